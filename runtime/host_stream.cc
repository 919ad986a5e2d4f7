// Host streams (CreateHostStream): one worker thread and one FIFO each, and the batching of their
// wake-ups (HostStreamWakeBatch).

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <typeinfo>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "runtime/clock.h"
#include "runtime/config.h"
#include "runtime/internal/clock_internal.h"
#include "runtime/internal/host_stream_internal.h"
#include "runtime/internal/lock_spinning.h"
#include "runtime/internal/stream_internal.h"
#include "runtime/recycling.h"
#include "runtime/status.h"
#include "runtime/stream.h"

namespace shardline {

SL_PARAM(bool, StreamBatchSched, "STREAM_BATCH_SCHED", true,
         "Host streams' worker threads run under SCHED_BATCH: a woken worker does not preempt "
         "the thread that submitted the work (it takes an idle core at once, else waits for the "
         "next scheduling point). 0: the default policy, under which every wake-up of a "
         "worker may switch the submitting thread out.");
SL_PARAM(int64_t, StreamSpinUs, "STREAM_SPIN_US", -1,
         "Microseconds a host stream's worker keeps polling for new work (yielding its core "
         "between polls) after its queue runs empty, before it sleeps. Work submitted meanwhile "
         "needs no wake-up (a system call on the submitting thread, and a context switch); the "
         "cost is a core kept busy for that long after each burst. -1 (auto): 50 us while the "
         "process's awake workers are at most a quarter of the hardware threads it may run on "
         "(never on a machine of fewer than 4), else 0. At most 1 s.",
         InRange<int64_t>(-1, 1000000));

namespace stream_internal {

// ThisThreadHostStreamCallStats(): plain increments, each thread its own.
constinit thread_local HostStreamCallStats call_stats;

namespace {
// What wakes a host stream's worker, shared between the stream, its worker and the threads that
// hold a wake-up of it back (so a stream destroyed meanwhile leaves a condition variable nobody
// waits on, not a dangling pointer).
struct WorkerWake {
  std::mutex mu;               // the stream's mutex (HostStream::mu_)
  std::condition_variable cv;  // the worker sleeps on it
  // Wake-ups handed to this worker by a HostStreamWakeBatch that woke it: it passes them on
  // before it runs anything, so the batch's thread pays for one wake-up, not one per worker.
  std::vector<std::shared_ptr<WorkerWake>> relay;  // guarded by mu
  bool worker_gone = false;                        // guarded by mu: nobody takes `relay` any more
  // Guarded by mu: the worker is inside cv's wait, so it passes `relay` on before it runs
  // anything. A worker already running (woken spuriously) could be running a wait for one of the
  // workers it would relay to.
  bool asleep = false;
};

// The calling thread's HostStreamWakeBatch: how deep, and the sleeping workers it holds back.
struct WakeBatchState {
  int depth = 0;
  std::vector<std::shared_ptr<WorkerWake>> held;
};
thread_local WakeBatchState wake_batch;

// Wakes a sleeping worker, or holds the wake-up back until the thread's batch ends. The caller
// pushed work under the worker's mutex while the worker slept (it releases the mutex only inside
// its wait), so the worker is waiting: a notify now or later cannot be lost.
void WakeWorker(const std::shared_ptr<WorkerWake>& wake) {
  if (wake_batch.depth > 0) {
    wake_batch.held.push_back(wake);
    return;
  }
  ++call_stats.wakes;
  wake->cv.notify_one();
}

// Wakes the workers in `relay` (a worker passing on the wake-ups handed to it).
void WakeRelayed(std::vector<std::shared_ptr<WorkerWake>>& relay) {
  for (const std::shared_ptr<WorkerWake>& wake : relay) wake->cv.notify_one();
  relay.clear();
}
}  // namespace

void WakeHeldWorkers() {
  if (wake_batch.held.empty()) return;
  // Swapped out first: the vector must not change under the loop.
  std::vector<std::shared_ptr<WorkerWake>> held;
  held.swap(wake_batch.held);
  // One wake-up from this thread: the first worker wakes the others. Unless its stream is gone
  // or its worker is already awake.
  size_t direct = held.size();
  if (held.size() > 1) {
    WorkerWake& first = *held.front();
    std::unique_lock<std::mutex> lock = LockSpinning(first.mu);
    if (first.asleep && !first.worker_gone) {
      for (size_t i = 1; i < held.size(); ++i) first.relay.push_back(std::move(held[i]));
      direct = 1;
    }
  }
  for (size_t i = 0; i < direct; ++i) {
    ++call_stats.wakes;
    held[i]->cv.notify_one();
  }
  held.clear();
  // Keep the storage for the next batch.
  if (wake_batch.held.empty()) wake_batch.held.swap(held);
}

void WakeHeldWorkersBeforeBlock(std::unique_lock<std::mutex>& lock) {
  if (wake_batch.held.empty()) return;
  // The waiter's lock may be a host stream's, the first held worker's among them.
  lock.unlock();
  WakeHeldWorkers();
  lock.lock();
}

namespace {

// Host-stream workers of the process that are not asleep waiting for work (running or polling).
std::atomic<int> awake_workers{0};
// Whether the calling thread is a host stream's worker (counted in awake_workers while awake).
thread_local bool on_worker = false;
// How long an idle worker polls under SHARDLINE_STREAM_SPIN_US=-1 (auto), when it may.
constexpr std::chrono::microseconds kAutoSpin{50};

// One queued item: an op, or a wait that had to be queued.
struct Item {
  enum Kind : uint8_t { kOp, kWait };
  explicit Item(StreamOp&& o) : kind(kOp), op(std::move(o)) {}
  explicit Item(WaitTarget&& w) : kind(kWait), wait(std::move(w)) {}
  Kind kind;
  StreamOp op;
  WaitTarget wait;  // kWait: what to wait for
};

// kTimeBlockItems consecutive items of a stream's FIFO, and the block their end times go to.
// Submitters construct items in the slots under the stream's lock and publish them by the count
// HostStream::pushed_; the worker runs and destroys them in place without any lock, then frees
// the segment (the last one it left is the stream's spare, reused for the next). So a
// submitter's lock stays on its own core while the worker drains the queue, and the worker takes
// the lock only to go to sleep.
struct Segment {
  explicit Segment(std::shared_ptr<TimeBlock> block) : times(std::move(block)) {}
  const std::shared_ptr<TimeBlock> times;
  std::atomic<Segment*> next{nullptr};  // set before the first item of the next is published
  alignas(Item) unsigned char slots[kTimeBlockItems][sizeof(Item)];

