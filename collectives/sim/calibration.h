// File: collectives/sim/calibration.h
// -----------------------------------------------------------------------------
// Calibration of a topology's link level from collective benchmark results: the JSON that the
// perf binaries (bench/perf, `-J`) write, or nccl-tests' own `-J` JSON from a GPU cluster.
//
// Every result row of a run of collective C on n ranks becomes one sample of the ring model of
// collectives/sim/topology.h on one link level: s steps, bus bytes b and a per-step message of m
// bytes, from the row's size S (nccl-tests' definition: the total buffer; for all_gather and
// reduce_scatter the gathered / reduced size, for all_to_all the send buffer):
//   all_gather, reduce_scatter, all_to_all   s = n-1,    b = (n-1) S / n,   m = S / n
//   all_reduce                               s = 2(n-1), b = 2(n-1) S / n,  m = S / n
//   broadcast                                s = n-1,    b = S,             m = S
// and its time t (the row's out-of-place or in-place time, or the smaller: CalibrationOptions).
// The model is t = s * alpha + b / (B * eff(m)), B the peak bus bandwidth and eff <= 1. The fit:
//   1. alpha = the median over the runs of (t - b / B) / s at each run's smallest message, where
//      the bytes cost almost nothing (0 if negative);
//   2. B = the largest b / (t - s * alpha) over the samples whose transfer t - s * alpha is at
//      least `min_transfer_share` of their time (below that the difference is noise);
//      1 and 2 depend on each other only through the tiny transfers of the smallest messages:
//      four rounds, starting from B = infinity, settle them;
//   3. every m gets eff(m) = (b / B) / (t - s * alpha), clamped to [0.001, 1] (1 where the time
//      is no more than the latency), the geometric mean over the samples of one m; the curve is
//      those points (none if they are all 1).
// So the model with the curve reproduces every sample (up to the mean over samples of one m and
// the clamp); the curve is flat beyond the largest size measured. The printed table shows, per
// size, the error of the plain alpha-beta model and of the model with the curve. Runs given
// together (collectives, rank counts) must have run on the same link level; runs are told apart
// by their source.

#ifndef SHARDLINE_COLLECTIVES_SIM_CALIBRATION_H_
#define SHARDLINE_COLLECTIVES_SIM_CALIBRATION_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "collectives/communicator.h"
#include "collectives/sim/topology.h"

namespace shardline {

// One benchmark run: one collective on `nranks` ranks.
struct PerfRun {
  std::string source;  // file name or label, for messages
  CollectiveKind kind = CollectiveKind::kAllReduce;
  int nranks = 0;
  struct Row {
    double size_bytes = 0;
    double out_of_place_s = -1;  // < 0: absent
    double in_place_s = -1;      // < 0: absent
  };
  std::vector<Row> rows;
};

struct PerfParseOptions {
  std::string source = "perf JSON";
  // 0: from the file (ours: "nranks"; nccl-tests: config.devices x nthreads x ngpus).
  int nranks = 0;
  // Empty: from the file (ours: "test"; nccl-tests: the program name in "args"), e.g.
  // "all_reduce_perf" or "all_reduce".
  std::string collective;
};

// Reads either JSON form. InvalidArgument naming the source and the field when something is
// missing or malformed, or the collective or the rank count cannot be determined.
absl::StatusOr<PerfRun> ParsePerfJson(absl::string_view json, const PerfParseOptions& options);
// ParsePerfJson of a file (source = the path).
absl::StatusOr<PerfRun> LoadPerfJson(const std::string& path, PerfParseOptions options);

// Repeats merged: runs of the same collective on the same rank count become one run (the first
// one's source, "+N repeats" appended) whose time at each size is the smallest any repeat
// measured (out-of-place and in-place separately). On a shared machine, interference only adds
// time, so the minimum over repeats is the least disturbed estimate. Runs appear in the order
// of their first repeat; sizes in ascending order.
std::vector<PerfRun> MinOverRepeats(const std::vector<PerfRun>& runs);
// The same merge with the median over the repeats at each size (the mean of the middle two for
// an even count; a cell a repeat lacks does not count): the typical time under the machine's
// load, for predicting medians measured under the same load (scripts/validate-sim).
std::vector<PerfRun> MedianOverRepeats(const std::vector<PerfRun>& runs);

struct CalibrationOptions {
  enum class Cell { kMin, kOutOfPlace, kInPlace };
  Cell cell = Cell::kMin;
  // Of a sample's time, for it to count towards the peak bandwidth.
  double min_transfer_share = 0.5;
};

// One sample with the fitted models' predictions.
struct CalibrationSample {
  std::string source;
  CollectiveKind kind = CollectiveKind::kAllReduce;
  int nranks = 0;
  double size_bytes = 0;
  double steps = 0, bus_bytes = 0, message_bytes = 0;
  double measured_s = 0;
  double plain_s = 0;  // alpha-beta, eff = 1
  double curve_s = 0;  // with the fitted curve
  bool peak = false;   // the sample that set B
};

struct CalibrationResult {
  LinkModel link;                          // bandwidth: the bus bandwidth B of the ring model
  std::vector<CalibrationSample> samples;  // by run, then size
  double max_plain_error = 0;              // max |model - measured| / measured
  double max_curve_error = 0;
};

// Fits one link level's alpha, B and curve to the runs (together). InvalidArgument if there are
// fewer than 2 usable samples (a time > 0, n >= 2) or none spends min_transfer_share of its time
// beyond the latency.
absl::StatusOr<CalibrationResult> FitLink(const std::vector<PerfRun>& runs,
                                          const CalibrationOptions& options = {});

// The samples of `runs` (as FitLink makes them) with `link`'s predictions: to check a calibrated
// link against runs it was not fitted to.
std::vector<CalibrationSample> EvaluateLink(const LinkModel& link, const std::vector<PerfRun>& runs,
                                            const CalibrationOptions& options = {});

// The per-size table: collective, n, size, measured, alpha-beta model and its error, the model
// with the curve and its error, source.
std::string FormatSamples(const std::vector<CalibrationSample>& samples);
// FormatSamples of the fit, then the fitted parameters.
std::string FormatCalibration(const CalibrationResult& result);

// `base` with the fitted link on one level. Intra-node: intra_node = the link. Inter-node (the
// runs spanned nodes with `ranks_per_node` ranks on each, a ring): the network carries b / k
// per rank (topology.h), so the rail bandwidth is B / k and the NIC bandwidth
// B * devices_per_node / (k * nics_per_node); latency and curve as fitted. InvalidArgument if
// the result does not validate or ranks_per_node is out of range.
enum class LinkLevel { kIntraNode, kInterNode };
absl::StatusOr<Topology> ApplyCalibration(Topology base, const CalibrationResult& result,
                                          LinkLevel level, int ranks_per_node = 1);

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_SIM_CALIBRATION_H_
