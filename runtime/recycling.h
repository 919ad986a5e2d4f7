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
  // A free block, or null.
  void* Take();
  // false: the list is full; the caller frees the block.
  bool Give(void* block);

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
      if (void* block = recycling_internal::ListOf<T>().Take()) return static_cast<T*>(block);
    }
    return std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, size_t n) noexcept {
    if (recycling_internal::kRecycle && n == 1 && recycling_internal::ListOf<T>().Give(p)) return;
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
