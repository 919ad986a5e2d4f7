// Host sharing on virtual time (runtime/virtual_sharing.h, VirtualTimelineOptions::host_cores):
// memory ops of streams on one host share its cores by processor sharing; streams without a
// host, ops with a declared duration and timelines without host_cores are unchanged. Random
// workloads are checked against an independent event-by-event processor-sharing reference.

#include "runtime/virtual_sharing.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "runtime/stream.h"
#include "runtime/virtual_time.h"

namespace shardline {
namespace {

using ::testing::HasSubstr;

constexpr absl::Time kEpoch = absl::UnixEpoch();

// 1 byte per ns for every memory op.
VirtualTimelineOptions Options(double host_cores) {
  VirtualTimelineOptions o;
  o.copy_bytes_per_s = 1e9;
  o.cast_bytes_per_s = 1e9;
  o.reduce_bytes_per_s = 1e9;
  o.fill_bytes_per_s = 1e9;
  o.host_cores = host_cores;
  return o;
}

std::unique_ptr<VirtualTimeline> MakeTimeline(double host_cores) {
  absl::StatusOr<std::unique_ptr<VirtualTimeline>> t = VirtualTimeline::Create(Options(host_cores));
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

std::unique_ptr<Stream> OnHost(VirtualTimeline& timeline, const std::string& name, int host) {
  absl::StatusOr<std::unique_ptr<Stream>> s =
      host < 0 ? CreateVirtualStream(timeline, {.name = name})
               : CreateVirtualStream(timeline, {.name = name}, host);
  EXPECT_TRUE(s.ok()) << s.status();
  return *std::move(s);
}

StreamOp Mem(StreamOpKind kind, uint64_t bytes, absl::Duration declared = absl::ZeroDuration()) {
  StreamOp op;
  op.name = "mem";
  op.kind = kind;
  op.bytes = bytes;
  op.duration = declared;
  op.run = [] { return absl::OkStatus(); };
  return op;
}

// Submits `op` and records an event after it; returns the event.
std::shared_ptr<Event> SubmitAndRecord(Stream& s, StreamOp op) {
  EXPECT_TRUE(s.Submit(std::move(op)).ok());
  std::shared_ptr<Event> e = s.CreateEvent();
  EXPECT_TRUE(e->Record(s).ok());
  return e;
}

double EndNs(const Event& e) {
  std::optional<absl::Time> at = e.completed_at();
  EXPECT_TRUE(at.has_value());
  return at.has_value() ? absl::ToDoubleNanoseconds(*at - kEpoch) : -1;
}

TEST(VirtualSharingTest, TwoMemoryOpsOnOneCoreTakeTwiceAsLong) {
  // 1 core: two 1000-byte ops (1 us alone) on two streams of host 0 both end at 2 us.
  {
    std::unique_ptr<VirtualTimeline> t = MakeTimeline(1);
    std::unique_ptr<Stream> a = OnHost(*t, "a", 0), b = OnHost(*t, "b", 0);
    std::shared_ptr<Event> ea = SubmitAndRecord(*a, Mem(StreamOpKind::kCast, 1000));
    std::shared_ptr<Event> eb = SubmitAndRecord(*b, Mem(StreamOpKind::kFill, 1000));
    ASSERT_TRUE(t->RunUntilIdle().ok());
    EXPECT_DOUBLE_EQ(EndNs(*ea), 2000);
    EXPECT_DOUBLE_EQ(EndNs(*eb), 2000);
  }
  // 2 cores: both alone-speed (1 us); a third op makes all three 3/2 as long.
  {
    std::unique_ptr<VirtualTimeline> t = MakeTimeline(2);
    std::unique_ptr<Stream> a = OnHost(*t, "a", 0), b = OnHost(*t, "b", 0);
    std::shared_ptr<Event> ea = SubmitAndRecord(*a, Mem(StreamOpKind::kCopy, 1000));
    std::shared_ptr<Event> eb = SubmitAndRecord(*b, Mem(StreamOpKind::kReduce, 1000));
    ASSERT_TRUE(t->RunUntilIdle().ok());
    EXPECT_DOUBLE_EQ(EndNs(*ea), 1000);
    EXPECT_DOUBLE_EQ(EndNs(*eb), 1000);
    std::unique_ptr<Stream> c = OnHost(*t, "c", 0);
    ea = SubmitAndRecord(*a, Mem(StreamOpKind::kCopy, 1000));
    eb = SubmitAndRecord(*b, Mem(StreamOpKind::kCopy, 1000));
    std::shared_ptr<Event> ec = SubmitAndRecord(*c, Mem(StreamOpKind::kCopy, 1000));
    ASSERT_TRUE(t->RunUntilIdle().ok());
    for (const auto& e : {ea, eb, ec}) EXPECT_NEAR(EndNs(*e), 1000 + 1500, 0.5);
  }
  // Other hosts, streams without a host, declared durations and compute do not share.
  {
    std::unique_ptr<VirtualTimeline> t = MakeTimeline(1);
    std::unique_ptr<Stream> a = OnHost(*t, "a", 0), b = OnHost(*t, "b", 1);
    std::unique_ptr<Stream> c = OnHost(*t, "c", -1), d = OnHost(*t, "d", 0);
    std::unique_ptr<Stream> e = OnHost(*t, "e", 0);
    std::shared_ptr<Event> ea = SubmitAndRecord(*a, Mem(StreamOpKind::kCast, 1000));
    std::shared_ptr<Event> eb = SubmitAndRecord(*b, Mem(StreamOpKind::kCast, 1000));
    std::shared_ptr<Event> ec = SubmitAndRecord(*c, Mem(StreamOpKind::kCast, 1000));
    std::shared_ptr<Event> ed =
        SubmitAndRecord(*d, Mem(StreamOpKind::kCast, 1000, absl::Nanoseconds(700)));
    StreamOp compute;
    compute.kind = StreamOpKind::kCompute;
    compute.flops = 1'000'000;
    std::shared_ptr<Event> ee = SubmitAndRecord(*e, std::move(compute));
    ASSERT_TRUE(t->RunUntilIdle().ok());
    EXPECT_DOUBLE_EQ(EndNs(*ea), 1000);
    EXPECT_DOUBLE_EQ(EndNs(*eb), 1000);
    EXPECT_DOUBLE_EQ(EndNs(*ec), 1000);
    EXPECT_DOUBLE_EQ(EndNs(*ed), 700);
    EXPECT_DOUBLE_EQ(EndNs(*ee), 10);  // 1e6 FLOPs at the default 100 TFLOP/s
  }
  // Without host_cores a host stream's ops take their time alone.
  {
    std::unique_ptr<VirtualTimeline> t = MakeTimeline(0);
    std::unique_ptr<Stream> a = OnHost(*t, "a", 0), b = OnHost(*t, "b", 0);
    std::shared_ptr<Event> ea = SubmitAndRecord(*a, Mem(StreamOpKind::kCast, 1000));
    std::shared_ptr<Event> eb = SubmitAndRecord(*b, Mem(StreamOpKind::kCast, 1000));
    ASSERT_TRUE(t->RunUntilIdle().ok());
    EXPECT_DOUBLE_EQ(EndNs(*ea), 1000);
    EXPECT_DOUBLE_EQ(EndNs(*eb), 1000);
  }
}

TEST(VirtualSharingTest, FlowsWithSeveralThreadsAndPorts) {
  // A flow of 2 threads and one op on a 2-core host: 3 threads, each at 2/3.
  std::unique_ptr<VirtualTimeline> t = MakeTimeline(2);
  std::unique_ptr<Stream> a = OnHost(*t, "a", 0);
  double flow_end = -1;
  ASSERT_TRUE(t->SubmitAsync(*a, {.name = "start",
                                  .start =
                                      [&](absl::Time, VirtualAsyncDone done) {
                                        t->sharing().Start(
                                            {{VirtualSharing::Host(0), 2.0}}, 3e-6,
                                            [&, done = std::move(done)]() mutable {
                                              flow_end =
                                                  absl::ToDoubleNanoseconds(t->Now() - kEpoch);
                                              std::move(done)(absl::OkStatus(), t->Now());
                                            });
                                      }})
                  .ok());
  std::unique_ptr<Stream> b = OnHost(*t, "b", 0);
  std::shared_ptr<Event> eb = SubmitAndRecord(*b, Mem(StreamOpKind::kCopy, 1000));
  ASSERT_TRUE(t->RunUntilIdle().ok());
  // Both at 2/3 until the op ends at 1.5 us (the flow has done 1 us of its 3), then the flow
  // alone at full speed: 2 us more.
  EXPECT_NEAR(EndNs(*eb), 1500, 0.5);
  EXPECT_NEAR(flow_end, 3500, 0.5);
  EXPECT_EQ(t->sharing().active(), 0);
  EXPECT_EQ(t->sharing().load(VirtualSharing::Host(0)), 0);

  // Lock-step: the same flow with its 2 threads in lock-step progresses at (2/3)^2 = 4/9 while
  // the op runs: by 1.5 us it has done 2/3 us of its 3, then 7/3 us alone.
  double lockstep_end = -1;
  const double start_ns = absl::ToDoubleNanoseconds(t->Now() - kEpoch);
  ASSERT_TRUE(t->SubmitAsync(*a, {.name = "lockstep",
                                  .start =
                                      [&](absl::Time, VirtualAsyncDone done) {
                                        t->sharing().Start(
                                            {{VirtualSharing::Host(0), 2.0, 2.0}}, 3e-6,
                                            [&, done = std::move(done)]() mutable {
                                              lockstep_end =
                                                  absl::ToDoubleNanoseconds(t->Now() - kEpoch);
                                              std::move(done)(absl::OkStatus(), t->Now());
                                            });
                                      }})
                  .ok());
  eb = SubmitAndRecord(*b, Mem(StreamOpKind::kCopy, 1000));
  ASSERT_TRUE(t->RunUntilIdle().ok());
  EXPECT_NEAR(EndNs(*eb) - start_ns, 1500, 0.5);
  EXPECT_NEAR(lockstep_end - start_ns, 1500 + 3000 - 1500 * 4.0 / 9.0, 0.5);

  // Ports of a user's own space: capacity 1 each, split equally; spaces are disjoint.
  const uint64_t s1 = t->sharing().NewSpace(), s2 = t->sharing().NewSpace();
  EXPECT_NE(s1, s2);
  EXPECT_EQ(t->sharing().Capacity({s1, 7}), 1.0);
  EXPECT_EQ(t->sharing().Capacity(VirtualSharing::Host(3)), 2.0);
}

TEST(VirtualSharingTest, BadOptionsAreErrors) {
  VirtualTimelineOptions o = Options(-1);
  absl::StatusOr<std::unique_ptr<VirtualTimeline>> t = VirtualTimeline::Create(o);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("host_cores"));
  o.host_cores = std::numeric_limits<double>::infinity();
  EXPECT_THAT(VirtualTimeline::Create(o).status().message(), HasSubstr("host_cores"));
  std::unique_ptr<VirtualTimeline> ok = MakeTimeline(2);
  absl::StatusOr<std::unique_ptr<Stream>> s = CreateVirtualStream(*ok, {.name = "x"}, -2);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("host"));
}

// The reference: each stream is a FIFO of items, either a fixed delay (a declared duration) or
// work shared on the host (ns alone). Event by event: every shared item in progress runs at
// min(1, cores / how many are in progress); the next event is the earliest end.
struct RefItem {
  bool shared = false;
  double ns = 0;
};
std::vector<std::vector<double>> ReferenceEnds(const std::vector<std::vector<RefItem>>& streams,
                                               double cores) {
  const size_t n = streams.size();
  std::vector<std::vector<double>> ends(n);
  std::vector<size_t> next(n, 0);
  std::vector<double> left(n, 0);
  for (size_t i = 0; i < n; ++i) {
    if (!streams[i].empty()) left[i] = streams[i][0].ns;
  }
  double now = 0;
  while (true) {
    int k = 0;
    for (size_t i = 0; i < n; ++i) {
      if (next[i] < streams[i].size() && streams[i][next[i]].shared) ++k;
    }
    const double rate = k > cores ? cores / k : 1.0;
    double step = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < n; ++i) {
      if (next[i] >= streams[i].size()) continue;
      const double r = streams[i][next[i]].shared ? rate : 1.0;
      step = std::min(step, left[i] / r);
    }
    if (step == std::numeric_limits<double>::infinity()) break;
    now += step;
    for (size_t i = 0; i < n; ++i) {
      if (next[i] >= streams[i].size()) continue;
      const double r = streams[i][next[i]].shared ? rate : 1.0;
      left[i] -= step * r;
      if (left[i] <= 1e-6) {
        ends[i].push_back(now);
        if (++next[i] < streams[i].size()) left[i] = streams[i][next[i]].ns;
      }
    }
  }
  return ends;
}

