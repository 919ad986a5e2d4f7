// File: runtime/allocator.h
// -----------------------------------------------------------------------------
// Memory with accounting. Allocators keep exact counters (current and peak bytes, live and total
// allocations) that callers read and reset: this is how the runtime reports per-pool memory and
// how tests prove a memory bound. (Not every byte shardline touches comes from an Allocator: the
// UCX backend's staging and scratch and the local backend's all-reduce scratch do not.)
//
// A Buffer owns one allocation and returns it when destroyed. Memory that a stream may still be
// reading is returned with guards: Buffer::ReleaseAfter(event) makes the allocator hold the
// block until every guard event has COMPLETED — reported through Event::OnComplete, which fires
// only once the device is done with the captured work, whether it succeeded or failed. A guard
// whose Query() already reports a failure while its work still runs (a CUDA stream poisoned by a
// host function, with kernels in flight) keeps the block. Completed blocks are returned to the
// implementation by the next Allocate() or Collect() on any thread. The block counts as
// allocated until then, so accounting never under-reports.
//
// Stream-ordered reuse: Allocate(bytes, first_user) tells the allocator which stream will use
// the memory first. A CachingPool may then hand out a block whose guards are still pending,
// after making `first_user` wait for them (guards recorded on `first_user` itself need no wait:
// stream order covers them) — the host never blocks to reuse memory, as with cudaFreeAsync. If
// a guard's work fails, `first_user` is poisoned with that failure (the memory's previous user
// failed). Plain allocators ignore the stream.
//
// Allocators:
//   HostAllocator      aligned private host memory (default alignment 64 bytes): malloc'd,
//                      copy-on-write across fork() as usual
//   shareable HostAllocator (CreateShareableHostAllocator) the same, except that allocations of
//                      at least SHARDLINE_HOST_SHAREABLE_BYTES (1 MiB) are blocks of the
//                      shareable arenas that local peers map (runtime/shared_memory.h): what
//                      a ucx communicator hands out for the memory it moves
//                      (Communicator::CreateHostAllocatorForTransfers). Freeing such a block
//                      returns its pages to the kernel at once, even while peers map them
//   PinnedAllocator    page-locked host memory (cudaHostAlloc; CUDA builds)
//   CudaAllocator      device memory from the device's stream-ordered memory pool
//                      (cudaMallocAsync/cudaFreeAsync; CUDA builds): neither call synchronizes
//                      the device, and the pool keeps freed memory (release threshold: all)
//   CachingPool        wraps any of the above; reuses freed blocks of the same size class
// No allocator synchronizes a device, except PinnedAllocator's cudaFreeHost (pinned memory is
// for staging buffers allocated once, not for the hot path).
//
// Thread safety: all methods may be called from any thread.

#ifndef SHARDLINE_RUNTIME_ALLOCATOR_H_
#define SHARDLINE_RUNTIME_ALLOCATOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace shardline {

struct MemoryStats {
  int64_t current_bytes = 0;      // bytes allocated and not yet returned
  int64_t peak_bytes = 0;         // max of current_bytes since creation or ResetPeak()
  int64_t live_allocations = 0;   // allocations not yet returned
  int64_t total_allocations = 0;  // allocations since creation or ResetStats()
  int64_t total_bytes = 0;        // bytes allocated since creation or ResetStats()
  // Allocations served by a block whose guards were still pending, after a stream wait
  // (Allocate(bytes, first_user); since creation or ResetStats()).
  int64_t stream_ordered_reuses = 0;
  // Blocks given up for good (since creation): guarded blocks whose readers had not finished
  // when the allocator was destroyed (DrainPending), and Buffers leaked with Buffer::Leak. A
  // leaked block is never freed (a stream may still use it) and no longer counts as allocated.
  int64_t leaked_blocks = 0;
  int64_t leaked_bytes = 0;
};

class Allocator;

