// File: runtime/cuda/cuda_check.h
// -----------------------------------------------------------------------------
// Turns a cudaError_t into an absl::Status that names the call, the file and the line:
//
//   SL_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
//   absl::Status status = SL_CUDA_STATUS(cudaEventQuery(event));
//
// gives "cudaEventQuery(event) failed at runtime/cuda/cuda_event.cc:42: cudaErrorInvalidValue
// (invalid argument)". Codes: Unavailable when there is no usable device or driver,
// ResourceExhausted when memory runs out, Internal for everything else.
//
// Only for code compiled with SHARDLINE_WITH_CUDA (it includes <cuda_runtime.h>).

#ifndef SHARDLINE_RUNTIME_CUDA_CUDA_CHECK_H_
#define SHARDLINE_RUNTIME_CUDA_CUDA_CHECK_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace shardline::cuda_internal {

inline absl::StatusCode CudaErrorCode(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return absl::StatusCode::kOk;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
      return absl::StatusCode::kUnavailable;
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    default:
      return absl::StatusCode::kInternal;
  }
}

// OK for cudaSuccess; otherwise the error, naming `call`, `file` and `line`.
inline absl::Status CudaStatus(cudaError_t error, const char* call, const char* file, int line) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::Status(CudaErrorCode(error),
                      absl::StrCat(call, " failed at ", file, ":", line, ": ",
                                   cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
}

}  // namespace shardline::cuda_internal

// The absl::Status of a CUDA runtime call.
#define SL_CUDA_STATUS(expr) \
  ::shardline::cuda_internal::CudaStatus((expr), #expr, __FILE__, __LINE__)

// Returns the Status of a failed CUDA runtime call from the current function.
#define SL_CUDA_RETURN_IF_ERROR(expr)                                                           \
  do {                                                                                          \
    const cudaError_t sl_cuda_error_ = (expr);                                                  \
    if (ABSL_PREDICT_FALSE(sl_cuda_error_ != cudaSuccess)) {                                    \
      return ::shardline::cuda_internal::CudaStatus(sl_cuda_error_, #expr, __FILE__, __LINE__); \
    }                                                                                           \
  } while (0)

#endif  // SHARDLINE_RUNTIME_CUDA_CUDA_CHECK_H_
