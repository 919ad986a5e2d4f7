// Host and caller streams, host events: ordering, cross-stream waits, deadlines, poisoning.

#include "runtime/stream.h"
#include "tests/common/gate.h"

#include <sched.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/clock.h"
#include "runtime/config.h"
#include "tests/common/rank_threads.h"
#include "tests/runtime/manual_event.h"

namespace shardline {
namespace {

using ::testing::HasSubstr;

absl::Time Soon() { return absl::Now() + absl::Seconds(20); }

std::unique_ptr<Stream> MakeHost(const std::string& name,
                                 absl::Duration wait_timeout = absl::Seconds(20)) {
  StreamOptions options;
  options.name = name;
  options.wait_timeout = wait_timeout;
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream(options);
  EXPECT_TRUE(stream.ok()) << stream.status();
  return std::move(stream).value();
}

std::unique_ptr<Stream> MakeCaller(const std::string& name,
                                   absl::Duration wait_timeout = absl::Seconds(20)) {
  StreamOptions options;
  options.name = name;
  options.wait_timeout = wait_timeout;
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateCallerStream(options);
  EXPECT_TRUE(stream.ok()) << stream.status();
  return std::move(stream).value();
}

using ::shardline::testing::BlockOn;
using ::shardline::testing::Gate;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

// The stream kinds of the tests whose body holds for both: a host stream (a worker thread and a
// queue) and a caller stream (work runs on the calling thread).
enum class StreamKind { kHost, kCaller };

std::string KindName(const ::testing::TestParamInfo<StreamKind>& info) {
  return info.param == StreamKind::kHost ? "HostStream" : "CallerStream";
}

const auto kBothKinds = ::testing::Values(StreamKind::kHost, StreamKind::kCaller);

// ---------------------------------------------------------------------------------------------
// Ordering stress: 4 host streams x 10,000 ops with random cross-stream waits. Every op takes a
// number from one global atomic counter; afterwards each happens-before edge is checked: FIFO
// order within each stream, and for each wait, the last op enqueued on A before the Record took
// a smaller number than the first op enqueued on B after the WaitEvent.
TEST(HostStreamTest, OrderingStressWithRandomCrossStreamWaits) {
  constexpr int kStreams = 4;
  constexpr int kOpsPerStream = 10000;
  std::mt19937 rng(20240611);
  std::vector<std::unique_ptr<Stream>> streams;
  for (int s = 0; s < kStreams; ++s) streams.push_back(MakeHost("stress" + std::to_string(s)));

  std::atomic<int64_t> clock{0};
  std::vector<std::vector<int64_t>> seq(kStreams, std::vector<int64_t>(kOpsPerStream, -1));
  std::vector<int> enqueued(kStreams, 0);
  struct Edge {
    int a, ops_before;  // ops [0, ops_before) of stream a happen before ...
    int b, ops_after;   // ... ops [ops_after, end) of stream b
  };
  std::vector<Edge> edges;

  std::uniform_int_distribution<int> pick_stream(0, kStreams - 1);
  std::uniform_int_distribution<int> percent(0, 99);
  int remaining = kStreams * kOpsPerStream;
  while (remaining > 0) {
    const int s = pick_stream(rng);
    if (enqueued[s] == kOpsPerStream) continue;
    const int index = enqueued[s]++;
    --remaining;
    // Some ops pause a little so that the streams drift apart and the waits really block.
    const bool pause = percent(rng) == 0;
    ASSERT_TRUE(streams[s]
                    ->Enqueue([&seq, &clock, s, index, pause] {
                      if (pause) absl::SleepFor(absl::Microseconds(50));
                      seq[s][index] = clock.fetch_add(1);
                      return absl::OkStatus();
                    })
                    .ok());
    if (percent(rng) < 3) {
      const int a = pick_stream(rng);
      int b = pick_stream(rng);
      if (b == a) b = (a + 1) % kStreams;
      absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*streams[a]);
      ASSERT_TRUE(event.ok()) << event.status();
      ASSERT_TRUE(streams[b]->WaitEvent(**event).ok());
      edges.push_back({a, enqueued[a], b, enqueued[b]});
    }
  }
  for (auto& stream : streams) ASSERT_TRUE(stream->Synchronize(Soon()).ok());

  for (int s = 0; s < kStreams; ++s) {
    for (int i = 0; i < kOpsPerStream; ++i) {
      ASSERT_GE(seq[s][i], 0) << "op " << i << " of stream " << s << " never ran";
      if (i > 0) {
        ASSERT_LT(seq[s][i - 1], seq[s][i]) << "FIFO broken on stream " << s;
      }
    }
  }
  ASSERT_GT(edges.size(), 100u);
  for (const Edge& e : edges) {
    if (e.ops_before == 0 || e.ops_after == kOpsPerStream) continue;
    EXPECT_LT(seq[e.a][e.ops_before - 1], seq[e.b][e.ops_after])
        << "stream " << e.b << " op " << e.ops_after << " ran before stream " << e.a << " op "
        << e.ops_before - 1 << " that it waited for";
  }
}

TEST(HostStreamTest, RunsWorkInOrderOnOneThreadAndDrainsOnDestruction) {
  std::vector<int> order;
  std::atomic<int> ran{0};
  {
    auto stream = MakeHost("drain");
    for (int i = 0; i < 100; ++i) {
      ASSERT_TRUE(stream
                      ->Enqueue([&order, &ran, i] {
                        order.push_back(i);
                        ran.fetch_add(1);
                        return absl::OkStatus();
                      })
                      .ok());
    }
  }  // the destructor lets all 100 run
  EXPECT_EQ(ran.load(), 100);
  std::vector<int> expected;
  for (int i = 0; i < 100; ++i) expected.push_back(i);
  EXPECT_EQ(order, expected);
}

TEST(HostStreamTest, WorkCanEnqueueOnItsOwnStream) {
  auto stream = MakeHost("nested");
  std::atomic<int> ran{0};
  Stream* raw = stream.get();
  ASSERT_TRUE(stream
                  ->Enqueue([raw, &ran] {
                    ran.fetch_add(1);
                    return raw->Enqueue([&ran] {
                      ran.fetch_add(1);
                      return absl::OkStatus();
                    });
                  })
                  .ok());
  // The nested item is enqueued before the outer one finishes, so one Synchronize after the
  // outer one has run is not enough: synchronize twice.
  ASSERT_TRUE(stream->Synchronize(Soon()).ok());
  ASSERT_TRUE(stream->Synchronize(Soon()).ok());
  EXPECT_EQ(ran.load(), 2);
}

TEST(HostStreamTest, SynchronizeFromOwnWorkIsAnError) {
  auto stream = MakeHost("self");
  absl::Status inner;
  Stream* raw = stream.get();
  ASSERT_TRUE(stream
                  ->Enqueue([raw, &inner] {
                    inner = raw->Synchronize(Soon());
                    return absl::OkStatus();
                  })
                  .ok());
  ASSERT_TRUE(stream->Synchronize(Soon()).ok());
  EXPECT_EQ(inner.code(), absl::StatusCode::kFailedPrecondition) << inner;
}

// ---------------------------------------------------------------------------------------------
TEST(HostStreamTest, OtherAwakeWorkersCountsRunningWorkersButNotTheCaller) {
  // A worker inside an op is awake: the main thread counts it, the worker itself does not.
  auto stream = MakeHost("busy");
  Gate started, release;
  std::atomic<int> inside{-1};
  ASSERT_TRUE(stream
                  ->Enqueue([&] {
                    inside.store(OtherAwakeHostStreamWorkers());
                    started.Open();
                    release.Wait();
                    return absl::OkStatus();
                  })
                  .ok());
  ASSERT_TRUE(started.Wait());
  const int from_main = OtherAwakeHostStreamWorkers();
  release.Open();
  ASSERT_TRUE(stream->Synchronize(Soon()).ok());
  EXPECT_GE(from_main, 1);
  EXPECT_LE(inside.load(), from_main - 1);
  EXPECT_GE(inside.load(), 0);
}

// Deadlines.

TEST(HostStreamTest, SynchronizeDeadlineFiresThenCompletes) {
  auto stream = MakeHost("slow");
  Gate gate;
  ASSERT_TRUE(stream->Enqueue(BlockOn(gate)).ok());
  absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*stream);
  ASSERT_TRUE(event.ok()) << event.status();

  absl::Status status = (*event)->Synchronize(absl::Now() + absl::Milliseconds(30));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(Message(status), HasSubstr("slow"));
  EXPECT_EQ((*event)->Query().value_or(true), false);
  status = stream->Synchronize(absl::Now() + absl::Milliseconds(30));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(Message(status), HasSubstr("slow"));

  gate.Open();
  EXPECT_TRUE((*event)->Synchronize(Soon()).ok());
  EXPECT_EQ((*event)->Query().value_or(false), true);
  EXPECT_TRUE(stream->Synchronize(Soon()).ok());
  EXPECT_TRUE(stream->status().ok());
}

// Voluntary context switches of the calling thread so far: one per sleep in a futex wait.
long VoluntarySwitches() {
  rusage usage{};
  getrusage(RUSAGE_THREAD, &usage);
  return usage.ru_nvcsw;
}

