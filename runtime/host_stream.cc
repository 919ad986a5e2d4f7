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

// A FIFO that keeps its storage. std::deque frees and allocates a node every few items (an
// Item is a few hundred bytes), which made the queue a malloc per submission or two.
template <typename T>
class Ring {
 public:
  bool empty() const { return size_ == 0; }
  T& front() { return slots_[head_]; }
  T& back() { return slots_[(head_ + size_ - 1) & (slots_.size() - 1)]; }
  void push_back(T&& item) {
    if (size_ == slots_.size()) Grow();
    slots_[(head_ + size_) & (slots_.size() - 1)] = std::move(item);
    ++size_;
  }
  // The slot keeps the moved-from (empty) item.
  void pop_front() {
    head_ = (head_ + 1) & (slots_.size() - 1);
    --size_;
  }

 private:
  void Grow() {
    std::vector<T> bigger(slots_.empty() ? 16 : 2 * slots_.size());  // a power of two
    for (size_t i = 0; i < size_; ++i) {
      bigger[i] = std::move(slots_[(head_ + i) & (slots_.size() - 1)]);
    }
    slots_ = std::move(bigger);
    head_ = 0;
  }

  std::vector<T> slots_;
  size_t head_ = 0;
  size_t size_ = 0;
};

// One worker thread, one FIFO. Ops, event markers and waits share the queue so that they keep
// their relative order.
class HostStream final : public Stream, public HostCaptureRecorder {
 public:
  HostStream(std::string name, absl::Duration wait_timeout, const Clock& clock, StreamTracer tracer,
             absl::Duration spin, bool batch)
      : name_(std::make_shared<const std::string>(std::move(name))),
        wait_timeout_(wait_timeout),
        clock_(clock),
        tracer_(tracer),
        spin_(absl::ToChronoNanoseconds(spin)) {
    worker_ = std::thread([this, batch] {
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
      WorkerLoop();
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
  }

  Device device() const override { return Device::Host(); }
  const std::string& name() const override { return *name_; }
  std::shared_ptr<const std::string> shared_name() const override { return name_; }
  const Clock& clock() const override { return clock_; }

  absl::Status Submit(StreamOp op) override {
    ++call_stats.submits;
    Item item;
    item.kind = Item::kOp;
    item.op = std::move(op);
    return Push(std::move(item));
  }

  absl::Status WaitEvent(Event& event) override {
    ++call_stats.waits;
    SL_ASSIGN_OR_RETURN(WaitTarget target, SnapshotWaitTarget(event, *this));
    if (target.empty()) return status();
    ++call_stats.waits_queued;
    Item item;
    item.kind = Item::kWait;
    item.wait = std::move(target);
    return Push(std::move(item));
  }

  absl::Status Synchronize(absl::Time deadline) override {
    if (std::this_thread::get_id() == worker_.get_id()) {
      return absl::FailedPreconditionError(
          absl::StrCat("stream '", *name_,
                       "': Synchronize called from the stream's own work would wait forever"));
    }
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t target = enqueued_;
    ++sync_waiters_;
    const bool done =
        clock_.WaitUntil(done_cv_, lock, deadline, [&] { return finished_ >= target; });
    --sync_waiters_;
    if (!done) {
      return absl::DeadlineExceededError(
          absl::StrCat("stream '", *name_, "': Synchronize timed out with ", target - finished_,
                       " enqueued item(s) still pending"));
    }
    return status_;
  }

  absl::Status status() const override {
    std::unique_lock<std::mutex> lock = LockSpinning(mu_);
    return status_;
  }

  std::shared_ptr<Event> CreateEvent() override { return CreateHostEvent(); }

  absl::Status RecordHostCapture(std::shared_ptr<HostCapture> capture) override {
    return RecordCapture(std::move(capture), nullptr);
  }

  // RecordSharedEvent on this stream.
  absl::StatusOr<std::shared_ptr<Event>> RecordShared() {
    {
      std::unique_lock<std::mutex> lock = LockSpinning(mu_);
      if (status_.ok()) {
        if (std::shared_ptr<Event> shared = mark_.At(position_)) return shared;
      }
    }
    std::shared_ptr<HostEvent> event = NewHostEvent();
    SL_RETURN_IF_ERROR(RecordCapture(HostEvent::PrepareFresh(event, *this, *this), &event));
    return event;
  }

 private:
  struct Item {
    enum Kind : uint8_t { kOp, kRecord, kWait };
    Kind kind = kOp;
    StreamOp op;
    WaitTarget wait;  // kRecord: the capture to complete. kWait: what to wait for.
    // A capture recorded right after this item was queued: completed once it ran (or was
    // dropped), with the stream's status then.
    std::shared_ptr<HostCapture> then;
  };

  // Records `capture` (its event's Record() on this stream). With `mark`, the capture's event
  // becomes the stream's shared mark (RecordSharedEvent), at the position read under the same
  // lock as the record, so the mark covers exactly the ops and waits counted in mark_position_.
  absl::Status RecordCapture(std::shared_ptr<HostCapture> capture,
                             const std::shared_ptr<HostEvent>* mark) {
    {
      std::unique_lock<std::mutex> lock = LockSpinning(mu_);
      if (status_.ok() && queue_.empty() && finished_ == enqueued_) {
        // Push's shortcut, without building an Item: everything enqueued before has run.
        ++enqueued_;
        ++finished_;
        SetMark(mark);
        lock.unlock();
        capture->Complete(absl::OkStatus());
        return absl::OkStatus();
      }
      ++call_stats.records_queued;
      if (status_.ok() && !queue_.empty() && queue_.back().then == nullptr) {
        // The last queued item is not running yet: the capture completes right after it, with
        // no item of its own (and no wake-up: the item's push already woke the worker).
        queue_.back().then = std::move(capture);
        SetMark(mark);
        return absl::OkStatus();
      }
    }
    Item item;
    item.kind = Item::kRecord;
    item.wait.capture = std::move(capture);
    return Push(std::move(item), mark);
  }

  // mu_ held; `mark` may be null (an ordinary record).
  void SetMark(const std::shared_ptr<HostEvent>* mark) { mark_.Set(mark, position_); }

  absl::Status Push(Item&& item, const std::shared_ptr<HostEvent>* mark = nullptr) {
    std::unique_lock<std::mutex> lock = LockSpinning(mu_);
    if (!status_.ok()) {
      absl::Status status = status_;
      lock.unlock();
      if (item.kind == Item::kRecord) item.wait.capture->Complete(status);
      return status;
    }
    if (item.kind == Item::kRecord && queue_.empty() && finished_ == enqueued_) {
      // Everything enqueued before has run: the event is complete now. Completed here rather
      // than by waking the worker for it (most records land on an idle stream).
      ++enqueued_;
      ++finished_;
      SetMark(mark);
      lock.unlock();
      item.wait.capture->Complete(absl::OkStatus());
      return absl::OkStatus();
    }
    if (item.kind == Item::kRecord) {
      SetMark(mark);
    } else {
      ++position_;
    }
    queue_.push_back(std::move(item));
    ++enqueued_;
    pushed_.store(enqueued_, std::memory_order_release);
    // One notify per sleep: a worker already notified (or running) needs no second one.
    const bool wake = worker_idle_;
    worker_idle_ = false;
    lock.unlock();
    if (wake) WakeWorker(wake_);
    return absl::OkStatus();
  }

  // Runs `item` (or drops it, if the stream is poisoned) and releases what it holds, so that its
  // closures are destroyed before Synchronize() can report it done.
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
        item.op = StreamOp();
        break;
      case Item::kRecord:
        item.wait.capture->Complete(poison);
        break;
      case Item::kWait:
        if (poison.ok()) result = RunTracedWait(tracer_, item.wait, wait_timeout_, clock_, *name_);
        break;
    }
    item.wait.capture = nullptr;
    item.wait.foreign = nullptr;
    if (item.then != nullptr) {
      item.then->Complete(poison.ok() ? result : poison);
      item.then = nullptr;
    }
    return result;
  }

