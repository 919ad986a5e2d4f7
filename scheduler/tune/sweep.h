// File: scheduler/tune/sweep.h
// -----------------------------------------------------------------------------
// A sweep over scheduler configurations: the grid of SimulationConfigs a SweepSpace spans, each
// simulated (scheduler/tune/simulate.h) on one cluster, and the table of what each would cost,
// with the best configuration that fits the device memory. shardline-tune sweep
// (scheduler/tools/shardline_tune.cc) is its command line; docs/tuning.md walks through one.
//
//   SweepSpace space{.world_size = 1024, .strategies = {kFullShard, kHybridShard},
//                    .hybrid_shard_sizes = {8, 16}, .forward_prefetch = {1, 2}};
//   SL_ASSIGN_OR_RETURN(std::vector<SimulationConfig> grid, ExpandSweep(space));
//   SL_ASSIGN_OR_RETURN(SweepResult r, RunSweep(model, grid, *cluster, {.threads = 2}));
//   r.rows[r.best];  SweepToJson(r, ...);  SweepToCsv(r);
//
// Dimensions: sharding strategy (and, for hybrid, the shard-group size), forward prefetch
// depth, backward prefetch mode and depth (one depth where the mode is off), the budget's unit
// count and byte caps, param and reduce dtypes, activation checkpointing, micro-batches per step
// and their accumulation mode (one mode where there is one micro-batch), CPU offload.
// kNotModelled names what the driver leaves out, in every output. Configurations the scheduler
// refuses (a byte budget below what the units need, say) are rows with an error, not failures of
// the sweep.
//
// The best row: the highest tokens/s per device among those that ran and fit the device
// memory (ties: the lower peak memory, then the earlier row); -1 if none.

#ifndef SHARDLINE_SCHEDULER_TUNE_SWEEP_H_
#define SHARDLINE_SCHEDULER_TUNE_SWEEP_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "scheduler/tune/model.h"
#include "scheduler/tune/simulate.h"

namespace shardline {

// What the simulated step leaves out (every output says so).
inline constexpr const char* kNotModelled[] = {
    "the optimizer step (its compute; with CPU offload, on the host)"};

struct SweepSpace {
  int world_size = 8;
  std::vector<ShardingStrategy> strategies = {ShardingStrategy::kFullShard};
  // kHybridShard's shard-group sizes (each must divide world_size and be below it).
  std::vector<int> hybrid_shard_sizes;
  std::vector<int> forward_prefetch = {1};
  std::vector<BackwardPrefetch> backward_prefetch = {BackwardPrefetch::kBeforeGrad};
  std::vector<int> backward_prefetch_depth = {1};
  std::vector<int> budget_units = {0};
  std::vector<uint64_t> budget_bytes = {0};
  // nullopt: the model's own dtype.
  std::vector<std::optional<DType>> param_dtypes = {std::nullopt};
  std::vector<std::optional<DType>> reduce_dtypes = {std::nullopt};
  std::vector<ActivationCheckpointing> activation_checkpointing = {{}};
  std::vector<int> micro_batches = {1};
  std::vector<GradientAccumulation> accumulation = {GradientAccumulation::kNoSync};
  std::vector<bool> cpu_offload = {false};
  HostLead host_lead = HostLead::kOneUse;
  RankMode ranks = RankMode::kAuto;
};

// Every combination, in a fixed order (strategy outermost). InvalidArgument for an empty
// dimension, a negative depth or a hybrid shard size that does not divide the world (naming it).
absl::StatusOr<std::vector<SimulationConfig>> ExpandSweep(const SweepSpace& space);

struct SweepRow {
  SimulationConfig config;
  absl::Status status;  // the simulation's error: the other fields are then unset
  SimulationReport report;
  // Against the hardware's peak for the row's param dtype (SweepOptions::peak_flops_per_s, else
  // the cluster's; 0 where neither states one, and then mfu and hfu are 0 too):
  //   mfu  model FLOPs per second per device over the peak (recomputation not counted), as
  //        PaLM (Chowdhery et al. 2022, appendix B), Megatron-LM and torchtitan define it
  //   hfu  the same with the recomputation counted (hardware FLOPs utilisation)
  // compute_busy: compute time over step time, the share of the step the compute stream works
  // (1 - compute_busy is what communication and waits add); it needs no peak.
  double peak_flops_per_s = 0;
  double mfu = 0;
  double hfu = 0;
  double compute_busy = 0;
};

struct SweepResult {
  std::vector<SweepRow> rows;
  int best = -1;
  // The peak for the model's own param dtype (SweepRow::peak_flops_per_s; 0: not known).
  double peak_flops_per_s = 0;
  double seconds = 0;  // wall-clock time of the sweep
};

struct SweepOptions {
  int threads = 1;  // configurations simulated at once
  // The peak MFU and HFU are measured against, for every row; 0: the cluster's peak for each
  // row's param dtype (SimCluster::peak_flops_per_s).
  double peak_flops_per_s = 0;
  // Called after each configuration (from the thread that ran it, serialised): done, total.
  std::function<void(int, int)> progress;
};

// Simulates every configuration. InvalidArgument for no configurations or threads < 1; a
// configuration's own error goes into its row.
absl::StatusOr<SweepResult> RunSweep(const ModelDescription& model,
                                     const std::vector<SimulationConfig>& configs,
                                     const SimCluster& cluster, const SweepOptions& options);

// The configuration in a few words: "hybrid k=8 fp=2 bp=before_grad:1 bu=0 bb=0 p=bf16 r=f32
// ckpt".
std::string DescribeConfig(const SimulationConfig& config);

// The table. JSON: {"model", "cluster", "world_size", "peak_TFLOPs", "not_modelled", "best",
// "seconds", "rows": [{"index", "strategy", "shard_size", "forward_prefetch",
// "backward_prefetch", "backward_prefetch_depth", "budget_units", "budget_bytes", "param_dtype",
// "reduce_dtype", "activation_checkpointing", "micro_batches", "accumulation", "cpu_offload", "ok",
// "error", "ranks_simulated", "representative", "step_time_s", "compute_time_s",
// "exposed_communication_s", "communication_time_s", "tokens_per_s_per_device", "peak_TFLOPs",
// "mfu", "hfu", "compute_busy",
// "ring_sent_bytes_per_rank", "intra_node_bytes_per_device", "inter_node_bytes_per_device",
// "budget_overshoots", "memory": {"master_shards", "sharded_grads", "optimizer_state",
// "unsharded_params_peak", "grad_buffers_peak", "activations_peak", "total_peak", "host_peak"},
// "fits"}]}. dtypes "model" where the model's own is used; peak_TFLOPs, mfu and hfu null (CSV:
// empty) where no peak is known. CSV: one header line and a line per row
// with the same fields (memory flattened to mem_<name>_bytes), errors quoted.
std::string SweepToJson(const SweepResult& result, const ModelDescription& model,
                        const SimCluster& cluster);
std::string SweepToCsv(const SweepResult& result);

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_TUNE_SWEEP_H_
