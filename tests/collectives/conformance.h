// File: tests/collectives/conformance.h
// -----------------------------------------------------------------------------
// The Communicator contract, as one typed gtest suite that every backend's test file
// instantiates with ranks as threads of the test process: every collective, dtype, reduce op and
// count (on both sides of the small-message threshold) against plain-loop references, in place
// and out of place; splits; mismatches that write nothing and fail on every rank naming both
// ranks; a missing rank (DeadlineExceeded naming it); an abort that reaches peers blocked in a
// collective; Work handles that order another stream; collectives issued on two streams (and
// from two threads) in issue order; a collective dropped by a poisoned stream failing every rank
// at once; Dup; peer errors told apart from local ones.
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

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "runtime/stream.h"
#include "testing/typed_values.h"
#include "tests/collectives/rank_comms.h"
#include "tests/common/gate.h"

namespace shardline::testing {

inline constexpr DType kReduceDTypes[] = {DType::kF32,  DType::kF64, DType::kF16,
                                          DType::kBF16, DType::kI32, DType::kI64};
// 4097 elements of 4 or 8 bytes exceed the ucx backend's small-message threshold.
inline constexpr size_t kCounts[] = {0, 1, 7, 4097};

// A float in [-1, 1) with a full mantissa, from a hash of (rank, i, salt): no period, and sums
// of them are not exact, so a misplaced block or a wrong reduction order shows.
inline float HashedFloat(int rank, size_t i, int salt = 0) {
  uint64_t x = (static_cast<uint64_t>(rank) << 48) ^ (static_cast<uint64_t>(salt) << 40) ^ i;
  x += 0x9E3779B97F4A7C15ull;  // splitmix64
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<float>(static_cast<double>(x >> 40) / static_cast<double>(1ull << 23) - 1.0);
}

inline std::vector<float> HashedFloats(int rank, size_t count, int salt = 0) {
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) values[i] = HashedFloat(rank, i, salt);
  return values;
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
          if (!PatternReductionFits(dtype, op, n)) continue;
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
                const double want = ReferenceReduce(dtype, op, n, r * count + i);
                ASSERT_NEAR(GetElement(dtype, out, i), want, Tolerance(dtype, op, want))
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
          if (!PatternReductionFits(dtype, op, n)) continue;
          for (size_t count : kCounts) {
            for (bool in_place : {false, true}) {
              std::vector<uint8_t> input = PatternBuffer(dtype, r, count);
              std::vector<uint8_t> separate(input.size());
              void* out = in_place ? input.data() : separate.data();
              absl::Status status =
                  WaitFor(comm.AllReduce(input.data(), out, count, dtype, stream, {.op = op}));
              ASSERT_TRUE(status.ok()) << status;
              for (size_t i = 0; i < count; ++i) {
                const double want = ReferenceReduce(dtype, op, n, i);
                ASSERT_NEAR(GetElement(dtype, out, i), want, Tolerance(dtype, op, want))
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
// Large odd buffers: the pipelined paths with ragged last chunks. Hashed floats, every element
// checked (the ragged tails included): sums against a double reference, max and the gather
// exactly.
TYPED_TEST_P(CommunicatorConformanceTest, OddMegaElementBuffers) {
  const int n = 3;
  const size_t count = (1 << 20) + 3;
  RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
    std::vector<float> input = HashedFloats(r, n * count, /*salt=*/11);
    std::vector<float> output(input.size());
    ASSERT_TRUE(
        WaitFor(comm.AllReduce(input.data(), output.data(), n * count, DType::kF32, stream)).ok());
    for (size_t i = 0; i < n * count; ++i) {
      double want = 0;
      for (int s = 0; s < n; ++s) want += HashedFloat(s, i, 11);
      ASSERT_NEAR(output[i], want, 1e-5) << i;
    }
    float* shard = input.data() + r * count;
    ASSERT_TRUE(WaitFor(comm.ReduceScatter(input.data(), shard, count, DType::kF32, stream,
                                           {.op = ReduceOp::kMax}))
                    .ok());
    auto max_of = [&](size_t i) {
      float m = HashedFloat(0, i, 11);
      for (int s = 1; s < n; ++s) m = std::max(m, HashedFloat(s, i, 11));
      return m;
    };
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(shard[i], max_of(r * count + i)) << i;
    std::vector<float> gathered(n * count);
    std::copy(shard, shard + count, gathered.begin() + r * count);
    ASSERT_TRUE(WaitFor(comm.AllGather(gathered.data() + r * count, gathered.data(), count,
                                       DType::kF32, stream))
                    .ok());
    for (size_t i = 0; i < n * count; ++i) ASSERT_EQ(gathered[i], max_of(i)) << i;
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

// Counts and dtypes agree but the keys differ (ranks gathering different units of one size): a
// mismatch on every rank, nothing written, each key named by the tag its rank issued it with
// (every rank has issued both keys before, so each knows both tags).
TYPED_TEST_P(CommunicatorConformanceTest, MismatchedKeysFailOnEveryRankNamingTheirTags) {
  const int n = 3;
  std::vector<absl::Status> results(n);
  RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
    std::vector<float> in(5, 1.0f), out(5 * n, -1.0f);
    for (uint64_t key : {1, 2}) {
      ASSERT_TRUE(WaitFor(comm.AllGather(in.data(), out.data(), 5, DType::kF32, stream,
                                         {.tag = absl::StrCat("unit", key), .key = key}))
                      .ok());
    }
    std::fill(out.begin(), out.end(), -1.0f);
    const uint64_t key = r == 2 ? 2 : 1;
    results[r] = WaitFor(comm.AllGather(in.data(), out.data(), 5, DType::kF32, stream,
                                        {.tag = absl::StrCat("unit", key), .key = key}));
    for (float x : out) ASSERT_EQ(x, -1.0f) << "no data may be written on a mismatch";
  });
  for (const absl::Status& status : results) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(IsPeerError(status)) << status;
    EXPECT_TRUE(absl::StrContains(status.message(),
                                  "rank 0 called all_gather(count=5, f32) for 'unit1' but rank 2 "
                                  "called all_gather(count=5, f32) for 'unit2'"))
        << status;
  }
}

// Keys named ahead (Communicator::NameKey, as the scheduler names its units' keys when they are
// registered) are named in a mismatch although no collective with them was issued before, on
// whichever rank sees it first.
TYPED_TEST_P(CommunicatorConformanceTest, KeysNamedAheadAreNamedInAMismatch) {
  const int n = 2;
  std::vector<absl::Status> results(n);
  RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
    comm.NameKey(1, "unit1");
    comm.NameKey(2, "unit2");
    comm.NameKey(2, "renamed");  // a key keeps its first name
    std::vector<float> in(5, 1.0f), out(5 * n, -1.0f);
    results[r] =
        WaitFor(comm.AllGather(in.data(), out.data(), 5, DType::kF32, stream, {.key = 1u + r}));
  });
  for (const absl::Status& status : results) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(absl::StrContains(status.message(),
                                  "rank 0 called all_gather(count=5, f32) for 'unit1' but rank 1 "
                                  "called all_gather(count=5, f32) for 'unit2'"))
        << status;
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

// FSDP's shape: all-gathers on a gather stream, reduce-scatters and all-reduces on a reduce
// stream, one communicator, the two streams released at the same moment, in both issue orders.
// Results must be as if issued serially; every element is checked.
TYPED_TEST_P(CommunicatorConformanceTest, CollectivesOnTwoStreamsRunInIssueOrder) {
  const int n = 3;
  RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& gather) {
    auto reduce = *CreateHostStream({.name = absl::StrCat("reduce", r)});
    int salt = 0;
    for (size_t count : {size_t{1001}, size_t{70001}}) {  // both sides of ucx's small threshold
      for (int iter = 0; iter < 4; ++iter, salt += 3) {
        const bool gather_first = iter % 2 == 0;
        std::vector<float> shard = HashedFloats(r, count, salt);
        std::vector<float> full(n * count, -7.0f);
        std::vector<float> grad = HashedFloats(r, n * count, salt + 1);
        std::vector<float> reduced(count, -7.0f);
        std::vector<float> norm = HashedFloats(r, 5, salt + 2);
        Gate start;
        ASSERT_TRUE(gather.Enqueue(BlockOn(start)).ok());
        ASSERT_TRUE(reduce->Enqueue(BlockOn(start)).ok());
        auto issue_gather = [&] {
          return comm.AllGather(shard.data(), full.data(), count, DType::kF32, gather);
        };
        auto issue_reduce = [&] {
          return comm.ReduceScatter(grad.data(), reduced.data(), count, DType::kF32, *reduce);
        };
        absl::StatusOr<Work> g = gather_first ? issue_gather() : issue_reduce();
        absl::StatusOr<Work> rs = gather_first ? issue_reduce() : issue_gather();
        if (!gather_first) std::swap(g, rs);
        absl::StatusOr<Work> ar =
            comm.AllReduce(norm.data(), norm.data(), norm.size(), DType::kF32, *reduce);
        start.Open();
        ASSERT_TRUE(WaitFor(g).ok()) << WaitFor(g);
        ASSERT_TRUE(WaitFor(rs).ok()) << WaitFor(rs);
        ASSERT_TRUE(WaitFor(ar).ok()) << WaitFor(ar);
        for (int s = 0; s < n; ++s) {
          for (size_t i = 0; i < count; ++i) {
            ASSERT_EQ(full[s * count + i], HashedFloat(s, i, salt)) << "block " << s << " " << i;
          }
        }
        for (size_t i = 0; i < count; ++i) {
          double ref = 0;
          for (int s = 0; s < n; ++s) ref += HashedFloat(s, r * count + i, salt + 1);
          ASSERT_NEAR(reduced[i], ref, 1e-5) << i;
        }
        for (size_t i = 0; i < norm.size(); ++i) {
          double ref = 0;
          for (int s = 0; s < n; ++s) ref += HashedFloat(s, i, salt + 2);
          ASSERT_NEAR(norm[i], ref, 1e-5) << i;
        }
      }
    }
  });
}

