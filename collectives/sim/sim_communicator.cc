#include "collectives/sim/sim_communicator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collectives/internal/data_movement.h"
#include "collectives/sim/internal/link_arbiter.h"
#include "runtime/check.h"
#include "runtime/config.h"
#include "runtime/status.h"

namespace shardline {
namespace {

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
           std::shared_ptr<sim_internal::LinkArbiter> arbiter, int representative = -1)
      : timeline_(timeline),
        size_(size),
        options_(options),
        arbiter_(std::move(arbiter)),
        representative_(representative),
        issued_(size, 0) {
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
  std::shared_ptr<SimGroup> Child(const std::string& name, const std::vector<int>& members) {
    const int size = static_cast<int>(members.size());
    std::lock_guard<std::mutex> lock(mu_);
    ChildEntry& entry = children_[name];
    if (entry.group == nullptr) {
      SimOptions options = options_;
      options.name = name;
      options.split_call = nullptr;  // representative mode: a split of a split is not modelled
      if (options.topology != nullptr) {
        options.devices.clear();
        for (const int member : members) options.devices.push_back(options_.devices[member]);
      }
      int representative = -1;
      if (representative_ >= 0) {
        representative = static_cast<int>(
            std::find(members.begin(), members.end(), representative_) - members.begin());
      }
      entry.group = std::make_shared<SimGroup>(timeline_, size, options, arbiter_, representative);
    }
    std::shared_ptr<SimGroup> group = entry.group;
    if (++entry.joined == group->present()) children_.erase(name);
    return group;
  }

  VirtualTimeline& timeline() const { return timeline_; }
  const std::shared_ptr<sim_internal::LinkArbiter>& arbiter() const { return arbiter_; }

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
  // Every rank arrived: compare fingerprints, then complete at the last arrival + cost.
  void Complete(std::vector<Arrival> ranks);
  // At the completion time: move the data and end the collective on every rank.
  void Finish(std::vector<Arrival> ranks);
  absl::Status Move(const std::vector<Arrival>& ranks) const;

  VirtualTimeline& timeline_;
  const int size_;
  const SimOptions options_;
  const std::shared_ptr<sim_internal::LinkArbiter> arbiter_;  // with a topology
  GroupShape shape_;                                          // with a topology
  const int representative_;                                  // -1: every rank exists
  std::mutex mu_;
  std::condition_variable split_cv_;
  absl::Status status_;
  std::map<uint64_t, Pending> pending_;
  std::vector<uint64_t> issued_;
  std::map<uint64_t, SplitEntry> splits_;
  std::map<std::string, ChildEntry> children_;
};

// ---- SimGroup: collectives -----------------------------------------------------------------

void SimGroup::Arrive(std::shared_ptr<SimCommunicator> comm, const SimCommunicator::Op& op,
                      absl::Time start, VirtualAsyncDone done) {
  const uint64_t seq = op.fingerprint.seq;
  const int rank = comm->rank();
  std::unique_lock<std::mutex> lock(mu_);
  if (!status_.ok()) {
    absl::Status status = Annotate(status_, comm->Describe(op));
    lock.unlock();
    std::move(done)(std::move(status), start);
    return;
  }
  Pending& pending = pending_[seq];
  if (pending.ranks.empty()) pending.ranks.resize(size_);
  pending.ranks[rank] = Arrival{std::move(comm), op, start, std::move(done), std::nullopt};
  if (++pending.arrived == present()) {
    std::vector<Arrival> ranks;
    for (std::optional<Arrival>& arrival : pending.ranks) {
      if (arrival.has_value()) ranks.push_back(std::move(*arrival));
    }
    pending_.erase(seq);
    lock.unlock();
    for (Arrival& arrival : ranks) {
      if (arrival.timer.has_value()) timeline_.Cancel(*arrival.timer);
    }
    Complete(std::move(ranks));
    return;
  }
  lock.unlock();
  // A timeout only fires if other work moves the clock past it (it is not progress).
  const VirtualTimer timer = timeline_.ScheduleAt(
      start + op.timeout, [self = shared_from_this(), seq, rank] { self->TimeOut(seq, rank); },
      /*progress=*/false);
  lock.lock();
  auto it = pending_.find(seq);
  if (it != pending_.end() && it->second.ranks[rank].has_value()) {
    it->second.ranks[rank]->timer = timer;
  } else {
    lock.unlock();
    timeline_.Cancel(timer);
  }
}

void SimGroup::TimeOut(uint64_t seq, int rank) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = pending_.find(seq);
  if (it == pending_.end() || !it->second.ranks[rank].has_value()) return;
  std::vector<int> missing;
  for (int r = 0; r < size_; ++r) {
    if (!it->second.ranks[r].has_value()) missing.push_back(r);
  }
  Arrival arrival = std::move(*it->second.ranks[rank]);
  it->second.ranks[rank].reset();
  --it->second.arrived;
  lock.unlock();
  absl::Status status = arrival.comm->DeadlineError(arrival.op, missing);
  std::move(arrival.done)(std::move(status), timeline_.Now());
}

