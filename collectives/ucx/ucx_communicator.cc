#include "collectives/ucx/ucx_communicator.h"

#include <cstring>
#include <mutex>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "collectives/ucx/internal/ucx_collective.h"
#include "collectives/ucx/internal/ucx_communicator_internal.h"
#include "collectives/ucx/internal/ucx_point_to_point.h"
#include "collectives/ucx/internal/ucx_transport.h"
#include "runtime/config.h"
#include "runtime/host_kernels.h"
#include "runtime/shared_memory.h"
#include "runtime/status.h"

namespace shardline {
namespace {

using ucx_internal::CollectiveHooks;
using ucx_internal::CollectiveRun;
using ucx_internal::RunScratch;
using ucx_internal::Tuning;
using ucx_internal::UcxTransport;

// CreateUcxCommunicator with an explicit bound on the address exchange (Split passes its own)
// and tuning (unset: the knobs'; subgroups inherit their parent's).
absl::StatusOr<std::shared_ptr<Communicator>> CreateWithDeadline(
    const UcxOptions& options, std::optional<Tuning> tuning, std::optional<absl::Time> deadline);

class UcxCommunicator final : public Communicator {
 public:
  UcxCommunicator(int rank, int size, std::string name, absl::Duration timeout,
                  std::shared_ptr<Store> store, std::unique_ptr<UcxTransport> transport,
                  Tuning tuning)
      : Communicator(rank, size, Device::Host(), std::move(name), timeout),
        store_(std::move(store)),
        transport_(std::move(transport)),
        tuning_(tuning) {
    if (transport_ != nullptr) {
      point_to_point_ = std::make_unique<ucx_internal::PointToPoint>(*transport_, tuning_);
      transport_->SetPendingWork([p2p = point_to_point_.get()] { return p2p->SendsPending(); });
    }
  }

  // Connects the transport's failure reports to Abort(). The handler holds a plain pointer:
  // the destructor removes it (waiting for a call in flight) before anything is destroyed, and
  // a strong reference taken on the transport's progress thread could make that thread the
  // last owner, destroying the transport from its own thread.
  void Attach() {
    if (transport_ == nullptr) return;
    transport_->SetAbortHandler([this](const absl::Status& reason, bool forward) {
      forward_abort_ = forward;
      // Only peers' aborts and deaths come through here.
      Abort(IsPeerError(reason) ? reason : MarkPeerError(reason, "peer"));
      forward_abort_ = true;
    });
  }

  ~UcxCommunicator() override {
    // Sends whose receivers still read them out of this process.
    if (point_to_point_ != nullptr) {
      point_to_point_->Flush(absl::Now() + timeout(), [this] { return status().ok(); });
      transport_->SetPendingWork(nullptr);
    }
    if (transport_ != nullptr) transport_->ClearAbortHandler();
  }

  absl::string_view backend() const override { return "ucx"; }

  std::unique_ptr<Allocator> CreateHostAllocatorForTransfers(size_t alignment,
                                                             std::string name) const override {
    if (transport_ != nullptr && transport_->maps_peers()) {
      return CreateShareableHostAllocator(alignment, std::move(name));
    }
    return CreateHostAllocator(alignment, std::move(name));
  }

