#include "scheduler/tune/overlap_validation.h"

#include <cmath>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "runtime/json.h"
#include "runtime/status.h"

namespace shardline {
namespace {

absl::Status BadMember(absl::string_view member, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("overlap_bench JSON: '", member, "' ", what));
}

absl::StatusOr<const JsonValue*> Member(const JsonValue& object, absl::string_view path,
                                        absl::string_view key, JsonValue::Kind kind) {
  const JsonValue* v = object.Find(key);
  const std::string name = path.empty() ? std::string(key) : absl::StrCat(path, ".", key);
  if (v == nullptr) return BadMember(name, "is missing");
  const bool number = kind == JsonValue::Kind::kNumber;
  if (number ? !v->is_number() : v->kind() != kind) {
    return BadMember(name, absl::StrCat("must be ", number ? "a number" : JsonKindName(kind),
                                        ", got ", JsonKindName(v->kind())));
  }
  return v;
}

absl::StatusOr<double> Number(const JsonValue& object, absl::string_view path,
                              absl::string_view key) {
  SL_ASSIGN_OR_RETURN(const JsonValue* v, Member(object, path, key, JsonValue::Kind::kNumber));
  return v->number();
}

absl::StatusOr<std::string> String(const JsonValue& object, absl::string_view path,
                                   absl::string_view key) {
  SL_ASSIGN_OR_RETURN(const JsonValue* v, Member(object, path, key, JsonValue::Kind::kString));
  return v->string();
}

// A whole number >= lo.
absl::StatusOr<int64_t> Whole(const JsonValue& object, absl::string_view path,
                              absl::string_view key, int64_t lo) {
  SL_ASSIGN_OR_RETURN(double v, Number(object, path, key));
  if (!(v >= static_cast<double>(lo)) || v != std::floor(v) || v > 9e15) {
    return BadMember(path.empty() ? std::string(key) : absl::StrCat(path, ".", key),
                     absl::StrCat("must be a whole number >= ", lo, ", got ", v));
  }
  return static_cast<int64_t>(v);
}

absl::StatusOr<BackwardPrefetch> ParseBackward(absl::string_view member, absl::string_view name) {
  for (BackwardPrefetch b :
       {BackwardPrefetch::kOff, BackwardPrefetch::kBeforeGrad, BackwardPrefetch::kAfterGrad}) {
    if (BackwardPrefetchName(b) == name) return b;
  }
  return BadMember(member, absl::StrCat("is not a backward prefetch mode: '", name, "'"));
}

}  // namespace

