// The Communicator API over the ucx backend with ranks as threads of one process, each with its
// own UCX worker, connected over a shared MemoryStore: this runs the real UCX paths (shared
// memory, the single-copy protocol — ranks of one process can read each other's memory) cheaply.
// Every collective, dtype and count against plain-loop references, in place and out of place,
// for world sizes 1 to 4; splits; collectives issued on two streams; UCX's own shared memory
// (SHARDLINE_UCX_CMA=0); mismatches, missing ranks and aborts fail on every rank instead of
// hanging.
#include "collectives/ucx/ucx_communicator.h"

#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/store/memory_store.h"
#include "runtime/check.h"
#include "runtime/config.h"
#include "runtime/stream.h"
#include "tests/common/typed_values.h"

namespace shardline {
namespace {

using ::shardline::testing::GetElement;
using ::shardline::testing::PatternBuffer;
using ::shardline::testing::PatternValue;
using ::shardline::testing::ReferenceReduce;
using ::shardline::testing::Tolerance;

using Comms = std::vector<std::shared_ptr<Communicator>>;
using RankFn = std::function<void(int rank, Communicator& comm, Stream& stream)>;

constexpr DType kReduceDTypes[] = {DType::kF32,  DType::kF64, DType::kF16,
                                   DType::kBF16, DType::kI32, DType::kI64};
// 4097 elements of 4 or 8 bytes exceed the small-message threshold: both protocols run.
constexpr size_t kCounts[] = {0, 1, 7, 4097};

// Makes the next communicator read SHARDLINE_UCX_CMA again.
void ReReadCmaKnob() {
  for (const ParamBase* param : AllParams()) {
    if (param->env_name() == "SHARDLINE_UCX_CMA") param->ResetCacheForTesting();
  }
}

// Creates the n communicators concurrently (creation waits for every peer's address).
Comms MakeComms(int n, absl::Duration timeout = absl::Seconds(30)) {
  auto store = std::make_shared<MemoryStore>();
  Comms comms(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::shared_ptr<Communicator>> comm = CreateUcxCommunicator(
          {.rank = r, .size = n, .store = store, .name = "world", .timeout = timeout});
      SL_CHECK_OK(comm.status());
      comms[r] = *std::move(comm);
    });
  }
  for (std::thread& t : threads) t.join();
  return comms;
}

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

class UcxCollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(UcxCollectivesTest, AllGather) {
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
          absl::Status status = WaitFor(comm.AllGather(in, output.data(), count, dtype, stream));
          ASSERT_TRUE(status.ok()) << status;
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

TEST_P(UcxCollectivesTest, ReduceScatter) {
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
}

TEST_P(UcxCollectivesTest, AllReduce) {
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
}

TEST_P(UcxCollectivesTest, BroadcastFromEveryRoot) {
  const int n = GetParam();
  Comms comms = MakeComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    for (DType dtype : kAllDTypes) {
      for (size_t count : kCounts) {
        for (int root = 0; root < n; ++root) {
          std::vector<uint8_t> buffer = PatternBuffer(dtype, r, count, /*salt=*/root);
          absl::Status status =
              WaitFor(comm.Broadcast(buffer.data(), count, dtype, stream, {.root = root}));
          ASSERT_TRUE(status.ok()) << status;
          for (size_t i = 0; i < count; ++i) {
            ASSERT_EQ(GetElement(dtype, buffer.data(), i), PatternValue(dtype, root, i, root));
          }
        }
      }
    }
  });
}

TEST_P(UcxCollectivesTest, AllToAll) {
  const int n = GetParam();
  Comms comms = MakeComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
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
                      PatternValue(dtype, s, r * count + i));
          }
        }
      }
    }
    ASSERT_TRUE(WaitFor(comm.Barrier(stream)).ok());
  });
}