 protected:
  absl::Status Run(const Op& op) override;
  absl::Status CheckPointToPoint(CollectiveKind kind, int peer, uint64_t match_tag) const override {
    if (match_tag > ucx_internal::kMaxMessageTag) {
      return absl::InvalidArgumentError(absl::StrCat("message tag ", match_tag,
                                                     " is out of the ucx backend's range [0, ",
                                                     ucx_internal::kMaxMessageTag, "]"));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::shared_ptr<Communicator>> CreateSubgroup(const std::vector<int>& ranks,
                                                               int index, const std::string& name,
                                                               absl::Time deadline) override;
  // Nothing to set up: what decides the path is whether the range is shareable memory, which a
  // peer maps whole (its arena) on first use; private memory cannot be made mappable.
  absl::StatusOr<TransferPath> RegisterMemoryImpl(const void* data, size_t bytes,
                                                  uint64_t /*id*/) override {
    if (transport_ == nullptr) return TransferPath::kAny;  // a group of one moves nothing
    if (!transport_->has_local_peers() || !transport_->read_by_every_local_peer()) {
      return TransferPath::kTransport;
    }
    if (transport_->maps_peers() && FindShareable(data, bytes).has_value()) {
      return TransferPath::kMapped;
    }
    return TransferPath::kProcessRead;
  }

  void OnAbort(const absl::Status& reason) override {
    if (transport_ == nullptr) return;
    // A peer's abort notice went to every rank already; anything else is news to the peers.
    if (forward_abort_) {
      transport_->BroadcastAbort(reason);
    } else {
      transport_->MarkAborted();
      transport_->Wake();
    }
  }

 private:
  // The communicator's helpers for one op, as the algorithms see them.
  class OpHooks final : public CollectiveHooks {
   public:
    OpHooks(const UcxCommunicator& comm, const Op& op) : comm_(comm), op_(op) {}
    absl::Status comm_status() const override { return comm_.status(); }
    absl::Status deadline_error(const std::vector<int>& missing) const override {
      return comm_.DeadlineError(op_, missing);
    }
    absl::Status mismatch_error(int a, const CollectiveFingerprint& fa, int b,
                                const CollectiveFingerprint& fb) const override {
      return comm_.MismatchError(op_, a, fa, b, fb);
    }
    std::string describe() const override { return comm_.Describe(op_); }
    void waiting_on(const std::vector<int>& pending) const override {
      comm_.NoteWaitingOn(op_, pending);
    }

   private:
    const UcxCommunicator& comm_;
    const Op& op_;
  };

  absl::Status RunAlone(const Op& op);
  absl::Status RunPointToPoint(const Op& op);
  // Whether an abort raised on this thread must be sent to the peers (false while handling a
  // peer's notice).
  static thread_local bool forward_abort_;

  std::shared_ptr<Store> store_;
  std::unique_ptr<UcxTransport> transport_;  // null for a group of one
  const Tuning tuning_;
  // Reused by every collective (only the stream thread running one touches them; collectives
  // of one communicator never run concurrently).
  std::unique_ptr<ucx_internal::Batch> batch_;
  ucx_internal::RunScratch scratch_;
  // Send and Recv (null for a group of one); destroyed before the transport.
  std::unique_ptr<ucx_internal::PointToPoint> point_to_point_;
};

thread_local bool UcxCommunicator::forward_abort_ = true;

absl::Status UcxCommunicator::RunAlone(const Op& op) {
  const CollectiveFingerprint& fp = op.fingerprint;
  const size_t bytes = fp.count * op.element_size;
  auto copy = [&](void* dst, const void* src) {
    if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
  };
  switch (fp.kind) {
    case CollectiveKind::kAllGather:
    case CollectiveKind::kAllToAll:
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllReduce:
      copy(op.output, op.input);
      return absl::OkStatus();
    case CollectiveKind::kBroadcast:
    case CollectiveKind::kBarrier:
    case CollectiveKind::kSend:  // never issued: a group of one has no peer
    case CollectiveKind::kRecv:
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::Status UcxCommunicator::RunPointToPoint(const Op& op) {
  OpHooks hooks(*this, op);
  if (op.fingerprint.kind == CollectiveKind::kSend) {
    return point_to_point_->Send(op.fingerprint, op.input, op.element_size, hooks);
  }
  std::unique_ptr<ucx_internal::Batch> batch;
  absl::Status status = point_to_point_->Recv(op.fingerprint, op.output, op.element_size,
                                              op.deadline, hooks, op.source.get(), &batch);
  if (!status.ok()) {
    // As for a collective: the peers hear of the failure before the release waits for the
    // cancellation of the receive.
    RecordEnded(op, status);
    Abort(status);
  }
  if (batch != nullptr) transport_->Release(std::move(batch)).reset();
  return status;
}

absl::Status UcxCommunicator::Run(const Op& op) {
  if (size() == 1) return RunAlone(op);
  if (IsPointToPoint(op.fingerprint.kind)) return RunPointToPoint(op);
  // Collectives run in sequence order whichever streams they were issued on (the base class
  // orders them), so every rank runs them in the same order: header tags carry no sequence
  // number and would cross otherwise.
  transport_->BeginCollective();
  absl::Cleanup end = [&] { transport_->EndCollective(); };

  OpHooks hooks(*this, op);
  CollectiveRun run(*transport_, op.fingerprint, op.input, op.output, op.element_size, op.deadline,
                    hooks, tuning_, std::move(batch_), scratch_);
  absl::Status status = ucx_internal::RunCollective(run);
  run.AbandonReads();
  if (!status.ok()) {
    // Tell the peers before the release below waits for cancellations (Launch's Abort is then
    // a no-op). Recorded first, so that the abort's flight dump shows it failed.
    RecordEnded(op, status);
    Abort(status);
    // Where another thread aborted first, its OnAbort may not have marked the mailbox yet: this
    // rank gave up on the collective, and peers may still read the buffers it is about to hand
    // back (RunCollective's last check needs the mark before they can be reused).
    transport_->MarkAborted();
  }
  // The next collective reuses the batch (its slots and buffers) unless requests are still
  // pending after a failure (then the transport keeps it).
  batch_ = transport_->Release(run.TakeBatch());
  return status;
}

absl::StatusOr<std::shared_ptr<Communicator>> UcxCommunicator::CreateSubgroup(
    const std::vector<int>& ranks, int index, const std::string& name, absl::Time deadline) {
  return CreateWithDeadline({.rank = index,
                             .size = static_cast<int>(ranks.size()),
                             .store = store_,
                             .name = name,
                             .timeout = timeout()},
                            tuning_, deadline);
}

absl::StatusOr<std::shared_ptr<Communicator>> CreateWithDeadline(
    const UcxOptions& options, std::optional<Tuning> tuning, std::optional<absl::Time> deadline) {
  const std::string where = absl::StrCat("creating ucx communicator ", options.name);
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": rank ", options.rank,
                                                   " is not in [0, size) for size ", options.size));
  }
  if (options.store == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": store is null"));
  }
  if (options.timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": negative timeout ", absl::FormatDuration(options.timeout)));
  }
  absl::Duration timeout = options.timeout;
  if (timeout == absl::ZeroDuration()) {
    SL_ASSIGN_OR_RETURN(timeout, DefaultTimeout());
  }
  if (!tuning.has_value()) {
    SL_ASSIGN_OR_RETURN(tuning, Tuning::FromEnvironment());
  }
  SL_RETURN_IF_ERROR(ucx_internal::ParamUcxShm().Get().status());
  std::unique_ptr<UcxTransport> transport;
  if (options.size > 1) {
    SL_ASSIGN_OR_RETURN(
        transport, UcxTransport::Create(options.rank, options.size, *options.store, options.name,
                                        *tuning, deadline.value_or(absl::Now() + timeout)));
  }
  auto comm = std::make_shared<UcxCommunicator>(options.rank, options.size, options.name, timeout,
                                                options.store, std::move(transport), *tuning);
  comm->Attach();
  return std::shared_ptr<Communicator>(std::move(comm));
}

}  // namespace

absl::StatusOr<std::shared_ptr<Communicator>> CreateUcxCommunicator(const UcxOptions& options) {
  return CreateWithDeadline(options, std::nullopt, std::nullopt);
}

namespace ucx_internal {

absl::StatusOr<std::shared_ptr<Communicator>> CreateUcxCommunicatorWithTuning(
    const UcxOptions& options, const Tuning& tuning) {
  return CreateWithDeadline(options, tuning, std::nullopt);
}

}  // namespace ucx_internal

}  // namespace shardline
