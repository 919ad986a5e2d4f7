// File: scheduler/tune/simulate.h
// -----------------------------------------------------------------------------
// The simulation driver: runs the real Scheduler (scheduler/scheduler.h) for one training step
// of a described model (scheduler/tune/model.h) on a simulated cluster, and reports what the
// step would cost: its time, the communication the compute had to wait for, the bytes each rank
// sent and the peak memory of each device.
//
//   auto cluster = CreateFlatCluster({.network = {.latency = absl::Microseconds(10),
//                                                 .bandwidth_bytes_per_s = 50e9},
//                                     .compute_flops_per_s = 400e12});
//   SL_ASSIGN_OR_RETURN(ModelDescription model, TransformerModel(Llama3_8B()));
//   SL_ASSIGN_OR_RETURN(SimulationReport r,
//                       Simulate(model, {.world_size = 8, .forward_prefetch = 2}, *cluster));
//   r.step_time; r.exposed_communication; r.ring_sent_bytes_per_rank; r.memory.total_peak;
//
// How. Every rank is a Scheduler on one VirtualTimeline (runtime/virtual_time.h): its streams
// are virtual streams, its communicators the cluster's sim communicators (collectives/sim/)
// wrapped in a CollectiveCounter (scheduler/tune/counting_communicator.h), its memory phantom
// (runtime/phantom_allocator.h; nothing is allocated or touched). The driver plays the
// framework: it calls the hooks of every rank in lockstep, in the model's forward order and in
// reverse for the backward, and enqueues each use's compute on the rank's compute stream as an
// op of declared duration FLOPs / the cluster's achieved throughput. It runs two steps: a
// warm-up that records the forward order (as a framework's first iteration does) and the
// measured step, which prefetches along it. The step is PreForward of the first use to the end
// of FinishBackward's waits; the optimizer's own compute is not simulated. How far the host
// runs ahead of the device is SimulationConfig::host_lead.
//
// Memory per device is the peak, over the measured step, of everything allocated on it in
// host-issue order (a GPU framework's host runs ahead of the device, and the scheduler's pools
// reuse memory stream-ordered, so issue order is what bounds the memory): the master shards
// and sharded gradients (the scheduler's shard allocator), the unsharded parameters and the
// gradient buffers in flight (its two caching pools, class-rounded blocks and cached blocks
// included), the optimizer state (optimizer_state_bytes_per_param per element of each master
// shard, padding included, allocated before the step) and the activations (each use's
// activation_bytes, or checkpointed_activation_bytes with checkpointing, from its forward to
// its backward; with checkpointing the full activation_bytes also during the use's own
// backward, for the uses that recompute, model.h). Ranks of one simulation are symmetric in these
// figures; the report takes the maximum over ranks.
//
// Every rank is simulated by default (world sizes of a few hundred run in seconds). Where ranks
// are symmetric (SimCluster::RanksSymmetric: every shard group and every replicate group has
// the same placement, so every rank issues the same collectives at the same virtual times and
// gets the same share of its links), SimulationConfig::ranks can ask for one representative
// rank instead (rank 0; every strategy has a single role): its communicator has the world's
// size, a collective completes when it arrives, costed for the whole group and placement
// (collectives/sim/sim_communicator.h, representative mode), and its memory is phantom as
// always. The report says which was used (SimulationReport::representative, ranks_simulated).
// tune_simulate_test checks it against a full run (64 ranks, flat and topology clusters).
// Schedulers are created from one thread per rank (creating the mesh splits communicators, a
// rendezvous); after that one thread drives.
//
// RunOnHostBackend runs the same driver, the same hooks in the same order, on the local backend
// (ranks as threads' communicators, host streams, real host memory, compute ops that do
// nothing): for checking that the scheduler decides the same on virtual time as on a real
// backend (its issue order), with a small model.

#ifndef SHARDLINE_SCHEDULER_TUNE_SIMULATE_H_
#define SHARDLINE_SCHEDULER_TUNE_SIMULATE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/sim/sim_communicator.h"
#include "collectives/sim/topology.h"
#include "runtime/dtype.h"
#include "runtime/trace.h"
#include "runtime/virtual_time.h"
#include "scheduler/scheduler.h"
#include "scheduler/tune/counting_communicator.h"
#include "scheduler/tune/model.h"

