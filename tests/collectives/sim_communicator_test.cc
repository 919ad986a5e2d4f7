// The sim backend (collectives/sim/): completion times from the cost model with staggered
// arrivals, data against plain loops and the local backend, mismatches, stalls and virtual
// timeouts, aborts, stream checks, phantom runs, Dup and Split, representative mode, 64 ranks
// in one thread, and point-to-point (message times, data, any source, order, failures).

#include "collectives/sim/sim_communicator.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/local/local_communicator.h"
#include "collectives/process_mesh.h"
#include "gmock/gmock.h"
#include "runtime/half.h"
#include "runtime/stream.h"
#include "runtime/virtual_time.h"
#include "tests/common/rank_threads.h"
#include "tests/common/sanitizers.h"

namespace shardline {
namespace {

using ::shardline::testing::RunRankThreads;
using ::testing::HasSubstr;

constexpr absl::Time kEpoch = absl::UnixEpoch();
absl::Duration Us(double us) { return absl::Nanoseconds(us * 1000); }

// 1 GB/s: 1000 bytes take 1us; latency 5us.
SimOptions Model() {
  SimOptions options;
  options.latency = Us(5);
  options.bandwidth_bytes_per_s = 1e9;
  options.timeout = absl::Seconds(100);
  return options;
}

// A simulation of `n` ranks: one virtual stream and one communicator per rank.
struct Sim {
  explicit Sim(int n, SimOptions options = Model(), VirtualTimelineOptions timeline_options = {})
      : timeline(*VirtualTimeline::Create(std::move(timeline_options))) {
    absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> created =
        CreateSimCommunicators(*timeline, n, options);
    EXPECT_TRUE(created.ok()) << created.status();
    comms = *std::move(created);
    for (int r = 0; r < n; ++r) {
      streams.push_back(*CreateVirtualStream(*timeline, {.name = absl::StrCat("rank", r)}));
    }
  }
  ~Sim() {
    streams.clear();
    comms.clear();
  }
  // Occupies rank r's stream for `d` before what comes next (a staggered arrival).
  void Delay(int r, absl::Duration d) {
    StreamOp op;
    op.name = "compute";
    op.kind = StreamOpKind::kCompute;
    op.duration = d;
    EXPECT_TRUE(streams[r]->Submit(std::move(op)).ok());
  }

