// File: runtime/cuda/cuda_kernels.h
// -----------------------------------------------------------------------------
// The element-wise kernels of runtime/host_kernels.h on device memory: same operations, same
// dtypes, same rounding (the device code uses runtime/half.h, so results match the host kernels
// bit for bit), same rules for count 0, aliasing and kAvg (see host_kernels.h). Each call
// enqueues one kernel on `stream` (a cudaStream_t passed as void*, nullptr = the legacy default
// stream) and returns without waiting; the Status reports launch errors (cudaGetLastError),
// errors during execution surface on the stream.
//
// Differences from the host kernels:
//   * Pointers must be aligned to their element size (InvalidArgument otherwise); 16-byte
//     aligned pointers use 16-byte vector loads.
//   * CudaReduceMany takes at most kCudaMaxReduceInputs inputs; `inputs` is a host array of
//     device pointers.
//   * The current device must be the one the pointers live on.
//
// Only available when shardline is built with SHARDLINE_WITH_CUDA.

#ifndef SHARDLINE_RUNTIME_CUDA_CUDA_KERNELS_H_
#define SHARDLINE_RUNTIME_CUDA_CUDA_KERNELS_H_

#include <cstddef>

#include "absl/status/status.h"
#include "runtime/dtype.h"

namespace shardline {

inline constexpr int kCudaMaxReduceInputs = 64;

absl::Status CudaCast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t count,
                      void* stream);

absl::Status CudaReduce(void* inout, const void* in, size_t count, DType dtype, ReduceOp op,
                        void* stream);

absl::Status CudaReduceMany(void* out, const void* const* inputs, int num_inputs, size_t count,
                            DType dtype, ReduceOp op, void* stream);

absl::Status CudaScale(void* inout, size_t count, DType dtype, double factor, void* stream);

// The doubles of device memory CudaSumSquares's `sums` must hold: the result, then scratch.
inline constexpr size_t kCudaSumSquaresDoubles = 257;

// sums[0] += the sum of squares of data[0..count), accumulated in double (f32, f64, f16, bf16;
// other dtypes are InvalidArgument). Deterministic for a given count: fixed partial sums and a
// fixed tree, not atomics. sums[1..] is scratch, so two sums on different streams need
// different `sums`. Differs from the host's SumOfSquares (index order) in the last bits.
absl::Status CudaSumSquares(const void* data, size_t count, DType dtype, double* sums,
                            void* stream);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_CUDA_CUDA_KERNELS_H_