// One allocation. Move-only; returns the memory to its allocator when destroyed. A Buffer may
// also hold memory that is not an allocator's: a framework's tensor, adopted with a release
// function (Adopt) or only viewed (View).
class Buffer {
 public:
  using ReleaseFn = absl::AnyInvocable<void(void* data) &&>;

  Buffer() = default;
  // Memory the caller allocated: `release(data)` runs once the buffer is reset (or destroyed)
  // and every guard given to ReleaseAfter has completed — in Reset() if none is pending, else on
  // the thread that completes the last guard (a stream's worker, a CUDA callback thread: it must
  // be short and must not call CUDA). A null `release` makes a view.
  static Buffer Adopt(void* data, size_t size, Device device, ReleaseFn release);
  // Memory the caller keeps alive for as long as the buffer and every work enqueued on it: the
  // buffer frees nothing.
  static Buffer View(void* data, size_t size, Device device);

  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  Device device() const;
  // The allocator the memory came from; null for adopted memory and views.
  Allocator* allocator() const { return allocator_; }

  // The memory may be reused only after `event` completes. May be called several times (for
  // several readers on different streams); every event must complete. Ignores nullptr.
  void ReleaseAfter(std::shared_ptr<Event> event);
  // The guards given so far.
  absl::Span<const std::shared_ptr<Event>> guards() const { return guards_; }

  // Returns the memory now (guarded by the events given to ReleaseAfter); the buffer is empty.
  void Reset();
  // Gives the memory up without returning it, for memory a stream may still use when its owner
  // goes away: it is never freed, and its allocator counts it as leaked (MemoryStats), not as
  // allocated. Adopted memory's release function never runs. The buffer is empty.
  void Leak();

 private:
  friend class Allocator;
  Buffer(Allocator* allocator, void* data, size_t size)
      : allocator_(allocator), data_(data), size_(size) {}

  Allocator* allocator_ = nullptr;
  void* data_ = nullptr;
  size_t size_ = 0;
  // Inline: a buffer is typically released after a handful of readers.
  absl::InlinedVector<std::shared_ptr<Event>, 4> guards_;
  Device device_ = Device::Host();  // adopted memory and views
  ReleaseFn release_;               // adopted memory
};

class Allocator {
 public:
  Allocator(Device device, std::string name);
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;
  // Blocks until guarded blocks are free (at most until one SHARDLINE_TIMEOUT_S deadline for
  // all of them) and frees them (implementations do this by calling DrainPending() in their
  // destructors). Destroying an allocator while Buffers from it are alive is a bug (checked).
  virtual ~Allocator();

  Device device() const { return device_; }
  const std::string& name() const { return name_; }

  // A zero-byte request returns an empty Buffer without touching the counters. ResourceExhausted
  // if the memory cannot be had, naming the allocator, the size and the current usage.
  absl::StatusOr<Buffer> Allocate(size_t bytes);
  // The same, for memory whose first user is work enqueued on `first_user` from now on: the
  // allocator may hand out memory that is still in use by earlier work after making
  // `first_user` wait for it (stream-ordered reuse, see the top of this file).
  absl::StatusOr<Buffer> Allocate(size_t bytes, Stream& first_user);

  MemoryStats stats() const;
  // peak_bytes := current_bytes.
  void ResetPeak();
  // peak := current, total_allocations := live_allocations, total_bytes := current_bytes.
  void ResetStats();

  // Frees the guarded blocks whose events have completed; returns how many were freed.
  int Collect();

  // Guarded blocks not yet freed (their guards have not all completed, or nobody collected
  // them yet).
  int64_t pending_blocks() const;

 protected:
  // Implementations provide raw memory. `bytes` > 0. `first_user` is the stream of Allocate's
  // second form, else null. May be called from any thread, without the allocator's lock held. A
  // failure's Status is passed up with the allocator's name, the size and the current usage
  // added (keep its code: ResourceExhausted when memory ran out).
  virtual absl::StatusOr<void*> AllocateRaw(size_t bytes, Stream* first_user) = 0;
  // `bytes` is the size that was passed to AllocateRaw for `data`. Called once the block's
  // guards completed, from a thread that called Allocate, Collect, a Buffer's release or
  // DrainPending (never from a stream's callback).
  virtual void DeallocateRaw(void* data, size_t bytes) = 0;

