// File: runtime/host_kernels.h
// -----------------------------------------------------------------------------
// Element-wise kernels on host memory, type-erased (pointer + count + DType) so collectives and
// the scheduler call one function for every dtype. runtime/cuda/cuda_kernels.h has the same
// operations on device memory, with the same rounding, bit for bit.
//
// Common rules:
//   * Pointers need no particular alignment (any byte address works); count may be 0, in which
//     case nothing is touched and the pointers may be null.
//   * bf16 and f16 are computed in f32 and rounded once, to nearest even, when stored.
//   * Integer sums and products wrap modulo 2^bits (no undefined behaviour on overflow).
//   * min/max use `a < b ? a : b` / `a > b ? a : b` on the compute type: NaN propagation is not
//     guaranteed (it depends on the operand order), as with most hardware min/max.
//   * An output may be identical to an input (same pointer); partially overlapping ranges are
//     not supported.
//   * kAvg behaves like kSum; divide by the number of contributors with Scale afterwards.
// Errors are InvalidArgument naming the dtype (or pair of dtypes) / argument that is not
// supported; on error nothing is written.

#ifndef SHARDLINE_RUNTIME_HOST_KERNELS_H_
#define SHARDLINE_RUNTIME_HOST_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "runtime/dtype.h"

namespace shardline {

// dst[i] = convert(src[i]) for i < count, for every pair of floating dtypes (f32, f64, f16,
// bf16). Narrowing rounds to nearest even (directly from the source: f64 -> f16 rounds once);
// widening is exact; identical dtypes copy. src and dst must not overlap unless identical and
// the dtypes are the same size.
absl::Status Cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t count);

// inout[i] = op(inout[i], in[i]) for i < count. All dtypes.
absl::Status Reduce(void* inout, const void* in, size_t count, DType dtype, ReduceOp op);

// out[i] = op(inputs[0][i], inputs[1][i], ..., inputs[num_inputs-1][i]), accumulated left to
// right in the compute type (f32 for bf16/f16) and rounded once. out may be identical to any
// input. num_inputs >= 1 (InvalidArgument otherwise); a null input with count > 0 is
// InvalidArgument.
absl::Status ReduceMany(void* out, const void* const* inputs, int num_inputs, size_t count,
                        DType dtype, ReduceOp op);

// ReduceMany for an output that is written whole and not read again soon (a reduce-scatter's
// shard): from kStreamingCopyMinBytes of output on (x86-64), the output is written with
// non-temporal stores, one 64-byte line at a time, so its lines are not read before they are
// overwritten (as CopyStreaming). The same bits as ReduceMany; the same argument rules (out may
// be identical to an input, though then its lines were just read and plain stores cost less).
absl::Status ReduceManyStreaming(void* out, const void* const* inputs, int num_inputs, size_t count,
                                 DType dtype, ReduceOp op);

// inout[i] *= factor (how kAvg divides by the number of contributors: factor = 1/n).
//   f32/f16/bf16: computed in f32 with the factor rounded to f32, then rounded once.
//   f64: computed in f64.
//   integers: if 1/factor is (within 1e-9 relative) a positive integer n, inout[i] / n with C++
//     integer division, i.e. truncation toward zero; otherwise trunc(inout[i] * factor) computed
//     in double and saturated to the type's range (NaN factor: InvalidArgument).
absl::Status Scale(void* inout, size_t count, DType dtype, double factor);

// Scale's integer rule: n if 1/factor is (within 1e-9 relative) a positive integer n below
// 2^62, else 0. CudaScale uses the same rule.
int64_t ExactDivisor(double factor);

// memcpy(dst, src, bytes) for a destination that is not read again soon: from
// kStreamingCopyMinBytes on (x86-64), the stores bypass the caches (non-temporal), so the
// destination's lines are not read before they are overwritten and do not evict useful data
// (docs/benchmarks.md has the measurement). Smaller copies, and other architectures, use memcpy.
// dst and src must not overlap.
void CopyStreaming(void* dst, const void* src, size_t bytes);
inline constexpr size_t kStreamingCopyMinBytes = 256 * 1024;

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_HOST_KERNELS_H_
