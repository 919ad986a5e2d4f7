// The perf binaries' data (bench/perf/values.h): small integers with no period in the index and
// none across ranks, so that #wrong sees a block at the wrong offset or from the wrong rank.

#include "bench/perf/values.h"

#include <cmath>
#include <cstddef>
#include <set>

#include "gtest/gtest.h"

namespace shardline::perf {
namespace {

constexpr size_t kElements = 4096;

// Fraction of elements of rank `a`'s input at i that equal rank `b`'s at i + shift.
double Matches(DType dtype, bool reducing, int a, int b, size_t shift, uint64_t seed) {
  size_t same = 0;
  for (size_t i = 0; i < kElements; ++i) {
    same +=
        InputValue(dtype, reducing, a, i, seed) == InputValue(dtype, reducing, b, i + shift, seed)
            ? 1
            : 0;
  }
  return static_cast<double>(same) / kElements;
}

TEST(PerfValuesTest, ValuesAreSmallIntegersInTheirRange) {
  for (bool reducing : {true, false}) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kI8, DType::kU8}) {
      const double max = reducing ? 12 : dtype == DType::kI8 ? 126 : 250;
      std::set<double> seen;
      for (int rank = 0; rank < 4; ++rank) {
        for (size_t i = 0; i < kElements; ++i) {
          const double v = InputValue(dtype, reducing, rank, i, 7);
          ASSERT_EQ(v, std::trunc(v)) << rank << " " << i;
          ASSERT_GE(v, 0);
          ASSERT_LE(v, max);
          seen.insert(v);
        }
      }
      EXPECT_EQ(seen.size(), static_cast<size_t>(max) + 1) << "reducing " << reducing;
    }
  }
}

// A block shifted by any offset, including the old pattern's periods (13, 251) and chunk sizes
// that are multiples of them, or taken from another rank, differs in most elements: about
// 1/13 (reducing) or 1/251 of them match by chance, never all.
TEST(PerfValuesTest, ShiftedOrForeignBlocksDiffer) {
  std::set<size_t> shifts = {13, 26, 251, 502, 3263, 1088, 4352, 32768, 131072, 1 << 20};
  for (size_t d = 1; d <= 300; ++d) shifts.insert(d);
  for (bool reducing : {true, false}) {
    const double bound = reducing ? 0.15 : 0.03;
    for (int a = 0; a < 3; ++a) {
      for (int b = 0; b < 3; ++b) {
        if (a != b) {
          EXPECT_LT(Matches(DType::kF32, reducing, a, b, 0, 1), bound) << a << " vs " << b;
        }
        for (size_t d : shifts) {
          ASSERT_LT(Matches(DType::kF32, reducing, a, b, d, 1), bound)
              << "rank " << a << " vs rank " << b << " shifted by " << d << " (reducing "
              << reducing << ")";
        }
      }
    }
  }
}

TEST(PerfValuesTest, EachCheckedCallGetsOtherData) {
  for (bool reducing : {true, false}) {
    size_t same = 0;
    for (size_t i = 0; i < kElements; ++i) {
      same +=
          InputValue(DType::kF32, reducing, 0, i, 1) == InputValue(DType::kF32, reducing, 0, i, 2)
              ? 1
              : 0;
    }
    EXPECT_LT(static_cast<double>(same) / kElements, reducing ? 0.15 : 0.03);
  }
}

// The reference of a sum is exact in every floating dtype whatever order a backend reduces in:
// the sum over up to 16 ranks of [0, 12] stays below 256, which bf16 holds exactly.
TEST(PerfValuesTest, ReferenceSumIsExactInBf16) {
  for (int n : {2, 3, 4, 8, 16}) {
    for (size_t i = 0; i < kElements; ++i) {
      const CheckArgs args{0, n, kElements, DType::kBF16, ReduceOp::kSum, -1, 3};
      const double want = ReducedValue(args, i);
      float reversed = 0;  // another order, in float
      for (int s = n - 1; s >= 0; --s) {
        reversed += static_cast<float>(InputValue(DType::kBF16, true, s, i, 3));
      }
      ASSERT_EQ(want, reversed) << "n " << n << " element " << i;
      ASSERT_LE(want, 256);
    }
  }
}

}  // namespace
}  // namespace shardline::perf
