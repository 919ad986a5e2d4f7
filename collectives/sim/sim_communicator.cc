// The sim backend's Communicator (SimCommunicator: launching a collective on a virtual stream,
// splits, subgroups), the factories that validate SimOptions and make a simulation's first
// group, and the ring cost model. The group the ranks share is in sim_group.cc and sim_split.cc.

#include "collectives/sim/sim_communicator.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/sim/internal/link_arbiter.h"
#include "collectives/sim/internal/sim_group.h"
#include "runtime/config.h"
#include "runtime/status.h"

namespace shardline {
namespace sim_internal {

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

absl::Status SimCommunicator::CheckPointToPoint(CollectiveKind kind, int peer,
                                                uint64_t match_tag) const {
  if (group_->present() < size()) {
    return absl::UnimplementedError(
        "a representative-rank sim communicator has no peers to exchange messages with");
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
  const bool point_to_point = IsPointToPoint(op.fingerprint.kind);
  if (!point_to_point) group_->NoteIssued(rank(), op.fingerprint.seq);
  auto task = std::make_shared<Task>(
      Task{std::static_pointer_cast<SimCommunicator>(shared_from_this()), op, stream.name()});
  VirtualAsyncOp async;
  async.name = std::string(CollectiveName(op.fingerprint.kind));
  async.kind = StreamOpKind::kCollective;
  async.bytes = std::max(op.input_count, op.output_count) * op.element_size;
  // The sequence number is spent: without this the peers would wait for this rank in vain.
  async.cancel = [task](const absl::Status& poison) {
    task->comm->Abort(task->comm->SkippedError(task->op, task->stream_name,
                                               "was poisoned before it ran", poison));
  };
  async.describe = [task, point_to_point] {
    SimGroup& group = *task->comm->group_;
    return point_to_point ? group.DescribePointToPoint(task->op.fingerprint, task->comm->rank())
                          : group.DescribeWait(task->op.fingerprint);
  };
  async.start = [task, point_to_point](absl::Time start, VirtualAsyncDone done) {
    SimCommunicator& comm = *task->comm;
    if (absl::Status status = comm.status(); !status.ok()) {
      std::move(done)(std::move(status), start);
      return;
    }
    task->op.deadline = start + task->op.timeout;
    VirtualAsyncDone end = [task, done = std::move(done)](absl::Status status,
                                                          absl::Time end) mutable {
      if (!status.ok()) task->comm->Abort(status);
      std::move(done)(std::move(status), end);
    };
    if (!point_to_point) {
      comm.group_->Arrive(task->comm, task->op, start, std::move(end));
    } else if (task->op.fingerprint.kind == CollectiveKind::kSend) {
      comm.group_->Send(task->comm, task->op, start, std::move(end));
    } else {
      comm.group_->Receive(task->comm, task->op, start, std::move(end));
    }
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

}  // namespace sim_internal

using sim_internal::SimCommunicator;
using sim_internal::SimGroup;

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
    case CollectiveKind::kSend:  // one message between two ranks
    case CollectiveKind::kRecv:
      return options.latency + transfer(bytes);
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
