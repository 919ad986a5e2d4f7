// A host communicator moving CUDA memory through pinned staging blocks (staged_communicator.h).

#include "collectives/staged/staged_communicator.h"

#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/allocator.h"
#include "runtime/caching_pool.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/status.h"
#include "runtime/stream_ops.h"

namespace shardline {
namespace {

std::string PointerText(const void* ptr) {
  return absl::StrCat("0x", absl::Hex(reinterpret_cast<uintptr_t>(ptr)));
}

// What a buffer is, for the checks and their messages.
struct MemoryKind {
  bool usable = false;  // memory of the communicator's device, or managed memory
  std::string text;     // "cuda:0 memory", "pinned host memory", ...
};

class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(std::shared_ptr<Communicator> host, int device,
                     std::unique_ptr<Allocator> pinned, std::unique_ptr<Stream> staging)
      : Communicator(host->rank(), host->size(), Device::Cuda(device), host->name(),
                     host->timeout()),
        host_(std::move(host)),
        device_(device),
        pinned_(std::move(pinned)),
        pool_(std::make_unique<CachingPool>(
            *pinned_, CachingPoolOptions{.name = absl::StrCat(name(), ".staging pool")})),
        staging_(std::move(staging)) {}

  ~StagedCommunicator() override {
    // The staging stream runs the host collectives: they end (or fail at their deadlines) before
    // the pool and the host communicator go.
    (void)staging_->Synchronize(absl::Now() + timeout());
  }

  absl::string_view backend() const override { return host_->backend(); }

 protected:
  absl::Status Run(const Op& op) override {
    return absl::InternalError("StagedCommunicator::Run: collectives are launched, never run");
  }

  absl::Status Launch(Op op, Stream& stream) override;

  // The device and the cudaStream_t only: a framework's wrapped stream qualifies too.
  absl::Status CheckStream(const Stream& stream) const override {
    if (stream.device() != Device::Cuda(device_) || stream.native_handle() == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "communicator ", name(), " (", backend(), " staged through host memory, rank ", rank(),
          " of ", size(), ") moves memory of cuda:", device_,
          " on CUDA streams of that device, but stream '", stream.name(), "' is ",
          stream.native_handle() == nullptr ? "not a CUDA stream" : "a CUDA stream", " on ",
          stream.device().ToString()));
    }
    return absl::OkStatus();
  }

  absl::Status CheckPointToPoint(CollectiveKind kind, int peer, uint64_t match_tag) const override {
    if (peer == kAnySource) {
      return absl::UnimplementedError(
          "a communicator staged through host memory receives from a known rank only (its copy "
          "into the output is enqueued before the source is known)");
    }
    return absl::OkStatus();
  }

  absl::Status CheckBuffers(absl::string_view where, const void* input, size_t input_bytes,
                            const void* output, size_t output_bytes) const override {
    const MemoryKind in = KindOf(input, input_bytes);
    const MemoryKind out = KindOf(output, output_bytes);
    const std::string what = absl::StrCat(where, " (", backend(), " staged, cuda:", device_, ")");
    if (input_bytes > 0 && output_bytes > 0 && in.usable != out.usable) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": input ", PointerText(input), " is ", in.text, " but output ",
          PointerText(output), " is ", out.text, "; both must be memory of cuda:", device_));
    }
    for (const auto& [ptr, bytes, kind, name] :
         {std::tuple(input, input_bytes, &in, "input"),
          std::tuple(output, output_bytes, &out, "output")}) {
      if (bytes > 0 && !kind->usable) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": ", name, " ", PointerText(ptr), " is ", kind->text,
                         "; this communicator moves memory of cuda:", device_,
                         " (host tensors go to a host communicator)"));
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::shared_ptr<Communicator>> SplitImpl(int color, int key,
                                                          absl::Time deadline) override {
    SL_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> part, host_->Split(color, key, deadline));
    if (part == nullptr) return part;
    return CreateStagedCommunicator(std::move(part), device_);
  }

  absl::StatusOr<std::shared_ptr<Communicator>> CreateSubgroup(const std::vector<int>& ranks,
                                                               int index, const std::string& name,
                                                               absl::Time deadline) override {
    return absl::UnimplementedError(
        absl::StrCat("communicator ", this->name(),
                     ": a communicator staged through host memory cannot "
                     "shrink (shrink its host communicator and stage the result)"));
  }

  void OnAbort(const absl::Status& reason) override { host_->Abort(reason); }

 private:
  MemoryKind KindOf(const void* ptr, size_t bytes) const {
    if (bytes == 0) return {true, "empty"};
    cudaPointerAttributes attr{};
    const cudaError_t error = cudaPointerGetAttributes(&attr, ptr);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      return {false, absl::StrCat("memory CUDA does not know (", cudaGetErrorString(error), ")")};
    }
    switch (attr.type) {
      case cudaMemoryTypeDevice:
        if (attr.device == device_) return {true, absl::StrCat("cuda:", device_, " memory")};
        return {false, absl::StrCat("memory of cuda:", attr.device)};
      case cudaMemoryTypeManaged:
        return {true, "managed memory"};
      case cudaMemoryTypeHost:
        return {false, "pinned host memory"};
      case cudaMemoryTypeUnregistered:
      default:
        return {false, "host memory"};
    }
  }

  // The host communicator's call for `op` on the staging blocks, on the staging stream.
  absl::StatusOr<Work> IssueOnHost(const Op& op, const void* in, void* out);

  std::shared_ptr<Communicator> host_;
  const int device_;
  std::unique_ptr<Allocator> pinned_;
  std::unique_ptr<CachingPool> pool_;  // of pinned_: staging blocks, stream-ordered
  std::unique_ptr<Stream> staging_;    // a host stream: the host collectives run on its worker
};

