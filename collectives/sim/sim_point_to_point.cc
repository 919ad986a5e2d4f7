// A sim group's sends and receives (sim_group.h): a send leaves its message in the receiver's
// inbox and ends at once; the message arrives one message's cost later (over the topology's links
// where there is one); a receive takes, per source, the first message of its tag, the earliest
// arrived of them, as soon as one has arrived.

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/internal/data_movement.h"
#include "collectives/sim/internal/sim_group.h"
#include "runtime/check.h"
#include "runtime/status.h"

namespace shardline::sim_internal {

void SimGroup::Send(std::shared_ptr<SimCommunicator> comm, const SimCommunicator::Op& op,
                    absl::Time start, VirtualAsyncDone done) {
  const CollectiveFingerprint& fp = op.fingerprint;
  const int from = comm->rank();
  const int to = fp.root;
  Message message;
  message.from = from;
  message.send = fp;
  const size_t bytes = fp.count * op.element_size;
  if (options_.move_data && timeline_.options().run_ops) {
    absl::StatusOr<std::unique_ptr<uint8_t[]>> data = data_movement::AllocateScratch(bytes);
    if (!data.ok()) {
      std::move(done)(Annotate(data.status(), comm->Describe(op)), start);
      return;
    }
    if (bytes > 0) std::memcpy(data->get(), op.input, bytes);
    message.data = std::shared_ptr<uint8_t[]>(std::move(*data));
  }
  absl::Status failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) {
      inboxes_[to].push_back(std::move(message));
    } else {
      failed = Annotate(status_, comm->Describe(op));
    }
  }
  // Not under the lock: `done` may abort the group.
  std::move(done)(failed, start);
  if (!failed.ok()) return;

  // The message's journey. `arrive` marks it arrived: it is the first message from `from` in
  // the inbox with this sequence number (messages are never reordered in an inbox).
  auto arrive = [self = shared_from_this(), from, to, seq = fp.seq] {
    std::vector<std::pair<Arrival, Message>> ready;
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      for (Message& m : self->inboxes_[to]) {
        if (m.from == from && m.send.seq == seq) {
          m.arrived = true;
          m.arrival = self->arrivals_++;
          break;
        }
      }
      self->Match(to, &ready);
    }
    self->FinishReceives(std::move(ready));
  };
  if (options_.topology == nullptr) {
    timeline_.ScheduleAt(start + SimCollectiveCost(fp.kind, fp.count, fp.dtype, size_, options_),
                         std::move(arrive));
    return;
  }
  const int devices[2] = {options_.devices[from], options_.devices[to]};
  absl::StatusOr<GroupShape> pair = GroupShapeOf(*options_.topology, devices);
  SL_CHECK_OK(pair.status());  // two devices of a group that fits the topology
  absl::StatusOr<CollectiveCost> cost =
      EstimateCollective(*options_.topology, fp.kind, fp.count, fp.dtype, *pair);
  SL_CHECK_OK(cost.status());
  std::vector<int64_t> ports;
  arbiter_->Count(devices[0], cost->intra_bytes, cost->inter_bytes);
  for (const int device : devices) {
    if (cost->uses_intra()) ports.push_back(LinkArbiter::Port(device, 0));
    if (cost->uses_inter()) ports.push_back(LinkArbiter::Port(device, 1));
  }
  timeline_.ScheduleAt(start + absl::Seconds(cost->latency_s),
                       [self = shared_from_this(), ports = std::move(ports),
                        transfer = cost->transfer_s, arrive = std::move(arrive)]() mutable {
                         if (transfer <= 0) {
                           arrive();
                           return;
                         }
                         self->arbiter_->Start(ports, {}, transfer, std::move(arrive));
                       });
}

void SimGroup::Receive(std::shared_ptr<SimCommunicator> comm, const SimCommunicator::Op& op,
                       absl::Time start, VirtualAsyncDone done) {
  const int rank = comm->rank();
  const uint64_t seq = op.fingerprint.seq;
  std::vector<std::pair<Arrival, Message>> ready;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!status_.ok()) {
      absl::Status status = Annotate(status_, comm->Describe(op));
      lock.unlock();
      std::move(done)(std::move(status), start);
      return;
    }
    receivers_[rank].push_back(Arrival{std::move(comm), op, start, std::move(done), std::nullopt});
    Match(rank, &ready);
  }
  if (!ready.empty()) {
    FinishReceives(std::move(ready));
    return;
  }
  // A timeout only fires if other work moves the clock past it (it is not progress).
  const VirtualTimer timer = timeline_.ScheduleAt(
      start + op.timeout,
      [self = shared_from_this(), rank, seq] { self->ReceiveTimeOut(rank, seq); },
      /*progress=*/false);
  std::lock_guard<std::mutex> lock(mu_);
  for (Arrival& waiting : receivers_[rank]) {
    if (waiting.op.fingerprint.seq == seq) {
      waiting.timer = timer;
      return;
    }
  }
  // Matched (or failed) meanwhile.
  timeline_.Cancel(timer);
}