void SimGroup::Complete(std::vector<Arrival> ranks) {
  absl::Time last = ranks[0].at;
  for (const Arrival& arrival : ranks) last = std::max(last, arrival.at);
  // Every rank runs the same comparison, so every rank reports the same pair.
  const CollectiveFingerprint& first = ranks[0].op.fingerprint;
  for (int r = 1; r < static_cast<int>(ranks.size()); ++r) {
    const CollectiveFingerprint& other = ranks[r].op.fingerprint;
    if (other == first) continue;
    for (Arrival& arrival : ranks) {
      absl::Status status = arrival.comm->MismatchError(arrival.op, 0, first, r, other);
      std::move(arrival.done)(std::move(status), last);
    }
    return;
  }
  if (options_.topology == nullptr) {
    const absl::Duration cost =
        SimCollectiveCost(first.kind, first.count, first.dtype, size_, options_);
    timeline_.ScheduleAt(last + cost,
                         [self = shared_from_this(), ranks = std::move(ranks)]() mutable {
                           self->Finish(std::move(ranks));
                         });
    return;
  }
  // The shape fits the topology (checked when the group was made), so the estimate cannot fail.
  absl::StatusOr<CollectiveCost> cost =
      EstimateCollective(*options_.topology, first.kind, first.count, first.dtype, shape_);
  SL_CHECK_OK(cost.status());
  std::vector<int64_t> ports;
  // Representative mode: only its own device's ports (by symmetry the others' carry the same).
  const std::vector<int> own = representative_ >= 0
                                   ? std::vector<int>{options_.devices[representative_]}
                                   : std::vector<int>{};
  // Host sharing: every rank copies with one thread on its node's host while the transfer runs.
  // With host_lockstep, the threads of all the group's ranks on a host (the representative's
  // peers included) must run at once.
  std::map<int, std::pair<int, int>> host_threads;
  const bool host_sharing = timeline_.options().host_cores > 0 && size_ > 1;
  const int per_node = options_.topology->devices_per_node;
  for (const int device : representative_ >= 0 ? own : options_.devices) {
    if (size_ > 1) arbiter_->Count(device, cost->intra_bytes, cost->inter_bytes);
    if (cost->uses_intra()) ports.push_back(sim_internal::LinkArbiter::Port(device, 0));
    if (cost->uses_inter()) ports.push_back(sim_internal::LinkArbiter::Port(device, 1));
    if (host_sharing)
      host_threads[device / per_node] = {host_threads[device / per_node].first + 1, 1};
  }
  if (host_sharing && timeline_.options().host_lockstep) {
    for (const int device : options_.devices) {
      if (auto it = host_threads.find(device / per_node); it != host_threads.end()) {
        it->second.second = 0;
      }
    }
    for (const int device : options_.devices) {
      if (auto it = host_threads.find(device / per_node); it != host_threads.end()) {
        ++it->second.second;
      }
    }
  }
  // The latency phase shares nothing; the transfer phase shares the ports.
  timeline_.ScheduleAt(
      last + absl::Seconds(cost->latency_s),
      [self = shared_from_this(), ranks = std::move(ranks), ports = std::move(ports),
       host_threads = std::move(host_threads), transfer = cost->transfer_s]() mutable {
        if (transfer <= 0) {
          self->Finish(std::move(ranks));
          return;
        }
        self->arbiter_->Start(
            ports, host_threads, transfer,
            [self, ranks = std::move(ranks)]() mutable { self->Finish(std::move(ranks)); });
      });
}