  // A guarded block that is still pending, taken out of the pending set for stream-ordered
  // reuse (TakePending): its memory, size, and the guards that have not completed yet.
  struct PendingBlock {
    void* data = nullptr;
    size_t bytes = 0;
    absl::InlinedVector<std::shared_ptr<Event>, 4> outstanding;
  };
  // Removes and returns a pending block for which `fits(block_bytes)` holds (the oldest such),
  // or nullopt. The block stops counting as allocated (the caller hands it out again through
  // AllocateRaw, which counts it anew) and must go back with ReturnPending or be handed out.
  std::optional<PendingBlock> TakePending(absl::FunctionRef<bool(size_t)> fits);
  // Puts a block from TakePending back into the pending set, with its outstanding guards.
  void ReturnPending(PendingBlock block);

  // Synchronizes every guarded block's events (at most until one SHARDLINE_TIMEOUT_S deadline
  // for all of them; virtual-time events by driving their timeline, a stalled one at once) and
  // frees the blocks through DeallocateRaw; a block whose guards have not completed by then is
  // leaked (logged, counted in MemoryStats::leaked_*, handed to LeakRaw), never freed under a
  // possible reader. Every implementation calls this first thing in its destructor: the base
  // destructor runs after the derived part is gone and cannot call DeallocateRaw.
  void DrainPending();
  // A block that DrainPending leaks: it will never come back through DeallocateRaw. An
  // implementation that keeps track of its blocks (a pool) forgets it here; the default does
  // nothing.
  virtual void LeakRaw(void* data, size_t bytes) {}

 private:
  friend class Buffer;
  // The pending blocks. The guards' completion callbacks keep it alive (they may run after the
  // allocator is gone: they then only update this set); the deleter only gives the allocator's
  // hold up.
  struct PendingSet;
  struct PendingSetDeleter {
    void operator()(PendingSet* set) const;
  };
  struct Freed {
    void* data;
    size_t bytes;
  };
  absl::StatusOr<Buffer> AllocateImpl(size_t bytes, Stream* first_user);
  // Returns the memory once every non-null event of `guards` has completed. Copies the events:
  // `guards` is the caller's to clear.
  void Release(void* data, size_t bytes, absl::Span<const std::shared_ptr<Event>> guards);
  // DeallocateRaw for each block, then updates the counters.
  void FreeBlocks(absl::Span<const Freed> blocks);
  // Buffer::Leak: the block no longer counts as allocated; it counts as leaked.
  void CountLeaked(size_t bytes);

  Device device_;
  std::string name_;
  mutable std::mutex mu_;
  MemoryStats stats_;
  std::unique_ptr<PendingSet, PendingSetDeleter> pending_;
};

// Aligned private host memory. `alignment` must be a power of two (checked).
std::unique_ptr<Allocator> CreateHostAllocator(size_t alignment = 64, std::string name = "host");
// Aligned host memory of which allocations of at least SHARDLINE_HOST_SHAREABLE_BYTES are
// shareable (runtime/shared_memory.h); smaller ones, and every one if `alignment` exceeds a page
// or no arena can be had (one INFO line), are private. Shared with forked children, unlike
// CreateHostAllocator's.
std::unique_ptr<Allocator> CreateShareableHostAllocator(size_t alignment = 64,
                                                        std::string name = "shareable");

// Page-locked host memory and CUDA device memory. Unimplemented without CUDA.
absl::StatusOr<std::unique_ptr<Allocator>> CreatePinnedAllocator(std::string name = "pinned");
absl::StatusOr<std::unique_ptr<Allocator>> CreateCudaAllocator(int device_index,
                                                               std::string name = "cuda");

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_ALLOCATOR_H_