  Item* slot(uint64_t i) { return std::launder(reinterpret_cast<Item*>(slots[i])); }
};

// One worker thread, one FIFO. Ops and waits share the queue so that they keep their relative
// order.
class HostStream final : public Stream, public HostCaptureRecorder {
 public:
  HostStream(std::string name, absl::Duration wait_timeout, const Clock& clock, StreamTracer tracer,
             absl::Duration spin, bool batch)
      : name_(std::make_shared<const std::string>(std::move(name))),
        progress_(std::make_shared<HostStreamProgress>(name_, id(), clock)),
        wait_timeout_(wait_timeout),
        clock_(clock),
        tracer_(tracer),
        spin_(absl::ToChronoNanoseconds(spin)) {
    tail_ = NewSegment();
    tail_times_ = tail_->times;
    Segment* const head = tail_;
    worker_ = std::thread([this, batch, head] {
#ifdef SCHED_BATCH
      if (batch) {
        // A woken worker does not preempt the thread that woke it (the submitter, in the middle
        // of its hooks); it runs on an idle core at once, else at the next scheduling point.
        sched_param param{};
        (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
      }
#endif
      on_worker = true;
      awake_workers.fetch_add(1, std::memory_order_relaxed);
      WorkerLoop(head);
      awake_workers.fetch_sub(1, std::memory_order_relaxed);
    });
  }

  ~HostStream() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    stopping_flag_.store(true, std::memory_order_relaxed);
    wake_->cv.notify_one();
    worker_.join();
    ::operator delete(spare_.load(std::memory_order_acquire));
  }

  Device device() const override { return Device::Host(); }
  const std::string& name() const override { return *name_; }
  std::shared_ptr<const std::string> shared_name() const override { return name_; }
  const Clock& clock() const override { return clock_; }

  absl::Status Submit(StreamOp op) override {
    ++call_stats.submits;
    return Push(std::move(op));
  }

  absl::Status WaitEvent(Event& event) override {
    ++call_stats.waits;
    SL_ASSIGN_OR_RETURN(WaitTarget target, SnapshotWaitTarget(event, *this));
    if (target.empty()) return status();
    ++call_stats.waits_queued;
    return Push(std::move(target));
  }

