// File: runtime/stream_ops.h
// -----------------------------------------------------------------------------
// The element-wise operations the scheduler enqueues on its streams, dispatched by the stream's
// device: on host and caller streams a StreamOp (runtime/stream.h) with its declared cost that
// runs the host kernel (runtime/host_kernels.h); on CUDA streams the CUDA kernel
// (runtime/cuda/cuda_kernels.h), cudaMemsetAsync or cudaMemcpyAsync on the stream. The layers
// above never see a device branch: they call these.
//
// Every function returns without waiting. An error means nothing was enqueued (the stream is
// poisoned, an argument is invalid, a launch failed). Errors during execution poison the stream.
// A count of 0 enqueues nothing. Pointers must stay valid until the op has run: order their
// release after an event recorded on the stream afterwards.

#ifndef SHARDLINE_RUNTIME_STREAM_OPS_H_
#define SHARDLINE_RUNTIME_STREAM_OPS_H_

#include <cstddef>

#include "absl/status/status.h"
#include "runtime/dtype.h"
#include "runtime/stream.h"

namespace shardline {

// dst[i] = (dst_dtype) src[i] for i < count (a copy when the dtypes agree; nothing is enqueued
// when they agree and src == dst).
absl::Status EnqueueCast(Stream& stream, const void* src, DType src_dtype, void* dst,
                         DType dst_dtype, size_t count);

// inout[i] = op(inout[i], in[i]) for i < count.
absl::Status EnqueueReduce(Stream& stream, void* inout, const void* in, size_t count, DType dtype,
                           ReduceOp op = ReduceOp::kSum);

// `bytes` zero bytes at `data`.
absl::Status EnqueueFill(Stream& stream, void* data, size_t bytes);

// `bytes` from `src` to `dst`, both in memory the stream's device can address (for a CUDA
// stream: device, pinned or managed memory; a copy between host and device is allowed).
absl::Status EnqueueCopy(Stream& stream, void* dst, const void* src, size_t bytes);

// `bytes` between host memory and memory of `device` (either way), blocking the caller until done
// or `deadline`: memcpy for the host, a copy on a new stream of the device otherwise. For setup
// and checkpoints, which may block; never in a step.
absl::Status CopyBlocking(Device device, void* dst, const void* src, size_t bytes,
                          absl::Time deadline);

// data[i] *= factor for i < count (host_kernels.h's Scale rules; CudaScale on a CUDA stream).
absl::Status EnqueueScale(Stream& stream, void* data, size_t count, DType dtype, double factor);

// The doubles `sums` must hold for EnqueueSumSquares: sums[0] is the result, the rest scratch
// for a CUDA stream's partial sums.
inline constexpr size_t kSumSquaresDoubles = 257;

// sums[0] += the sum of squares of data[0..count) (f32, f64, f16, bf16), accumulated in double.
// `sums` (kSumSquaresDoubles doubles) is in memory of the stream's device; two sums in flight
// on different streams need different `sums`. Host streams sum in index order, CUDA streams in a
// fixed tree: each deterministic, the two may differ in the last bits.
absl::Status EnqueueSumSquares(Stream& stream, const void* data, size_t count, DType dtype,
                               double* sums);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_STREAM_OPS_H_
