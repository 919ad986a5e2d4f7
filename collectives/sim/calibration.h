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
// The model is t = s * alpha + b / (B * eff(m)). The fit:
//   1. B by least squares of t = s * a + b / B on the relative error, over the samples with the
//      largest m: starting with the `min_linear_samples` largest, extended to smaller m while
//      the fit so far predicts the next sample within `linear_tolerance`, every sample of the
//      set stays within it after the refit, and the added sample's
//      transfer b / B is at least `min_transfer_share` of its time (there eff = 1; where the
//      latency dominates, a curve would hide inside the tolerance). (A negative intercept a is
//      set to 0 and B refitted alone.)
//   2. alpha = the median over the runs of (t - b / B) / s at each run's smallest message,
//      where the bytes cost almost nothing (a, fixed by large messages, is too uncertain to be
//      the latency); 0 if negative.
//   3. Each m below the linear set gets eff(m) = (b / B) / (t - s * alpha), clamped to
//      [0.001, 1] (1 where the time is no more than the latency), the geometric mean over the
//      samples of one m; the curve is those points and (the smallest m of the linear set, 1).
// So the curve reproduces every sample below the linear set (up to the mean over samples of
// the same m); the printed table shows, per size, the error of the plain alpha-beta model and of
// the model with the curve. Where several runs (collectives, rank counts) are given, they are
// fitted together: they must have run on the same link level.

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

struct CalibrationOptions {
  enum class Cell { kMin, kOutOfPlace, kInPlace };
  Cell cell = Cell::kMin;
  double linear_tolerance = 0.05;   // relative
  double min_transfer_share = 0.5;  // of a sample's time, to join the linear set
  int min_linear_samples = 3;
};

// One sample with the fitted models' predictions.
struct CalibrationSample {
  std::string source;
  CollectiveKind kind = CollectiveKind::kAllReduce;
  int nranks = 0;
  double size_bytes = 0;
  double steps = 0, bus_bytes = 0, message_bytes = 0;
  double measured_s = 0;
  double plain_s = 0;   // alpha-beta, eff = 1
  double curve_s = 0;   // with the fitted curve
  bool linear = false;  // in the set that fixed alpha and B
};

struct CalibrationResult {
  LinkModel link;                          // bandwidth: the bus bandwidth B of the ring model
  std::vector<CalibrationSample> samples;  // by run, then size
  int linear_samples = 0;
  double max_plain_error = 0;  // max |model - measured| / measured
  double max_curve_error = 0;
};

// Fits one link level's alpha, B and curve to the runs (together). InvalidArgument if there are
// fewer usable samples (a time > 0, n >= 2) than min_linear_samples, or the data does not give a
// positive bandwidth.
absl::StatusOr<CalibrationResult> FitLink(const std::vector<PerfRun>& runs,
                                          const CalibrationOptions& options = {});

// The per-size table: source, collective, n, size, measured, alpha-beta model and its error,
// the model with the curve and its error; then the fitted parameters.
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
