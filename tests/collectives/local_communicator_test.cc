// The Communicator API over the local backend (ranks as threads): the conformance suite
// (tests/collectives/conformance.h) for world sizes 1 to 8, plus what is local-specific:
// back-to-back barriers, argument validation, the fingerprint encoding.
#include "collectives/local/local_communicator.h"

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "runtime/check.h"
#include "runtime/stream.h"
#include "tests/collectives/conformance.h"
#include "tests/common/sanitizers.h"

namespace shardline {
namespace {

using ::shardline::testing::Comms;
using ::shardline::testing::RunRanks;
using ::shardline::testing::WaitFor;

struct LocalBackend {
  static constexpr const char* kName = "local";
  static constexpr int kWorldSizes[] = {1, 2, 3, 4, 5, 8};
  static Comms Make(int n, absl::Duration timeout) {
    absl::StatusOr<Comms> comms = CreateLocalCommunicators(n, {.timeout = timeout});
    SL_CHECK_OK(comms.status());
    return *std::move(comms);
  }
};

}  // namespace

namespace testing {
INSTANTIATE_TYPED_TEST_SUITE_P(Local, CommunicatorConformanceTest, LocalBackend);
}  // namespace testing

namespace {

Comms MakeComms(int n) { return LocalBackend::Make(n, absl::Seconds(30)); }

// A barrier followed at once by another collective: a fast rank must not post the next
// collective before the slow ones have compared the barrier's fingerprints.
TEST(LocalCommunicatorTest, BackToBackBarriersNeverMismatch) {
  Comms comms = MakeComms(3);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    for (int i = 0; i < 500; ++i) {
      ASSERT_TRUE(comm.Barrier(stream).ok());  // not waited for: the all-reduce follows at once
      int32_t value = r;
      ASSERT_TRUE(WaitFor(comm.AllReduce(&value, &value, 1, DType::kI32, stream)).ok());
      ASSERT_EQ(value, 3);  // 0 + 1 + 2
    }
  });
}

TEST(LocalCommunicatorTest, InvalidArgumentsEnqueueNothing) {
  Comms comms = MakeComms(2);
  Communicator& comm = *comms[0];
  auto stream = *CreateHostStream({});
  std::vector<float> buffer(16);
  auto expect_invalid = [](const absl::StatusOr<Work>& work, absl::string_view needle) {
    ASSERT_FALSE(work.ok());
    EXPECT_EQ(work.status().code(), absl::StatusCode::kInvalidArgument) << work.status();
    EXPECT_TRUE(absl::StrContains(work.status().message(), needle)) << work.status();
  };
  // Overlapping but not the in-place form (rank 0's slice is at offset 0, not 1).
  expect_invalid(comm.AllGather(buffer.data() + 1, buffer.data(), 4, DType::kF32, *stream),
                 "overlap");
  expect_invalid(comm.AllToAll(buffer.data(), buffer.data(), 2, DType::kF32, *stream),
                 "all_to_all has none");
  expect_invalid(comm.AllReduce(nullptr, buffer.data(), 4, DType::kF32, *stream), "input is null");
  expect_invalid(comm.Broadcast(buffer.data(), 4, DType::kF32, *stream, {.root = 2}), "root 2");
  expect_invalid(comm.AllReduce(buffer.data(), buffer.data(), 4, DType::kU8, *stream), "dtype u8");
  expect_invalid(
      comm.AllGather(buffer.data(), buffer.data(), size_t{1} << 62, DType::kF32, *stream),
      "overflows");
  // Nothing was enqueued: the sequence did not advance, the communicator is healthy.
  EXPECT_EQ(comm.next_seq(), 0u);
  EXPECT_TRUE(comm.status().ok());
}