  std::unique_ptr<VirtualTimeline> timeline;
  std::vector<std::shared_ptr<Communicator>> comms;
  std::vector<std::unique_ptr<Stream>> streams;
};

absl::Duration DoneAt(const Work& work) {
  std::optional<absl::Time> at = work.event()->completed_at();
  EXPECT_TRUE(at.has_value());
  return at.has_value() ? *at - kEpoch : absl::InfiniteDuration();
}

std::vector<float> RandomFloats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-10.0f, 10.0f);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Point-to-point in virtual time. A ring of 3 ranks, rank r reaching its send at 10us * r: a send
// ends when it starts; its message (4000 bytes: 5us + 4us) arrives 9us later; the receive that
// follows the send on the same stream ends at max(its start, the arrival). Every bit arrives.
TEST(SimCommunicatorTest, PointToPointMessagesTakeOneMessagesCost) {
  constexpr int n = 3;
  constexpr size_t kCount = 1000;
  EXPECT_EQ(SimCollectiveCost(CollectiveKind::kSend, kCount, DType::kF32, n, Model()), Us(9));
  Sim sim(n);
  std::vector<std::vector<float>> out, in(n, std::vector<float>(kCount, -1.0f));
  std::vector<Work> sends, receives;
  for (int r = 0; r < n; ++r) {
    out.push_back(RandomFloats(kCount, 40 + r));
    sim.Delay(r, Us(10) * r);
    sends.push_back(
        *sim.comms[r]->Send(out[r].data(), kCount, DType::kF32, (r + 1) % n, *sim.streams[r]));
    receives.push_back(
        *sim.comms[r]->Recv(in[r].data(), kCount, DType::kF32, (r + n - 1) % n, *sim.streams[r]));
  }
  ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
  for (int r = 0; r < n; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    EXPECT_EQ(DoneAt(sends[r]), Us(10) * r);
    // Rank 0 waits for rank 2's message (sent at 20us); the others' arrived before they looked.
    EXPECT_EQ(DoneAt(receives[r]), r == 0 ? Us(29) : Us(10) * r);
    EXPECT_TRUE(receives[r].status().ok()) << receives[r].status();
    EXPECT_EQ(receives[r].source(), (r + n - 1) % n);
    EXPECT_TRUE(SameBits(in[r], out[(r + n - 1) % n]));
  }
}

// From any source: the earliest arrived message first. Messages of one source keep their order
// even when a later, smaller one arrives first.
TEST(SimCommunicatorTest, PointToPointFromAnySourceTakesTheEarliestArrival) {
  Sim sim(3);
  const std::vector<float> big = RandomFloats(4000, 1), small = RandomFloats(1, 2),
                           late = RandomFloats(1, 3);
  // Rank 2 at 0: 16000 bytes (arrives at 21us), then 4 bytes (arrives at 5.004us).
  ASSERT_TRUE(sim.comms[2]->Send(big.data(), 4000, DType::kF32, 0, *sim.streams[2]).ok());
  ASSERT_TRUE(sim.comms[2]->Send(small.data(), 1, DType::kF32, 0, *sim.streams[2]).ok());
  // Rank 1 at 30us: 4 bytes (arrives at 35.004us).
  sim.Delay(1, Us(30));
  ASSERT_TRUE(sim.comms[1]->Send(late.data(), 1, DType::kF32, 0, *sim.streams[1]).ok());
  std::vector<float> first(4000), second(1), third(1);
  Work a = *sim.comms[0]->Recv(first.data(), 4000, DType::kF32, 2, *sim.streams[0]);
  Work b = *sim.comms[0]->Recv(second.data(), 1, DType::kF32, kAnySource, *sim.streams[0]);
  Work c = *sim.comms[0]->Recv(third.data(), 1, DType::kF32, kAnySource, *sim.streams[0]);
  ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
  EXPECT_EQ(DoneAt(a), Us(21));
  EXPECT_TRUE(SameBits(first, big)) << "the later, smaller message overtook the first";
  EXPECT_EQ(b.source(), 2);
  EXPECT_EQ(DoneAt(b), Us(21));
  EXPECT_TRUE(SameBits(second, small));
  EXPECT_EQ(c.source(), 1);
  EXPECT_EQ(DoneAt(c), Us(35.004));
  EXPECT_TRUE(SameBits(third, late));
}

// A size mismatch fails the receive naming both sides, writes nothing and aborts the group; a
// receive whose message never comes fails at its virtual deadline naming the rank.
TEST(SimCommunicatorTest, PointToPointFailures) {
  {
    Sim sim(2);
    std::vector<float> out = RandomFloats(5, 7), in(7, 0.5f);
    ASSERT_TRUE(sim.comms[0]->Send(out.data(), 5, DType::kF32, 1, *sim.streams[0]).ok());
    Work w = *sim.comms[1]->Recv(in.data(), 7, DType::kF32, 0, *sim.streams[1]);
    ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << w.status();
    EXPECT_THAT(w.status().message(), HasSubstr("rank 0 sent send(count=5, f32, to=1, tag=0) but "
                                                "this rank receives recv(count=7, f32, from=0"));
    EXPECT_EQ(in, std::vector<float>(7, 0.5f));
    // The receiver's failure aborted the group: the sender's next operation fails with it.
    Work next = *sim.comms[0]->Send(out.data(), 5, DType::kF32, 1, *sim.streams[0]);
    ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
    EXPECT_THAT(next.status().message(), HasSubstr("peer rank 1 aborted")) << next.status();
  }
  {
    Sim sim(3);
    float x = 0;
    Work w = *sim.comms[1]->Recv(&x, 1, DType::kF32, kAnySource, *sim.streams[1],
                                 {.timeout = Us(100), .match_tag = 3});
    sim.Delay(0, absl::Milliseconds(1));  // moves the clock past the deadline
    ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
    EXPECT_EQ(w.status().code(), absl::StatusCode::kDeadlineExceeded) << w.status();
    EXPECT_THAT(w.status().message(), HasSubstr("waiting for rank(s) 0, 2"));
    EXPECT_EQ(DoneAt(w), Us(100));
  }
}

TEST(SimCommunicatorTest, CostModel) {
  const SimOptions m = Model();
  EXPECT_EQ(SimCollectiveCost(CollectiveKind::kAllGather, 250, DType::kF32, 5, m), 4 * Us(6));
  EXPECT_EQ(SimCollectiveCost(CollectiveKind::kReduceScatter, 500, DType::kBF16, 2, m), Us(6));
  EXPECT_EQ(SimCollectiveCost(CollectiveKind::kAllToAll, 125, DType::kF64, 3, m), 2 * Us(6));
  // 4000 bytes over 5 ranks: 800 bytes per step.
  EXPECT_EQ(SimCollectiveCost(CollectiveKind::kAllReduce, 1000, DType::kF32, 5, m), 8 * Us(5.8));
  EXPECT_EQ(SimCollectiveCost(CollectiveKind::kBroadcast, 1000, DType::kF32, 5, m),
            4 * Us(5) + Us(4));
  EXPECT_EQ(SimCollectiveCost(CollectiveKind::kBarrier, 0, DType::kU8, 5, m), 8 * Us(5));
  EXPECT_EQ(SimCollectiveCost(CollectiveKind::kAllReduce, 1000, DType::kF32, 1, m),
            absl::ZeroDuration());
}

// Every collective completes on every rank at max(arrival) + cost; the next one on the same
// stream arrives then.
void CheckTimes(int n) {
  Sim sim(n);
  const size_t count = 1000;  // f32: 4000 bytes
  std::vector<std::vector<float>> in(n, std::vector<float>(count * n, 1.0f));
  std::vector<std::vector<float>> out(n, std::vector<float>(count * n));
  std::vector<Work> gathers, reduces, scatters, broadcasts, barriers;
  for (int r = 0; r < n; ++r) {
    sim.Delay(r, Us(10) * r);  // rank r arrives at 10us * r
    gathers.push_back(
        *sim.comms[r]->AllGather(in[r].data(), out[r].data(), 250, DType::kF32, *sim.streams[r]));
    reduces.push_back(
        *sim.comms[r]->AllReduce(in[r].data(), out[r].data(), count, DType::kF32, *sim.streams[r]));
    // Rank 0 arrives late at the reduce-scatter.
    if (r == 0) sim.Delay(0, Us(100));
    scatters.push_back(*sim.comms[r]->ReduceScatter(in[r].data(), out[r].data(), 250, DType::kF32,
                                                    *sim.streams[r]));
    broadcasts.push_back(*sim.comms[r]->Broadcast(out[r].data(), count, DType::kF32,
                                                  *sim.streams[r], {.root = n - 1}));
    barriers.push_back(*sim.comms[r]->Barrier(*sim.streams[r]));
  }
  ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
  const int64_t steps = n - 1;
  const absl::Duration gather_end = Us(10) * (n - 1) + steps * (Us(5) + Us(1));
  const absl::Duration reduce_end =
      gather_end + 2 * steps * (Us(5) + absl::Nanoseconds(4000.0 / n));
  const absl::Duration scatter_end = reduce_end + Us(100) + steps * (Us(5) + Us(1));
  const absl::Duration broadcast_end = scatter_end + steps * Us(5) + Us(4);
  const absl::Duration barrier_end = broadcast_end + 2 * steps * Us(5);
  for (int r = 0; r < n; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r, " of ", n));
    EXPECT_EQ(DoneAt(gathers[r]), gather_end);
    EXPECT_EQ(DoneAt(reduces[r]), reduce_end);
    EXPECT_EQ(DoneAt(scatters[r]), scatter_end);
    EXPECT_EQ(DoneAt(broadcasts[r]), broadcast_end);
    EXPECT_EQ(DoneAt(barriers[r]), barrier_end);
    EXPECT_TRUE(barriers[r].status().ok());
  }
  EXPECT_EQ(sim.timeline->Now(), kEpoch + barrier_end);
}