// A thread blocked behind many queued items (a burst of small collectives, then one wait) sleeps
// until its own position is done: the worker does not wake it at every item before. A wake-up
// per item cost such a burst 2-5x its time.
TEST(HostStreamTest, AWaiterBehindManyItemsSleepsUntilItsPosition) {
  auto stream = MakeHost("burst");
  for (const bool whole_stream : {false, true}) {
    SCOPED_TRACE(whole_stream ? "Stream::Synchronize" : "Event::Synchronize");
    // The first item holds the queue until the waiter is about to block; each item behind it
    // runs for 20 us, so the waiter is asleep while they run.
    std::atomic<bool> waiting{false};
    ASSERT_TRUE(stream
                    ->Enqueue([&waiting] {
                      while (!waiting.load()) std::this_thread::yield();
                      return absl::OkStatus();
                    })
                    .ok());
    constexpr int kItems = 300;
    std::atomic<int> ran{0};
    for (int i = 0; i < kItems; ++i) {
      ASSERT_TRUE(stream
                      ->Enqueue([&ran] {
                        const absl::Time end = absl::Now() + absl::Microseconds(20);
                        while (absl::Now() < end) {
                        }
                        ran.fetch_add(1);
                        return absl::OkStatus();
                      })
                      .ok());
    }
    absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*stream);
    ASSERT_TRUE(event.ok()) << event.status();
    const long before = VoluntarySwitches();
    waiting.store(true);
    ASSERT_TRUE((whole_stream ? stream->Synchronize(Soon()) : (*event)->Synchronize(Soon())).ok());
    const long switches = VoluntarySwitches() - before;
    EXPECT_EQ(ran.load(), kItems);
    EXPECT_LT(switches, 30) << "the waiter slept " << switches << " times behind " << kItems
                            << " items";
  }
}

TEST(HostStreamTest, WaitTimeoutPoisonsTheStream) {
  auto producer = MakeHost("producer");
  auto consumer = MakeHost("consumer", absl::Milliseconds(30));
  Gate gate;
  ASSERT_TRUE(producer->Enqueue(BlockOn(gate)).ok());
  absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*producer);
  ASSERT_TRUE(event.ok());

  std::atomic<bool> before{false}, after{false};
  ASSERT_TRUE(consumer
                  ->Enqueue([&before] {
                    before = true;
                    return absl::OkStatus();
                  })
                  .ok());
  ASSERT_TRUE(consumer->WaitEvent(**event).ok());
  ASSERT_TRUE(consumer
                  ->Enqueue([&after] {
                    after = true;
                    return absl::OkStatus();
                  })
                  .ok());
  absl::Status status = consumer->Synchronize(Soon());
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(Message(status), HasSubstr("consumer"));
  EXPECT_THAT(Message(status), HasSubstr("producer"));
  EXPECT_EQ(consumer->status(), status);
  EXPECT_TRUE(before);
  EXPECT_FALSE(after);
  EXPECT_EQ(consumer->Enqueue([] { return absl::OkStatus(); }), status);

  gate.Open();
  EXPECT_TRUE(producer->Synchronize(Soon()).ok());
  EXPECT_EQ(consumer->status(), status);  // stays poisoned
}

