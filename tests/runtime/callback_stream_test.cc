// Callback streams, events and allocators (runtime/callback_stream.h) against a test double of
// another runtime: a queue whose fns the test runs when it chooses, an event it completes, a pool
// over a fixed arena. Checked: every callback gets the user pointer; work, records and waits run
// in enqueue order; a wait gives up at the stream's wait_timeout, and Synchronize at its
// deadline, with DeadlineExceeded instead of hanging.

#include "runtime/callback_stream.h"

#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/clock.h"
#include "runtime/stream.h"
#include "tests/common/gate.h"
#include "tests/runtime/manual_event.h"

namespace shardline {
namespace {

using ::testing::HasSubstr;

absl::Time Soon() { return absl::Now() + absl::Seconds(20); }

// The other runtime's in-order queue: enqueue keeps (fn, ctx); the test runs them.
class Queue {
 public:
  static int Enqueue(void* user, void (*fn)(void* ctx), void* ctx) {
    auto* q = static_cast<Queue*>(user);
    EXPECT_EQ(q->self_, q) << "enqueue got another user pointer";
    std::lock_guard<std::mutex> lock(q->mu_);
    if (q->refuse_with_ != 0) return q->refuse_with_;
    q->fns_.emplace_back(fn, ctx);
    return 0;
  }
  static void Release(void* user) {
    auto* q = static_cast<Queue*>(user);
    EXPECT_EQ(q->self_, q) << "release got another user pointer";
    std::lock_guard<std::mutex> lock(q->mu_);
    ++q->releases_;
  }

  StreamCallbacks callbacks() {
    return {.user = this, .enqueue = &Queue::Enqueue, .release = &Queue::Release, .origin = "test"};
  }
  // Runs the oldest fn on this thread; false if there is none.
  bool RunOne() {
    std::pair<void (*)(void*), void*> next;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fns_.empty()) return false;
      next = fns_.front();
      fns_.pop_front();
    }
    next.first(next.second);
    return true;
  }
  void RunAll() {
    while (RunOne()) {
    }
  }
  size_t pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return fns_.size();
  }
  int releases() {
    std::lock_guard<std::mutex> lock(mu_);
    return releases_;
  }
  void RefuseWith(int rc) {
    std::lock_guard<std::mutex> lock(mu_);
    refuse_with_ = rc;
  }

 private:
  Queue* const self_ = this;
  std::mutex mu_;
  std::deque<std::pair<void (*)(void*), void*>> fns_;
  int refuse_with_ = 0;
  int releases_ = 0;
};

std::unique_ptr<Stream> MakeStream(Queue& queue, absl::Duration wait_timeout = absl::Seconds(20)) {
  absl::StatusOr<std::unique_ptr<Stream>> stream =
      CreateCallbackStream(queue.callbacks(), {.name = "fw", .wait_timeout = wait_timeout});
  EXPECT_TRUE(stream.ok()) << stream.status();
  return std::move(stream).value();
}

// Work that appends `c` to `log` (the test's thread and the runner's are ordered by the queue).
Stream::Work Append(std::string& log, char c) {
  return [&log, c] {
    log += c;
    return absl::OkStatus();
  };
}

TEST(CallbackStreamTest, RunsOpsAndRecordsInEnqueueOrderOnTheOtherRuntimesQueue) {
  Queue queue;
  std::string log;
  {
    std::unique_ptr<Stream> stream = MakeStream(queue);
    EXPECT_EQ(stream->device(), Device::Host());
    ASSERT_TRUE(stream->Enqueue(Append(log, 'a')).ok());
    absl::StatusOr<std::shared_ptr<Event>> after_a = RecordEvent(*stream);
    ASSERT_TRUE(after_a.ok()) << after_a.status();
    ASSERT_TRUE(stream->Enqueue(Append(log, 'b')).ok());
    // A host stream waits for the callback stream's event: its work sees 'a' and not 'b'.
    absl::StatusOr<std::unique_ptr<Stream>> host = CreateHostStream({.name = "host"});
    ASSERT_TRUE(host.ok()) << host.status();
    ASSERT_TRUE((*host)->WaitEvent(**after_a).ok());
    std::string seen_by_host;
    std::mutex seen_mu;
    ASSERT_TRUE((*host)
                    ->Enqueue([&] {
                      std::lock_guard<std::mutex> lock(seen_mu);
                      seen_by_host = "done";
                      return absl::OkStatus();
                    })
                    .ok());

    // Nothing runs until the other runtime runs it: one fn per op and per record.
    EXPECT_EQ(queue.pending(), 3u);
    EXPECT_EQ(log, "");
    EXPECT_EQ(*(*after_a)->Query(), false);
    ASSERT_TRUE(queue.RunOne());
    EXPECT_EQ(log, "a");
    EXPECT_EQ(*(*after_a)->Query(), false) << "the record is behind 'a' in the queue, not yet run";
    ASSERT_TRUE(queue.RunOne());
    EXPECT_EQ(*(*after_a)->Query(), true);
    EXPECT_EQ(log, "a");
    ASSERT_TRUE((*host)->Synchronize(Soon()).ok());
    {
      std::lock_guard<std::mutex> lock(seen_mu);
      EXPECT_EQ(seen_by_host, "done");
    }
    ASSERT_TRUE(queue.RunOne());
    EXPECT_EQ(log, "ab");
    EXPECT_FALSE(queue.RunOne());
    EXPECT_TRUE(stream->Synchronize(Soon()).ok());
    EXPECT_EQ(queue.releases(), 0);
  }
  EXPECT_EQ(queue.releases(), 1) << "the destructor hands the stream back once";
}

