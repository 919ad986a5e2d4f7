// File: runtime/allocator.h
// -----------------------------------------------------------------------------
// Memory with accounting. Every byte shardline holds comes from an Allocator, which keeps exact
// counters (current and peak bytes, live and total allocations) that callers read and reset:
// this is how the runtime reports per-pool memory and how tests prove the rate limiter's bound.
//
// A Buffer owns one allocation and returns it when destroyed. Memory that a stream may still be
// reading is returned with a guard: Buffer::ReleaseAfter(event) makes the allocator hold the
// block until the event completes (checked without blocking whenever the allocator is next
// used, or by Collect()). The block counts as allocated until then, so accounting never
// under-reports. No allocator ever synchronizes a device or sleeps to find out.
//
// Allocators:
//   HostAllocator      aligned host memory (default alignment 64 bytes); allocations of at least
//                      SHARDLINE_HOST_SHAREABLE_BYTES (1 MiB) are shareable memory that local
//                      peers map (runtime/shared_memory.h)
//   PinnedAllocator    page-locked host memory (cudaHostAlloc; CUDA builds)
//   CudaAllocator      device memory (cudaMalloc; CUDA builds)
//   CachingPool        wraps any of the above; reuses freed blocks of the same size class
//
// Thread safety: all methods may be called from any thread.

#ifndef SHARDLINE_RUNTIME_ALLOCATOR_H_
#define SHARDLINE_RUNTIME_ALLOCATOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace shardline {

struct MemoryStats {
  int64_t current_bytes = 0;      // bytes allocated and not yet returned
  int64_t peak_bytes = 0;         // max of current_bytes since creation or ResetPeak()
  int64_t live_allocations = 0;   // allocations not yet returned
  int64_t total_allocations = 0;  // allocations since creation or ResetStats()
  int64_t total_bytes = 0;        // bytes allocated since creation or ResetStats()
};

class Allocator;

// One allocation. Move-only; returns the memory to its allocator when destroyed.
class Buffer {
 public:
  Buffer() = default;
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
  Allocator* allocator() const { return allocator_; }

  // The memory may be reused only after `event` completes. May be called several times (for
  // several readers on different streams); every event must complete. Ignores nullptr.
  void ReleaseAfter(std::shared_ptr<Event> event);

  // Returns the memory now (guarded by the events given to ReleaseAfter); the buffer is empty.
  void Reset();

 private:
  friend class Allocator;
  Buffer(Allocator* allocator, void* data, size_t size)
      : allocator_(allocator), data_(data), size_(size) {}

  Allocator* allocator_ = nullptr;
  void* data_ = nullptr;
  size_t size_ = 0;
  std::vector<std::shared_ptr<Event>> guards_;
};

class Allocator {
 public:
  Allocator(Device device, std::string name);
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;
  // Blocks until guarded blocks are free (each guard bounded by SHARDLINE_TIMEOUT_S) and frees
  // them (implementations do this by calling DrainPending() in their destructors). Destroying an
  // allocator while Buffers from it are alive is a bug (checked).
  virtual ~Allocator();

  Device device() const { return device_; }
  const std::string& name() const { return name_; }

  // A zero-byte request returns an empty Buffer without touching the counters. ResourceExhausted
  // if the memory cannot be had, naming the allocator, the size and the current usage.
  absl::StatusOr<Buffer> Allocate(size_t bytes);

  MemoryStats stats() const;
  // peak_bytes := current_bytes.
  void ResetPeak();
  // peak := current, total_allocations := live_allocations, total_bytes := current_bytes.
  void ResetStats();

  // Frees the guarded blocks whose events have completed; returns how many were freed.
  int Collect();

 protected:
  // Implementations provide raw memory. `bytes` > 0. May be called from any thread, without the
  // allocator's lock held. A failure's Status is passed up with the allocator's name, the size
  // and the current usage added (keep its code: ResourceExhausted when memory ran out).
  virtual absl::StatusOr<void*> AllocateRaw(size_t bytes) = 0;
  // `bytes` is the size that was passed to AllocateRaw for `data`.
  virtual void DeallocateRaw(void* data, size_t bytes) = 0;

  // Blocks until every guarded block's events complete (each bounded by SHARDLINE_TIMEOUT_S) and
  // frees them through DeallocateRaw; a block whose guard times out is leaked (logged), never
  // freed under a possible reader. Every implementation calls this first thing in its
  // destructor: the base destructor runs after the derived part is gone and cannot call
  // DeallocateRaw.
  void DrainPending();

 private:
  friend class Buffer;
  struct Pending {
    void* data;
    size_t bytes;
    std::vector<std::shared_ptr<Event>> guards;
  };
  void Release(void* data, size_t bytes, std::vector<std::shared_ptr<Event>> guards);
  // Moves the pending blocks whose guards have all completed into `ready` (mu_ held); returns
  // how many. The caller frees them with FreeBlocks after dropping the lock.
  int CollectLocked(std::vector<Pending>& ready);
  // DeallocateRaw for each block, then updates the counters.
  void FreeBlocks(std::vector<Pending>& blocks);

  Device device_;
  std::string name_;
  mutable std::mutex mu_;
  MemoryStats stats_;
  std::vector<Pending> pending_;
};

// Aligned host memory. `alignment` must be a power of two (checked).
std::unique_ptr<Allocator> CreateHostAllocator(size_t alignment = 64, std::string name = "host");

// Page-locked host memory and CUDA device memory. Unimplemented without CUDA.
absl::StatusOr<std::unique_ptr<Allocator>> CreatePinnedAllocator(std::string name = "pinned");
absl::StatusOr<std::unique_ptr<Allocator>> CreateCudaAllocator(int device_index,
                                                               std::string name = "cuda");

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_ALLOCATOR_H_