TEST(HostStreamTest, InvalidWaitTimeoutIsRejected) {
  StreamOptions options;
  options.name = "bad";
  options.wait_timeout = absl::Seconds(-1);
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream(options);
  EXPECT_EQ(stream.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(stream.status()), HasSubstr("bad"));
  EXPECT_EQ(CreateCallerStream(options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(HostStreamTest, InvalidTimeoutKnobIsRejectedWhenWaitTimeoutIsUnset) {
  const char* old = std::getenv("SHARDLINE_TIMEOUT_S");
  const std::string saved = old != nullptr ? old : "";
  setenv("SHARDLINE_TIMEOUT_S", "soon", 1);
  ParamTimeout().ResetCacheForTesting();
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream();
  EXPECT_EQ(stream.status().code(), absl::StatusCode::kInvalidArgument) << stream.status();
  StreamOptions explicit_timeout;
  explicit_timeout.wait_timeout = absl::Seconds(1);
  EXPECT_TRUE(CreateHostStream(explicit_timeout).ok());
  if (old != nullptr) {
    setenv("SHARDLINE_TIMEOUT_S", saved.c_str(), 1);
  } else {
    unsetenv("SHARDLINE_TIMEOUT_S");
  }
  ParamTimeout().ResetCacheForTesting();
  EXPECT_TRUE(CreateHostStream().ok());
}

TEST(HostStreamTest, RecordOnADrainedStreamCompletesAtOnceAndAfterPendingWorkOnlyOnceItRan) {
  auto stream = MakeHost("drained");
  // Nothing enqueued yet: the event is complete when Record returns, with a completion time.
  absl::StatusOr<std::shared_ptr<Event>> first = RecordEvent(*stream);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<bool> done = (*first)->Query();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(*done);
  EXPECT_TRUE((*first)->completed_at().has_value());

  // Behind pending work it is not complete until that work ran.
  Gate gate;
  std::atomic<int> ran{0};
  ASSERT_TRUE(stream->Enqueue(BlockOn(gate)).ok());
  ASSERT_TRUE(stream
                  ->Enqueue([&ran] {
                    ran.fetch_add(1);
                    return absl::OkStatus();
                  })
                  .ok());
  absl::StatusOr<std::shared_ptr<Event>> behind = RecordEvent(*stream);
  ASSERT_TRUE(behind.ok()) << behind.status();
  done = (*behind)->Query();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_FALSE(*done);
  gate.Open();
  ASSERT_TRUE((*behind)->Synchronize(Soon()).ok());
  EXPECT_EQ(ran.load(), 1);

  // Drained again: Synchronize counts the records completed at once as finished.
  ASSERT_TRUE(stream->Synchronize(Soon()).ok());
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<std::shared_ptr<Event>> again = RecordEvent(*stream);
    ASSERT_TRUE(again.ok()) << again.status();
    done = (*again)->Query();
    ASSERT_TRUE(done.ok() && *done) << "record " << i << " on a drained stream is still pending";
  }
  ASSERT_TRUE(stream->Synchronize(Soon()).ok());

  // A poisoned stream completes the record at once too, with its failure.
  ASSERT_TRUE(stream->Enqueue([] { return absl::InternalError("boom"); }).ok());
  EXPECT_EQ(stream->Synchronize(Soon()).code(), absl::StatusCode::kInternal);
  std::shared_ptr<Event> failed = stream->CreateEvent();
  EXPECT_EQ(failed->Record(*stream).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(failed->Synchronize(Soon()).code(), absl::StatusCode::kInternal);
}

// Records behind queued work (riding on the last queued item, or queued themselves when that
// item already carries one) complete after exactly the work before them, with the stream's status
// at that point.
TEST(HostStreamTest, RecordsBehindQueuedWorkCompleteWithTheStatusAfterTheirWork) {
  auto stream = MakeHost("behind");
  Gate gate;
  std::atomic<int> ran{0};
  ASSERT_TRUE(stream->Enqueue(BlockOn(gate)).ok());
  std::vector<std::shared_ptr<Event>> events;
  auto record = [&] {
    absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*stream);
    ASSERT_TRUE(event.ok()) << event.status();
    events.push_back(*event);
  };
  record();  // [0] after the gate
  ASSERT_TRUE(stream
                  ->Enqueue([&ran] {
                    ran.fetch_add(1);
                    return absl::OkStatus();
                  })
                  .ok());
  record();  // [1] after the counting op
  record();  // [2] the same point, a second record
  record();  // [3] and a third
  ASSERT_TRUE(stream->Enqueue([] { return absl::InternalError("boom"); }).ok());
  record();  // [4] after the failure
  record();  // [5]
  for (const auto& event : events) {
    absl::StatusOr<bool> done = event->Query();
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_FALSE(*done);
  }
  gate.Open();
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(events[i]->Synchronize(Soon()).ok()) << "record " << i;
  }
  EXPECT_EQ(ran.load(), 1);
  for (int i = 4; i < 6; ++i) {
    EXPECT_EQ(events[i]->Synchronize(Soon()).code(), absl::StatusCode::kInternal) << "record " << i;
  }
  // Completion times follow the order of the work.
  for (int i = 1; i < 6; ++i) {
    ASSERT_TRUE(events[i]->completed_at().has_value());
    EXPECT_GE(*events[i]->completed_at(), *events[i - 1]->completed_at()) << "record " << i;
  }
}

// Restores an environment variable and the knob's cache when it goes out of scope.
class ScopedSpinKnob {
 public:
  explicit ScopedSpinKnob(const char* value) {
    const char* old = std::getenv(kName);
    had_ = old != nullptr;
    if (had_) saved_ = old;
    setenv(kName, value, 1);
    ParamStreamSpinUs().ResetCacheForTesting();
  }
  ~ScopedSpinKnob() {
    if (had_) {
      setenv(kName, saved_.c_str(), 1);
    } else {
      unsetenv(kName);
    }
    ParamStreamSpinUs().ResetCacheForTesting();
  }

 private:
  static constexpr const char* kName = "SHARDLINE_STREAM_SPIN_US";
  bool had_ = false;
  std::string saved_;
};

// Ping-pong across two host streams: each op of b reads what the op of a before b's wait wrote;
// `between(i)` runs on the host after round i is submitted. Every round's value is checked.
void PingPong(Stream& a, Stream& b, int rounds, const std::function<void(int)>& between) {
  std::vector<int> written(rounds, -1);
  std::vector<int> seen(rounds, -2);
  for (int i = 0; i < rounds; ++i) {
    ASSERT_TRUE(a.Enqueue([&written, i] {
                   written[i] = i;
                   return absl::OkStatus();
                 }).ok());
    absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(a);
    ASSERT_TRUE(event.ok()) << event.status();
    ASSERT_TRUE(b.WaitEvent(**event).ok());
    ASSERT_TRUE(b.Enqueue([&written, &seen, i] {
                   seen[i] = written[i];
                   return absl::OkStatus();
                 }).ok());
    between(i);
  }
  ASSERT_TRUE(b.Synchronize(Soon()).ok());
  ASSERT_TRUE(a.Synchronize(Soon()).ok());
  for (int i = 0; i < rounds; ++i) ASSERT_EQ(seen[i], i) << "round " << i;
}

TEST(HostStreamTest, SpinningWorkersKeepOrderAcrossStreams) {
  ScopedSpinKnob spin("300");
  auto a = MakeHost("spin a");
  auto b = MakeHost("spin b");
  // The host submits in bursts with pauses longer and shorter than the spin, so the workers both
  // catch work while polling and go to sleep in between.
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> pause_us(0, 600);
  PingPong(*a, *b, 2000, [&](int i) {
    if (i % 50 == 49) absl::SleepFor(absl::Microseconds(pause_us(rng)));
  });
}

// The scheduling policy a host stream's worker runs under, read by an op on it.
int WorkerPolicy(Stream& stream) {
  std::atomic<int> policy{-1};
  EXPECT_TRUE(stream
                  .Enqueue([&policy] {
                    policy.store(sched_getscheduler(0));
                    return absl::OkStatus();
                  })
                  .ok());
  EXPECT_TRUE(stream.Synchronize(Soon()).ok());
  return policy.load();
}

TEST(HostStreamTest, WorkersRunUnderSchedBatchUnlessTheKnobIsOff) {
  const char* old = std::getenv("SHARDLINE_STREAM_BATCH_SCHED");
  const std::string saved = old != nullptr ? old : "";
  unsetenv("SHARDLINE_STREAM_BATCH_SCHED");
  ParamStreamBatchSched().ResetCacheForTesting();
  EXPECT_EQ(WorkerPolicy(*MakeHost("batch")), SCHED_BATCH);
  setenv("SHARDLINE_STREAM_BATCH_SCHED", "0", 1);
  ParamStreamBatchSched().ResetCacheForTesting();
  EXPECT_EQ(WorkerPolicy(*MakeHost("default policy")), SCHED_OTHER);
  setenv("SHARDLINE_STREAM_BATCH_SCHED", "sometimes", 1);
  ParamStreamBatchSched().ResetCacheForTesting();
  absl::StatusOr<std::unique_ptr<Stream>> bad = CreateHostStream({.name = "bad batch"});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(Message(bad.status()), HasSubstr("SHARDLINE_STREAM_BATCH_SCHED"));
  if (old != nullptr) {
    setenv("SHARDLINE_STREAM_BATCH_SCHED", saved.c_str(), 1);
  } else {
    unsetenv("SHARDLINE_STREAM_BATCH_SCHED");
  }
  ParamStreamBatchSched().ResetCacheForTesting();
}

TEST(HostStreamTest, AutoSpinKnobKeepsOrderAcrossStreams) {
  // -1 (auto, the default): the workers poll only while few of them are awake for the machine's
  // hardware threads; the order holds either way.
  ScopedSpinKnob spin("-1");
  auto a = MakeHost("auto a");
  auto b = MakeHost("auto b");
  PingPong(*a, *b, 3000, [](int) {});
}

TEST(HostStreamTest, NegativeSpinKnobIsRejected) {
  ScopedSpinKnob spin("-2");
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream({.name = "bad spin"});
  EXPECT_EQ(stream.status().code(), absl::StatusCode::kInvalidArgument) << stream.status();
  EXPECT_THAT(Message(stream.status()), HasSubstr("SHARDLINE_STREAM_SPIN_US"));
  EXPECT_THAT(Message(stream.status()), HasSubstr("bad spin"));
}

// A work item that counts its runs in `ran`.
auto CountInto(std::atomic<int>& ran) {
  return [&ran] {
    ran.fetch_add(1);
    return absl::OkStatus();
  };
}

// ---------------------------------------------------------------------------------------------
// Poisoning.

TEST(HostStreamTest, FailurePoisonsStreamEventsAndWaiters) {
  auto gather = MakeHost("gather");
  auto reduce = MakeHost("reduce");
  Gate gate;
  std::atomic<int> ran{0};
  auto count = CountInto(ran);

  ASSERT_TRUE(gather->Enqueue(count).ok());
  absl::StatusOr<std::shared_ptr<Event>> before = RecordEvent(*gather);
  ASSERT_TRUE(before.ok());
  ASSERT_TRUE(gather->Enqueue(BlockOn(gate)).ok());
  ASSERT_TRUE(gather->Enqueue([] { return absl::InternalError("boom"); }).ok());
  // Enqueued while the failure is still ahead of the worker: accepted, then dropped.
  ASSERT_TRUE(gather->Enqueue(count).ok());
  absl::StatusOr<std::shared_ptr<Event>> after = RecordEvent(*gather);
  ASSERT_TRUE(after.ok());

  ASSERT_TRUE(reduce->Enqueue(count).ok());
  ASSERT_TRUE(reduce->WaitEvent(**after).ok());
  ASSERT_TRUE(reduce->Enqueue(count).ok());

  gate.Open();
  absl::Status status = gather->Synchronize(Soon());
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(Message(status), HasSubstr("gather"));
  EXPECT_THAT(Message(status), HasSubstr("boom"));
  EXPECT_EQ(gather->status(), status);

  EXPECT_TRUE((*before)->Synchronize(Soon()).ok());
  EXPECT_EQ((*before)->Query().value_or(false), true);
  EXPECT_EQ((*after)->Synchronize(Soon()), status);
  EXPECT_EQ((*after)->Query().status(), status);

  // The error travelled along the wait: same Status on the waiting stream.
  EXPECT_EQ(reduce->Synchronize(Soon()), status);
  EXPECT_EQ(ran.load(), 2);  // gather's first op and reduce's op before the wait

  // Poisoned for good: Enqueue refuses, new events report the error at once.
  EXPECT_EQ(gather->Enqueue(count), status);
  std::shared_ptr<Event> late = gather->CreateEvent();
  EXPECT_EQ(late->Record(*gather), status);
  EXPECT_EQ(late->Query().status(), status);
  EXPECT_EQ(reduce->Enqueue(count), status);
  EXPECT_EQ(ran.load(), 2);

  // A third stream waiting on an event that has already failed gets poisoned too, after the
  // work it had enqueued before the wait.
  auto third = MakeHost("third");
  ASSERT_TRUE(third->Enqueue(count).ok());
  ASSERT_TRUE(third->WaitEvent(**after).ok());
  EXPECT_EQ(third->Synchronize(Soon()), status);
  EXPECT_EQ(ran.load(), 3);
}

// ---------------------------------------------------------------------------------------------
// Events.

// ---------------------------------------------------------------------------------------------
// HostStreamWakeBatch: held wake-ups are never lost.

// A deadline short enough that a lost wake-up fails the test quickly, long enough for a loaded
// machine.
absl::Time Bounded() { return absl::Now() + absl::Seconds(10); }

uint64_t Wakes() { return ThisThreadHostStreamCallStats().wakes; }

TEST(HostStreamWakeBatchTest, HoldsTheWakeUpOfASleepingWorkerUntilTheBatchEnds) {
  auto stream = MakeHost("held");
  bool saw_held = false;
  for (int attempt = 0; attempt < 50 && !saw_held; ++attempt) {
    ASSERT_TRUE(stream->Synchronize(Bounded()).ok());
    std::atomic<bool> ran{false};
    const uint64_t before = Wakes();
    bool ran_inside = false;
    {
      HostStreamWakeBatch batch;
      ASSERT_TRUE(stream
                      ->Enqueue([&ran] {
                        ran.store(true);
                        return absl::OkStatus();
                      })
                      .ok());
      for (int i = 0; i < 5; ++i)
        ASSERT_TRUE(stream->Enqueue([] { return absl::OkStatus(); }).ok());
      // A woken worker would run the op meanwhile; a held one cannot.
      absl::SleepFor(absl::Milliseconds(5));
      ran_inside = ran.load();
      EXPECT_EQ(Wakes(), before) << "a wake-up was issued inside the batch";
    }
    // One wake-up at most for the six submissions, at the end of the batch.
    const uint64_t wakes = Wakes() - before;
    ASSERT_LE(wakes, 1u);
    if (wakes == 1) {
      // The worker slept when the batch began: nothing ran until the batch ended.
      EXPECT_FALSE(ran_inside) << "attempt " << attempt;
      saw_held = true;
    }
    ASSERT_TRUE(stream->Synchronize(Bounded()).ok());
    EXPECT_TRUE(ran.load());
  }
  EXPECT_TRUE(saw_held) << "the worker was never asleep at the start of a batch";
}

TEST(HostStreamWakeBatchTest, BlockingInsideABatchWakesTheHeldWorkersFirst) {
  auto a = MakeHost("held a");
  auto b = MakeHost("held b");
  auto caller = MakeCaller("held caller");
  for (int round = 0; round < 20; ++round) {
    HostStreamWakeBatch batch;
    std::atomic<int> ran{0};
    auto count = CountInto(ran);
    // Stream::Synchronize.
    ASSERT_TRUE(a->Enqueue(count).ok());
    ASSERT_TRUE(a->Synchronize(Bounded()).ok()) << "round " << round;
    EXPECT_EQ(ran.load(), 1);
    // Event::Synchronize.
    ASSERT_TRUE(a->Enqueue(count).ok());
    absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*a);
    ASSERT_TRUE(event.ok()) << event.status();
    ASSERT_TRUE((*event)->Synchronize(Bounded()).ok()) << "round " << round;
    EXPECT_EQ(ran.load(), 2);
    // A chain through a second held worker: b waits for a, the caller stream for b.
    ASSERT_TRUE(a->Enqueue(count).ok());
    event = RecordEvent(*a);
    ASSERT_TRUE(event.ok()) << event.status();
    ASSERT_TRUE(b->WaitEvent(**event).ok());
    ASSERT_TRUE(b->Enqueue(count).ok());
    absl::StatusOr<std::shared_ptr<Event>> after_b = RecordEvent(*b);
    ASSERT_TRUE(after_b.ok()) << after_b.status();
    ASSERT_TRUE(caller->WaitEvent(**after_b).ok()) << "round " << round;
    EXPECT_EQ(ran.load(), 4);
  }
}