TEST(CallbackStreamTest, WorkAfterAWaitRunsOnlyOnceTheEventCompleted) {
  Queue queue;
  std::unique_ptr<Stream> stream = MakeStream(queue);
  // An event of a kind the stream does not know, and one of a host stream held by a gate.
  std::shared_ptr<testing::ManualEvent> foreign = testing::ManualEvent::Create();
  testing::Gate gate;
  absl::StatusOr<std::unique_ptr<Stream>> host = CreateHostStream({.name = "host"});
  ASSERT_TRUE(host.ok()) << host.status();
  ASSERT_TRUE((*host)->Enqueue(testing::BlockOn(gate)).ok());
  absl::StatusOr<std::shared_ptr<Event>> host_event = RecordEvent(**host);
  ASSERT_TRUE(host_event.ok()) << host_event.status();

  std::mutex mu;
  bool foreign_completed = false;  // set just before the test completes `foreign`
  bool gate_opened = false;
  bool saw_foreign = false, saw_gate = false;
  ASSERT_TRUE(stream->WaitEvent(*foreign).ok());
  ASSERT_TRUE(stream->WaitEvent(**host_event).ok());
  ASSERT_TRUE(stream
                  ->Enqueue([&] {
                    std::lock_guard<std::mutex> lock(mu);
                    saw_foreign = foreign_completed;
                    saw_gate = gate_opened;
                    return absl::OkStatus();
                  })
                  .ok());
  ASSERT_EQ(queue.pending(), 3u);

  // The runner blocks in the first wait until the test completes the events.
  std::thread runner([&] { queue.RunAll(); });
  {
    std::lock_guard<std::mutex> lock(mu);
    foreign_completed = true;
  }
  foreign->Complete();
  {
    std::lock_guard<std::mutex> lock(mu);
    gate_opened = true;
  }
  gate.Open();
  runner.join();
  EXPECT_TRUE(stream->Synchronize(Soon()).ok());
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_TRUE(saw_foreign) << "the work ran before the foreign event completed";
  EXPECT_TRUE(saw_gate) << "the work ran before the host stream's event completed";
}

TEST(CallbackStreamTest, WaitsEndAtTheirDeadlinesWithDeadlineExceeded) {
  Queue queue;
  const absl::Duration wait_timeout = absl::Milliseconds(50);
  std::unique_ptr<Stream> stream = MakeStream(queue, wait_timeout);
  std::shared_ptr<testing::ManualEvent> never = testing::ManualEvent::Create();
  ASSERT_TRUE(stream->WaitEvent(*never).ok());
  bool ran = false;
  absl::Status cancelled;
  StreamOp op;
  op.run = [&] {
    ran = true;
    return absl::OkStatus();
  };
  op.cancel = [&](const absl::Status& poison) { cancelled = poison; };
  ASSERT_TRUE(stream->Submit(std::move(op)).ok());

  // The other runtime has not run the fns: Synchronize gives up at its deadline.
  absl::Status sync = stream->Synchronize(absl::Now() + absl::Milliseconds(20));
  EXPECT_EQ(sync.code(), absl::StatusCode::kDeadlineExceeded) << sync;
  EXPECT_THAT(sync.message(), HasSubstr("2 enqueued fn(s) the framework has not run (test)"));

  // The wait gives up at wait_timeout and poisons the stream; the op behind it is cancelled.
  const absl::Time start = absl::Now();
  queue.RunAll();
  const absl::Duration waited = absl::Now() - start;
  EXPECT_GE(waited, wait_timeout);
  EXPECT_LT(waited, absl::Seconds(10));
  EXPECT_FALSE(ran);
  EXPECT_EQ(cancelled.code(), absl::StatusCode::kDeadlineExceeded) << cancelled;
  const absl::Status poison = stream->status();
  EXPECT_EQ(poison.code(), absl::StatusCode::kDeadlineExceeded) << poison;
  EXPECT_THAT(poison.message(), HasSubstr("stream 'fw': waited its wait_timeout (50ms)"));
  EXPECT_THAT(poison.message(), HasSubstr("(test)"));
  EXPECT_EQ(stream->Synchronize(Soon()), poison);
  // A poisoned stream refuses new work without enqueueing it.
  EXPECT_EQ(stream->Enqueue([] { return absl::OkStatus(); }), poison);
  EXPECT_EQ(queue.pending(), 0u);
}

