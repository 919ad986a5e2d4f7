// Tests of runtime/half.h against the independent reference in half_reference.h: every 16-bit
// pattern both ways, every rounding midpoint, overflow and subnormal boundaries, random f32/f64.

#include "runtime/half.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "gtest/gtest.h"
#include "tests/runtime/half_reference.h"

namespace shardline {
namespace {

using testing::HalfFormat;
using testing::kBf16Format;
using testing::kF16Format;
using testing::RefDecode;
using testing::RefIsNaN;
using testing::RefRounder;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Format {
  const char* name;
  HalfFormat format;
  uint16_t (*from_float)(float);
  float (*to_float)(uint16_t);
  uint16_t (*from_double)(double);
  uint16_t quiet_bit;
};

const Format kFormats[] = {
    {"f16", kF16Format, FloatToHalfBits, HalfBitsToFloat, DoubleToHalfBits, 0x0200},
    {"bf16", kBf16Format, FloatToBf16Bits, Bf16BitsToFloat, DoubleToBf16Bits, 0x0040},
};

void PrintTo(const Format& f, std::ostream* os) { *os << f.name; }

class HalfTest : public ::testing::TestWithParam<Format> {};

// Checks that `got` is the expected rounding of `x` (NaN: a quiet NaN with x's sign).
void ExpectRounded(const Format& fmt, const RefRounder& ref, double x, uint16_t got,
                   const char* what) {
  const uint16_t want = ref.Round(x);
  if (std::isnan(x)) {
    EXPECT_TRUE(RefIsNaN(fmt.format, got)) << what << " " << x << " -> " << std::hex << got;
    EXPECT_EQ(got & 0x8000, want & 0x8000) << what << " NaN sign";
    EXPECT_TRUE(got & fmt.quiet_bit) << what << " NaN not quiet: " << std::hex << got;
  } else {
    ASSERT_EQ(got, want) << fmt.name << " " << what << "(" << std::hexfloat << x << ") got 0x"
                         << std::hex << got << " want 0x" << want;
  }
}

TEST_P(HalfTest, WidenEveryPattern) {
  const Format& fmt = GetParam();
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const float got = fmt.to_float(bits);
    const double want = RefDecode(fmt.format, bits);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << b;
      ASSERT_EQ(std::signbit(got), std::signbit(want)) << std::hex << b;
      ASSERT_TRUE(Bits(got) & 0x00400000u) << "widened NaN not quiet " << std::hex << b;
    } else {
      ASSERT_EQ(static_cast<double>(got), want) << std::hex << b;
      ASSERT_EQ(std::signbit(got), std::signbit(want)) << std::hex << b;
    }
  }
}

TEST_P(HalfTest, RoundTripEveryPattern) {
  const Format& fmt = GetParam();
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const uint16_t back = fmt.from_float(fmt.to_float(bits));
    const uint16_t back_d = fmt.from_double(static_cast<double>(fmt.to_float(bits)));
    // A NaN comes back quiet, with the same sign and payload.
    const uint16_t want = RefIsNaN(fmt.format, bits) ? (bits | fmt.quiet_bit) : bits;
    ASSERT_EQ(back, want) << fmt.name << " 0x" << std::hex << b;
    ASSERT_EQ(back_d, want) << fmt.name << " (via double) 0x" << std::hex << b;
  }
}

// Every midpoint between neighbouring finite values (both signs), and the floats/doubles just
// below and above it: ties go to the even pattern, everything else to the nearer value.
TEST_P(HalfTest, NarrowAtEveryMidpoint) {
  const Format& fmt = GetParam();
  const RefRounder ref(fmt.format);
  const uint16_t inf = testing::InfBits(fmt.format);
  for (uint32_t b = 0; b + 1 <= inf; ++b) {
    const double lo = RefDecode(fmt.format, static_cast<uint16_t>(b));
    const double hi = b + 1 == inf ? std::ldexp(1.0, testing::ExpMax(fmt.format) - fmt.format.bias)
                                   : RefDecode(fmt.format, static_cast<uint16_t>(b + 1));
    const double mid = (lo + hi) / 2;  // exact in double
    for (double sign : {1.0, -1.0}) {
      const double m = sign * mid;
      const float mf = static_cast<float>(m);
      ASSERT_EQ(static_cast<double>(mf), m) << "midpoint not exact in f32";
      for (float x : {mf, std::nextafter(mf, 0.0f), std::nextafter(mf, 2 * mf)}) {
        ExpectRounded(fmt, ref, x, fmt.from_float(x), "from_float");
      }
      // Doubles within a hair of the midpoint: a naive f64 -> f32 -> 16-bit path rounds the
      // first two onto the midpoint and then ties wrongly.
      for (double x : {std::nextafter(m, 0.0), std::nextafter(m, 2 * m), m, m * (1 + 0x1p-40),
                       m * (1 - 0x1p-40)}) {
        ExpectRounded(fmt, ref, x, fmt.from_double(x), "from_double");
      }
    }
  }
}