// Two threads of each rank issue barriers on one communicator at the same time (PyTorch runs
// backward hooks on its own threads). Barriers are all alike, so any interleaving is an order
// the ranks agree on; every sequence number must be used exactly once.
TYPED_TEST_P(CommunicatorConformanceTest, ThreadsIssueOnOneCommunicatorAtOnce) {
  const int n = 2;
  constexpr int kPerThread = 20;
  RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
    auto other = *CreateHostStream({.name = absl::StrCat("hook", r)});
    std::vector<Work> works[2];
    std::thread helper([&] {
      for (int i = 0; i < kPerThread; ++i) {
        absl::StatusOr<Work> w = comm.Barrier(*other);
        ASSERT_TRUE(w.ok()) << w.status();
        works[1].push_back(*w);
      }
    });
    for (int i = 0; i < kPerThread; ++i) {
      absl::StatusOr<Work> w = comm.Barrier(stream);
      ASSERT_TRUE(w.ok()) << w.status();
      works[0].push_back(*w);
    }
    helper.join();
    for (auto& list : works) {
      for (Work& w : list) ASSERT_TRUE(w.Wait(absl::Now() + absl::Seconds(60)).ok());
    }
    EXPECT_EQ(comm.next_seq(), 2u * kPerThread);
  });
}

