// Page-locked host memory (cudaHostAlloc) and device memory (cudaMalloc) behind the Allocator
// interface of runtime/allocator.h. Compiled only with SHARDLINE_WITH_CUDA; without CUDA the
// factories in runtime/allocator.cc return Unimplemented.

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "runtime/allocator.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace shardline {
namespace {

// Makes `device` current for the scope and restores the previous device afterwards, so an
// allocation on cuda:1 does not change the caller's current device.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = SL_CUDA_STATUS(cudaSetDevice(device));
  }
  ~ScopedDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

class PinnedAllocator final : public Allocator {
 public:
  explicit PinnedAllocator(std::string name) : Allocator(Device::Host(), std::move(name)) {}
  ~PinnedAllocator() override { DrainPending(); }

 protected:
  absl::StatusOr<void*> AllocateRaw(size_t bytes) override {
    void* data = nullptr;
    // Portable: pinned for every CUDA context, so any device's copies can use it directly.
    const cudaError_t e = cudaHostAlloc(&data, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the error so it does not surface in an unrelated call
      return SL_CUDA_STATUS(e);
    }
    return data;
  }
  void DeallocateRaw(void* data, size_t bytes) override {
    const cudaError_t e = cudaFreeHost(data);
    if (e != cudaSuccess) {
      SL_LOG(WARN, ALLOC) << "allocator '" << name() << "': cudaFreeHost of " << bytes
                          << " bytes failed: " << cudaGetErrorName(e) << " ("
                          << cudaGetErrorString(e) << ")";
    }
  }
};

class CudaAllocator final : public Allocator {
 public:
  CudaAllocator(int device, std::string name)
      : Allocator(Device::Cuda(device), std::move(name)), device_index_(device) {}
  ~CudaAllocator() override { DrainPending(); }

 protected:
  absl::StatusOr<void*> AllocateRaw(size_t bytes) override {
    ScopedDevice scoped(device_index_);
    SL_RETURN_IF_ERROR(scoped.status());
    void* data = nullptr;
    const cudaError_t e = cudaMalloc(&data, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return SL_CUDA_STATUS(e);
    }
    return data;
  }
  void DeallocateRaw(void* data, size_t bytes) override {
    ScopedDevice scoped(device_index_);
    const cudaError_t e = scoped.status().ok() ? cudaFree(data) : cudaErrorInvalidDevice;
    if (e != cudaSuccess) {
      SL_LOG(WARN, ALLOC) << "allocator '" << name() << "': cudaFree of " << bytes
                          << " bytes on cuda:" << device_index_
                          << " failed: " << cudaGetErrorName(e) << " (" << cudaGetErrorString(e)
                          << ")";
    }
  }

 private:
  int device_index_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Allocator>> CreatePinnedAllocator(std::string name) {
  int count = 0;
  const absl::Status s = SL_CUDA_STATUS(cudaGetDeviceCount(&count));
  if (!s.ok()) {
    return Annotate(s, absl::StrCat("CreatePinnedAllocator('", name, "')"));
  }
  return std::unique_ptr<Allocator>(std::make_unique<PinnedAllocator>(std::move(name)));
}

absl::StatusOr<std::unique_ptr<Allocator>> CreateCudaAllocator(int device_index, std::string name) {
  int count = 0;
  const absl::Status s = SL_CUDA_STATUS(cudaGetDeviceCount(&count));
  if (!s.ok()) {
    return Annotate(s, absl::StrCat("CreateCudaAllocator(cuda:", device_index, ")"));
  }
  if (device_index < 0 || device_index >= count) {
    return absl::UnavailableError(absl::StrCat("CreateCudaAllocator: no device cuda:", device_index,
                                               " (", count, " CUDA devices visible)"));
  }
  return std::unique_ptr<Allocator>(std::make_unique<CudaAllocator>(device_index, std::move(name)));
}

}  // namespace shardline