TEST(HostStreamWakeBatchTest, ABatchWakesOneWorkerWhichWakesTheOthers) {
  constexpr int kStreams = 6;
  std::vector<std::unique_ptr<Stream>> streams;
  for (int s = 0; s < kStreams; ++s) streams.push_back(MakeHost("relay" + std::to_string(s)));
  int relayed_batches = 0;
  for (int round = 0; round < 40; ++round) {
    for (auto& stream : streams) ASSERT_TRUE(stream->Synchronize(Bounded()).ok());
    // Let the workers fall asleep, so that the batch holds several wake-ups back.
    absl::SleepFor(absl::Milliseconds(2));
    std::vector<std::atomic<int>> ran(kStreams);
    for (auto& r : ran) r.store(0);
    const uint64_t before = Wakes();
    {
      HostStreamWakeBatch batch;
      for (int s = 0; s < kStreams; ++s) {
        for (int i = 0; i < 3; ++i) {
          ASSERT_TRUE(streams[s]
                          ->Enqueue([&ran, s] {
                            ran[s].fetch_add(1);
                            return absl::OkStatus();
                          })
                          .ok());
        }
      }
    }
    // This thread woke one worker at most; the others were woken by it.
    EXPECT_LE(Wakes() - before, 1u) << "round " << round;
    if (Wakes() - before == 1) ++relayed_batches;
    for (int s = 0; s < kStreams; ++s) {
      // Only the relay wakes these workers: a lost relay fails the bounded Synchronize.
      ASSERT_TRUE(streams[s]->Synchronize(Bounded()).ok()) << "round " << round << ", stream " << s;
      EXPECT_EQ(ran[s].load(), 3);
    }
  }
  EXPECT_GT(relayed_batches, 0) << "no batch found a sleeping worker";
}

TEST(HostStreamWakeBatchTest, AWakeUpHandedToAStreamBeingDestroyedStillArrives) {
  auto survivor = MakeHost("survivor");
  for (int round = 0; round < 20; ++round) {
    std::atomic<int> ran{0};
    auto count = CountInto(ran);
    {
      HostStreamWakeBatch batch;
      auto doomed = MakeHost("doomed");
      ASSERT_TRUE(doomed->Synchronize(Bounded()).ok());
      ASSERT_TRUE(survivor->Synchronize(Bounded()).ok());
      absl::SleepFor(absl::Milliseconds(1));
      // `doomed` is held first, so it would relay the survivor's wake-up.
      ASSERT_TRUE(doomed->Enqueue(count).ok());
      ASSERT_TRUE(survivor->Enqueue(count).ok());
      doomed.reset();  // its worker exits; the batch ends with the survivor still held
    }
    ASSERT_TRUE(survivor->Synchronize(Bounded()).ok()) << "round " << round;
    EXPECT_EQ(ran.load(), 2);
  }
}

TEST(HostStreamWakeBatchTest, WakeHeldLetsAThreadWaitByOtherMeansInsideABatch) {
  auto stream = MakeHost("spun on");
  for (int round = 0; round < 20; ++round) {
    ASSERT_TRUE(stream->Synchronize(Bounded()).ok());
    std::atomic<bool> ran{false};
    HostStreamWakeBatch batch;
    ASSERT_TRUE(stream
                    ->Enqueue([&ran] {
                      ran.store(true);
                      return absl::OkStatus();
                    })
                    .ok());
    HostStreamWakeBatch::WakeHeld();
    // A wait outside the stream library (a spin on a flag), bounded: a worker still held back
    // would never set it.
    const absl::Time deadline = Bounded();
    while (!ran.load() && absl::Now() < deadline) std::this_thread::yield();
    ASSERT_TRUE(ran.load()) << "round " << round;
  }
}

TEST(HostStreamWakeBatchTest, NestedBatchesWakeOnlyWhenTheOutermostEnds) {
  auto stream = MakeHost("nested");
  for (int round = 0; round < 20; ++round) {
    const uint64_t before = Wakes();
    std::atomic<int> ran{0};
    {
      HostStreamWakeBatch outer;
      {
        HostStreamWakeBatch inner;
        ASSERT_TRUE(stream
                        ->Enqueue([&ran] {
                          ran.fetch_add(1);
                          return absl::OkStatus();
                        })
                        .ok());
        inner.End();
        inner.End();  // a second End does nothing
      }
      EXPECT_EQ(Wakes(), before) << "the inner batch woke the worker";
    }
    EXPECT_LE(Wakes() - before, 1u);
    ASSERT_TRUE(stream->Synchronize(Bounded()).ok()) << "round " << round;
    EXPECT_EQ(ran.load(), 1);
  }
}

TEST(HostStreamWakeBatchTest, AStreamDestroyedWhileItsWakeUpIsHeldRunsItsWork) {
  for (int round = 0; round < 20; ++round) {
    std::atomic<int> ran{0};
    HostStreamWakeBatch batch;
    {
      auto stream = MakeHost("short-lived");
      ASSERT_TRUE(stream->Synchronize(Bounded()).ok());
      for (int i = 0; i < 3; ++i) {
        ASSERT_TRUE(stream
                        ->Enqueue([&ran] {
                          ran.fetch_add(1);
                          return absl::OkStatus();
                        })
                        .ok());
      }
      // The destructor drains the queue (each wait bounded) and joins the worker.
    }
    EXPECT_EQ(ran.load(), 3) << "round " << round;
    batch.End();  // wakes a condition variable that outlived its stream
  }
}

// Runs `body` on a thread of its own and waits for it at most `limit`. A body still running then
// is deadlocked: its thread cannot be joined or cancelled, so the process ends with a message
// rather than hanging until the test runner's timeout.
void FailIfStuck(absl::Duration limit, const std::function<void()>& body) {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::thread runner([&] {
    body();
    std::lock_guard<std::mutex> lock(mu);
    done = true;
    cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(mu);
  if (!cv.wait_for(lock, absl::ToChronoNanoseconds(limit), [&] { return done; })) {
    std::fprintf(stderr, "deadlocked: the body did not return within %s\n",
                 absl::FormatDuration(limit).c_str());
    std::abort();
  }
  lock.unlock();
  runner.join();
}

// A thread blocking inside a batch wakes the workers it holds back while it still holds the lock
// of the stream it waits for. That wake-up must not take the lock again (the first held worker
// relays the others' wake-ups under its stream's lock): with that stream's wake-up held first,
// the thread would deadlock on itself; with two threads, each on the other's stream.
TEST(HostStreamWakeBatchTest, SynchronizingAStreamWhoseWakeUpIsHeldFirstReturns) {
  auto a = MakeHost("held first");
  auto b = MakeHost("held second");
  int held_both = 0;
  FailIfStuck(absl::Seconds(60), [&] {
    for (int round = 0; round < 20; ++round) {
      ASSERT_TRUE(a->Synchronize(Bounded()).ok());
      ASSERT_TRUE(b->Synchronize(Bounded()).ok());
      // Let both workers fall asleep, so that the batch holds both wake-ups, a's first.
      absl::SleepFor(absl::Milliseconds(2));
      std::atomic<int> ran{0};
      auto count = CountInto(ran);
      const uint64_t before = Wakes();
      {
        HostStreamWakeBatch batch;
        ASSERT_TRUE(a->Enqueue(count).ok());
        ASSERT_TRUE(b->Enqueue(count).ok());
        ASSERT_TRUE(a->Synchronize(Bounded()).ok()) << "round " << round;
        if (Wakes() - before == 1) ++held_both;  // one wake-up, relayed to b by a's worker
      }
      ASSERT_TRUE(b->Synchronize(Bounded()).ok()) << "round " << round;
      EXPECT_EQ(ran.load(), 2);
    }
  });
  EXPECT_GT(held_both, 0) << "no round found both workers asleep";
}

// Threads that batch their submissions to shared streams, with records and cross-stream waits,
// while other threads' submissions find the workers already "woken" by a held wake-up: at the end
// every op has run, in each thread's order per stream. A lost wake-up leaves work queued behind a
// sleeping worker, and the bounded Synchronize fails.
TEST(HostStreamWakeBatchTest, ThreadsBatchingOnSharedStreamsNeverLoseAWakeUp) {
  constexpr int kStreams = 5;
  constexpr int kThreads = 4;
  constexpr int kRounds = 400;
  std::vector<std::unique_ptr<Stream>> streams;
  for (int s = 0; s < kStreams; ++s) streams.push_back(MakeHost("shared" + std::to_string(s)));
  // last[t][s]: the last round of thread t that ran on stream s (each thread's ops on one stream
  // run in its order).
  std::vector<std::vector<std::atomic<int>>> last(kThreads);
  std::vector<std::atomic<int>> out_of_order(kThreads);
  for (auto& v : last) v = std::vector<std::atomic<int>>(kStreams);
  for (auto& v : last)
    for (auto& x : v) x.store(-1);
  for (auto& x : out_of_order) x.store(0);
  std::vector<std::vector<int>> submitted(kThreads, std::vector<int>(kStreams, 0));
  std::vector<std::vector<std::atomic<int>>> ran(kThreads);
  for (auto& v : ran) v = std::vector<std::atomic<int>>(kStreams);
  for (auto& v : ran)
    for (auto& x : v) x.store(0);
  std::atomic<int> failures{0};
  FailIfStuck(absl::Seconds(120), [&] {
    testing::RunRankThreads(kThreads, [&](int t) {
      std::mt19937 rng(1000 + t);
      for (int r = 0; r < kRounds; ++r) {
        HostStreamWakeBatch batch;
        const int n = 1 + static_cast<int>(rng() % 6);
        for (int i = 0; i < n; ++i) {
          const int s = static_cast<int>(rng() % kStreams);
          if (rng() % 3 == 0) {
            const int from = static_cast<int>(rng() % kStreams);
            absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*streams[from]);
            if (!event.ok() || !streams[s]->WaitEvent(**event).ok()) failures.fetch_add(1);
          }
          ++submitted[t][s];
          absl::Status status = streams[s]->Enqueue([&, t, s, r] {
            if (last[t][s].load() > r) out_of_order[t].fetch_add(1);
            last[t][s].store(r);
            ran[t][s].fetch_add(1);
            return absl::OkStatus();
          });
          if (!status.ok()) failures.fetch_add(1);
        }
        if (r % 50 == 49) {
          // Blocking inside the batch: this thread's held wake-ups go out first.
          if (!streams[rng() % kStreams]->Synchronize(Bounded()).ok()) failures.fetch_add(1);
        }
      }
    });
  });
  for (int s = 0; s < kStreams; ++s) {
    ASSERT_TRUE(streams[s]->Synchronize(Bounded()).ok()) << "stream " << s;
  }
  EXPECT_EQ(failures.load(), 0);
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(out_of_order[t].load(), 0) << "thread " << t;
    for (int s = 0; s < kStreams; ++s) {
      EXPECT_EQ(ran[t][s].load(), submitted[t][s]) << "thread " << t << ", stream " << s;
    }
  }
}

