// Host and caller streams, host events, and the stream factories of runtime/stream.h.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "runtime/config.h"
#include "runtime/host_stream_internal.h"
#include "runtime/status.h"
#include "runtime/stream.h"

#ifdef SHARDLINE_WITH_CUDA
#include "runtime/cuda/cuda_stream.h"
#endif

namespace shardline {
namespace internal {

void HostCapture::Complete(absl::Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
    status_ = std::move(status);
  }
  cv_.notify_all();
}

absl::Status HostCapture::Wait(absl::Time deadline, absl::string_view waiter) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!WaitUntil(cv_, lock, deadline, [this] { return done_; })) {
    return absl::DeadlineExceededError(absl::StrCat(
        waiter, ": timed out waiting for an event recorded on stream '", stream_name_, "'"));
  }
  return status_;
}

bool HostCapture::done(absl::Status* status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (done_) *status = status_;
  return done_;
}

absl::StatusOr<absl::Duration> ResolveWaitTimeout(const StreamOptions& options) {
  if (options.wait_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("stream '", options.name,
                                                   "': StreamOptions.wait_timeout must not be "
                                                   "negative, got ",
                                                   absl::FormatDuration(options.wait_timeout)));
  }
  if (options.wait_timeout > absl::ZeroDuration()) return options.wait_timeout;
  absl::StatusOr<absl::Duration> timeout = DefaultTimeout();
  if (!timeout.ok()) {
    return Annotate(timeout.status(),
                    absl::StrCat("stream '", options.name,
                                 "': StreamOptions.wait_timeout is unset and its default, "
                                 "SHARDLINE_TIMEOUT_S, is invalid"));
  }
  return *timeout;
}

absl::Status HostEvent::Record(Stream& stream) {
  auto* recorder = dynamic_cast<HostCaptureRecorder*>(&stream);
  if (recorder == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("a host event cannot be recorded on stream '",
                                                   stream.name(), "' (", stream.device().ToString(),
                                                   "); create the event with its CreateEvent()"));
  }
  auto capture = std::make_shared<HostCapture>(stream.name());
  {
    std::lock_guard<std::mutex> lock(mu_);
    current_ = capture;
  }
  return recorder->RecordHostCapture(std::move(capture));
}

std::shared_ptr<HostCapture> HostEvent::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return current_;
}

absl::StatusOr<bool> HostEvent::Query() {
  std::shared_ptr<HostCapture> capture = current();
  if (capture == nullptr) return true;
  absl::Status status;
  if (!capture->done(&status)) return false;
  if (!status.ok()) return status;
  return true;
}

absl::Status HostEvent::Synchronize(absl::Time deadline) {
  std::shared_ptr<HostCapture> capture = current();
  if (capture == nullptr) return absl::OkStatus();
  return capture->Wait(deadline, "Event::Synchronize");
}

namespace {

// What a stream has to wait for to honour WaitEvent(event): a host capture, a foreign waiter, or
// nothing (never recorded, or already complete and OK).
struct WaitTarget {
  std::shared_ptr<HostCapture> capture;
  HostWaitable::Waiter foreign;
  bool empty() const { return capture == nullptr && foreign == nullptr; }
};

absl::StatusOr<WaitTarget> SnapshotWaitTarget(Event& event, const std::string& stream_name) {
  WaitTarget target;
  if (auto* host = dynamic_cast<HostEvent*>(&event)) {
    target.capture = host->current();
    absl::Status status;
    // A capture that completed OK needs no wait; a failed one still has to poison the stream in
    // order, after the work enqueued before this wait.
    if (target.capture != nullptr && target.capture->done(&status) && status.ok()) {
      target.capture = nullptr;
    }
    return target;
  }
  if (auto* waitable = dynamic_cast<HostWaitable*>(&event)) {
    SL_ASSIGN_OR_RETURN(target.foreign, waitable->SnapshotForHostWait());
    return target;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "stream '", stream_name, "' cannot wait for an event of device ", event.device().ToString()));
}

// Runs the wait of `target` on this thread, bounded by `timeout`. Errors are what the stream is
// poisoned with: the failed event's own Status, or DeadlineExceeded naming the stream.
absl::Status RunWait(WaitTarget& target, absl::Duration timeout, const std::string& stream_name) {
  const absl::Time deadline = absl::Now() + timeout;
  if (target.capture != nullptr) {
    return target.capture->Wait(deadline, absl::StrCat("stream '", stream_name, "' (wait_timeout ",
                                                       absl::FormatDuration(timeout), ")"));
  }
  absl::Status status = std::move(target.foreign)(deadline);
  if (absl::IsDeadlineExceeded(status)) {
    status = Annotate(status, absl::StrCat("stream '", stream_name, "' (wait_timeout ",
                                           absl::FormatDuration(timeout), ")"));
  }
  return status;
}