absl::StatusOr<Work> StagedCommunicator::IssueOnHost(const Op& op, const void* in, void* out) {
  const CollectiveFingerprint& fp = op.fingerprint;
  CollectiveOptions options;
  options.timeout = op.timeout;
  options.key = IsPointToPoint(fp.kind) ? 0 : fp.key;
  switch (fp.kind) {
    case CollectiveKind::kAllGather:
      return host_->AllGather(in, out, fp.count, fp.dtype, *staging_, options);
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllReduce: {
      ReduceOptions reduce;
      static_cast<CollectiveOptions&>(reduce) = options;
      reduce.op = fp.op;
      return fp.kind == CollectiveKind::kAllReduce
                 ? host_->AllReduce(in, out, fp.count, fp.dtype, *staging_, reduce)
                 : host_->ReduceScatter(in, out, fp.count, fp.dtype, *staging_, reduce);
    }
    case CollectiveKind::kBroadcast: {
      BroadcastOptions broadcast;
      static_cast<CollectiveOptions&>(broadcast) = options;
      broadcast.root = fp.root;
      return host_->Broadcast(out, fp.count, fp.dtype, *staging_, broadcast);
    }
    case CollectiveKind::kAllToAll:
      return host_->AllToAll(in, out, fp.count, fp.dtype, *staging_, options);
    case CollectiveKind::kBarrier:
      return host_->Barrier(*staging_, options);
    case CollectiveKind::kSend:
    case CollectiveKind::kRecv: {
      PointToPointOptions p2p;
      p2p.timeout = op.timeout;
      p2p.match_tag = fp.key;
      return fp.kind == CollectiveKind::kSend
                 ? host_->Send(in, fp.count, fp.dtype, fp.root, *staging_, p2p)
                 : host_->Recv(out, fp.count, fp.dtype, fp.root, *staging_, p2p);
    }
  }
  return absl::InternalError("StagedCommunicator: unknown collective kind");
}