TEST(EventTest, NeverRecordedEventIsComplete) {
  std::shared_ptr<Event> event = CreateHostEvent();
  EXPECT_EQ(event->device(), Device::Host());
  EXPECT_EQ(event->Query().value_or(false), true);
  EXPECT_TRUE(event->Synchronize(absl::Now()).ok());
  auto stream = MakeHost("idle");
  EXPECT_TRUE(stream->WaitEvent(*event).ok());
  auto caller = MakeCaller("idle-caller");
  EXPECT_TRUE(caller->WaitEvent(*event).ok());
  EXPECT_TRUE(stream->Synchronize(Soon()).ok());
}

TEST(EventTest, ReRecordReplacesTheCaptureButNotEarlierWaits) {
  auto slow = MakeHost("slow");
  auto fast = MakeHost("fast");
  auto waiter = MakeHost("waiter");
  Gate gate;
  std::atomic<bool> slow_done{false};
  ASSERT_TRUE(slow->Enqueue(BlockOn(gate)).ok());
  ASSERT_TRUE(slow->Enqueue([&slow_done] {
                    slow_done = true;
                    return absl::OkStatus();
                  })
                  .ok());

  std::shared_ptr<Event> event = slow->CreateEvent();
  ASSERT_TRUE(event->Record(*slow).ok());
  EXPECT_EQ(event->Query().value_or(true), false);

  // This wait captured the record on `slow`; re-recording must not release it early.
  ASSERT_TRUE(waiter->WaitEvent(*event).ok());
  std::atomic<bool> saw_slow_done{false};
  ASSERT_TRUE(waiter
                  ->Enqueue([&] {
                    saw_slow_done = slow_done.load();
                    return absl::OkStatus();
                  })
                  .ok());

  ASSERT_TRUE(event->Record(*fast).ok());
  EXPECT_TRUE(event->Synchronize(Soon()).ok());  // captures only fast's (empty) work
  EXPECT_FALSE(slow_done);

  gate.Open();
  ASSERT_TRUE(waiter->Synchronize(Soon()).ok());
  EXPECT_TRUE(saw_slow_done);
}

// A record on a host stream is a position in the stream's progress: dropping the event while
// that record is still pending frees it at once (no stream holds any part of it) and does not
// release the streams waiting for it.
TEST(EventTest, AnEventDroppedBeforeItsRecordCompletesStillOrdersItsWaiters) {
  auto slow = MakeHost("slow");
  auto waiter = MakeHost("waiter");
  Gate gate;
  std::atomic<bool> slow_done{false};
  ASSERT_TRUE(slow->Enqueue(BlockOn(gate)).ok());
  ASSERT_TRUE(slow->Enqueue([&slow_done] {
                    slow_done = true;
                    return absl::OkStatus();
                  })
                  .ok());
  std::shared_ptr<Event> event = slow->CreateEvent();
  ASSERT_TRUE(event->Record(*slow).ok());
  ASSERT_TRUE(waiter->WaitEvent(*event).ok());
  std::atomic<bool> saw_slow_done{false};
  ASSERT_TRUE(waiter
                  ->Enqueue([&] {
                    saw_slow_done = slow_done.load();
                    return absl::OkStatus();
                  })
                  .ok());
  std::weak_ptr<Event> weak = event;
  event.reset();
  EXPECT_TRUE(weak.expired());  // neither the pending record nor the wait keeps it
  gate.Open();
  ASSERT_TRUE(waiter->Synchronize(Soon()).ok());
  ASSERT_TRUE(slow->Synchronize(Soon()).ok());
  EXPECT_TRUE(saw_slow_done);
}

// An event recorded three times: each record captures its own point, the completion times
// follow the records, and the first (embedded) record's wait is unaffected by the later ones.
TEST(EventTest, EveryRecordOfAnEventCapturesItsOwnPoint) {
  auto stream = MakeHost("s");
  std::shared_ptr<Event> event = stream->CreateEvent();
  std::vector<std::optional<absl::Time>> times;
  for (int i = 0; i < 3; ++i) {
    Gate gate;
    ASSERT_TRUE(stream->Enqueue(BlockOn(gate)).ok());
    ASSERT_TRUE(event->Record(*stream).ok());
    EXPECT_EQ(event->Query().value_or(true), false) << "record " << i;
    EXPECT_FALSE(event->completed_at().has_value()) << "record " << i;
    gate.Open();
    ASSERT_TRUE(event->Synchronize(Soon()).ok()) << "record " << i;
    EXPECT_EQ(event->Query().value_or(false), true) << "record " << i;
    times.push_back(event->completed_at());
    ASSERT_TRUE(times.back().has_value()) << "record " << i;
    EXPECT_EQ(event->recorded_stream_id(), stream->id());
  }
  EXPECT_LE(*times[0], *times[1]);
  EXPECT_LE(*times[1], *times[2]);
}

// A host stream's queue is a ring that grows: items queued while the worker is blocked, with the
// ring's start in the middle of its storage, still run once each, in order.
// A record on a host stream is a position: its completion time is the end of the item it follows
// (stamped per block of items), its outcome the first failure at or before it. Checked over more
// items than one block, against the manual clock's known steps, and after the stream is gone.
TEST(EventTest, PositionsKeepTimesAndOutcomesAcrossBlocksAndOutliveTheStream) {
  const absl::Time t0 = absl::FromUnixSeconds(5000);
  ManualClock clock(t0);
  StreamOptions options;
  options.name = "blocks";
  options.clock = &clock;
  std::unique_ptr<Stream> stream = *CreateHostStream(options);
  constexpr int kOps = 150;
  constexpr int kFails = 120;  // op 120 fails: the 29 after it are dropped
  Gate gate;
  ASSERT_TRUE(stream->Enqueue(BlockOn(gate)).ok());
  std::atomic<int> cancelled{0};
  std::vector<std::shared_ptr<Event>> events;
  for (int k = 0; k < kOps; ++k) {
    StreamOp op;
    op.run = [&clock, k]() -> absl::Status {
      if (k == kFails) return absl::InternalError("op 120");
      clock.Advance(absl::Milliseconds(1));
      return absl::OkStatus();
    };
    op.cancel = [&cancelled](const absl::Status& status) {
      EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
      ++cancelled;
    };
    ASSERT_TRUE(stream->Submit(std::move(op)).ok());
    events.push_back(*RecordEvent(*stream));
  }
  for (const std::shared_ptr<Event>& event : events) {
    EXPECT_EQ(event->Query().value_or(true), false);
    EXPECT_EQ(event->completed_at(), std::nullopt);
  }
  gate.Open();
  ASSERT_EQ(stream->Synchronize(clock.Now() + absl::Hours(1)).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(cancelled.load(), kOps - kFails - 1);
  stream.reset();  // the events keep what they need
  for (int k = 0; k < kOps; ++k) {
    const absl::StatusOr<bool> done = events[k]->Query();
    if (k < kFails) {
      ASSERT_TRUE(done.ok()) << "record " << k << ": " << done.status();
      EXPECT_TRUE(*done);
      EXPECT_EQ(events[k]->completed_at(), t0 + absl::Milliseconds(k + 1)) << "record " << k;
    } else {
      EXPECT_EQ(done.status().code(), absl::StatusCode::kInternal) << "record " << k;
      EXPECT_THAT(Message(done.status()), HasSubstr("op 120"));
      // The failed op and the dropped ones took no clock time.
      EXPECT_EQ(events[k]->completed_at(), t0 + absl::Milliseconds(kFails)) << "record " << k;
    }
    EXPECT_EQ(events[k]->Synchronize(clock.Now()).code(), done.status().code());
  }
}

// OnComplete races the worker finishing the position: whichever side takes the callback runs it,
// exactly once, and before the completion is seen by the thread that registered it.
TEST(EventTest, CallbacksRegisteredAsTheWorkerFinishesRunOnceAndBeforeTheCompletionIsSeen) {
  auto stream = MakeHost("racing");
  constexpr int kRecords = 4000;
  std::vector<std::atomic<int>> runs(kRecords);
  std::vector<std::shared_ptr<Event>> events;
  for (int i = 0; i < kRecords; ++i) {
    ASSERT_TRUE(stream->Enqueue([] { return absl::OkStatus(); }).ok());
    events.push_back(*RecordEvent(*stream));
    events.back()->OnComplete([&runs, i](absl::Status status) {
      EXPECT_TRUE(status.ok()) << status;
      runs[i].fetch_add(1);
    });
    if (i % 50 == 49) {
      ASSERT_TRUE(events[i]->Synchronize(Soon()).ok());
      for (int j = i - 49; j <= i; ++j) ASSERT_EQ(runs[j].load(), 1) << "record " << j;
    }
  }
  ASSERT_TRUE(stream->Synchronize(Soon()).ok());
  for (int i = 0; i < kRecords; ++i) ASSERT_EQ(runs[i].load(), 1) << "record " << i;
}

TEST(HostStreamTest, QueueGrowthAcrossSegmentsKeepsOrder) {
  auto stream = MakeHost("segments");
  std::vector<int> ran;  // written by the worker only
  int next = 0;
  auto push = [&](int n) {
    for (int i = 0; i < n; ++i) {
      ASSERT_TRUE(stream
                      ->Enqueue([&ran, v = next++] {
                        ran.push_back(v);
                        return absl::OkStatus();
                      })
                      .ok());
    }
  };
  for (int round = 0; round < 4; ++round) {
    push(11);  // moves the queue's start off a segment's first slot
    ASSERT_TRUE(stream->Synchronize(Soon()).ok());
    Gate gate;
    ASSERT_TRUE(stream->Enqueue(BlockOn(gate)).ok());
    push(37 + 50 * round);  // across segments (64 items each) while the worker is held
    gate.Open();
    ASSERT_TRUE(stream->Synchronize(Soon()).ok());
  }
  ASSERT_EQ(static_cast<int>(ran.size()), next);
  for (int i = 0; i < next; ++i) ASSERT_EQ(ran[i], i);
}

TEST(EventTest, RecordEventHelperMarksThePoint) {
  auto stream = MakeHost("mark");
  std::atomic<int> ran{0};
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(stream
                    ->Enqueue([&ran] {
                      ran.fetch_add(1);
                      return absl::OkStatus();
                    })
                    .ok());
  }
  absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*stream);
  ASSERT_TRUE(event.ok());
  ASSERT_TRUE((*event)->Synchronize(Soon()).ok());
  EXPECT_EQ(ran.load(), 10);
  EXPECT_EQ((*event)->device(), Device::Host());
}

