// Tests of runtime/stream_ops.h on host streams: each op against a plain loop, in stream order
// with an asynchronous stream, with its declared kind and cost, and refused on a poisoned stream.

#include "runtime/stream_ops.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "runtime/half.h"
#include "runtime/host_kernels.h"
#include "runtime/stream.h"
#include "tests/common/gate.h"

namespace shardline {
namespace {

using testing::BlockOn;
using testing::Gate;

// Records the ops submitted to it, then runs them (a stream that looks at what it is given).
class RecordingStream final : public Stream {
 public:
  Device device() const override { return Device::Host(); }
  const std::string& name() const override { return name_; }
  absl::Status Submit(StreamOp op) override {
    ops.push_back({op.name, op.kind, op.bytes});
    return std::move(op.run)();
  }
  absl::Status WaitEvent(Event&) override { return absl::OkStatus(); }
  absl::Status Synchronize(absl::Time) override { return absl::OkStatus(); }
  absl::Status status() const override { return absl::OkStatus(); }
  std::shared_ptr<Event> CreateEvent() override { return CreateHostEvent(); }

  struct Seen {
    std::string name;
    StreamOpKind kind;
    uint64_t bytes;
  };
  std::vector<Seen> ops;

 private:
  std::string name_ = "recording";
};

float Hashed(size_t i) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + 12345;
  x = (x ^ (x >> 31)) * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<double>(x >> 40) / (1 << 20) - 8.0);
}

TEST(StreamOpsTest, OpsRunInStreamOrderAndMatchPlainLoops) {
  auto stream = *CreateHostStream({.name = "ops"});
  const size_t n = 1031;
  std::vector<float> a(n), b(n), sum(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = Hashed(i);
    b[i] = Hashed(i + n);
  }
  std::vector<uint16_t> half(n);
  std::vector<float> back(n, -1.0f), copy(n, -1.0f);
  std::vector<float> zeroed = b;
  Gate gate;
  // Everything queues behind the gate: nothing may run before it opens.
  ASSERT_TRUE(stream->Enqueue(BlockOn(gate)).ok());
  ASSERT_TRUE(EnqueueCopy(*stream, sum.data(), a.data(), n * 4).ok());
  ASSERT_TRUE(EnqueueReduce(*stream, sum.data(), b.data(), n, DType::kF32).ok());
  ASSERT_TRUE(EnqueueCast(*stream, sum.data(), DType::kF32, half.data(), DType::kBF16, n).ok());
  ASSERT_TRUE(EnqueueCast(*stream, half.data(), DType::kBF16, back.data(), DType::kF32, n).ok());
  ASSERT_TRUE(EnqueueCopy(*stream, copy.data(), back.data(), n * 4).ok());
  ASSERT_TRUE(EnqueueFill(*stream, zeroed.data(), 3 * 4).ok());
  ASSERT_TRUE(EnqueueCast(*stream, a.data(), DType::kF32, a.data(), DType::kF32, 0).ok());
  EXPECT_EQ(copy[0], -1.0f);
  gate.Open();
  ASSERT_TRUE(stream->Synchronize(absl::Now() + absl::Seconds(20)).ok());
  for (size_t i = 0; i < n; ++i) {
    const float s = a[i] + b[i];
    ASSERT_EQ(sum[i], s) << i;
    ASSERT_EQ(copy[i], Bf16BitsToFloat(FloatToBf16Bits(s))) << i;
    ASSERT_EQ(zeroed[i], i < 3 ? 0.0f : b[i]) << i;
  }
}