void SimGroup::Finish(std::vector<Arrival> ranks) {
  absl::Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    status = status_;  // aborted while the collective ran: it fails
  }
  if (status.ok() && options_.move_data && timeline_.options().run_ops) status = Move(ranks);
  const absl::Time now = timeline_.Now();
  for (Arrival& arrival : ranks) {
    std::move(arrival.done)(Annotate(status, arrival.comm->Describe(arrival.op)), now);
  }
}

absl::Status SimGroup::Move(const std::vector<Arrival>& ranks) const {
  const CollectiveFingerprint& fp = ranks[0].op.fingerprint;
  const size_t esize = ranks[0].op.element_size;
  std::vector<const void*> inputs;
  std::vector<void*> outputs;
  for (const Arrival& arrival : ranks) {
    inputs.push_back(arrival.op.input);
    outputs.push_back(arrival.op.output);
  }
  if (fp.kind != CollectiveKind::kAllReduce) {
    for (int r = 0; r < size_; ++r) {
      SL_RETURN_IF_ERROR(data_movement::WriteRankOutput(fp, esize, inputs, r, outputs[r]));
    }
    return absl::OkStatus();
  }
  // Into scratch first: in place, every output is also an input.
  const size_t bytes = fp.count * esize;
  SL_ASSIGN_OR_RETURN(std::unique_ptr<uint8_t[]> scratch, data_movement::AllocateScratch(bytes));
  SL_RETURN_IF_ERROR(data_movement::ReduceSlice(fp, esize, inputs, 0, fp.count, scratch.get()));
  data_movement::CopyIntoEach(outputs, 0, scratch.get(), bytes);
  return absl::OkStatus();
}

std::string SimGroup::DescribeWait(const CollectiveFingerprint& fp) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string what =
      absl::StrCat(CollectiveName(fp.kind), " #", fp.seq, " on ", options_.name, " (sim; ");
  auto it = pending_.find(fp.seq);
  if (!status_.ok() || it == pending_.end()) return absl::StrCat(what, "completing)");
  std::vector<int> waiting, queued, not_issued;
  for (int r = 0; r < size_; ++r) {
    if (it->second.ranks[r].has_value()) {
      waiting.push_back(r);
    } else if (issued_[r] > fp.seq) {
      queued.push_back(r);
    } else {
      not_issued.push_back(r);
    }
  }
  std::vector<std::string> parts;
  parts.push_back(absl::StrCat("ranks waiting: ", absl::StrJoin(waiting, ", ")));
  if (!queued.empty()) {
    parts.push_back(
        absl::StrCat("issued, not reached by their streams: ", absl::StrJoin(queued, ", ")));
  }
  if (!not_issued.empty()) {
    parts.push_back(absl::StrCat("not issued: ", absl::StrJoin(not_issued, ", ")));
  }
  return absl::StrCat(what, absl::StrJoin(parts, "; "), ")");
}

void SimGroup::Fail(const absl::Status& peer_status, int own_rank, const absl::Status& own) {
  std::vector<Arrival> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status_.ok()) return;
    status_ = peer_status;
    for (auto& [seq, pending] : pending_) {
      for (std::optional<Arrival>& arrival : pending.ranks) {
        if (arrival.has_value()) failed.push_back(std::move(*arrival));
      }
    }
    pending_.clear();
  }
  // Abort may come from any thread; the collectives end inside the engine, now.
  for (Arrival& arrival : failed) {
    if (arrival.timer.has_value()) timeline_.Cancel(*arrival.timer);
    absl::Status status = arrival.comm->rank() == own_rank ? own : peer_status;
    timeline_.ScheduleAt(
        timeline_.Now(), [this_group = shared_from_this(), arrival = std::move(arrival),
                          status = std::move(status)]() mutable {
          std::move(arrival.done)(Annotate(status, arrival.comm->Describe(arrival.op)),
                                  this_group->timeline_.Now());
        });
  }
}

