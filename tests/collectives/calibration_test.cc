// Calibration (collectives/sim/calibration.h): both JSON forms parse, a fit of synthetic data
// generated from known parameters recovers them (exactly without noise, closely with it), the
// calibrated topology carries them, and bad input is named.

#include "collectives/sim/calibration.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"

namespace shardline {
namespace {

using ::testing::HasSubstr;

// The truth: 7 us per step, 12 GB/s, a curve from 0.2 at 1 KiB to 1 at 256 KiB.
LinkModel Truth() {
  LinkModel link;
  link.latency_s = 7e-6;
  link.bandwidth_bytes_per_s = 12e9;
  link.efficiency = {{1024, 0.2}, {16384, 0.5}, {262144, 1.0}};
  return link;
}

// Time of one row from the ring model (calibration.h's table) on `link`.
double ModelTime(const LinkModel& link, CollectiveKind kind, int n, double size) {
  double s = n - 1, b = (n - 1) * size / n, m = size / n;
  if (kind == CollectiveKind::kAllReduce) {
    s = 2 * (n - 1);
    b = 2 * (n - 1) * size / n;
  } else if (kind == CollectiveKind::kBroadcast) {
    b = size;
    m = size;
  }
  return s * link.latency_s + b / (link.bandwidth_bytes_per_s * link.Efficiency(m));
}

// The sizes of every synthetic run: 8 B to 64 MiB by 4 (nccl-tests' -b 8 -e 64M -f 4).
std::vector<double> Sizes() {
  std::vector<double> sizes;
  for (double size = 8; size <= 64.0 * 1024 * 1024; size *= 4) sizes.push_back(size);
  return sizes;
}

// Our perf binaries' form (bench/perf/report.cc). `noise(i)`: the relative perturbation of row i.
template <typename Noise>
std::string OurJson(const LinkModel& link, CollectiveKind kind, int n, Noise noise) {
  std::string rows;
  int i = 0;
  for (const double size : Sizes()) {
    const double t = ModelTime(link, kind, n, size) * (1 + noise(i++));
    absl::StrAppendFormat(&rows,
                          "%s    {\"size\": %.0f, \"count\": 1, \"type\": \"float\", \"redop\": "
                          "\"sum\", \"root\": -1, \"out_of_place\": {\"time_us\": %.17g, "
                          "\"algbw\": 1.5, \"busbw\": 1.5, \"wrong\": 0}, \"in_place\": "
                          "{\"time_us\": %.17g, \"algbw\": 1, \"busbw\": 1, \"wrong\": 0}}",
                          rows.empty() ? "" : ",\n", size, t * 1e6, t * 1e6 * 1.5);
  }
  return absl::StrCat("{\n  \"test\": \"", CollectiveName(kind),
                      "_perf\", \"backend\": \"local\", ", "\"nranks\": ", n,
                      ",\n  \"results\": [\n", rows,
                      "\n  ],\n  \"out_of_bounds\": 0, \"avg_busbw\": 1.0\n}\n");
}

// nccl-tests' form (src/util.cu, JSON_FILE_VERSION 2): the program in "args", one device line
// per process, times in "time", root as a string, "nan" allowed elsewhere.
template <typename Noise>
std::string NcclTestsJson(const LinkModel& link, CollectiveKind kind, int processes,
                          int gpus_per_process, Noise noise) {
  const int n = processes * gpus_per_process;
  std::string devices, rows;
  for (int p = 0; p < processes; ++p) {
    absl::StrAppend(&devices, p == 0 ? "" : ",",
                    absl::StrFormat("{\"rank\":%d,\"group\":0,\"pid\":1,\"hostname\":\"h\","
                                    "\"device\":0,\"device_hex\":\"0000:04:00\","
                                    "\"device_info\":\"NVIDIA H100 80GB HBM3\"}",
                                    p * gpus_per_process));
  }
  int i = 0;
  const char* program = kind == CollectiveKind::kAllToAll ? "alltoall" : nullptr;
  for (const double size : Sizes()) {
    const double t = ModelTime(link, kind, n, size) * (1 + noise(i++));
    absl::StrAppendFormat(&rows,
                          "%s{\"size\":%.0f,\"count\":2,\"type\":\"float\",\"redop\":\"sum\","
                          "\"root\":\"    -1\",\"out_of_place\":{\"time\":%.17g,\"alg_bw\":1,"
                          "\"bus_bw\":1,\"nwrong\":0},\"in_place\":{\"time\":%.17g,\"alg_bw\":1,"
                          "\"bus_bw\":\"nan\",\"nwrong\":0},\"actual_iterations\":20,"
                          "\"experiment_name\":\"x\"}",
                          rows.empty() ? "" : ",", size, t * 1e6 * 1.2, t * 1e6);
  }
  return absl::StrCat(
      "{\"version\":2,\"start_time\":\"2025-01-01 00:00:00\",\"args\":[\"./build/",
      program != nullptr ? program : std::string(CollectiveName(kind)),
      "_perf\",\"-b\",\"8\"],\"env\":[],\"nccl_version\":22703,\"config\":{\"nthreads\":1,"
      "\"ngpus\":",
      gpus_per_process,
      ",\"minimum_bytes\":8,\"maximum_bytes\":67108864,\"step_factor\":4,\"devices\":[", devices,
      "]},\"results\":[", rows,
      "],\"out_of_bounds\":{\"count\":0,\"okay\":\"true\"},\"average_bus_bandwidth\":"
      "{\"bandwidth\":1,\"okay\":\"unchecked\"},\"errors\":[],\"end_time\":\"x\"}");
}

std::vector<PerfRun> Runs(const LinkModel& link, double noise_amplitude) {
  auto noise = [noise_amplitude](int i) { return noise_amplitude * std::sin(1.7 * i + 0.3); };
  std::vector<PerfRun> runs;
  absl::StatusOr<PerfRun> ag =
      ParsePerfJson(OurJson(link, CollectiveKind::kAllGather, 4, noise), {.source = "ag"});
  EXPECT_TRUE(ag.ok()) << ag.status();
  absl::StatusOr<PerfRun> rs =
      ParsePerfJson(OurJson(link, CollectiveKind::kReduceScatter, 3, noise), {.source = "rs"});
  EXPECT_TRUE(rs.ok()) << rs.status();
  absl::StatusOr<PerfRun> ar =
      ParsePerfJson(NcclTestsJson(link, CollectiveKind::kAllReduce, 2, 4, noise), {.source = "ar"});
  EXPECT_TRUE(ar.ok()) << ar.status();
  if (ag.ok()) runs.push_back(*ag);
  if (rs.ok()) runs.push_back(*rs);
  if (ar.ok()) runs.push_back(*ar);
  return runs;
}

TEST(CalibrationTest, ParsesBothForms) {
  auto none = [](int) { return 0.0; };
  const LinkModel link = Truth();
  absl::StatusOr<PerfRun> ours =
      ParsePerfJson(OurJson(link, CollectiveKind::kAllGather, 4, none), {});
  ASSERT_TRUE(ours.ok()) << ours.status();
  EXPECT_EQ(ours->kind, CollectiveKind::kAllGather);
  EXPECT_EQ(ours->nranks, 4);
  ASSERT_EQ(ours->rows.size(), Sizes().size());
  EXPECT_EQ(ours->rows[3].size_bytes, 512);
  EXPECT_NEAR(ours->rows[3].out_of_place_s, ModelTime(link, CollectiveKind::kAllGather, 4, 512),
              1e-15);
  EXPECT_NEAR(ours->rows[3].in_place_s, 1.5 * ModelTime(link, CollectiveKind::kAllGather, 4, 512),
              1e-15);

  absl::StatusOr<PerfRun> nccl =
      ParsePerfJson(NcclTestsJson(link, CollectiveKind::kAllToAll, 2, 8, none), {});
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  EXPECT_EQ(nccl->kind, CollectiveKind::kAllToAll);
  EXPECT_EQ(nccl->nranks, 16);  // 2 processes x 8 GPUs
  EXPECT_NEAR(nccl->rows[2].in_place_s, ModelTime(link, CollectiveKind::kAllToAll, 16, 128), 1e-15);
  // Overrides.
  nccl = ParsePerfJson(NcclTestsJson(link, CollectiveKind::kAllToAll, 2, 8, none),
                       {.nranks = 5, .collective = "broadcast"});
  ASSERT_TRUE(nccl.ok());
  EXPECT_EQ(nccl->kind, CollectiveKind::kBroadcast);
  EXPECT_EQ(nccl->nranks, 5);
}

TEST(CalibrationTest, BadInputIsNamed) {
  auto err = [](absl::string_view json, PerfParseOptions o = {.source = "f.json"}) {
    absl::StatusOr<PerfRun> r = ParsePerfJson(json, o);
    EXPECT_FALSE(r.ok());
    return std::string(r.status().message());
  };
  EXPECT_THAT(err("[1]"), HasSubstr("f.json: the top level must be an object"));
  EXPECT_THAT(err("{"), HasSubstr("f.json: JSON line 1 column 2"));
  EXPECT_THAT(err(R"({"nranks": 2, "results": []})"), HasSubstr("names the collective"));
  EXPECT_THAT(err(R"({"test": "sendrecv_perf", "nranks": 2, "results": []})"),
              HasSubstr("'sendrecv_perf' is not a collective the calibration knows"));
  EXPECT_THAT(err(R"({"test": "all_reduce_perf", "results": []})"),
              HasSubstr("the rank count must be at least 2 (found 0)"));
  EXPECT_THAT(err(R"({"test": "all_reduce_perf", "nranks": 2})"),
              HasSubstr("\"results\" must be an array"));
  EXPECT_THAT(err(R"({"test": "all_reduce_perf", "nranks": 2, "results": [{"size": "8"}]})"),
              HasSubstr("results[0].size must be a number >= 0"));
  EXPECT_THAT(err(R"({"test": "all_reduce_perf", "nranks": 2,
                      "results": [{"size": 8, "out_of_place": {"busbw": 1}}]})"),
              HasSubstr("results[0].out_of_place has no time_us / time / cpu_time"));
  EXPECT_THAT(err(R"({"test": "all_reduce_perf", "nranks": 2,
                      "results": [{"size": 8, "in_place": {"time_us": "1"}}]})"),
              HasSubstr("results[0].in_place.time_us must be a number"));
  EXPECT_THAT(LoadPerfJson("/nonexistent.json", {}).status().message(), HasSubstr("cannot open"));
  // Too little data to fit.
  PerfRun run;
  run.kind = CollectiveKind::kAllReduce;
  run.nranks = 2;
  run.rows = {{1024, 1e-5, -1}, {2048, -1, -1}};
  EXPECT_THAT(FitLink({run}).status().message(), HasSubstr("at least 2 samples"));
  // Times that do not grow with the size.
  run.rows = {{1024, 1e-5, -1}, {2048, 1e-5, -1}, {4096, 0.9e-5, -1}, {8192, 0.8e-5, -1}};
  EXPECT_THAT(FitLink({run}).status().message(),
              HasSubstr("no sample spends at least 0.5 of its time beyond the latency"));
}

