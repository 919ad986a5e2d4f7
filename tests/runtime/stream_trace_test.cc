// Timing and tracing of streams: StreamOptions::trace spans (ops and waits, at execution time, on
// the stream's clock), Event::completed_at and ElapsedBetween.

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "runtime/clock.h"
#include "runtime/stream.h"
#include "runtime/trace.h"
#include "tests/common/gate.h"
#include "tests/runtime/manual_event.h"

namespace shardline {
namespace {

using ::shardline::testing::BlockOn;
using ::shardline::testing::Gate;
using ::testing::HasSubstr;

absl::Time Soon() { return absl::Now() + absl::Seconds(20); }

// One complete ("X") event of a trace file, as TraceWriter writes it: one event per line.
struct Span {
  int tid = 0;
  std::string name;
  std::string category;
  double ts_us = 0;
  double dur_us = 0;
  std::string args;  // the args object's body, e.g. "bytes":400
};

// The complete events of `json` in file order. Our writer puts one event per line; the test's
// names contain no characters that JSON escapes. (trace_test checks the writer's JSON with an
// independent parser.)
std::vector<Span> ParseSpans(const std::string& json) {
  static const std::regex kComplete(
      R"re(\{"ph":"X","pid":\d+,"tid":(\d+),"name":"([^"]*)","cat":"([^"]*)","ts":([-0-9.]+),"dur":([-0-9.]+),"args":\{(.*)\}\},?$)re");
  std::vector<Span> spans;
  for (absl::string_view line : absl::StrSplit(json, '\n')) {
    const std::string text(line);
    std::smatch sm;
    if (!std::regex_search(text, sm, kComplete)) continue;
    Span span;
    span.tid = std::stoi(sm[1]);
    span.name = sm[2];
    span.category = sm[3];
    span.ts_us = std::stod(sm[4]);
    span.dur_us = std::stod(sm[5]);
    span.args = sm[6];
    spans.push_back(span);
  }
  return spans;
}

std::vector<Span> OnTrack(const std::vector<Span>& spans, int tid) {
  std::vector<Span> out;
  for (const Span& span : spans) {
    if (span.tid == tid) out.push_back(span);
  }
  return out;
}

std::string WriteAndRead(const TraceWriter& trace, const std::string& file) {
  // Named for this process: test binaries of several build directories may run at once.
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/shardline_stream_trace_test_", getpid(), "_", file);
  EXPECT_TRUE(trace.WriteFile(path).ok());
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

StreamOp MakeOp(std::string name, StreamOpKind kind, uint64_t bytes, StreamOp::Run run) {
  StreamOp op;
  op.name = std::move(name);
  op.kind = kind;
  op.bytes = bytes;
  op.run = std::move(run);
  return op;
}

absl::Status Ok() { return absl::OkStatus(); }

// A host stream emits one span per op, on its worker, in stream order, with the op's name, kind
// and bytes; a wait for another stream's pending event shows as "wait <stream>" between them.
TEST(StreamTraceTest, HostStreamSpansOpsAndWaitsInOrder) {
  TraceWriter trace(/*rank=*/0);
  std::unique_ptr<Stream> gather =
      *CreateHostStream({.name = "gather", .wait_timeout = absl::Seconds(20), .trace = &trace});
  std::unique_ptr<Stream> compute = *CreateHostStream(
      {.name = "compute", .wait_timeout = absl::Seconds(20), .trace = &trace, .track = "lane 2"});

  Gate gate;
  ASSERT_TRUE(compute->Enqueue(BlockOn(gate)).ok());
  std::shared_ptr<Event> computed = *RecordEvent(*compute);

  ASSERT_TRUE(gather->Submit(MakeOp("cast f32->bf16", StreamOpKind::kCast, 400, Ok)).ok());
  // The compute stream is held at the gate: this wait is pending when enqueued.
  ASSERT_TRUE(gather->WaitEvent(*computed).ok());
  ASSERT_TRUE(gather->Submit(MakeOp("all_gather #1", StreamOpKind::kCollective, 4096, Ok)).ok());
  ASSERT_TRUE(gather->Submit(MakeOp("reduce sum f32", StreamOpKind::kReduce, 800, Ok)).ok());
  gate.Open();
  ASSERT_TRUE(gather->Synchronize(Soon()).ok());
  ASSERT_TRUE(compute->Synchronize(Soon()).ok());

  const std::vector<Span> spans = ParseSpans(WriteAndRead(trace, "host_stream_trace.json"));
  const std::vector<Span> lane = OnTrack(spans, trace.Track("gather"));
  ASSERT_EQ(lane.size(), 4u);
  EXPECT_EQ(lane[0].name, "cast f32->bf16");
  EXPECT_EQ(lane[0].category, "cast");
  EXPECT_EQ(lane[0].args, R"("bytes":400)");
  EXPECT_EQ(lane[1].name, "wait compute");
  EXPECT_EQ(lane[1].category, "wait");
  EXPECT_EQ(lane[2].name, "all_gather #1");
  EXPECT_EQ(lane[2].category, "collective");
  EXPECT_EQ(lane[2].args, R"("bytes":4096)");
  EXPECT_EQ(lane[3].name, "reduce sum f32");
  EXPECT_EQ(lane[3].category, "reduce");
  EXPECT_EQ(lane[3].args, R"("bytes":800)");
  // In order and not overlapping (timestamps are printed to a nanosecond; doubles of wall-clock
  // microseconds keep a fraction of one).
  for (size_t i = 0; i + 1 < lane.size(); ++i) {
    EXPECT_GE(lane[i].dur_us, 0);
    EXPECT_LE(lane[i].ts_us + lane[i].dur_us, lane[i + 1].ts_us + 0.5) << i;
  }
  // The compute stream's op is on its own track, named by StreamOptions::track.
  const std::vector<Span> other = OnTrack(spans, trace.Track("lane 2"));
  ASSERT_EQ(other.size(), 1u);
  EXPECT_EQ(other[0].name, "host work");
  EXPECT_EQ(other[0].category, "host");
  // The gated op ends before the gather stream's wait does.
  EXPECT_LE(other[0].ts_us + other[0].dur_us, lane[1].ts_us + lane[1].dur_us + 0.5);
}

// On a ManualClock, spans are virtual time read when the op runs: each op advances the clock by a
// known amount, so every span has exactly that duration and starts where the previous ended,
// although all were submitted at the start. Host and caller streams alike.
TEST(StreamTraceTest, ManualClockSpansHaveTheVirtualDurations) {
  for (bool host : {true, false}) {
    SCOPED_TRACE(host ? "host stream" : "caller stream");
    const absl::Time t0 = absl::FromUnixSeconds(1000);
    ManualClock clock(t0);
    TraceWriter trace(/*rank=*/1);
    StreamOptions options{.name = "virtual", .clock = &clock, .trace = &trace};
    std::unique_ptr<Stream> stream =
        host ? *CreateHostStream(options) : *CreateCallerStream(options);
    const absl::Duration costs[] = {absl::Microseconds(250), absl::Milliseconds(1),
                                    absl::Microseconds(3500)};
    const StreamOpKind kinds[] = {StreamOpKind::kFill, StreamOpKind::kCopy, StreamOpKind::kCompute};
    for (int i = 0; i < 3; ++i) {
      StreamOp op =
          MakeOp(absl::StrCat("op ", i), kinds[i], 1000 * (i + 1), [&clock, cost = costs[i]] {
            clock.Advance(cost);
            return absl::OkStatus();
          });
      if (i == 2) op.flops = 12345;
      ASSERT_TRUE(stream->Submit(std::move(op)).ok());
    }
    ASSERT_TRUE(stream->Synchronize(clock.Now() + absl::Hours(1)).ok());

    const std::vector<Span> spans =
        OnTrack(ParseSpans(WriteAndRead(trace, "manual_clock_trace.json")), trace.Track("virtual"));
    ASSERT_EQ(spans.size(), 3u);
    absl::Time start = t0;
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(spans[i].name, absl::StrCat("op ", i));
      EXPECT_EQ(spans[i].category, StreamOpKindName(kinds[i]));
      EXPECT_EQ(spans[i].ts_us, absl::ToDoubleMicroseconds(start - absl::UnixEpoch())) << i;
      EXPECT_EQ(spans[i].dur_us, absl::ToDoubleMicroseconds(costs[i])) << i;
      start += costs[i];
    }
    EXPECT_EQ(spans[2].args, R"("bytes":3000,"flops":12345)");
  }
}

// A caller stream's wait for a pending event is a span on the calling thread, on its clock.
TEST(StreamTraceTest, CallerStreamWaitIsASpan) {
  ManualClock clock(absl::FromUnixSeconds(50));
  TraceWriter trace(/*rank=*/0);
  std::unique_ptr<Stream> producer = *CreateHostStream({.name = "producer", .clock = &clock});
  std::unique_ptr<Stream> caller = *CreateCallerStream(
      {.name = "caller", .wait_timeout = absl::Seconds(20), .clock = &clock, .trace = &trace});
  Gate gate;
  ASSERT_TRUE(producer
                  ->Enqueue([&] {
                    gate.Wait();
                    clock.Advance(absl::Milliseconds(7));
                    return absl::OkStatus();
                  })
                  .ok());
  std::shared_ptr<Event> produced = *RecordEvent(*producer);
  // The gate opens once the caller is blocked in its wait (on the clock), so the wait is
  // pending when it starts.
  std::thread opener([&] {
    const absl::Time give_up = Soon();
    while (clock.waiters() == 0 && absl::Now() < give_up) std::this_thread::yield();
    gate.Open();
  });
  ASSERT_TRUE(caller->WaitEvent(*produced).ok());
  opener.join();
  const std::vector<Span> spans =
      OnTrack(ParseSpans(WriteAndRead(trace, "caller_wait_trace.json")), trace.Track("caller"));
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].name, "wait producer");
  EXPECT_EQ(spans[0].category, "wait");
  EXPECT_EQ(spans[0].ts_us, 50e6);
  EXPECT_EQ(spans[0].dur_us, 7000);
}

