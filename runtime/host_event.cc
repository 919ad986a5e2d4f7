// Host events and their captures (runtime/internal/stream_internal.h), what a host or caller
// stream waits for when it waits for an event of any kind, and the stream tracer.

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <typeinfo>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "runtime/internal/host_stream_internal.h"
#include "runtime/internal/lock_spinning.h"
#include "runtime/internal/stream_internal.h"
#include "runtime/recycling.h"
#include "runtime/status.h"
#include "runtime/stream.h"
#include "runtime/trace.h"

namespace shardline {
namespace stream_internal {

void HostCapture::Complete(absl::Status status) {
  // Read before taking mu_: the time the captured work was done, not when the callbacks were.
  const absl::Time now = clock_->Now();
  std::unique_lock<std::mutex> lock = LockSpinning(mu_);
  if (done_ || completing_) return;
  completing_ = true;
  completed_at_ = now;
  status_ = std::move(status);
  // The callbacks run before the capture reports done, so that whoever sees it done (a
  // Synchronize, a Query) also sees their effects (an allocator's block marked free). One
  // registered meanwhile joins the next round.
  while (!callbacks_.empty()) {
    Callbacks callbacks;
    callbacks.swap(callbacks_);
    const absl::Status outcome = status_;
    lock.unlock();
    for (EventCallback& callback : callbacks) std::move(callback)(outcome);
    lock.lock();
  }
  done_ = true;
  // Notified under the lock: a waiter on a ManualClock may be about to destroy its wait.
  cv_.notify_all();
}

void HostCapture::OnComplete(EventCallback callback) {
  absl::Status status;
  {
    std::unique_lock<std::mutex> lock = LockSpinning(mu_);
    if (!done_) {
      callbacks_.push_back(std::move(callback));
      return;
    }
    status = status_;
  }
  std::move(callback)(std::move(status));
}

absl::Status HostCapture::Wait(absl::Time deadline, absl::string_view waiter) {
  return Wait(deadline, [waiter] { return std::string(waiter); });
}

absl::Status HostCapture::Wait(absl::Time deadline, absl::FunctionRef<std::string()> waiter) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!clock_->WaitUntil(cv_, lock, deadline, [this] { return done_; })) {
    return absl::DeadlineExceededError(absl::StrCat(
        waiter(), ": timed out waiting for an event recorded on stream '", stream_name(), "'"));
  }
  return status_;
}

bool HostCapture::done(absl::Status* status) {
  std::unique_lock<std::mutex> lock = LockSpinning(mu_);
  if (done_) *status = status_;
  return done_;
}

std::optional<absl::Time> HostCapture::completed_at() {
  std::unique_lock<std::mutex> lock = LockSpinning(mu_);
  if (!done_) return std::nullopt;
  return completed_at_;
}

bool HostStreamProgress::WaitUntilDone(uint64_t position, absl::Time deadline) {
  if (Done(position)) return true;
  std::unique_lock<std::mutex> lock(wait_mu_);
  // Registered before the check (first_wait_'s store and the check's load sequentially
  // consistent, as Finish's store of the count and its load of first_wait_): either Finish sees
  // this position due or the check sees it done.
  waits_.push_back(position);
  if (position < first_wait_.load(std::memory_order_relaxed)) {
    first_wait_.store(position, std::memory_order_seq_cst);
  }
  const bool done = clock_->WaitUntil(wait_cv_, lock, deadline, [&] {
    return finished_.load(std::memory_order_seq_cst) >= position;
  });
  waits_.erase(std::find(waits_.begin(), waits_.end(), position));
  uint64_t first = kNever;
  for (uint64_t p : waits_) first = std::min(first, p);
  first_wait_.store(first, std::memory_order_seq_cst);
  return done;
}

absl::Status HostStreamProgress::Wait(uint64_t position, absl::Time deadline,
                                      absl::FunctionRef<std::string()> waiter) {
  if (!WaitUntilDone(position, deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(
        waiter(), ": timed out waiting for an event recorded on stream '", *name_, "'"));
  }
  return OutcomeAt(position);
}

void HostStreamProgress::OnComplete(uint64_t position, EventCallback callback) {
  if (!Done(position)) {
    {
      std::lock_guard<std::mutex> lock(cb_mu_);
      callbacks_.emplace_back(position, std::move(callback));
      if (position < first_callback_.load(std::memory_order_relaxed)) {
        first_callback_.store(position, std::memory_order_seq_cst);
      }
    }
    // The worker may have passed its check of first_callback_ before the store above and
    // published the position since: then the callback is this thread's to run (whoever takes it
    // out of callbacks_ runs it). Else the worker's check after its publication sees the store.
    const uint64_t finished = finished_.load(std::memory_order_seq_cst);
    if (finished >= position) RunDueCallbacks(finished);
    return;
  }
  std::move(callback)(OutcomeAt(position));
}