// Sums of squares accumulate into sums[0] in stream order; scaling follows them. Every floating
// dtype, odd counts, against a double loop over the values as the dtype holds them.
TEST(StreamOpsTest, SumSquaresAccumulatesAndScaleScales) {
  auto stream = *CreateHostStream({.name = "norms"});
  for (DType dtype : {DType::kF32, DType::kF64, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const size_t n = 4099, m = 17;
    std::vector<float> values(n + m);
    for (size_t i = 0; i < values.size(); ++i) values[i] = Hashed(i + 7 * n);
    std::vector<std::byte> data(values.size() * DTypeSize(dtype));
    ASSERT_TRUE(Cast(values.data(), DType::kF32, data.data(), dtype, values.size()).ok());
    std::vector<float> held(values.size());  // the values as the dtype holds them
    ASSERT_TRUE(Cast(data.data(), dtype, held.data(), DType::kF32, values.size()).ok());
    double expected_first = 0, expected_second = 0;
    for (size_t i = 0; i < n; ++i) expected_first += static_cast<double>(held[i]) * held[i];
    for (size_t i = n; i < n + m; ++i) expected_second += static_cast<double>(held[i]) * held[i];

    std::vector<double> sums(kSumSquaresDoubles, 0.25);  // sums[0] is added to, not overwritten
    Gate gate;
    ASSERT_TRUE(stream->Enqueue(BlockOn(gate)).ok());
    ASSERT_TRUE(EnqueueSumSquares(*stream, data.data(), n, dtype, sums.data()).ok());
    ASSERT_TRUE(
        EnqueueSumSquares(*stream, data.data() + n * DTypeSize(dtype), m, dtype, sums.data()).ok());
    ASSERT_TRUE(EnqueueScale(*stream, data.data(), n + m, dtype, 0.375).ok());
    EXPECT_EQ(sums[0], 0.25);  // nothing ran before the gate
    gate.Open();
    ASSERT_TRUE(stream->Synchronize(absl::Now() + absl::Seconds(20)).ok());
    EXPECT_NEAR(sums[0], 0.25 + expected_first + expected_second,
                1e-12 * (expected_first + expected_second));
    std::vector<float> scaled(values.size());
    ASSERT_TRUE(Cast(data.data(), dtype, scaled.data(), DType::kF32, values.size()).ok());
    for (size_t i = 0; i < values.size(); ++i) {
      // f64 scales in double; the others in f32 with the factor rounded to f32, then round once.
      float want;
      if (dtype == DType::kF64) {
        want = static_cast<float>(static_cast<double>(held[i]) * 0.375);
      } else {
        const float product = held[i] * 0.375f;
        std::vector<std::byte> one(DTypeSize(dtype));
        ASSERT_TRUE(Cast(&product, DType::kF32, one.data(), dtype, 1).ok());
        ASSERT_TRUE(Cast(one.data(), dtype, &want, DType::kF32, 1).ok());
      }
      ASSERT_EQ(scaled[i], want) << i;
    }
  }
}

TEST(StreamOpsTest, SumSquaresRefusesIntegersAndNullSums) {
  auto stream = *CreateCallerStream({.name = "norms"});
  std::vector<int32_t> ints(5, 3);
  std::vector<double> sums(kSumSquaresDoubles, 0);
  absl::Status status = EnqueueSumSquares(*stream, ints.data(), 5, DType::kI32, sums.data());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("i32"), std::string::npos) << status;
  std::vector<float> x(3, 1.0f);
  status = EnqueueSumSquares(*stream, x.data(), 3, DType::kF32, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("null"), std::string::npos) << status;
  EXPECT_TRUE(stream->status().ok()) << "a refused op must not poison the stream";
}

TEST(StreamOpsTest, OpsDeclareTheirKindAndCost) {
  RecordingStream stream;
  std::vector<float> x(10), y(10);
  std::vector<uint16_t> h(10);
  ASSERT_TRUE(EnqueueCast(stream, x.data(), DType::kF32, h.data(), DType::kBF16, 10).ok());
  ASSERT_TRUE(EnqueueReduce(stream, x.data(), y.data(), 10, DType::kF32, ReduceOp::kMax).ok());
  ASSERT_TRUE(EnqueueFill(stream, x.data(), 40).ok());
  ASSERT_TRUE(EnqueueCopy(stream, x.data(), y.data(), 40).ok());
  ASSERT_TRUE(EnqueueCopy(stream, x.data(), y.data(), 0).ok());  // nothing submitted
  ASSERT_EQ(stream.ops.size(), 4u);
  EXPECT_EQ(stream.ops[0].kind, StreamOpKind::kCast);
  EXPECT_EQ(stream.ops[0].bytes, 40u);
  EXPECT_EQ(stream.ops[0].name, "cast f32->bf16");
  EXPECT_EQ(stream.ops[1].kind, StreamOpKind::kReduce);
  EXPECT_EQ(stream.ops[1].bytes, 80u);
  EXPECT_EQ(stream.ops[2].kind, StreamOpKind::kFill);
  EXPECT_EQ(stream.ops[3].kind, StreamOpKind::kCopy);
  EXPECT_EQ(stream.ops[3].bytes, 40u);
}

TEST(StreamOpsTest, APoisonedStreamRefusesOps) {
  auto stream = *CreateCallerStream({.name = "poisoned"});
  EXPECT_FALSE(stream->Enqueue([] { return absl::InternalError("boom"); }).ok());
  std::vector<float> x(4, 1.0f);
  EXPECT_EQ(EnqueueFill(*stream, x.data(), 16).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(x[0], 1.0f);
}

TEST(StreamOpsTest, CopyBlockingCopiesHostMemoryAndRefusesAMissingDevice) {
  std::vector<float> src(1031), dst(1031, 0.f);
  for (size_t i = 0; i < src.size(); ++i) src[i] = std::sin(0.37f * static_cast<float>(i)) + 0.1f;
  ASSERT_TRUE(CopyBlocking(Device::Host(), dst.data(), src.data(), src.size() * sizeof(float),
                           absl::Now() + absl::Seconds(10))
                  .ok());
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), src.size() * sizeof(float)), 0);
  // A device that cannot be used (no GPU here, or an index past the last one) is an error, not a
  // copy: nothing is written.
  std::vector<float> untouched(4, 7.f);
  const absl::Status missing =
      CopyBlocking(Device::Cuda(1 << 20), untouched.data(), src.data(),
                   untouched.size() * sizeof(float), absl::Now() + absl::Seconds(10));
  EXPECT_FALSE(missing.ok());
  EXPECT_EQ(untouched[0], 7.f);
}

}  // namespace
}  // namespace shardline
