// Page-locked host memory (cudaHostAlloc) and device memory (cudaMalloc) behind the Allocator
// interface of runtime/allocator.h. Compiled only with SHARDLINE_WITH_CUDA; without CUDA the
// factories in runtime/allocator.cc return Unimplemented.

#include <cuda_runtime.h>

#include <cstdint>
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
  absl::StatusOr<void*> AllocateRaw(size_t bytes, Stream* /*first_user*/) override {
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

// Device memory from the device's default stream-ordered pool. An allocation for a stream is
// made in that stream's order (cudaMallocAsync on it): usable at once by its work, and by other
// streams' work ordered after it by events, as every hand-over is. Without a stream it is made on
// an internal stream that is synchronized (it carries only allocations and frees, so this waits
// for no kernel). Frees (after the block's guards completed) go to the internal stream. The pool
// keeps freed memory (release threshold: everything), so steady state calls neither cudaMalloc
// nor cudaFree, and no call here synchronizes the device.
class CudaAllocator final : public Allocator {
 public:
  CudaAllocator(int device, std::string name, cudaStream_t internal)
      : Allocator(Device::Cuda(device), std::move(name)),
        device_index_(device),
        internal_(internal) {}
  ~CudaAllocator() override {
    DrainPending();
    ScopedDevice scoped(device_index_);
    (void)cudaStreamSynchronize(internal_);
    (void)cudaStreamDestroy(internal_);
  }

 protected:
  absl::StatusOr<void*> AllocateRaw(size_t bytes, Stream* first_user) override {
    ScopedDevice scoped(device_index_);
    SL_RETURN_IF_ERROR(scoped.status());
    const bool on_user = first_user != nullptr && first_user->device() == device();
    const auto stream =
        on_user ? static_cast<cudaStream_t>(first_user->native_handle()) : internal_;
    void* data = nullptr;
    cudaError_t e = cudaMallocAsync(&data, bytes, stream);
    if (e == cudaSuccess && !on_user) e = cudaStreamSynchronize(internal_);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return SL_CUDA_STATUS(e);
    }
    return data;
  }
  void DeallocateRaw(void* data, size_t bytes) override {
    ScopedDevice scoped(device_index_);
    const cudaError_t e =
        scoped.status().ok() ? cudaFreeAsync(data, internal_) : cudaErrorInvalidDevice;
    if (e != cudaSuccess) {
      SL_LOG(WARN, ALLOC) << "allocator '" << name() << "': cudaFreeAsync of " << bytes
                          << " bytes on cuda:" << device_index_
                          << " failed: " << cudaGetErrorName(e) << " (" << cudaGetErrorString(e)
                          << ")";
    }
  }

 private:
  const int device_index_;
  const cudaStream_t internal_;
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
  ScopedDevice scoped(device_index);
  SL_RETURN_IF_ERROR(scoped.status());
  // Keep what the pool frees: without this the driver may return memory to the OS at the next
  // synchronization, and the allocation after it pays for cudaMalloc again.
  cudaMemPool_t pool = nullptr;
  SL_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, device_index));
  uint64_t keep_all = UINT64_MAX;
  SL_CUDA_RETURN_IF_ERROR(
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all));
  cudaStream_t internal = nullptr;
  SL_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&internal, cudaStreamNonBlocking));
  return std::unique_ptr<Allocator>(
      std::make_unique<CudaAllocator>(device_index, std::move(name), internal));
}

}  // namespace shardline