TEST_P(UcxCollectivesTest, SplitIntoReversedHalves) {
  const int n = GetParam();
  Comms comms = MakeComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
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
    EXPECT_EQ((*sub)->backend(), "ucx");
    int32_t mine = r;
    std::vector<int32_t> gathered(members.size());
    ASSERT_TRUE(WaitFor((*sub)->AllGather(&mine, gathered.data(), 1, DType::kI32, stream)).ok());
    EXPECT_EQ(gathered, std::vector<int32_t>(members.begin(), members.end()));
    // Parent and child interleave without crossing.
    ASSERT_TRUE(WaitFor(comm.Barrier(stream)).ok());
    std::vector<float> sum(5000, 1.0f);
    ASSERT_TRUE(
        WaitFor((*sub)->AllReduce(sum.data(), sum.data(), sum.size(), DType::kF32, stream)).ok());
    EXPECT_EQ(sum[4999], static_cast<float>(members.size()));
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, UcxCollectivesTest, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return absl::StrCat("n", info.param); });

TEST(UcxCollectivesLargeTest, PipelinedOddMegaElementBuffers) {
  const int n = 3;
  const size_t count = (1 << 20) + 3;  // several chunks per block, a ragged last one
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
                                           DType::kF32, stream, {.op = ReduceOp::kMax}))
                    .ok());
    for (size_t i = 0; i < count; i += 991) {
      ASSERT_EQ(GetElement(DType::kF32, input.data() + r * count * 4, i),
                ReferenceReduce(DType::kF32, ReduceOp::kMax, n, r * count + i));
    }
    // In-place all-gather of the reduced shards.
    std::vector<uint8_t> gathered(n * count * 4);
    std::copy(input.begin() + r * count * 4, input.begin() + (r + 1) * count * 4,
              gathered.begin() + r * count * 4);
    ASSERT_TRUE(WaitFor(comm.AllGather(gathered.data() + r * count * 4, gathered.data(), count,
                                       DType::kF32, stream))
                    .ok());
    for (size_t i = 0; i < n * count; i += 1009) {
      ASSERT_EQ(GetElement(DType::kF32, gathered.data(), i),
                ReferenceReduce(DType::kF32, ReduceOp::kMax, n, i));
    }
  });
}

TEST(UcxCommunicatorTest, CollectivesIssuedOnTwoStreamsRunInIssueOrder) {
  // FSDP's shape: all-gathers on a gather stream, reduce-scatters on a reduce stream, one
  // communicator. The two stream threads run at once; results must be as if issued serially.
  const int n = 3;
  Comms comms = MakeComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& gather) {
    auto reduce = *CreateHostStream({.name = absl::StrCat("reduce", r)});
    for (size_t count : {size_t{1000}, size_t{70000}}) {  // small and large protocols
      for (int iter = 0; iter < 4; ++iter) {
        std::vector<uint8_t> shard = PatternBuffer(DType::kF32, r, count, /*salt=*/iter);
        std::vector<uint8_t> full(n * count * 4);
        std::vector<uint8_t> grad = PatternBuffer(DType::kF32, r, n * count, /*salt=*/iter + 9);
        std::vector<uint8_t> reduced(count * 4);
        absl::StatusOr<Work> g =
            comm.AllGather(shard.data(), full.data(), count, DType::kF32, gather);
        absl::StatusOr<Work> rs =
            comm.ReduceScatter(grad.data(), reduced.data(), count, DType::kF32, *reduce);
        ASSERT_TRUE(WaitFor(g).ok()) << WaitFor(g);
        ASSERT_TRUE(WaitFor(rs).ok()) << WaitFor(rs);
        for (int s = 0; s < n; ++s) {
          for (size_t i = 0; i < count; i += 13) {
            ASSERT_EQ(GetElement(DType::kF32, full.data(), s * count + i),
                      PatternValue(DType::kF32, s, i, iter));
          }
        }
        for (size_t i = 0; i < count; i += 13) {
          ASSERT_EQ(GetElement(DType::kF32, reduced.data(), i),
                    ReferenceReduce(DType::kF32, ReduceOp::kSum, n, r * count + i, iter + 9));
        }
      }
    }
  });
}