// The stream that should run rank 0's all-reduce is poisoned after the collective was enqueued:
// the collective never runs. Every rank must fail at once with an error naming it, not at the
// communicator's timeout.
TYPED_TEST_P(CommunicatorConformanceTest, CollectiveDroppedByAPoisonedStreamFailsEveryRank) {
  const int n = 3;
  const absl::Duration timeout = absl::Seconds(120);
  std::vector<absl::Status> results(n);
  const absl::Time start = absl::Now();
  RunRanks(this->Make(n, timeout), [&](int r, Communicator& comm, Stream& stream) {
    std::vector<float> buffer = HashedFloats(r, 1000);
    Gate gate;
    if (r == 0) {
      ASSERT_TRUE(stream
                      .Enqueue([&gate] {
                        gate.Wait();
                        return absl::InternalError("the framework's kernel failed");
                      })
                      .ok());
    }
    absl::StatusOr<Work> work =
        comm.AllReduce(buffer.data(), buffer.data(), buffer.size(), DType::kF32, stream);
    gate.Open();
    results[r] = WaitFor(work);
  });
  EXPECT_LT(absl::Now() - start, timeout / 4) << "the peers waited for their deadline";
  for (int r = 0; r < n; ++r) {
    EXPECT_FALSE(results[r].ok());
    // Rank 0's own Work reports its stream's failure; the peers learn of the skipped collective.
    if (r > 0) {
      EXPECT_TRUE(absl::StrContains(results[r].message(), "all_reduce #0")) << results[r];
      EXPECT_TRUE(absl::StrContains(results[r].message(), "never ran")) << results[r];
      EXPECT_TRUE(absl::StrContains(results[r].message(), "the framework's kernel failed"))
          << results[r];
      EXPECT_TRUE(IsPeerError(results[r])) << results[r];
    }
  }
}

