// The simulated clusters (scheduler/tune/simulate.h): a flat network, or a topology
// (collectives/sim/topology.h) with its link levels, host cores and memory-op rates.

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "runtime/status.h"
#include "scheduler/tune/simulate.h"

namespace shardline {
namespace {

class FlatCluster final : public SimCluster {
 public:
  explicit FlatCluster(FlatClusterOptions options) : options_(std::move(options)) {
    options_.network.move_data = false;
    options_.network.dup_without_rendezvous = false;
  }
  std::string Describe() const override {
    return absl::StrFormat("flat: %g us, %g GB/s per link, %g TFLOP/s, %g GiB",
                           absl::ToDoubleMicroseconds(options_.network.latency),
                           options_.network.bandwidth_bytes_per_s / 1e9,
                           options_.compute_flops_per_s / 1e12,
                           static_cast<double>(options_.device_memory_bytes) / (1ull << 30));
  }
  absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> CreateWorld(
      VirtualTimeline& timeline, int world_size) const override {
    return CreateSimCommunicators(timeline, world_size, options_.network);
  }
  absl::StatusOr<std::shared_ptr<Communicator>> CreateRepresentative(
      VirtualTimeline& timeline, int world_size, int rank,
      std::function<std::pair<int, int>(uint64_t, int)> split_call) const override {
    SimOptions network = options_.network;
    network.split_call = std::move(split_call);
    return CreateRepresentativeSimCommunicator(timeline, world_size, rank, network);
  }
  // Every group of a size costs the same wherever it is.
  bool RanksSymmetric(int, int) const override { return true; }
  double compute_flops_per_s(DType) const override { return options_.compute_flops_per_s; }
  uint64_t device_memory_bytes() const override { return options_.device_memory_bytes; }
  double host_link_bytes_per_s() const override { return options_.host_link_bytes_per_s; }

 private:
  FlatClusterOptions options_;
};

class TopologyCluster final : public SimCluster {
 public:
  explicit TopologyCluster(std::shared_ptr<const Topology> topology)
      : topology_(std::move(topology)) {}
  std::string Describe() const override {
    const Topology& t = *topology_;
    std::string compute = absl::StrFormat("%g TFLOP/s", t.compute_flops_per_s / 1e12);
    if (!(t.compute_flops_per_s > 0)) {
      std::vector<std::string> per_dtype;
      for (const DType dtype : kAllDTypes) {
        const double v = t.compute_flops_by_dtype[static_cast<int>(dtype)];
        if (v > 0) per_dtype.push_back(absl::StrFormat("%s %g", DTypeName(dtype), v / 1e12));
      }
      compute = absl::StrCat(absl::StrJoin(per_dtype, ", "), " TFLOP/s");
    }
    return absl::StrFormat("topology %s: %d x %d devices, %s, %g GiB", t.name, t.nodes,
                           t.devices_per_node, compute,
                           static_cast<double>(t.device_memory_bytes) / (1ull << 30));
  }
  absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> CreateWorld(
      VirtualTimeline& timeline, int world_size) const override {
    SL_ASSIGN_OR_RETURN(SimOptions network, Network(world_size));
    return CreateSimCommunicators(timeline, world_size, network);
  }
  absl::StatusOr<std::shared_ptr<Communicator>> CreateRepresentative(
      VirtualTimeline& timeline, int world_size, int rank,
      std::function<std::pair<int, int>(uint64_t, int)> split_call) const override {
    SL_ASSIGN_OR_RETURN(SimOptions network, Network(world_size));
    network.split_call = std::move(split_call);
    return CreateRepresentativeSimCommunicator(timeline, world_size, rank, network);
  }
  bool RanksSymmetric(int world_size, int shard_size) const override {
    const int d = topology_->devices_per_node;
    // The world: inside one node, or whole nodes.
    if (world_size > d && world_size % d != 0) return false;
    // Shard groups of consecutive ranks: several whole groups per node, or whole nodes per group.
    // Replicate groups (every shard_size-th rank) then all have one shape too.
    if (shard_size < 1 || world_size % shard_size != 0) return false;
    return d % shard_size == 0 || shard_size % d == 0;
  }
  double compute_flops_per_s(DType dtype) const override {
    return topology_->ComputeFlopsPerS(dtype);
  }
  double peak_flops_per_s(DType dtype) const override { return topology_->PeakFlopsPerS(dtype); }
  absl::Duration ComputeDuration(const ComputeWork& work, DType dtype) const override {
    return shardline::ComputeDuration(*topology_, work, dtype);
  }
  uint64_t device_memory_bytes() const override { return topology_->device_memory_bytes; }
  std::shared_ptr<const Topology> topology() const override { return topology_; }
  double host_link_bytes_per_s() const override { return topology_->host_link_bytes_per_s; }
  VirtualTimelineOptions TimelineOptions() const override {
    const MemoryOpsModel& m = topology_->memory_ops;
    VirtualTimelineOptions o;
    o.copy_bytes_per_s = m.copy_bytes_per_s;
    o.cast_bytes_per_s = m.cast_bytes_per_s;
    o.reduce_bytes_per_s = m.reduce_bytes_per_s;
    o.fill_bytes_per_s = m.fill_bytes_per_s;
    o.op_overhead = absl::Seconds(m.op_overhead_s);
    o.host_cores = topology_->host_cores;
    o.host_lockstep = topology_->host_lockstep;
    return o;
  }
  int HostOf(int rank) const override {
    return topology_->host_cores > 0 ? rank / topology_->devices_per_node : -1;
  }
  int RanksOnHost(int world_size) const override {
    return std::max(1, std::min(world_size, topology_->devices_per_node));
  }

 private:
  absl::StatusOr<SimOptions> Network(int world_size) const {
    if (world_size > topology_->devices()) {
      return absl::InvalidArgumentError(
          absl::StrCat("topology '", topology_->name, "' has ", topology_->devices(), " devices (",
                       topology_->nodes, " x ", topology_->devices_per_node, "), too few for ",
                       world_size, " ranks"));
    }
    SimOptions network{.name = "world",
                       .move_data = false,
                       .dup_without_rendezvous = false,
                       .topology = topology_};
    for (int r = 0; r < world_size; ++r) network.devices.push_back(r);
    return network;
  }

  std::shared_ptr<const Topology> topology_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<SimCluster>> CreateTopologyCluster(
    std::shared_ptr<const Topology> topology) {
  if (topology == nullptr) return absl::InvalidArgumentError("topology cluster: null topology");
  SL_RETURN_IF_ERROR(ValidateTopology(*topology));
  return std::make_unique<TopologyCluster>(std::move(topology));
}

absl::StatusOr<std::unique_ptr<SimCluster>> CreateFlatCluster(FlatClusterOptions options) {
  if (!(options.compute_flops_per_s > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "flat cluster: compute_flops_per_s must be positive, got ", options.compute_flops_per_s));
  }
  return std::make_unique<FlatCluster>(std::move(options));
}

}  // namespace shardline