absl::StatusOr<SimGroup::SplitResult> SimGroup::Split(uint64_t split, int rank, int color, int key,
                                                      absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  SplitEntry& entry = splits_[split];
  if (entry.calls.empty()) entry.calls.resize(size_);
  const std::string where = absl::StrCat("split #", split, " of ", options_.name, " (sim, rank ",
                                         rank, " of ", size_, ")");
  SplitResult result;
  const bool dup = color == 0 && key == rank;
  // Representative mode: a group with split_call takes every split from it; one without (a
  // split's group) only Dups.
  const bool take_as_dup =
      representative_ >= 0 ? options_.split_call == nullptr : options_.dup_without_rendezvous;
  if (dup && take_as_dup && entry.mode != SplitEntry::kGeneral) {
    // Dup: every rank joins group 0 in rank order, assuming the others make the same call.
    entry.mode = SplitEntry::kDup;
    entry.calls[rank] = std::make_pair(color, key);
    for (int r = 0; r < size_; ++r) result.members.push_back(r);
    result.index = rank;
  } else if (entry.mode == SplitEntry::kDup) {
    std::vector<int> dups;
    for (int r = 0; r < size_; ++r) {
      if (entry.calls[r].has_value()) dups.push_back(r);
    }
    absl::Status status = MarkPeerError(
        absl::InvalidArgumentError(absl::StrCat(
            where, ": this rank called Split(color=", color, ", key=", key, ") but rank(s) ",
            absl::StrJoin(dups, ", "),
            " called Split(0, own rank), which the sim backend took for Dup() and completed "
            "without waiting (SimOptions.dup_without_rendezvous): every rank must make the same "
            "call; for general splits from threads, set dup_without_rendezvous = false")),
        absl::StrJoin(dups, ", "));
    // The communicator those ranks got is wrong: make its collectives fail too.
    std::shared_ptr<SimGroup> wrong;
    if (auto it = children_.find(absl::StrCat(options_.name, "/split", split, ".color0"));
        it != children_.end()) {
      wrong = it->second.group;
    }
    lock.unlock();
    if (wrong != nullptr) wrong->Fail(status);
    return status;
  } else if (representative_ >= 0) {
    // Representative mode: the other ranks' calls come from split_call, no rendezvous.
    if (options_.split_call == nullptr) {
      return absl::UnimplementedError(absl::StrCat(
          where,
          ": a representative-rank simulation cannot split this group (no "
          "SimOptions.split_call: only the group CreateRepresentativeSimCommunicator made "
          "has one; splits of its splits other than Dup are not modelled)"));
    }
    entry.mode = SplitEntry::kGeneral;
    for (int r = 0; r < size_; ++r) entry.calls[r] = options_.split_call(split, r);
    if (*entry.calls[rank] != std::make_pair(color, key)) {
      const std::pair<int, int> expected = *entry.calls[rank];
      splits_.erase(split);
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the representative called Split(color=", color, ", key=", key,
                       ") but SimOptions.split_call says its call is (", expected.first, ", ",
                       expected.second, ")"));
    }
    if (color >= 0) {
      for (int r = 0; r < size_; ++r) {
        if (entry.calls[r]->first == color) result.members.push_back(r);
      }
      std::stable_sort(result.members.begin(), result.members.end(), [&](int a, int b) {
        return entry.calls[a]->second < entry.calls[b]->second;
      });
      result.index = static_cast<int>(
          std::find(result.members.begin(), result.members.end(), rank) - result.members.begin());
    }
  } else {
    entry.mode = SplitEntry::kGeneral;
    entry.calls[rank] = std::make_pair(color, key);
    ++entry.arrived;
    split_cv_.notify_all();
    const bool all = split_cv_.wait_until(lock, absl::ToChronoTime(deadline),
                                          [&] { return splits_[split].arrived == size_; });
    SplitEntry& ready = splits_[split];
    if (!all) {
      std::vector<int> missing;
      for (int r = 0; r < size_; ++r) {
        if (!ready.calls[r].has_value()) missing.push_back(r);
      }
      return MarkPeerError(
          absl::DeadlineExceededError(
              absl::StrCat(where, ": timed out waiting for rank(s) ", absl::StrJoin(missing, ", "),
                           " (a sim split other than Dup is a rendezvous of the ranks' threads)")),
          absl::StrJoin(missing, ", "));
    }
    if (color >= 0) {
      for (int r = 0; r < size_; ++r) {
        if (ready.calls[r]->first == color) result.members.push_back(r);
      }
      std::stable_sort(result.members.begin(), result.members.end(), [&](int a, int b) {
        return ready.calls[a]->second < ready.calls[b]->second;
      });
      result.index = static_cast<int>(
          std::find(result.members.begin(), result.members.end(), rank) - result.members.begin());
    }
  }
  if (++splits_[split].left == present()) splits_.erase(split);
  return result;
}

