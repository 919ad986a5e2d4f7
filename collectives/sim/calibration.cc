// Fitting a link level to collective benchmark results (collectives/sim/calibration.h).

#include "collectives/sim/calibration.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "runtime/json.h"
#include "runtime/status.h"

namespace shardline {
namespace {

absl::Status Bad(const PerfParseOptions& o, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(o.source, ": ", what));
}

// "all_reduce_perf", ".../all_reduce_perf", "all_reduce", "alltoall" -> the kind.
absl::StatusOr<CollectiveKind> KindFromName(absl::string_view name) {
  absl::string_view base = name.substr(name.find_last_of('/') + 1);
  absl::ConsumeSuffix(&base, "_perf");
  if (base == "alltoall") return CollectiveKind::kAllToAll;
  for (const CollectiveKind kind :
       {CollectiveKind::kAllGather, CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce,
        CollectiveKind::kBroadcast, CollectiveKind::kAllToAll}) {
    if (CollectiveName(kind) == base) return kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("'", name,
                   "' is not a collective the calibration knows (all_gather, reduce_scatter, "
                   "all_reduce, broadcast, all_to_all / alltoall, optionally with _perf)"));
}

// A cell's time in seconds: ours {"time_us": t}, nccl-tests {"time": t} or {"cpu_time": t} (us).
absl::StatusOr<double> CellTime(const PerfParseOptions& o, const JsonValue* cell,
                                const std::string& path) {
  if (cell == nullptr || cell->kind() == JsonValue::Kind::kNull) return -1.0;
  if (cell->kind() != JsonValue::Kind::kObject) {
    return Bad(o, absl::StrCat(path, " must be an object or null"));
  }
  for (const char* key : {"time_us", "time", "cpu_time"}) {
    const JsonValue* t = cell->Find(key);
    if (t == nullptr) continue;
    if (!t->is_number()) return Bad(o, absl::StrCat(path, ".", key, " must be a number"));
    return t->number() * 1e-6;
  }
  return Bad(o, absl::StrCat(path, " has no time_us / time / cpu_time"));
}

int64_t IntOr(const JsonValue* v, int64_t fallback) {
  return v != nullptr && v->kind() == JsonValue::Kind::kInteger ? v->integer() : fallback;
}

struct Model {
  double steps, bus, message;
};

Model RingModel(CollectiveKind kind, int nranks, double size) {
  const double n = nranks;
  switch (kind) {
    case CollectiveKind::kAllReduce:
      return {2 * (n - 1), 2 * (n - 1) * size / n, size / n};
    case CollectiveKind::kBroadcast:
      return {n - 1, size, size};
    default:
      return {n - 1, (n - 1) * size / n, size / n};
  }
}

}  // namespace

absl::StatusOr<PerfRun> ParsePerfJson(absl::string_view json, const PerfParseOptions& o) {
  absl::StatusOr<JsonValue> parsed = ParseJson(json);
  if (!parsed.ok()) return Bad(o, parsed.status().message());
  const JsonValue& root = *parsed;
  if (root.kind() != JsonValue::Kind::kObject) return Bad(o, "the top level must be an object");
  PerfRun run;
  run.source = o.source;

  // The collective.
  std::string name = o.collective;
  if (name.empty()) {
    if (const JsonValue* test = root.Find("test");
        test != nullptr && test->kind() == JsonValue::Kind::kString) {
      name = test->string();
    } else if (const JsonValue* args = root.Find("args");
               args != nullptr && args->kind() == JsonValue::Kind::kArray &&
               !args->items().empty() && args->items()[0].kind() == JsonValue::Kind::kString) {
      name = args->items()[0].string();
    } else {
      return Bad(o,
                 "no \"test\" (perf binaries) or \"args\" (nccl-tests) names the collective; "
                 "give it explicitly");
    }
  }
  absl::StatusOr<CollectiveKind> kind = KindFromName(name);
  if (!kind.ok()) return Bad(o, kind.status().message());
  run.kind = *kind;

  // The rank count.
  run.nranks = o.nranks;
  if (run.nranks == 0) {
    if (const JsonValue* n = root.Find("nranks"); n != nullptr) {
      run.nranks = static_cast<int>(IntOr(n, 0));
    } else if (const JsonValue* config = root.Find("config");
               config != nullptr && config->kind() == JsonValue::Kind::kObject) {
      // nccl-tests lists one device line per process (the first of its threads x GPUs).
      const JsonValue* devices = config->Find("devices");
      if (devices != nullptr && devices->kind() == JsonValue::Kind::kArray) {
        run.nranks = static_cast<int>(devices->items().size() * IntOr(config->Find("nthreads"), 1) *
                                      IntOr(config->Find("ngpus"), 1));
      }
    }
  }
  if (run.nranks < 2) {
    return Bad(o, absl::StrCat("the rank count must be at least 2 (found ", run.nranks,
                               "); give it explicitly if the file does not say"));
  }

  const JsonValue* results = root.Find("results");
  if (results == nullptr || results->kind() != JsonValue::Kind::kArray) {
    return Bad(o, "\"results\" must be an array");
  }
  for (size_t i = 0; i < results->items().size(); ++i) {
    const JsonValue& row = results->items()[i];
    const std::string path = absl::StrCat("results[", i, "]");
    if (row.kind() != JsonValue::Kind::kObject)
      return Bad(o, absl::StrCat(path, " must be an object"));
    const JsonValue* size = row.Find("size");
    if (size == nullptr || !size->is_number() || size->number() < 0) {
      return Bad(o, absl::StrCat(path, ".size must be a number >= 0"));
    }
    PerfRun::Row r;
    r.size_bytes = size->number();
    SL_ASSIGN_OR_RETURN(r.out_of_place_s,
                        CellTime(o, row.Find("out_of_place"), path + ".out_of_place"));
    SL_ASSIGN_OR_RETURN(r.in_place_s, CellTime(o, row.Find("in_place"), path + ".in_place"));
    run.rows.push_back(r);
  }
  return run;
}

