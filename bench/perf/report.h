// File: bench/perf/report.h
// -----------------------------------------------------------------------------
// What the perf binaries print (rank 0), in nccl-tests' format: the run header with one
// "#  Rank" line per rank, the column header, one row per size with an out-of-place and an
// in-place cell, the footer; and the same rows as a JSON file (-J). bench/perf/common.h shows
// the format; tests/scripts/perf_format_test.py parses it as people parse nccl-tests output.

#ifndef SHARDLINE_BENCH_PERF_REPORT_H_
#define SHARDLINE_BENCH_PERF_REPORT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "bench/perf/flags.h"
#include "runtime/device.h"
#include "runtime/dtype.h"

namespace shardline::perf {

// One of a row's two timings.
struct Cell {
  bool present = false;
  double time_us = 0;
  double algbw = 0;
  double busbw = 0;
  int64_t wrong = -1;  // -1: not checked
};

// One printed row: one size of one datatype and op.
struct Row {
  size_t bytes = 0;
  size_t count = 0;
  DType dtype = DType::kF32;
  std::string redop;
  int root = -1;
  Cell out_of_place;
  Cell in_place;
};

// What the header and the JSON file say about the run.
struct RunInfo {
  const char* binary;  // "all_gather_perf"
  std::string backend;
  int nranks;
  int processes;
  const Options& options;
};

// This rank's "#  Rank" line (nccl-tests' "Using devices" list): pid, host, device, backend and
// the CPU model on a host device.
std::string RankLine(int rank, Device device, absl::string_view backend);

// From "# Collective test starting" to the "#  Rank" lines (one per rank, in rank order).
void PrintRunHeader(const RunInfo& run, const std::vector<std::string>& rank_lines);
// The three lines of column names.
void PrintColumnHeader();
// A row's first five columns (size count type redop root), then each cell's four.
std::string RowPrefix(const Row& row);
std::string CellText(const Cell& cell);
// "# Out of bounds values", "# Avg bus bandwidth" and "# Collective test concluded".
void PrintFooter(const RunInfo& run, int64_t errors, double avg_busbw);

// Writes the run and its rows as JSON to run.options.json_path; Unavailable if it cannot.
absl::Status WriteJson(const RunInfo& run, const std::vector<Row>& rows, int64_t errors,
                       double avg_busbw);

}  // namespace shardline::perf

#endif  // SHARDLINE_BENCH_PERF_REPORT_H_