absl::Status StagedCommunicator::Launch(Op op, Stream& stream) {
  const CollectiveFingerprint& fp = op.fingerprint;
  const size_t in_bytes = op.input_count * op.element_size;
  const size_t out_bytes = op.output_count * op.element_size;
  // A broadcast moves one buffer in place: one staging block, copied in (the root's data) and out.
  const bool one_block = fp.kind == CollectiveKind::kBroadcast;
  Buffer in_stage;
  Buffer out_stage;
  // Both blocks' first user is the caller's stream: it waits for their last users there, and the
  // staging stream reaches them only after the copy-in recorded on it.
  if (in_bytes > 0) {
    SL_ASSIGN_OR_RETURN(in_stage, pool_->Allocate(in_bytes, stream));
  }
  if (out_bytes > 0 && !one_block) {
    SL_ASSIGN_OR_RETURN(out_stage, pool_->Allocate(out_bytes, stream));
  }
  void* staged_out = one_block ? in_stage.data() : out_stage.data();
  auto keep_on_failure = [&] {
    // Copies may still run on the device into these blocks: never hand them back.
    if (in_stage.data() != nullptr) in_stage.Leak();
    if (out_stage.data() != nullptr) out_stage.Leak();
  };
  if (in_bytes > 0) {
    if (absl::Status s = EnqueueCopy(stream, in_stage.data(), op.input, in_bytes); !s.ok()) {
      keep_on_failure();
      return s;
    }
  }
  absl::StatusOr<std::shared_ptr<Event>> copied_in = RecordEvent(stream);
  if (!copied_in.ok()) {
    keep_on_failure();
    return copied_in.status();
  }
  // The host collective: on the staging stream, once the copy-in is done.
  std::weak_ptr<Communicator> weak = weak_from_this();
  absl::Status queued = staging_->WaitEvent(**copied_in);
  if (queued.ok()) {
    StreamOp started;
    started.name = "staged start";
    started.run = [weak, op]() -> absl::Status {
      if (std::shared_ptr<Communicator> self = weak.lock()) {
        static_cast<StagedCommunicator&>(*self).RecordStarted(op);
      }
      return absl::OkStatus();
    };
    queued = staging_->Submit(std::move(started));
  }
  absl::StatusOr<Work> host_work =
      queued.ok() ? IssueOnHost(op, in_stage.data(), staged_out) : absl::StatusOr<Work>(queued);
  if (!host_work.ok()) {
    keep_on_failure();
    return host_work.status();
  }
  const std::shared_ptr<Event> done = host_work->event();
  // Its outcome is this collective's: the flight record, a Recv's source, an abort on failure.
  std::shared_ptr<std::atomic<int>> source = op.source;
  const int peer = fp.root;
  done->OnComplete([weak, op, source, peer](const absl::Status& status) {
    std::shared_ptr<Communicator> self = weak.lock();
    if (self == nullptr) return;
    auto& staged = static_cast<StagedCommunicator&>(*self);
    if (status.ok() && source != nullptr) source->store(peer, std::memory_order_release);
    staged.RecordEnded(op, status);
    if (!status.ok()) staged.Abort(status);
  });
  // The caller's stream waits for it on the device, then copies the result out.
  absl::Status waited = stream.WaitEvent(*done);
  if (waited.ok() && out_bytes > 0) waited = EnqueueCopy(stream, op.output, staged_out, out_bytes);
  absl::StatusOr<std::shared_ptr<Event>> copied_out =
      waited.ok() ? RecordEvent(stream) : absl::StatusOr<std::shared_ptr<Event>>(waited);
  if (!copied_out.ok()) {
    keep_on_failure();
    return copied_out.status();
  }
  if (in_stage.data() != nullptr) in_stage.ReleaseAfter(*copied_out);
  if (out_stage.data() != nullptr) out_stage.ReleaseAfter(*copied_out);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<Communicator>> CreateStagedCommunicator(
    std::shared_ptr<Communicator> host, int device) {
  if (host == nullptr) return absl::InvalidArgumentError("CreateStagedCommunicator: host is null");
  if (!host->device().is_host()) {
    return absl::InvalidArgumentError(
        absl::StrCat("CreateStagedCommunicator: communicator ", host->name(), " (", host->backend(),
                     ") moves ", host->device().ToString(), " memory, not host memory"));
  }
  const std::string what = absl::StrCat("communicator ", host->name(), " staged on cuda:", device);
  int count = 0;
  if (absl::Status s = SL_CUDA_STATUS(cudaGetDeviceCount(&count)); !s.ok()) {
    return absl::UnavailableError(absl::StrCat(what, ": ", s.message()));
  }
  if (device < 0 || device >= count) {
    return absl::UnavailableError(absl::StrCat(what, ": cuda:", device, " does not exist (", count,
                                               " CUDA devices visible)"));
  }
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Allocator> pinned,
                      CreatePinnedAllocator(absl::StrCat(host->name(), ".staging")));
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> staging,
                      CreateHostStream({.name = absl::StrCat(host->name(), ".staging")}));
  return std::shared_ptr<Communicator>(std::make_shared<StagedCommunicator>(
      std::move(host), device, std::move(pinned), std::move(staging)));
}

}  // namespace shardline
