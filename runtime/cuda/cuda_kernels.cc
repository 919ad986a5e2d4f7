// absl::Status wrappers of the launch functions in cuda_kernels.cu: argument validation happens
// here, in g++-compiled code, so the .cu file never sees abseil.

#include "runtime/cuda/cuda_kernels.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/cuda_kernels_launch.h"
#include "runtime/host_kernels.h"
#include "runtime/status.h"

namespace shardline {
namespace {

namespace ci = cuda_internal;

static_assert(
    static_cast<int>(DType::kF32) == ci::kKF32 && static_cast<int>(DType::kF64) == ci::kKF64 &&
    static_cast<int>(DType::kF16) == ci::kKF16 && static_cast<int>(DType::kBF16) == ci::kKBF16 &&
    static_cast<int>(DType::kI8) == ci::kKI8 && static_cast<int>(DType::kU8) == ci::kKU8 &&
    static_cast<int>(DType::kI32) == ci::kKI32 && static_cast<int>(DType::kI64) == ci::kKI64);
static_assert(static_cast<int>(ReduceOp::kSum) == ci::kKSum &&
              static_cast<int>(ReduceOp::kAvg) == ci::kKAvg &&
              static_cast<int>(ReduceOp::kMin) == ci::kKMin &&
              static_cast<int>(ReduceOp::kMax) == ci::kKMax &&
              static_cast<int>(ReduceOp::kProduct) == ci::kKProduct);
static_assert(kCudaMaxReduceInputs == ci::kMaxReduceInputs);

bool ValidDType(DType dtype) { return static_cast<int>(dtype) <= ci::kKI64; }
bool ValidOp(ReduceOp op) { return static_cast<int>(op) <= ci::kKProduct; }

absl::Status CheckPointer(absl::string_view fn, absl::string_view arg, const void* p, DType dtype) {
  if (p == nullptr) return absl::InvalidArgumentError(absl::StrCat(fn, ": ", arg, " is null"));
  if (reinterpret_cast<uintptr_t>(p) % DTypeSize(dtype) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        fn, ": ", arg, " (0x", absl::Hex(reinterpret_cast<uintptr_t>(p)),
        ") is not aligned to its element size ", DTypeSize(dtype), " (", DTypeName(dtype), ")"));
  }
  return absl::OkStatus();
}

absl::Status LaunchStatus(int error, absl::string_view what) {
  if (error == 0) return absl::OkStatus();
  const auto e = static_cast<cudaError_t>(error);
  return absl::Status(cuda_internal::CudaErrorCode(e),
                      absl::StrCat(what, ": kernel launch failed: ", cudaGetErrorName(e), " (",
                                   cudaGetErrorString(e), ")"));
}

}  // namespace

absl::Status CudaCast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t count,
                      void* stream) {
  if (!IsFloatingPoint(src_dtype) || !IsFloatingPoint(dst_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaCast: unsupported dtype pair ", DTypeName(src_dtype), " -> ",
                     DTypeName(dst_dtype), " (only f32, f64, f16, bf16 are supported)"));
  }
  if (count == 0) return absl::OkStatus();
  SL_RETURN_IF_ERROR(CheckPointer("CudaCast", "src", src, src_dtype));
  SL_RETURN_IF_ERROR(CheckPointer("CudaCast", "dst", dst, dst_dtype));
  const std::string what = absl::StrCat("CudaCast(", DTypeName(src_dtype), " -> ",
                                        DTypeName(dst_dtype), ", count=", count, ")");
  if (src_dtype == dst_dtype) {
    if (src == dst) return absl::OkStatus();
    return Annotate(
        SL_CUDA_STATUS(cudaMemcpyAsync(dst, src, count * DTypeSize(src_dtype), cudaMemcpyDefault,
                                       static_cast<cudaStream_t>(stream))),
        what);
  }
  return LaunchStatus(ci::LaunchCast(src, static_cast<int>(src_dtype), dst,
                                     static_cast<int>(dst_dtype), count, stream),
                      what);
}

absl::Status CudaReduceMany(void* out, const void* const* inputs, int num_inputs, size_t count,
                            DType dtype, ReduceOp op, void* stream) {
  if (num_inputs < 1 || num_inputs > kCudaMaxReduceInputs) {
    return absl::InvalidArgumentError(absl::StrCat("CudaReduceMany: num_inputs must be in [1, ",
                                                   kCudaMaxReduceInputs, "], got ", num_inputs));
  }
  if (!ValidDType(dtype) || !ValidOp(op)) {
    return absl::InvalidArgumentError(absl::StrCat("CudaReduceMany: invalid dtype ",
                                                   static_cast<int>(dtype), " or op ",
                                                   static_cast<int>(op)));
  }
  if (count == 0) return absl::OkStatus();
  SL_RETURN_IF_ERROR(CheckPointer("CudaReduceMany", "out", out, dtype));
  if (inputs == nullptr) return absl::InvalidArgumentError("CudaReduceMany: inputs is null");
  for (int k = 0; k < num_inputs; ++k) {
    SL_RETURN_IF_ERROR(
        CheckPointer("CudaReduceMany", absl::StrCat("inputs[", k, "]"), inputs[k], dtype));
  }
  return LaunchStatus(ci::LaunchReduceMany(out, inputs, num_inputs, count, static_cast<int>(dtype),
                                           static_cast<int>(op), stream),
                      absl::StrCat("CudaReduceMany(", DTypeName(dtype), ", ", ReduceOpName(op),
                                   ", inputs=", num_inputs, ", count=", count, ")"));
}

absl::Status CudaReduce(void* inout, const void* in, size_t count, DType dtype, ReduceOp op,
                        void* stream) {
  const void* inputs[2] = {inout, in};
  return CudaReduceMany(inout, inputs, 2, count, dtype, op, stream);
}

absl::Status CudaScale(void* inout, size_t count, DType dtype, double factor, void* stream) {
  if (!std::isfinite(factor)) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaScale: factor must be finite, got ", factor));
  }
  if (!ValidDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaScale: invalid dtype ", static_cast<int>(dtype)));
  }
  if (count == 0) return absl::OkStatus();
  SL_RETURN_IF_ERROR(CheckPointer("CudaScale", "inout", inout, dtype));
  // Same integer rule as the host Scale: exact division when factor is 1/n.
  const int64_t divisor = ExactDivisor(factor);
  return LaunchStatus(
      ci::LaunchScale(inout, count, static_cast<int>(dtype), factor, divisor, stream),
      absl::StrCat("CudaScale(", DTypeName(dtype), ", count=", count, ")"));
}

absl::Status CudaSumSquares(const void* data, size_t count, DType dtype, double* sums,
                            void* stream) {
  static_assert(kCudaSumSquaresDoubles == 1 + ci::kSumSquaresBlocks);
  if (!IsFloatingPoint(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("CudaSumSquares: dtype ", DTypeName(dtype),
                                                   " is not supported (f32, f64, f16, bf16)"));
  }
  if (count == 0) return absl::OkStatus();
  SL_RETURN_IF_ERROR(CheckPointer("CudaSumSquares", "data", data, dtype));
  SL_RETURN_IF_ERROR(CheckPointer("CudaSumSquares", "sums", sums, DType::kF64));
  return LaunchStatus(ci::LaunchSumSquares(data, count, static_cast<int>(dtype), sums, stream),
                      absl::StrCat("CudaSumSquares(", DTypeName(dtype), ", count=", count, ")"));
}

}  // namespace shardline