absl::StatusOr<PerfRun> LoadPerfJson(const std::string& path, PerfParseOptions options) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open perf JSON '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  options.source = path;
  return ParsePerfJson(text.str(), options);
}

namespace {

enum class Merge : uint8_t { kMin, kMedian };

double MedianOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::vector<PerfRun> MergeRepeats(const std::vector<PerfRun>& runs, Merge merge) {
  std::vector<PerfRun> out;
  std::vector<int> repeats;
  // Per merged run and size: every repeat's out-of-place and in-place times (< 0: absent).
  std::vector<std::map<double, std::pair<std::vector<double>, std::vector<double>>>> cells;
  for (const PerfRun& run : runs) {
    size_t i = 0;
    while (i < out.size() && !(out[i].kind == run.kind && out[i].nranks == run.nranks)) ++i;
    if (i == out.size()) {
      out.push_back(run);
      out.back().rows.clear();
      repeats.push_back(0);
      cells.emplace_back();
    }
    ++repeats[i];
    for (const PerfRun::Row& row : run.rows) {
      auto it = std::find_if(out[i].rows.begin(), out[i].rows.end(),
                             [&](const PerfRun::Row& r) { return r.size_bytes == row.size_bytes; });
      if (it == out[i].rows.end()) out[i].rows.push_back(row);
      auto& [outs, ins] = cells[i][row.size_bytes];
      if (row.out_of_place_s >= 0) outs.push_back(row.out_of_place_s);
      if (row.in_place_s >= 0) ins.push_back(row.in_place_s);
    }
  }
  auto pick = [merge](const std::vector<double>& v) {
    if (v.empty()) return -1.0;
    return merge == Merge::kMin ? *std::min_element(v.begin(), v.end()) : MedianOf(v);
  };
  for (size_t i = 0; i < out.size(); ++i) {
    for (PerfRun::Row& row : out[i].rows) {
      const auto& [outs, ins] = cells[i][row.size_bytes];
      row.out_of_place_s = pick(outs);
      row.in_place_s = pick(ins);
    }
    std::sort(
        out[i].rows.begin(), out[i].rows.end(),
        [](const PerfRun::Row& a, const PerfRun::Row& b) { return a.size_bytes < b.size_bytes; });
    if (repeats[i] > 1) {
      absl::StrAppend(&out[i].source, " +", repeats[i] - 1, " repeats",
                      merge == Merge::kMedian ? " (median)" : "");
    }
  }
  return out;
}

}  // namespace

std::vector<PerfRun> MinOverRepeats(const std::vector<PerfRun>& runs) {
  return MergeRepeats(runs, Merge::kMin);
}

std::vector<PerfRun> MedianOverRepeats(const std::vector<PerfRun>& runs) {
  return MergeRepeats(runs, Merge::kMedian);
}

