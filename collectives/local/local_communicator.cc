#include "collectives/local/local_communicator.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "absl/strings/str_cat.h"
#include "collectives/internal/data_movement.h"
#include "runtime/config.h"
#include "runtime/status.h"

namespace shardline {
namespace {

// The state shared by the ranks of one group.
class LocalGroup {
 public:
  LocalGroup(int size, std::string name)
      : size_(size), name_(std::move(name)), slots_(size), inboxes_(size) {}

  int size() const { return size_; }

  struct Slot {
    CollectiveFingerprint fingerprint;
    const void* input = nullptr;
    void* output = nullptr;
    uint64_t phases = 0;  // barrier phases this rank has entered
  };

  // Posts rank's slot for a new collective (before its first phase).
  void Post(int rank, const CollectiveFingerprint& fp, const void* input, void* output) {
    std::lock_guard<std::mutex> lock(mu_);
    Slot& slot = slots_[rank];
    slot.fingerprint = fp;
    slot.input = input;
    slot.output = output;
  }

  // Enters the next barrier phase and waits until every rank has entered it. On a deadline,
  // fills `missing` with the ranks that had not and sets `timed_out` (OK status); on an abort,
  // fills `missing` the same way and returns the abort's status.
  absl::Status Arrive(int rank, const Clock& clock, absl::Time deadline, std::vector<int>* missing,
                      bool* timed_out) {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t target = ++slots_[rank].phases;
    cv_.notify_all();
    auto all_arrived = [&] {
      return std::all_of(slots_.begin(), slots_.end(),
                         [&](const Slot& s) { return s.phases >= target; });
    };
    const bool woken =
        clock.WaitUntil(cv_, lock, deadline, [&] { return all_arrived() || !status_.ok(); });
    if (!woken || !status_.ok()) {
      for (int r = 0; r < size_; ++r) {
        if (slots_[r].phases < target) missing->push_back(r);
      }
    }
    if (!woken) {
      *timed_out = true;
      return absl::OkStatus();
    }
    return status_;
  }

  // The ranks that have not yet entered the phase `rank` waits in (empty if it waits in none).
  std::vector<int> Awaited(int rank) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int> awaited;
    for (int r = 0; r < size_; ++r) {
      if (slots_[r].phases < slots_[rank].phases) awaited.push_back(r);
    }
    return awaited;
  }

  // Snapshot of every rank's slot; valid between two phases that all ranks have passed.
  std::vector<Slot> Slots() {
    std::lock_guard<std::mutex> lock(mu_);
    return slots_;
  }

  // Point-to-point: a sent message, copied out of its sender's buffer (so a send never waits
  // for its receive, and two ranks that both send first do not deadlock).
  struct Message {
    int from = 0;
    CollectiveFingerprint send;  // the sender's
    std::unique_ptr<uint8_t[]> data;
  };

