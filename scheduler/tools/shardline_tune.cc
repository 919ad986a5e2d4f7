// shardline-tune: the tuner's command line.
//
//   shardline-tune sweep --model llama3-8b --topology h100-128-nodes --world 1024 [options]
//   shardline-tune calibrate [options] -o topology.json perf.json...   (shardline-tune-calibrate)
//
// sweep simulates every configuration of a grid (scheduler/tune/sweep.h) of the real scheduler
// on a simulated cluster (a topology: a shipped name or a JSON file), prints the best ones and
// the recommendation, and writes the whole table as JSON and CSV, and the chosen
// configuration's simulated timeline as a Chrome trace (runtime/trace.h, the form the scheduler
// writes). `shardline-tune sweep --help` lists the options; docs/tuning.md walks through a run.
// Exit status: 0, or 2 with a message naming what was wrong.

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "collectives/sim/topology.h"
#include "runtime/status.h"
#include "runtime/trace.h"
#include "scheduler/tune/model.h"
#include "scheduler/tune/overlap_validation.h"
#include "scheduler/tune/simulate.h"
#include "scheduler/tune/sweep.h"

namespace shardline {

// collectives/tools/tune_calibrate.cc, compiled into this binary too.
absl::Status TuneCalibrateMain(int argc, char** argv, const char* program);

namespace {

constexpr char kUsage[] =
    "usage: shardline-tune sweep (--model PRESET | --model-json FILE) --topology NAME|FILE\n"
    "                            [options]\n"
    "       shardline-tune calibrate [options] -o topology.json perf.json...\n"
    "                            (shardline-tune calibrate --help)\n"
    "       shardline-tune validate --topology NAME|FILE [options] overlap.json...\n"
    "                            (shardline-tune validate --help)\n";

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

constexpr char kSweepUsage[] =
    "usage: shardline-tune sweep [options]\n"
    "model (one of):\n"
    "  --model PRESET            llama3-8b, llama3-70b, llama3-405b, gpt3-175b\n"
    "    --seq-len S --micro-batch B        the preset's shape (8192 / gpt3: 2048; 1)\n"
    "    --layers L --hidden H --ffn F --heads A --kv-heads K --vocab V   overrides\n"
    "  --model-json FILE         a model description (docs/tuning-model.md)\n"
    "cluster:\n"
    "  --topology NAME|FILE      a shipped topology (dgx-h100, h100-128-nodes, dgx-a100,\n"
    "                            this-machine) or a topology JSON file\n"
    "  --world N                 ranks (default: every device of the topology)\n"
    "  --peak-TFLOPs X           per-device peak for MFU (default: the topology's achieved\n"
    "                            compute_TFLOPs, so MFU = compute time / step time)\n"
    "dimensions (comma-separated lists):\n"
    "  --strategies LIST         full, hybrid, shard_grad_op, no_shard (default: all)\n"
    "  --shard-sizes LIST        hybrid shard-group sizes (default: devices per node and twice\n"
    "                            that, where they divide the world and are below it)\n"
    "  --forward-prefetch LIST   depths (default 1,2)\n"
    "  --backward-prefetch LIST  off, before_grad, after_grad (default before_grad)\n"
    "  --backward-depth LIST     depths (default 1)\n"
    "  --budget-units LIST       unit caps, 0 = none (default 0)\n"
    "  --budget-GiB LIST         byte caps in GiB, 0 = none (default 0)\n"
    "  --param-dtypes LIST       f32, bf16, f16, model (default model)\n"
    "  --reduce-dtypes LIST      f32, bf16, f16, model (default model)\n"
    "  --checkpointing LIST      off, on (default off,on)\n"
    "  --micro-batches LIST      micro-batches per optimizer step (default 1; each of the model's\n"
    "                            --micro-batch sequences)\n"
    "  --accumulation LIST       no_sync, sync: reduce on the last micro-batch only, or on every\n"
    "                            one (default no_sync; one value where micro-batches is 1)\n"
    "  --cpu-offload LIST        off, on: master shards, gradients and optimizer state in host\n"
    "                            memory, copied over the topology's host_link_GBps (default off)\n"
    "simulation:\n"
    "  --host-lead one_use|whole_step      (default one_use)\n"
    "  --ranks auto|all|representative     (default auto: one representative rank where the\n"
    "                                      placement is symmetric)\n"
    "  --jobs N                  configurations at once (default: the CPUs)\n"
    "output:\n"
    "  --json FILE  --csv FILE   the table\n"
    "  --trace FILE              Chrome trace of the recommended configuration (rank 0)\n"
    "  --top K                   rows printed (default 10)\n"
    "  --progress | --no-progress   progress bar on stderr (default: when it is a terminal)\n";

struct SweepFlags {
  std::string model, model_json, topology, json, csv, trace;
  int64_t seq_len = 0, hidden = 0, ffn = 0, vocab = 0;
  int micro_batch = 0, layers = 0, heads = 0, kv_heads = 0;
  int world = 0, jobs = 0, top = 10;
  double peak_tflops = 0;
  std::optional<bool> progress;
  SweepSpace space;
  bool shard_sizes_given = false;
};

absl::Status Bad(absl::string_view flag, absl::string_view value, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(flag, ": '", value, "' ", what));
}

template <typename T, typename F>
absl::StatusOr<std::vector<T>> ParseList(absl::string_view flag, absl::string_view value,
                                         F parse_one) {
  std::vector<T> out;
  for (absl::string_view item : absl::StrSplit(value, ',')) {
    if (item.empty()) return Bad(flag, value, "has an empty item");
    SL_ASSIGN_OR_RETURN(T v, parse_one(item));
    out.push_back(std::move(v));
  }
  return out;
}

absl::StatusOr<SweepFlags> ParseSweepFlags(int argc, char** argv) {
  SweepFlags f;
  f.space.strategies = {ShardingStrategy::kFullShard, ShardingStrategy::kHybridShard,
                        ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard};
  f.space.forward_prefetch = {1, 2};
  f.space.activation_checkpointing = {false, true};
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::fputs(kSweepUsage, stdout);
      std::exit(0);
    }
    if (arg == "--progress" || arg == "--no-progress") {
      f.progress = arg == "--progress";
      continue;
    }
    if (arg.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", arg, "' (sweep takes only flags)"));
    }
    if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(arg, " needs a value"));
    const std::string value = argv[++i];
    auto positive = [&](auto* out) -> absl::Status {
      int64_t v = 0;
      if (!absl::SimpleAtoi(value, &v) || v < 1)
        return Bad(arg, value, "is not a positive integer");
      *out = static_cast<std::remove_pointer_t<decltype(out)>>(v);
      return absl::OkStatus();
    };
    auto non_negative = [&](absl::string_view item) -> absl::StatusOr<int> {
      int v = 0;
      if (!absl::SimpleAtoi(item, &v) || v < 0) {
        return Bad(arg, item, "is not a non-negative integer");
      }
      return v;
    };
    auto dtype = [&](absl::string_view item) -> absl::StatusOr<std::optional<DType>> {
      if (item == "model") return std::optional<DType>();
      absl::StatusOr<DType> d = ParseDType(item);
      if (!d.ok() || !IsFloatingPoint(*d)) {
        return Bad(arg, item, "is not a floating dtype (f32, bf16, f16, f64) or 'model'");
      }
      return std::optional<DType>(*d);
    };
    if (arg == "--model") {
      f.model = value;
    } else if (arg == "--model-json") {
      f.model_json = value;
    } else if (arg == "--topology") {
      f.topology = value;
    } else if (arg == "--json") {
      f.json = value;
    } else if (arg == "--csv") {
      f.csv = value;
    } else if (arg == "--trace") {
      f.trace = value;
    } else if (arg == "--seq-len") {
      SL_RETURN_IF_ERROR(positive(&f.seq_len));
    } else if (arg == "--micro-batch") {
      SL_RETURN_IF_ERROR(positive(&f.micro_batch));
    } else if (arg == "--layers") {
      SL_RETURN_IF_ERROR(positive(&f.layers));
    } else if (arg == "--hidden") {
      SL_RETURN_IF_ERROR(positive(&f.hidden));
    } else if (arg == "--ffn") {
      SL_RETURN_IF_ERROR(positive(&f.ffn));
    } else if (arg == "--heads") {
      SL_RETURN_IF_ERROR(positive(&f.heads));
    } else if (arg == "--kv-heads") {
      SL_RETURN_IF_ERROR(positive(&f.kv_heads));
    } else if (arg == "--vocab") {
      SL_RETURN_IF_ERROR(positive(&f.vocab));
    } else if (arg == "--world") {
      SL_RETURN_IF_ERROR(positive(&f.world));
    } else if (arg == "--jobs") {
      SL_RETURN_IF_ERROR(positive(&f.jobs));
    } else if (arg == "--top") {
      SL_RETURN_IF_ERROR(positive(&f.top));
    } else if (arg == "--peak-TFLOPs") {
      if (!absl::SimpleAtod(value, &f.peak_tflops) || !(f.peak_tflops > 0)) {
        return Bad(arg, value, "is not a positive number");
      }
    } else if (arg == "--strategies") {
      SL_ASSIGN_OR_RETURN(
          f.space.strategies,
          ParseList<ShardingStrategy>(
              arg, value, [&](absl::string_view s) -> absl::StatusOr<ShardingStrategy> {
                if (s == "full") return ShardingStrategy::kFullShard;
                if (s == "hybrid") return ShardingStrategy::kHybridShard;
                if (s == "shard_grad_op") return ShardingStrategy::kShardGradOp;
                if (s == "no_shard") return ShardingStrategy::kNoShard;
                return Bad(arg, s, "is not full, hybrid, shard_grad_op or no_shard");
              }));
    } else if (arg == "--shard-sizes") {
      SL_ASSIGN_OR_RETURN(
          f.space.hybrid_shard_sizes,
          ParseList<int>(arg, value, [&](absl::string_view s) -> absl::StatusOr<int> {
            SL_ASSIGN_OR_RETURN(int v, non_negative(s));
            if (v < 1) return Bad(arg, s, "is not a positive integer");
            return v;
          }));
      f.shard_sizes_given = true;
    } else if (arg == "--forward-prefetch") {
      SL_ASSIGN_OR_RETURN(f.space.forward_prefetch, ParseList<int>(arg, value, non_negative));
    } else if (arg == "--backward-prefetch") {
      SL_ASSIGN_OR_RETURN(
          f.space.backward_prefetch,
          ParseList<BackwardPrefetch>(arg, value,
                                      [&](absl::string_view s) -> absl::StatusOr<BackwardPrefetch> {
                                        if (s == "off") return BackwardPrefetch::kOff;
                                        if (s == "before_grad")
                                          return BackwardPrefetch::kBeforeGrad;
                                        if (s == "after_grad") return BackwardPrefetch::kAfterGrad;
                                        return Bad(arg, s, "is not off, before_grad or after_grad");
                                      }));
    } else if (arg == "--backward-depth") {
      SL_ASSIGN_OR_RETURN(f.space.backward_prefetch_depth,
                          ParseList<int>(arg, value, non_negative));
    } else if (arg == "--budget-units") {
      SL_ASSIGN_OR_RETURN(f.space.budget_units, ParseList<int>(arg, value, non_negative));
    } else if (arg == "--budget-GiB") {
      SL_ASSIGN_OR_RETURN(
          f.space.budget_bytes,
          ParseList<uint64_t>(arg, value, [&](absl::string_view s) -> absl::StatusOr<uint64_t> {
            double gib = 0;
            if (!absl::SimpleAtod(s, &gib) || gib < 0) {
              return Bad(arg, s, "is not a non-negative number");
            }
            return static_cast<uint64_t>(gib * (1ull << 30));
          }));
    } else if (arg == "--param-dtypes") {
      SL_ASSIGN_OR_RETURN(f.space.param_dtypes, ParseList<std::optional<DType>>(arg, value, dtype));
    } else if (arg == "--reduce-dtypes") {
      SL_ASSIGN_OR_RETURN(f.space.reduce_dtypes,
                          ParseList<std::optional<DType>>(arg, value, dtype));
    } else if (arg == "--micro-batches") {
      SL_ASSIGN_OR_RETURN(
          f.space.micro_batches,
          ParseList<int>(arg, value, [&](absl::string_view s) -> absl::StatusOr<int> {
            SL_ASSIGN_OR_RETURN(int v, non_negative(s));
            if (v < 1) return Bad(arg, s, "is not a positive integer");
            return v;
          }));
    } else if (arg == "--accumulation") {
      SL_ASSIGN_OR_RETURN(
          f.space.accumulation,
          ParseList<GradientAccumulation>(
              arg, value, [&](absl::string_view s) -> absl::StatusOr<GradientAccumulation> {
                if (s == "no_sync") return GradientAccumulation::kNoSync;
                if (s == "sync") return GradientAccumulation::kSync;
                return Bad(arg, s, "is not no_sync or sync");
              }));
    } else if (arg == "--cpu-offload") {
      SL_ASSIGN_OR_RETURN(
          f.space.cpu_offload,
          ParseList<bool>(arg, value, [&](absl::string_view s) -> absl::StatusOr<bool> {
            if (s == "on") return true;
            if (s == "off") return false;
            return Bad(arg, s, "is not on or off");
          }));
    } else if (arg == "--checkpointing") {
      SL_ASSIGN_OR_RETURN(
          f.space.activation_checkpointing,
          ParseList<bool>(arg, value, [&](absl::string_view s) -> absl::StatusOr<bool> {
            if (s == "on") return true;
            if (s == "off") return false;
            return Bad(arg, s, "is not on or off");
          }));
    } else if (arg == "--host-lead") {
      if (value == "one_use") {
        f.space.host_lead = HostLead::kOneUse;
      } else if (value == "whole_step") {
        f.space.host_lead = HostLead::kWholeStep;
      } else {
        return Bad(arg, value, "is not one_use or whole_step");
      }
    } else if (arg == "--ranks") {
      if (value == "auto") {
        f.space.ranks = RankMode::kAuto;
      } else if (value == "all") {
        f.space.ranks = RankMode::kAll;
      } else if (value == "representative") {
        f.space.ranks = RankMode::kRepresentative;
      } else {
        return Bad(arg, value, "is not auto, all or representative");
      }
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag ", arg, " (shardline-tune sweep --help lists them)"));
    }
  }
  if (f.model.empty() == f.model_json.empty()) {
    return absl::InvalidArgumentError("give exactly one of --model PRESET and --model-json FILE");
  }
  if (!f.model_json.empty() && (f.seq_len || f.micro_batch || f.layers || f.hidden || f.ffn ||
                                f.heads || f.kv_heads || f.vocab)) {
    return absl::InvalidArgumentError(
        "--seq-len, --micro-batch and the shape overrides apply to --model presets, not to "
        "--model-json");
  }
  if (f.topology.empty()) return absl::InvalidArgumentError("--topology is required");
  return f;
}

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", what, " '", path, "'"));
  return std::string(std::istreambuf_iterator<char>(in), {});
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write '", path, "'"));
  return absl::OkStatus();
}

