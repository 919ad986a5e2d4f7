#include "runtime/stream_ops.h"

#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "runtime/host_kernels.h"
#include "runtime/recycling.h"
#include "runtime/shard_norms.h"
#include "runtime/status.h"

#ifdef SHARDLINE_WITH_CUDA
#include <cuda_runtime.h>

#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/cuda_kernels.h"
#include "runtime/cuda/cuda_util.h"
#endif

namespace shardline {
namespace {

// A host op: its name, kind and cost, then `run`. A closure larger than the two pointers that
// an AnyInvocable stores inline goes into a recycled block (a cast's or a reduction's arguments):
// the hooks enqueue several per unit, and malloc would see each freed on another thread.
template <typename Run>
absl::Status SubmitHost(Stream& stream, StreamOpKind kind, std::string name, uint64_t bytes,
                        Run run) {
  StreamOp op;
  op.name = std::move(name);
  op.kind = kind;
  op.bytes = bytes;
  if constexpr (sizeof(Run) > 2 * sizeof(void*)) {
    op.run = [boxed = MakeRecycled<Run>(std::move(run))]() { return std::move(*boxed)(); };
  } else {
    op.run = std::move(run);
  }
  return stream.Submit(std::move(op));
}

#ifdef SHARDLINE_WITH_CUDA
cudaStream_t CudaHandle(Stream& stream) {
  return static_cast<cudaStream_t>(stream.native_handle());
}

// Launches on the stream's device: a wrapped legacy default stream (a null handle) belongs to
// whichever device is current, so make it the stream's.
#define SL_ON_STREAM_DEVICE(stream) \
  CudaDeviceGuard sl_device_guard;  \
  SL_RETURN_IF_ERROR(sl_device_guard.Set((stream).device().index()))
#endif

#ifndef SHARDLINE_WITH_CUDA
// Unimplemented for a device this build cannot reach.
absl::Status NoDevice(const Stream& stream) {
  return absl::UnimplementedError(absl::StrCat("stream '", stream.name(), "' is on ",
                                               stream.device().ToString(),
                                               ", which needs a CUDA build of shardline"));
}
#endif

}  // namespace

absl::Status EnqueueCast(Stream& stream, const void* src, DType src_dtype, void* dst,
                         DType dst_dtype, size_t count) {
  if (count == 0 || (src == dst && src_dtype == dst_dtype)) return absl::OkStatus();
  if (stream.device().is_host()) {
    return SubmitHost(stream, StreamOpKind::kCast,
                      absl::StrCat("cast ", DTypeName(src_dtype), "->", DTypeName(dst_dtype)),
                      count * DTypeSize(src_dtype),
                      [=]() { return Cast(src, src_dtype, dst, dst_dtype, count); });
  }
#ifdef SHARDLINE_WITH_CUDA
  SL_ON_STREAM_DEVICE(stream);
  return CudaCast(src, src_dtype, dst, dst_dtype, count, CudaHandle(stream));
#else
  return NoDevice(stream);
#endif
}

absl::Status EnqueueReduce(Stream& stream, void* inout, const void* in, size_t count, DType dtype,
                           ReduceOp op) {
  if (count == 0) return absl::OkStatus();
  if (stream.device().is_host()) {
    return SubmitHost(stream, StreamOpKind::kReduce,
                      absl::StrCat("reduce ", ReduceOpName(op), " ", DTypeName(dtype)),
                      2 * count * DTypeSize(dtype),
                      [=]() { return Reduce(inout, in, count, dtype, op); });
  }
#ifdef SHARDLINE_WITH_CUDA
  SL_ON_STREAM_DEVICE(stream);
  return CudaReduce(inout, in, count, dtype, op, CudaHandle(stream));
#else
  return NoDevice(stream);
#endif
}

absl::Status EnqueueFill(Stream& stream, void* data, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (stream.device().is_host()) {
    return SubmitHost(stream, StreamOpKind::kFill, "zero fill", bytes, [=]() {
      std::memset(data, 0, bytes);
      return absl::OkStatus();
    });
  }
#ifdef SHARDLINE_WITH_CUDA
  SL_ON_STREAM_DEVICE(stream);
  return Annotate(SL_CUDA_STATUS(cudaMemsetAsync(data, 0, bytes, CudaHandle(stream))),
                  absl::StrCat("stream '", stream.name(), "': zero fill of ", bytes, " bytes"));
#else
  return NoDevice(stream);
#endif
}

absl::Status EnqueueCopy(Stream& stream, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (stream.device().is_host()) {
    return SubmitHost(stream, StreamOpKind::kCopy, "copy", bytes, [=]() {
      std::memmove(dst, src, bytes);
      return absl::OkStatus();
    });
  }
#ifdef SHARDLINE_WITH_CUDA
  SL_ON_STREAM_DEVICE(stream);
  return Annotate(
      SL_CUDA_STATUS(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, CudaHandle(stream))),
      absl::StrCat("stream '", stream.name(), "': copy of ", bytes, " bytes"));
#else
  return NoDevice(stream);
#endif
}

absl::Status CopyBlocking(Device device, void* dst, const void* src, size_t bytes,
                          absl::Time deadline) {
  if (bytes == 0) return absl::OkStatus();
  if (device.is_host()) {
    std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream,
                      CreateStream(device, {.name = "blocking copy"}));
  SL_RETURN_IF_ERROR(EnqueueCopy(*stream, dst, src, bytes));
  return stream->Synchronize(deadline);
}

absl::Status EnqueueScale(Stream& stream, void* data, size_t count, DType dtype, double factor) {
  if (count == 0) return absl::OkStatus();
  if (stream.device().is_host()) {
    return SubmitHost(stream, StreamOpKind::kCast, absl::StrCat("scale ", DTypeName(dtype)),
                      count * DTypeSize(dtype),
                      [=]() { return Scale(data, count, dtype, factor); });
  }
#ifdef SHARDLINE_WITH_CUDA
  SL_ON_STREAM_DEVICE(stream);
  return CudaScale(data, count, dtype, factor, CudaHandle(stream));
#else
  return NoDevice(stream);
#endif
}

absl::Status EnqueueSumSquares(Stream& stream, const void* data, size_t count, DType dtype,
                               double* sums) {
  static_assert(kSumSquaresDoubles >= 1);
  if (!IsFloatingPoint(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("stream '", stream.name(),
                                                   "': sum of squares of ", DTypeName(dtype),
                                                   " (only f32, f64, f16, bf16 are supported)"));
  }
  if (count == 0) return absl::OkStatus();
  if (sums == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("stream '", stream.name(), "': sum of squares into a null `sums`"));
  }
  if (stream.device().is_host()) {
    return SubmitHost(stream, StreamOpKind::kReduce,
                      absl::StrCat("sum of squares ", DTypeName(dtype)), count * DTypeSize(dtype),
                      [=]() -> absl::Status {
                        SL_ASSIGN_OR_RETURN(double sum, SumOfSquares(data, count, dtype));
                        sums[0] += sum;
                        return absl::OkStatus();
                      });
  }
#ifdef SHARDLINE_WITH_CUDA
  static_assert(kSumSquaresDoubles == kCudaSumSquaresDoubles);
  SL_ON_STREAM_DEVICE(stream);
  return CudaSumSquares(data, count, dtype, sums, CudaHandle(stream));
#else
  return NoDevice(stream);
#endif
}

}  // namespace shardline
