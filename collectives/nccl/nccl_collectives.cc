// The nccl backend's collectives: stream and buffer checks, the NCCL calls on the caller's CUDA
// stream, and the optional fingerprint check (see nccl_communicator.h for the behaviour).

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/nccl/internal/nccl_check.h"
#include "collectives/nccl/internal/nccl_communicator_impl.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/status.h"

namespace shardline::nccl_internal {
namespace {

ncclDataType_t NcclDType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kF64:
      return ncclFloat64;
    case DType::kF16:
      return ncclFloat16;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kI8:
      return ncclInt8;
    case DType::kU8:
      return ncclUint8;
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
  }
  return ncclUint8;
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;  // integers: sum, then truncating division, as communicator.h specifies
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kProduct:
      return ncclProd;
  }
  return ncclSum;
}

std::string PointerText(const void* ptr) {
  return absl::StrCat("0x", absl::Hex(reinterpret_cast<uintptr_t>(ptr)));
}

}  // namespace

// The device and the cudaStream_t only, not the Stream's class: a framework's stream wrapped with
// WrapCudaStream qualifies as well as one of ours.
absl::Status NcclCommunicator::CheckStream(const Stream& stream) const {
  if (stream.device() != Device::Cuda(cuda_device_) || stream.native_handle() == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "communicator ", name(), " (nccl, rank ", rank(), " of ", size(), ") moves memory of cuda:",
        cuda_device_, " on CUDA streams of that device, but stream '", stream.name(), "' is ",
        stream.native_handle() == nullptr ? "not a CUDA stream" : "a CUDA stream", " on ",
        stream.device().ToString()));
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::CheckPointToPoint(CollectiveKind kind, int peer,
                                                 uint64_t match_tag) const {
  if (peer == kAnySource) {
    return absl::UnimplementedError(
        "the nccl backend cannot receive from any rank (NCCL has no wildcard receive)");
  }
  if (match_tag != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "message tag ", match_tag,
        ": the nccl backend has no tags (NCCL matches the messages between two ranks in the "
        "order they were issued); use tag 0"));
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::CheckBuffers(absl::string_view where, const void* input,
                                            size_t input_bytes, const void* output,
                                            size_t output_bytes) const {
  const std::string described = absl::StrCat(where, " (nccl)");
  SL_RETURN_IF_ERROR(CheckBuffer(described, input, input_bytes, "input"));
  return CheckBuffer(described, output, output_bytes, "output");
}

absl::Status NcclCommunicator::CheckBuffer(absl::string_view where, const void* ptr, size_t bytes,
                                           const char* what) const {
  if (bytes == 0) return absl::OkStatus();
  cudaPointerAttributes attr{};
  const cudaError_t error = cudaPointerGetAttributes(&attr, ptr);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", what, " ", PointerText(ptr),
                     " is not memory CUDA knows: ", cudaGetErrorString(error)));
  }
  switch (attr.type) {
    case cudaMemoryTypeDevice:
      if (attr.device != cuda_device_) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": ", what, " ", PointerText(ptr), " is memory of cuda:", attr.device,
            ", but the communicator is on cuda:", cuda_device_));
      }
      return absl::OkStatus();
    case cudaMemoryTypeManaged:
      return absl::OkStatus();
    case cudaMemoryTypeHost:
    case cudaMemoryTypeUnregistered:
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", what, " ", PointerText(ptr), " is ",
                       attr.type == cudaMemoryTypeHost ? "pinned host memory" : "host memory",
                       "; the nccl backend moves device memory of cuda:", cuda_device_));
  }
}

absl::Status NcclCommunicator::EnqueueOneRank(const Op& op, cudaStream_t stream) {
  const CollectiveFingerprint& fp = op.fingerprint;
  // Every collective of one rank leaves its input in its output: a reduction over one rank is
  // the identity for sum, avg (x / 1), min and max; a gather, a broadcast and an all-to-all copy
  // the rank's own block.
  const size_t bytes = fp.kind == CollectiveKind::kBarrier || IsPointToPoint(fp.kind)
                           ? 0
                           : fp.count * op.element_size;
  if (bytes == 0 || op.input == op.output) return absl::OkStatus();
  return SL_CUDA_STATUS(
      cudaMemcpyAsync(op.output, op.input, bytes, cudaMemcpyDeviceToDevice, stream));
}

