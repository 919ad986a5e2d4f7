// shardline-tune sweep (scheduler/tools/internal/shardline_tune.h): simulates every
// configuration of the grid, prints the best ones and the recommendation, writes the table and
// the recommended configuration's trace.

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "runtime/status.h"
#include "runtime/trace.h"
#include "scheduler/tools/internal/shardline_tune.h"
#include "scheduler/tune/model.h"
#include "scheduler/tune/simulate.h"
#include "scheduler/tune/sweep.h"

namespace shardline::tune_cli {
namespace {

absl::StatusOr<ModelDescription> BuildModel(const SweepFlags& f) {
  if (!f.model_json.empty()) return ModelFromJson(f.model_json);
  SL_ASSIGN_OR_RETURN(TransformerConfig config, PresetConfig(f.model, f.seq_len, f.micro_batch));
  if (f.layers > 0) config.layers = f.layers;
  if (f.hidden > 0) config.hidden = f.hidden;
  if (f.ffn > 0) config.ffn = f.ffn;
  if (f.heads > 0) config.heads = f.heads;
  if (f.kv_heads > 0) config.kv_heads = f.kv_heads;
  if (f.vocab > 0) config.vocab = f.vocab;
  if (f.layers || f.hidden || f.ffn || f.heads || f.kv_heads || f.vocab) {
    config.name += " (modified)";
  }
  return TransformerModel(config);
}

std::string GiB(uint64_t bytes) {
  return absl::StrFormat("%.2f", static_cast<double>(bytes) / (1ull << 30));
}

}  // namespace

absl::Status Sweep(int argc, char** argv) {
  SL_ASSIGN_OR_RETURN(SweepFlags f, ParseSweepFlags(argc, argv));
  SL_ASSIGN_OR_RETURN(ModelDescription model, BuildModel(f));
  SL_ASSIGN_OR_RETURN(Topology topology, FindTopology(f.topology, argv[0]));
  auto shared_topology = std::make_shared<const Topology>(std::move(topology));
  SL_ASSIGN_OR_RETURN(std::unique_ptr<SimCluster> cluster, CreateTopologyCluster(shared_topology));
  f.space.world_size = f.world > 0 ? f.world : shared_topology->devices();
  if (f.space.world_size > shared_topology->devices()) {
    return absl::InvalidArgumentError(absl::StrCat("--world ", f.space.world_size, ": topology '",
                                                   shared_topology->name, "' has only ",
                                                   shared_topology->devices(), " devices"));
  }
  if (!f.shard_sizes_given) {
    const int d = shared_topology->devices_per_node;
    for (const int k : {d, 2 * d}) {
      if (k > 1 && k < f.space.world_size && f.space.world_size % k == 0) {
        f.space.hybrid_shard_sizes.push_back(k);
      }
    }
    if (f.space.hybrid_shard_sizes.empty()) {
      // No hybrid mesh fits this world with the default sizes: drop the strategy.
      std::erase(f.space.strategies, ShardingStrategy::kHybridShard);
      if (f.space.strategies.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--strategies hybrid: no default shard size fits a world of ",
                         f.space.world_size, " (give --shard-sizes)"));
      }
    }
  }
  SL_ASSIGN_OR_RETURN(std::vector<SimulationConfig> grid, ExpandSweep(f.space));

  const bool progress = f.progress.value_or(isatty(STDERR_FILENO) != 0);
  SweepOptions options;
  options.threads = f.jobs > 0 ? f.jobs : std::max(1u, std::thread::hardware_concurrency());
  options.peak_flops_per_s = f.peak_tflops * 1e12;
  const absl::Time start = absl::Now();
  if (progress) {
    options.progress = [&](int done, int total) {
      // At most once per percent.
      if (done != total && done > 1 &&
          static_cast<int64_t>(done) * 100 / total ==
              static_cast<int64_t>(done - 1) * 100 / total) {
        return;
      }
      constexpr int kWidth = 40;
      const int filled = static_cast<int>(static_cast<int64_t>(kWidth) * done / total);
      std::fprintf(stderr, "\r[%s%s] %d/%d configurations, %.1f s",
                   std::string(filled, '#').c_str(), std::string(kWidth - filled, ' ').c_str(),
                   done, total, absl::ToDoubleSeconds(absl::Now() - start));
      if (done == total) std::fputc('\n', stderr);
      std::fflush(stderr);
    };
  }
  std::printf("# model %s: %.3fB parameters, %lld tokens per micro-batch\n", model.name.c_str(),
              static_cast<double>(model.ParameterCount()) / 1e9,
              static_cast<long long>(model.tokens_per_micro_batch));
  std::printf("# cluster %s; world %d ranks\n", cluster->Describe().c_str(), f.space.world_size);
  std::printf("# %zu configurations, %d at once; not modelled: %s\n", grid.size(), options.threads,
              absl::StrJoin(kNotModelled, "; ").c_str());
  std::fflush(stdout);
  SL_ASSIGN_OR_RETURN(SweepResult result, RunSweep(model, grid, *cluster, options));

  int representative = 0, failed = 0, fits = 0;
  for (const SweepRow& row : result.rows) {
    if (!row.status.ok()) {
      ++failed;
      continue;
    }
    if (row.report.representative) ++representative;
    if (row.report.fits) ++fits;
  }
  std::printf(
      "# simulated in %.1f s; %d of %zu configurations with one representative rank "
      "standing for all %d (symmetric placement), the others with every rank\n",
      result.seconds, representative, result.rows.size() - failed, f.space.world_size);
  std::printf("# %d fit %s GiB of device memory, %zu do not, %d refused by the scheduler\n", fits,
              GiB(cluster->device_memory_bytes()).c_str(), result.rows.size() - failed - fits,
              failed);
  const std::string dtype(DTypeName(model.precision.param_dtype));
  if (result.peak_flops_per_s > 0) {
    std::printf(
        "# MFU: model FLOPs per second over the peak, %.1f TFLOP/s per device (%s); HFU counts "
        "the recomputation too; busy: compute time / step time\n",
        result.peak_flops_per_s / 1e12,
        f.peak_tflops > 0 ? "--peak-TFLOPs"
                          : absl::StrCat("the topology's ", dtype, " peak_TFLOPs").c_str());
  } else {
    std::printf(
        "# MFU and HFU: n/a (the topology states no peak_TFLOPs for %s; give --peak-TFLOPs); "
        "busy: compute time / step time\n",
        dtype.c_str());
  }

  // The best rows: those that fit first, by tokens/s.
  std::vector<int> order;
  for (size_t i = 0; i < result.rows.size(); ++i) {
    if (result.rows[i].status.ok()) order.push_back(static_cast<int>(i));
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const SimulationReport& x = result.rows[a].report;
    const SimulationReport& y = result.rows[b].report;
    if (x.fits != y.fits) return x.fits;
    return x.tokens_per_s_per_device > y.tokens_per_s_per_device;
  });
  std::printf("%5s  %-52s %9s %10s %6s %6s %6s %9s %9s %9s %9s %5s\n", "row", "configuration",
              "step_ms", "tok/s/dev", "MFU", "HFU", "busy", "exposed", "intra_GB", "inter_GB",
              "peak_GiB", "fits");
  auto of_peak = [](const SweepRow& row, double v) {
    return row.peak_flops_per_s > 0 ? absl::StrFormat("%.3f", v) : std::string("n/a");
  };
  for (size_t k = 0; k < order.size() && k < static_cast<size_t>(f.top); ++k) {
    const SweepRow& row = result.rows[order[k]];
    const SimulationReport& r = row.report;
    std::printf("%5d  %-52s %9.2f %10.1f %6s %6s %6.3f %9.2f %9.3f %9.3f %9s %5s\n", order[k],
                DescribeConfig(row.config).c_str(),
                absl::ToDoubleMilliseconds(r.step_time.value_or(absl::ZeroDuration())),
                r.tokens_per_s_per_device, of_peak(row, row.mfu).c_str(),
                of_peak(row, row.hfu).c_str(), row.compute_busy,
                absl::ToDoubleMilliseconds(r.exposed_communication.value_or(absl::ZeroDuration())),
                r.intra_node_bytes_per_device / 1e9, r.inter_node_bytes_per_device / 1e9,
                GiB(r.memory.total_peak).c_str(), r.fits ? "yes" : "NO");
  }
  if (result.best < 0) {
    std::printf("# no configuration fits the device memory\n");
  } else {
    const SweepRow& best = result.rows[result.best];
    std::printf(
        "# recommended: row %d, %s: %.2f ms per step, %.1f tokens/s per device, MFU %s, "
        "compute busy %.3f, peak %s GiB\n",
        result.best, DescribeConfig(best.config).c_str(),
        absl::ToDoubleMilliseconds(*best.report.step_time), best.report.tokens_per_s_per_device,
        of_peak(best, best.mfu).c_str(), best.compute_busy,
        GiB(best.report.memory.total_peak).c_str());
  }
  if (!f.json.empty()) {
    SL_RETURN_IF_ERROR(WriteFile(f.json, SweepToJson(result, model, *cluster)));
    std::printf("# wrote %s\n", f.json.c_str());
  }
  if (!f.csv.empty()) {
    SL_RETURN_IF_ERROR(WriteFile(f.csv, SweepToCsv(result)));
    std::printf("# wrote %s\n", f.csv.c_str());
  }
  if (!f.trace.empty()) {
    if (result.best < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("--trace ", f.trace, ": no configuration fits, nothing to trace"));
    }
    SimulationConfig c = result.rows[result.best].config;
    TraceWriter trace(0, absl::StrCat("shardline-tune: ", DescribeConfig(c)));
    c.trace = &trace;
    SL_RETURN_IF_ERROR(Simulate(model, c, *cluster).status());
    SL_RETURN_IF_ERROR(trace.WriteFile(f.trace));
    std::printf("# wrote %s (rank 0 of the recommended configuration, virtual time)\n",
                f.trace.c_str());
  }
  return absl::OkStatus();
}

}  // namespace shardline::tune_cli