TEST(CalibrationTest, RecoversKnownParameters) {
  const LinkModel truth = Truth();
  const std::vector<PerfRun> runs = Runs(truth, 0);
  ASSERT_EQ(runs.size(), 3u);
  absl::StatusOr<CalibrationResult> fit = FitLink(runs);  // min of out/in place: the truth
  ASSERT_TRUE(fit.ok()) << fit.status();
  // The latency's tiny error (below) moves the peak bandwidth by less than 1e-4.
  EXPECT_NEAR(fit->link.bandwidth_bytes_per_s, truth.bandwidth_bytes_per_s, 1e-4 * 12e9);
  // The smallest messages (8 bytes) still cost a few bytes' transfer at eff 0.2: 1e-4 relative.
  EXPECT_NEAR(fit->link.latency_s, truth.latency_s, 1e-3 * truth.latency_s);
  int peaks = 0;
  for (const CalibrationSample& x : fit->samples) {
    // The peak bandwidth comes from a sample at full efficiency.
    if (x.peak) {
      ++peaks;
      EXPECT_EQ(truth.Efficiency(x.message_bytes), 1.0) << x.source << " " << x.size_bytes;
    }
    // The fitted curve at every sample's size is the truth's, where the transfer is a visible
    // part of the time (below that the efficiency hardly matters and cannot be told apart from
    // the latency).
    const double transfer =
        x.bus_bytes / (truth.bandwidth_bytes_per_s * truth.Efficiency(x.message_bytes));
    if (transfer > 0.1 * x.measured_s) {
      EXPECT_NEAR(fit->link.Efficiency(x.message_bytes), truth.Efficiency(x.message_bytes), 2e-3)
          << x.source << " m=" << x.message_bytes;
    }
    // And the model with the curve reproduces every time.
    EXPECT_NEAR(x.curve_s, x.measured_s, 2e-3 * x.measured_s);
  }
  EXPECT_EQ(peaks, 1);
  EXPECT_LT(fit->max_curve_error, 2e-3);
  EXPECT_GT(fit->max_plain_error, 0.1);  // without the curve, mid sizes are off
  const std::string table = FormatCalibration(*fit);
  EXPECT_THAT(table, HasSubstr("peak bus bandwidth 12 GB/s"));
  EXPECT_THAT(table, HasSubstr("(peak bandwidth)"));

  // Into a topology, on either level.
  Topology base;
  base.name = "fit";
  base.devices_per_node = 8;
  base.nodes = 2;
  base.nics_per_node = 4;
  base.device_memory_bytes = 1 << 30;
  base.compute_flops_per_s = 1e12;
  base.intra_node = {.bandwidth_bytes_per_s = 100e9, .latency_s = 1e-6};
  base.inter_node = {.bandwidth_bytes_per_s = 1e9, .latency_s = 1e-6};
  base.collectives = DefaultCollectiveAlgorithms();
  absl::StatusOr<Topology> intra = ApplyCalibration(base, *fit, LinkLevel::kIntraNode);
  ASSERT_TRUE(intra.ok()) << intra.status();
  EXPECT_EQ(intra->intra_node, fit->link);
  EXPECT_EQ(intra->inter_node, base.inter_node);
  // Inter-node, the runs had 4 ranks per node: rail = B / 4, NIC = rail * 8 / 4 = B / 2.
  absl::StatusOr<Topology> inter = ApplyCalibration(base, *fit, LinkLevel::kInterNode, 4);
  ASSERT_TRUE(inter.ok()) << inter.status();
  EXPECT_DOUBLE_EQ(inter->inter_node.bandwidth_bytes_per_s, fit->link.bandwidth_bytes_per_s / 2);
  EXPECT_EQ(inter->inter_node.latency_s, fit->link.latency_s);
  EXPECT_EQ(inter->inter_node.efficiency, fit->link.efficiency);
  // And the topology's ring on 2 nodes x 4 ranks then reproduces the all-reduce samples (the
  // network is the bottleneck at the calibrated bandwidth; inside the node 100 GB/s is not).
  inter->intra_node.bandwidth_bytes_per_s = 1e15;
  for (const CalibrationSample& x : fit->samples) {
    if (x.source != "ar" || x.size_bytes < 1e6) continue;
    absl::StatusOr<CollectiveCost> c =
        EstimateCollectiveWith(*inter, CollectiveAlgorithm::kRing, CollectiveKind::kAllReduce,
                               static_cast<size_t>(x.size_bytes / 4), DType::kF32, {8, 2, 4});
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_NEAR(c->seconds(), x.measured_s, 1e-3 * x.measured_s) << x.size_bytes;
  }
  EXPECT_THAT(ApplyCalibration(base, *fit, LinkLevel::kInterNode, 9).status().message(),
              HasSubstr("ranks per node must be in 1..8"));
}

