// Communicator::Shrink with ranks as threads, over the local and the ucx backend: survivors of
// an aborted communicator build one without the lost ranks and run checked collectives on it;
// survivors that disagree on the lost ranks fail at the deadline; bad arguments are named.
// (Shrink after a real SIGKILL, across processes: tests/scripts/multiprocess_test.py.)
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "collectives/local/local_communicator.h"
#include "runtime/check.h"
#include "runtime/stream.h"
#include "tests/collectives/rank_comms.h"
#include "tests/common/rank_threads.h"

namespace shardline {
namespace {

using ::shardline::testing::Comms;
using ::shardline::testing::MakeUcxComms;
using ::shardline::testing::RunRankThreads;
using ::shardline::testing::WaitFor;

// Floats with a full mantissa from a hash of (rank, i, salt) (splitmix64): sums are not exact,
// so a wrong member or order shows.
std::vector<float> HashedFloats(int rank, size_t count, int salt) {
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) {
    uint64_t x = (static_cast<uint64_t>(rank) << 48) ^ (static_cast<uint64_t>(salt) << 40) ^ i;
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    values[i] = static_cast<float>(static_cast<double>(x >> 40) / (1ull << 23) - 1.0);
  }
  return values;
}

Comms MakeLocal(int n) {
  absl::StatusOr<Comms> comms = CreateLocalCommunicators(n, {.timeout = absl::Seconds(30)});
  SL_CHECK_OK(comms.status());
  return *std::move(comms);
}

class ShrinkTest : public ::testing::TestWithParam<const char*> {
 protected:
  Comms Make(int n) { return std::string(GetParam()) == "ucx" ? MakeUcxComms(n) : MakeLocal(n); }
};

// Runs fn(rank) on one thread per listed rank.
template <typename Fn>
void OnThreads(const std::vector<int>& ranks, Fn fn) {
  RunRankThreads(static_cast<int>(ranks.size()), [&](int i) { fn(ranks[i]); });
}

// 5 ranks; ranks 1 and 3 are "lost": they never call anything again, the survivors' world is
// aborted (as a dead peer aborts it). The survivors shrink to 3 ranks, in order, and run an
// all-reduce of hashed floats (compared with a sum in the survivors' order), an all-gather and
// a second shrink of the shrunk communicator.
TEST_P(ShrinkTest, SurvivorsOfAnAbortedCommunicatorRunCollectives) {
  Comms comms = Make(5);
  const std::vector<int> survivors = {0, 2, 4};
  const size_t count = 4099;
  OnThreads(survivors, [&](int r) {
    Communicator& world = *comms[r];
    world.Abort(absl::UnavailableError("peer ranks 1 and 3 died"));
    ASSERT_FALSE(world.status().ok());
    absl::StatusOr<std::shared_ptr<Communicator>> small =
        world.Shrink({3, 1}, absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(small.ok()) << small.status();
    Communicator& comm = **small;
    const int index =
        static_cast<int>(std::find(survivors.begin(), survivors.end(), r) - survivors.begin());
    EXPECT_EQ(comm.size(), 3);
    EXPECT_EQ(comm.rank(), index);
    EXPECT_TRUE(absl::StrContains(comm.name(), "world/shrink0.without_1_3")) << comm.name();
    auto stream = *CreateHostStream({.name = absl::StrCat("s", r)});
    std::vector<float> values = HashedFloats(r, count, 11);
    ASSERT_TRUE(
        WaitFor(comm.AllReduce(values.data(), values.data(), count, DType::kF32, *stream)).ok());
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int s : survivors) want += HashedFloats(s, count, 11)[i];
      ASSERT_NEAR(values[i], want, 1e-5f) << "element " << i;
    }
    std::vector<int32_t> ranks(3, -1);
    const int32_t mine = r;
    ASSERT_TRUE(WaitFor(comm.AllGather(&mine, ranks.data(), 1, DType::kI32, *stream)).ok());
    EXPECT_EQ(ranks, std::vector<int32_t>(survivors.begin(), survivors.end()));
    // Shrinking again (nothing excluded): the same three ranks under a new name.
    absl::StatusOr<std::shared_ptr<Communicator>> again =
        comm.Shrink({}, absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(again.ok()) << again.status();
    int32_t sum = r;
    ASSERT_TRUE(WaitFor((*again)->AllReduce(&sum, &sum, 1, DType::kI32, *stream)).ok());
    EXPECT_EQ(sum, 0 + 2 + 4);
  });
}

// Rank 3 thinks rank 2 died too: it never joins the others' group, and nobody hangs. (ucx
// meets at creation, so Shrink fails; the local backend's groups meet at their first
// collective, so the barrier does.)
TEST_P(ShrinkTest, SurvivorsThatDisagreeFailAtTheDeadline) {
  Comms comms = Make(4);
  OnThreads({0, 2, 3}, [&](int r) {
    std::vector<int> excluded = r == 3 ? std::vector<int>{1, 2} : std::vector<int>{1};
    const absl::Time start = absl::Now();
    absl::StatusOr<std::shared_ptr<Communicator>> small =
        comms[r]->Shrink(excluded, absl::Now() + absl::Seconds(2));
    absl::Status status = small.status();
    if (small.ok()) {
      auto stream = *CreateHostStream({.name = absl::StrCat("s", r)});
      CollectiveOptions options;
      options.timeout = absl::Seconds(2);
      status = WaitFor((*small)->Barrier(*stream, options));
    }
    EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << "rank " << r << ": " << status;
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  });
}

TEST_P(ShrinkTest, BadArgumentsAreNamed) {
  Comms comms = Make(3);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  auto expect = [&](std::vector<int> excluded, absl::string_view needle) {
    absl::Status s = comms[0]->Shrink(excluded, deadline).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), needle)) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "shrinking world (rank 0 of 3)")) << s;
  };
  expect({3}, "excluded rank 3 is not in [0, 3)");
  expect({-1}, "excluded rank -1 is not in [0, 3)");
  expect({1, 1}, "excluded rank 1 is listed twice");
  expect({2, 0}, "rank 0 cannot exclude itself");
}

INSTANTIATE_TEST_SUITE_P(Backends, ShrinkTest, ::testing::Values("local", "ucx"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace shardline