// A file path, or a shipped name looked up in the source tree's and the installation's
// topology folders.
absl::StatusOr<Topology> FindTopology(const std::string& name, const char* argv0) {
  if (name.find('/') != std::string::npos || name.find(".json") != std::string::npos) {
    return LoadTopology(name);
  }
  std::vector<std::string> dirs;
#ifdef SHARDLINE_TOPOLOGIES_DIR
  dirs.push_back(SHARDLINE_TOPOLOGIES_DIR);
#endif
  std::string exe = argv0;
  if (const size_t slash = exe.rfind('/'); slash != std::string::npos) {
    dirs.push_back(exe.substr(0, slash) + "/../share/shardline/topologies");
  }
  for (const std::string& dir : dirs) {
    const std::string path = absl::StrCat(dir, "/", name, ".json");
    if (std::ifstream(path).good()) return LoadTopology(path);
  }
  return absl::NotFoundError(absl::StrCat("--topology: '", name,
                                          "' is neither a file nor a shipped topology (dgx-h100, "
                                          "h100-128-nodes, dgx-a100, dgx-a100-cluster, "
                                          "this-machine)"));
}

absl::StatusOr<ModelDescription> BuildModel(const SweepFlags& f) {
  if (!f.model_json.empty()) {
    SL_ASSIGN_OR_RETURN(std::string text, ReadFile(f.model_json, "model"));
    absl::StatusOr<ModelDescription> m = ParseModelJson(text);
    if (!m.ok()) return Annotate(m.status(), f.model_json);
    return m;
  }
  PresetShape shape;
  if (f.model == "gpt3-175b") shape.seq_len = 2048;
  if (f.seq_len > 0) shape.seq_len = f.seq_len;
  if (f.micro_batch > 0) shape.micro_batch = f.micro_batch;
  absl::StatusOr<TransformerConfig> config = PresetByName(f.model, shape);
  if (!config.ok()) return Annotate(config.status(), "--model");
  if (f.layers > 0) config->layers = f.layers;
  if (f.hidden > 0) config->hidden = f.hidden;
  if (f.ffn > 0) config->ffn = f.ffn;
  if (f.heads > 0) config->heads = f.heads;
  if (f.kv_heads > 0) config->kv_heads = f.kv_heads;
  if (f.vocab > 0) config->vocab = f.vocab;
  if (f.layers || f.hidden || f.ffn || f.heads || f.kv_heads || f.vocab) {
    config->name += " (modified)";
  }
  return TransformerModel(*config);
}