std::deque<SimGroup::Message>::iterator SimGroup::Candidate(std::deque<Message>& inbox,
                                                            const CollectiveFingerprint& fp) {
  auto best = inbox.end();
  std::vector<int> seen;  // sources whose first message of the tag came already
  for (auto it = inbox.begin(); it != inbox.end(); ++it) {
    if (it->send.key != fp.key) continue;
    if (fp.root != kAnySource && it->from != fp.root) continue;
    if (std::find(seen.begin(), seen.end(), it->from) != seen.end()) continue;
    seen.push_back(it->from);
    if (it->arrived && (best == inbox.end() || it->arrival < best->arrival)) best = it;
  }
  return best;
}

void SimGroup::Match(int rank, std::vector<std::pair<Arrival, Message>>* ready) {
  std::deque<Arrival>& waiting = receivers_[rank];
  for (auto receiver = waiting.begin(); receiver != waiting.end();) {
    auto message = Candidate(inboxes_[rank], receiver->op.fingerprint);
    if (message == inboxes_[rank].end()) {
      ++receiver;
      continue;
    }
    ready->emplace_back(std::move(*receiver), std::move(*message));
    inboxes_[rank].erase(message);
    receiver = waiting.erase(receiver);
  }
}

void SimGroup::FinishReceives(std::vector<std::pair<Arrival, Message>> ready) {
  const absl::Time now = timeline_.Now();
  for (auto& [receive, message] : ready) {
    if (receive.timer.has_value()) timeline_.Cancel(*receive.timer);
    const CollectiveFingerprint& fp = receive.op.fingerprint;
    SimCommunicator& comm = *receive.comm;
    absl::Status status;
    if (message.send.count != fp.count || message.send.dtype != fp.dtype) {
      status = MarkPeerError(absl::InvalidArgumentError(absl::StrCat(
                                 comm.Describe(receive.op), ": rank ", message.from, " sent ",
                                 message.send.CallString(), " but this rank receives ",
                                 fp.CallString(), ": sizes and dtypes must match")),
                             absl::StrCat(message.from));
    } else {
      if (message.data != nullptr && fp.count > 0) {
        std::memcpy(receive.op.output, message.data.get(), fp.count * receive.op.element_size);
      }
      receive.op.source->store(message.from, std::memory_order_release);
    }
    std::move(receive.done)(std::move(status), std::max(now, receive.at));
  }
}

void SimGroup::ReceiveTimeOut(int rank, uint64_t seq) {
  std::unique_lock<std::mutex> lock(mu_);
  std::deque<Arrival>& waiting = receivers_[rank];
  auto it = std::find_if(waiting.begin(), waiting.end(),
                         [&](const Arrival& a) { return a.op.fingerprint.seq == seq; });
  if (it == waiting.end()) return;
  Arrival receive = std::move(*it);
  waiting.erase(it);
  lock.unlock();
  const int from = receive.op.fingerprint.root;
  std::vector<int> awaited;
  for (int r = 0; r < size_; ++r) {
    if (r != rank && (from == kAnySource || r == from)) awaited.push_back(r);
  }
  absl::Status status = receive.comm->DeadlineError(receive.op, awaited);
  std::move(receive.done)(std::move(status), timeline_.Now());
}

std::string SimGroup::DescribePointToPoint(const CollectiveFingerprint& fp, int rank) {
  const std::string what =
      absl::StrCat(CollectiveName(fp.kind), " #", fp.seq, " on ", options_.name, " (sim; ");
  if (fp.kind == CollectiveKind::kSend) return absl::StrCat(what, "buffered)");
  std::lock_guard<std::mutex> lock(mu_);
  for (const Message& m : inboxes_[rank]) {
    if (m.send.key == fp.key && (fp.root == kAnySource || m.from == fp.root)) {
      return absl::StrCat(what, "its message from rank ", m.from, " is on its way)");
    }
  }
  return absl::StrCat(what, "no matching message was sent)");
}

}  // namespace shardline::sim_internal