void HostStreamProgress::RunDueCallbacks(uint64_t finished) {
  absl::InlinedVector<std::pair<uint64_t, EventCallback>, 4> due;
  {
    std::lock_guard<std::mutex> lock(cb_mu_);
    // The due ones out (in registration order), the rest kept in order, in one pass: no
    // temporary buffer (std::stable_partition allocates one per call).
    size_t kept = 0;
    uint64_t first = kNever;
    for (size_t i = 0; i < callbacks_.size(); ++i) {
      if (callbacks_[i].first <= finished) {
        due.push_back(std::move(callbacks_[i]));
      } else {
        first = std::min(first, callbacks_[i].first);
        if (kept != i) callbacks_[kept] = std::move(callbacks_[i]);
        ++kept;
      }
    }
    callbacks_.erase(callbacks_.begin() + static_cast<std::ptrdiff_t>(kept), callbacks_.end());
    first_callback_.store(first, std::memory_order_seq_cst);
  }
  for (auto& [position, callback] : due) std::move(callback)(OutcomeAt(position));
}

void HostStreamProgress::Fail(uint64_t item, absl::Status failure) {
  failure_ = std::move(failure);
  failed_at_.store(item, std::memory_order_release);
}

void HostStreamProgress::Finish(uint64_t item, absl::Time at, TimeBlock* times) {
  times->at[(item - 1) % kTimeBlockItems] = at;
  // The callbacks of the item run before it is published (HostEvent's rule); one registered
  // meanwhile is run below, or by the thread that registered it.
  if (first_callback_.load(std::memory_order_seq_cst) <= item) RunDueCallbacks(item);
  finished_.store(item, std::memory_order_seq_cst);
  if (first_callback_.load(std::memory_order_seq_cst) <= item) RunDueCallbacks(item);
  if (first_wait_.load(std::memory_order_seq_cst) <= item) {
    // Notified under the lock: a waiter on a ManualClock may be about to destroy its wait.
    std::lock_guard<std::mutex> lock(wait_mu_);
    wait_cv_.notify_all();
  }
}

StreamTracer::StreamTracer(const StreamOptions& options) : writer_(options.trace) {
  if (writer_ != nullptr)
    tid_ = writer_->Track(options.track.empty() ? options.name : options.track);
}

absl::Status StreamTracer::RunOp(StreamOp& op, const Clock& clock) const {
  if (writer_ == nullptr) return std::move(op.run)();
  const absl::Time start = clock.Now();
  absl::Status result = std::move(op.run)();
  const absl::Time end = clock.Now();
  TraceArgs args;
  args.ints.emplace_back("bytes", static_cast<int64_t>(op.bytes));
  if (op.flops != 0) args.ints.emplace_back("flops", static_cast<int64_t>(op.flops));
  if (!result.ok()) args.strings.emplace_back("error", result.ToString());
  writer_->AddComplete(tid_, op.name, StreamOpKindName(op.kind), start, end - start,
                       std::move(args));
  return result;
}

absl::Status StreamTracer::RunWait(absl::string_view source, const Clock& clock,
                                   absl::FunctionRef<absl::Status()> wait) const {
  if (writer_ == nullptr) return wait();
  const absl::Time start = clock.Now();
  absl::Status result = wait();
  const absl::Time end = clock.Now();
  TraceArgs args;
  if (!result.ok()) args.strings.emplace_back("error", result.ToString());
  writer_->AddComplete(tid_, absl::StrCat("wait ", source), "wait", start, end - start,
                       std::move(args));
  return result;
}

HostCaptureRecorder* AsRecorder(Stream& stream) {
  if (HostCaptureRecorder* recorder = AsHostStream(stream)) return recorder;
  if (HostCaptureRecorder* recorder = AsCallerStream(stream)) return recorder;
  return dynamic_cast<HostCaptureRecorder*>(&stream);
}

absl::Status HostEvent::Record(Stream& stream) {
  if (AsHostStream(stream) != nullptr) {
    ++call_stats.records;
    HostMark mark;
    absl::Status status = MarkHostStream(stream, &mark);
    SetMark(std::move(mark), stream.id());
    return status;
  }
  HostCaptureRecorder* recorder = AsRecorder(stream);
  if (recorder == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("a host event cannot be recorded on stream '",
                                                   stream.name(), "' (", stream.device().ToString(),
                                                   "); create the event with its CreateEvent()"));
  }
  ++call_stats.records;
  std::shared_ptr<const std::string> name = recorder->shared_name();
  std::shared_ptr<HostCapture> capture;
  HostMark old_mark;  // released after the lock
  {
    std::unique_lock<std::mutex> lock = LockSpinning(mu_);
    bool embedded = false;
    if (!embedded_.has_value()) {
      if (std::shared_ptr<HostEvent> self = weak_from_this().lock()) {
        embedded_.emplace(stream, std::move(name));
        capture = std::shared_ptr<HostCapture>(std::move(self), &*embedded_);
        embedded = true;
      }
    }
    if (!embedded) capture = std::make_shared<HostCapture>(stream, std::move(name));
    current_embedded_ = embedded;
    current_ = embedded ? nullptr : capture;
    old_mark = std::move(mark_);
    mark_ = HostMark();
    recorded_stream_id_.store(stream.id(), std::memory_order_relaxed);
  }
  return recorder->RecordHostCapture(std::move(capture));
}

