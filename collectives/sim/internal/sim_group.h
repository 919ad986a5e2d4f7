// File: collectives/sim/internal/sim_group.h
// -----------------------------------------------------------------------------
// The sim backend's two halves (private to collectives/sim/): SimCommunicator, the
// Communicator a rank holds, and SimGroup, the state the ranks of one group share (their
// collectives in flight, keyed by sequence number, and their splits).
//
//   sim_communicator.cc  SimCommunicator, the factories, the cost model without a topology
//   sim_group.cc         a group's collectives: arrival, timeout, completion, data, abort
//   sim_split.cc         a group's splits and the groups they create
//   sim_point_to_point.cc  a group's sends and receives

#ifndef SHARDLINE_COLLECTIVES_SIM_INTERNAL_SIM_GROUP_H_
#define SHARDLINE_COLLECTIVES_SIM_INTERNAL_SIM_GROUP_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/sim/internal/link_arbiter.h"
#include "collectives/sim/sim_communicator.h"
#include "collectives/sim/topology.h"
#include "runtime/check.h"
#include "runtime/stream.h"
#include "runtime/virtual_time.h"

namespace shardline::sim_internal {

class SimGroup;

class SimCommunicator final : public Communicator {
 public:
  // The group works with the validated ops and the API's error helpers.
  using Communicator::DeadlineError;
  using Communicator::Describe;
  using Communicator::MismatchError;
  using Communicator::Op;

  SimCommunicator(int rank, std::shared_ptr<SimGroup> group, std::string name,
                  absl::Duration timeout);

  absl::string_view backend() const override { return "sim"; }
  const std::shared_ptr<SimGroup>& group() const { return group_; }
  bool AcceptsAnyClock() const override { return true; }

 protected:
  absl::Status Run(const Op& op) override {
    return absl::InternalError(
        absl::StrCat(Describe(op), ": the sim backend launches asynchronously; Run is unused"));
  }
  absl::Status Launch(Op op, Stream& stream) override;
  absl::Status CheckStream(const Stream& stream) const override;
  absl::Status CheckPointToPoint(CollectiveKind kind, int peer, uint64_t match_tag) const override;
  absl::StatusOr<std::shared_ptr<Communicator>> SplitImpl(int color, int key,
                                                          absl::Time deadline) override;
  absl::StatusOr<std::shared_ptr<Communicator>> CreateSubgroup(const std::vector<int>& ranks,
                                                               int index, const std::string& name,
                                                               absl::Time deadline) override;
  void OnAbort(const absl::Status& reason) override;

 private:
  const std::shared_ptr<SimGroup> group_;
  uint64_t splits_ = 0;  // Split calls so far (collective: every rank counts the same)
  std::mutex split_mu_;
};

// The state the ranks of one group share: the collectives in flight, keyed by sequence number.
class SimGroup : public std::enable_shared_from_this<SimGroup> {
 public:
  // With options.topology: `arbiter` shares the links of every group of the simulation, and
  // options.devices holds one device per rank (validated). representative >= 0: only that rank
  // exists (representative mode, sim_communicator.h).
  SimGroup(VirtualTimeline& timeline, int size, const SimOptions& options,
           std::shared_ptr<LinkArbiter> arbiter, int representative = -1)
      : timeline_(timeline),
        size_(size),
        options_(options),
        arbiter_(std::move(arbiter)),
        representative_(representative),
        issued_(size, 0),
        inboxes_(size),
        receivers_(size) {
    if (options_.topology != nullptr) {
      absl::StatusOr<GroupShape> shape = GroupShapeOf(*options_.topology, options_.devices);
      SL_CHECK_OK(shape.status());
      shape_ = *shape;
    }
  }

  int size() const { return size_; }
  const std::string& name() const { return options_.name; }
  // The ranks that exist: all of them, or the representative alone.
  int present() const { return representative_ < 0 ? size_ : 1; }

  // A rank's collective was issued (for stall reports).
  void NoteIssued(int rank, uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu_);
    issued_[rank] = std::max(issued_[rank], seq + 1);
  }

  // A rank's stream reached its collective at `start`. `done` ends it on that stream.
  void Arrive(std::shared_ptr<SimCommunicator> comm, const SimCommunicator::Op& op,
              absl::Time start, VirtualAsyncDone done);

  // What the collective `seq` waits for: "all_gather #3 on world (sim; ranks waiting: 0; not
  // issued: 1)".
  std::string DescribeWait(const CollectiveFingerprint& fp);