TEST(SimCommunicatorTest, CompletionTimesTwoRanks) { CheckTimes(2); }
TEST(SimCommunicatorTest, CompletionTimesFiveRanks) { CheckTimes(5); }

// Data: every collective against a plain loop in rank order, random floats, odd counts, in
// place and out of place.
TEST(SimCommunicatorTest, DataMatchesPlainLoops) {
  for (const int n : {3, 5}) {
    for (const size_t count : {size_t{1}, size_t{7}, size_t{1001}}) {
      SCOPED_TRACE(absl::StrCat(n, " ranks, count ", count));
      Sim sim(n);
      std::vector<std::vector<float>> in(n);
      for (int r = 0; r < n; ++r) in[r] = RandomFloats(count * n, 100 * n + r + count);
      std::vector<std::vector<float>> gathered(n, std::vector<float>(count * n));
      std::vector<std::vector<float>> gathered_in_place(n, std::vector<float>(count * n, -1.0f));
      std::vector<std::vector<float>> scattered(n, std::vector<float>(count));
      std::vector<std::vector<float>> averaged(n, std::vector<float>(count));
      std::vector<std::vector<float>> reduced(n);
      std::vector<std::vector<float>> maxed(n, std::vector<float>(count * n));
      std::vector<std::vector<float>> broadcast(n);
      std::vector<std::vector<float>> exchanged(n, std::vector<float>(count * n));
      for (int r = 0; r < n; ++r) {
        Communicator& c = *sim.comms[r];
        Stream& s = *sim.streams[r];
        std::copy(in[r].begin(), in[r].begin() + count, gathered_in_place[r].begin() + r * count);
        reduced[r] = in[r];  // in place
        broadcast[r] = in[r];
        ASSERT_TRUE(c.AllGather(in[r].data(), gathered[r].data(), count, DType::kF32, s).ok());
        ASSERT_TRUE(c.AllGather(gathered_in_place[r].data() + r * count,
                                gathered_in_place[r].data(), count, DType::kF32, s)
                        .ok());
        ASSERT_TRUE(c.ReduceScatter(in[r].data(), scattered[r].data(), count, DType::kF32, s).ok());
        ASSERT_TRUE(c.ReduceScatter(in[r].data(), averaged[r].data(), count, DType::kF32, s,
                                    {.op = ReduceOp::kAvg})
                        .ok());
        ASSERT_TRUE(
            c.AllReduce(reduced[r].data(), reduced[r].data(), count * n, DType::kF32, s).ok());
        ASSERT_TRUE(c.AllReduce(in[r].data(), maxed[r].data(), count * n, DType::kF32, s,
                                {.op = ReduceOp::kMax})
                        .ok());
        ASSERT_TRUE(c.Broadcast(broadcast[r].data(), count * n, DType::kF32, s, {.root = 2}).ok());
        ASSERT_TRUE(c.AllToAll(in[r].data(), exchanged[r].data(), count, DType::kF32, s).ok());
      }
      ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());

      // The references: plain loops over the ranks in order.
      std::vector<float> sum(count * n), max(count * n);
      for (size_t i = 0; i < count * n; ++i) {
        float acc = in[0][i], hi = in[0][i];
        for (int s = 1; s < n; ++s) {
          acc += in[s][i];
          hi = in[s][i] > hi ? in[s][i] : hi;
        }
        sum[i] = acc;
        max[i] = hi;
      }
      const float inv_n = static_cast<float>(1.0 / n);
      for (int r = 0; r < n; ++r) {
        SCOPED_TRACE(absl::StrCat("rank ", r));
        std::vector<float> gather_ref, scatter_ref, avg_ref, exchange_ref;
        for (int s = 0; s < n; ++s) {
          gather_ref.insert(gather_ref.end(), in[s].begin(), in[s].begin() + count);
          exchange_ref.insert(exchange_ref.end(), in[s].begin() + r * count,
                              in[s].begin() + (r + 1) * count);
        }
        for (size_t i = 0; i < count; ++i) {
          scatter_ref.push_back(sum[r * count + i]);
          avg_ref.push_back(sum[r * count + i] * inv_n);
        }
        EXPECT_TRUE(SameBits(gathered[r], gather_ref));
        EXPECT_TRUE(SameBits(gathered_in_place[r], gather_ref));
        EXPECT_TRUE(SameBits(scattered[r], scatter_ref));
        EXPECT_TRUE(SameBits(averaged[r], avg_ref));
        EXPECT_TRUE(SameBits(reduced[r], sum));
        EXPECT_TRUE(SameBits(maxed[r], max));
        EXPECT_TRUE(SameBits(broadcast[r], in[2]));
        EXPECT_TRUE(SameBits(exchanged[r], exchange_ref));
      }
    }
  }
}

