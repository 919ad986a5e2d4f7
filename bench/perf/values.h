// File: bench/perf/values.h
// -----------------------------------------------------------------------------
// The data of the perf binaries: what every rank writes into its input, and the plain-loop
// reference its output is checked against (#wrong).
//
// Values are a hash of (rank, index, seed), reduced to small integers: no period in the index
// and none across ranks, so a block that lands at the wrong offset, or comes from the wrong
// rank, differs from the reference in most of its elements. Integers in [0, 12] sum exactly in
// every floating dtype for a few ranks in any order (bf16 holds every integer up to 256), so the
// reference of a sum, min or max is exact whatever order a backend reduces in. Averages of
// floats are scaled by a rounded 1/n: CheckTolerance allows a few units in the last place.

#ifndef SHARDLINE_BENCH_PERF_VALUES_H_
#define SHARDLINE_BENCH_PERF_VALUES_H_

#include <cstddef>
#include <cstdint>

#include "runtime/dtype.h"

namespace shardline::perf {

// What the reference needs to know about one checked call.
struct CheckArgs {
  int rank;
  int nranks;
  size_t count;  // CollCounts::param
  DType dtype;
  ReduceOp op;
  int root;
  uint64_t seed;
};

// Element `index` of rank `rank`'s input. `reducing`: integers in [0, 12], small enough that the
// sum over a few ranks stays exact in bf16; otherwise in [0, 250] ([0, 126] for int8).
double InputValue(DType dtype, bool reducing, int rank, size_t index, uint64_t seed);

// op over the ranks, in rank order, of InputValue(reducing=true, s, index): the reference of
// reduce-scatter and all-reduce (kAvg divides; integers truncate, as the backends do).
double ReducedValue(const CheckArgs& args, size_t index);

// How far an output element may be from the reference `want`: 0, except for averaged floats.
double CheckTolerance(DType dtype, ReduceOp op, double want);

}  // namespace shardline::perf

#endif  // SHARDLINE_BENCH_PERF_VALUES_H_