// RecordSharedEvent returns the previous shared event exactly while nothing was enqueued since
// (a record enqueues nothing; a wait on a completed event neither), and each event it returns
// covers exactly the work before its point: checked against the number of ops run when it
// completes, with the ops held behind a gate.
TEST(EventTest, SharedEventIsReusedOnlyWhileTheStreamPointIsUnchanged) {
  auto stream = MakeHost("shared");
  auto other = MakeHost("other");
  Gate gate;
  std::atomic<int> ran{0};
  auto count = CountInto(ran);
  ASSERT_TRUE(stream->Enqueue(BlockOn(gate)).ok());
  ASSERT_TRUE(stream->Enqueue(count).ok());
  absl::StatusOr<std::shared_ptr<Event>> first = RecordSharedEvent(*stream);
  ASSERT_TRUE(first.ok()) << first.status();
  // Nothing enqueued in between (an ordinary record does not count): the same event.
  ASSERT_TRUE(RecordEvent(*stream).ok());
  absl::StatusOr<std::shared_ptr<Event>> again = RecordSharedEvent(*stream);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->get(), first->get());
  // A wait on a completed event enqueues nothing either.
  absl::StatusOr<std::shared_ptr<Event>> done_elsewhere = RecordEvent(*other);
  ASSERT_TRUE(done_elsewhere.ok());
  ASSERT_TRUE((*done_elsewhere)->Synchronize(Soon()).ok());
  ASSERT_TRUE(stream->WaitEvent(**done_elsewhere).ok());
  absl::StatusOr<std::shared_ptr<Event>> after_noop_wait = RecordSharedEvent(*stream);
  ASSERT_TRUE(after_noop_wait.ok());
  EXPECT_EQ(after_noop_wait->get(), first->get());

  // An op: a new event, covering it.
  ASSERT_TRUE(stream->Enqueue(count).ok());
  absl::StatusOr<std::shared_ptr<Event>> second = RecordSharedEvent(*stream);
  ASSERT_TRUE(second.ok());
  EXPECT_NE(second->get(), first->get());
  // A queued wait (on an event of `other` held behind its own gate): a new event too.
  Gate other_gate;
  ASSERT_TRUE(other->Enqueue(BlockOn(other_gate)).ok());
  absl::StatusOr<std::shared_ptr<Event>> pending_elsewhere = RecordEvent(*other);
  ASSERT_TRUE(pending_elsewhere.ok());
  ASSERT_TRUE(stream->WaitEvent(**pending_elsewhere).ok());
  absl::StatusOr<std::shared_ptr<Event>> third = RecordSharedEvent(*stream);
  ASSERT_TRUE(third.ok());
  EXPECT_NE(third->get(), second->get());
  ASSERT_TRUE(stream->Enqueue(count).ok());

  for (const auto* event : {&*first, &*second, &*third}) {
    absl::StatusOr<bool> done = (*event)->Query();
    ASSERT_TRUE(done.ok());
    EXPECT_FALSE(*done);
  }
  std::atomic<int> ran_at_first{-1}, ran_at_second{-1};
  (*first)->OnComplete([&](absl::Status) { ran_at_first = ran.load(); });
  (*second)->OnComplete([&](absl::Status) { ran_at_second = ran.load(); });
  gate.Open();
  ASSERT_TRUE((*second)->Synchronize(Soon()).ok());
  EXPECT_EQ(ran_at_first.load(), 1);
  EXPECT_EQ(ran_at_second.load(), 2);
  absl::StatusOr<bool> third_done = (*third)->Query();
  ASSERT_TRUE(third_done.ok());
  EXPECT_FALSE(*third_done) << "the shared event after a queued wait completed before the wait";
  other_gate.Open();
  ASSERT_TRUE((*third)->Synchronize(Soon()).ok());
  ASSERT_TRUE(stream->Synchronize(Soon()).ok());
  EXPECT_EQ(ran.load(), 3);

  // A poisoned stream: an error, as RecordEvent gives, not the last healthy point.
  ASSERT_TRUE(stream->Enqueue([] { return absl::InternalError("boom"); }).ok());
  EXPECT_EQ(stream->Synchronize(Soon()).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(RecordSharedEvent(*stream).status().code(), absl::StatusCode::kInternal);
}

TEST(EventTest, SharedEventOnACallerStreamFollowsItsItems) {
  auto stream = MakeCaller("caller-shared");
  int ran = 0;
  absl::StatusOr<std::shared_ptr<Event>> first = RecordSharedEvent(*stream);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::shared_ptr<Event>> again = RecordSharedEvent(*stream);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), first->get());
  ASSERT_TRUE(stream
                  ->Enqueue([&ran] {
                    ++ran;
                    return absl::OkStatus();
                  })
                  .ok());
  absl::StatusOr<std::shared_ptr<Event>> second = RecordSharedEvent(*stream);
  ASSERT_TRUE(second.ok());
  EXPECT_NE(second->get(), first->get());
  ASSERT_TRUE((*second)->Synchronize(Soon()).ok());
  EXPECT_EQ(ran, 1);
  // A failing item poisons: an error, and the next shared record is not the healthy one.
  EXPECT_FALSE(stream->Enqueue([] { return absl::InternalError("boom"); }).ok());
  EXPECT_EQ(RecordSharedEvent(*stream).status().code(), absl::StatusCode::kInternal);
}

class ForeignEvent final : public Event {
 public:
  Device device() const override { return Device::Cuda(3); }
  absl::Status Record(Stream&) override { return absl::OkStatus(); }
  absl::StatusOr<bool> Query() override { return true; }
  absl::Status Synchronize(absl::Time) override { return absl::OkStatus(); }
  void OnComplete(EventCallback callback) override { std::move(callback)(absl::OkStatus()); }
};

class ForeignStream final : public Stream {
 public:
  Device device() const override { return Device::Cuda(3); }
  const std::string& name() const override { return name_; }
  absl::Status Submit(StreamOp) override { return absl::OkStatus(); }
  absl::Status WaitEvent(Event&) override { return absl::OkStatus(); }
  absl::Status Synchronize(absl::Time) override { return absl::OkStatus(); }
  absl::Status status() const override { return absl::OkStatus(); }
  std::shared_ptr<Event> CreateEvent() override { return std::make_shared<ForeignEvent>(); }

 private:
  std::string name_ = "foreign";
};

TEST(EventTest, AHostEventCannotBeRecordedOnAForeignStream) {
  auto stream = MakeHost("host");
  ForeignStream foreign_stream;
  std::shared_ptr<Event> event = CreateHostEvent();
  absl::Status status = event->Record(foreign_stream);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(Message(status), HasSubstr("foreign"));
  EXPECT_TRUE(stream->status().ok());
}