TEST(VirtualSharingTest, RandomWorkloadsMatchTheProcessorSharingReference) {
  std::mt19937_64 rng(0x5a4e);
  for (int trial = 0; trial < 40; ++trial) {
    const double cores = trial % 4 == 3 ? 1.5 : 1 + trial % 3;
    const int nstreams = 2 + static_cast<int>(rng() % 4);
    std::vector<std::vector<RefItem>> ref(nstreams);
    std::unique_ptr<VirtualTimeline> t = MakeTimeline(cores);
    std::vector<std::unique_ptr<Stream>> streams;
    std::vector<std::vector<std::shared_ptr<Event>>> events(nstreams);
    for (int i = 0; i < nstreams; ++i) {
      streams.push_back(OnHost(*t, absl::StrCat("s", i), 0));
      const int items = 1 + static_cast<int>(rng() % 5);
      for (int j = 0; j < items; ++j) {
        // Integer ns so that declared and modelled times are exact.
        const uint64_t ns = 101 + rng() % 3001;
        const bool shared = rng() % 3 != 0;
        const StreamOpKind kinds[] = {StreamOpKind::kCopy, StreamOpKind::kCast,
                                      StreamOpKind::kReduce, StreamOpKind::kFill};
        StreamOp op =
            shared ? Mem(kinds[rng() % 4], ns) : Mem(StreamOpKind::kCopy, 5, absl::Nanoseconds(ns));
        events[i].push_back(SubmitAndRecord(*streams[i], std::move(op)));
        ref[i].push_back({shared, static_cast<double>(ns)});
      }
    }
    ASSERT_TRUE(t->RunUntilIdle().ok());
    const std::vector<std::vector<double>> want = ReferenceEnds(ref, cores);
    for (int i = 0; i < nstreams; ++i) {
      ASSERT_EQ(want[i].size(), events[i].size());
      for (size_t j = 0; j < events[i].size(); ++j) {
        // Virtual time has quarter-nanosecond ticks; every rate change may round once.
        EXPECT_NEAR(EndNs(*events[i][j]), want[i][j], 2.0)
            << "trial " << trial << " stream " << i << " op " << j << " cores " << cores;
      }
    }
  }
}

}  // namespace
}  // namespace shardline
