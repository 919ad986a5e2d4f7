// The counting communicator (scheduler/tune/counting_communicator.h) over the local backend,
// three ranks: every collective's result equals a plain-loop reference on every element (the
// wrapper passes the call through unchanged), the tallies count each call's payload and ring
// bytes, splits and dups are counted under their own names, an abort reaches the wrapped
// communicator, and a bad call is the wrapped API's error.
#include "scheduler/tune/counting_communicator.h"

#include <gtest/gtest.h>

#include <vector>

#include "absl/strings/match.h"
#include "collectives/local/local_communicator.h"
#include "runtime/stream.h"
#include "tests/common/rank_threads.h"

namespace shardline {
namespace {

constexpr int kRanks = 3;

float Value(int rank, size_t i) {
  // Distinct, exactly representable, sums exact in f32.
  return static_cast<float>((rank * 131 + static_cast<int>(i) * 17) % 97) - 48.0f;
}

struct Ranks {
  std::vector<std::shared_ptr<Communicator>> inner;
  std::vector<std::shared_ptr<Communicator>> comms;
  std::vector<std::shared_ptr<CollectiveCounter>> counters;
  std::vector<std::unique_ptr<Stream>> streams;
};

Ranks Make() {
  Ranks r;
  auto inner = CreateLocalCommunicators(kRanks);
  EXPECT_TRUE(inner.ok()) << inner.status();
  r.inner = *inner;
  for (int i = 0; i < kRanks; ++i) {
    r.counters.push_back(std::make_shared<CollectiveCounter>());
    r.comms.push_back(WrapCounting(r.inner[i], r.counters[i]));
    r.streams.push_back(*CreateHostStream({.name = "s"}));
  }
  return r;
}

TEST(TuneCountingTest, CollectivesPassThroughAndAreCounted) {
  Ranks r = Make();
  const size_t ag = 7, rs = 5, ar = 11, bc = 9;
  std::vector<std::vector<float>> ag_in(kRanks), ag_out(kRanks, std::vector<float>(ag * kRanks));
  std::vector<std::vector<float>> rs_in(kRanks), rs_out(kRanks, std::vector<float>(rs));
  std::vector<std::vector<float>> ar_buf(kRanks), bc_buf(kRanks);
  for (int i = 0; i < kRanks; ++i) {
    for (size_t e = 0; e < ag; ++e) ag_in[i].push_back(Value(i, e));
    for (size_t e = 0; e < rs * kRanks; ++e) rs_in[i].push_back(Value(i, e + 100));
    for (size_t e = 0; e < ar; ++e) ar_buf[i].push_back(Value(i, e + 200));
    for (size_t e = 0; e < bc; ++e) bc_buf[i].push_back(Value(i, e + 300));
  }
  const auto ar_in = ar_buf;
  for (int i = 0; i < kRanks; ++i) {
    Communicator& c = *r.comms[i];
    Stream& s = *r.streams[i];
    ASSERT_TRUE(c.AllGather(ag_in[i].data(), ag_out[i].data(), ag, DType::kF32, s).ok());
    ASSERT_TRUE(c.ReduceScatter(rs_in[i].data(), rs_out[i].data(), rs, DType::kF32, s,
                                {.op = ReduceOp::kSum})
                    .ok());
    ASSERT_TRUE(
        c.AllReduce(ar_buf[i].data(), ar_buf[i].data(), ar, DType::kF32, s, {.op = ReduceOp::kMax})
            .ok());
    BroadcastOptions b;
    b.root = 1;
    ASSERT_TRUE(c.Broadcast(bc_buf[i].data(), bc, DType::kF32, s, b).ok());
    ASSERT_TRUE(c.Barrier(s).ok());
  }
  for (int i = 0; i < kRanks; ++i) {
    ASSERT_TRUE(r.streams[i]->Synchronize(absl::Now() + absl::Seconds(30)).ok());
  }
  for (int i = 0; i < kRanks; ++i) {
    for (int src = 0; src < kRanks; ++src) {
      for (size_t e = 0; e < ag; ++e) EXPECT_EQ(ag_out[i][src * ag + e], Value(src, e));
    }
    for (size_t e = 0; e < rs; ++e) {
      float sum = 0;
      for (int src = 0; src < kRanks; ++src) sum += Value(src, i * rs + e + 100);
      EXPECT_EQ(rs_out[i][e], sum);
    }
    for (size_t e = 0; e < ar; ++e) {
      float max = ar_in[0][e];
      for (int src = 1; src < kRanks; ++src) max = std::max(max, ar_in[src][e]);
      EXPECT_EQ(ar_buf[i][e], max);
    }
    for (size_t e = 0; e < bc; ++e) EXPECT_EQ(bc_buf[i][e], Value(1, e + 300));

    const CollectiveCounter& k = *r.counters[i];
    EXPECT_EQ(k.Sum(CollectiveKind::kAllGather).calls, 1u);
    EXPECT_EQ(k.Sum(CollectiveKind::kAllGather).payload_bytes, ag * kRanks * 4);
    EXPECT_EQ(k.Sum(CollectiveKind::kAllGather).ring_sent_bytes_times_size,
              (kRanks - 1) * ag * kRanks * 4);
    EXPECT_EQ(k.Sum(CollectiveKind::kReduceScatter).payload_bytes, rs * kRanks * 4);
    EXPECT_EQ(k.Sum(CollectiveKind::kAllReduce).payload_bytes, ar * 4);
    EXPECT_EQ(k.Sum(CollectiveKind::kAllReduce).ring_sent_bytes_times_size,
              2 * (kRanks - 1) * ar * 4);
    EXPECT_EQ(k.Sum(CollectiveKind::kBroadcast).payload_bytes, bc * 4);
    EXPECT_EQ(k.Sum(CollectiveKind::kBarrier).calls, 1u);
    EXPECT_EQ(k.Sum(CollectiveKind::kBarrier).payload_bytes, 0u);
    // (n-1)/n of AG, RS, broadcast payloads, 2(n-1)/n of the all-reduce's.
    const double sent = (2.0 / 3) * (ag * 3 * 4 + rs * 3 * 4 + bc * 4) + (4.0 / 3) * (ar * 4);
    EXPECT_NEAR(k.RingSentBytes(), sent, 1e-9);
    EXPECT_EQ(k.Totals().size(), 5u);
  }
}

TEST(TuneCountingTest, SplitsAreCountedAndAbortsReachTheWrappedCommunicator) {
  Ranks r = Make();
  std::vector<std::shared_ptr<Communicator>> pairs(kRanks), dups(kRanks);
  testing::RunRankThreads(kRanks, [&](int i) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    // Ranks 0 and 1 form a group; rank 2 joins none.
    auto split = r.comms[i]->Split(i < 2 ? 0 : -1, i, deadline);
    ASSERT_TRUE(split.ok()) << split.status();
    pairs[i] = *split;
    auto dup = r.comms[i]->Dup(deadline);
    ASSERT_TRUE(dup.ok()) << dup.status();
    dups[i] = *dup;
  });
  ASSERT_EQ(pairs[2], nullptr);
  ASSERT_NE(pairs[0], nullptr);
  EXPECT_EQ(pairs[0]->size(), 2);
  EXPECT_EQ(pairs[1]->rank(), 1);
  EXPECT_EQ(dups[2]->size(), kRanks);
  for (int i = 0; i < kRanks; ++i) r.counters[i]->Reset();
  std::vector<float> in = {1.5f, 2.5f, 3.0f}, out0(6), out1(6);
  std::vector<float> in1 = {4.0f, 5.0f, 6.0f};
  ASSERT_TRUE(pairs[0]->AllGather(in.data(), out0.data(), 3, DType::kF32, *r.streams[0]).ok());
  ASSERT_TRUE(pairs[1]->AllGather(in1.data(), out1.data(), 3, DType::kF32, *r.streams[1]).ok());
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(r.streams[i]->Synchronize(absl::Now() + absl::Seconds(30)).ok());
  }
  EXPECT_EQ(out0, (std::vector<float>{1.5f, 2.5f, 3.0f, 4.0f, 5.0f, 6.0f}));
  EXPECT_EQ(out1, out0);
  const auto totals = r.counters[0]->Totals();
  ASSERT_EQ(totals.size(), 1u);
  EXPECT_EQ(totals.begin()->first.size, 2);
  EXPECT_EQ(totals.begin()->first.communicator, pairs[0]->name());
  EXPECT_EQ(totals.begin()->second.payload_bytes, 24u);
  EXPECT_TRUE(r.counters[2]->Totals().empty());

  // A bad call is the API's error, not counted.
  float x = 0;
  absl::StatusOr<Work> bad =
      dups[0]->AllReduce(&x, &x, 1, DType::kU8, *r.streams[0], {.op = ReduceOp::kSum});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.counters[0]->Sum(CollectiveKind::kAllReduce).calls, 0u);

  // Aborting the wrapper aborts the communicator it wraps.
  r.comms[2]->Abort(absl::UnavailableError("test abort"));
  EXPECT_TRUE(absl::StrContains(r.inner[2]->status().message(), "test abort"))
      << r.inner[2]->status();
}

}  // namespace
}  // namespace shardline