absl::Status NcclCommunicator::Enqueue(const Op& op, cudaStream_t stream) {
  if (size() == 1) return EnqueueOneRank(op, stream);
  const CollectiveFingerprint& fp = op.fingerprint;
  const ncclDataType_t dtype = NcclDType(fp.dtype);
  switch (fp.kind) {
    case CollectiveKind::kAllGather:
      return SL_NCCL_ACCEPTED(ncclAllGather(op.input, op.output, fp.count, dtype, comm_, stream),
                              comm_);
    case CollectiveKind::kReduceScatter:
      return SL_NCCL_ACCEPTED(
          ncclReduceScatter(op.input, op.output, fp.count, dtype, NcclOp(fp.op), comm_, stream),
          comm_);
    case CollectiveKind::kAllReduce:
      return SL_NCCL_ACCEPTED(
          ncclAllReduce(op.input, op.output, fp.count, dtype, NcclOp(fp.op), comm_, stream), comm_);
    case CollectiveKind::kBroadcast:
      return SL_NCCL_ACCEPTED(
          ncclBroadcast(op.input, op.output, fp.count, dtype, fp.root, comm_, stream), comm_);
    case CollectiveKind::kAllToAll: {
      // One send and one receive per peer (itself included), fused so they progress together.
      const size_t bytes = fp.count * op.element_size;
      const auto* in = static_cast<const uint8_t*>(op.input);
      auto* out = static_cast<uint8_t*>(op.output);
      SL_RETURN_IF_ERROR(SL_NCCL_ACCEPTED(ncclGroupStart(), comm_));
      absl::Status status;
      for (int peer = 0; peer < size() && status.ok(); ++peer) {
        status = SL_NCCL_ACCEPTED(ncclSend(in + peer * bytes, fp.count, dtype, peer, comm_, stream),
                                  comm_);
        if (status.ok()) {
          status = SL_NCCL_ACCEPTED(
              ncclRecv(out + peer * bytes, fp.count, dtype, peer, comm_, stream), comm_);
        }
      }
      // The group must be closed even after a failed call.
      const absl::Status ended = SL_NCCL_ACCEPTED(ncclGroupEnd(), comm_);
      return status.ok() ? ended : status;
    }
    case CollectiveKind::kBarrier:
      // Every rank's kernel must start before any finishes; the zero it sums stays zero.
      return SL_NCCL_ACCEPTED(
          ncclAllReduce(barrier_scratch_, barrier_scratch_, 1, ncclInt32, ncclSum, comm_, stream),
          comm_);
    case CollectiveKind::kSend:
      return SL_NCCL_ACCEPTED(ncclSend(op.input, fp.count, dtype, fp.root, comm_, stream), comm_);
    case CollectiveKind::kRecv:
      op.source->store(fp.root, std::memory_order_release);
      return SL_NCCL_ACCEPTED(ncclRecv(op.output, fp.count, dtype, fp.root, comm_, stream), comm_);
  }
  return absl::InternalError(absl::StrCat(Describe(op), ": unknown collective kind"));
}

absl::Status NcclCommunicator::WaitAccepted(absl::string_view what, absl::Duration timeout,
                                            absl::Time deadline) {
  PollBackoff backoff;
  while (true) {
    ncclResult_t state = ncclSuccess;
    SL_RETURN_IF_ERROR(Annotate(SL_NCCL_STATUS(ncclCommGetAsyncError(comm_, &state), comm_), what));
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return AsyncError(state, what);
    SL_RETURN_IF_ERROR(status());
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": NCCL did not accept the operation within ", absl::FormatDuration(timeout),
          " (NCCL cannot tell which rank(s) it is waiting for)"));
    }
    backoff.Pause();
  }
}