TEST(CalibrationTest, EvaluateLinkPredictsOtherRuns) {
  // A link evaluated on runs it was not fitted to: the ring model's times, by hand for one row.
  const LinkModel truth = Truth();
  PerfRun run{.source = "bc", .kind = CollectiveKind::kBroadcast, .nranks = 5};
  run.rows = {{4096, 1e-4, -1}, {1 << 20, 1e-3, 2e-3}};
  const std::vector<CalibrationSample> x = EvaluateLink(truth, {run});
  ASSERT_EQ(x.size(), 2u);
  // broadcast of 4096 B on 5 ranks: 4 steps, bus 4096, m 4096: eff(4096) = 0.2 + 0.3 * 2/4.
  EXPECT_DOUBLE_EQ(x[0].plain_s, 4 * 7e-6 + 4096 / 12e9);
  EXPECT_DOUBLE_EQ(x[0].curve_s, 4 * 7e-6 + 4096 / (12e9 * 0.35));
  EXPECT_EQ(x[1].measured_s, 1e-3);  // the smaller of the two cells
  EXPECT_DOUBLE_EQ(x[1].curve_s, 4 * 7e-6 + (1 << 20) / 12e9);
  EXPECT_THAT(FormatSamples(x), HasSubstr("broadcast"));
}