// Other kinds of stream: RecordSharedEvent is RecordEvent (a fresh event each time).
TEST(EventTest, SharedEventOnAForeignStreamIsAFreshRecord) {
  ForeignStream foreign_stream;
  absl::StatusOr<std::shared_ptr<Event>> first = RecordSharedEvent(foreign_stream);
  absl::StatusOr<std::shared_ptr<Event>> second = RecordSharedEvent(foreign_stream);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_NE(first->get(), second->get());
  EXPECT_EQ((*first)->device(), Device::Cuda(3));
}

// ---------------------------------------------------------------------------------------------
// Caller streams.

TEST(CallerStreamTest, RunsWorkInlineOnTheCallingThread) {
  auto stream = MakeCaller("compute");
  EXPECT_EQ(stream->device(), Device::Host());
  EXPECT_EQ(stream->name(), "compute");
  EXPECT_EQ(stream->native_handle(), nullptr);
  std::thread::id ran_on;
  int value = 0;
  ASSERT_TRUE(stream
                  ->Enqueue([&] {
                    ran_on = std::this_thread::get_id();
                    value = 42;
                    return absl::OkStatus();
                  })
                  .ok());
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_EQ(value, 42);  // already ran: no Synchronize needed
  absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*stream);
  ASSERT_TRUE(event.ok());
  EXPECT_EQ((*event)->Query().value_or(false), true);
  EXPECT_TRUE(stream->Synchronize(absl::Now()).ok());
}

TEST(CallerStreamTest, FailurePoisons) {
  auto stream = MakeCaller("compute");
  absl::Status status = stream->Enqueue([] { return absl::AbortedError("nan loss"); });
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(Message(status), HasSubstr("compute"));
  EXPECT_THAT(Message(status), HasSubstr("nan loss"));
  bool ran = false;
  EXPECT_EQ(stream->Enqueue([&ran] {
    ran = true;
    return absl::OkStatus();
  }),
            status);
  EXPECT_FALSE(ran);
  EXPECT_EQ(stream->Synchronize(Soon()), status);
  std::shared_ptr<Event> event = stream->CreateEvent();
  EXPECT_EQ(event->Record(*stream), status);
  EXPECT_EQ(event->Query().status(), status);

  auto host = MakeHost("host");
  ASSERT_TRUE(host->WaitEvent(*event).ok());
  EXPECT_EQ(host->Synchronize(Soon()), status);
}

TEST(CallerStreamTest, WaitBlocksTheCallerUntilAHostStreamEventCompletes) {
  auto host = MakeHost("gather");
  auto caller = MakeCaller("compute");
  Gate gate;
  std::atomic<bool> gathered{false};
  ASSERT_TRUE(host->Enqueue(BlockOn(gate)).ok());
  ASSERT_TRUE(host->Enqueue([&gathered] {
                    gathered = true;
                    return absl::OkStatus();
                  })
                  .ok());
  absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*host);
  ASSERT_TRUE(event.ok());

  // Opens the gate a little later, so that the caller really blocks in WaitEvent.
  std::thread opener([&gate] {
    absl::SleepFor(absl::Milliseconds(20));
    gate.Open();
  });
  EXPECT_TRUE(caller->WaitEvent(**event).ok());
  EXPECT_TRUE(gathered);
  opener.join();
}

TEST(CallerStreamTest, WaitTimeoutPoisonsTheCallerStream) {
  auto host = MakeHost("gather");
  auto caller = MakeCaller("compute", absl::Milliseconds(30));
  Gate gate;
  ASSERT_TRUE(host->Enqueue(BlockOn(gate)).ok());
  absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*host);
  ASSERT_TRUE(event.ok());

  absl::Status status = caller->WaitEvent(**event);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(Message(status), HasSubstr("compute"));
  EXPECT_THAT(Message(status), HasSubstr("gather"));
  EXPECT_EQ(caller->status(), status);
  EXPECT_EQ(caller->Enqueue([] { return absl::OkStatus(); }), status);
  gate.Open();
  EXPECT_TRUE(host->Synchronize(Soon()).ok());
}

TEST(CallerStreamTest, WaitOnAFailedEventPoisonsTheCallerStream) {
  auto host = MakeHost("gather");
  auto caller = MakeCaller("compute");
  ASSERT_TRUE(host->Enqueue([] { return absl::UnavailableError("peer 3 gone"); }).ok());
  absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*host);
  // Depending on timing the record lands before or after the failure: both report it.
  std::shared_ptr<Event> recorded = event.ok() ? *event : nullptr;
  absl::Status host_status = host->Synchronize(Soon());
  ASSERT_EQ(host_status.code(), absl::StatusCode::kUnavailable);
  if (recorded == nullptr) {
    recorded = host->CreateEvent();
    EXPECT_EQ(recorded->Record(*host), host_status);
  }
  EXPECT_EQ(caller->WaitEvent(*recorded), host_status);
  EXPECT_EQ(caller->status(), host_status);
}

TEST(CallerStreamTest, HostStreamWaitsForCallerWorkRunningOnAnotherThread) {
  auto caller = MakeCaller("compute");
  auto host = MakeHost("reduce");
  Gate started, gate;
  std::atomic<bool> computed{false};
  std::thread worker([&] {
    EXPECT_TRUE(caller
                    ->Enqueue([&] {
                      started.Open();
                      gate.Wait();
                      computed = true;
                      return absl::OkStatus();
                    })
                    .ok());
  });
  ASSERT_TRUE(started.Wait());
  // The caller stream is busy on `worker`: the event completes only when that work finishes.
  absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*caller);
  ASSERT_TRUE(event.ok());
  EXPECT_EQ((*event)->Query().value_or(true), false);
  ASSERT_TRUE(host->WaitEvent(**event).ok());
  std::atomic<bool> saw_computed{false};
  ASSERT_TRUE(host->Enqueue([&] {
                    saw_computed = computed.load();
                    return absl::OkStatus();
                  })
                  .ok());
  gate.Open();
  ASSERT_TRUE(host->Synchronize(Soon()).ok());
  EXPECT_TRUE(saw_computed);
  EXPECT_TRUE(caller->Synchronize(Soon()).ok());
  worker.join();
}

// An event recorded while work of several threads runs completes when the work started
// before it finishes, even while later work keeps the stream busy.
TEST(CallerStreamTest, EventIsNotStarvedByWorkStartedAfterIt) {
  auto caller = MakeCaller("compute");
  Gate first_started, first_gate, second_started, second_gate;
  std::thread first([&] {
    EXPECT_TRUE(caller
                    ->Enqueue([&] {
                      first_started.Open();
                      first_gate.Wait();
                      return absl::OkStatus();
                    })
                    .ok());
  });
  ASSERT_TRUE(first_started.Wait());
  std::shared_ptr<Event> event = *RecordEvent(*caller);
  std::thread second([&] {
    EXPECT_TRUE(caller
                    ->Enqueue([&] {
                      second_started.Open();
                      second_gate.Wait();
                      return absl::OkStatus();
                    })
                    .ok());
  });
  ASSERT_TRUE(second_started.Wait());
  EXPECT_EQ(event->Query().value_or(true), false);
  first_gate.Open();
  // The stream is still busy with `second`, started after the record.
  EXPECT_TRUE(event->Synchronize(Soon()).ok());
  EXPECT_FALSE(caller->Synchronize(absl::Now() + absl::Milliseconds(1)).ok());
  second_gate.Open();
  first.join();
  second.join();
  EXPECT_TRUE(caller->Synchronize(Soon()).ok());
}