namespace {

std::vector<CalibrationSample> MakeSamples(const std::vector<PerfRun>& runs,
                                           const CalibrationOptions& options) {
  std::vector<CalibrationSample> samples;
  for (const PerfRun& run : runs) {
    for (const PerfRun::Row& row : run.rows) {
      double t = -1;
      switch (options.cell) {
        case CalibrationOptions::Cell::kOutOfPlace:
          t = row.out_of_place_s;
          break;
        case CalibrationOptions::Cell::kInPlace:
          t = row.in_place_s;
          break;
        case CalibrationOptions::Cell::kMin:
          t = row.out_of_place_s > 0 && row.in_place_s > 0
                  ? std::min(row.out_of_place_s, row.in_place_s)
                  : std::max(row.out_of_place_s, row.in_place_s);
          break;
      }
      if (!(t > 0) || row.size_bytes <= 0 || run.nranks < 2) continue;
      const Model m = RingModel(run.kind, run.nranks, row.size_bytes);
      CalibrationSample x;
      x.source = run.source;
      x.kind = run.kind;
      x.nranks = run.nranks;
      x.size_bytes = row.size_bytes;
      x.steps = m.steps;
      x.bus_bytes = m.bus;
      x.message_bytes = m.message;
      x.measured_s = t;
      samples.push_back(x);
    }
  }
  return samples;
}

// Fills the predictions; returns the largest relative errors (plain, curve).
std::pair<double, double> Predict(const LinkModel& link, std::vector<CalibrationSample>& samples) {
  double plain = 0, curve = 0;
  for (CalibrationSample& x : samples) {
    x.plain_s = x.steps * link.latency_s + x.bus_bytes / link.bandwidth_bytes_per_s;
    x.curve_s = x.steps * link.latency_s +
                x.bus_bytes / (link.bandwidth_bytes_per_s * link.Efficiency(x.message_bytes));
    plain = std::max(plain, std::fabs(x.plain_s - x.measured_s) / x.measured_s);
    curve = std::max(curve, std::fabs(x.curve_s - x.measured_s) / x.measured_s);
  }
  return {plain, curve};
}

}  // namespace

std::vector<CalibrationSample> EvaluateLink(const LinkModel& link, const std::vector<PerfRun>& runs,
                                            const CalibrationOptions& options) {
  std::vector<CalibrationSample> samples = MakeSamples(runs, options);
  Predict(link, samples);
  return samples;
}

absl::StatusOr<CalibrationResult> FitLink(const std::vector<PerfRun>& runs,
                                          const CalibrationOptions& options) {
  CalibrationResult result;
  result.samples = MakeSamples(runs, options);
  std::vector<CalibrationSample>& samples = result.samples;
  if (samples.size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "calibration needs at least 2 samples with a positive size and time on >= 2 ranks, got ",
        samples.size()));
  }
  // Each run's sample with the smallest message: its time is (almost) all latency.
  std::vector<size_t> smallest;
  {
    std::map<std::string, size_t> by_run;
    for (size_t i = 0; i < samples.size(); ++i) {
      auto [it, inserted] = by_run.emplace(samples[i].source, i);
      if (!inserted && samples[i].message_bytes < samples[it->second].message_bytes) {
        it->second = i;
      }
    }
    for (const auto& [source, i] : by_run) smallest.push_back(i);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t mid = v.size() / 2;
    return v.size() % 2 == 1 ? v[mid] : (v[mid - 1] + v[mid]) / 2;
  };
  // alpha and B depend on each other only through the small transfer at the smallest messages:
  // a few rounds settle them (the same number every time: deterministic).
  double alpha = 0, bandwidth = 0;
  size_t peak = samples.size();
  for (int round = 0; round < 4; ++round) {
    std::vector<double> latencies;
    for (const size_t i : smallest) {
      const CalibrationSample& x = samples[i];
      const double transfer = bandwidth > 0 ? x.bus_bytes / bandwidth : 0;
      latencies.push_back(std::max(0.0, (x.measured_s - transfer) / x.steps));
    }
    alpha = median(latencies);
    bandwidth = 0;
    peak = samples.size();
    for (size_t i = 0; i < samples.size(); ++i) {
      const CalibrationSample& x = samples[i];
      const double transfer = x.measured_s - x.steps * alpha;
      // Where the latency is most of the time, the difference is noise, not a bandwidth.
      if (x.bus_bytes <= 0 || transfer < options.min_transfer_share * x.measured_s) continue;
      if (x.bus_bytes / transfer > bandwidth) {
        bandwidth = x.bus_bytes / transfer;
        peak = i;
      }
    }
    if (!(bandwidth > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration: no sample spends at least ", options.min_transfer_share,
                       " of its time beyond the latency (", alpha * 1e6,
                       " us per step), so no bandwidth can be fitted; measure larger sizes"));
    }
  }
  samples[peak].peak = true;
  result.link.bandwidth_bytes_per_s = bandwidth;
  result.link.latency_s = alpha;

  // The efficiency of every message size: geometric mean over its samples.
  std::map<double, std::pair<double, int>> log_eff;  // m -> (sum of log eff, samples)
  for (const CalibrationSample& x : samples) {
    const double transfer = x.measured_s - x.steps * alpha;
    double eff = transfer > 0 ? x.bus_bytes / (bandwidth * transfer) : 1.0;
    eff = std::clamp(eff, 0.001, 1.0);
    auto& [sum, count] = log_eff[x.message_bytes];
    sum += std::log(eff);
    ++count;
  }
  for (const auto& [m, entry] : log_eff) {
    result.link.efficiency.push_back({m, std::exp(entry.first / entry.second)});
  }
  // A curve of ones is no curve.
  if (std::all_of(result.link.efficiency.begin(), result.link.efficiency.end(),
                  [](const EfficiencyPoint& p) { return p.efficiency == 1.0; })) {
    result.link.efficiency.clear();
  }

  std::tie(result.max_plain_error, result.max_curve_error) = Predict(result.link, samples);
  return result;
}

