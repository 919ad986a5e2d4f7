// File: bench/perf/flags.h
// -----------------------------------------------------------------------------
// The perf binaries' command line, as nccl-tests spells it (bench/perf/common.h lists the
// flags): parsing with messages that name the flag, the usage text, and nccl-tests' type names.

#ifndef SHARDLINE_BENCH_PERF_FLAGS_H_
#define SHARDLINE_BENCH_PERF_FLAGS_H_

#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/perf/common.h"
#include "runtime/dtype.h"

namespace shardline::perf {

// The parsed command line; the defaults are nccl-tests' (bench/perf/common.h lists the flags).
struct Options {
  size_t min_bytes = size_t{32} << 20;
  size_t max_bytes = size_t{32} << 20;
  size_t step_bytes = size_t{1} << 20;
  size_t step_factor = 1;
  int iters = 20;
  int warmup = 5;
  int check = 1;
  std::vector<DType> dtypes = {DType::kF32};
  std::vector<ReduceOp> ops = {ReduceOp::kSum};
  int root = 0;
  int average = 1;
  int threads = 1;
  int timeout_s = 0;
  std::string json_path;
  std::string backend = "ucx";
  std::string stream_kind = "host";
};

struct ParseResult {
  Options options;
  bool help = false;  // -h/--help: print the usage, run nothing
};

// Parses argv[1..argc); InvalidArgument naming the flag on a bad one. `spec` decides which
// datatypes are accepted (a reducing collective takes no int8/uint8) and what -d all means.
absl::StatusOr<ParseResult> ParseFlags(const CollectiveSpec& spec, int argc, char** argv);

// nccl-tests' usage text, for `binary`.
void PrintUsage(const char* binary, FILE* out);

// nccl-tests' name of `dtype` ("float", "half", "bfloat16", ...), as the type column prints it.
const char* NcclTypeName(DType dtype);

}  // namespace shardline::perf

#endif  // SHARDLINE_BENCH_PERF_FLAGS_H_