std::string GiB(uint64_t bytes) {
  return absl::StrFormat("%.2f", static_cast<double>(bytes) / (1ull << 30));
}

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
  std::printf("# MFU against %.1f TFLOP/s per device%s\n", result.peak_flops_per_s / 1e12,
              f.peak_tflops > 0 ? "" : " (the topology's achieved throughput: --peak-TFLOPs)");

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
  std::printf("%5s  %-52s %9s %10s %6s %9s %9s %9s %9s %5s\n", "row", "configuration", "step_ms",
              "tok/s/dev", "MFU", "exposed", "intra_GB", "inter_GB", "peak_GiB", "fits");
  for (size_t k = 0; k < order.size() && k < static_cast<size_t>(f.top); ++k) {
    const SweepRow& row = result.rows[order[k]];
    const SimulationReport& r = row.report;
    std::printf("%5d  %-52s %9.2f %10.1f %6.3f %9.2f %9.3f %9.3f %9s %5s\n", order[k],
                DescribeConfig(row.config).c_str(),
                absl::ToDoubleMilliseconds(r.step_time.value_or(absl::ZeroDuration())),
                r.tokens_per_s_per_device, row.mfu,
                absl::ToDoubleMilliseconds(r.exposed_communication.value_or(absl::ZeroDuration())),
                r.intra_node_bytes_per_device / 1e9, r.inter_node_bytes_per_device / 1e9,
                GiB(r.memory.total_peak).c_str(), r.fits ? "yes" : "NO");
  }
  if (result.best < 0) {
    std::printf("# no configuration fits the device memory\n");
  } else {
    const SweepRow& best = result.rows[result.best];
    std::printf(
        "# recommended: row %d, %s: %.2f ms per step, %.1f tokens/s per device, MFU %.3f, "
        "peak %s GiB\n",
        result.best, DescribeConfig(best.config).c_str(),
        absl::ToDoubleMilliseconds(*best.report.step_time), best.report.tokens_per_s_per_device,
        best.mfu, GiB(best.report.memory.total_peak).c_str());
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

double MedianOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  if (n == 0) return 0;
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

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

}  // namespace
}  // namespace shardline

int main(int argc, char** argv) {
  // The scheduler's warnings (a budget below what the units need, say) would flood the terminal
  // over a sweep; the table carries them (budget_overshoots, errors). SHARDLINE_DEBUG_FILE, if
  // set, still receives them.
  setenv("SHARDLINE_DEBUG_FILE", "/dev/null", /*overwrite=*/0);
  const std::string command = argc > 1 ? argv[1] : "";
  absl::Status status;
  if (command == "sweep") {
    status = shardline::Sweep(argc, argv);
  } else if (command == "validate") {
    status = shardline::Validate(argc, argv);
  } else if (command == "calibrate") {
    status = shardline::TuneCalibrateMain(argc - 1, argv + 1, "shardline-tune calibrate");
  } else if (command == "-h" || command == "--help") {
    std::fputs(shardline::kUsage, stdout);
    return 0;
  } else {
    std::fprintf(stderr, "shardline-tune: %s\n%s",
                 command.empty() ? "no subcommand (sweep, calibrate or validate)"
                                 : absl::StrCat("unknown subcommand '", command, "'").c_str(),
                 shardline::kUsage);
    return 2;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "shardline-tune %s: %s\n", command.c_str(),
                 std::string(status.message()).c_str());
    return 2;
  }
  return 0;
}