// bf16 sums and averages, bit for bit the local backend's (which runs as threads).
TEST(SimCommunicatorTest, Bf16ReductionsMatchTheLocalBackend) {
  constexpr int n = 4;
  constexpr size_t count = 333;
  std::vector<std::vector<uint16_t>> in(n, std::vector<uint16_t>(count * n));
  for (int r = 0; r < n; ++r) {
    const std::vector<float> values = RandomFloats(count * n, 7 + r);
    for (size_t i = 0; i < values.size(); ++i) in[r][i] = FloatToBf16Bits(values[i]);
  }
  auto run = [&](bool sim_backend) {
    std::vector<std::vector<uint16_t>> out(n, std::vector<uint16_t>(count * n + count));
    if (sim_backend) {
      Sim sim(n);
      for (int r = 0; r < n; ++r) {
        EXPECT_TRUE(sim.comms[r]
                        ->AllReduce(in[r].data(), out[r].data(), count * n, DType::kBF16,
                                    *sim.streams[r], {.op = ReduceOp::kAvg})
                        .ok());
        EXPECT_TRUE(sim.comms[r]
                        ->ReduceScatter(in[r].data(), out[r].data() + count * n, count,
                                        DType::kBF16, *sim.streams[r])
                        .ok());
      }
      EXPECT_TRUE(sim.timeline->RunUntilIdle().ok());
      return out;
    }
    std::vector<std::shared_ptr<Communicator>> comms =
        *CreateLocalCommunicators(n, {.timeout = absl::Seconds(30)});
    RunRankThreads(n, [&](int r) {
      std::unique_ptr<Stream> stream = *CreateCallerStream({.name = "local"});
      EXPECT_TRUE(comms[r]
                      ->AllReduce(in[r].data(), out[r].data(), count * n, DType::kBF16, *stream,
                                  {.op = ReduceOp::kAvg})
                      .ok());
      EXPECT_TRUE(
          comms[r]
              ->ReduceScatter(in[r].data(), out[r].data() + count * n, count, DType::kBF16, *stream)
              .ok());
    });
    return out;
  };
  const std::vector<std::vector<uint16_t>> sim = run(true);
  const std::vector<std::vector<uint16_t>> local = run(false);
  for (int r = 0; r < n; ++r) EXPECT_EQ(sim[r], local[r]) << "rank " << r;
  // And against a plain loop: f32 accumulation in rank order, one rounding.
  for (size_t i = 0; i < count; ++i) {
    float acc = Bf16BitsToFloat(in[0][i]);
    for (int s = 1; s < n; ++s) acc += Bf16BitsToFloat(in[s][i]);
    ASSERT_EQ(sim[0][count * n + i], FloatToBf16Bits(acc)) << i;
  }
}

// An all-reduce whose scratch cannot be allocated (a count of 2^57 bytes; the buffers are never
// touched, the allocation comes first) fails with ResourceExhausted on every rank instead of
// terminating the process on std::bad_alloc.
TEST(SimCommunicatorTest, ScratchThatCannotBeAllocatedIsResourceExhaustedOnEveryRank) {
  if (testing::UnderSanitizer()) {
    GTEST_SKIP() << "the sanitizers' allocators report a 2^57-byte request as an error";
  }
  Sim sim(2);
  const size_t count = size_t{1} << 55;  // f32
  const void* input = reinterpret_cast<const void*>(uintptr_t{1} << 40);
  void* output = reinterpret_cast<void*>(uintptr_t{1} << 62);
  std::vector<Work> works;
  for (int r = 0; r < 2; ++r) {
    works.push_back(*sim.comms[r]->AllReduce(input, output, count, DType::kF32, *sim.streams[r]));
  }
  EXPECT_TRUE(sim.timeline->RunUntilIdle().ok());
  for (int r = 0; r < 2; ++r) {
    const absl::Status status = works[r].status();
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
    EXPECT_THAT(status.message(),
                HasSubstr(absl::StrCat("all_reduce #0 on world (rank ", r,
                                       " of 2, sim): cannot allocate the 144115188075855872 bytes "
                                       "of the reduction's scratch")));
  }
}