  absl::Status Synchronize(absl::Time deadline) override {
    if (std::this_thread::get_id() == worker_.get_id()) {
      return absl::FailedPreconditionError(
          absl::StrCat("stream '", *name_,
                       "': Synchronize called from the stream's own work would wait forever"));
    }
    uint64_t target;
    {
      std::unique_lock<std::mutex> lock = LockSpinning(mu_);
      target = enqueued_;
    }
    if (!progress_->WaitUntilDone(target, deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat("stream '", *name_, "': Synchronize timed out with ",
                       target - progress_->finished(), " enqueued item(s) still pending"));
    }
    // The worker poisons status_ before it publishes the failed item finished.
    return status();
  }

  absl::Status status() const override {
    std::unique_lock<std::mutex> lock = LockSpinning(mu_);
    return status_;
  }

  std::shared_ptr<Event> CreateEvent() override { return CreateHostEvent(); }

  absl::Status RecordHostCapture(std::shared_ptr<HostCapture> capture) override {
    HostMark mark;
    absl::Status status = Mark(&mark, nullptr);
    progress_->OnComplete(mark.position, [capture = std::move(capture)](absl::Status outcome) {
      capture->Complete(std::move(outcome));
    });
    return status;
  }

  // Records a position on this stream (MarkHostStream). With `shared`, a fresh event that gets
  // the mark and becomes the stream's shared mark (RecordSharedEvent), under the same lock, so
  // the mark covers exactly the items counted in mark_'s position.
  absl::Status Mark(HostMark* mark, const std::shared_ptr<HostEvent>* shared) {
    std::unique_lock<std::mutex> lock = LockSpinning(mu_);
    if (!status_.ok()) {
      // Poisoned: complete at once with the failure, at the first failed item (the worker
      // records it in the progress before it poisons status_).
      mark->position = progress_->failed_at();
      mark->done_on = progress_;
      mark->done_at = clock_.Now();
      return status_;
    }
    mark->position = enqueued_;
    if (progress_->Done(enqueued_)) {
      // Everything enqueued before has run: complete now, timed now.
      mark->done_on = progress_;
      mark->done_at = clock_.Now();
    } else {
      ++call_stats.records_queued;
      mark->times = tail_times_;
    }
    if (shared != nullptr) {
      (*shared)->SetFreshMark(std::move(*mark), id());
      mark_.Set(shared, enqueued_);
    }
    return absl::OkStatus();
  }

  // RecordSharedEvent on this stream.
  absl::StatusOr<std::shared_ptr<Event>> RecordShared() {
    {
      std::unique_lock<std::mutex> lock = LockSpinning(mu_);
      if (status_.ok()) {
        if (std::shared_ptr<Event> shared = mark_.At(enqueued_)) return shared;
      }
    }
    std::shared_ptr<HostEvent> event = NewHostEvent();
    ++call_stats.records;
    HostMark mark;
    absl::Status status = Mark(&mark, &event);
    if (!status.ok()) return status;
    return event;
  }

 private:
  // A segment for the next items: the one the worker left last (spare_), else a new one.
  Segment* NewSegment() {
    void* memory = spare_.exchange(nullptr, std::memory_order_acquire);
    if (memory == nullptr) memory = ::operator new(sizeof(Segment));
    return new (memory)
        Segment(std::allocate_shared<TimeBlock>(RecyclingAllocator<TimeBlock>(), progress_));
  }
  // The worker, done with `segment`: kept as the spare (one per stream, 16 KiB), else freed.
  void FreeSegment(Segment* segment) {
    segment->~Segment();
    void* expected = nullptr;
    if (!spare_.compare_exchange_strong(expected, segment, std::memory_order_release,
                                        std::memory_order_relaxed)) {
      ::operator delete(segment);
    }
  }

  // Appends the item made of `what` (a StreamOp or a WaitTarget), constructed in its slot.
  template <typename What>
  absl::Status Push(What&& what) {
    std::unique_lock<std::mutex> lock = LockSpinning(mu_);
    if (!status_.ok()) return status_;
    const uint64_t index = enqueued_ % kTimeBlockItems;
    if (index == 0 && enqueued_ > 0) {
      // The first item of a segment: its block, for the worker to stamp and the records behind
      // it to read. Linked before the item is published.
      Segment* segment = NewSegment();
      tail_->next.store(segment, std::memory_order_release);
      tail_ = segment;
      tail_times_ = segment->times;
    }
    new (tail_->slots[index]) Item(std::forward<What>(what));
    ++enqueued_;
    pushed_.store(enqueued_, std::memory_order_release);
    // One notify per sleep: a worker already notified (or running) needs no second one.
    const bool wake = worker_idle_;
    worker_idle_ = false;
    lock.unlock();
    if (wake) WakeWorker(wake_);
    return absl::OkStatus();
  }

