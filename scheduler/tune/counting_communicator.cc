// The counting wrapper (scheduler/tune/counting_communicator.h). The base class validates,
// numbers and orders each collective as it does for any backend; Launch() then records it and
// issues the same call on the wrapped communicator, which validates, orders and runs it again
// by its own rules, so the wrapper changes nothing the wrapped backend does.

#include "scheduler/tune/counting_communicator.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"

namespace shardline {

uint64_t CollectivePayloadBytes(CollectiveKind kind, uint64_t count, size_t element_size,
                                int size) {
  const uint64_t e = element_size, n = static_cast<uint64_t>(size);
  switch (kind) {
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllToAll:
      return count * n * e;
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kBroadcast:
    case CollectiveKind::kSend:
    case CollectiveKind::kRecv:
      return count * e;
    case CollectiveKind::kBarrier:
      return 0;
  }
  return 0;
}

uint64_t RingSentBytesTimesSize(CollectiveKind kind, uint64_t payload_bytes, int size) {
  const uint64_t n1 = static_cast<uint64_t>(size) - 1;
  switch (kind) {
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllToAll:
    case CollectiveKind::kBroadcast:
      return n1 * payload_bytes;
    case CollectiveKind::kAllReduce:
      return 2 * n1 * payload_bytes;
    case CollectiveKind::kBarrier:
      return 0;
    case CollectiveKind::kSend:  // the payload once, from one rank: size x (payload / size)
    case CollectiveKind::kRecv:
      return payload_bytes;
  }
  return 0;
}

void CollectiveCounter::Record(const std::string& communicator, int size, CollectiveKind kind,
                               uint64_t payload_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  CollectiveTally& t = totals_[Key{communicator, size, kind}];
  ++t.calls;
  t.payload_bytes += payload_bytes;
  t.ring_sent_bytes_times_size += RingSentBytesTimesSize(kind, payload_bytes, size);
}

std::map<CollectiveCounter::Key, CollectiveTally> CollectiveCounter::Totals() const {
  std::lock_guard<std::mutex> lock(mu_);
  return totals_;
}

CollectiveTally SumTallies(const std::map<CollectiveCounter::Key, CollectiveTally>& totals,
                           CollectiveKind kind, int size) {
  CollectiveTally sum;
  for (const auto& [key, t] : totals) {
    if (key.kind != kind || (size != 0 && key.size != size)) continue;
    sum.calls += t.calls;
    sum.payload_bytes += t.payload_bytes;
    sum.ring_sent_bytes_times_size += t.ring_sent_bytes_times_size;
  }
  return sum;
}

CollectiveTally CollectiveCounter::Sum(CollectiveKind kind, int size) const {
  std::lock_guard<std::mutex> lock(mu_);
  return SumTallies(totals_, kind, size);
}

double CollectiveCounter::RingSentBytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  double bytes = 0;
  for (const auto& [key, t] : totals_) {
    bytes += static_cast<double>(t.ring_sent_bytes_times_size) / key.size;
  }
  return bytes;
}

void CollectiveCounter::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  totals_.clear();
}

namespace {

class CountingCommunicator final : public Communicator {
 public:
  CountingCommunicator(std::shared_ptr<Communicator> inner,
                       std::shared_ptr<CollectiveCounter> counter)
      : Communicator(inner->rank(), inner->size(), inner->device(), inner->name(),
                     inner->timeout()),
        inner_(std::move(inner)),
        counter_(std::move(counter)) {}

  absl::string_view backend() const override { return inner_->backend(); }

 protected:
  absl::Status Run(const Op& op) override {
    // Launch() never calls it.
    return absl::InternalError(absl::StrCat(Describe(op), ": Run on a counting wrapper"));
  }

  absl::Status Launch(Op op, Stream& stream) override {
    const CollectiveFingerprint& fp = op.fingerprint;
    const CollectiveOptions options{.timeout = op.timeout};
    ReduceOptions reduce;
    reduce.timeout = op.timeout;
    reduce.op = fp.op;
    absl::StatusOr<Work> work;
    switch (fp.kind) {
      case CollectiveKind::kAllGather:
        work = inner_->AllGather(op.input, op.output, fp.count, fp.dtype, stream, options);
        break;
      case CollectiveKind::kReduceScatter:
        work = inner_->ReduceScatter(op.input, op.output, fp.count, fp.dtype, stream, reduce);
        break;
      case CollectiveKind::kAllReduce:
        work = inner_->AllReduce(op.input, op.output, fp.count, fp.dtype, stream, reduce);
        break;
      case CollectiveKind::kBroadcast: {
        BroadcastOptions b;
        b.timeout = op.timeout;
        b.root = fp.root;
        work = inner_->Broadcast(op.output, fp.count, fp.dtype, stream, b);
        break;
      }
      case CollectiveKind::kAllToAll:
        work = inner_->AllToAll(op.input, op.output, fp.count, fp.dtype, stream, options);
        break;
      case CollectiveKind::kBarrier:
        work = inner_->Barrier(stream, options);
        break;
      case CollectiveKind::kSend:  // never issued here: CheckPointToPoint refuses them
      case CollectiveKind::kRecv:
        return absl::InternalError("the counting communicator has no point-to-point");
    }
    // Counted once the wrapped communicator has taken it.
    if (work.ok()) {
      counter_->Record(name(), size(), fp.kind,
                       CollectivePayloadBytes(fp.kind, fp.count, op.element_size, size()));
    }
    return work.status();
  }

  // The wrapped communicator checks the stream (and its clock) when the call reaches it.
  absl::Status CheckStream(const Stream&) const override { return absl::OkStatus(); }
  bool AcceptsAnyClock() const override { return true; }

  absl::StatusOr<std::shared_ptr<Communicator>> SplitImpl(int color, int key,
                                                          absl::Time deadline) override {
    SL_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> split, inner_->Split(color, key, deadline));
    return WrapCounting(std::move(split), counter_);
  }

  absl::StatusOr<std::shared_ptr<Communicator>> CreateSubgroup(const std::vector<int>&, int,
                                                               const std::string& name,
                                                               absl::Time) override {
    // SplitImpl() never calls it.
    return absl::InternalError(
        absl::StrCat("counting wrapper of ", this->name(), ": CreateSubgroup(", name, ")"));
  }

  void OnAbort(const absl::Status& reason) override { inner_->Abort(reason); }

 private:
  std::shared_ptr<Communicator> inner_;
  std::shared_ptr<CollectiveCounter> counter_;
};

}  // namespace

std::shared_ptr<Communicator> WrapCounting(std::shared_ptr<Communicator> inner,
                                           std::shared_ptr<CollectiveCounter> counter) {
  if (inner == nullptr) return nullptr;
  return std::make_shared<CountingCommunicator>(std::move(inner), std::move(counter));
}

}  // namespace shardline