namespace shardline {

// The machine a simulation runs on: how its collectives and compute take time, and how much
// memory a device has. An interface, so that a topology-aware cost model can replace the flat
// one without touching the driver.
class SimCluster {
 public:
  virtual ~SimCluster() = default;
  // One line for reports: "flat: 5 us, 50 GB/s per link, 400 TFLOP/s, 80 GiB".
  virtual std::string Describe() const = 0;
  // The world's communicators on `timeline` (element r is rank r). They must accept virtual
  // streams of `timeline`, move no data, and support splits from one thread per rank.
  virtual absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> CreateWorld(
      VirtualTimeline& timeline, int world_size) const = 0;
  // Representative mode: rank `rank` of a world of `world_size`, alone (CreateRepresentative-
  // SimCommunicator); split_call gives every rank's (color, key) for the world's splits.
  virtual absl::StatusOr<std::shared_ptr<Communicator>> CreateRepresentative(
      VirtualTimeline& timeline, int world_size, int rank,
      std::function<std::pair<int, int>(uint64_t split, int rank)> split_call) const = 0;
  // Whether, in a world of `world_size` ranks split into shard groups of `shard_size`
  // consecutive ranks (ProcessMesh), every rank sits where every other does: all shard groups
  // have one placement, all replicate groups another. Only then may one rank stand for all.
  virtual bool RanksSymmetric(int world_size, int shard_size) const = 0;
  // The compute throughput each device achieves in `dtype` (FLOP/s); 0: the cluster cannot
  // compute in it (a topology whose compute_TFLOPs names other dtypes).
  virtual double compute_flops_per_s(DType dtype) const = 0;
  // The hardware's peak for matrix products in `dtype` (FLOP/s per device), what MFU is measured
  // against; 0 where it is not known (the flat cluster; a topology without "peak_TFLOPs").
  virtual double peak_flops_per_s(DType /*dtype*/) const { return 0; }
  // How long a compute op of `work` in `dtype` takes: by default every FLOP at
  // compute_flops_per_s(dtype), the memory-bound bytes free; a topology cluster times it with its
  // topology (ComputeDuration in collectives/sim/topology.h).
  virtual absl::Duration ComputeDuration(const ComputeWork& work, DType dtype) const {
    return absl::Seconds((work.matmul_flops + work.attention_flops + work.other_flops) /
                         compute_flops_per_s(dtype));
  }
  // Memory per device; 0: unlimited.
  virtual uint64_t device_memory_bytes() const = 0;
  // The topology the cluster simulates; null for the flat cluster.
  virtual std::shared_ptr<const Topology> topology() const { return nullptr; }
  // A device's link to host memory, bytes/s each way (CPU offload's copies); 0: none known.
  virtual double host_link_bytes_per_s() const { return 0; }
  // How long the scheduler's memory ops (casts, copies, reductions, fills) take on its virtual
  // streams: the timeline's cost model (run_ops is set false by Simulate). The flat cluster keeps
  // the timeline's defaults; a topology cluster takes its memory_ops (topology.h).
  virtual VirtualTimelineOptions TimelineOptions() const { return {}; }
  // Host sharing (a topology's host_cores, VirtualTimelineOptions::host_cores): the host whose
  // cores rank `rank`'s memory ops take, and how many ranks of a world of `world_size` share it;
  // host -1: no host sharing (the flat cluster, GPU topologies). In representative mode the one
  // simulated rank gets host_cores / ranks of its host (its peers there, which do the same at the
  // same time, take the rest).
  virtual int HostOf(int /*rank*/) const { return -1; }
  virtual int RanksOnHost(int /*world_size*/) const { return 1; }
};

// Every group, of whatever size and placement, costs what SimOptions' ring model says
// (collectives/sim/sim_communicator.h): one latency and one bandwidth for all links.
struct FlatClusterOptions {
  // name, latency, bandwidth_bytes_per_s and timeout are used; move_data and
  // dup_without_rendezvous are set by the cluster (false, false).
  SimOptions network;
  double compute_flops_per_s = 400e12;
  uint64_t device_memory_bytes = 80ull << 30;
  double host_link_bytes_per_s = 0;  // CPU offload's copies; 0: none (offload is an error)
};
// InvalidArgument for a non-positive throughput or SimOptions' own errors (at CreateWorld).
absl::StatusOr<std::unique_ptr<SimCluster>> CreateFlatCluster(FlatClusterOptions options);

// A Topology (collectives/sim/topology.h): rank r runs on device r (node r / devices_per_node),
// so a ProcessMesh's shard group of k consecutive ranks sits inside one node when k divides
// devices_per_node and its replicate group spans the nodes; collectives take the topology's
// cost for their group's placement, with link contention (sim_communicator.h); a use's compute
// takes ComputeDuration(topology, its work, the param dtype); device memory is the topology's.
// CreateWorld fails with InvalidArgument for a world larger than the topology's devices.
// InvalidArgument for a null or invalid topology.
absl::StatusOr<std::unique_ptr<SimCluster>> CreateTopologyCluster(
    std::shared_ptr<const Topology> topology);

// How far the framework's host runs ahead of its compute stream. The scheduler takes unsharded
// gradients only from blocks that nothing uses any more (a compute stream must never wait for a
// reduction, scheduler.h), so the further the host runs ahead, the more gradient buffers the
// reduce pool holds at once; gathers and their budget are unaffected (stream-ordered reuse), and
// so is the issue order (decided by the hook sequence alone).
enum class HostLead : uint8_t {
  kOneUse,     // after each use's hooks the host waits for that use's compute (as a framework
               // whose host blocks once per layer)
  kWholeStep,  // the host issues the whole step before the device runs any of it (the most a
               // host can run ahead: the reduce pool's worst case)
};
// "one_use", "whole_step".
absl::string_view HostLeadName(HostLead lead);

// Which ranks a simulation runs (the header comment).
enum class RankMode : uint8_t {
  kAll,             // every rank
  kRepresentative,  // one rank (FailedPrecondition where the ranks are not symmetric)
  kAuto,            // one rank where the ranks are symmetric, every rank otherwise
};
// "all", "representative", "auto".
absl::string_view RankModeName(RankMode mode);

// How the micro-batches of one optimizer step reduce their gradients
// (SimulationConfig::micro_batches > 1).
enum class GradientAccumulation : uint8_t {
  kNoSync,  // FSDP2's set_requires_gradient_sync(false) on all but the last micro-batch: the
            // unsharded gradients accumulate (in the reduce pool), the last one reduces them
  kSync,    // every micro-batch reduces (reduce-scatter, and all-reduce for hybrid/no-shard)
};
// "no_sync", "sync".
absl::string_view GradientAccumulationName(GradientAccumulation accumulation);

// Activation checkpointing (model.h says what each use keeps and recomputes). The uses it
// applies to are those that keep less with full checkpointing than without
// (checkpointed_activation_bytes < activation_bytes: the presets' layers):
//   kOff    every use keeps activation_bytes
//   kFull   each of them keeps checkpointed_activation_bytes and recomputes its forward
//   kOp     selective per op (torchtitan's `op`): each keeps selective_activation_bytes and
//           recomputes selective_recompute_flops (a model without those figures is refused)
//   kLayer  selective per layer (torchtitan's numeric option): the `every`-th of them, the
//           2*every-th, ... are checkpointed fully, the others keep everything
// A use that recomputes holds its activation_bytes during its own backward.
enum class CheckpointMode : uint8_t { kOff, kFull, kOp, kLayer };
struct ActivationCheckpointing {
  CheckpointMode mode = CheckpointMode::kOff;
  int every = 0;  // kLayer: >= 1
  bool operator==(const ActivationCheckpointing&) const = default;
};
// "off", "full", "op", "layer:K".
std::string ActivationCheckpointingName(ActivationCheckpointing checkpointing);
// The names above, and "on" for full; InvalidArgument naming the text otherwise.
absl::StatusOr<ActivationCheckpointing> ParseActivationCheckpointing(absl::string_view text);

struct SimulationConfig {
  int world_size = 8;
  RankMode ranks = RankMode::kAll;
  // Full shard is the mesh 1 x N, hybrid R x k with k = shard_size, shard-grad-op 1 x N with the
  // parameters kept from forward to backward, no-shard N x 1.
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int shard_size = 0;  // kHybridShard: k (must divide world_size); ignored otherwise
  int forward_prefetch = 1;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBeforeGrad;
  int backward_prefetch_depth = 1;
  uint64_t budget_bytes = 0;  // 0: unlimited
  int budget_units = 0;       // 0: unlimited
  // Override the model's (and every unit's) param and reduce dtypes.
  std::optional<DType> param_dtype;
  std::optional<DType> reduce_dtype;
  // Every unit's reshard_after_forward (root included); unset: the strategy's default, with the
  // root (root_unit) kept unsharded as in FSDP2.
  std::optional<bool> reshard_after_forward;
  int root_unit = 0;  // -1: no root
  ActivationCheckpointing activation_checkpointing;
  // Micro-batches per optimizer step (>= 1): the step runs the forward and backward of the
  // model's micro-batch this many times, each ending with FinishBackward; `accumulation` decides
  // which of them reduce.
  int micro_batches = 1;
  GradientAccumulation accumulation = GradientAccumulation::kNoSync;
  // FSDP's CPUOffload (SchedulerOptions::cpu_offload): the master shards, the sharded gradients
  // and the optimizer state in host memory (MemoryReport::host_peak, not the device's); each
  // gather copies its shard to the device and each reduction its reduced shard back. Those
  // copies are the scheduler's only copy ops, so on virtual time they take
  // SimCluster::host_link_bytes_per_s() (FailedPrecondition where the cluster has none).
  bool cpu_offload = false;
  HostLead host_lead = HostLead::kOneUse;
  // Rank 0's streams and the scheduler's spans, on virtual time. Null: none. Must outlive the
  // call.
  TraceWriter* trace = nullptr;
};

// Bytes per device (the maximum over ranks), peaks over the measured step.
struct MemoryReport {
  uint64_t master_shards = 0;          // Σ master shard bytes (padded), constant
  uint64_t sharded_grads = 0;          // the sharded gradients after the step
  uint64_t optimizer_state = 0;        // constant
  uint64_t unsharded_params_peak = 0;  // the gather pool's blocks (class-rounded, cached incl.)
  uint64_t grad_buffers_peak = 0;      // the reduce pool's blocks (unsharded grads, temporaries)
  uint64_t activations_peak = 0;
  // The peak of the sum of everything above at once (not the sum of the peaks).
  uint64_t total_peak = 0;
  // The gather pool's peak of requested bytes (no class rounding, no cache): the unsharded
  // parameters in flight.
  uint64_t unsharded_params_requested_peak = 0;
  // Host memory per rank (CPU offload: master shards, sharded gradients, optimizer state; they
  // are then not in total_peak). 0 without offload.
  uint64_t host_peak = 0;
};

struct SimulationReport {
  int world_size = 0;
  int ranks_simulated = 0;
  bool representative = false;  // one rank stood for all (RankMode)
  std::string cluster;          // SimCluster::Describe()
  // Virtual-time figures (unset on the host backend). step_time: the slowest rank's.
  std::optional<absl::Duration> step_time;
  std::optional<absl::Duration> exposed_communication;  // rank 0's compute stream's gather waits
  std::optional<absl::Duration> communication_time;     // rank 0's collectives' busy time
  absl::Duration compute_time;  // the compute ops' declared durations, per rank
  uint64_t step_flops = 0;      // per rank: forward + backward (+ recomputation)
  uint64_t model_flops = 0;  // per rank: forward + backward (MFU's numerator; HFU's is step_flops)
  // With micro_batches > 1: step_time, exposed_communication and communication_time are sums
  // over the micro-batches (each from its first PreForward to the end of its FinishBackward's
  // waits; the next one starts after), compute_time, step_flops and model_flops cover all of them.
  // Tokens per second per device (micro_batches x tokens_per_micro_batch / step_time); 0
  // without either.
  double tokens_per_s_per_device = 0;
  // Rank 0's collectives of the measured step, per communicator and kind, and the bytes it sent
  // (ring convention, counting_communicator.h).
  std::map<CollectiveCounter::Key, CollectiveTally> collectives;
  double ring_sent_bytes_per_rank = 0;
  // With a topology: the bytes a device sent in the measured step on each link level
  // (SimTrafficByDevice; the most any simulated device sent). 0 on a flat cluster.
  double intra_node_bytes_per_device = 0;
  double inter_node_bytes_per_device = 0;
  MemoryReport memory;
  bool fits = true;     // memory.total_peak <= the cluster's device memory
  StepMetrics metrics;  // rank 0's scheduler metrics of the measured step
  // Per rank, per micro-batch of each step (warm-up, measured): the scheduler's issue log
  // interleaved with the driver's compute ("AG layer0", "f layer0", "RS layer0", "b layer0").
  std::vector<std::vector<std::vector<std::string>>> event_logs;
};

// InvalidArgument for a bad config (world size < 1, a shard size that does not divide it,
// negative depths) or model (ModelDescription::Validate); FailedPrecondition for
// RankMode::kRepresentative where the ranks are not symmetric; the scheduler's errors otherwise.
absl::StatusOr<SimulationReport> Simulate(const ModelDescription& model,
                                          const SimulationConfig& config,
                                          const SimCluster& cluster);

// The same steps on the local backend with real host memory (keep the model small: every rank
// allocates its shards, buffers and activations). Times are unset; memory is real. Every rank
// runs (config.ranks must be kAll or kAuto).
absl::StatusOr<SimulationReport> RunOnHostBackend(const ModelDescription& model,
                                                  const SimulationConfig& config);

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_TUNE_SIMULATE_H_