TEST(CallbackStreamTest, ARefusedEnqueueFailsTheStream) {
  Queue queue;
  std::unique_ptr<Stream> stream = MakeStream(queue);
  queue.RefuseWith(7);
  bool touched = false;
  StreamOp op;
  op.run = [&] {
    touched = true;
    return absl::OkStatus();
  };
  op.cancel = [&](const absl::Status&) { touched = true; };
  const absl::Status refused = stream->Submit(std::move(op));
  EXPECT_EQ(refused.code(), absl::StatusCode::kInternal) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("stream 'fw': the framework's enqueue returned 7"));
  EXPECT_FALSE(touched) << "a refused op neither runs nor is cancelled";
  EXPECT_EQ(stream->status(), refused);
  EXPECT_EQ(stream->Synchronize(Soon()), refused);
}

TEST(CallbackStreamTest, SynchronizeFromItsOwnWorkIsRefused) {
  Queue queue;
  std::unique_ptr<Stream> stream = MakeStream(queue);
  absl::Status inner;
  ASSERT_TRUE(stream
                  ->Enqueue([&] {
                    inner = stream->Synchronize(Soon());
                    return absl::OkStatus();
                  })
                  .ok());
  queue.RunAll();
  EXPECT_EQ(inner.code(), absl::StatusCode::kFailedPrecondition) << inner;
  EXPECT_TRUE(stream->Synchronize(Soon()).ok());
}