// ---- SimCommunicator -------------------------------------------------------------------------

SimCommunicator::SimCommunicator(int rank, std::shared_ptr<SimGroup> group, std::string name,
                                 absl::Duration timeout)
    : Communicator(rank, group->size(), Device::Host(), std::move(name), timeout),
      group_(std::move(group)) {
  // A thousand simulated ranks share the process: their rings would cost more than they tell.
  DisableFlightRecorder();
}

absl::Status SimCommunicator::CheckStream(const Stream& stream) const {
  if (!group_->timeline().Owns(stream)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "communicator ", name(),
        " (sim) runs only on virtual streams of its timeline, but stream '", stream.name(),
        "' is not one (create it with CreateVirtualStream on the same timeline)"));
  }
  return absl::OkStatus();
}

absl::Status SimCommunicator::Launch(Op op, Stream& stream) {
  struct Task {
    std::shared_ptr<SimCommunicator> comm;
    Op op;
    std::string stream_name;
  };
  op.clock = &stream.clock();
  group_->NoteIssued(rank(), op.fingerprint.seq);
  auto task = std::make_shared<Task>(
      Task{std::static_pointer_cast<SimCommunicator>(shared_from_this()), op, stream.name()});
  VirtualAsyncOp async;
  async.name = std::string(CollectiveName(op.fingerprint.kind));
  async.kind = StreamOpKind::kCollective;
  async.bytes = std::max(op.input_count, op.output_count) * op.element_size;
  // The sequence number is spent: without this the peers would wait for this rank in vain.
  async.cancel = [task](const absl::Status& poison) {
    task->comm->Abort(
        task->comm->SkippedError(task->op, task->stream_name,
                                 absl::StrCat("was poisoned before it ran: ", poison.message())));
  };
  async.describe = [task] { return task->comm->group_->DescribeWait(task->op.fingerprint); };
  async.start = [task](absl::Time start, VirtualAsyncDone done) {
    SimCommunicator& comm = *task->comm;
    if (absl::Status status = comm.status(); !status.ok()) {
      std::move(done)(std::move(status), start);
      return;
    }
    task->op.deadline = start + task->op.timeout;
    comm.group_->Arrive(
        task->comm, task->op, start,
        [task, done = std::move(done)](absl::Status status, absl::Time end) mutable {
          if (!status.ok()) task->comm->Abort(status);
          std::move(done)(std::move(status), end);
        });
  };
  return group_->timeline().SubmitAsync(stream, std::move(async));
}

void SimCommunicator::OnAbort(const absl::Status& reason) { group_->Abort(rank(), reason); }

absl::StatusOr<std::shared_ptr<Communicator>> SimCommunicator::SplitImpl(int color, int key,
                                                                         absl::Time deadline) {
  uint64_t split;
  {
    std::lock_guard<std::mutex> lock(split_mu_);
    split = splits_++;
  }
  SL_ASSIGN_OR_RETURN(SimGroup::SplitResult result,
                      group_->Split(split, rank(), color, key, deadline));
  if (color < 0) return std::shared_ptr<Communicator>();
  return CreateSubgroup(result.members, result.index,
                        absl::StrCat(name(), "/split", split, ".color", color), deadline);
}

absl::StatusOr<std::shared_ptr<Communicator>> SimCommunicator::CreateSubgroup(
    const std::vector<int>& ranks, int index, const std::string& name, absl::Time deadline) {
  std::shared_ptr<SimGroup> child = group_->Child(name, ranks);
  return std::shared_ptr<Communicator>(
      std::make_shared<SimCommunicator>(index, std::move(child), name, timeout()));
}

}  // namespace

std::vector<SimLinkTraffic> SimTrafficByDevice(const Communicator& comm) {
  const auto* sim = dynamic_cast<const SimCommunicator*>(&comm);
  if (sim == nullptr || sim->group()->arbiter() == nullptr) return {};
  return sim->group()->arbiter()->Traffic();
}

