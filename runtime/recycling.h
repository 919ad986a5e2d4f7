// File: runtime/recycling.h
// -----------------------------------------------------------------------------
// Free lists for the small objects that the hot paths make on one thread and drop on another at
// every hook: host events (with their shared_ptr control blocks), collective launches, the
// arguments of host stream ops. Their blocks go back to a free list shared by all threads
// instead of to malloc, whose per-thread caches take the slow path on both sides when one thread
// allocates what another frees. Each list holds at most kMaxBlocks blocks; the rest go back to
// malloc.
//
//   RecyclingAllocator<T>  a standard allocator (std::allocate_shared, containers of one
//                          element at a time: only single-object allocations are recycled)
//   MakeRecycled<T>(args)  a std::unique_ptr<T> whose block is recycled: one pointer, so that a
//                          closure capturing it fits an AnyInvocable's inline storage
//
// Under AddressSanitizer nothing is recycled, so that it sees every object's lifetime.
//
// Thread safety: all functions may be called from any thread. The lists are never destroyed
// (objects may be released during static destruction).

#ifndef SHARDLINE_RUNTIME_RECYCLING_H_
#define SHARDLINE_RUNTIME_RECYCLING_H_

#include <cstddef>
#include <memory>
#include <mutex>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace shardline {
namespace recycling_internal {

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kRecycle = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kRecycle = false;
#else
inline constexpr bool kRecycle = true;
#endif
#else
inline constexpr bool kRecycle = true;
#endif

// Free blocks of one size, shared by all threads.
class BlockList {
 public:
  static constexpr size_t kMaxBlocks = 1024;
  BlockList() { blocks_.reserve(kMaxBlocks); }
  // Moves up to `n` free blocks into `out`; returns how many.
  size_t TakeMany(void** out, size_t n);
  // Takes as many of the `n` blocks at `blocks` as fit; returns how many (the first ones). The
  // caller frees the rest.
  size_t GiveMany(void* const* blocks, size_t n);

 private:
  std::mutex mu_;
  std::vector<void*> blocks_;  // guarded by mu_
};

// The list of T's blocks.
template <typename T>
BlockList& ListOf() {
  static BlockList* const list = new BlockList;
  return *list;
}

// Each thread keeps a few free blocks of each type in front of the shared list, and moves them to
// and from it in batches: the hooks make and drop several objects of a type per call, and a lock
// of the shared list per object (a cache-line transfer whenever another thread used it last) cost
// more than the object. Trivially destructible, so a block freed during the thread's exit, after
// CacheFlusher ran, still has somewhere to go (the shared list).
inline constexpr size_t kThreadCacheBlocks = 32;
struct ThreadCache {
  void* blocks[kThreadCacheBlocks];
  size_t size;
  bool flusher_armed;  // CacheFlusher constructed for this thread
  bool closed;         // the thread is exiting: bypass the cache
};

// Returns a thread's cached blocks of T to the shared list when the thread exits.
template <typename T>
struct CacheFlusher;

template <typename T>
ThreadCache& CacheOf() {
  static thread_local constinit ThreadCache cache{};
  return cache;
}

template <typename T>
void FreeBlocks(void* const* blocks, size_t n) {
  for (size_t i = 0; i < n; ++i) std::allocator<T>().deallocate(static_cast<T*>(blocks[i]), 1);
}

template <typename T>
struct CacheFlusher {
  ~CacheFlusher() {
    ThreadCache& cache = CacheOf<T>();
    cache.closed = true;
    const size_t given = ListOf<T>().GiveMany(cache.blocks, cache.size);
    FreeBlocks<T>(cache.blocks + given, cache.size - given);
    cache.size = 0;
  }
};

template <typename T>
void ArmFlusher(ThreadCache& cache) {
  if (cache.flusher_armed) return;
  cache.flusher_armed = true;
  static thread_local CacheFlusher<T> flusher;
  (void)flusher;
}

// A free block of T, or null.
template <typename T>
void* TakeBlock() {
  ThreadCache& cache = CacheOf<T>();
  if (cache.size == 0) {
    if (cache.closed) return ListOf<T>().TakeMany(cache.blocks, 1) == 1 ? cache.blocks[0] : nullptr;
    ArmFlusher<T>(cache);
    cache.size = ListOf<T>().TakeMany(cache.blocks, kThreadCacheBlocks / 2);
    if (cache.size == 0) return nullptr;
  }
  return cache.blocks[--cache.size];
}

// Keeps `block` (of T) for reuse, or frees it.
template <typename T>
void GiveBlock(void* block) {
  ThreadCache& cache = CacheOf<T>();
  if (cache.closed) {
    if (ListOf<T>().GiveMany(&block, 1) == 0) FreeBlocks<T>(&block, 1);
    return;
  }
  if (cache.size == kThreadCacheBlocks) {
    // Half to the shared list: the thread keeps room to free more and blocks to take.
    constexpr size_t kHalf = kThreadCacheBlocks / 2;
    const size_t given = ListOf<T>().GiveMany(cache.blocks + kHalf, kHalf);
    FreeBlocks<T>(cache.blocks + kHalf + given, kHalf - given);
    cache.size = kHalf;
  }
  ArmFlusher<T>(cache);
  cache.blocks[cache.size++] = block;
}

}  // namespace recycling_internal

template <typename T>
class RecyclingAllocator {
 public:
  using value_type = T;
  RecyclingAllocator() = default;
  template <typename U>
  RecyclingAllocator(const RecyclingAllocator<U>&) noexcept {}  // NOLINT: rebinding
  T* allocate(size_t n) {
    if (recycling_internal::kRecycle && n == 1) {
      if (void* block = recycling_internal::TakeBlock<T>()) return static_cast<T*>(block);
    }
    return std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, size_t n) noexcept {
    if (recycling_internal::kRecycle && n == 1) return recycling_internal::GiveBlock<T>(p);
    std::allocator<T>().deallocate(p, n);
  }
  template <typename U>
  bool operator==(const RecyclingAllocator<U>&) const noexcept {
    return true;
  }
};

template <typename T>
struct RecycledDelete {
  void operator()(T* p) const noexcept {
    p->~T();
    RecyclingAllocator<T>().deallocate(p, 1);
  }
};
template <typename T>
using Recycled = std::unique_ptr<T, RecycledDelete<T>>;

// For types whose construction cannot throw (small argument structs).
template <typename T, typename... Args>
Recycled<T> MakeRecycled(Args&&... args) {
  static_assert(std::is_nothrow_constructible_v<T, Args&&...>);
  return Recycled<T>(new (RecyclingAllocator<T>().allocate(1)) T(std::forward<Args>(args)...));
}

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_RECYCLING_H_