// A duplicate has its own issue order: a collective on it runs while the original
// communicator's collective is still held back on its stream.
TYPED_TEST_P(CommunicatorConformanceTest, DupRunsIndependentlyOfTheOriginal) {
  const int n = 2;
  RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
    absl::StatusOr<std::shared_ptr<Communicator>> dup = comm.Dup(absl::Now() + absl::Seconds(60));
    ASSERT_TRUE(dup.ok()) << dup.status();
    ASSERT_NE(*dup, nullptr);
    EXPECT_EQ((*dup)->rank(), r);
    EXPECT_EQ((*dup)->size(), n);
    EXPECT_EQ((*dup)->next_seq(), 0u);
    auto other = *CreateHostStream({.name = absl::StrCat("dup", r)});
    Gate gate;
    ASSERT_TRUE(stream.Enqueue(BlockOn(gate)).ok());
    std::vector<float> held = HashedFloats(r, 64, 1);
    absl::StatusOr<Work> first =
        comm.AllReduce(held.data(), held.data(), held.size(), DType::kF32, stream);
    std::vector<float> free_running = HashedFloats(r, 64, 2);
    absl::StatusOr<Work> second = (*dup)->AllReduce(free_running.data(), free_running.data(),
                                                    free_running.size(), DType::kF32, *other);
    // Completes although the original's collective, issued first, has not started.
    EXPECT_TRUE(WaitFor(second).ok()) << WaitFor(second);
    EXPECT_FALSE(first->IsCompleted());
    gate.Open();
    EXPECT_TRUE(WaitFor(first).ok()) << WaitFor(first);
    for (size_t i = 0; i < held.size(); ++i) {
      ASSERT_NEAR(free_running[i], HashedFloat(0, i, 2) + HashedFloat(1, i, 2), 1e-6);
      ASSERT_NEAR(held[i], HashedFloat(0, i, 1) + HashedFloat(1, i, 1), 1e-6);
    }
  });
}

// A local bad argument is not a peer's fault; a disagreement is.
TYPED_TEST_P(CommunicatorConformanceTest, PeerErrorsAreToldApartFromLocalOnes) {
  const int n = 2;
  std::vector<absl::Status> results(n);
  RunRanks(this->Make(n), [&](int r, Communicator& comm, Stream& stream) {
    absl::StatusOr<Work> bad = comm.AllGather(nullptr, nullptr, 4, DType::kF32, stream);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_FALSE(IsPeerError(bad.status())) << bad.status();
    std::vector<float> in(8), out(8 * n);
    results[r] =
        WaitFor(comm.AllGather(in.data(), out.data(), r == 1 ? 8 : 7, DType::kF32, stream));
  });
  for (const absl::Status& status : results) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(IsPeerError(status)) << status;
  }
}