// Recording on a poisoned caller stream still waits for work that runs on other threads.
TEST(CallerStreamTest, EventOnAPoisonedStreamWaitsForRunningWork) {
  auto caller = MakeCaller("compute");
  Gate started, gate;
  std::atomic<bool> finished{false};
  std::thread worker([&] {
    (void)caller->Enqueue([&] {
      started.Open();
      gate.Wait();
      finished = true;
      return absl::OkStatus();
    });
  });
  ASSERT_TRUE(started.Wait());
  EXPECT_FALSE(caller->Enqueue([] { return absl::InternalError("boom"); }).ok());
  std::shared_ptr<Event> event = caller->CreateEvent();
  EXPECT_FALSE(event->Record(*caller).ok());
  EXPECT_EQ(event->Query().value_or(true), false) << "work from before the record still runs";
  gate.Open();
  EXPECT_EQ(event->Synchronize(Soon()).code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(finished);
  worker.join();
}

// ---------------------------------------------------------------------------------------------
// Dropped ops, the open event protocol, clocks.

class StreamOpTest : public ::testing::TestWithParam<StreamKind> {};

TEST_P(StreamOpTest, APoisonedStreamCancelsInsteadOfRunning) {
  const bool host = GetParam() == StreamKind::kHost;
  auto stream = host ? MakeHost("ops") : MakeCaller("ops");
  Gate gate;
  std::thread opener;
  if (host) {
    ASSERT_TRUE(stream
                    ->Enqueue([&gate] {
                      gate.Wait();
                      return absl::DataLossError("bad bits");
                    })
                    .ok());
  } else {
    EXPECT_FALSE(stream->Enqueue([] { return absl::DataLossError("bad bits"); }).ok());
  }
  std::atomic<int> ran{0};
  absl::Status cancelled;
  StreamOp op;
  op.name = "all_gather #3";
  op.kind = StreamOpKind::kCollective;
  op.run = [&ran] {
    ++ran;
    return absl::OkStatus();
  };
  op.cancel = [&cancelled](const absl::Status& poison) { cancelled = poison; };
  const absl::Status submitted = stream->Submit(std::move(op));
  if (host) {
    ASSERT_TRUE(submitted.ok());  // accepted: the stream fails only later
    gate.Open();
    EXPECT_EQ(stream->Synchronize(Soon()).code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(cancelled.code(), absl::StatusCode::kDataLoss) << cancelled;
  } else {
    // Refused at submission: neither run nor cancel is called.
    EXPECT_EQ(submitted.code(), absl::StatusCode::kDataLoss);
    EXPECT_TRUE(cancelled.ok());
  }
  EXPECT_EQ(ran.load(), 0);
  EXPECT_EQ(StreamOpKindName(StreamOpKind::kCollective), "collective");
}

INSTANTIATE_TEST_SUITE_P(BothKinds, StreamOpTest, kBothKinds, KindName);

TEST(EventTest, OnCompleteRunsOnceAfterTheCapturedWorkAndBeforeSynchronizeReturns) {
  auto stream = MakeHost("producer");
  Gate gate;
  std::atomic<int> value{0};
  ASSERT_TRUE(stream
                  ->Enqueue([&] {
                    gate.Wait();
                    value = 7;
                    return absl::OkStatus();
                  })
                  .ok());
  std::shared_ptr<Event> event = *RecordEvent(*stream);
  std::atomic<int> calls{0};
  std::atomic<int> seen{-1};
  event->OnComplete([&](absl::Status status) {
    EXPECT_TRUE(status.ok()) << status;
    seen = value.load();
    ++calls;
  });
  EXPECT_EQ(calls.load(), 0);
  gate.Open();
  ASSERT_TRUE(event->Synchronize(Soon()).ok());
  EXPECT_EQ(calls.load(), 1) << "callbacks run before the completion is reported";
  EXPECT_EQ(seen.load(), 7);
  // Registered after completion: at once, here.
  bool late = false;
  event->OnComplete([&late](absl::Status status) { late = status.ok(); });
  EXPECT_TRUE(late);
  // Never recorded: at once.
  bool never = false;
  CreateHostEvent()->OnComplete([&never](absl::Status status) { never = status.ok(); });
  EXPECT_TRUE(never);
  // On a failure, with the failure.
  ASSERT_TRUE(stream->Enqueue([] { return absl::InternalError("kernel"); }).ok());
  std::shared_ptr<Event> failed = stream->CreateEvent();
  (void)failed->Record(*stream);
  absl::Status outcome;
  std::atomic<bool> called{false};
  failed->OnComplete([&](absl::Status status) {
    outcome = status;
    called = true;
  });
  (void)failed->Synchronize(Soon());
  EXPECT_TRUE(called);
  EXPECT_EQ(outcome.code(), absl::StatusCode::kInternal);
}

// An event of a kind no stream knows (a framework's own, here a test double) is waited for
// through OnComplete: the host and caller streams order work after it, and its failure poisons.
TEST(EventTest, StreamsWaitForForeignEventsThroughOnComplete) {
  auto host = MakeHost("host");
  auto foreign = testing::ManualEvent::Create();
  ASSERT_TRUE(host->WaitEvent(*foreign).ok());
  std::atomic<bool> ran{false};
  ASSERT_TRUE(host->Enqueue([&ran] {
                    ran = true;
                    return absl::OkStatus();
                  })
                  .ok());
  EXPECT_FALSE(host->Synchronize(absl::Now() + absl::Milliseconds(50)).ok());
  EXPECT_FALSE(ran);
  foreign->Complete();
  ASSERT_TRUE(host->Synchronize(Soon()).ok());
  EXPECT_TRUE(ran);

  auto failing = testing::ManualEvent::Create();
  auto caller = MakeCaller("caller");
  std::thread failer([&failing] { failing->Fail(absl::AbortedError("framework stream died")); });
  EXPECT_EQ(caller->WaitEvent(*failing).code(), absl::StatusCode::kAborted);
  failer.join();
  EXPECT_EQ(caller->status().code(), absl::StatusCode::kAborted);
}

TEST(ClockTest, ManualClockMovesOnlyWhenTold) {
  ManualClock clock(absl::FromUnixSeconds(100));
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(100));
  clock.Advance(absl::Seconds(5));
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(105));
  clock.Set(absl::FromUnixSeconds(90));  // never backwards
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(105));
  clock.Set(absl::FromUnixSeconds(200));
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(200));
  EXPECT_EQ(clock.name(), "manual");
  EXPECT_EQ(WallClock().name(), "wall");
}

// WallNow reads the system's real-time clock: the time absl::Now() tells (abseil interpolates
// between resynchronizations with it: within a millisecond here), in nanoseconds too, and the
// wall clock of streams is it.
TEST(ClockTest, WallNowTellsTheTimeAbslNowDoes) {
  for (int i = 0; i < 1000; ++i) {
    const absl::Time before = absl::Now();
    const absl::Time wall = WallNow();
    const int64_t wall_ns = WallNowNanos();
    const absl::Time clock = WallClock().Now();
    const absl::Time after = absl::Now();
    for (absl::Time t : {wall, absl::FromUnixNanos(wall_ns), clock}) {
      ASSERT_GE(t, before - absl::Milliseconds(1));
      ASSERT_LE(t, after + absl::Milliseconds(1));
    }
  }
}

// A stream on a manual clock: its wait_timeout and every deadline are times on that clock. A
// wait of 5 virtual seconds survives real time passing, and ends when the clock is advanced.
class StreamClockTest : public ::testing::TestWithParam<StreamKind> {};

TEST_P(StreamClockTest, WaitTimeoutAndDeadlinesFollowTheStreamsClock) {
  const bool host = GetParam() == StreamKind::kHost;
  ManualClock clock;
  StreamOptions options{.name = "virtual", .wait_timeout = absl::Seconds(5), .clock = &clock};
  std::unique_ptr<Stream> stream = host ? *CreateHostStream(options) : *CreateCallerStream(options);
  EXPECT_EQ(&stream->clock(), &clock);
  auto never = testing::ManualEvent::Create();
  absl::Status waited;
  std::thread waiter;
  if (host) {
    ASSERT_TRUE(stream->WaitEvent(*never).ok());
  } else {
    waiter = std::thread([&] { waited = stream->WaitEvent(*never); });
  }
  // Once the wait has read the clock, advance it in steps: it must not give up before 5
  // virtual seconds, however much real time passes meanwhile.
  while (clock.waiters() == 0) std::this_thread::yield();
  const absl::Time start = clock.Now();
  for (int i = 0; i < 4; ++i) clock.Advance(absl::Seconds(1));
  EXPECT_TRUE(stream->status().ok());
  clock.Advance(absl::Seconds(2));
  const absl::Status status = stream->Synchronize(clock.Now() + absl::Hours(1));
  if (waiter.joinable()) waiter.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  if (!host) {
    EXPECT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded) << waited;
  }
  EXPECT_GE(clock.Now() - start, absl::Seconds(5));
  // An event's Synchronize deadline is on the recording stream's clock too.
  auto other = *CreateHostStream({.name = "gated", .clock = &clock});
  Gate gate;
  ASSERT_TRUE(other->Enqueue(BlockOn(gate)).ok());
  std::shared_ptr<Event> event = *RecordEvent(*other);
  std::thread advancer([&clock] {
    while (clock.waiters() == 0) std::this_thread::yield();
    clock.Advance(absl::Seconds(11));
  });
  EXPECT_EQ(event->Synchronize(clock.Now() + absl::Seconds(10)).code(),
            absl::StatusCode::kDeadlineExceeded);
  advancer.join();
  gate.Open();
  EXPECT_TRUE(event->Synchronize(clock.Now() + absl::Seconds(10)).ok());
}

INSTANTIATE_TEST_SUITE_P(BothKinds, StreamClockTest, kBothKinds, KindName);

// ---------------------------------------------------------------------------------------------
// Factories.

TEST(CreateStreamTest, HostDeviceGivesAHostStream) {
  StreamOptions options;
  options.name = "by-device";
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateStream(Device::Host(), options);
  ASSERT_TRUE(stream.ok()) << stream.status();
  EXPECT_EQ((*stream)->name(), "by-device");
  EXPECT_EQ((*stream)->device(), Device::Host());
  std::atomic<bool> ran{false};
  ASSERT_TRUE((*stream)
                  ->Enqueue([&ran] {
                    ran = true;
                    return absl::OkStatus();
                  })
                  .ok());
  ASSERT_TRUE((*stream)->Synchronize(Soon()).ok());
  EXPECT_TRUE(ran);
}

TEST(CreateStreamTest, CudaDeviceWorksOrFailsCleanly) {
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateStream(Device::Cuda(0));
  if (!stream.ok()) {
    // Built without CUDA (Unimplemented) or no GPU here (Unavailable).
    EXPECT_THAT(stream.status().code(),
                ::testing::AnyOf(absl::StatusCode::kUnimplemented, absl::StatusCode::kUnavailable))
        << stream.status();
    EXPECT_THAT(Message(stream.status()), HasSubstr("cuda:0"));
    return;
  }
  EXPECT_EQ((*stream)->device(), Device::Cuda(0));
  EXPECT_NE((*stream)->native_handle(), nullptr);
  std::atomic<bool> ran{false};
  ASSERT_TRUE((*stream)
                  ->Enqueue([&ran] {
                    ran = true;
                    return absl::OkStatus();
                  })
                  .ok());
  ASSERT_TRUE((*stream)->Synchronize(Soon()).ok());
  EXPECT_TRUE(ran);
}

TEST(CreateStreamTest, MissingCudaDeviceIsAnError) {
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateStream(Device::Cuda(4096));
  ASSERT_FALSE(stream.ok());
  EXPECT_THAT(stream.status().code(),
              ::testing::AnyOf(absl::StatusCode::kUnimplemented, absl::StatusCode::kUnavailable));
}

}  // namespace
}  // namespace shardline
