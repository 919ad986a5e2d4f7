// The Communicator API over the local backend (ranks as threads): every collective, dtype and
// count against plain-loop references, in place and out of place, for world sizes 1 to 8;
// validation; mismatches, missing ranks and aborts fail on every rank instead of hanging.
#include "collectives/local/local_communicator.h"

#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "runtime/check.h"
#include "runtime/stream.h"
#include "tests/common/typed_values.h"

namespace shardline {
namespace {

using ::shardline::testing::GetElement;
using ::shardline::testing::PatternBuffer;
using ::shardline::testing::PatternValue;
using ::shardline::testing::ReferenceReduce;
using ::shardline::testing::SetElement;
using ::shardline::testing::Tolerance;

using Comms = std::vector<std::shared_ptr<Communicator>>;
using RankFn = std::function<void(int rank, Communicator& comm, Stream& stream)>;

constexpr DType kReduceDTypes[] = {DType::kF32,  DType::kF64, DType::kF16,
                                   DType::kBF16, DType::kI32, DType::kI64};
constexpr size_t kCounts[] = {0, 1, 7, 4097};

Comms MakeComms(int size, absl::Duration timeout = absl::Seconds(30)) {
  absl::StatusOr<Comms> comms = CreateLocalCommunicators(size, {.timeout = timeout});
  SL_CHECK_OK(comms.status());
  return *std::move(comms);
}

// Runs fn on one thread per rank, each with its own host stream.
void RunRanks(const Comms& comms, const RankFn& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < static_cast<int>(comms.size()); ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<Stream>> stream =
          CreateHostStream({.name = absl::StrCat("comm", r)});
      ASSERT_TRUE(stream.ok()) << stream.status();
      fn(r, *comms[r], **stream);
    });
  }
  for (std::thread& t : threads) t.join();
}

absl::Status WaitFor(const absl::StatusOr<Work>& work) {
  if (!work.ok()) return work.status();
  return work->Wait(absl::Now() + absl::Seconds(60));
}

class LocalCollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(LocalCollectivesTest, AllGather) {
  const int n = GetParam();
  Comms comms = MakeComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    for (DType dtype : kAllDTypes) {
      for (size_t count : kCounts) {
        for (bool in_place : {false, true}) {
          const size_t e = DTypeSize(dtype);
          std::vector<uint8_t> input = PatternBuffer(dtype, r, count);
          std::vector<uint8_t> output(n * count * e, 0xAB);
          const void* in = input.data();
          if (in_place) {
            std::copy(input.begin(), input.end(), output.begin() + r * count * e);
            in = output.data() + r * count * e;
          }
          ASSERT_TRUE(WaitFor(comm.AllGather(in, output.data(), count, dtype, stream)).ok());
          for (int s = 0; s < n; ++s) {
            for (size_t i = 0; i < count; ++i) {
              ASSERT_EQ(GetElement(dtype, output.data(), s * count + i), PatternValue(dtype, s, i))
                  << dtype << " count " << count << " in_place " << in_place << " from " << s;
            }
          }
        }
      }
    }
  });
}

TEST_P(LocalCollectivesTest, ReduceScatter) {
  const int n = GetParam();
  Comms comms = MakeComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    for (DType dtype : kReduceDTypes) {
      for (ReduceOp op : kAllReduceOps) {
        for (size_t count : kCounts) {
          for (bool in_place : {false, true}) {
            const size_t e = DTypeSize(dtype);
            std::vector<uint8_t> input = PatternBuffer(dtype, r, n * count);
            std::vector<uint8_t> separate(count * e);
            void* out = in_place ? input.data() + r * count * e : separate.data();
            ASSERT_TRUE(
                WaitFor(comm.ReduceScatter(input.data(), out, count, dtype, stream, {.op = op}))
                    .ok());
            for (size_t i = 0; i < count; ++i) {
              ASSERT_NEAR(GetElement(dtype, out, i), ReferenceReduce(dtype, op, n, r * count + i),
                          Tolerance(dtype, op))
                  << dtype << " " << op << " count " << count << " in_place " << in_place;
            }
          }
        }
      }
    }
  });
}

TEST_P(LocalCollectivesTest, AllReduce) {
  const int n = GetParam();
  Comms comms = MakeComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    for (DType dtype : kReduceDTypes) {
      for (ReduceOp op : kAllReduceOps) {
        for (size_t count : kCounts) {
          for (bool in_place : {false, true}) {
            std::vector<uint8_t> input = PatternBuffer(dtype, r, count);
            std::vector<uint8_t> separate(input.size());
            void* out = in_place ? input.data() : separate.data();
            ASSERT_TRUE(
                WaitFor(comm.AllReduce(input.data(), out, count, dtype, stream, {.op = op})).ok());
            for (size_t i = 0; i < count; ++i) {
              ASSERT_NEAR(GetElement(dtype, out, i), ReferenceReduce(dtype, op, n, i),
                          Tolerance(dtype, op))
                  << dtype << " " << op << " count " << count << " in_place " << in_place;
            }
          }
        }
      }
    }
  });
}