  // Point-to-point (sim_point_to_point.cc; the rules in communicator.h). A send ends on its
  // stream at `start` (its data copied, when the simulation moves data); its message reaches
  // the receiver one message's cost later: SimCollectiveCost(kSend), or with a topology its
  // latency, then its transfer over the two devices' ports, shared like a collective's. A
  // receive ends when its message has arrived: at its start if it had, else at the arrival;
  // at its deadline, DeadlineExceeded.
  void Send(std::shared_ptr<SimCommunicator> comm, const SimCommunicator::Op& op, absl::Time start,
            VirtualAsyncDone done);
  void Receive(std::shared_ptr<SimCommunicator> comm, const SimCommunicator::Op& op,
               absl::Time start, VirtualAsyncDone done);
  // "recv #2 from rank 1 on world (sim; no matching message has arrived)".
  std::string DescribePointToPoint(const CollectiveFingerprint& fp, int rank);

  // Fails every collective in flight, and every later one, with `reason` (from rank `rank`).
  void Abort(int rank, const absl::Status& reason) {
    Fail(MarkPeerError(absl::Status(reason.code(), absl::StrCat("peer rank ", rank,
                                                                " aborted: ", reason.message())),
                       absl::StrCat(rank)),
         rank, reason);
  }
  // The same with `status` for every rank but `own_rank`, which gets `own` (-1: none).
  void Fail(const absl::Status& status, int own_rank = -1, const absl::Status& own = {});

  struct SplitResult {
    std::vector<int> members;
    int index = -1;
  };
  absl::StatusOr<SplitResult> Split(uint64_t split, int rank, int color, int key,
                                    absl::Time deadline);

  // The group that the members of a split called `name` share (`members`: their ranks in this
  // group, in their new order); created by the first of them.
  std::shared_ptr<SimGroup> Child(const std::string& name, const std::vector<int>& members);

  VirtualTimeline& timeline() const { return timeline_; }
  const std::shared_ptr<LinkArbiter>& arbiter() const { return arbiter_; }

 private:
  struct Arrival {
    std::shared_ptr<SimCommunicator> comm;
    SimCommunicator::Op op;
    absl::Time at;
    VirtualAsyncDone done;
    std::optional<VirtualTimer> timer;
  };
  // One collective in flight: the ranks that arrived.
  struct Pending {
    std::vector<std::optional<Arrival>> ranks;
    int arrived = 0;
  };
  // A sent message, in its receiver's inbox from its send until a receive takes it.
  struct Message {
    int from = 0;
    CollectiveFingerprint send;
    std::shared_ptr<uint8_t[]> data;  // null when the simulation moves no data
    bool arrived = false;
    uint64_t arrival = 0;  // order of arrival, once arrived
  };
  struct ChildEntry {
    std::shared_ptr<SimGroup> group;
    int joined = 0;
  };
  struct SplitEntry {
    enum Mode : uint8_t { kUnknown, kDup, kGeneral };
    Mode mode = kUnknown;
    std::vector<std::optional<std::pair<int, int>>> calls;  // (color, key) per rank
    int arrived = 0;
    int left = 0;
  };

  void TimeOut(uint64_t seq, int rank);
  // Point-to-point: the message a waiting receive of `fp` takes from `inbox` (inbox.end() if
  // none yet) — per source the first of its tag, the earliest arrived among them.
  static std::deque<Message>::iterator Candidate(std::deque<Message>& inbox,
                                                 const CollectiveFingerprint& fp);
  // Matches `rank`'s waiting receives with arrived messages (mu_ held); the matched receives
  // are moved to `ready` with their messages, to be finished without the lock.
  void Match(int rank, std::vector<std::pair<Arrival, Message>>* ready);
  void FinishReceives(std::vector<std::pair<Arrival, Message>> ready);
  void ReceiveTimeOut(int rank, uint64_t seq);
  // Every rank arrived: compare fingerprints, then complete at the last arrival + cost.
  void Complete(std::vector<Arrival> ranks);
  // At the completion time: move the data and end the collective on every rank.
  void Finish(std::vector<Arrival> ranks);
  absl::Status Move(const std::vector<Arrival>& ranks) const;

  VirtualTimeline& timeline_;
  const int size_;
  const SimOptions options_;
  const std::shared_ptr<LinkArbiter> arbiter_;  // with a topology
  GroupShape shape_;                            // with a topology
  const int representative_;                    // -1: every rank exists
  std::mutex mu_;
  std::condition_variable split_cv_;
  absl::Status status_;
  std::map<uint64_t, Pending> pending_;
  std::vector<uint64_t> issued_;
  std::map<uint64_t, SplitEntry> splits_;
  std::map<std::string, ChildEntry> children_;
  std::vector<std::deque<Message>> inboxes_;    // per receiving rank
  std::vector<std::deque<Arrival>> receivers_;  // per rank: its waiting receives, in order
  uint64_t arrivals_ = 0;
};

}  // namespace shardline::sim_internal

#endif  // SHARDLINE_COLLECTIVES_SIM_INTERNAL_SIM_GROUP_H_