absl::Status NcclCommunicator::CheckFingerprints(const Op& op, cudaStream_t stream,
                                                 absl::Time deadline) {
  constexpr size_t kSize = CollectiveFingerprint::kEncodedSize;
  const std::string what = absl::StrCat(Describe(op), ": fingerprint check");
  const size_t n = static_cast<size_t>(size());
  uint8_t* mine = fingerprints_host_ + n * kSize;
  uint8_t* slot = fingerprints_dev_ + static_cast<size_t>(rank()) * kSize;
  op.fingerprint.Encode(mine);
  SL_RETURN_IF_ERROR(Annotate(
      SL_CUDA_STATUS(cudaMemcpyAsync(slot, mine, kSize, cudaMemcpyHostToDevice, stream)), what));
  {
    std::lock_guard<std::mutex> lock(nccl_mu_);
    SL_RETURN_IF_ERROR(status());
    if (comm_ == nullptr)
      return absl::FailedPreconditionError(absl::StrCat(what, ": no NCCL communicator"));
    SL_RETURN_IF_ERROR(Annotate(
        SL_NCCL_ACCEPTED(ncclAllGather(slot, fingerprints_dev_, kSize, ncclUint8, comm_, stream),
                         comm_),
        what));
    SL_RETURN_IF_ERROR(WaitAccepted(what, op.timeout, deadline));
  }
  SL_RETURN_IF_ERROR(
      Annotate(SL_CUDA_STATUS(cudaMemcpyAsync(fingerprints_host_, fingerprints_dev_, n * kSize,
                                              cudaMemcpyDeviceToHost, stream)),
               what));
  SL_RETURN_IF_ERROR(Annotate(SL_CUDA_STATUS(cudaEventRecord(fingerprints_ready_, stream)), what));
  // The debug mode's price: the host waits for the stream (and every rank's arrival).
  PollBackoff backoff;
  while (true) {
    const cudaError_t error = cudaEventQuery(fingerprints_ready_);
    if (error == cudaSuccess) break;
    if (error != cudaErrorNotReady) return Annotate(SL_CUDA_STATUS(error), what);
    SL_RETURN_IF_ERROR(status());
    {
      std::lock_guard<std::mutex> lock(nccl_mu_);
      ncclResult_t state = ncclSuccess;
      if (comm_ != nullptr && ncclCommGetAsyncError(comm_, &state) == ncclSuccess &&
          state != ncclSuccess && state != ncclInProgress) {
        return AsyncError(state, what);
      }
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          DeadlineError(op, {}).message(),
          " in the fingerprint check: a rank did not issue it or the stream is blocked (NCCL "
          "cannot tell which rank)"));
    }
    backoff.Pause();
  }
  std::vector<CollectiveFingerprint> all(n);
  for (size_t r = 0; r < n; ++r) {
    absl::StatusOr<CollectiveFingerprint> fp =
        CollectiveFingerprint::Decode(fingerprints_host_ + r * kSize);
    if (!fp.ok()) {
      return absl::InternalError(absl::StrCat(
          what, ": rank ", r, " sent a malformed fingerprint: ", fp.status().message()));
    }
    all[r] = *fp;
  }
  // Every rank sees the same table, so every rank reports the same pair.
  for (size_t r = 1; r < n; ++r) {
    if (!(all[r] == all[0])) return MismatchError(op, 0, all[0], static_cast<int>(r), all[r]);
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Launch(Op op, Stream& stream) {
  SL_RETURN_IF_ERROR(stream.status());
  const auto cuda_stream = static_cast<cudaStream_t>(stream.native_handle());
  CudaDeviceGuard guard;
  SL_RETURN_IF_ERROR(Annotate(guard.Set(cuda_device_), Describe(op)));
  // Bounds the host-side waits of this call; the watchdog bounds the collective itself, from
  // the moment it starts on the stream.
  const absl::Time deadline = absl::Now() + op.timeout;
  op.deadline = deadline;
  if (settings_.check_fingerprints)
    SL_RETURN_IF_ERROR(CheckFingerprints(op, cuda_stream, deadline));

  // A count of 0 moves nothing (the same on every rank: the counts are part of the call).
  if (op.fingerprint.count > 0 || op.fingerprint.kind == CollectiveKind::kBarrier) {
    cudaEvent_t start = nullptr;
    cudaEvent_t done = nullptr;
    SL_RETURN_IF_ERROR(Annotate(TakeEvents(&start, &done), Describe(op)));
    absl::Status launched;
    {
      std::lock_guard<std::mutex> lock(nccl_mu_);
      launched = status();
      if (launched.ok() && comm_ == nullptr) {
        launched =
            absl::FailedPreconditionError(absl::StrCat(Describe(op), ": no NCCL communicator"));
      }
      if (launched.ok()) launched = SL_CUDA_STATUS(cudaEventRecord(start, cuda_stream));
      if (launched.ok()) launched = Enqueue(op, cuda_stream);
      // A non-blocking communicator may accept the call before it is on the stream: anything
      // enqueued afterwards (events, the Work's event) must come after the kernel.
      if (launched.ok()) launched = WaitAccepted(Describe(op), op.timeout, deadline);
      if (launched.ok()) launched = SL_CUDA_STATUS(cudaEventRecord(done, cuda_stream));
    }
    if (!launched.ok()) {
      ReturnEvents(start, done);
      return absl::StrContains(launched.message(), Describe(op)) ? launched
                                                                 : Annotate(launched, Describe(op));
    }
    Track(op, start, done);
  } else {
    // Nothing to launch: for the flight recorder it ran and ended here.
    RecordStarted(op);
    RecordEnded(op, absl::OkStatus());
  }
  if (settings_.stream_status) {
    // Fails the stream (and so the Work's event, and streams that wait on it) if the
    // communicator was aborted by the time the collective left the stream: ncclCommAbort ends
    // the kernels, but the stream would otherwise report success.
    SL_RETURN_IF_ERROR(stream.Enqueue([status = shared_status_]() { return status->Get(); }));
  }
  return absl::OkStatus();
}

}  // namespace shardline::nccl_internal