  // Queues `message` for rank `to`; the group's abort status if it was aborted.
  absl::Status Deliver(int to, Message message) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status_.ok()) return status_;
    inboxes_[to].push_back(std::move(message));
    cv_.notify_all();
    return absl::OkStatus();
  }

  // Takes the earliest message to `rank` from `from` (kAnySource: from anyone) with message tag
  // `tag`, waiting for one until `deadline` (then sets `timed_out`, OK status) or an abort (its
  // status).
  absl::Status Take(int rank, int from, uint64_t tag, const Clock& clock, absl::Time deadline,
                    Message* out, bool* timed_out) {
    std::unique_lock<std::mutex> lock(mu_);
    std::deque<Message>& inbox = inboxes_[rank];
    auto match = inbox.end();
    const bool woken = clock.WaitUntil(cv_, lock, deadline, [&] {
      match = std::find_if(inbox.begin(), inbox.end(), [&](const Message& m) {
        return (from == kAnySource || m.from == from) && m.send.key == tag;
      });
      return match != inbox.end() || !status_.ok();
    });
    if (!status_.ok()) return status_;
    if (!woken) {
      *timed_out = true;
      return absl::OkStatus();
    }
    *out = std::move(*match);
    inbox.erase(match);
    return absl::OkStatus();
  }

  void Abort(const absl::Status& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) status_ = reason;
    cv_.notify_all();
  }

  // The group that the members of a split called `name` share; created by the first of them.
  std::shared_ptr<LocalGroup> Child(const std::string& name, int size) {
    std::lock_guard<std::mutex> lock(mu_);
    ChildEntry& entry = children_[name];
    if (entry.group == nullptr) entry.group = std::make_shared<LocalGroup>(size, name);
    std::shared_ptr<LocalGroup> group = entry.group;
    if (++entry.joined == size) children_.erase(name);  // every member has its reference
    return group;
  }

 private:
  struct ChildEntry {
    std::shared_ptr<LocalGroup> group;
    int joined = 0;
  };

  const int size_;
  const std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> slots_;
  std::vector<std::deque<Message>> inboxes_;  // per receiving rank, in arrival order
  absl::Status status_;
  std::map<std::string, ChildEntry> children_;
};

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(int rank, std::shared_ptr<LocalGroup> group, std::string name,
                    absl::Duration timeout)
      : Communicator(rank, group->size(), Device::Host(), std::move(name), timeout),
        group_(std::move(group)) {}

  absl::string_view backend() const override { return "local"; }
  bool AcceptsAnyClock() const override { return true; }

 protected:
  absl::Status Run(const Op& op) override;
  absl::Status CheckPointToPoint(CollectiveKind kind, int peer, uint64_t match_tag) const override {
    return absl::OkStatus();
  }
  absl::StatusOr<std::shared_ptr<Communicator>> CreateSubgroup(const std::vector<int>& ranks,
                                                               int index, const std::string& name,
                                                               absl::Time deadline) override {
    std::shared_ptr<LocalGroup> child = group_->Child(name, static_cast<int>(ranks.size()));
    return std::shared_ptr<Communicator>(
        std::make_shared<LocalCommunicator>(index, std::move(child), name, timeout()));
  }
  std::optional<std::vector<int>> WaitingOn() const override { return group_->Awaited(rank()); }
  void OnAbort(const absl::Status& reason) override {
    group_->Abort(MarkPeerError(
        absl::Status(reason.code(),
                     absl::StrCat("peer rank ", rank(), " aborted: ", reason.message())),
        absl::StrCat(rank())));
  }

 private:
  absl::Status Phase(const Op& op) {
    std::vector<int> missing;
    bool timed_out = false;
    absl::Status status = group_->Arrive(rank(), *op.clock, op.deadline, &missing, &timed_out);
    if (timed_out) return DeadlineError(op, missing);
    if (!status.ok()) {
      if (!missing.empty()) NoteWaitingOn(op, missing);  // whom it waited for when aborted
      return Annotate(status, Describe(op));
    }
    return absl::OkStatus();
  }

  absl::Status Move(const Op& op, const std::vector<LocalGroup::Slot>& slots);
  absl::Status RunSend(const Op& op);
  absl::Status RunRecv(const Op& op);

  std::shared_ptr<LocalGroup> group_;
};

absl::Status LocalCommunicator::RunSend(const Op& op) {
  LocalGroup::Message message;
  message.from = rank();
  message.send = op.fingerprint;
  const size_t bytes = op.fingerprint.count * op.element_size;
  absl::StatusOr<std::unique_ptr<uint8_t[]>> data = data_movement::AllocateScratch(bytes);
  if (!data.ok()) return Annotate(data.status(), Describe(op));
  message.data = *std::move(data);
  if (bytes > 0) std::memcpy(message.data.get(), op.input, bytes);
  absl::Status delivered = group_->Deliver(op.fingerprint.root, std::move(message));
  return delivered.ok() ? delivered : Annotate(delivered, Describe(op));
}

