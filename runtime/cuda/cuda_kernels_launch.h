// File: runtime/cuda/cuda_kernels_launch.h
// -----------------------------------------------------------------------------
// Internal to runtime/cuda/: the C-style launch functions that cuda_kernels.cu defines and
// cuda_kernels.cc wraps into the absl::Status API of cuda_kernels.h. Nothing here includes abseil
// or dtype.h, so that nvcc never has to parse them. Arguments are validated by the caller; each
// function enqueues one kernel on `stream` (a cudaStream_t) and returns cudaGetLastError() as an
// int (0 = cudaSuccess). Callers use cuda_kernels.h instead.

#ifndef SHARDLINE_RUNTIME_CUDA_CUDA_KERNELS_LAUNCH_H_
#define SHARDLINE_RUNTIME_CUDA_CUDA_KERNELS_LAUNCH_H_

#include <cstddef>
#include <cstdint>

namespace shardline::cuda_internal {

// Mirrors of DType and ReduceOp (cuda_kernels.cc static_asserts that they agree).
enum KernelDType : int { kKF32 = 0, kKF64, kKF16, kKBF16, kKI8, kKU8, kKI32, kKI64 };
enum KernelOp : int { kKSum = 0, kKAvg, kKMin, kKMax, kKProduct };

// The most inputs ReduceMany takes in one launch (their pointers travel as a kernel argument).
inline constexpr int kMaxReduceInputs = 64;

int LaunchCast(const void* src, int src_dtype, void* dst, int dst_dtype, size_t count,
               void* stream);
// out[i] = op(inputs[0][i], ..., inputs[num_inputs-1][i]); inputs is a host array of device
// pointers, 1 <= num_inputs <= kMaxReduceInputs.
int LaunchReduceMany(void* out, const void* const* inputs, int num_inputs, size_t count, int dtype,
                     int op, void* stream);
// Floating dtypes: x *= float(factor) (f64: factor). Integers: divisor > 0 ? x / divisor :
// saturate(trunc(x * factor)).
int LaunchScale(void* inout, size_t count, int dtype, double factor, int64_t divisor, void* stream);

// Blocks of the sum-of-squares kernel: each writes one partial sum to sums[1 + block].
inline constexpr int kSumSquaresBlocks = 256;
// sums[0] += the sum of squares of data[0..count) (floating dtypes), in double; sums has
// 1 + kSumSquaresBlocks doubles of device memory (the rest is scratch). Two launches, a fixed
// summation order: the result depends on count, not on timing.
int LaunchSumSquares(const void* data, size_t count, int dtype, double* sums, void* stream);

}  // namespace shardline::cuda_internal

#endif  // SHARDLINE_RUNTIME_CUDA_CUDA_KERNELS_LAUNCH_H_