absl::StatusOr<OverlapBenchRun> ParseOverlapBenchJson(absl::string_view json) {
  SL_ASSIGN_OR_RETURN(JsonValue root, ParseJson(json));
  if (root.kind() != JsonValue::Kind::kObject) return BadMember("(root)", "must be an object");
  OverlapBenchRun run;
  SL_ASSIGN_OR_RETURN(std::string bench, String(root, "", "benchmark"));
  if (bench != "overlap_bench") return BadMember("benchmark", absl::StrCat("is '", bench, "'"));
  SL_ASSIGN_OR_RETURN(int64_t ranks, Whole(root, "", "ranks", 1));
  SL_ASSIGN_OR_RETURN(int64_t units, Whole(root, "", "units", 1));
  SL_ASSIGN_OR_RETURN(int64_t root_unit, Whole(root, "", "root_unit", -1));
  run.ranks = static_cast<int>(ranks);
  run.units = static_cast<int>(units);
  run.root_unit = static_cast<int>(root_unit);
  if (run.root_unit >= run.units) return BadMember("root_unit", "is not below 'units'");
  SL_ASSIGN_OR_RETURN(run.ratio, Number(root, "", "ratio"));
  SL_ASSIGN_OR_RETURN(run.backward_factor, Number(root, "", "backward_factor"));
  if (!(run.backward_factor > 0)) return BadMember("backward_factor", "must be > 0");
  SL_ASSIGN_OR_RETURN(run.compute, String(root, "", "compute"));
  if (run.compute != "stream") {
    return BadMember(
        "compute",
        absl::StrCat("is '", run.compute, "': only runs with --compute stream can be simulated"));
  }
  SL_ASSIGN_OR_RETURN(run.load_before, String(root, "", "load_before"));
  SL_ASSIGN_OR_RETURN(run.load_after, String(root, "", "load_after"));
  SL_ASSIGN_OR_RETURN(const JsonValue* calib,
                      Member(root, "", "calibration", JsonValue::Kind::kObject));
  SL_ASSIGN_OR_RETURN(int64_t unit_bytes, Whole(*calib, "calibration", "unit_bytes", 4));
  if (unit_bytes % 4 != 0)
    return BadMember("calibration.unit_bytes", "is not a multiple of 4 (f32)");
  run.unit_bytes = static_cast<uint64_t>(unit_bytes);
  SL_ASSIGN_OR_RETURN(run.all_gather_us, Number(*calib, "calibration", "all_gather_us"));
  SL_ASSIGN_OR_RETURN(run.reduce_scatter_us, Number(*calib, "calibration", "reduce_scatter_us"));
  SL_ASSIGN_OR_RETURN(run.zero_fill_us, Number(*calib, "calibration", "zero_fill_us"));
  SL_ASSIGN_OR_RETURN(run.forward_us, Number(*calib, "calibration", "forward_us"));
  SL_ASSIGN_OR_RETURN(run.backward_us, Number(*calib, "calibration", "backward_us"));
  SL_ASSIGN_OR_RETURN(const JsonValue* configs,
                      Member(root, "", "configs", JsonValue::Kind::kArray));
  if (configs->items().empty()) return BadMember("configs", "is empty");
  for (size_t i = 0; i < configs->items().size(); ++i) {
    const JsonValue& c = configs->items()[i];
    const std::string path = absl::StrCat("configs[", i, "]");
    if (c.kind() != JsonValue::Kind::kObject) return BadMember(path, "must be an object");
    OverlapBenchConfig config;
    SL_ASSIGN_OR_RETURN(config.name, String(c, path, "name"));
    SL_ASSIGN_OR_RETURN(int64_t fp, Whole(c, path, "forward_prefetch", 0));
    SL_ASSIGN_OR_RETURN(std::string bp, String(c, path, "backward_prefetch"));
    SL_ASSIGN_OR_RETURN(config.backward_prefetch,
                        ParseBackward(absl::StrCat(path, ".backward_prefetch"), bp));
    SL_ASSIGN_OR_RETURN(int64_t bd, Whole(c, path, "backward_depth", 0));
    SL_ASSIGN_OR_RETURN(int64_t budget, Whole(c, path, "budget_bytes", 0));
    config.forward_prefetch = static_cast<int>(fp);
    config.backward_depth = static_cast<int>(bd);
    config.budget_bytes = static_cast<uint64_t>(budget);
    SL_ASSIGN_OR_RETURN(const JsonValue* median,
                        Member(c, path, "median", JsonValue::Kind::kObject));
    const std::string mpath = absl::StrCat(path, ".median");
    SL_ASSIGN_OR_RETURN(config.step_ms, Number(*median, mpath, "step_ms"));
    SL_ASSIGN_OR_RETURN(config.compute_ms, Number(*median, mpath, "compute_ms"));
    SL_ASSIGN_OR_RETURN(config.gathers, Number(*median, mpath, "gathers"));
    SL_ASSIGN_OR_RETURN(config.reductions, Number(*median, mpath, "reductions"));
    if (!(config.step_ms > 0) || !(config.compute_ms > 0)) {
      return BadMember(mpath, "step_ms and compute_ms must be > 0");
    }
    SL_ASSIGN_OR_RETURN(const JsonValue* samples,
                        Member(c, path, "samples", JsonValue::Kind::kArray));
    for (size_t j = 0; j < samples->items().size(); ++j) {
      const JsonValue& s = samples->items()[j];
      if (s.kind() != JsonValue::Kind::kObject) {
        return BadMember(absl::StrCat(path, ".samples[", j, "]"), "must be an object");
      }
      SL_ASSIGN_OR_RETURN(double step,
                          Number(s, absl::StrCat(path, ".samples[", j, "]"), "step_ms"));
      config.step_samples_ms.push_back(step);
    }
    run.configs.push_back(std::move(config));
  }
  return run;
}