TEST_P(HalfTest, NarrowEdgeValues) {
  const Format& fmt = GetParam();
  const RefRounder ref(fmt.format);
  const float kInf = std::numeric_limits<float>::infinity();
  const float edges[] = {0.0f,
                         -0.0f,
                         kInf,
                         -kInf,
                         std::numeric_limits<float>::quiet_NaN(),
                         -std::numeric_limits<float>::quiet_NaN(),
                         FromBits(0x7f800001u),  // signalling NaN
                         FromBits(0xff800001u),
                         FromBits(0x7fbfffffu),
                         std::numeric_limits<float>::max(),
                         -std::numeric_limits<float>::max(),
                         std::numeric_limits<float>::min(),
                         std::numeric_limits<float>::denorm_min(),
                         -std::numeric_limits<float>::denorm_min(),
                         65504.0f,
                         65519.0f,
                         65519.996f,
                         65520.0f,
                         -65520.0f,
                         65536.0f,
                         1e10f,
                         0x1p-14f,
                         0x1p-15f,
                         0x1p-24f,
                         0x1p-25f,
                         0x1.000002p-25f,
                         0x1p-26f,
                         0x1.ffep-15f,
                         0x1.fffp-15f,
                         1.0f,
                         -1.0f,
                         3.14159265f,
                         0x1.fep127f,
                         0x1.ffp127f,
                         0x1.fefffep127f,
                         0x1p-126f,
                         0x1p-133f,
                         0x1p-134f,
                         0x1.8p-134f};
  for (float x : edges) {
    ExpectRounded(fmt, ref, x, fmt.from_float(x), "from_float");
    ExpectRounded(fmt, ref, x, fmt.from_double(static_cast<double>(x)), "from_double");
  }
  const double dedges[] = {1e300,
                           -1e300,
                           1e-300,
                           -1e-300,
                           0x1.fffffffffffffp-25,
                           0x1.0000000000001p-25,
                           0x1.fefffffffffffp127,
                           0x1.ff00000000001p127,
                           std::numeric_limits<double>::denorm_min()};
  for (double x : dedges) ExpectRounded(fmt, ref, x, fmt.from_double(x), "from_double");
}

TEST_P(HalfTest, NarrowRandomFloats) {
  const Format& fmt = GetParam();
  const RefRounder ref(fmt.format);
  std::mt19937_64 rng(1234);
  for (int i = 0; i < 1000000; ++i) {
    const uint64_t r = rng();
    // Half the samples from the whole f32 range, half from the format's own exponent range.
    uint32_t u = static_cast<uint32_t>(r);
    if (i & 1) {
      const int exp_span = fmt.format.bias * 2 + 10;
      const uint32_t e = static_cast<uint32_t>(127 - fmt.format.bias - 12 + (r >> 40) % exp_span);
      u = (u & 0x807fffffu) | (std::min<uint32_t>(e, 254) << 23);
    }
    const float x = FromBits(u);
    ExpectRounded(fmt, ref, x, fmt.from_float(x), "from_float");
    const double d = static_cast<double>(x) * (1 + static_cast<double>(r >> 44) * 0x1p-45);
    ExpectRounded(fmt, ref, d, fmt.from_double(d), "from_double");
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, HalfTest, ::testing::ValuesIn(kFormats),
                         [](const ::testing::TestParamInfo<Format>& info) {
                           return std::string(info.param.name);
                         });

TEST(HalfConstexpr, UsableInConstantExpressions) {
  static_assert(FloatToBf16Bits(1.0f) == 0x3f80);
  static_assert(FloatToHalfBits(1.0f) == 0x3c00);
  static_assert(HalfBitsToFloat(0x3c00) == 1.0f);
  static_assert(Bf16BitsToFloat(0xc000) == -2.0f);
  static_assert(FloatToHalfBits(65520.0f) == 0x7c00);
  static_assert(DoubleToHalfBits(0x1p-24) == 0x0001);
  static_assert(bf16::FromFloat(3.0f).ToFloat() == 3.0f);
  static_assert(f16::FromFloat(0.5f).ToFloat() == 0.5f);
  SUCCEED();
}

}  // namespace
}  // namespace shardline
