// File: tests/collectives/conformance.h
// -----------------------------------------------------------------------------
// The Communicator contract, as one typed gtest suite that every backend's test file
// instantiates with ranks as threads of the test process: every collective, dtype, reduce op and
// count (on both sides of the small-message threshold) against plain-loop references, in place
// and out of place; splits; mismatches that write nothing and fail on every rank naming both
// ranks; a missing rank (DeadlineExceeded naming it); an abort that reaches peers blocked in a
// collective; Work handles that order another stream.
//
//   struct UcxBackend {
//     static constexpr const char* kName = "ucx";                 // Communicator::backend()
//     static constexpr int kWorldSizes[] = {1, 2, 3, 4};
//     static Comms Make(int n, absl::Duration timeout);          // the n ranks' communicators
//   };
//   INSTANTIATE_TYPED_TEST_SUITE_P(Ucx, CommunicatorConformanceTest, UcxBackend);
//
// Include it from exactly one .cc of a test binary (it defines the tests).

#ifndef SHARDLINE_TESTS_COLLECTIVES_CONFORMANCE_H_
#define SHARDLINE_TESTS_COLLECTIVES_CONFORMANCE_H_

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "runtime/stream.h"
#include "testing/typed_values.h"

namespace shardline::testing {

using Comms = std::vector<std::shared_ptr<Communicator>>;
using RankFn = std::function<void(int rank, Communicator& comm, Stream& stream)>;

inline constexpr DType kReduceDTypes[] = {DType::kF32,  DType::kF64, DType::kF16,
                                          DType::kBF16, DType::kI32, DType::kI64};
// 4097 elements of 4 or 8 bytes exceed the ucx backend's small-message threshold.
inline constexpr size_t kCounts[] = {0, 1, 7, 4097};

// Runs fn on one thread per rank, each with its own host stream.
inline void RunRanks(const Comms& comms, const RankFn& fn) {
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

inline absl::Status WaitFor(const absl::StatusOr<Work>& work) {
  if (!work.ok()) return work.status();
  return work->Wait(absl::Now() + absl::Seconds(60));
}

template <typename Backend>
class CommunicatorConformanceTest : public ::testing::Test {
 protected:
  static Comms Make(int n, absl::Duration timeout = absl::Seconds(30)) {
    return Backend::Make(n, timeout);
  }
  // Runs `body(n)` for every world size of the backend.
  template <typename Body>
  static void ForEachWorldSize(Body body) {
    for (int n : Backend::kWorldSizes) {
      SCOPED_TRACE(absl::StrCat(Backend::kName, ", world size ", n));
      body(n);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
};

TYPED_TEST_SUITE_P(CommunicatorConformanceTest);

TYPED_TEST_P(CommunicatorConformanceTest, AllGather) {
  this->ForEachWorldSize([&](int n) {
    RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
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
            absl::Status status = WaitFor(comm.AllGather(in, output.data(), count, dtype, stream));
            ASSERT_TRUE(status.ok()) << status;
            for (int s = 0; s < n; ++s) {
              for (size_t i = 0; i < count; ++i) {
                ASSERT_EQ(GetElement(dtype, output.data(), s * count + i),
                          PatternValue(dtype, s, i))
                    << dtype << " count " << count << " in_place " << in_place << " from " << s;
              }
            }
          }
        }
      }
    });
  });
}