// One worker thread, one FIFO. Work items, event markers and waits share the queue so that they
// keep their relative order.
class HostStream final : public Stream, public HostCaptureRecorder {
 public:
  HostStream(std::string name, absl::Duration wait_timeout)
      : name_(std::move(name)), wait_timeout_(wait_timeout) {
    worker_ = std::thread([this] { WorkerLoop(); });
  }

  ~HostStream() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    work_cv_.notify_one();
    worker_.join();
  }

  Device device() const override { return Device::Host(); }
  const std::string& name() const override { return name_; }

  absl::Status Enqueue(Work work) override {
    Item item;
    item.kind = Item::kWork;
    item.work = std::move(work);
    return Push(std::move(item));
  }

  absl::Status WaitEvent(Event& event) override {
    SL_ASSIGN_OR_RETURN(WaitTarget target, SnapshotWaitTarget(event, name_));
    if (target.empty()) return status();
    Item item;
    item.kind = Item::kWait;
    item.wait = std::move(target);
    return Push(std::move(item));
  }

  absl::Status Synchronize(absl::Time deadline) override {
    if (std::this_thread::get_id() == worker_.get_id()) {
      return absl::FailedPreconditionError(
          absl::StrCat("stream '", name_,
                       "': Synchronize called from the stream's own work would wait forever"));
    }
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t target = enqueued_;
    ++sync_waiters_;
    const bool done = WaitUntil(done_cv_, lock, deadline, [&] { return finished_ >= target; });
    --sync_waiters_;
    if (!done) {
      return absl::DeadlineExceededError(
          absl::StrCat("stream '", name_, "': Synchronize timed out with ", target - finished_,
                       " enqueued item(s) still pending"));
    }
    return status_;
  }

  absl::Status status() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

  std::shared_ptr<Event> CreateEvent() override { return CreateHostEvent(); }

  absl::Status RecordHostCapture(std::shared_ptr<HostCapture> capture) override {
    Item item;
    item.kind = Item::kRecord;
    item.wait.capture = std::move(capture);
    return Push(std::move(item));
  }

 private:
  struct Item {
    enum Kind : uint8_t { kWork, kRecord, kWait };
    Kind kind = kWork;
    Work work;
    WaitTarget wait;  // kRecord: the capture to complete. kWait: what to wait for.
  };

  absl::Status Push(Item item) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!status_.ok()) {
      absl::Status status = status_;
      lock.unlock();
      if (item.kind == Item::kRecord) item.wait.capture->Complete(status);
      return status;
    }
    queue_.push_back(std::move(item));
    ++enqueued_;
    const bool wake = worker_idle_;
    lock.unlock();
    if (wake) work_cv_.notify_one();
    return absl::OkStatus();
  }

  // Runs `item` (or drops it, if the stream is poisoned) and releases what it holds, so that its
  // closure is destroyed before Synchronize() can report it done.
  absl::Status Run(Item& item, const absl::Status& poison) {
    absl::Status result;
    switch (item.kind) {
      case Item::kWork:
        if (poison.ok()) {
          result = std::move(item.work)();
          if (!result.ok()) result = Annotate(result, absl::StrCat("stream '", name_, "'"));
        }
        item.work = nullptr;
        break;
      case Item::kRecord:
        item.wait.capture->Complete(poison);
        break;
      case Item::kWait:
        if (poison.ok()) result = RunWait(item.wait, wait_timeout_, name_);
        break;
    }
    item.wait.capture = nullptr;
    item.wait.foreign = nullptr;
    return result;
  }

  void WorkerLoop() {
    Item item;
    bool ran = false;
    absl::Status result;
    while (true) {
      absl::Status poison;
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (ran) {
          if (!result.ok() && status_.ok()) status_ = std::move(result);
          ++finished_;
          if (sync_waiters_ > 0) done_cv_.notify_all();
        }
        worker_idle_ = true;
        work_cv_.wait(lock, [this] { return !queue_.empty() || stopping_; });
        worker_idle_ = false;
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
        poison = status_;
      }
      result = Run(item, poison);
      ran = true;
    }
  }

  const std::string name_;
  const absl::Duration wait_timeout_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // the worker waits for items
  std::condition_variable done_cv_;  // Synchronize waits for finished_
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t finished_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool worker_idle_ ABSL_GUARDED_BY(mu_) = false;  // blocked in work_cv_: needs a notify
  int sync_waiters_ ABSL_GUARDED_BY(mu_) = 0;      // blocked in done_cv_
  std::thread worker_;
};