// A failing op's span carries the error; the ops the poisoned stream drops make none; a wait for
// an event that is already complete makes none either.
TEST(StreamTraceTest, FailedOpIsTracedAndDroppedOpsAreNot) {
  TraceWriter trace(/*rank=*/0);
  std::unique_ptr<Stream> stream =
      *CreateHostStream({.name = "failing", .wait_timeout = absl::Seconds(20), .trace = &trace});
  std::unique_ptr<Stream> idle = *CreateHostStream({.name = "idle"});
  std::shared_ptr<Event> done = *RecordEvent(*idle);
  ASSERT_TRUE(done->Synchronize(Soon()).ok());
  ASSERT_TRUE(stream->WaitEvent(*done).ok());
  ASSERT_TRUE(stream
                  ->Submit(MakeOp("bad", StreamOpKind::kHost, 8,
                                  [] { return absl::InternalError("boom"); }))
                  .ok());
  (void)stream->Submit(MakeOp("dropped", StreamOpKind::kHost, 8, Ok));
  EXPECT_EQ(stream->Synchronize(Soon()).code(), absl::StatusCode::kInternal);
  const std::vector<Span> spans =
      OnTrack(ParseSpans(WriteAndRead(trace, "failed_trace.json")), trace.Track("failing"));
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].name, "bad");
  EXPECT_THAT(spans[0].args, HasSubstr(R"("error":"INTERNAL: boom")"));
}