TEST_P(LocalCollectivesTest, BroadcastFromEveryRoot) {
  const int n = GetParam();
  Comms comms = MakeComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    for (DType dtype : kAllDTypes) {
      for (size_t count : kCounts) {
        for (int root = 0; root < n; ++root) {
          std::vector<uint8_t> buffer = PatternBuffer(dtype, r, count, /*salt=*/root);
          ASSERT_TRUE(
              WaitFor(comm.Broadcast(buffer.data(), count, dtype, stream, {.root = root})).ok());
          for (size_t i = 0; i < count; ++i) {
            ASSERT_EQ(GetElement(dtype, buffer.data(), i), PatternValue(dtype, root, i, root));
          }
        }
      }
    }
  });
}

TEST_P(LocalCollectivesTest, AllToAll) {
  const int n = GetParam();
  Comms comms = MakeComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    for (DType dtype : kAllDTypes) {
      for (size_t count : kCounts) {
        std::vector<uint8_t> input = PatternBuffer(dtype, r, n * count);
        std::vector<uint8_t> output(input.size());
        ASSERT_TRUE(WaitFor(comm.AllToAll(input.data(), output.data(), count, dtype, stream)).ok());
        for (int s = 0; s < n; ++s) {
          for (size_t i = 0; i < count; ++i) {
            ASSERT_EQ(GetElement(dtype, output.data(), s * count + i),
                      PatternValue(dtype, s, r * count + i));
          }
        }
      }
    }
  });
}

TEST_P(LocalCollectivesTest, SplitIntoReversedHalves) {
  const int n = GetParam();
  Comms comms = MakeComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    // Even and odd ranks, ordered by descending rank; rank 1 opts out when n > 2.
    const int color = (n > 2 && r == 1) ? -1 : r % 2;
    absl::StatusOr<std::shared_ptr<Communicator>> sub =
        comm.Split(color, /*key=*/-r, absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(sub.ok()) << sub.status();
    if (color < 0) {
      EXPECT_EQ(*sub, nullptr);
      ASSERT_TRUE(WaitFor(comm.Barrier(stream)).ok());  // still a member of the parent
      return;
    }
    std::vector<int> members;
    for (int s = n - 1; s >= 0; --s) {
      if (s % 2 == color && !(n > 2 && s == 1)) members.push_back(s);
    }
    ASSERT_EQ((*sub)->size(), static_cast<int>(members.size()));
    EXPECT_EQ(members[(*sub)->rank()], r);
    // The new group gathers parent ranks in its own order.
    int32_t mine = r;
    std::vector<int32_t> gathered(members.size());
    ASSERT_TRUE(WaitFor((*sub)->AllGather(&mine, gathered.data(), 1, DType::kI32, stream)).ok());
    EXPECT_EQ(gathered, std::vector<int32_t>(members.begin(), members.end()));
    // And it still works after the parent issues more collectives.
    ASSERT_TRUE(WaitFor(comm.Barrier(stream)).ok());
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, LocalCollectivesTest, ::testing::Values(1, 2, 3, 4, 5, 8),
                         [](const auto& info) { return absl::StrCat("n", info.param); });

TEST(LocalCollectivesLargeTest, OddMegaElementBuffers) {
  const int n = 3;
  const size_t count = (1 << 20) + 3;
  Comms comms = MakeComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    std::vector<uint8_t> input = PatternBuffer(DType::kF32, r, n * count);
    std::vector<uint8_t> output(input.size());
    ASSERT_TRUE(
        WaitFor(comm.AllReduce(input.data(), output.data(), n * count, DType::kF32, stream)).ok());
    for (size_t i = 0; i < n * count; i += 997) {
      ASSERT_EQ(GetElement(DType::kF32, output.data(), i),
                ReferenceReduce(DType::kF32, ReduceOp::kSum, n, i));
    }
    ASSERT_TRUE(WaitFor(comm.ReduceScatter(input.data(), input.data() + r * count * 4, count,
                                           DType::kF32, stream))
                    .ok());
    for (size_t i = 0; i < count; i += 991) {
      ASSERT_EQ(GetElement(DType::kF32, input.data() + r * count * 4, i),
                ReferenceReduce(DType::kF32, ReduceOp::kSum, n, r * count + i));
    }
  });
}

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

