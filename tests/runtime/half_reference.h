// File: tests/runtime/half_reference.h
// -----------------------------------------------------------------------------
// An independent reference for the 16-bit float formats, for tests only. It decodes bit patterns
// with ldexp (double arithmetic) and rounds by searching the sorted table of every finite value
// of the format for the nearest one (ties to the even bit pattern) — a different algorithm from
// the bit manipulation in runtime/half.h, so the two can check each other.

#ifndef SHARDLINE_TESTS_RUNTIME_HALF_REFERENCE_H_
#define SHARDLINE_TESTS_RUNTIME_HALF_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace shardline::testing {

struct HalfFormat {
  int exponent_bits;
  int mantissa_bits;
  int bias;
};
inline constexpr HalfFormat kF16Format{5, 10, 15};
inline constexpr HalfFormat kBf16Format{8, 7, 127};

inline int ExpMax(const HalfFormat& f) { return (1 << f.exponent_bits) - 1; }
inline uint16_t InfBits(const HalfFormat& f) {
  return static_cast<uint16_t>(ExpMax(f) << f.mantissa_bits);
}
inline bool RefIsNaN(const HalfFormat& f, uint16_t bits) { return (bits & 0x7fff) > InfBits(f); }

// The value of a bit pattern (NaN for NaNs).
inline double RefDecode(const HalfFormat& f, uint16_t bits) {
  const bool negative = bits & 0x8000;
  const int e = (bits >> f.mantissa_bits) & ExpMax(f);
  const int m = bits & ((1 << f.mantissa_bits) - 1);
  double v;
  if (e == ExpMax(f)) {
    v = m != 0 ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), 1 - f.bias - f.mantissa_bits);
  } else {
    v = std::ldexp(static_cast<double>((1 << f.mantissa_bits) + m), e - f.bias - f.mantissa_bits);
  }
  return negative ? -v : v;
}

// Rounds any double to the nearest bit pattern, ties to even; beyond the largest finite value
// the next "value" is 2^(emax+1), encoded as Inf. NaN -> the format's canonical quiet NaN (tests
// check NaN-ness and sign separately).
class RefRounder {
 public:
  explicit RefRounder(const HalfFormat& f) : format_(f) {
    const uint16_t inf = InfBits(f);
    for (uint32_t bits = 0; bits < inf; ++bits) table_.push_back(RefDecode(f, bits));
    // The overflow threshold: the value the Inf pattern would have if the exponent continued.
    table_.push_back(std::ldexp(1.0, ExpMax(f) - f.bias));
  }

  uint16_t Round(double x) const {
    const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    if (std::isnan(x)) return static_cast<uint16_t>(sign | InfBits(format_) | 1);
    const double a = std::fabs(x);
    if (a >= table_.back()) return static_cast<uint16_t>(sign | InfBits(format_));
    // table_[lo] <= a < table_[lo + 1]
    const size_t lo = std::upper_bound(table_.begin(), table_.end(), a) - table_.begin() - 1;
    const double below = a - table_[lo];      // exact (Sterbenz)
    const double above = table_[lo + 1] - a;  // exact
    size_t pick = lo;
    if (above < below || (above == below && (lo & 1))) pick = lo + 1;
    return static_cast<uint16_t>(sign | pick);
  }

 private:
  HalfFormat format_;
  std::vector<double> table_;
};

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_RUNTIME_HALF_REFERENCE_H_