absl::StatusOr<ModelDescription> OverlapBenchModel(int units, uint64_t unit_bytes,
                                                   uint64_t forward_ns, uint64_t backward_ns) {
  if (units < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("overlap model: units must be >= 1, got ", units));
  }
  if (unit_bytes < 4 || unit_bytes % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "overlap model: unit_bytes must be a positive multiple of 4 (f32), got ", unit_bytes));
  }
  ModelDescription m;
  m.name = "overlap_bench";
  m.precision = {
      .param_dtype = DType::kF32, .reduce_dtype = DType::kF32, .master_dtype = DType::kF32};
  m.optimizer_state_bytes_per_param = 0;  // the benchmark has no optimizer
  for (int u = 0; u < units; ++u) {
    UnitDescription unit;
    unit.name = absl::StrCat("unit", u);
    unit.tensors = {{.name = "w", .shape = {static_cast<int64_t>(unit_bytes / 4)}}};
    m.units.push_back(std::move(unit));
    m.forward.push_back({.unit = u, .forward_flops = forward_ns, .backward_flops = backward_ns});
  }
  SL_RETURN_IF_ERROR(m.Validate());
  return m;
}

absl::StatusOr<std::vector<OverlapPrediction>> PredictOverlapBench(
    const Topology& topology, const OverlapBenchRun& run, const OverlapModelOptions& options) {
  if (topology.devices() < run.ranks) {
    return absl::InvalidArgumentError(absl::StrCat("topology '", topology.name, "' has ",
                                                   topology.devices(), " devices, the run ",
                                                   run.ranks, " ranks"));
  }
  auto topo = std::make_shared<Topology>(topology);
  topo->compute_flops_per_s = 1e9;  // 1 FLOP = 1 ns
  topo->device_memory_bytes = uint64_t{1} << 60;
  SL_ASSIGN_OR_RETURN(std::unique_ptr<SimCluster> cluster, CreateTopologyCluster(topo));
  std::vector<OverlapPrediction> out;
  for (const OverlapBenchConfig& c : run.configs) {
    // The kernels' measured time per unit: forward t, backward backward_factor t.
    const double per_unit_ms = c.compute_ms / run.units;
    double forward_ns = per_unit_ms / (1 + run.backward_factor) * 1e6;
    double backward_ns = forward_ns * run.backward_factor;
    if (options.zero_fill && c.backward_prefetch == BackwardPrefetch::kOff) {
      backward_ns += run.zero_fill_us * 1e3;  // PreBackward's fill on the compute stream
    }
    SL_ASSIGN_OR_RETURN(ModelDescription model,
                        OverlapBenchModel(run.units, run.unit_bytes,
                                          static_cast<uint64_t>(std::llround(forward_ns)),
                                          static_cast<uint64_t>(std::llround(backward_ns))));
    SimulationConfig config;
    config.world_size = run.ranks;
    config.ranks = RankMode::kAuto;
    config.strategy = ShardingStrategy::kFullShard;
    config.forward_prefetch = c.forward_prefetch;
    config.backward_prefetch = c.backward_prefetch;
    config.backward_prefetch_depth = c.backward_depth;
    config.budget_bytes = c.budget_bytes;
    config.root_unit = run.root_unit;
    // The benchmark's host only enqueues (its compute is a stream): it runs the step ahead.
    config.host_lead = HostLead::kWholeStep;
    if (options.trace != nullptr && c.name == options.trace_config) config.trace = options.trace;
    SL_ASSIGN_OR_RETURN(SimulationReport r, Simulate(model, config, *cluster));
    if (!r.step_time.has_value()) {
      return absl::InternalError(absl::StrCat("overlap model '", c.name, "': no step time"));
    }
    OverlapPrediction p;
    p.config = c.name;
    p.measured_step_ms = c.step_ms;
    p.predicted_step_ms = absl::ToDoubleMilliseconds(*r.step_time);
    p.error = (p.predicted_step_ms - p.measured_step_ms) / p.measured_step_ms;
    p.compute_ms = absl::ToDoubleMilliseconds(r.compute_time);
    p.predicted_exposed_ms =
        absl::ToDoubleMilliseconds(r.exposed_communication.value_or(absl::ZeroDuration()));
    p.predicted_communication_ms =
        absl::ToDoubleMilliseconds(r.communication_time.value_or(absl::ZeroDuration()));
    p.measured_gathers = c.gathers;
    p.measured_reductions = c.reductions;
    for (const auto& [key, tally] : r.collectives) {
      if (key.kind == CollectiveKind::kAllGather) p.predicted_gathers += tally.calls;
      if (key.kind == CollectiveKind::kReduceScatter) p.predicted_reductions += tally.calls;
    }
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace shardline
