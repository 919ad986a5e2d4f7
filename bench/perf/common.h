// File: bench/perf/common.h
// -----------------------------------------------------------------------------
// The shared driver of the collective performance tests (all_gather_perf, reduce_scatter_perf,
// all_reduce_perf, broadcast_perf, alltoall_perf). They speak nccl-tests' language: the same
// flags, the same output columns and footer, the same bandwidth definitions
// (nccl-tests doc/PERFORMANCE.md), so people who read nccl-tests output read ours.
//
//   shardline-launch -n 2 all_gather_perf -b 1M -e 64M -f 4 -c 1      # ucx, 2 processes
//   all_reduce_perf --backend local -t 4 -b 8 -e 128M -f 2             # 4 ranks as threads
//   mpirun -n 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 all_reduce_perf -b 8 -e 1G -f 2
//
// Flags (as nccl-tests; sizes take K/M/G suffixes, binary units):
//   -b/--minbytes, -e/--maxbytes   sweep bounds in bytes (default 32M .. 32M)
//   -f/--stepfactor, -i/--stepbytes  multiplicative or additive step (default -i 1M)
//   -n/--iters (20), -w/--warmup_iters (5), -c/--check (1: number of checked runs per size)
//   -d/--datatype float|half|bfloat16|double|int8|uint8|int32|int64|all (float)
//   -o/--op sum|avg|min|max|all (sum)   -r/--root (0)
//   -a/--average 0|1|2|3: the time reported is rank 0's, the average, the minimum or the
//      maximum over ranks (1)
//   -t/--nthreads N  ranks as threads of this process (--backend local only)
//   -g/--ngpus 1     one device per rank (the only value accepted)
//   -T/--timeout S   bound on every collective, seconds (default SHARDLINE_TIMEOUT_S)
//   -J/--output_file F  also write the results as JSON to F (rank 0)
//   --backend ucx|local|nccl (ucx)   --stream host|caller (host: collectives run on a stream's
//      worker thread, as the FSDP scheduler issues them; caller: on the calling thread)
//
// Output (rank 0): nccl-tests' header ("# nThread ... validation: 1 graph: 0", "# Using
// devices", one line per rank), one row per size with out-of-place and in-place columns
//   size count type redop root | time algbw busbw #wrong | time algbw busbw #wrong
// and the footer ("# Out of bounds values : 0 OK", "# Avg bus bandwidth    : x"). A form the
// Communicator API does not have (out-of-place broadcast, in-place all-to-all) prints N/A.
//
// Bandwidths, with S the printed size in bytes and t the time of one call:
//   algbw = S / t;   busbw = algbw * factor, factor = 2(n-1)/n for all-reduce, (n-1)/n for
//   all-gather, reduce-scatter and all-to-all (S being the total size), 1 for broadcast.
//
// Data: inputs are small integers hashed from (rank, index, seed) (exact in every dtype, so sums
// of a few ranks are exact; bench/perf/values.h); outputs start as a NaN/-1 sentinel; #wrong
// counts output elements that differ from a plain-loop reference (relative tolerance for
// averaged floats), summed over ranks. The process exits 1 if any element was wrong or a
// collective failed (the error is printed with its rank).
//
// Files: this header is what each <collective>_perf.cc fills in (a CollectiveSpec) and calls
// (PerfMain, in common.cc). flags.h parses the command line, runner.h runs one rank's sweep,
// report.h prints the table and writes the JSON, memory.h holds the buffers, values.h the data
// and its reference.

#ifndef SHARDLINE_BENCH_PERF_COMMON_H_
#define SHARDLINE_BENCH_PERF_COMMON_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "bench/perf/values.h"
#include "collectives/communicator.h"
#include "runtime/dtype.h"
#include "runtime/stream.h"

namespace shardline::perf {

// Element counts of one collective at one size, as nccl-tests' getCollByteCount: `count` is
// size / element size; `param` is the count argument of the call; in place, the send buffer is
// recv + rank * send_inplace_offset and the output recv + rank * recv_inplace_offset.
struct CollCounts {
  size_t send = 0;
  size_t recv = 0;
  size_t param = 0;
  size_t send_inplace_offset = 0;
  size_t recv_inplace_offset = 0;
};

struct IssueArgs {
  Communicator& comm;
  Stream& stream;
  const void* send;
  void* recv;
  size_t count;  // CollCounts::param
  DType dtype;
  ReduceOp op;
  int root;
};

struct CollectiveSpec {
  const char* binary;  // "all_gather_perf"
  CollectiveKind kind;
  bool reduces;  // the redop column and -o apply; inputs use the reducing pattern
  bool rooted;   // the root column and -r apply
  bool has_out_of_place;
  bool has_in_place;
  CollCounts (*counts)(size_t count, int nranks);
  // Bytes of algbw's numerator for a call with `param` elements of `element_size` bytes.
  double (*alg_bytes)(size_t param, size_t element_size, int nranks);
  double (*bus_factor)(int nranks);
  absl::StatusOr<Work> (*issue)(const IssueArgs& args);
  // Expected value of output element `j` (0 <= j < CollCounts::recv) on `args.rank`.
  double (*expected)(const CheckArgs& args, size_t j);
};

// Parses the flags, joins the job (or starts -t threads for --backend local), runs the sweep
// and prints the report. Returns the process exit code: 0, 1 on wrong results or a failed
// collective, 2 on bad flags.
int PerfMain(const CollectiveSpec& spec, int argc, char** argv);

}  // namespace shardline::perf

#endif  // SHARDLINE_BENCH_PERF_COMMON_H_