// A seeded fault-injection sweep: each trial runs a random sequence of collectives (all-reduce,
// all-gather, reduce-scatter, broadcast from a random root, barrier; odd counts on both sides of
// the small-message threshold) on 2-4 ranks, and at a random point one rank misbehaves: it
// passes another count, another dtype or another key, never shows up (a dead rank), or aborts
// its communicator. Every collective before the fault must move exactly the right data; at the
// fault, every rank that is still there must get an error (InvalidArgument and a peer error for
// the disagreements, naming the faulty rank for a missing one) within the timeout, and nothing
// may hang or abort the process.
TYPED_TEST_P(CommunicatorConformanceTest, RandomFaultsFailEveryRankWithinTheDeadline) {
  enum Fault { kCount, kDType, kKey, kMissing, kAbort, kFaults };
  const char* const kFaultNames[] = {"count", "dtype", "key", "missing", "abort"};
  enum Kind { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kBarrier, kKinds };
  int largest = 0;
  for (int n : TypeParam::kWorldSizes) largest = std::max(largest, n);
  if (largest < 2) GTEST_SKIP() << "one rank only";
#if defined(__SANITIZE_THREAD__)
  const int trials = 5;
#else
  const int trials = 12;
#endif
  for (int trial = 0; trial < trials; ++trial) {
    std::mt19937_64 rng(4242 + trial);
    const int n = 2 + static_cast<int>(rng() % std::min(3, largest - 1));
    const int steps = 2 + static_cast<int>(rng() % 6);
    const int at = static_cast<int>(rng() % steps);
    const int culprit = static_cast<int>(rng() % n);
    // Every fault once in the first trials, then at random.
    const Fault fault = static_cast<Fault>(trial < kFaults ? trial : rng() % kFaults);
    std::vector<Kind> kinds(steps);
    std::vector<size_t> counts(steps);
    std::vector<int> roots(steps);
    for (int i = 0; i < steps; ++i) {
      kinds[i] = static_cast<Kind>(rng() % kKinds);
      counts[i] = std::vector<size_t>{1, 7, 301, 5003}[rng() % 4];
      roots[i] = static_cast<int>(rng() % n);
    }
    // A count/dtype/key fault needs a collective that has them.
    if (fault != kMissing && fault != kAbort && kinds[at] == kBarrier) kinds[at] = kAllReduce;
    SCOPED_TRACE(absl::StrCat("trial ", trial, ": ", n, " ranks, ", steps, " collectives, rank ",
                              culprit, " faults (", kFaultNames[fault], ") at collective ", at));
    const absl::Duration timeout = absl::Milliseconds(700);
    Comms comms = this->Make(n, timeout);
    std::vector<absl::Status> at_fault(n);
    std::vector<int> reached(n, -1);
    // An abort comes after every rank returned from the collective before it (a backend may fail
    // a collective that a peer aborts during, even if that peer's part of it was done).
    std::mutex mu;
    std::condition_variable cv;
    int before_fault = 0;
    const absl::Time start = absl::Now();
    RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
      for (int i = 0; i < steps; ++i) {
        const bool faulty = r == culprit && i == at;
        if (faulty && fault == kMissing) return;  // dead: never issues it
        if (faulty && fault == kAbort) {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait_for(lock, std::chrono::seconds(20), [&] { return at == 0 || before_fault == n; });
          lock.unlock();
          comm.Abort(absl::AbortedError("injected fault"));
        }
        size_t count = counts[i];
        DType dtype = DType::kF32;
        uint64_t key = 7;
        if (faulty && fault == kCount) ++count;
        if (faulty && fault == kDType) dtype = DType::kI32;  // same size, another meaning
        if (faulty && fault == kKey) key = 8;
        std::vector<float> in = HashedFloats(r, counts[i] * n + 1, i);
        std::vector<float> out(counts[i] * n + 1, -2.0f);
        ReduceOptions reduce;
        reduce.key = key;
        BroadcastOptions broadcast;
        broadcast.key = key;
        broadcast.root = roots[i];
        absl::StatusOr<Work> work;
        switch (kinds[i]) {
          case kAllReduce:
            work = comm.AllReduce(in.data(), out.data(), count, dtype, stream, reduce);
            break;
          case kAllGather:
            work = comm.AllGather(in.data(), out.data(), count, dtype, stream, {.key = key});
            break;
          case kReduceScatter:
            work = comm.ReduceScatter(in.data(), out.data(), count, dtype, stream, reduce);
            break;
          case kBroadcast:
            out = in;
            work = comm.Broadcast(out.data(), count, dtype, stream, broadcast);
            break;
          case kBarrier:
          case kKinds:
            work = comm.Barrier(stream, {.key = key});
            break;
        }
        const absl::Status status = WaitFor(work);
        reached[r] = i;
        if (i == at) {
          at_fault[r] = status;
          return;  // a failed collective aborts the communicator
        }
        ASSERT_TRUE(status.ok()) << "collective " << i << " before the fault: " << status;
        if (i + 1 == at) {
          {
            std::lock_guard<std::mutex> lock(mu);
            ++before_fault;
          }
          cv.notify_all();
        }
        const size_t c = counts[i];
        for (size_t e = 0; e < c; ++e) {
          switch (kinds[i]) {
            case kAllReduce: {
              double sum = 0;
              for (int p = 0; p < n; ++p) sum += HashedFloat(p, e, i);
              ASSERT_NEAR(out[e], sum, 1e-5) << "all_reduce " << i << " element " << e;
              break;
            }
            case kAllGather:
              for (int p = 0; p < n; ++p) {
                ASSERT_EQ(out[p * c + e], HashedFloat(p, e, i)) << "all_gather " << i;
              }
              break;
            case kReduceScatter: {
              double sum = 0;
              for (int p = 0; p < n; ++p) sum += HashedFloat(p, r * c + e, i);
              ASSERT_NEAR(out[e], sum, 1e-5) << "reduce_scatter " << i << " element " << e;
              break;
            }
            case kBroadcast:
              ASSERT_EQ(out[e], HashedFloat(roots[i], e, i)) << "broadcast " << i;
              break;
            default:
              break;
          }
        }
      }
    });
    EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(15)) << "an error took too long";
    for (int r = 0; r < n; ++r) {
      if (r == culprit && fault == kMissing) continue;
      SCOPED_TRACE(absl::StrCat("rank ", r));
      ASSERT_EQ(reached[r], at) << "rank stopped early";
      const absl::Status& status = at_fault[r];
      EXPECT_FALSE(status.ok());
      switch (fault) {
        case kCount:
        case kDType:
        case kKey:
          EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
          EXPECT_TRUE(IsPeerError(status)) << status;
          EXPECT_TRUE(absl::StrContains(status.message(), absl::StrCat("rank ", culprit)))
              << status;
          break;
        case kMissing:
          EXPECT_TRUE(absl::StrContains(status.message(), absl::StrCat(culprit))) << status;
          break;
        case kAbort:
          if (r != culprit) {
            EXPECT_TRUE(IsPeerError(status)) << status;
          }
          break;
        case kFaults:
          break;
      }
    }
    if (::testing::Test::HasFailure()) return;
  }
}

REGISTER_TYPED_TEST_SUITE_P(
    CommunicatorConformanceTest, AllGather, ReduceScatter, AllReduce, BroadcastFromEveryRoot,
    AllToAll, SplitIntoReversedHalves, OddMegaElementBuffers,
    MismatchedCountsFailOnEveryRankNamingBoth, MismatchedKeysFailOnEveryRankNamingTheirTags,
    KeysNamedAheadAreNamedInAMismatch, MismatchedSmallAndLargeCountsWriteNothing,
    MismatchedDTypesAndKindsFail, MissingRankIsADeadlineErrorNamingIt,
    AbortReachesPeersBlockedInACollective, WorkHandleSynchronizesAnotherStream,
    CollectivesOnTwoStreamsRunInIssueOrder, ThreadsIssueOnOneCommunicatorAtOnce,
    CollectiveDroppedByAPoisonedStreamFailsEveryRank, DupRunsIndependentlyOfTheOriginal,
    PeerErrorsAreToldApartFromLocalOnes, RandomFaultsFailEveryRankWithinTheDeadline);

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_COLLECTIVES_CONFORMANCE_H_