TEST(SimCommunicatorTest, MismatchFailsOnEveryRankAndMovesNothing) {
  Sim sim(3);
  std::vector<std::vector<float>> in(3, std::vector<float>(8, 1.0f));
  std::vector<std::vector<float>> out(3, std::vector<float>(24, 0.0f));
  std::vector<Work> works;
  for (int r = 0; r < 3; ++r) {
    const size_t count = r == 2 ? 5 : 4;
    works.push_back(
        *sim.comms[r]->AllGather(in[r].data(), out[r].data(), count, DType::kF32, *sim.streams[r]));
  }
  EXPECT_TRUE(sim.timeline->RunUntilIdle().ok());
  for (int r = 0; r < 3; ++r) {
    const absl::Status status = works[r].status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(),
                HasSubstr(absl::StrCat("all_gather #0 on world (rank ", r,
                                       " of 3, sim): ranks disagree on the collective: rank 0 "
                                       "called all_gather(count=4, f32) but rank 2 called "
                                       "all_gather(count=5, f32)")));
    EXPECT_TRUE(IsPeerError(status));
    EXPECT_EQ(out[r], std::vector<float>(24, 0.0f));
    EXPECT_FALSE(sim.comms[r]->status().ok());
  }
}

// A rank that has not issued the collective: the driver reports the stall at once, naming
// the collective and the ranks; once the rank issues it, the timeline goes on.
TEST(SimCommunicatorTest, StallNamesTheCollectiveAndTheRanks) {
  Sim sim(3);
  std::vector<float> data(3, 1.0f);
  std::vector<float> out0(9), out1(9), out2(9);
  ASSERT_TRUE(
      sim.comms[0]->AllGather(data.data(), out0.data(), 3, DType::kF32, *sim.streams[0]).ok());
  sim.Delay(1, Us(2));
  const absl::Status stalled = sim.streams[0]->Synchronize(absl::InfiniteFuture());
  EXPECT_EQ(stalled.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stalled.message(),
            "stream 'rank0': Synchronize: virtual time stalled at +2us: stream 'rank0' waits for "
            "all_gather #0 on world (sim; ranks waiting: 0; not issued: 1, 2)");
  // Rank 1 issues it behind a stream that is blocked: "issued, not reached".
  VirtualAsyncOp gate;
  VirtualAsyncDone open;
  gate.start = [&](absl::Time, VirtualAsyncDone done) { open = std::move(done); };
  gate.describe = [] { return std::string("a gate"); };
  ASSERT_TRUE(sim.timeline->SubmitAsync(*sim.streams[2], std::move(gate)).ok());
  std::shared_ptr<Event> gated = *RecordEvent(*sim.streams[2]);
  ASSERT_TRUE(sim.streams[1]->WaitEvent(*gated).ok());
  ASSERT_TRUE(
      sim.comms[1]->AllGather(data.data(), out1.data(), 3, DType::kF32, *sim.streams[1]).ok());
  EXPECT_THAT(sim.timeline->RunUntilIdle().message(),
              HasSubstr("all_gather #0 on world (sim; ranks waiting: 0; issued, not reached by "
                        "their streams: 1; not issued: 2)"));
  sim.timeline->ScheduleAt(sim.timeline->Now(),
                           [&] { std::move(open)(absl::OkStatus(), sim.timeline->Now()); });
  ASSERT_TRUE(
      sim.comms[2]->AllGather(data.data(), out2.data(), 3, DType::kF32, *sim.streams[2]).ok());
  EXPECT_TRUE(sim.timeline->RunUntilIdle().ok());
  EXPECT_EQ(out0, std::vector<float>(9, 1.0f));
  EXPECT_EQ(sim.timeline->Now(), kEpoch + Us(2) + 2 * (Us(5) + Us(0.012)));
}