void HostEvent::SetMark(HostMark mark, uint64_t stream_id) {
  std::unique_lock<std::mutex> lock = LockSpinning(mu_);
  std::swap(mark_, mark);
  current_ = nullptr;
  current_embedded_ = false;
  recorded_stream_id_.store(stream_id, std::memory_order_relaxed);
  lock.unlock();  // the old mark (now in `mark`) is released outside the lock
}

void HostEvent::SetFreshMark(HostMark mark, uint64_t stream_id) {
  // No other thread holds the event yet: whatever hands it over publishes these fields.
  mark_ = std::move(mark);
  recorded_stream_id_.store(stream_id, std::memory_order_relaxed);
}

std::shared_ptr<HostCapture> HostEvent::PrepareFresh(const std::shared_ptr<HostEvent>& self,
                                                     Stream& stream,
                                                     const HostCaptureRecorder& recorder) {
  ++call_stats.records;
  HostEvent& event = *self;
  // No other thread holds the event yet: its fields need no lock (the stream's lock, taken
  // when the stream records the capture, publishes them to the worker that completes it).
  event.embedded_.emplace(stream, recorder.shared_name());
  event.current_embedded_ = true;
  event.recorded_stream_id_.store(stream.id(), std::memory_order_relaxed);
  return std::shared_ptr<HostCapture>(self, &*event.embedded_);
}

absl::Status HostEvent::RecordFresh(const std::shared_ptr<HostEvent>& self, Stream& stream,
                                    HostCaptureRecorder& recorder) {
  return recorder.RecordHostCapture(PrepareFresh(self, stream, recorder));
}

std::shared_ptr<HostCapture> HostEvent::current() const {
  std::unique_lock<std::mutex> lock = LockSpinning(mu_);
  if (mark_.recorded()) {
    const HostMark mark = mark_;
    lock.unlock();
    HostStreamProgress& progress = mark.progress();
    auto capture = std::make_shared<HostCapture>(progress.shared_name(), progress.stream_id(),
                                                 progress.clock());
    progress.OnComplete(mark.position,
                        [capture](absl::Status status) { capture->Complete(std::move(status)); });
    return capture;
  }
  if (!current_embedded_) return current_;
  // The event is alive (this is one of its methods), so some shared_ptr owns it.
  std::shared_ptr<const HostEvent> self = weak_from_this().lock();
  if (self == nullptr) return nullptr;  // unreachable but for a call from the destructor
  return std::shared_ptr<HostCapture>(std::move(self), const_cast<HostCapture*>(&*embedded_));
}

void HostEvent::SnapshotForWait(std::shared_ptr<const TimeBlock>* times, uint64_t* position,
                                std::shared_ptr<HostCapture>* capture, std::string* source) const {
  {
    std::unique_lock<std::mutex> lock = LockSpinning(mu_);
    if (mark_.recorded()) {
      if (!mark_.Done()) {
        *times = mark_.times;
        *position = mark_.position;
        return;  // `source` is the progress's stream name (RunTracedWait)
      }
      // A position done OK needs no wait; a failed one still has to poison the stream in order,
      // after the work enqueued before this wait (a capture that is complete already).
      if (mark_.progress().failed_at() > mark_.position) return;
    }
  }
  *capture = current();
  if (*capture == nullptr) return;
  absl::Status status;
  if ((*capture)->done(&status) && status.ok()) {
    *capture = nullptr;
    return;
  }
  *source = (*capture)->stream_name();
}

absl::StatusOr<bool> HostEvent::Query() {
  {
    std::unique_lock<std::mutex> lock = LockSpinning(mu_);
    if (mark_.recorded()) {
      if (!mark_.Done()) return false;
      absl::Status status = mark_.progress().OutcomeAt(mark_.position);
      if (!status.ok()) return status;
      return true;
    }
  }
  std::shared_ptr<HostCapture> capture = current();
  if (capture == nullptr) return true;
  absl::Status status;
  if (!capture->done(&status)) return false;
  if (!status.ok()) return status;
  return true;
}