TEST(UcxCommunicatorTest, LargeMessagesThroughUcxSharedMemory) {
  // SHARDLINE_UCX_CMA=0: no single-copy reads, UCX moves the large messages itself.
  setenv("SHARDLINE_UCX_CMA", "0", 1);
  ReReadCmaKnob();
  Comms comms = MakeComms(2);
  unsetenv("SHARDLINE_UCX_CMA");
  ReReadCmaKnob();
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    const size_t count = 300001;
    std::vector<uint8_t> input = PatternBuffer(DType::kF32, r, 2 * count);
    std::vector<uint8_t> output(input.size());
    ASSERT_TRUE(
        WaitFor(comm.AllReduce(input.data(), output.data(), 2 * count, DType::kF32, stream)).ok());
    for (size_t i = 0; i < 2 * count; i += 101) {
      ASSERT_EQ(GetElement(DType::kF32, output.data(), i),
                ReferenceReduce(DType::kF32, ReduceOp::kSum, 2, i));
    }
    std::vector<uint8_t> gathered(2 * count * 4);
    ASSERT_TRUE(
        WaitFor(comm.AllGather(input.data(), gathered.data(), count, DType::kF32, stream)).ok());
    for (size_t i = 0; i < count; i += 101) {
      ASSERT_EQ(GetElement(DType::kF32, gathered.data(), (1 - r) * count + i),
                PatternValue(DType::kF32, 1 - r, i));
    }
  });
}

TEST(UcxCommunicatorTest, MismatchedCountsFailOnEveryRankNamingBoth) {
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

TEST(UcxCommunicatorTest, MismatchedSmallAndLargeCountsWriteNothing) {
  // One rank takes the zero-copy path, the others the small one: nothing may be written and no
  // message may be truncated into user memory.
  const int n = 3;
  Comms comms = MakeComms(n);
  std::vector<absl::Status> results(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
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

TEST(UcxCommunicatorTest, MismatchedDTypesAndKindsFail) {
  const int n = 3;
  Comms comms = MakeComms(n);
  std::vector<absl::Status> results(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    std::vector<double> buffer(4);
    const DType dtype = r == 1 ? DType::kI64 : DType::kF64;
    results[r] = WaitFor(comm.AllReduce(buffer.data(), buffer.data(), 4, dtype, stream));
  });
  for (const absl::Status& status : results) {
    EXPECT_TRUE(absl::StrContains(status.message(), "but rank 1 called all_reduce(count=4, i64"))
        << status;
  }
  // Kinds: rank 0 broadcasts while the others barrier.
  Comms more = MakeComms(2);
  std::vector<absl::Status> kinds(2);
  RunRanks(more, [&](int r, Communicator& comm, Stream& stream) {
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

TEST(UcxCommunicatorTest, MissingRankIsADeadlineErrorNamingIt) {
  const int n = 3;
  Comms comms = MakeComms(n, absl::Milliseconds(400));
  std::vector<absl::Status> results(n);
  const absl::Time start = absl::Now();
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    if (r == 2) return;
    std::vector<float> buffer(4);
    results[r] = WaitFor(comm.AllReduce(buffer.data(), buffer.data(), 4, DType::kF32, stream));
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].code(), absl::StatusCode::kDeadlineExceeded) << results[r];
    EXPECT_TRUE(absl::StrContains(results[r].message(), "waiting for rank(s) 2")) << results[r];
  }
  auto stream = *CreateHostStream({});
  EXPECT_FALSE(comms[0]->Barrier(*stream).ok());
}

TEST(UcxCommunicatorTest, AbortReachesPeersBlockedInACollective) {
  const int n = 4;
  Comms comms = MakeComms(n, absl::Seconds(60));
  std::vector<absl::Status> results(n);
  const absl::Time start = absl::Now();
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    if (r == 3) {
      absl::SleepFor(absl::Milliseconds(50));  // let the others block first
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
    EXPECT_TRUE(absl::StrContains(results[r].message(), "peer rank 3 aborted: rank 3 lost"))
        << results[r];
  }
}

TEST(UcxCommunicatorTest, WorkHandleSynchronizesAnotherStream) {
  const int n = 2;
  Comms comms = MakeComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
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
    EXPECT_EQ(seen, 3.0f);
  });
}

TEST(UcxCommunicatorTest, CreationWithoutPeersTimesOutNamingThem) {
  auto store = std::make_shared<MemoryStore>();
  absl::StatusOr<std::shared_ptr<Communicator>> comm = CreateUcxCommunicator(
      {.rank = 0, .size = 3, .store = store, .timeout = absl::Milliseconds(200)});
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_TRUE(absl::StrContains(comm.status().message(), "rank(s) 1, 2")) << comm.status();
  EXPECT_EQ(CreateUcxCommunicator({.rank = 3, .size = 3, .store = store}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateUcxCommunicator({.rank = 0, .size = 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardline
