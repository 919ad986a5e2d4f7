// shardline-tune validate (scheduler/tools/internal/shardline_tune.h): sets the simulator's
// predicted step times against overlap_bench's measured ones.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "runtime/status.h"
#include "runtime/trace.h"
#include "scheduler/tools/internal/shardline_tune.h"
#include "scheduler/tune/overlap_validation.h"

namespace shardline::tune_cli {
namespace {

constexpr char kValidateUsage[] =
    "usage: shardline-tune validate --topology NAME|FILE [--zero-fill] [--markdown FILE]\n"
    "                               overlap.json...\n"
    "Simulates every configuration of overlap_bench runs (their --json output) on the topology\n"
    "(calibrated from the collective benchmarks) and sets the predicted step time against the\n"
    "measured one. Runs of the same --ratio and unit size are repeats: per (ratio, unit,\n"
    "configuration) the table has"
    " the median measured and the median predicted step over them.\n"
    "  --zero-fill       add the run's measured zero-fill per unit to the compute stream where\n"
    "                    the scheduler fills there (no backward prefetch)\n"
    "  --markdown FILE   also write the table to FILE\n"
    "  --trace FILE --trace-config NAME\n"
    "                    the simulated timeline (Chrome trace, rank 0) of configuration NAME\n"
    "                    of the first run\n";

double MedianOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  if (n == 0) return 0;
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

absl::Status Validate(int argc, char** argv) {
  std::string topology_name;
  std::string markdown, trace_path, trace_config;
  bool zero_fill = false;
  std::vector<std::string> inputs;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* flag) -> absl::StatusOr<std::string> {
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(flag, ": missing value"));
      return std::string(argv[++i]);
    };
    if (arg == "-h" || arg == "--help") {
      std::fputs(kValidateUsage, stdout);
      return absl::OkStatus();
    } else if (arg == "--topology") {
      SL_ASSIGN_OR_RETURN(topology_name, value("--topology"));
    } else if (arg == "--markdown") {
      SL_ASSIGN_OR_RETURN(markdown, value("--markdown"));
    } else if (arg == "--zero-fill") {
      zero_fill = true;
    } else if (arg == "--trace") {
      SL_ASSIGN_OR_RETURN(trace_path, value("--trace"));
    } else if (arg == "--trace-config") {
      SL_ASSIGN_OR_RETURN(trace_config, value("--trace-config"));
    } else if (absl::StartsWith(arg, "-")) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", arg));
    } else {
      inputs.push_back(arg);
    }
  }
  if (topology_name.empty()) return absl::InvalidArgumentError("--topology is required");
  if (inputs.empty()) return absl::InvalidArgumentError("no overlap_bench JSON file given");
  if (trace_path.empty() != trace_config.empty()) {
    return absl::InvalidArgumentError("--trace and --trace-config go together");
  }
  SL_ASSIGN_OR_RETURN(Topology topology, FindTopology(topology_name, argv[0]));
  std::unique_ptr<TraceWriter> trace;
  if (!trace_path.empty()) {
    trace = std::make_unique<TraceWriter>(
        0, absl::StrCat("shardline-tune validate: ", trace_config, " on ", topology.name));
  }

  // (ratio, configuration) in first-seen order -> measured and predicted per run.
  struct Row {
    double ratio = 0;
    OverlapBenchConfig config;
    uint64_t unit_bytes = 0;
    std::vector<double> measured, predicted, compute, exposed;
    std::string predicted_counts;
  };
  std::vector<Row> rows;
  std::vector<std::string> loads;
  int units = 0;
  int ranks = 0;
  for (const std::string& path : inputs) {
    SL_ASSIGN_OR_RETURN(std::string text, ReadFile(path, "overlap_bench JSON"));
    absl::StatusOr<OverlapBenchRun> run = ParseOverlapBenchJson(text);
    if (!run.ok()) return Annotate(run.status(), path);
    const bool traced = trace != nullptr && &path == &inputs.front();
    absl::StatusOr<std::vector<OverlapPrediction>> predictions =
        PredictOverlapBench(topology, *run,
                            {.zero_fill = zero_fill,
                             .trace = traced ? trace.get() : nullptr,
                             .trace_config = trace_config});
    if (!predictions.ok()) return Annotate(predictions.status(), path);
    if (traced) {
      if (std::none_of(run->configs.begin(), run->configs.end(),
                       [&](const OverlapBenchConfig& c) { return c.name == trace_config; })) {
        return absl::InvalidArgumentError(
            absl::StrCat("--trace-config ", trace_config, ": no such configuration in ", path));
      }
      SL_RETURN_IF_ERROR(trace->WriteFile(trace_path));
    }
    loads.push_back(absl::StrCat(run->load_before, " -> ", run->load_after));
    units = run->units;
    ranks = run->ranks;
    for (size_t i = 0; i < run->configs.size(); ++i) {
      const OverlapBenchConfig& c = run->configs[i];
      const OverlapPrediction& p = (*predictions)[i];
      auto it = std::find_if(rows.begin(), rows.end(), [&](const Row& r) {
        return r.ratio == run->ratio && r.unit_bytes == run->unit_bytes && r.config.name == c.name;
      });
      if (it == rows.end()) {
        rows.push_back({.ratio = run->ratio, .config = c, .unit_bytes = run->unit_bytes});
        it = rows.end() - 1;
      }
      it->measured.push_back(p.measured_step_ms);
      it->predicted.push_back(p.predicted_step_ms);
      it->compute.push_back(p.compute_ms);
      it->exposed.push_back(p.predicted_exposed_ms);
      it->predicted_counts =
          absl::StrFormat("%.0f/%.0f vs %.0f/%.0f", p.measured_gathers, p.measured_reductions,
                          p.predicted_gathers, p.predicted_reductions);
    }
  }
  std::string out = absl::StrFormat(
      "# topology %s: latency %.2f us, bus bandwidth %.2f GB/s, %zu curve points, host cores "
      "%s; %zu runs, %d ranks, %d units; zero-fills %s\n",
      topology.name, topology.intra_node.latency_s * 1e6,
      topology.intra_node.bandwidth_bytes_per_s / 1e9, topology.intra_node.efficiency.size(),
      topology.host_cores > 0 ? absl::StrFormat("%.2f", topology.host_cores)
                              : std::string("none (not shared)"),
      inputs.size(), ranks, units, zero_fill ? "modelled" : "not modelled");
  absl::StrAppend(&out, "# load average per run (before -> after): ", absl::StrJoin(loads, "; "),
                  "\n\n");
  absl::StrAppend(&out,
                  "| ratio | config | fwd / bwd prefetch | budget MiB | unit MiB | compute ms | "
                  "measured step ms | predicted step ms | error | predicted exposed ms | "
                  "AG/RS measured vs simulated |\n"
                  "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|\n");
  double worst = 0;
  for (const Row& r : rows) {
    const double measured = MedianOf(r.measured);
    const double predicted = MedianOf(r.predicted);
    const double error = (predicted - measured) / measured;
    worst = std::max(worst, std::abs(error));
    absl::StrAppend(
        &out,
        absl::StrFormat(
            "| %.2f | %s | %d / %s:%d | %s | %.1f | %.1f | %.1f | %.1f | %+.1f%% | %.1f | %s |\n",
            r.ratio, r.config.name, r.config.forward_prefetch,
            BackwardPrefetchName(r.config.backward_prefetch), r.config.backward_depth,
            r.config.budget_bytes == 0 ? std::string("none")
                                       : absl::StrFormat("%.1f", r.config.budget_bytes / 1048576.0),
            r.unit_bytes / 1048576.0, MedianOf(r.compute), measured, predicted, 100 * error,
            MedianOf(r.exposed), r.predicted_counts));
  }
  absl::StrAppend(&out, absl::StrFormat("\n# largest |error|: %.1f%% (%zu settings)\n", 100 * worst,
                                        rows.size()));
  std::fputs(out.c_str(), stdout);
  if (!markdown.empty()) SL_RETURN_IF_ERROR(WriteFile(markdown, out));
  return absl::OkStatus();
}

}  // namespace shardline::tune_cli