absl::Status LocalCommunicator::RunRecv(const Op& op) {
  const CollectiveFingerprint& fp = op.fingerprint;
  LocalGroup::Message message;
  bool timed_out = false;
  absl::Status status =
      group_->Take(rank(), fp.root, fp.key, *op.clock, op.deadline, &message, &timed_out);
  if (!status.ok()) return Annotate(status, Describe(op));
  if (timed_out) {
    std::vector<int> awaited;
    for (int r = 0; r < size(); ++r) {
      if (r != rank() && (fp.root == kAnySource || r == fp.root)) awaited.push_back(r);
    }
    return DeadlineError(op, awaited);
  }
  if (message.send.count != fp.count || message.send.dtype != fp.dtype) {
    return MarkPeerError(
        absl::InvalidArgumentError(absl::StrCat(
            Describe(op), ": rank ", message.from, " sent ", message.send.CallString(),
            " but this rank receives ", fp.CallString(), ": sizes and dtypes must match")),
        absl::StrCat(message.from));
  }
  const size_t bytes = fp.count * op.element_size;
  if (bytes > 0) std::memcpy(op.output, message.data.get(), bytes);
  op.source->store(message.from, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status LocalCommunicator::Run(const Op& op) {
  if (op.fingerprint.kind == CollectiveKind::kSend) return RunSend(op);
  if (op.fingerprint.kind == CollectiveKind::kRecv) return RunRecv(op);
  group_->Post(rank(), op.fingerprint, op.input, op.output);
  SL_RETURN_IF_ERROR(Phase(op));
  const std::vector<LocalGroup::Slot> slots = group_->Slots();
  // Every rank runs the same comparison, so every rank reports the same pair.
  for (int r = 1; r < size(); ++r) {
    if (!(slots[r].fingerprint == slots[0].fingerprint)) {
      return MismatchError(op, 0, slots[0].fingerprint, r, slots[r].fingerprint);
    }
  }
  SL_RETURN_IF_ERROR(Move(op, slots));
  // Nobody may reuse its buffers, or post its next collective's slot, before every peer has
  // finished reading this one's (a barrier too: its peers are still comparing fingerprints).
  return Phase(op);
}

absl::Status LocalCommunicator::Move(const Op& op, const std::vector<LocalGroup::Slot>& slots) {
  const CollectiveFingerprint& fp = op.fingerprint;
  std::vector<const void*> inputs;
  for (const LocalGroup::Slot& slot : slots) inputs.push_back(slot.input);
  if (fp.kind != CollectiveKind::kAllReduce) {
    return data_movement::WriteRankOutput(fp, op.element_size, inputs, rank(), op.output);
  }
  // Rank r reduces block r of every input (in rank order, so the result does not depend on who
  // computed it), then writes it into every rank's output once all inputs are read.
  const int n = size();
  const size_t per = (fp.count + n - 1) / n;
  const size_t begin = std::min(fp.count, per * rank());
  const size_t len = std::min(fp.count, begin + per) - begin;
  // Memory that cannot be had is this collective's error (the communicator aborts and the peers
  // waiting in the next phase get it).
  absl::StatusOr<std::unique_ptr<uint8_t[]>> scratch =
      data_movement::AllocateScratch(len * op.element_size);
  if (!scratch.ok()) return Annotate(scratch.status(), Describe(op));
  SL_RETURN_IF_ERROR(
      data_movement::ReduceSlice(fp, op.element_size, inputs, begin, len, scratch->get()));
  SL_RETURN_IF_ERROR(Phase(op));
  std::vector<void*> outputs;
  for (const LocalGroup::Slot& slot : slots) outputs.push_back(slot.output);
  data_movement::CopyIntoEach(outputs, begin * op.element_size, scratch->get(),
                              len * op.element_size);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> CreateLocalCommunicators(
    int size, const LocalOptions& options) {
  if (size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("local communicator size must be at least 1, got ", size));
  }
  absl::Duration timeout = options.timeout;
  if (timeout == absl::ZeroDuration()) {
    SL_ASSIGN_OR_RETURN(timeout, DefaultTimeout());
  }
  auto group = std::make_shared<LocalGroup>(size, options.name);
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) {
    comms.push_back(std::make_shared<LocalCommunicator>(r, group, options.name, timeout));
  }
  return comms;
}

}  // namespace shardline