std::string FormatSamples(const std::vector<CalibrationSample>& samples) {
  std::string out =
      absl::StrFormat("# %-14s %4s %12s %12s %12s %8s %12s %8s %s\n", "collective", "n", "size(B)",
                      "measured(us)", "alpha-beta", "error", "with-curve", "error", "source");
  for (const CalibrationSample& x : samples) {
    absl::StrAppendFormat(&out, "  %-14s %4d %12.0f %12.2f %12.2f %+7.1f%% %12.2f %+7.1f%% %s%s\n",
                          CollectiveName(x.kind), x.nranks, x.size_bytes, x.measured_s * 1e6,
                          x.plain_s * 1e6, 100 * (x.plain_s - x.measured_s) / x.measured_s,
                          x.curve_s * 1e6, 100 * (x.curve_s - x.measured_s) / x.measured_s,
                          x.source, x.peak ? " (peak bandwidth)" : "");
  }
  return out;
}

std::string FormatCalibration(const CalibrationResult& r) {
  std::string out = FormatSamples(r.samples);
  absl::StrAppendFormat(&out,
                        "# latency %.3f us per step, peak bus bandwidth %.4g GB/s; max error: "
                        "alpha-beta %.1f%%, with the curve %.1f%%\n",
                        r.link.latency_s * 1e6, r.link.bandwidth_bytes_per_s / 1e9,
                        100 * r.max_plain_error, 100 * r.max_curve_error);
  absl::StrAppend(&out, "# efficiency curve:");
  if (r.link.efficiency.empty()) absl::StrAppend(&out, " none (1 at every size)");
  for (const EfficiencyPoint& p : r.link.efficiency) {
    absl::StrAppendFormat(&out, " %.0fB:%.3f", p.bytes, p.efficiency);
  }
  absl::StrAppend(&out, "\n");
  return out;
}

absl::StatusOr<Topology> ApplyCalibration(Topology base, const CalibrationResult& result,
                                          LinkLevel level, int ranks_per_node) {
  if (level == LinkLevel::kIntraNode) {
    base.intra_node = result.link;
  } else {
    if (ranks_per_node < 1 || ranks_per_node > base.devices_per_node) {
      return absl::InvalidArgumentError(absl::StrCat("calibration: ranks per node must be in 1..",
                                                     base.devices_per_node, ", got ",
                                                     ranks_per_node));
    }
    if (base.nics_per_node < 1) {
      return absl::InvalidArgumentError(
          "calibration of the inter-node level needs the base topology's nics_per_node");
    }
    base.inter_node = result.link;
    base.inter_node.bandwidth_bytes_per_s = result.link.bandwidth_bytes_per_s *
                                            base.devices_per_node /
                                            (ranks_per_node * base.nics_per_node);
  }
  SL_RETURN_IF_ERROR(ValidateTopology(base));
  return base;
}

}  // namespace shardline