  void WorkerLoop() {
    Item item;
    bool ran = false;
    absl::Status result;
    while (true) {
      absl::Status poison;
      {
        std::unique_lock<std::mutex> lock = LockSpinning(mu_);
        if (ran) {
          if (!result.ok() && status_.ok()) status_ = std::move(result);
          ++finished_;
          if (sync_waiters_ > 0) done_cv_.notify_all();
        }
        if (queue_.empty() && !stopping_ && MaySpin()) {
          // Poll for a while before sleeping: a Push meanwhile finds the worker awake and
          // notifies nobody.
          const uint64_t seen = enqueued_;
          lock.unlock();
          Spin(seen);
          lock.lock();
        }
        while (true) {
          PassOnRelayedWakes(lock);
          if (!queue_.empty() || stopping_) break;
          worker_idle_ = true;  // Push clears it when it notifies
          awake_workers.fetch_sub(1, std::memory_order_relaxed);
          wake_->asleep = true;
          wake_->cv.wait(lock,
                         [this] { return !queue_.empty() || stopping_ || !wake_->relay.empty(); });
          wake_->asleep = false;
          awake_workers.fetch_add(1, std::memory_order_relaxed);
          worker_idle_ = false;
        }
        if (queue_.empty()) {
          // Stopping. Wake-ups handed over later go straight to their workers.
          wake_->worker_gone = true;
          PassOnRelayedWakes(lock);
          return;
        }
        item = std::move(queue_.front());
        queue_.pop_front();
        poison = status_;
      }
      result = Run(item, poison);
      ran = true;
    }
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
  const absl::Duration wait_timeout_;
  const Clock& clock_;
  const StreamTracer tracer_;
  const std::chrono::nanoseconds spin_;
  std::atomic<uint64_t> pushed_{0};  // enqueued_, for the spinning worker to poll without mu_
  std::atomic<bool> stopping_flag_{false};

  // The worker's mutex and condition variable, shared with the threads that hold a wake-up of it
  // back (HostStreamWakeBatch).
  const std::shared_ptr<WorkerWake> wake_ = std::make_shared<WorkerWake>();
  std::mutex& mu_ = wake_->mu;
  std::vector<std::shared_ptr<WorkerWake>>
      relayed_;                      // the worker's: relay wake-ups being passed on
  std::condition_variable done_cv_;  // Synchronize waits for finished_
  Ring<Item> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t finished_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool worker_idle_ ABSL_GUARDED_BY(mu_) = false;  // blocked in wake_->cv: needs a notify
  int sync_waiters_ ABSL_GUARDED_BY(mu_) = 0;      // blocked in done_cv_
  // Ops and waits accepted so far (records not counted: they enqueue no work).
  uint64_t position_ ABSL_GUARDED_BY(mu_) = 0;
  SharedMark mark_ ABSL_GUARDED_BY(mu_);  // the last RecordSharedEvent's, at position_
  std::thread worker_;
};

}  // namespace

HostCaptureRecorder* AsHostStream(Stream& stream) {
  return typeid(stream) == typeid(HostStream) ? static_cast<HostStream*>(&stream) : nullptr;
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
