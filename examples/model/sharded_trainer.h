// File: examples/model/sharded_trainer.h
// -----------------------------------------------------------------------------
// The example model (tiny_lm.h) trained data-parallel and sharded by the Scheduler: every rank
// of `world` trains its slice of each step's global batch on a CPU "framework" (the calling
// thread is the compute stream: a caller stream), the scheduler gathers each unit's parameters
// around its forward and backward and reduce-scatters its gradient, and AdamW steps on the
// shards. The result must equal TrainReference (the unsharded single-process run of the same
// global batch); CompareWithReference measures that.
//
//   SL_ASSIGN_OR_RETURN(ShardedRun run, TrainSharded(config, world, options));
//   SL_ASSIGN_OR_RETURN(auto errors, CompareWithReference(config, *world, run, options));
//
// Precision: with a param_dtype other than f32 the gathered parameters are cast to f32 for the
// model's f32 kernels (bf16 values, f32 arithmetic, as autocast does) and the f32 gradient is
// cast back into the param-dtype unsharded gradient.

#ifndef SHARDLINE_EXAMPLES_MODEL_SHARDED_TRAINER_H_
#define SHARDLINE_EXAMPLES_MODEL_SHARDED_TRAINER_H_

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "examples/model/tiny_lm.h"
#include "scheduler/scheduler.h"

namespace shardline::examples {

enum class Accumulation : uint8_t {
  kSync,            // every micro-batch reduce-scatters (into the sharded gradient)
  kNoSync,          // micro-batches before the last accumulate unsharded, the last reduces
  kDeferAllReduce,  // hybrid: reduce-scatter each micro-batch, all-reduce after the last only
};

struct ShardedRunOptions {
  SchedulerOptions scheduler;      // strategy, prefetch, budget, trace...
  MixedPrecisionPolicy precision;  // of every unit
  int steps = 10;
  int micro_batches = 1;  // per rank per step; must divide tokens_per_rank
  Accumulation accumulation = Accumulation::kSync;
  TrainOptions train;  // AdamW, recompute, the data seed
  // Called on every rank after each step (for printing).
  std::function<void(int step, double loss, const StepMetrics& metrics, absl::Duration wall)>
      on_step;
};

struct ShardedRun {
  std::vector<double> losses;  // the global loss of each step (the same on every rank)
  std::vector<StepMetrics> metrics;
  // This rank's final master shards, as full tensors with only the elements of its shard set
  // (the others are 0) and a mask of which those are: [unit][tensor][element].
  std::vector<std::vector<std::vector<float>>> params;
  std::vector<std::vector<std::vector<uint8_t>>> owned;
};

// Trains; collective over `world` (every rank calls it with the same options).
absl::StatusOr<ShardedRun> TrainSharded(const ModelConfig& config,
                                        std::shared_ptr<Communicator> world,
                                        const ShardedRunOptions& options);

struct ReferenceComparison {
  // Per tensor, ||sharded - reference|| / ||reference|| over all elements: [unit][tensor].
  std::vector<std::vector<double>> relative_error;
  double max_relative_error = 0;
  std::vector<double> reference_losses;
};

// The unsharded single-process run of data-parallel training on `world` ranks: each step, every
// rank's slice of the global batch (split into micro_batches pieces, as TrainSharded does) adds
// its gradient into a zeroed set of full tensors, the ranks' sets are summed in rank order within
// each group of `group` consecutive ranks (the shard groups, whose reduce-scatter sums first),
// then the groups' sums in order, and AdamW steps on the full tensors. The same arithmetic as
// TrainReference up to the order of the sums: grouping them by rank, as data parallelism does,
// keeps the rounding of gradients that are sums with cancellation (the biases) close to the sharded
// run's, which 10 AdamW steps would otherwise amplify to ~3e-5 of a bias's norm at 4 ranks. Returns
// the loss per step.
absl::StatusOr<std::vector<double>> TrainDataParallelReference(const ModelConfig& config, int steps,
                                                               int world, int micro_batches,
                                                               int group,
                                                               const TrainOptions& options,
                                                               ReferenceAccess& access);

// Runs TrainDataParallelReference on this rank and compares every element this rank owns; the
// norms are summed over `world` (an all-reduce, so the result is the same on every rank; replicas
// count twice in both norms, which leaves the ratio unchanged).
absl::StatusOr<ReferenceComparison> CompareWithReference(const ModelConfig& config,
                                                         Communicator& world, const ShardedRun& run,
                                                         const ShardedRunOptions& options);

}  // namespace shardline::examples

#endif  // SHARDLINE_EXAMPLES_MODEL_SHARDED_TRAINER_H_
