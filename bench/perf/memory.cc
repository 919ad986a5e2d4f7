#include "bench/perf/memory.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"

#if SHARDLINE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace shardline::perf {

absl::StatusOr<std::unique_ptr<Memory>> Memory::Create(const Communicator& comm) {
  const Device device = comm.device();
  auto memory = std::unique_ptr<Memory>(new Memory(device));
  if (device.is_host()) {
    // The memory the communicator moves fastest (ucx: shareable, mapped by the local peers).
    memory->allocator_ = comm.CreateHostAllocatorForTransfers(4096, "perf");
  } else {
    SL_ASSIGN_OR_RETURN(memory->allocator_, CreateCudaAllocator(device.index(), "perf"));
  }
  return memory;
}

absl::StatusOr<Buffer> Memory::Allocate(size_t bytes) {
  return allocator_->Allocate(std::max<size_t>(bytes, 64));
}

absl::Status Memory::Write(void* dst, size_t bytes, const std::function<void(void*)>& fill) {
  if (device_.is_host()) {
    fill(dst);
    return absl::OkStatus();
  }
  staging_.resize(bytes);
  fill(staging_.data());
  return CopyToDevice(dst, staging_.data(), bytes);
}

absl::Status Memory::Read(const void* src, size_t bytes,
                          const std::function<void(const void*)>& use) {
  if (device_.is_host()) {
    use(src);
    return absl::OkStatus();
  }
  staging_.resize(bytes);
  SL_RETURN_IF_ERROR(CopyToHost(staging_.data(), src, bytes));
  use(staging_.data());
  return absl::OkStatus();
}

absl::Status Memory::CopyToDevice(void* dst, const void* src, size_t bytes) {
#if SHARDLINE_WITH_CUDA
  const cudaError_t err = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaMemcpy to device: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
#else
  return absl::UnimplementedError("device memory needs a CUDA build");
#endif
}

absl::Status Memory::CopyToHost(void* dst, const void* src, size_t bytes) {
#if SHARDLINE_WITH_CUDA
  const cudaError_t err = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaMemcpy to host: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
#else
  return absl::UnimplementedError("device memory needs a CUDA build");
#endif
}

}  // namespace shardline::perf