TYPED_TEST_P(CommunicatorConformanceTest, ReduceScatter) {
  this->ForEachWorldSize([&](int n) {
    RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
      for (DType dtype : kReduceDTypes) {
        for (ReduceOp op : kAllReduceOps) {
          for (size_t count : kCounts) {
            for (bool in_place : {false, true}) {
              const size_t e = DTypeSize(dtype);
              std::vector<uint8_t> input = PatternBuffer(dtype, r, n * count);
              std::vector<uint8_t> separate(count * e);
              void* out = in_place ? input.data() + r * count * e : separate.data();
              absl::Status status =
                  WaitFor(comm.ReduceScatter(input.data(), out, count, dtype, stream, {.op = op}));
              ASSERT_TRUE(status.ok()) << status;
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
  });
}

TYPED_TEST_P(CommunicatorConformanceTest, AllReduce) {
  this->ForEachWorldSize([&](int n) {
    RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
      for (DType dtype : kReduceDTypes) {
        for (ReduceOp op : kAllReduceOps) {
          for (size_t count : kCounts) {
            for (bool in_place : {false, true}) {
              std::vector<uint8_t> input = PatternBuffer(dtype, r, count);
              std::vector<uint8_t> separate(input.size());
              void* out = in_place ? input.data() : separate.data();
              absl::Status status =
                  WaitFor(comm.AllReduce(input.data(), out, count, dtype, stream, {.op = op}));
              ASSERT_TRUE(status.ok()) << status;
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
  });
}

TYPED_TEST_P(CommunicatorConformanceTest, BroadcastFromEveryRoot) {
  this->ForEachWorldSize([&](int n) {
    RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
      for (DType dtype : kAllDTypes) {
        for (size_t count : kCounts) {
          for (int root = 0; root < n; ++root) {
            std::vector<uint8_t> buffer = PatternBuffer(dtype, r, count, /*salt=*/root);
            absl::Status status =
                WaitFor(comm.Broadcast(buffer.data(), count, dtype, stream, {.root = root}));
            ASSERT_TRUE(status.ok()) << status;
            for (size_t i = 0; i < count; ++i) {
              ASSERT_EQ(GetElement(dtype, buffer.data(), i), PatternValue(dtype, root, i, root))
                  << dtype << " count " << count << " root " << root;
            }
          }
        }
      }
    });
  });
}

TYPED_TEST_P(CommunicatorConformanceTest, AllToAll) {
  this->ForEachWorldSize([&](int n) {
    RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
      for (DType dtype : kAllDTypes) {
        for (size_t count : kCounts) {
          std::vector<uint8_t> input = PatternBuffer(dtype, r, n * count);
          std::vector<uint8_t> output(input.size());
          absl::Status status =
              WaitFor(comm.AllToAll(input.data(), output.data(), count, dtype, stream));
          ASSERT_TRUE(status.ok()) << status;
          for (int s = 0; s < n; ++s) {
            for (size_t i = 0; i < count; ++i) {
              ASSERT_EQ(GetElement(dtype, output.data(), s * count + i),
                        PatternValue(dtype, s, r * count + i))
                  << dtype << " count " << count << " from " << s;
            }
          }
        }
      }
      ASSERT_TRUE(WaitFor(comm.Barrier(stream)).ok());
    });
  });
}

// Even ranks and odd ranks form two groups ordered by descending parent rank; with more than two
// ranks, rank 1 opts out. Parent and child collectives interleave without crossing.
TYPED_TEST_P(CommunicatorConformanceTest, SplitIntoReversedHalves) {
  this->ForEachWorldSize([&](int n) {
    RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
      const int color = (n > 2 && r == 1) ? -1 : r % 2;
      absl::StatusOr<std::shared_ptr<Communicator>> sub =
          comm.Split(color, /*key=*/-r, absl::Now() + absl::Seconds(30));
      ASSERT_TRUE(sub.ok()) << sub.status();
      if (color < 0) {
        EXPECT_EQ(*sub, nullptr);
        ASSERT_TRUE(WaitFor(comm.Barrier(stream)).ok());
        return;
      }
      std::vector<int> members;
      for (int s = n - 1; s >= 0; --s) {
        if (s % 2 == color && !(n > 2 && s == 1)) members.push_back(s);
      }
      ASSERT_EQ((*sub)->size(), static_cast<int>(members.size()));
      EXPECT_EQ(members[(*sub)->rank()], r);
      EXPECT_EQ((*sub)->backend(), TypeParam::kName);
      int32_t mine = r;
      std::vector<int32_t> gathered(members.size());
      ASSERT_TRUE(WaitFor((*sub)->AllGather(&mine, gathered.data(), 1, DType::kI32, stream)).ok());
      EXPECT_EQ(gathered, std::vector<int32_t>(members.begin(), members.end()));
      ASSERT_TRUE(WaitFor(comm.Barrier(stream)).ok());
      std::vector<float> sum(5000, 1.0f);
      ASSERT_TRUE(
          WaitFor((*sub)->AllReduce(sum.data(), sum.data(), sum.size(), DType::kF32, stream)).ok());
      EXPECT_EQ(sum[4999], static_cast<float>(members.size()));
    });
  });
}

// Several pipeline chunks per block with a ragged last one: all-reduce, an in-place max
// reduce-scatter, and an in-place all-gather of its shards.
TYPED_TEST_P(CommunicatorConformanceTest, OddMegaElementBuffers) {
  const int n = 3;
  const size_t count = (1 << 20) + 3;
  RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
    std::vector<uint8_t> input = PatternBuffer(DType::kF32, r, n * count);
    std::vector<uint8_t> output(input.size());
    ASSERT_TRUE(
        WaitFor(comm.AllReduce(input.data(), output.data(), n * count, DType::kF32, stream)).ok());
    for (size_t i = 0; i < n * count; i += 997) {
      ASSERT_EQ(GetElement(DType::kF32, output.data(), i),
                ReferenceReduce(DType::kF32, ReduceOp::kSum, n, i));
    }
    uint8_t* shard = input.data() + r * count * 4;
    ASSERT_TRUE(WaitFor(comm.ReduceScatter(input.data(), shard, count, DType::kF32, stream,
                                           {.op = ReduceOp::kMax}))
                    .ok());
    for (size_t i = 0; i < count; i += 991) {
      ASSERT_EQ(GetElement(DType::kF32, shard, i),
                ReferenceReduce(DType::kF32, ReduceOp::kMax, n, r * count + i));
    }
    std::vector<uint8_t> gathered(n * count * 4);
    std::copy(shard, shard + count * 4, gathered.begin() + r * count * 4);
    ASSERT_TRUE(WaitFor(comm.AllGather(gathered.data() + r * count * 4, gathered.data(), count,
                                       DType::kF32, stream))
                    .ok());
    for (size_t i = 0; i < n * count; i += 1009) {
      ASSERT_EQ(GetElement(DType::kF32, gathered.data(), i),
                ReferenceReduce(DType::kF32, ReduceOp::kMax, n, i));
    }
  });
}