TEST(CalibrationTest, MinOverRepeats) {
  PerfRun a{.source = "a", .kind = CollectiveKind::kAllGather, .nranks = 2};
  a.rows = {{1024, 3e-6, 5e-6}, {4096, 9e-6, -1}};
  PerfRun b = a;
  b.source = "b";
  b.rows = {{4096, 7e-6, 8e-6}, {1024, 4e-6, 2e-6}, {16384, 1e-5, -1}};
  PerfRun other = a;  // another rank count: not a repeat
  other.source = "c";
  other.nranks = 3;
  const std::vector<PerfRun> merged = MinOverRepeats({a, other, b});
  ASSERT_EQ(merged.size(), 2u);
  EXPECT_EQ(merged[0].source, "a +1 repeats");
  EXPECT_EQ(merged[1].source, "c");
  ASSERT_EQ(merged[0].rows.size(), 3u);
  auto row = [](const PerfRun::Row& r) {
    return std::vector<double>{r.size_bytes, r.out_of_place_s, r.in_place_s};
  };
  EXPECT_EQ(row(merged[0].rows[0]), (std::vector<double>{1024, 3e-6, 2e-6}));
  EXPECT_EQ(row(merged[0].rows[1]), (std::vector<double>{4096, 7e-6, 8e-6}));
  EXPECT_EQ(row(merged[0].rows[2]), (std::vector<double>{16384, 1e-5, -1}));
  EXPECT_EQ(merged[1].rows.size(), 2u);
}

TEST(CalibrationTest, RecoversParametersFromNoisyData) {
  const LinkModel truth = Truth();
  absl::StatusOr<CalibrationResult> fit = FitLink(Runs(truth, 0.02));
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_NEAR(fit->link.bandwidth_bytes_per_s, truth.bandwidth_bytes_per_s, 0.03 * 12e9);
  EXPECT_NEAR(fit->link.latency_s, truth.latency_s, 0.03 * truth.latency_s);
  for (const CalibrationSample& x : fit->samples) {
    const double transfer =
        x.bus_bytes / (truth.bandwidth_bytes_per_s * truth.Efficiency(x.message_bytes));
    if (transfer > 0.3 * x.measured_s) {
      EXPECT_NEAR(fit->link.Efficiency(x.message_bytes), truth.Efficiency(x.message_bytes), 0.1)
          << x.source << " m=" << x.message_bytes;
    }
  }
  // The curve absorbs what it can; the per-size error stays within the noise plus the mean over
  // runs at one size.
  EXPECT_LT(fit->max_curve_error, 0.06);
}

}  // namespace
}  // namespace shardline