// An all-reduce whose scratch cannot be allocated (a count whose block is 128 PiB; the buffers
// are never touched, since the allocation comes first) fails with ResourceExhausted on every
// rank instead of terminating the process on std::bad_alloc.
TEST(LocalCommunicatorTest, ScratchThatCannotBeAllocatedIsResourceExhaustedOnEveryRank) {
  if (testing::UnderSanitizer()) {
    GTEST_SKIP() << "the sanitizers' allocators report a 2^57-byte request as an error";
  }
  const int n = 2;
  const size_t count = size_t{1} << 56;  // f32: a block of 2^57 bytes per rank
  const void* input = reinterpret_cast<const void*>(uintptr_t{1} << 40);
  void* output = reinterpret_cast<void*>(uintptr_t{1} << 62);
  std::vector<absl::Status> statuses(n);
  RunRanks(MakeComms(n), [&](int r, Communicator& comm, Stream& stream) {
    statuses[r] = WaitFor(comm.AllReduce(input, output, count, DType::kF32, stream));
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(absl::IsResourceExhausted(statuses[r])) << "rank " << r << ": " << statuses[r];
    EXPECT_TRUE(absl::StrContains(statuses[r].message(),
                                  "cannot allocate the 144115188075855872 bytes of the "
                                  "reduction's scratch"))
        << "rank " << r << ": " << statuses[r];
  }
}

// A wait that gives up says which collective is late, in what state, and whom it waits for; the
// handle's Abort(reason) fails it with that reason.
TEST(LocalCommunicatorTest, WaitTimeoutNamesTheCollectiveAndAbortTakesAReason) {
  Comms comms = MakeComms(2);
  auto stream = *CreateHostStream({.name = "s0"});
  float value = 1;
  absl::StatusOr<Work> reduce = comms[0]->AllReduce(&value, &value, 1, DType::kF32, *stream);
  absl::StatusOr<Work> barrier = comms[0]->Barrier(*stream);
  ASSERT_TRUE(reduce.ok() && barrier.ok());
  absl::Status late = reduce->Wait(absl::Now() + absl::Milliseconds(100));
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  EXPECT_TRUE(absl::StartsWith(late.message(),
                               "all_reduce #0 on world (rank 0 of 2, local): not finished after "
                               "waiting "))
      << late;
  EXPECT_TRUE(absl::StrContains(late.message(), ": running for ")) << late;
  EXPECT_TRUE(absl::EndsWith(late.message(), ", waiting for rank(s) 1")) << late;
  EXPECT_FALSE(IsPeerError(late)) << late;  // the wait gave up; the collective did not fail
  absl::Status queued = barrier->Wait(absl::Now());
  EXPECT_TRUE(absl::StrContains(queued.message(),
                                "barrier #1 on world (rank 0 of 2, local): not finished after "
                                "waiting "))
      << queued;
  EXPECT_TRUE(absl::EndsWith(queued.message(),
                             ": still queued on stream 's0', behind all_reduce #0 (running)"))
      << queued;

  reduce->Abort(absl::CancelledError("giving up"));
  absl::Status aborted = reduce->Wait(absl::Now() + absl::Seconds(30));
  EXPECT_EQ(aborted.code(), absl::StatusCode::kCancelled) << aborted;
  EXPECT_TRUE(absl::StrContains(aborted.message(), "giving up")) << aborted;
  EXPECT_EQ(barrier->Wait(absl::Now() + absl::Seconds(30)).code(), absl::StatusCode::kCancelled);
}

TEST(CollectiveFingerprintTest, EncodeDecodeRoundTrip) {
  CollectiveFingerprint fp{
      CollectiveKind::kBroadcast, 1234567890123ull, 4097, DType::kBF16, ReduceOp::kSum, 5,
      0x0123456789abcdefull};
  uint8_t bytes[CollectiveFingerprint::kEncodedSize];
  fp.Encode(bytes);
  absl::StatusOr<CollectiveFingerprint> back = CollectiveFingerprint::Decode(bytes);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, fp);
  EXPECT_EQ(fp.CallString(), "broadcast(count=4097, bf16, root=5)");
  bytes[0] = 200;
  EXPECT_FALSE(CollectiveFingerprint::Decode(bytes).ok());
}

}  // namespace
}  // namespace shardline