TYPED_TEST_P(CommunicatorConformanceTest, MismatchedCountsFailOnEveryRankNamingBoth) {
  const int n = 4;
  std::vector<absl::Status> results(n);
  RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
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

// One rank's count is large (the ucx backend's zero-copy path), the others' small: nothing may
// be written and nothing truncated into user memory.
TYPED_TEST_P(CommunicatorConformanceTest, MismatchedSmallAndLargeCountsWriteNothing) {
  const int n = 3;
  std::vector<absl::Status> results(n);
  RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
    const size_t count = r == 1 ? 100000 : 5;
    std::vector<float> in(100000, 2.0f), out(100000 * n, -1.0f);
    results[r] = WaitFor(comm.AllGather(in.data(), out.data(), count, DType::kF32, stream));
    for (size_t i = 0; i < out.size(); i += 4999) ASSERT_EQ(out[i], -1.0f);
  });
  for (const absl::Status& status : results) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), "but rank 1 called all_gather(count=100000"))
        << status;
  }
}

TYPED_TEST_P(CommunicatorConformanceTest, MismatchedDTypesAndKindsFail) {
  const int n = 3;
  std::vector<absl::Status> results(n);
  RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
    std::vector<double> buffer(4);
    const DType dtype = r == 1 ? DType::kI64 : DType::kF64;  // same size, different meaning
    results[r] = WaitFor(comm.AllReduce(buffer.data(), buffer.data(), 4, dtype, stream));
  });
  for (const absl::Status& status : results) {
    EXPECT_TRUE(absl::StrContains(status.message(), "but rank 1 called all_reduce(count=4, i64"))
        << status;
  }
  // Kinds: rank 0 broadcasts while rank 1 enters a barrier.
  std::vector<absl::Status> kinds(2);
  RunRanks(this->Make(2), [&](int r, Communicator& comm, Stream& stream) {
    float x = 1;
    kinds[r] = r == 0 ? WaitFor(comm.Broadcast(&x, 1, DType::kF32, stream))
                      : WaitFor(comm.Barrier(stream));
  });
  for (const absl::Status& status : kinds) {
    EXPECT_TRUE(absl::StrContains(status.message(),
                                  "rank 0 called broadcast(count=1, f32, "
                                  "root=0) but rank 1 called barrier()"))
        << status;
  }
}

