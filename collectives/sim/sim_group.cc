// A sim group's collectives: each rank arrives when its virtual stream reaches the collective;
// the last arrival compares the fingerprints and schedules the completion at its virtual time
// (with a topology, through the link arbiter); a rank that waits past its timeout, or an abort,
// fails it.

#include "collectives/sim/internal/sim_group.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collectives/internal/data_movement.h"
#include "runtime/check.h"
#include "runtime/status.h"

namespace shardline::sim_internal {

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
    for (std::deque<Arrival>& waiting : receivers_) {
      for (Arrival& receive : waiting) failed.push_back(std::move(receive));
      waiting.clear();
    }
    for (std::deque<Message>& inbox : inboxes_) inbox.clear();
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

}  // namespace shardline::sim_internal