  // Runs `item` (or drops it, if the stream is poisoned). The caller destroys it before it
  // publishes it finished, so that its closures are gone before Synchronize() can report it done.
  absl::Status Run(Item& item, const absl::Status& poison) {
    absl::Status result;
    switch (item.kind) {
      case Item::kOp:
        if (poison.ok()) {
          result = tracer_.RunOp(item.op, clock_);
          if (!result.ok()) result = Annotate(result, absl::StrCat("stream '", *name_, "'"));
        } else if (item.op.cancel != nullptr) {
          std::move(item.op.cancel)(poison);
        }
        break;
      case Item::kWait:
        if (poison.ok()) result = RunTracedWait(tracer_, item.wait, wait_timeout_, clock_, *name_);
        break;
    }
    return result;
  }

  // Runs the items in order from `head` (the first segment) without the lock; takes it only to
  // go to sleep, and to poison the stream.
  void WorkerLoop(Segment* head) {
    uint64_t popped = 0;  // items run (or dropped) so far
    absl::Status poison;  // the worker's copy of status_
    while (true) {
      if (pushed_.load(std::memory_order_acquire) == popped && !AwaitWork(popped)) break;
      const uint64_t index = popped % kTimeBlockItems;
      if (index == 0 && popped > 0) {
        Segment* next = head->next.load(std::memory_order_acquire);
        FreeSegment(head);
        head = next;
      }
      Item* item = head->slot(index);
      absl::Status result = Run(*item, poison);
      item->~Item();
      ++popped;
      if (!result.ok() && poison.ok()) {
        // The first failure: recorded for the positions from this item on, then refuse later
        // submissions, all before anyone can see the item finished (Synchronize reads status_
        // once it did; a record on the poisoned stream reads the failed position).
        poison = result;
        progress_->Fail(popped, result);
        std::unique_lock<std::mutex> lock = LockSpinning(mu_);
        status_ = std::move(result);
      }
      progress_->Finish(popped, clock_.Now(), head->times.get());
    }
    FreeSegment(head);
  }

  // Waits until an item after the first `popped` is published (true), or the stream stops with
  // none (false). Polls a while first (MaySpin), then sleeps under mu_.
  bool AwaitWork(uint64_t popped) {
    if (!stopping_flag_.load(std::memory_order_relaxed) && MaySpin()) {
      // A Push meanwhile finds the worker awake and notifies nobody.
      Spin(popped);
      if (pushed_.load(std::memory_order_acquire) != popped) return true;
    }
    std::unique_lock<std::mutex> lock = LockSpinning(mu_);
    // pushed_ changes only under mu_: read here, it is exact.
    auto queued = [&] { return pushed_.load(std::memory_order_acquire) != popped; };
    while (true) {
      PassOnRelayedWakes(lock);
      if (queued() || stopping_) break;
      worker_idle_ = true;  // Push clears it when it notifies
      awake_workers.fetch_sub(1, std::memory_order_relaxed);
      wake_->asleep = true;
      wake_->cv.wait(lock, [&] { return queued() || stopping_ || !wake_->relay.empty(); });
      wake_->asleep = false;
      awake_workers.fetch_add(1, std::memory_order_relaxed);
      worker_idle_ = false;
    }
    if (queued()) return true;
    // Stopping. Wake-ups handed over later go straight to their workers.
    wake_->worker_gone = true;
    PassOnRelayedWakes(lock);
    return false;
  }

  // Wakes the workers whose wake-ups a batch handed to this one, with mu_ released meanwhile.
  void PassOnRelayedWakes(std::unique_lock<std::mutex>& lock) {
    if (wake_->relay.empty()) return;
    relayed_.swap(wake_->relay);
    lock.unlock();
    WakeRelayed(relayed_);
    lock.lock();
  }

  // Whether to poll before sleeping: spin_ > 0, or auto (negative) while the process's awake
  // workers are at most a quarter of its hardware threads.
  bool MaySpin() const {
    if (spin_.count() >= 0) return spin_.count() > 0;
    static const int hardware_threads = UsableHardwareThreads();
    return 4 * awake_workers.load(std::memory_order_relaxed) <= hardware_threads;
  }

  static int UsableHardwareThreads() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
    return static_cast<int>(std::thread::hardware_concurrency());
  }