TYPED_TEST_P(CommunicatorConformanceTest, MissingRankIsADeadlineErrorNamingIt) {
  const int n = 3;
  Comms comms = this->Make(n, absl::Milliseconds(400));
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
  // The communicator is aborted now: later collectives fail at once.
  auto stream = *CreateHostStream({});
  EXPECT_FALSE(comms[0]->Barrier(*stream).ok());
}

TYPED_TEST_P(CommunicatorConformanceTest, AbortReachesPeersBlockedInACollective) {
  const int n = 4;
  std::vector<absl::Status> results(n);
  const absl::Time start = absl::Now();
  RunRanks(this->Make(n, absl::Seconds(60)), [&](int r, Communicator& comm, Stream& stream) {
    if (r == 3) {
      absl::SleepFor(absl::Milliseconds(50));  // a delay to create, not an event to wait for
      comm.Abort(absl::UnavailableError("rank 3 lost its process"));
      return;
    }
    std::vector<float> buffer(100000);
    results[r] =
        WaitFor(comm.AllReduce(buffer.data(), buffer.data(), buffer.size(), DType::kF32, stream));
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].code(), absl::StatusCode::kUnavailable) << results[r];
    EXPECT_TRUE(absl::StrContains(results[r].message(), "rank 3 lost its process")) << results[r];
  }
}

TYPED_TEST_P(CommunicatorConformanceTest, WorkHandleSynchronizesAnotherStream) {
  RunRanks(this->Make(2), [&](int r, Communicator& comm, Stream& stream) {
    auto consumer = *CreateHostStream({.name = "consumer"});
    std::vector<float> buffer(1 << 16, static_cast<float>(r + 1));
    absl::StatusOr<Work> work =
        comm.AllReduce(buffer.data(), buffer.data(), buffer.size(), DType::kF32, stream);
    ASSERT_TRUE(work.ok());
    ASSERT_TRUE(work->Synchronize(*consumer).ok());
    float seen = 0;
    ASSERT_TRUE(consumer
                    ->Enqueue([&]() -> absl::Status {
                      seen = buffer.back();
                      return absl::OkStatus();
                    })
                    .ok());
    ASSERT_TRUE(consumer->Synchronize(absl::Now() + absl::Seconds(30)).ok());
    EXPECT_EQ(seen, 3.0f);  // 1 + 2: the consumer ran after the collective
    EXPECT_TRUE(work->IsCompleted());
    EXPECT_TRUE(Work().IsCompleted());
  });
}

REGISTER_TYPED_TEST_SUITE_P(CommunicatorConformanceTest, AllGather, ReduceScatter, AllReduce,
                            BroadcastFromEveryRoot, AllToAll, SplitIntoReversedHalves,
                            OddMegaElementBuffers, MismatchedCountsFailOnEveryRankNamingBoth,
                            MismatchedSmallAndLargeCountsWriteNothing, MismatchedDTypesAndKindsFail,
                            MissingRankIsADeadlineErrorNamingIt,
                            AbortReachesPeersBlockedInACollective,
                            WorkHandleSynchronizesAnotherStream);

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_COLLECTIVES_CONFORMANCE_H_
