#include "bench/perf/values.h"

#include <algorithm>
#include <cmath>

#include "testing/typed_values.h"

namespace shardline::perf {
namespace {

// splitmix64's finalizer: every input bit affects every output bit.
uint64_t Mix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

double InputValue(DType dtype, bool reducing, int rank, size_t index, uint64_t seed) {
  // Rank and seed are hashed before they meet the index, so no (rank, index) pair of a run
  // aliases another one.
  const uint64_t key = Mix(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(rank)) + index;
  const uint64_t h = Mix(key);
  if (reducing) return static_cast<double>(h % 13);
  return static_cast<double>(h % (dtype == DType::kI8 ? 127 : 251));
}

double ReducedValue(const CheckArgs& a, size_t index) {
  double acc = InputValue(a.dtype, true, 0, index, a.seed);
  for (int s = 1; s < a.nranks; ++s) {
    acc = ::shardline::testing::ReferenceOp(a.op, acc, InputValue(a.dtype, true, s, index, a.seed));
  }
  if (a.op == ReduceOp::kAvg) {
    acc = IsFloatingPoint(a.dtype) ? acc / a.nranks : std::trunc(acc / a.nranks);
  }
  return acc;
}

double CheckTolerance(DType dtype, ReduceOp op, double want) {
  if (op != ReduceOp::kAvg || !IsFloatingPoint(dtype)) return 0;
  const double ulp = dtype == DType::kF64   ? 0x1p-52
                     : dtype == DType::kF32 ? 0x1p-23
                     : dtype == DType::kF16 ? 0x1p-10
                                            : 0x1p-7;
  return 4 * ulp * std::max(1.0, std::abs(want));
}

}  // namespace shardline::perf
