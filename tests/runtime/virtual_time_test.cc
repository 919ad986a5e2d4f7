// Virtual-time streams (runtime/virtual_time.h): the cost model, FIFO order and cross-stream
// waits at exact virtual times, determinism, poisoning and cancel, stalls, virtual deadlines and
// wait timeouts, OnComplete order, trace spans at virtual times, phantom runs (run_ops=false),
// re-entrancy and the host-blocking counter.

#include "runtime/virtual_time.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "runtime/clock.h"
#include "runtime/stream.h"
#include "runtime/trace.h"

namespace shardline {
namespace {

using ::testing::HasSubstr;

constexpr absl::Time kEpoch = absl::UnixEpoch();
absl::Time At(absl::Duration d) { return kEpoch + d; }
absl::Duration Us(double us) { return absl::Nanoseconds(us * 1000); }

// Rates that make costs round numbers: 1 byte or flop per ns.
VirtualTimelineOptions UnitRates() {
  VirtualTimelineOptions options;
  options.copy_bytes_per_s = 1e9;
  options.cast_bytes_per_s = 0.5e9;
  options.reduce_bytes_per_s = 0.25e9;
  options.fill_bytes_per_s = 2e9;
  options.collective_bytes_per_s = 1e9;
  options.compute_flops_per_s = 1e9;
  return options;
}

std::unique_ptr<VirtualTimeline> MakeTimeline(VirtualTimelineOptions options = UnitRates()) {
  absl::StatusOr<std::unique_ptr<VirtualTimeline>> timeline =
      VirtualTimeline::Create(std::move(options));
  EXPECT_TRUE(timeline.ok()) << timeline.status();
  return *std::move(timeline);
}

std::unique_ptr<Stream> MakeStream(VirtualTimeline& timeline, std::string name,
                                   StreamOptions options = {}) {
  options.name = std::move(name);
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateVirtualStream(timeline, options);
  EXPECT_TRUE(stream.ok()) << stream.status();
  return *std::move(stream);
}

// An op that appends "<name>@<virtual time of its run>" to `log`.
StreamOp LoggedOp(std::string name, StreamOpKind kind, uint64_t amount, VirtualTimeline& timeline,
                  std::vector<std::string>* log, absl::Duration duration = absl::ZeroDuration()) {
  StreamOp op;
  op.name = name;
  op.kind = kind;
  if (kind == StreamOpKind::kCompute) {
    op.flops = amount;
  } else {
    op.bytes = amount;
  }
  op.duration = duration;
  op.run = [name, &timeline, log]() {
    log->push_back(absl::StrCat(name, "@", absl::FormatDuration(timeline.Now() - kEpoch)));
    return absl::OkStatus();
  };
  return op;
}

absl::Duration CompletedAt(const Event& event) {
  std::optional<absl::Time> at = event.completed_at();
  EXPECT_TRUE(at.has_value());
  return at.has_value() ? *at - kEpoch : absl::InfiniteDuration();
}

TEST(VirtualTimeTest, CostModel) {
  std::unique_ptr<VirtualTimeline> timeline = MakeTimeline();
  StreamOp op;
  op.kind = StreamOpKind::kCopy;
  op.bytes = 1000;
  EXPECT_EQ(timeline->OpDuration(op), Us(1));
  op.kind = StreamOpKind::kCast;
  EXPECT_EQ(timeline->OpDuration(op), Us(2));
  op.kind = StreamOpKind::kReduce;
  EXPECT_EQ(timeline->OpDuration(op), Us(4));
  op.kind = StreamOpKind::kFill;
  EXPECT_EQ(timeline->OpDuration(op), Us(0.5));
  op.kind = StreamOpKind::kCollective;
  EXPECT_EQ(timeline->OpDuration(op), Us(1));
  op.kind = StreamOpKind::kHost;
  EXPECT_EQ(timeline->OpDuration(op), absl::ZeroDuration());
  op.kind = StreamOpKind::kCompute;
  op.flops = 3000;
  EXPECT_EQ(timeline->OpDuration(op), Us(3));
  op.duration = Us(7);  // declared: the model is not consulted
  EXPECT_EQ(timeline->OpDuration(op), Us(7));

  VirtualTimelineOptions options = UnitRates();
  options.op_overhead = Us(0.25);
  std::unique_ptr<VirtualTimeline> with_overhead = MakeTimeline(options);
  op.duration = absl::ZeroDuration();
  EXPECT_EQ(with_overhead->OpDuration(op), Us(3.25));
  op.kind = StreamOpKind::kHost;
  EXPECT_EQ(with_overhead->OpDuration(op), Us(0.25));

  options = UnitRates();
  options.fill_bytes_per_s = 0;
  EXPECT_THAT(VirtualTimeline::Create(options).status().message(), HasSubstr("fill_bytes_per_s"));
  options = UnitRates();
  options.op_overhead = -Us(1);
  EXPECT_EQ(VirtualTimeline::Create(options).status().code(), absl::StatusCode::kInvalidArgument);

  ManualClock manual;
  absl::StatusOr<std::unique_ptr<Stream>> wrong_clock =
      CreateVirtualStream(*timeline, {.name = "s", .clock = &manual});
  EXPECT_EQ(wrong_clock.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong_clock.status().message(), HasSubstr("manual"));
}

// Two streams: FIFO on each, a cross-stream wait, run closures at their virtual start times,
// events at their virtual completion times. Nothing runs before the engine is driven.
TEST(VirtualTimeTest, FifoAndCrossStreamWaitAtExactTimes) {
  std::unique_ptr<VirtualTimeline> timeline = MakeTimeline();
  std::unique_ptr<Stream> a = MakeStream(*timeline, "a");
  std::unique_ptr<Stream> b = MakeStream(*timeline, "b");
  EXPECT_EQ(&a->clock(), timeline.get());
  EXPECT_TRUE(timeline->Owns(*a));
  std::vector<std::string> log;

  ASSERT_TRUE(a->Submit(LoggedOp("copy", StreamOpKind::kCopy, 1000, *timeline, &log)).ok());
  absl::StatusOr<std::shared_ptr<Event>> after_copy = RecordEvent(*a);
  ASSERT_TRUE(after_copy.ok());
  ASSERT_TRUE(a->Submit(LoggedOp("compute", StreamOpKind::kCompute, 2000, *timeline, &log)).ok());
  ASSERT_TRUE(a->Submit(LoggedOp("declared", StreamOpKind::kHost, 0, *timeline, &log, Us(5))).ok());
  absl::StatusOr<std::shared_ptr<Event>> a_done = RecordEvent(*a);
  ASSERT_TRUE(a_done.ok());

  ASSERT_TRUE(b->Submit(LoggedOp("b0", StreamOpKind::kCast, 200, *timeline, &log)).ok());  // 0.4us
  ASSERT_TRUE(b->WaitEvent(**after_copy).ok());
  ASSERT_TRUE(b->Submit(LoggedOp("b1", StreamOpKind::kReduce, 750, *timeline, &log)).ok());  // 3us
  absl::StatusOr<std::shared_ptr<Event>> b_done = RecordEvent(*b);
  ASSERT_TRUE(b_done.ok());
  ASSERT_TRUE(b->WaitEvent(**a_done).ok());
  ASSERT_TRUE(b->Submit(LoggedOp("b2", StreamOpKind::kFill, 2000, *timeline, &log)).ok());  // 1us

  // Nothing has run: no thread.
  EXPECT_TRUE(log.empty());
  EXPECT_EQ(*(*a_done)->Query(), false);
  EXPECT_EQ(timeline->Now(), kEpoch);

  ASSERT_TRUE(b->Synchronize(absl::InfiniteFuture()).ok());
  EXPECT_THAT(log, ::testing::ElementsAre("copy@0", "b0@0", "compute@1us", "b1@1us", "declared@3us",
                                          "b2@8us"));
  EXPECT_EQ(CompletedAt(**after_copy), Us(1));
  EXPECT_EQ(CompletedAt(**b_done), Us(4));
  EXPECT_EQ(CompletedAt(**a_done), Us(8));
  EXPECT_EQ(timeline->Now(), At(Us(9)));
  EXPECT_EQ(*ElapsedBetween(**after_copy, **a_done), Us(7));
  EXPECT_EQ((*a_done)->recorded_stream_id(), a->id());
  EXPECT_TRUE(timeline->RunUntilIdle().ok());
}

// A scenario with several streams, random costs and waits; two runs give the same timeline.
std::vector<std::string> RunScenario(uint32_t seed, std::string* trace_json) {
  std::unique_ptr<VirtualTimeline> timeline = MakeTimeline();
  TraceWriter trace(/*rank=*/0);
  std::vector<std::unique_ptr<Stream>> streams;
  for (int s = 0; s < 4; ++s) {
    streams.push_back(MakeStream(*timeline, absl::StrCat("s", s), {.trace = &trace}));
  }
  std::vector<std::string> log;
  std::vector<std::shared_ptr<Event>> events;
  std::mt19937 rng(seed);
  for (int i = 0; i < 200; ++i) {
    Stream& stream = *streams[rng() % streams.size()];
    const uint32_t choice = rng() % 4;
    if (choice == 0 && !events.empty()) {
      EXPECT_TRUE(stream.WaitEvent(*events[rng() % events.size()]).ok());
    } else if (choice == 1) {
      absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(stream);
      EXPECT_TRUE(event.ok());
      events.push_back(*event);
    } else {
      const auto kind = static_cast<StreamOpKind>(1 + rng() % 4);
      EXPECT_TRUE(stream
                      .Submit(LoggedOp(absl::StrCat(stream.name(), ".op", i), kind,
                                       1 + rng() % 5000, *timeline, &log))
                      .ok());
    }
  }
  EXPECT_TRUE(timeline->RunUntilIdle().ok());
  for (const std::shared_ptr<Event>& event : events) {
    log.push_back(absl::StrCat("event@", absl::FormatDuration(CompletedAt(*event))));
  }
  log.push_back(absl::StrCat("end@", absl::FormatDuration(timeline->Now() - kEpoch)));
  *trace_json = trace.ToJson();
  streams.clear();
  return log;
}

TEST(VirtualTimeTest, SameCallsGiveTheSameTimeline) {
  std::string trace1, trace2, trace3;
  const std::vector<std::string> first = RunScenario(7, &trace1);
  const std::vector<std::string> second = RunScenario(7, &trace2);
  EXPECT_EQ(first, second);
  EXPECT_EQ(trace1, trace2);
  EXPECT_GT(first.size(), 100u);
  // A different scenario gives a different timeline (the comparison above means something).
  EXPECT_NE(RunScenario(8, &trace3), first);
}

TEST(VirtualTimeTest, PoisonPropagatesThroughWaitsAndDroppedOpsAreCancelled) {
  std::unique_ptr<VirtualTimeline> timeline = MakeTimeline();
  std::unique_ptr<Stream> a = MakeStream(*timeline, "a");
  std::unique_ptr<Stream> b = MakeStream(*timeline, "b");
  std::vector<std::string> log;

  StreamOp failing;
  failing.name = "failing";
  failing.duration = Us(2);
  failing.run = [] { return absl::DataLossError("boom"); };
  ASSERT_TRUE(a->Submit(std::move(failing)).ok());
  std::vector<std::string> cancelled;
  auto cancellable = [&](std::string name) {
    StreamOp op = LoggedOp(name, StreamOpKind::kHost, 0, *timeline, &log, Us(1));
    op.cancel = [&cancelled, name](const absl::Status& poison) {
      cancelled.push_back(absl::StrCat(name, ": ", poison.message()));
    };
    return op;
  };
  ASSERT_TRUE(a->Submit(cancellable("a1")).ok());
  absl::StatusOr<std::shared_ptr<Event>> a_event = RecordEvent(*a);
  ASSERT_TRUE(a_event.ok());
  ASSERT_TRUE(b->Submit(LoggedOp("b0", StreamOpKind::kHost, 0, *timeline, &log, Us(1))).ok());
  ASSERT_TRUE(b->WaitEvent(**a_event).ok());
  ASSERT_TRUE(b->Submit(cancellable("b1")).ok());
  absl::StatusOr<std::shared_ptr<Event>> b_event = RecordEvent(*b);
  ASSERT_TRUE(b_event.ok());

  const absl::Status synced = b->Synchronize(absl::InfiniteFuture());
  EXPECT_EQ(synced.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(synced.message(), HasSubstr("stream 'a'"));
  EXPECT_THAT(synced.message(), HasSubstr("boom"));
  EXPECT_THAT(log, ::testing::ElementsAre("b0@0"));
  EXPECT_THAT(cancelled, ::testing::ElementsAre("a1: stream 'a': boom", "b1: stream 'a': boom"));
  EXPECT_EQ(a->status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ((*a_event)->Query().status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ((*b_event)->Query().status().code(), absl::StatusCode::kDataLoss);
  // The failure surfaced at the failing op's end, and travelled along the wait at that time.
  EXPECT_EQ(CompletedAt(**a_event), Us(2));
  EXPECT_EQ(CompletedAt(**b_event), Us(2));

  // A poisoned stream refuses new work without calling its cancel.
  bool called = false;
  StreamOp refused;
  refused.cancel = [&](const absl::Status&) { called = true; };
  EXPECT_EQ(a->Submit(std::move(refused)).code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(called);
  // An event recorded on it completes at once with the failure.
  absl::StatusOr<std::shared_ptr<Event>> late = RecordEvent(*a);
  EXPECT_FALSE(late.ok());
}

// An async op that never ends: everything behind it stalls, and the driver says so at once,
// naming each blocked stream and what it waits for. Ending the op from within the engine
// resumes the timeline.
TEST(VirtualTimeTest, StallIsReportedAtOnceAndNamesWhatEachStreamWaitsFor) {
  std::unique_ptr<VirtualTimeline> timeline = MakeTimeline();
  std::unique_ptr<Stream> a = MakeStream(*timeline, "rank1.gather");
  std::unique_ptr<Stream> b = MakeStream(*timeline, "rank1.compute");
  std::vector<std::string> log;
  ASSERT_TRUE(
      a->Submit(LoggedOp("before", StreamOpKind::kHost, 0, *timeline, &log, Us(1200))).ok());
  VirtualAsyncDone held;
  absl::Time started;
  VirtualAsyncOp async;
  async.name = "gate";
  async.start = [&](absl::Time start, VirtualAsyncDone done) {
    started = start;
    held = std::move(done);
  };
  async.describe = [] { return std::string("the test's gate"); };
  ASSERT_TRUE(timeline->SubmitAsync(*a, std::move(async)).ok());
  absl::StatusOr<std::shared_ptr<Event>> gated = RecordEvent(*a);
  ASSERT_TRUE(gated.ok());
  ASSERT_TRUE(b->WaitEvent(**gated).ok());
  ASSERT_TRUE(b->Submit(LoggedOp("after", StreamOpKind::kHost, 0, *timeline, &log, Us(1))).ok());

  const absl::Status stalled = b->Synchronize(At(absl::Seconds(1000)));
  EXPECT_EQ(stalled.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stalled.message(),
            "stream 'rank1.compute': Synchronize: virtual time stalled at +1.2ms: stream "
            "'rank1.gather' waits for the test's gate; stream 'rank1.compute' waits for an event "
            "recorded on stream 'rank1.gather'");
  EXPECT_EQ(started, At(Us(1200)));
  EXPECT_EQ(timeline->Now(), At(Us(1200)));  // the stall did not wait out the deadline
  EXPECT_EQ(timeline->RunUntilIdle().code(), absl::StatusCode::kFailedPrecondition);
  // A wrong-stream SubmitAsync is refused.
  std::unique_ptr<Stream> host = *CreateHostStream({.name = "host"});
  VirtualAsyncOp stray;
  stray.start = [](absl::Time, VirtualAsyncDone) {};
  EXPECT_EQ(timeline->SubmitAsync(*host, std::move(stray)).code(),
            absl::StatusCode::kInvalidArgument);

  // End the op from within the engine, 3us after its start (the end is clamped to >= now).
  timeline->ScheduleAt(timeline->Now(),
                       [&] { std::move(held)(absl::OkStatus(), timeline->Now() + Us(3)); });
  ASSERT_TRUE(b->Synchronize(absl::InfiniteFuture()).ok());
  EXPECT_EQ(CompletedAt(**gated), Us(1203));
  EXPECT_THAT(log, ::testing::ElementsAre("before@0", "after@1.203ms"));
}

TEST(VirtualTimeTest, DeadlinesAreVirtual) {
  std::unique_ptr<VirtualTimeline> timeline = MakeTimeline();
  std::unique_ptr<Stream> a = MakeStream(*timeline, "a");
  std::vector<std::string> log;
  ASSERT_TRUE(
      a->Submit(LoggedOp("long", StreamOpKind::kHost, 0, *timeline, &log, absl::Milliseconds(10)))
          .ok());
  absl::StatusOr<std::shared_ptr<Event>> done = RecordEvent(*a);
  ASSERT_TRUE(done.ok());
  const absl::Status early = a->Synchronize(At(absl::Milliseconds(5)));
  EXPECT_EQ(early.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(early.message(), HasSubstr("stream 'a'"));
  EXPECT_THAT(early.message(), HasSubstr("+5ms"));
  EXPECT_EQ(timeline->Now(), At(absl::Milliseconds(5)));  // left at the deadline
  EXPECT_EQ((*done)->Synchronize(At(absl::Milliseconds(9))).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE((*done)->Synchronize(At(absl::Milliseconds(10))).ok());
  EXPECT_EQ(timeline->Now(), At(absl::Milliseconds(10)));
  EXPECT_TRUE(a->Synchronize(kEpoch).ok());  // nothing left: no deadline applies
}

TEST(VirtualTimeTest, WaitTimeoutIsVirtual) {
  std::unique_ptr<VirtualTimeline> timeline = MakeTimeline();
  std::unique_ptr<Stream> slow = MakeStream(*timeline, "slow");
  std::unique_ptr<Stream> waiter =
      MakeStream(*timeline, "waiter", {.wait_timeout = absl::Milliseconds(1)});
  std::vector<std::string> log;
  ASSERT_TRUE(
      slow->Submit(LoggedOp("long", StreamOpKind::kHost, 0, *timeline, &log, absl::Milliseconds(2)))
          .ok());
  absl::StatusOr<std::shared_ptr<Event>> done = RecordEvent(*slow);
  ASSERT_TRUE(done.ok());
  ASSERT_TRUE(waiter->WaitEvent(**done).ok());
  absl::StatusOr<std::shared_ptr<Event>> waited = RecordEvent(*waiter);
  ASSERT_TRUE(waited.ok());
  ASSERT_TRUE(timeline->RunUntilIdle().ok());
  EXPECT_EQ(waiter->status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(waiter->status().message(), HasSubstr("wait_timeout 1ms"));
  EXPECT_THAT(waiter->status().message(), HasSubstr("stream 'slow'"));
  EXPECT_EQ(CompletedAt(**waited), absl::Milliseconds(1));
  EXPECT_TRUE(slow->status().ok());
  EXPECT_EQ(CompletedAt(**done), absl::Milliseconds(2));
}

TEST(VirtualTimeTest, RunUntilFiresTimeoutsAndMovesTheClock) {
  std::unique_ptr<VirtualTimeline> timeline = MakeTimeline();
  std::unique_ptr<Stream> a = MakeStream(*timeline, "a");
  std::vector<std::string> fired;
  timeline->ScheduleAt(
      At(Us(5)), [&] { fired.push_back("timeout@5us"); }, /*progress=*/false);
  timeline->ScheduleAt(At(Us(3)), [&] { fired.push_back("work@3us"); });
  const VirtualTimer dropped = timeline->ScheduleAt(At(Us(4)), [&] { fired.push_back("dropped"); });
  timeline->Cancel(dropped);
  // Only a timeout is left after the work: RunUntilIdle does not fire it.
  ASSERT_TRUE(timeline->RunUntilIdle().ok());
  EXPECT_THAT(fired, ::testing::ElementsAre("work@3us"));
  EXPECT_EQ(timeline->Now(), At(Us(3)));
  ASSERT_TRUE(timeline->RunUntil(At(Us(10))).ok());
  EXPECT_THAT(fired, ::testing::ElementsAre("work@3us", "timeout@5us"));
  EXPECT_EQ(timeline->Now(), At(Us(10)));
}

// OnComplete callbacks run on the driving thread at the capture's virtual time, in time order,
// before Query() reports the completion; one may enqueue more work, which starts at its time.
TEST(VirtualTimeTest, OnCompleteCallbacksRunInVirtualTimeOrderBeforeDone) {
  std::unique_ptr<VirtualTimeline> timeline = MakeTimeline();
  std::unique_ptr<Stream> a = MakeStream(*timeline, "a");
  std::unique_ptr<Stream> b = MakeStream(*timeline, "b");
  std::vector<std::string> log;
  ASSERT_TRUE(a->Submit(LoggedOp("a0", StreamOpKind::kHost, 0, *timeline, &log, Us(3))).ok());
  std::shared_ptr<Event> late = *RecordEvent(*a);
  ASSERT_TRUE(b->Submit(LoggedOp("b0", StreamOpKind::kHost, 0, *timeline, &log, Us(1))).ok());
  std::shared_ptr<Event> early = *RecordEvent(*b);
  late->OnComplete([&](absl::Status status) {
    log.push_back(absl::StrCat("late cb@", absl::FormatDuration(timeline->Now() - kEpoch),
                               " done=", *late->Query() ? 1 : 0));
  });
  early->OnComplete([&](absl::Status status) {
    log.push_back(absl::StrCat("early cb@", absl::FormatDuration(timeline->Now() - kEpoch),
                               " done=", *early->Query() ? 1 : 0));
    // Work enqueued from a callback starts at the callback's time.
    EXPECT_TRUE(
        b->Submit(LoggedOp("from cb", StreamOpKind::kHost, 0, *timeline, &log, Us(1))).ok());
    // Driving from here would be re-entrant.
    const absl::Status reentrant = late->Synchronize(absl::InfiniteFuture());
    EXPECT_EQ(reentrant.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(reentrant.message(), HasSubstr("inside an op or callback"));
  });
  ASSERT_TRUE(timeline->RunUntilIdle().ok());
  EXPECT_THAT(log, ::testing::ElementsAre("a0@0", "b0@0", "early cb@1us done=0", "from cb@1us",
                                          "late cb@3us done=0"));
  // On a completed event a callback runs at once, here.
  bool ran = false;
  early->OnComplete([&](absl::Status status) { ran = status.ok(); });
  EXPECT_TRUE(ran);
}

TEST(VirtualTimeTest, ReentrantSynchronizeFromAnOpFails) {
  std::unique_ptr<VirtualTimeline> timeline = MakeTimeline();
  std::unique_ptr<Stream> a = MakeStream(*timeline, "a");
  absl::Status inner;
  StreamOp op;
  op.duration = Us(1);
  op.run = [&] {
    inner = a->Synchronize(absl::InfiniteFuture());
    return absl::OkStatus();
  };
  ASSERT_TRUE(a->Submit(std::move(op)).ok());
  ASSERT_TRUE(a->Synchronize(absl::InfiniteFuture()).ok());
  EXPECT_EQ(inner.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(inner.message(), HasSubstr("stream 'a': Synchronize"));
}

TEST(VirtualTimeTest, TraceSpansAtVirtualTimes) {
  std::unique_ptr<VirtualTimeline> timeline = MakeTimeline();
  TraceWriter trace(/*rank=*/3);
  std::unique_ptr<Stream> a = MakeStream(*timeline, "a", {.trace = &trace});
  std::unique_ptr<Stream> b = MakeStream(*timeline, "b", {.trace = &trace, .track = "lane"});
  StreamOp copy;
  copy.name = "copy x";
  copy.kind = StreamOpKind::kCopy;
  copy.bytes = 2500;  // 2.5us
  ASSERT_TRUE(a->Submit(std::move(copy)).ok());
  std::shared_ptr<Event> copied = *RecordEvent(*a);
  ASSERT_TRUE(b->WaitEvent(*copied).ok());
  StreamOp compute;
  compute.name = "matmul";
  compute.kind = StreamOpKind::kCompute;
  compute.flops = 4000;  // 4us
  ASSERT_TRUE(b->Submit(std::move(compute)).ok());
  ASSERT_TRUE(timeline->RunUntilIdle().ok());

  const std::string json = trace.ToJson();
  std::vector<std::string> spans;
  static const std::regex kComplete(
      R"re(\{"ph":"X","pid":3,"tid":(\d+),"name":"([^"]*)","cat":"([^"]*)","ts":([-0-9.]+),"dur":([-0-9.]+),"args":\{(.*)\}\})re");
  for (absl::string_view line : absl::StrSplit(json, '\n')) {
    const std::string text(line);
    std::smatch sm;
    if (!std::regex_search(text, sm, kComplete)) continue;
    spans.push_back(absl::StrCat(sm[1].str(), " ", sm[2].str(), " ", sm[3].str(), " ts=",
                                 sm[4].str(), " dur=", sm[5].str(), " {", sm[6].str(), "}"));
  }
  EXPECT_THAT(spans, ::testing::ElementsAre("1 copy x copy ts=0.000 dur=2.500 {\"bytes\":2500}",
                                            "2 wait a wait ts=0.000 dur=2.500 {}",
                                            "2 matmul compute ts=2.500 dur=4.000 "
                                            "{\"bytes\":0,\"flops\":4000}"))
      << json;
}

TEST(VirtualTimeTest, RunOpsFalseNeverCallsRun) {
  VirtualTimelineOptions options = UnitRates();
  options.run_ops = false;
  std::unique_ptr<VirtualTimeline> timeline = MakeTimeline(options);
  std::unique_ptr<Stream> a = MakeStream(*timeline, "a");
  int runs = 0;
  for (int i = 0; i < 3; ++i) {
    StreamOp op;
    op.kind = StreamOpKind::kCopy;
    op.bytes = 1000;
    op.run = [&runs] {
      ++runs;
      return absl::OkStatus();
    };
    ASSERT_TRUE(a->Submit(std::move(op)).ok());
  }
  ASSERT_TRUE(a->Synchronize(absl::InfiniteFuture()).ok());
  EXPECT_EQ(runs, 0);
  EXPECT_EQ(timeline->Now(), At(Us(3)));
}

TEST(VirtualTimeTest, HostBlockingRunsCountsOnlyCallsThatDrove) {
  std::unique_ptr<VirtualTimeline> timeline = MakeTimeline();
  std::unique_ptr<Stream> a = MakeStream(*timeline, "a");
  std::vector<std::string> log;
  ASSERT_TRUE(a->Submit(LoggedOp("x", StreamOpKind::kHost, 0, *timeline, &log, Us(1))).ok());
  std::shared_ptr<Event> done = *RecordEvent(*a);
  EXPECT_EQ(*done->Query(), false);
  EXPECT_EQ(timeline->host_blocking_runs(), 0);
  EXPECT_EQ(timeline->steps(), 0);
  ASSERT_TRUE(done->Synchronize(absl::InfiniteFuture()).ok());
  EXPECT_EQ(timeline->host_blocking_runs(), 1);
  EXPECT_GT(timeline->steps(), 0);
  ASSERT_TRUE(a->Synchronize(absl::InfiniteFuture()).ok());  // already done: no driving
  ASSERT_TRUE(done->Synchronize(absl::InfiniteFuture()).ok());
  EXPECT_EQ(timeline->host_blocking_runs(), 1);
}

TEST(VirtualTimeTest, ForeignEvents) {
  std::unique_ptr<VirtualTimeline> timeline = MakeTimeline();
  std::unique_ptr<VirtualTimeline> other = MakeTimeline();
  std::unique_ptr<Stream> a = MakeStream(*timeline, "a");
  std::unique_ptr<Stream> elsewhere = MakeStream(*other, "elsewhere");
  std::unique_ptr<Stream> host = *CreateHostStream({.name = "host"});

  // Pending foreign events: refused, naming them.
  std::shared_ptr<Event> pending_other = elsewhere->CreateEvent();
  ASSERT_TRUE(elsewhere->Submit(StreamOp{.duration = Us(1)}).ok());
  ASSERT_TRUE(pending_other->Record(*elsewhere).ok());
  absl::Status refused = a->WaitEvent(*pending_other);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("another timeline, recorded on stream 'elsewhere'"));

  std::shared_ptr<Event> host_event = CreateHostEvent();
  std::mutex mu;
  mu.lock();  // holds the host stream until released
  ASSERT_TRUE(host->Enqueue([&mu] {
                    std::lock_guard<std::mutex> hold(mu);
                    return absl::OkStatus();
                  })
                  .ok());
  ASSERT_TRUE(host_event->Record(*host).ok());
  refused = a->WaitEvent(*host_event);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("a host event recorded on stream 'host'"));
  mu.unlock();
  ASSERT_TRUE(host->Synchronize(absl::Now() + absl::Seconds(20)).ok());

  // Completed ones are fine; a failed one poisons in order.
  ASSERT_TRUE(other->RunUntilIdle().ok());
  EXPECT_TRUE(a->WaitEvent(*pending_other).ok());
  EXPECT_TRUE(a->WaitEvent(*host_event).ok());
  mu.lock();  // the failure comes after the record
  ASSERT_TRUE(host->Enqueue([&mu] {
                    std::lock_guard<std::mutex> hold(mu);
                    return absl::UnavailableError("host failed");
                  })
                  .ok());
  std::shared_ptr<Event> failed = *RecordEvent(*host);
  mu.unlock();
  ASSERT_EQ(failed->Synchronize(absl::Now() + absl::Seconds(20)).code(),
            absl::StatusCode::kUnavailable);
  ASSERT_TRUE(a->Submit(StreamOp{.duration = Us(1)}).ok());
  ASSERT_TRUE(a->WaitEvent(*failed).ok());
  EXPECT_TRUE(a->status().ok());
  EXPECT_EQ(a->Synchronize(absl::InfiniteFuture()).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(timeline->Now(), At(Us(1)));

  // A virtual event records only on a virtual stream of its own timeline.
  EXPECT_EQ(a->CreateEvent()->Record(*elsewhere).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a->CreateEvent()->Record(*host).code(), absl::StatusCode::kInvalidArgument);
}

TEST(VirtualTimeTest, DestroyingAStreamLetsItsWorkFinishOrCancelsIt) {
  std::unique_ptr<VirtualTimeline> timeline = MakeTimeline();
  std::vector<std::string> log;
  std::shared_ptr<Event> finished;
  {
    std::unique_ptr<Stream> a = MakeStream(*timeline, "a");
    ASSERT_TRUE(a->Submit(LoggedOp("x", StreamOpKind::kHost, 0, *timeline, &log, Us(2))).ok());
    finished = *RecordEvent(*a);
  }
  EXPECT_THAT(log, ::testing::ElementsAre("x@0"));
  EXPECT_EQ(CompletedAt(*finished), Us(2));

  // Stalled behind an async op that never ends: the rest is cancelled.
  std::string cancelled;
  std::shared_ptr<Event> never;
  {
    std::unique_ptr<Stream> b = MakeStream(*timeline, "b");
    VirtualAsyncOp stuck;
    stuck.start = [](absl::Time, VirtualAsyncDone) {};
    ASSERT_TRUE(timeline->SubmitAsync(*b, std::move(stuck)).ok());
    StreamOp op;
    op.cancel = [&](const absl::Status& status) { cancelled = std::string(status.message()); };
    ASSERT_TRUE(b->Submit(std::move(op)).ok());
    never = *RecordEvent(*b);
  }
  EXPECT_THAT(cancelled, HasSubstr("virtual stream 'b' was destroyed with this work pending"));
  EXPECT_EQ(never->Query().status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace shardline
