// The JSON reader (runtime/json.h): integers stay exact, numbers with a fraction or an exponent
// read as the nearest double, JsonNumber round-trips doubles, and bad input names line/column.

#include "runtime/json.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"

namespace shardline {
namespace {

TEST(JsonTest, IntegersAndNumbersKeepTheirKind) {
  auto v = ParseJson(R"({"i": 42, "n": -9223372036854775808, "f": 0.5, "e": 3.7e11,
                         "neg": -1.25E-3, "z": 0e0, "tiny": 1e-400})");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->Find("i")->kind(), JsonValue::Kind::kInteger);
  EXPECT_EQ(v->Find("i")->integer(), 42);
  EXPECT_EQ(v->Find("i")->number(), 42.0);
  EXPECT_EQ(v->Find("n")->integer(), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(v->Find("f")->kind(), JsonValue::Kind::kNumber);
  EXPECT_EQ(v->Find("f")->number(), 0.5);
  EXPECT_EQ(v->Find("e")->number(), 3.7e11);
  EXPECT_EQ(v->Find("neg")->number(), -1.25e-3);
  EXPECT_EQ(v->Find("z")->number(), 0.0);
  EXPECT_EQ(v->Find("tiny")->number(), 0.0);
  EXPECT_TRUE(v->Find("e")->is_number());
  EXPECT_EQ(JsonKindName(v->Find("e")->kind()), "number");
  // A huge mantissa with a fraction is a number, not an integer overflow.
  auto big = ParseJson("123456789012345678901234.5");
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->number(), 123456789012345678901234.5);
}

TEST(JsonTest, MalformedNumbersNameThePlace) {
  struct Case {
    const char* text;
    const char* message;
  };
  for (const Case& c : {Case{"[1.]", "line 1 column 4: expected a digit after the decimal point"},
                        Case{"[1e]", "line 1 column 4: expected a digit in the exponent"},
                        Case{"\n  1e999", "line 2 column 3: number out of the double range"},
                        Case{"9223372036854775808", "integer out of the 64-bit range"},
                        Case{"01.5", "leading zeros"}, Case{"-.5", "expected a digit"}}) {
    auto v = ParseJson(c.text);
    ASSERT_FALSE(v.ok()) << c.text;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(v.status().message().find(c.message), std::string::npos) << v.status();
  }
}

TEST(JsonTest, JsonNumberRoundTrips) {
  std::mt19937_64 rng(12345);
  std::uniform_real_distribution<double> mantissa(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-300, 300);
  for (int i = 0; i < 2000; ++i) {
    const double d = std::ldexp(mantissa(rng), exponent(rng));
    const std::string text = JsonNumber(d);
    auto v = ParseJson(text);
    ASSERT_TRUE(v.ok()) << text << ": " << v.status();
    ASSERT_EQ(v->number(), d) << text;
    // Independent reference: strtod of the same text.
    ASSERT_EQ(std::strtod(text.c_str(), nullptr), d) << text;
  }
  EXPECT_EQ(JsonNumber(0.5), "0.5");
  EXPECT_EQ(JsonNumber(370e9), "3.7e+11");
}

}  // namespace
}  // namespace shardline