// completed_at is the recording stream's clock time when the capture completed; ElapsedBetween
// subtracts two of them.
TEST(StreamTraceTest, CompletionTimesFollowTheManualClock) {
  const absl::Time t0 = absl::FromUnixSeconds(2000);
  ManualClock clock(t0);
  std::unique_ptr<Stream> stream = *CreateHostStream({.name = "timed", .clock = &clock});
  auto advance = [&clock](absl::Duration d) {
    return [&clock, d] {
      clock.Advance(d);
      return absl::OkStatus();
    };
  };
  std::shared_ptr<Event> e0 = *RecordEvent(*stream);
  ASSERT_TRUE(stream->Enqueue(advance(absl::Milliseconds(2))).ok());
  std::shared_ptr<Event> e1 = *RecordEvent(*stream);
  ASSERT_TRUE(stream->Enqueue(advance(absl::Milliseconds(3))).ok());
  std::shared_ptr<Event> e2 = *RecordEvent(*stream);
  ASSERT_TRUE(stream->Synchronize(clock.Now() + absl::Hours(1)).ok());

  EXPECT_EQ(e0->completed_at(), t0);
  EXPECT_EQ(e1->completed_at(), t0 + absl::Milliseconds(2));
  EXPECT_EQ(e2->completed_at(), t0 + absl::Milliseconds(5));
  EXPECT_EQ(*ElapsedBetween(*e0, *e1), absl::Milliseconds(2));
  EXPECT_EQ(*ElapsedBetween(*e1, *e2), absl::Milliseconds(3));
  EXPECT_EQ(*ElapsedBetween(*e2, *e0), -absl::Milliseconds(5));

  // Pending: no time yet, and ElapsedBetween names the end that lacks one.
  Gate gate;
  ASSERT_TRUE(stream->Enqueue(BlockOn(gate)).ok());
  std::shared_ptr<Event> pending = *RecordEvent(*stream);
  EXPECT_EQ(pending->completed_at(), std::nullopt);
  absl::StatusOr<absl::Duration> elapsed = ElapsedBetween(*e0, *pending);
  EXPECT_EQ(elapsed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(elapsed.status().message()), HasSubstr("end event"));
  gate.Open();
  ASSERT_TRUE(pending->Synchronize(clock.Now() + absl::Hours(1)).ok());
  EXPECT_EQ(pending->completed_at(), t0 + absl::Milliseconds(5));

  // Never recorded, or a kind that keeps no time: no time.
  std::shared_ptr<Event> never = stream->CreateEvent();
  EXPECT_EQ(never->completed_at(), std::nullopt);
  auto foreign = testing::ManualEvent::Create();
  foreign->Complete();
  EXPECT_EQ(foreign->completed_at(), std::nullopt);
  elapsed = ElapsedBetween(*foreign, *e0);
  EXPECT_EQ(elapsed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(elapsed.status().message()), HasSubstr("start event"));

  // A failed capture completed too: it has a time.
  ASSERT_TRUE(stream->Enqueue([] { return absl::InternalError("boom"); }).ok());
  std::shared_ptr<Event> failed = stream->CreateEvent();
  (void)failed->Record(*stream);
  EXPECT_EQ(failed->Synchronize(clock.Now() + absl::Hours(1)).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(failed->completed_at(), t0 + absl::Milliseconds(5));

  // A caller stream completes a capture on the recording thread, at its clock's time.
  clock.Advance(absl::Seconds(1));
  std::unique_ptr<Stream> caller = *CreateCallerStream({.name = "inline", .clock = &clock});
  std::shared_ptr<Event> now = *RecordEvent(*caller);
  EXPECT_EQ(now->completed_at(), t0 + absl::Milliseconds(5) + absl::Seconds(1));
}

// On the wall clock, completion times are monotone in stream order and bracketed by the host's
// readings of the clock.
TEST(StreamTraceTest, WallClockCompletionTimesAreMonotone) {
  std::unique_ptr<Stream> stream = *CreateHostStream({.name = "wall"});
  const absl::Time before = absl::Now();
  std::vector<std::shared_ptr<Event>> events;
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(stream->Enqueue(Ok).ok());
    events.push_back(*RecordEvent(*stream));
  }
  ASSERT_TRUE(stream->Synchronize(Soon()).ok());
  const absl::Time after = absl::Now();
  std::optional<absl::Time> last = before;
  for (const std::shared_ptr<Event>& event : events) {
    const std::optional<absl::Time> at = event->completed_at();
    ASSERT_TRUE(at.has_value());
    EXPECT_GE(*at, *last);
    last = at;
  }
  EXPECT_LE(*last, after);
  EXPECT_GE(*ElapsedBetween(*events.front(), *events.back()), absl::ZeroDuration());
}

}  // namespace
}  // namespace shardline