TEST(LocalCommunicatorTest, MismatchedCountsFailOnEveryRankNamingBoth) {
  const int n = 4;
  Comms comms = MakeComms(n);
  std::vector<absl::Status> results(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    const size_t count = r == 2 ? 8 : 7;
    std::vector<float> in(8), out(8 * n, -1.0f);
    results[r] = WaitFor(comm.AllGather(in.data(), out.data(), count, DType::kF32, stream));
    EXPECT_EQ(out[0], -1.0f) << "no data may be written on a mismatch";
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(results[r].code(), absl::StatusCode::kInvalidArgument) << results[r];
    EXPECT_TRUE(absl::StrContains(results[r].message(),
                                  "rank 0 called all_gather(count=7, f32) but rank 2 called "
                                  "all_gather(count=8, f32)"))
        << results[r];
  }
}

TEST(LocalCommunicatorTest, MismatchedDTypesAndOpsFail) {
  const int n = 3;
  Comms comms = MakeComms(n);
  std::vector<absl::Status> results(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    std::vector<double> buffer(4);
    const DType dtype = r == 1 ? DType::kI64 : DType::kF64;  // same size, different meaning
    results[r] = WaitFor(comm.AllReduce(buffer.data(), buffer.data(), 4, dtype, stream));
  });
  for (const absl::Status& status : results) {
    EXPECT_TRUE(absl::StrContains(status.message(), "but rank 1 called all_reduce(count=4, i64"))
        << status;
  }
}

TEST(LocalCommunicatorTest, MissingRankIsADeadlineErrorNamingIt) {
  const int n = 3;
  Comms comms = MakeComms(n, absl::Milliseconds(300));
  std::vector<absl::Status> results(n);
  const absl::Time start = absl::Now();
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    if (r == 2) return;  // never shows up
    std::vector<float> buffer(4);
    results[r] = WaitFor(comm.AllReduce(buffer.data(), buffer.data(), 4, DType::kF32, stream));
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].code(), absl::StatusCode::kDeadlineExceeded) << results[r];
    EXPECT_TRUE(absl::StrContains(results[r].message(), "waiting for rank(s) 2")) << results[r];
  }
  // The communicator is now aborted: later collectives fail at once.
  auto stream = *CreateHostStream({});
  EXPECT_FALSE(comms[0]->Barrier(*stream).ok());
}

TEST(LocalCommunicatorTest, AbortWakesEveryRank) {
  const int n = 4;
  Comms comms = MakeComms(n, absl::Seconds(60));
  std::vector<absl::Status> results(n);
  const absl::Time start = absl::Now();
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    if (r == 3) {
      // Dies before the collective: its abort must reach the peers blocked in it.
      comm.Abort(absl::UnavailableError("rank 3 lost its process"));
      return;
    }
    std::vector<float> buffer(16);
    results[r] = WaitFor(comm.AllReduce(buffer.data(), buffer.data(), 16, DType::kF32, stream));
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].code(), absl::StatusCode::kUnavailable) << results[r];
    EXPECT_TRUE(absl::StrContains(results[r].message(), "rank 3 lost its process")) << results[r];
  }
}

TEST(LocalCommunicatorTest, WorkHandleSynchronizesAnotherStream) {
  const int n = 2;
  Comms comms = MakeComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    auto consumer = *CreateHostStream({.name = "consumer"});
    std::vector<float> buffer(1024, static_cast<float>(r + 1));
    absl::StatusOr<Work> work =
        comm.AllReduce(buffer.data(), buffer.data(), buffer.size(), DType::kF32, stream);
    ASSERT_TRUE(work.ok());
    ASSERT_TRUE(work->Synchronize(*consumer).ok());
    float seen = 0;
    ASSERT_TRUE(consumer
                    ->Enqueue([&]() -> absl::Status {
                      seen = buffer[1023];
                      return absl::OkStatus();
                    })
                    .ok());
    ASSERT_TRUE(consumer->Synchronize(absl::Now() + absl::Seconds(30)).ok());
    EXPECT_EQ(seen, 3.0f);  // 1 + 2: the consumer ran after the collective
    EXPECT_TRUE(work->IsCompleted());
    EXPECT_TRUE(Work().IsCompleted());
  });
}

TEST(CollectiveFingerprintTest, EncodeDecodeRoundTrip) {
  CollectiveFingerprint fp{
      CollectiveKind::kBroadcast, 1234567890123ull, 4097, DType::kBF16, ReduceOp::kSum, 5};
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
