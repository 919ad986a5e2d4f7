// DType, ReduceOp, Device and the Status macros.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/status.h"

// runtime/status.h is installed, so it leaves the unprefixed names to the embedding framework:
// otherwise include order would decide whose RETURN_IF_ERROR a framework's file gets.
#if defined(RETURN_IF_ERROR) || defined(ASSIGN_OR_RETURN)
#error "runtime/status.h defines an unprefixed status macro; it must define only SL_ names"
#endif

namespace shardline {
namespace {

using ::testing::HasSubstr;

TEST(DTypeTest, SizesMatchTheirCTypes) {
  EXPECT_EQ(DTypeSize(DType::kF32), sizeof(float));
  EXPECT_EQ(DTypeSize(DType::kF64), sizeof(double));
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kI8), sizeof(int8_t));
  EXPECT_EQ(DTypeSize(DType::kU8), sizeof(uint8_t));
  EXPECT_EQ(DTypeSize(DType::kI32), sizeof(int32_t));
  EXPECT_EQ(DTypeSize(DType::kI64), sizeof(int64_t));
}

TEST(DTypeTest, NamesRoundTrip) {
  for (DType dtype : kAllDTypes) {
    absl::StatusOr<DType> parsed = ParseDType(DTypeName(dtype));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, dtype);
  }
  EXPECT_EQ(*ParseDType("BFloat16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("float"), DType::kF32);
  EXPECT_EQ(*ParseDType("half"), DType::kF16);
}

TEST(DTypeTest, UnknownNameIsInvalidArgumentNamingIt) {
  absl::StatusOr<DType> parsed = ParseDType("f24");
  ASSERT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("'f24'"), absl::string_view::npos);
}

TEST(DTypeTest, FloatingPointClassification) {
  int floating = 0;
  for (DType dtype : kAllDTypes) floating += IsFloatingPoint(dtype);
  EXPECT_EQ(floating, 4);
  EXPECT_TRUE(IsFloatingPoint(DType::kBF16));
  EXPECT_FALSE(IsFloatingPoint(DType::kI64));
}

TEST(ReduceOpTest, NamesRoundTrip) {
  for (ReduceOp op : kAllReduceOps) EXPECT_EQ(*ParseReduceOp(ReduceOpName(op)), op);
  EXPECT_EQ(*ParseReduceOp("MEAN"), ReduceOp::kAvg);
  EXPECT_EQ(*ParseReduceOp("Prod"), ReduceOp::kProduct);
  absl::StatusOr<ReduceOp> bad = ParseReduceOp("band");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("'band'"));
  EXPECT_THAT(bad.status().message(), HasSubstr("product"));
}

TEST(DeviceTest, ParseAndPrint) {
  EXPECT_EQ(*Device::Parse("host"), Device::Host());
  EXPECT_EQ(*Device::Parse("CPU"), Device::Host());
  EXPECT_EQ(*Device::Parse("cuda"), Device::Cuda(0));
  EXPECT_EQ(*Device::Parse("cuda:3"), Device::Cuda(3));
  EXPECT_EQ(Device::Cuda(3).ToString(), "cuda:3");
  EXPECT_EQ(Device::Host().ToString(), "host");
  EXPECT_NE(Device::Cuda(0), Device::Cuda(1));
  for (const char* bad : {"cuda:", "cuda:-1", "cuda:x", "tpu", ""}) {
    absl::StatusOr<Device> device = Device::Parse(bad);
    EXPECT_EQ(device.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  SL_ASSIGN_OR_RETURN(int half, Half(x));
  SL_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

absl::Status CheckQuarter(int x, int* out) {
  SL_ASSIGN_OR_RETURN(*out, Quarter(x));
  SL_RETURN_IF_ERROR(absl::OkStatus());
  return absl::OkStatus();
}

TEST(StatusMacrosTest, PropagateFirstError) {
  int out = 0;
  EXPECT_TRUE(CheckQuarter(12, &out).ok());
  EXPECT_EQ(out, 3);
  absl::Status status = CheckQuarter(6, &out);  // 6 -> 3 -> odd
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out, 3);  // untouched by the failed call
}

TEST(StatusMacrosTest, AnnotateKeepsCode) {
  absl::Status annotated = Annotate(absl::UnavailableError("peer 3 closed"), "all_gather #7");
  EXPECT_EQ(annotated.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(annotated.message(), "all_gather #7: peer 3 closed");
  EXPECT_TRUE(Annotate(absl::OkStatus(), "x").ok());
}

}  // namespace
}  // namespace shardline
