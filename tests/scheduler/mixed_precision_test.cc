// MixedPrecisionPolicy: validation names the offending field, the sharded gradient's dtype follows
// keep_low_precision_grads, and the printed form.
#include "scheduler/mixed_precision.h"

#include <gtest/gtest.h>

#include <sstream>

#include "absl/strings/match.h"

namespace shardline {
namespace {

TEST(MixedPrecisionPolicyTest, DefaultIsFullPrecision) {
  const MixedPrecisionPolicy policy;
  EXPECT_TRUE(policy.Validate().ok());
  EXPECT_EQ(policy.param_dtype, DType::kF32);
  EXPECT_EQ(policy.reduce_dtype, DType::kF32);
  EXPECT_EQ(policy.master_dtype, DType::kF32);
  EXPECT_EQ(policy.sharded_grad_dtype(), DType::kF32);
  EXPECT_EQ(policy.ToString(), "param=f32 reduce=f32 master=f32");
}

TEST(MixedPrecisionPolicyTest, EveryFloatingCombinationIsValid) {
  for (DType p : kAllDTypes) {
    for (DType r : kAllDTypes) {
      for (DType m : kAllDTypes) {
        const MixedPrecisionPolicy policy{p, r, m, false};
        const bool valid = IsFloatingPoint(p) && IsFloatingPoint(r) && IsFloatingPoint(m);
        EXPECT_EQ(policy.Validate().ok(), valid) << policy;
      }
    }
  }
}

TEST(MixedPrecisionPolicyTest, IntegerDTypesAreRejectedNamingTheField) {
  struct Case {
    MixedPrecisionPolicy policy;
    const char* field;
    const char* dtype;
  };
  const Case cases[] = {
      {{DType::kI32, DType::kF32, DType::kF32, false}, "param_dtype", "i32"},
      {{DType::kBF16, DType::kU8, DType::kF32, false}, "reduce_dtype", "u8"},
      {{DType::kBF16, DType::kF32, DType::kI64, false}, "master_dtype", "i64"},
  };
  for (const Case& c : cases) {
    const absl::Status status = c.policy.Validate();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(status.message(), c.field)) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), c.dtype)) << status;
  }
}

TEST(MixedPrecisionPolicyTest, KeepLowPrecisionGradsKeepsTheReduceDType) {
  MixedPrecisionPolicy policy{DType::kBF16, DType::kF16, DType::kF32, false};
  EXPECT_EQ(policy.sharded_grad_dtype(), DType::kF32);
  policy.keep_low_precision_grads = true;
  EXPECT_EQ(policy.sharded_grad_dtype(), DType::kF16);
  EXPECT_EQ(policy.ToString(), "param=bf16 reduce=f16 master=f32 keep_low_precision_grads");
  std::ostringstream os;
  os << policy;
  EXPECT_EQ(os.str(), policy.ToString());
}

TEST(MixedPrecisionPolicyTest, Equality) {
  const MixedPrecisionPolicy a{DType::kBF16, DType::kF32, DType::kF32, false};
  MixedPrecisionPolicy b = a;
  EXPECT_EQ(a, b);
  b.keep_low_precision_grads = true;
  EXPECT_NE(a, b);
}

}  // namespace
}  // namespace shardline