// A rank that arrives after the timeout: the waiting ranks fail with DeadlineExceeded naming
// it, at arrival + timeout in virtual time, and the group is aborted.
TEST(SimCommunicatorTest, TimeoutIsVirtual) {
  SimOptions options = Model();
  options.timeout = absl::Seconds(1);
  Sim sim(2, options);
  std::vector<float> data(4, 1.0f), out0(8), out1(8);
  sim.Delay(1, absl::Seconds(10));
  Work w0 = *sim.comms[0]->AllGather(data.data(), out0.data(), 4, DType::kF32, *sim.streams[0]);
  Work w1 = *sim.comms[1]->AllGather(data.data(), out1.data(), 4, DType::kF32, *sim.streams[1]);
  EXPECT_TRUE(sim.timeline->RunUntilIdle().ok());
  EXPECT_EQ(w0.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(w0.status().message(), HasSubstr("timeout after 1s waiting for rank(s) 1"));
  EXPECT_EQ(DoneAt(w0), absl::Seconds(1));
  EXPECT_EQ(w1.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(w1.status().message(), HasSubstr("peer rank 0 aborted"));
  EXPECT_EQ(DoneAt(w1), absl::Seconds(10));
  EXPECT_EQ(out1, std::vector<float>(8, 0.0f));
}

TEST(SimCommunicatorTest, WorkAbortFailsTheGroup) {
  Sim sim(2);
  std::vector<float> data(4, 1.0f), out0(8), out1(8);
  Work w0 = *sim.comms[0]->AllGather(data.data(), out0.data(), 4, DType::kF32, *sim.streams[0]);
  ASSERT_FALSE(sim.timeline->RunUntilIdle().ok());  // rank 1 has not issued it
  w0.Abort();
  Work w1 = *sim.comms[1]->AllGather(data.data(), out1.data(), 4, DType::kF32, *sim.streams[1]);
  EXPECT_TRUE(sim.timeline->RunUntilIdle().ok());
  EXPECT_EQ(w0.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(w1.status().code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(IsPeerError(w1.status()));
  EXPECT_EQ(out0, std::vector<float>(8, 0.0f));
}

TEST(SimCommunicatorTest, OnlyVirtualStreamsOfItsTimeline) {
  Sim sim(1);
  std::unique_ptr<VirtualTimeline> other = std::make_unique<VirtualTimeline>();
  std::unique_ptr<Stream> foreign = *CreateVirtualStream(*other, {.name = "foreign"});
  std::unique_ptr<Stream> host = *CreateHostStream({.name = "host"});
  float x = 1;
  for (Stream* stream : {foreign.get(), host.get()}) {
    absl::StatusOr<Work> work = sim.comms[0]->AllReduce(&x, &x, 1, DType::kF32, *stream);
    EXPECT_EQ(work.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(work.status().message(), HasSubstr("runs only on virtual streams of its timeline"));
  }
  EXPECT_EQ(sim.comms[0]->backend(), "sim");
  EXPECT_EQ(sim.comms[0]->next_seq(), 0u);
  // One rank: completes at its arrival.
  Work one = *sim.comms[0]->AllReduce(&x, &x, 1, DType::kF32, *sim.streams[0]);
  EXPECT_TRUE(one.Wait(absl::InfiniteFuture()).ok());
  EXPECT_EQ(DoneAt(one), absl::ZeroDuration());
  foreign.reset();
}

TEST(SimCommunicatorTest, PhantomRunMovesNothingButTakesTheSameTime) {
  VirtualTimelineOptions timeline_options;
  timeline_options.run_ops = false;
  Sim sim(2, Model(), timeline_options);
  std::vector<float> data(250, 1.0f), out0(500, 0.0f), out1(500, 0.0f);
  Work w0 = *sim.comms[0]->AllGather(data.data(), out0.data(), 250, DType::kF32, *sim.streams[0]);
  Work w1 = *sim.comms[1]->AllGather(data.data(), out1.data(), 250, DType::kF32, *sim.streams[1]);
  EXPECT_TRUE(sim.timeline->RunUntilIdle().ok());
  EXPECT_EQ(DoneAt(w0), Us(6));
  EXPECT_EQ(out0, std::vector<float>(500, 0.0f));
  EXPECT_EQ(out1, std::vector<float>(500, 0.0f));
}

// The base's rule: a communicator runs its collectives in issue order across streams.
TEST(SimCommunicatorTest, IssueOrderAcrossStreams) {
  Sim sim(2);
  std::vector<std::unique_ptr<Stream>> second;
  for (int r = 0; r < 2; ++r) {
    second.push_back(*CreateVirtualStream(*sim.timeline, {.name = absl::StrCat("rank", r, ".b")}));
  }
  std::vector<float> data(250, 1.0f), out(1000);
  std::vector<Work> first_works, second_works;
  for (int r = 0; r < 2; ++r) {
    first_works.push_back(
        *sim.comms[r]->AllGather(data.data(), out.data(), 250, DType::kF32, *sim.streams[r]));
    second_works.push_back(
        *sim.comms[r]->AllGather(data.data(), out.data() + 500, 250, DType::kF32, *second[r]));
  }
  EXPECT_TRUE(sim.timeline->RunUntilIdle().ok());
  EXPECT_EQ(DoneAt(first_works[0]), Us(6));
  EXPECT_EQ(DoneAt(second_works[0]), Us(12));
  second.clear();
}

TEST(SimCommunicatorTest, DupFromOneThreadAndSplitFromThreads) {
  constexpr int n = 4;
  Sim sim(n);
  // Dup: each rank in turn, from this thread, without waiting for the others.
  std::vector<std::shared_ptr<Communicator>> dups;
  for (int r = 0; r < n; ++r) {
    absl::StatusOr<std::shared_ptr<Communicator>> dup =
        sim.comms[r]->Dup(absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(dup.ok()) << dup.status();
    EXPECT_EQ((*dup)->rank(), r);
    EXPECT_EQ((*dup)->size(), n);
    EXPECT_EQ((*dup)->backend(), "sim");
    dups.push_back(*dup);
  }
  EXPECT_EQ(dups[0]->name(), dups[3]->name());
  EXPECT_NE(dups[0]->name(), sim.comms[0]->name());
  std::vector<std::vector<float>> values(n);
  for (int r = 0; r < n; ++r) {
    values[r] = RandomFloats(5, r);
    ASSERT_TRUE(dups[r]
                    ->AllReduce(values[r].data(), values[r].data(), 5, DType::kF32, *sim.streams[r])
                    .ok());
  }
  ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
  for (int r = 1; r < n; ++r) EXPECT_TRUE(SameBits(values[r], values[0]));
  // Its own sequence: the world communicator is still at #0.
  EXPECT_EQ(sim.comms[0]->next_seq(), 0u);
  EXPECT_EQ(dups[0]->next_seq(), 1u);

  // A Split that is not the same Dup on every rank: rank 0's was taken for Dup, rank 1's fails
  // saying so, and the communicator rank 0 got fails its collectives.
  {
    Sim conflict(2);
    absl::StatusOr<std::shared_ptr<Communicator>> dup0 =
        conflict.comms[0]->Split(0, 0, absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(dup0.ok());
    absl::StatusOr<std::shared_ptr<Communicator>> other =
        conflict.comms[1]->Split(1, 1, absl::Now() + absl::Seconds(20));
    EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(other.status().message(), HasSubstr("dup_without_rendezvous"));
    float x = 1;
    Work failed = *(*dup0)->AllReduce(&x, &x, 1, DType::kF32, *conflict.streams[0]);
    EXPECT_EQ(failed.Wait(absl::InfiniteFuture()).code(), absl::StatusCode::kInvalidArgument);
  }

  // A general split is a rendezvous of threads: here, the ProcessMesh 2 x 2, whose first row
  // and column look like Dup to single ranks (hence dup_without_rendezvous = false).
  SimOptions mesh_options = Model();
  mesh_options.dup_without_rendezvous = false;
  Sim mesh_sim(n, mesh_options);
  std::vector<std::optional<ProcessMesh>> meshes(n);
  RunRankThreads(n, [&](int r) {
    absl::StatusOr<ProcessMesh> mesh =
        ProcessMesh::Create(mesh_sim.comms[r], 2, absl::Now() + absl::Seconds(20));
    EXPECT_TRUE(mesh.ok()) << mesh.status();
    if (mesh.ok()) meshes[r] = *std::move(mesh);
  });
  std::vector<float> shard_sum(n), replicate_sum(n);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(meshes[r].has_value());
    EXPECT_EQ(meshes[r]->shard_rank(), r % 2);
    EXPECT_EQ(meshes[r]->replicate_rank(), r / 2);
    shard_sum[r] = replicate_sum[r] = static_cast<float>(1 << r);
    ASSERT_TRUE(meshes[r]
                    ->shard()
                    ->AllReduce(&shard_sum[r], &shard_sum[r], 1, DType::kF32, *mesh_sim.streams[r])
                    .ok());
    ASSERT_TRUE(
        meshes[r]
            ->replicate()
            ->AllReduce(&replicate_sum[r], &replicate_sum[r], 1, DType::kF32, *mesh_sim.streams[r])
            .ok());
  }
  ASSERT_TRUE(mesh_sim.timeline->RunUntilIdle().ok());
  EXPECT_EQ(shard_sum, (std::vector<float>{3, 3, 12, 12}));      // rows {0,1}, {2,3}
  EXPECT_EQ(replicate_sum, (std::vector<float>{5, 10, 5, 10}));  // columns {0,2}, {1,3}

  // A general split that a thread makes alone times out (wall clock), naming the others.
  Sim lonely(2);
  absl::StatusOr<std::shared_ptr<Communicator>> alone =
      lonely.comms[0]->Split(1, 0, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(alone.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(alone.status().message(), HasSubstr("rank(s) 1"));
}

// 64 ranks in one thread: an all-gather, data and time exact.
// Representative mode: one rank of a group of n, completing on its own arrival at arrival + the
// cost of the whole group (SimCollectiveCost for the group's size); the mesh's splits from
// split_call give the representative its rows and columns; Dup of a split works, other splits
// of a split are Unimplemented; bad arguments are errors.
TEST(SimCommunicatorTest, RepresentativeRankCompletesAloneWithTheGroupsCost) {
  constexpr int kWorld = 12, kShard = 4;  // a 3 x 4 mesh
  SimOptions options = Model();
  options.move_data = false;
  options.dup_without_rendezvous = false;
  options.split_call = [](uint64_t split, int rank) {
    return split == 0 ? std::make_pair(rank / kShard, rank) : std::make_pair(rank % kShard, rank);
  };
  auto timeline = *VirtualTimeline::Create({.run_ops = false});
  absl::StatusOr<std::shared_ptr<Communicator>> rep =
      CreateRepresentativeSimCommunicator(*timeline, kWorld, 5, options);
  ASSERT_TRUE(rep.ok()) << rep.status();
  EXPECT_EQ((*rep)->rank(), 5);
  EXPECT_EQ((*rep)->size(), kWorld);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  absl::StatusOr<ProcessMesh> mesh = ProcessMesh::Create(*rep, kShard, deadline);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_EQ(mesh->shard()->size(), kShard);
  EXPECT_EQ(mesh->shard_rank(), 1);
  EXPECT_EQ(mesh->replicate()->size(), kWorld / kShard);
  EXPECT_EQ(mesh->replicate_rank(), 1);
  absl::StatusOr<std::shared_ptr<Communicator>> dup = mesh->shard()->Dup(deadline);
  ASSERT_TRUE(dup.ok()) << dup.status();
  std::unique_ptr<Stream> stream = *CreateVirtualStream(*timeline, {.name = "rep"});
  std::vector<float> buffer(kWorld * 1000), piece(1000);
  StreamOp delay{.name = "compute", .kind = StreamOpKind::kCompute, .duration = Us(7)};
  ASSERT_TRUE(stream->Submit(std::move(delay)).ok());
  Work gather = *mesh->shard()->AllGather(piece.data(), buffer.data(), 333, DType::kF32, *stream);
  Work reduce = *(*dup)->ReduceScatter(buffer.data(), piece.data(), 333, DType::kF32, *stream);
  Work all = *mesh->replicate()->AllReduce(buffer.data(), buffer.data(), 999, DType::kF32, *stream);
  Work world = *(*rep)->Barrier(*stream);
  ASSERT_TRUE(timeline->RunUntilIdle().ok());
  const absl::Duration gather_end =
      Us(7) + SimCollectiveCost(CollectiveKind::kAllGather, 333, DType::kF32, kShard, options);
  const absl::Duration reduce_end =
      gather_end +
      SimCollectiveCost(CollectiveKind::kReduceScatter, 333, DType::kF32, kShard, options);
  const absl::Duration all_end =
      reduce_end +
      SimCollectiveCost(CollectiveKind::kAllReduce, 999, DType::kF32, kWorld / kShard, options);
  const absl::Duration barrier_end =
      all_end + SimCollectiveCost(CollectiveKind::kBarrier, 0, DType::kU8, kWorld, options);
  EXPECT_EQ(DoneAt(gather), gather_end);
  EXPECT_EQ(DoneAt(reduce), reduce_end);
  EXPECT_EQ(DoneAt(all), all_end);
  EXPECT_EQ(DoneAt(world), barrier_end);
  EXPECT_TRUE(world.status().ok());

  // A split of a split other than Dup is not modelled; split_call must agree with the caller.
  absl::StatusOr<std::shared_ptr<Communicator>> sub = mesh->shard()->Split(0, 3, deadline);
  ASSERT_FALSE(sub.ok());
  EXPECT_EQ(sub.status().code(), absl::StatusCode::kUnimplemented) << sub.status();
  absl::StatusOr<std::shared_ptr<Communicator>> wrong = (*rep)->Split(7, 5, deadline);
  ASSERT_FALSE(wrong.ok());
  EXPECT_THAT(wrong.status().message(), HasSubstr("SimOptions.split_call says"));

  // Bad arguments.
  SimOptions moving = options;
  moving.move_data = true;
  EXPECT_THAT(CreateRepresentativeSimCommunicator(*timeline, 4, 0, moving).status().message(),
              HasSubstr("move_data = false"));
  SimOptions no_call = options;
  no_call.split_call = nullptr;
  EXPECT_THAT(CreateRepresentativeSimCommunicator(*timeline, 4, 0, no_call).status().message(),
              HasSubstr("split_call"));
  EXPECT_THAT(CreateRepresentativeSimCommunicator(*timeline, 4, 4, options).status().message(),
              HasSubstr("representative rank 4 is not a rank of a group of 4"));
}

TEST(SimCommunicatorTest, SixtyFourRanksInOneThread) {
  constexpr int n = 64;
  constexpr size_t count = 1001;
  const absl::Time wall_start = absl::Now();
  Sim sim(n);
  std::vector<std::vector<float>> in(n), out(n, std::vector<float>(count * n));
  std::vector<Work> works;
  for (int r = 0; r < n; ++r) {
    in[r] = RandomFloats(count, r);
    works.push_back(
        *sim.comms[r]->AllGather(in[r].data(), out[r].data(), count, DType::kF32, *sim.streams[r]));
  }
  const int64_t blocking_before = sim.timeline->host_blocking_runs();
  ASSERT_TRUE(works[n - 1].Wait(absl::InfiniteFuture()).ok());
  EXPECT_EQ(sim.timeline->host_blocking_runs(), blocking_before + 1);
  ASSERT_TRUE(sim.timeline->RunUntilIdle().ok());
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(DoneAt(works[r]), 63 * (Us(5) + Us(4.004)));
    for (int s = 0; s < n; ++s) {
      ASSERT_EQ(std::memcmp(out[r].data() + s * count, in[s].data(), count * sizeof(float)), 0)
          << r << " " << s;
    }
  }
  EXPECT_LT(absl::Now() - wall_start, absl::Seconds(10));
}

}  // namespace
}  // namespace shardline