// Work runs inline on the thread that enqueues it; waits block that thread. Work enqueued from
// several threads at once runs concurrently: the order is each thread's call order.
class CallerStream final : public Stream, public HostCaptureRecorder {
 public:
  CallerStream(std::string name, absl::Duration wait_timeout)
      : name_(std::move(name)), wait_timeout_(wait_timeout) {}

  Device device() const override { return Device::Host(); }
  const std::string& name() const override { return name_; }

  absl::Status Enqueue(Work work) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!status_.ok()) return status_;
      ++running_;
    }
    absl::Status result = std::move(work)();
    work = nullptr;
    if (!result.ok()) result = Annotate(result, absl::StrCat("stream '", name_, "'"));
    return Finish(std::move(result));
  }

  absl::Status WaitEvent(Event& event) override {
    SL_RETURN_IF_ERROR(status());
    SL_ASSIGN_OR_RETURN(WaitTarget target, SnapshotWaitTarget(event, name_));
    if (target.empty()) return absl::OkStatus();
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++running_;
    }
    return Finish(RunWait(target, wait_timeout_, name_));
  }

  absl::Status Synchronize(absl::Time deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!WaitUntil(idle_cv_, lock, deadline, [this] { return running_ == 0; })) {
      return absl::DeadlineExceededError(absl::StrCat("stream '", name_,
                                                      "': Synchronize timed out with ", running_,
                                                      " item(s) still running on other threads"));
    }
    return status_;
  }

  absl::Status status() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

  std::shared_ptr<Event> CreateEvent() override { return CreateHostEvent(); }

  absl::Status RecordHostCapture(std::shared_ptr<HostCapture> capture) override {
    absl::Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      status = status_;
      // Work running on other threads may predate this record: complete when it has all finished.
      if (status.ok() && running_ > 0) {
        pending_.push_back(std::move(capture));
        return absl::OkStatus();
      }
    }
    capture->Complete(status);
    return status;
  }

 private:
  // Ends one item: records its failure and completes the captures that waited for idleness.
  absl::Status Finish(absl::Status result) {
    std::deque<std::shared_ptr<HostCapture>> completed;
    absl::Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!result.ok() && status_.ok()) status_ = std::move(result);
      status = status_;
      if (--running_ == 0) {
        completed.swap(pending_);
        idle_cv_.notify_all();
      }
    }
    for (auto& capture : completed) capture->Complete(status);
    return status;
  }

  const std::string name_;
  const absl::Duration wait_timeout_;

  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  int64_t running_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::shared_ptr<HostCapture>> pending_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace
}  // namespace internal

absl::StatusOr<std::unique_ptr<Stream>> CreateHostStream(StreamOptions options) {
  SL_ASSIGN_OR_RETURN(absl::Duration wait_timeout, internal::ResolveWaitTimeout(options));
  return std::make_unique<internal::HostStream>(std::move(options.name), wait_timeout);
}

absl::StatusOr<std::unique_ptr<Stream>> CreateCallerStream(StreamOptions options) {
  SL_ASSIGN_OR_RETURN(absl::Duration wait_timeout, internal::ResolveWaitTimeout(options));
  return std::make_unique<internal::CallerStream>(std::move(options.name), wait_timeout);
}

absl::StatusOr<std::unique_ptr<Stream>> CreateStream(Device device, StreamOptions options) {
  if (device.is_host()) return CreateHostStream(std::move(options));
#ifdef SHARDLINE_WITH_CUDA
  return CreateCudaStream(device.index(), std::move(options));
#else
  return absl::UnimplementedError(absl::StrCat("cannot create stream '", options.name, "' on ",
                                               device.ToString(),
                                               ": shardline was built without CUDA "
                                               "(SHARDLINE_WITH_CUDA=OFF)"));
#endif
}

std::shared_ptr<Event> CreateHostEvent() { return std::make_shared<internal::HostEvent>(); }

absl::StatusOr<std::shared_ptr<Event>> RecordEvent(Stream& stream) {
  std::shared_ptr<Event> event = stream.CreateEvent();
  SL_RETURN_IF_ERROR(event->Record(stream));
  return event;
}

}  // namespace shardline
