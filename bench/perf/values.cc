#include "bench/perf/values.h"

#include <algorithm>
#include <cmath>

#include "testing/typed_values.h"

namespace shardline::perf {
double InputValue(DType dtype, bool reducing, int rank, size_t index, uint64_t seed) {
  const uint64_t mix = static_cast<uint64_t>(rank) * 97 + index * 31 + seed * 17;
  if (reducing) return static_cast<double>(mix % 13);
  return static_cast<double>(mix % (dtype == DType::kI8 ? 127 : 251));
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