absl::Duration SimCollectiveCost(CollectiveKind kind, size_t count, DType dtype, int size,
                                 const SimOptions& options) {
  if (size <= 1) return absl::ZeroDuration();
  const int64_t n = size;
  const double bytes = static_cast<double>(count) * static_cast<double>(DTypeSize(dtype));
  auto transfer = [&](double b) {
    if (b <= 0 || std::isinf(options.bandwidth_bytes_per_s)) return absl::ZeroDuration();
    return absl::Nanoseconds(b * 1e9 / options.bandwidth_bytes_per_s);
  };
  switch (kind) {
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllToAll:
      return (n - 1) * (options.latency + transfer(bytes));
    case CollectiveKind::kAllReduce:
      return 2 * (n - 1) * (options.latency + transfer(bytes / static_cast<double>(n)));
    case CollectiveKind::kBroadcast:
      return (n - 1) * options.latency + transfer(bytes);
    case CollectiveKind::kBarrier:
      return 2 * (n - 1) * options.latency;
  }
  return absl::ZeroDuration();
}

namespace {

// The validated options and the shared state of a new simulation's first group.
struct Resolved {
  SimOptions options;
  absl::Duration timeout;
  std::shared_ptr<sim_internal::LinkArbiter> arbiter;
};

absl::StatusOr<Resolved> Resolve(VirtualTimeline& timeline, int size, const SimOptions& options) {
  if (size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("sim communicator size must be at least 1, got ", size));
  }
  if (options.latency < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("SimOptions.latency must not be negative, got ",
                                                   absl::FormatDuration(options.latency)));
  }
  if (!(options.bandwidth_bytes_per_s > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SimOptions.bandwidth_bytes_per_s must be positive, got ", options.bandwidth_bytes_per_s));
  }
  if (options.timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("SimOptions.timeout must not be negative, got ",
                                                   absl::FormatDuration(options.timeout)));
  }
  absl::Duration timeout = options.timeout;
  if (timeout == absl::ZeroDuration()) {
    SL_ASSIGN_OR_RETURN(timeout, DefaultTimeout());
  }
  SimOptions resolved = options;
  std::shared_ptr<sim_internal::LinkArbiter> arbiter;
  if (options.topology != nullptr) {
    SL_RETURN_IF_ERROR(ValidateTopology(*options.topology));
    if (resolved.devices.empty()) {
      for (int r = 0; r < size; ++r) resolved.devices.push_back(r);
    }
    if (static_cast<int>(resolved.devices.size()) != size) {
      return absl::InvalidArgumentError(
          absl::StrCat("SimOptions.devices has ", resolved.devices.size(),
                       " entries for a group of ", size, " ranks (one device per rank)"));
    }
    absl::StatusOr<GroupShape> shape = GroupShapeOf(*options.topology, resolved.devices);
    if (!shape.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("SimOptions.devices: ", shape.status().message()));
    }
    arbiter = std::make_shared<sim_internal::LinkArbiter>(timeline);
  } else if (!options.devices.empty()) {
    return absl::InvalidArgumentError("SimOptions.devices is set but SimOptions.topology is not");
  }
  return Resolved{std::move(resolved), timeout, std::move(arbiter)};
}

}  // namespace

absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> CreateSimCommunicators(
    VirtualTimeline& timeline, int size, const SimOptions& options) {
  SL_ASSIGN_OR_RETURN(Resolved resolved, Resolve(timeline, size, options));
  auto group =
      std::make_shared<SimGroup>(timeline, size, resolved.options, std::move(resolved.arbiter));
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) {
    comms.push_back(std::make_shared<SimCommunicator>(r, group, options.name, resolved.timeout));
  }
  return comms;
}

absl::StatusOr<std::shared_ptr<Communicator>> CreateRepresentativeSimCommunicator(
    VirtualTimeline& timeline, int size, int rank, const SimOptions& options) {
  SL_ASSIGN_OR_RETURN(Resolved resolved, Resolve(timeline, size, options));
  if (rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("representative rank ", rank, " is not a rank of a group of ", size));
  }
  if (options.move_data) {
    return absl::InvalidArgumentError(
        "a representative-rank sim communicator moves no data: set SimOptions.move_data = false");
  }
  if (options.split_call == nullptr) {
    return absl::InvalidArgumentError(
        "a representative-rank sim communicator needs SimOptions.split_call (the other ranks' "
        "split calls)");
  }
  auto group = std::make_shared<SimGroup>(timeline, size, resolved.options,
                                          std::move(resolved.arbiter), rank);
  return std::shared_ptr<Communicator>(
      std::make_shared<SimCommunicator>(rank, group, options.name, resolved.timeout));
}

}  // namespace shardline
