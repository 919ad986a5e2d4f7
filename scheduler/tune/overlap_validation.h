// File: scheduler/tune/overlap_validation.h
// -----------------------------------------------------------------------------
// The simulator against the overlap benchmark (bench/overlap/overlap_bench.cc): the same units,
// the same emulated compute, the same scheduler policies, simulated on a topology calibrated
// from the collective microbenchmarks alone (never from the overlap results), and the predicted
// step time set against the measured one.
//
//   SL_ASSIGN_OR_RETURN(OverlapBenchRun run, ParseOverlapBenchJson(text));   // --json's output
//   SL_ASSIGN_OR_RETURN(std::vector<OverlapPrediction> p, PredictOverlapBench(topology, run));
//
// What the simulation is given, per configuration of the run: the world size, the number of
// units and their size (one f32 tensor each, the benchmark's units), the root unit, the
// prefetch depths, the backward mode and the byte budget the benchmark used, and the compute
// per unit. The compute is what the emulated kernels measurably took in that configuration
// (the run's median compute_ms, split between forward and backward by the benchmark's
// backward factor): a sleeping kernel oversleeps under load, and that is the compute's time,
// not the overlap's. Every collective's time comes from the topology (its latency, bandwidth,
// size-efficiency curve and contention model, collectives/sim/). Gradient zero-fills are a
// modelled option (OverlapModelOptions::zero_fill): the benchmark measures one unit's memset
// before the steps (calibration.zero_fill_us), and the scheduler runs one fill per unit per
// step, on the compute stream without backward prefetch or on its grad stream with it.

#ifndef SHARDLINE_SCHEDULER_TUNE_OVERLAP_VALIDATION_H_
#define SHARDLINE_SCHEDULER_TUNE_OVERLAP_VALIDATION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "collectives/sim/topology.h"
#include "scheduler/scheduler.h"
#include "scheduler/tune/model.h"
#include "scheduler/tune/simulate.h"

namespace shardline {

// One configuration of an overlap_bench run, as its JSON states it.
struct OverlapBenchConfig {
  std::string name;
  int forward_prefetch = 0;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kOff;
  int backward_depth = 1;
  uint64_t budget_bytes = 0;  // 0: unlimited
  // Medians over the run's samples (rank 0).
  double step_ms = 0;
  double compute_ms = 0;
  double gathers = 0;
  double reductions = 0;
  // The samples' step times (for the spread).
  std::vector<double> step_samples_ms;
};

struct OverlapBenchRun {
  int ranks = 0;
  int units = 0;
  int root_unit = -1;
  double ratio = 0;
  double backward_factor = 0;
  std::string compute;  // "stream" or "caller"
  std::string load_before, load_after;
  uint64_t unit_bytes = 0;  // the unsharded unit (f32)
  double all_gather_us = 0, reduce_scatter_us = 0, zero_fill_us = 0;
  double forward_us = 0, backward_us = 0;  // the nominal emulated compute per unit
  std::vector<OverlapBenchConfig> configs;
};

// InvalidArgument naming the member for a missing or mistyped member, a non-positive size or
// count, an unknown backward prefetch mode, or a run whose compute is not "stream" (the caller
// mode blocks the host in every hook, which the simulation does not play).
absl::StatusOr<OverlapBenchRun> ParseOverlapBenchJson(absl::string_view json);

// The benchmark's model: `units` units "unit0".. of one f32 tensor of unit_bytes / 4 elements,
// used once each in order, with forward_flops and backward_flops of the given counts, no
// activations, f32 everywhere. With a cluster whose compute runs at 1e9 FLOP/s (1 FLOP = 1 ns)
// the FLOPs are the kernels' nanoseconds.
absl::StatusOr<ModelDescription> OverlapBenchModel(int units, uint64_t unit_bytes,
                                                   uint64_t forward_ns, uint64_t backward_ns);

struct OverlapModelOptions {
  // Add the run's measured zero-fill per unit to the compute stream (without backward prefetch,
  // where the scheduler fills on the compute stream) or to nothing (with it, the fill runs on
  // the grad stream under the gather). Off: fills take no time.
  bool zero_fill = false;
  // Optional: the simulated timeline (rank 0's streams, both simulated steps) of the
  // configuration named trace_config goes to this writer (runtime/trace.h).
  TraceWriter* trace = nullptr;
  std::string trace_config;
};

struct OverlapPrediction {
  std::string config;
  double measured_step_ms = 0;
  double predicted_step_ms = 0;
  double error = 0;                 // (predicted - measured) / measured
  double compute_ms = 0;            // the compute given to the simulation
  double predicted_exposed_ms = 0;  // its compute-stream waits for gathers
  double predicted_communication_ms = 0;
  double measured_gathers = 0, predicted_gathers = 0;
  double measured_reductions = 0, predicted_reductions = 0;
};

// Simulates every configuration of `run` on `topology` (its first run.ranks devices; the
// topology's compute throughput is replaced by 1e9 FLOP/s so that compute is given in ns, its
// device memory by unlimited). InvalidArgument where the topology has fewer devices than the
// run's ranks; the simulation's errors otherwise.
absl::StatusOr<std::vector<OverlapPrediction>> PredictOverlapBench(
    const Topology& topology, const OverlapBenchRun& run, const OverlapModelOptions& options = {});

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_TUNE_OVERLAP_VALIDATION_H_
