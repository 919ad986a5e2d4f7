// File: bench/perf/memory.h
// -----------------------------------------------------------------------------
// The perf binaries' buffers: host memory from the communicator's host allocator for transfers
// (ucx: shareable memory that the local peers map), or device memory from a CUDA allocator. Inputs
// are written and outputs read through host views; on a device that is a staging copy (cudaMemcpy),
// outside the timed region.

#ifndef SHARDLINE_BENCH_PERF_MEMORY_H_
#define SHARDLINE_BENCH_PERF_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "runtime/allocator.h"
#include "runtime/device.h"

namespace shardline::perf {

class Memory {
 public:
  // Memory on `comm`'s device. Unimplemented for a device in a build without CUDA.
  static absl::StatusOr<std::unique_ptr<Memory>> Create(const Communicator& comm);

  // A buffer of at least `bytes` (64 at least, so that empty sizes still get an address).
  absl::StatusOr<Buffer> Allocate(size_t bytes);

  // Runs `fill` on host memory of `bytes` that then lands at `dst`.
  absl::Status Write(void* dst, size_t bytes, const std::function<void(void*)>& fill);

  // Runs `use` on a host view of `bytes` at `src`.
  absl::Status Read(const void* src, size_t bytes, const std::function<void(const void*)>& use);

 private:
  explicit Memory(Device device) : device_(device) {}

  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes);
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes);

  Device device_;
  std::unique_ptr<Allocator> allocator_;
  std::vector<uint8_t> staging_;
};

}  // namespace shardline::perf

#endif  // SHARDLINE_BENCH_PERF_MEMORY_H_