absl::Status HostEvent::Synchronize(absl::Time deadline) {
  {
    std::unique_lock<std::mutex> lock = LockSpinning(mu_);
    if (mark_.recorded()) {
      const HostMark mark = mark_;
      lock.unlock();
      return mark.progress().Wait(mark.position, deadline,
                                  [] { return std::string("Event::Synchronize"); });
    }
  }
  std::shared_ptr<HostCapture> capture = current();
  if (capture == nullptr) return absl::OkStatus();
  return capture->Wait(deadline, "Event::Synchronize");
}

void HostEvent::OnComplete(EventCallback callback) {
  {
    std::unique_lock<std::mutex> lock = LockSpinning(mu_);
    if (mark_.recorded()) {
      if (mark_.Done()) {
        absl::Status outcome = mark_.progress().OutcomeAt(mark_.position);
        lock.unlock();
        return std::move(callback)(std::move(outcome));
      }
      const HostMark mark = mark_;
      lock.unlock();
      return mark.progress().OnComplete(mark.position, std::move(callback));
    }
  }
  std::shared_ptr<HostCapture> capture = current();
  if (capture == nullptr) return std::move(callback)(absl::OkStatus());
  capture->OnComplete(std::move(callback));
}

uint64_t HostEvent::recorded_stream_id() const {
  return recorded_stream_id_.load(std::memory_order_relaxed);
}

std::optional<absl::Time> HostEvent::completed_at() const {
  {
    std::unique_lock<std::mutex> lock = LockSpinning(mu_);
    if (mark_.recorded()) return mark_.completed_at();
  }
  std::shared_ptr<HostCapture> capture = current();
  if (capture == nullptr) return std::nullopt;
  return capture->completed_at();
}

absl::StatusOr<WaitTarget> SnapshotWaitTarget(Event& event, const Stream& waiter) {
  WaitTarget target;
  // HostEvent is final: comparing the type is exact, and cheaper than a dynamic_cast.
  if (auto* host = typeid(event) == typeid(HostEvent) ? static_cast<HostEvent*>(&event) : nullptr) {
    host->SnapshotForWait(&target.mark, &target.position, &target.capture, &target.source);
    return target;
  } else if (auto* waitable = dynamic_cast<HostWaitable*>(&event)) {
    SL_ASSIGN_OR_RETURN(target.foreign, waitable->SnapshotForHostWait());
    target.source = waitable->recorded_stream_name();
    return target;
  } else {
    target.source = absl::StrCat("event (", event.device().ToString(), ")");
    // Any other kind of event (a framework's, a test double): a capture of our own that the
    // event's completion callback completes.
    target.capture = std::make_shared<HostCapture>(waiter);
    event.OnComplete(
        [capture = target.capture](absl::Status status) { capture->Complete(std::move(status)); });
  }
  absl::Status status;
  // A capture that completed OK needs no wait; a failed one still has to poison the stream in
  // order, after the work enqueued before this wait.
  if (target.capture != nullptr && target.capture->done(&status) && status.ok()) {
    target.capture = nullptr;
  }
  return target;
}

namespace {

// Runs the wait of `target` on this thread, bounded by `timeout` on `clock` (the waiting
// stream's). Errors are what the stream is poisoned with: the failed event's own Status, or
// DeadlineExceeded naming the stream.
absl::Status RunWait(WaitTarget& target, absl::Duration timeout, const Clock& clock,
                     const std::string& stream_name) {
  // Formatted only for a timeout.
  auto waiter = [&] {
    return absl::StrCat("stream '", stream_name, "' (wait_timeout ", absl::FormatDuration(timeout),
                        ")");
  };
  if (target.mark != nullptr) {
    HostStreamProgress& progress = *target.mark->progress;
    return progress.Wait(target.position, progress.clock().Now() + timeout, waiter);
  }
  if (target.capture != nullptr) {
    return target.capture->Wait(target.capture->clock().Now() + timeout, waiter);
  }
  // A foreign wait (a CUDA event) may block without a Clock; what it waits for may wait in turn
  // for work this thread holds back.
  WakeHeldWorkers();
  absl::Status status = std::move(target.foreign)(clock.Now() + timeout);
  if (absl::IsDeadlineExceeded(status)) status = Annotate(status, waiter());
  return status;
}

}  // namespace

absl::Status RunTracedWait(const StreamTracer& tracer, WaitTarget& target, absl::Duration timeout,
                           const Clock& clock, const std::string& stream_name) {
  const std::string& source =
      target.mark != nullptr ? target.mark->progress->stream_name() : target.source;
  return tracer.RunWait(source, clock,
                        [&] { return RunWait(target, timeout, clock, stream_name); });
}

std::shared_ptr<HostEvent> NewHostEvent() {
  ++call_stats.events;
  return std::allocate_shared<HostEvent>(RecyclingAllocator<HostEvent>());
}

}  // namespace stream_internal

std::shared_ptr<Event> CreateHostEvent() { return stream_internal::NewHostEvent(); }

}  // namespace shardline