  // Returns once an item was pushed after `seen` items, the stream is stopping, or the spin
  // (spin_, or kAutoSpin when auto) passed.
  void Spin(uint64_t seen) const {
    const auto end = std::chrono::steady_clock::now() + (spin_.count() < 0 ? kAutoSpin : spin_);
    while (true) {
      for (int i = 0; i < 64; ++i) {
        if (pushed_.load(std::memory_order_acquire) != seen ||
            stopping_flag_.load(std::memory_order_relaxed)) {
          return;
        }
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      }
      if (std::chrono::steady_clock::now() >= end) return;
      std::this_thread::yield();  // a thread waiting for this core (the submitter) goes first
    }
  }

  const std::shared_ptr<const std::string> name_;  // shared with the captures
  // What the worker finished, shared with the events recorded on the stream.
  const std::shared_ptr<HostStreamProgress> progress_;
  const absl::Duration wait_timeout_;
  const Clock& clock_;
  const StreamTracer tracer_;
  const std::chrono::nanoseconds spin_;
  std::atomic<uint64_t> pushed_{0};  // enqueued_, for the spinning worker to poll without mu_
  std::atomic<bool> stopping_flag_{false};
  // The memory of a segment the worker left, for the next NewSegment (it needs no lock: the worker
  // and the submitters exchange it whole).
  std::atomic<void*> spare_{nullptr};

  // The worker's mutex and condition variable, shared with the threads that hold a wake-up of it
  // back (HostStreamWakeBatch).
  const std::shared_ptr<WorkerWake> wake_ = std::make_shared<WorkerWake>();
  std::mutex& mu_ = wake_->mu;
  std::vector<std::shared_ptr<WorkerWake>>
      relayed_;  // the worker's: relay wake-ups being passed on
  uint64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool worker_idle_ ABSL_GUARDED_BY(mu_) = false;  // blocked in wake_->cv: needs a notify
  SharedMark mark_ ABSL_GUARDED_BY(mu_);           // the last RecordSharedEvent's, at enqueued_
  // The segment that takes item enqueued_ + 1, and the time block of item enqueued_ (the
  // previous segment's when enqueued_ ends one: the next is made with its first item).
  Segment* tail_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::shared_ptr<const TimeBlock> tail_times_ ABSL_GUARDED_BY(mu_);
  std::thread worker_;
};

}  // namespace

HostCaptureRecorder* AsHostStream(Stream& stream) {
  return typeid(stream) == typeid(HostStream) ? static_cast<HostStream*>(&stream) : nullptr;
}

absl::Status MarkHostStream(Stream& stream, HostMark* mark) {
  return static_cast<HostStream&>(stream).Mark(mark, nullptr);
}

absl::StatusOr<std::shared_ptr<Event>> RecordSharedOnHostStream(Stream& stream) {
  return static_cast<HostStream&>(stream).RecordShared();
}

}  // namespace stream_internal

absl::StatusOr<std::unique_ptr<Stream>> CreateHostStream(StreamOptions options) {
  // Before any worker exists whose wake-up a thread could hold back: threads about to block in a
  // clock's wait wake the workers they hold back first.
  static const bool hooked =
      (clock_internal::SetBeforeBlockHook(&stream_internal::WakeHeldWorkersBeforeBlock), true);
  (void)hooked;
  SL_ASSIGN_OR_RETURN(absl::Duration wait_timeout, stream_internal::ResolveWaitTimeout(options));
  const Clock& clock = options.clock != nullptr ? *options.clock : WallClock();
  const stream_internal::StreamTracer tracer(options);
  absl::StatusOr<int64_t> spin_us = ParamStreamSpinUs().Get();
  if (!spin_us.ok()) {
    return Annotate(spin_us.status(), absl::StrCat("stream '", options.name, "'"));
  }
  absl::StatusOr<bool> batch = ParamStreamBatchSched().Get();
  if (!batch.ok()) return Annotate(batch.status(), absl::StrCat("stream '", options.name, "'"));
  return std::make_unique<stream_internal::HostStream>(
      std::move(options.name), wait_timeout, clock, tracer, absl::Microseconds(*spin_us), *batch);
}

HostStreamWakeBatch::HostStreamWakeBatch() { ++stream_internal::wake_batch.depth; }

void HostStreamWakeBatch::End() {
  if (!open_) return;
  open_ = false;
  if (--stream_internal::wake_batch.depth == 0) stream_internal::WakeHeldWorkers();
}

void HostStreamWakeBatch::WakeHeld() { stream_internal::WakeHeldWorkers(); }

HostStreamCallStats ThisThreadHostStreamCallStats() { return stream_internal::call_stats; }

int OtherAwakeHostStreamWorkers() {
  return stream_internal::awake_workers.load(std::memory_order_relaxed) -
         (stream_internal::on_worker ? 1 : 0);
}

}  // namespace shardline