TEST(CallbackStreamTest, CreationChecksItsArguments) {
  Queue queue;
  StreamCallbacks no_enqueue = queue.callbacks();
  no_enqueue.enqueue = nullptr;
  EXPECT_EQ(CreateCallbackStream(no_enqueue).status().code(), absl::StatusCode::kInvalidArgument);
  ManualClock clock;
  EXPECT_EQ(CreateCallbackStream(queue.callbacks(), {.clock = &clock}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateCallbackEvent({}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateCallbackAllocator({}, Device::Host(), "pool").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(queue.releases(), 0) << "release is not called when creation fails";
}

// The other runtime's event: query answers `state`; notify keeps (done, ctx) for the test.
struct ForeignEvent {
  static int Query(void* user) { return static_cast<ForeignEvent*>(user)->Checked()->state; }
  static void Notify(void* user, void (*done)(void* ctx, int failed), void* ctx) {
    ForeignEvent* e = static_cast<ForeignEvent*>(user)->Checked();
    std::lock_guard<std::mutex> lock(e->mu);
    e->pending.emplace_back(done, ctx);
  }
  static void Release(void* user) { ++static_cast<ForeignEvent*>(user)->Checked()->releases; }
  ForeignEvent* Checked() {
    EXPECT_EQ(self, this) << "a callback got another user pointer";
    return this;
  }
  // Calls every kept done(ctx, failed).
  void Finish(int failed) {
    std::deque<std::pair<void (*)(void*, int), void*>> fns;
    {
      std::lock_guard<std::mutex> lock(mu);
      fns.swap(pending);
    }
    for (auto& [done, ctx] : fns) done(ctx, failed);
  }
  EventCallbacks callbacks() {
    return {.user = this,
            .query = &ForeignEvent::Query,
            .notify = &ForeignEvent::Notify,
            .release = &ForeignEvent::Release,
            .origin = "test"};
  }

  ForeignEvent* const self = this;
  int state = 0;
  int releases = 0;
  std::mutex mu;
  std::deque<std::pair<void (*)(void*, int), void*>> pending;
};

TEST(CallbackEventTest, AnswersThroughQueryAndNotifyAndTimesOut) {
  ForeignEvent foreign;
  {
    absl::StatusOr<std::shared_ptr<Event>> event = CreateCallbackEvent(foreign.callbacks());
    ASSERT_TRUE(event.ok()) << event.status();
    EXPECT_EQ(*(*event)->Query(), false);
    foreign.state = 1;
    EXPECT_EQ(*(*event)->Query(), true);
    foreign.state = -3;
    EXPECT_THAT((*event)->Query().status().message(), HasSubstr("reported failure -3"));

    // Nobody calls done: Synchronize returns at its deadline.
    const absl::Status timed_out = (*event)->Synchronize(absl::Now() + absl::Milliseconds(20));
    EXPECT_EQ(timed_out.code(), absl::StatusCode::kDeadlineExceeded) << timed_out;
    EXPECT_THAT(timed_out.message(), HasSubstr("a framework's event (test)"));

    absl::Status heard = absl::UnknownError("not called");
    (*event)->OnComplete([&](absl::Status status) { heard = std::move(status); });
    foreign.Finish(/*failed=*/5);  // also ends the timed-out Synchronize's notification
    EXPECT_EQ(heard.code(), absl::StatusCode::kInternal) << heard;
    EXPECT_THAT(heard.message(), HasSubstr("reported failure 5"));

    absl::StatusOr<std::unique_ptr<Stream>> host = CreateHostStream({.name = "host"});
    ASSERT_TRUE(host.ok()) << host.status();
    EXPECT_EQ((*event)->Record(**host).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(foreign.releases, 0);
  }
  EXPECT_EQ(foreign.releases, 1);
}

// The other runtime's pool: hands out `arena` (+ `offset`), or refuses with `refuse_with`.
struct Pool {
  static int Alloc(void* user, size_t bytes, void* stream, void** ptr) {
    Pool* p = static_cast<Pool*>(user);
    EXPECT_EQ(p->self, p) << "alloc got another user pointer";
    EXPECT_EQ(stream, nullptr) << "no stream, or a host stream";
    p->alloc_bytes = bytes;
    if (p->refuse_with != 0) return p->refuse_with;
    *ptr = p->arena + p->offset;
    return 0;
  }
  static void Free(void* user, void* ptr, size_t bytes, void* stream) {
    Pool* p = static_cast<Pool*>(user);
    EXPECT_EQ(p->self, p) << "free got another user pointer";
    EXPECT_EQ(stream, nullptr);
    ++p->frees;
    p->freed = ptr;
    p->freed_bytes = bytes;
  }

  Pool* const self = this;
  alignas(64) unsigned char arena[256] = {};
  size_t offset = 0;
  int refuse_with = 0;
  size_t alloc_bytes = 0;
  int frees = 0;
  void* freed = nullptr;
  size_t freed_bytes = 0;
};

TEST(CallbackAllocatorTest, AllocatesAndFreesThroughTheCallbacks) {
  Pool pool;
  absl::StatusOr<std::unique_ptr<Allocator>> allocator = CreateCallbackAllocator(
      {.user = &pool, .alloc = &Pool::Alloc, .free = &Pool::Free, .origin = "test"}, Device::Host(),
      "fw pool");
  ASSERT_TRUE(allocator.ok()) << allocator.status();
  {
    absl::StatusOr<Buffer> buffer = (*allocator)->Allocate(100);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    EXPECT_EQ(buffer->data(), pool.arena);
    EXPECT_EQ(pool.alloc_bytes, 100u);
    EXPECT_EQ((*allocator)->stats().current_bytes, 100);
    EXPECT_EQ(pool.frees, 0);
  }
  EXPECT_EQ(pool.frees, 1);
  EXPECT_EQ(pool.freed, pool.arena);
  EXPECT_EQ(pool.freed_bytes, 100u);

  // A misaligned block is refused and given back at once.
  pool.offset = 8;
  absl::StatusOr<Buffer> misaligned = (*allocator)->Allocate(32);
  EXPECT_EQ(misaligned.status().code(), absl::StatusCode::kInvalidArgument) << misaligned.status();
  EXPECT_THAT(misaligned.status().message(), HasSubstr("not aligned to 64 bytes (test)"));
  EXPECT_EQ(pool.frees, 2);
  EXPECT_EQ(pool.freed, pool.arena + 8);
  EXPECT_EQ(pool.freed_bytes, 32u);

  pool.offset = 0;
  pool.refuse_with = 3;
  absl::StatusOr<Buffer> refused = (*allocator)->Allocate(16);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("returned 3"));
  EXPECT_EQ((*allocator)->stats().current_bytes, 0);
}

}  // namespace
}  // namespace shardline
