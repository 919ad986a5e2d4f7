// File: bench/perf/runner.h
// -----------------------------------------------------------------------------
// One rank of a perf binary, as nccl-tests' common.cu runs it: warm up at the largest and the
// smallest size, then for every size time the out-of-place and the in-place call (data
// initialised, one synchronising call, a barrier, `iters` calls issued back to back, a wait
// for the last) and check `check` further calls against the reference (bench/perf/values.h).
// Rank 0 prints the report (bench/perf/report.h).

#ifndef SHARDLINE_BENCH_PERF_RUNNER_H_
#define SHARDLINE_BENCH_PERF_RUNNER_H_

#include "bench/perf/common.h"
#include "bench/perf/flags.h"
#include "collectives/communicator.h"

namespace shardline::perf {

// Runs the whole sweep of `spec` on `comm` (one of `processes` processes). Returns the exit code:
// 0, or 1 on wrong results or a failed collective (the error is printed with the rank, and the
// communicator is aborted so that the peers fail too).
int RunRank(const CollectiveSpec& spec, const Options& options, Communicator& comm, int processes);

}  // namespace shardline::perf

#endif  // SHARDLINE_BENCH_PERF_RUNNER_H_
