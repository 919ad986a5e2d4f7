// Host events and their captures (runtime/internal/stream_internal.h), what a host or caller
// stream waits for when it waits for an event of any kind, and the stream tracer.

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
  HostCaptureRecorder* recorder = AsRecorder(stream);
  if (recorder == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("a host event cannot be recorded on stream '",
                                                   stream.name(), "' (", stream.device().ToString(),
                                                   "); create the event with its CreateEvent()"));
  }
  ++call_stats.records;
  std::shared_ptr<const std::string> name = recorder->shared_name();
  std::shared_ptr<HostCapture> capture;
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
    recorded_stream_id_.store(stream.id(), std::memory_order_relaxed);
  }
  return recorder->RecordHostCapture(std::move(capture));
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
  if (!current_embedded_) return current_;
  // The event is alive (this is one of its methods), so some shared_ptr owns it.
  std::shared_ptr<const HostEvent> self = weak_from_this().lock();
  if (self == nullptr) return nullptr;  // unreachable but for a call from the destructor
  return std::shared_ptr<HostCapture>(std::move(self), const_cast<HostCapture*>(&*embedded_));
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

void HostEvent::OnComplete(EventCallback callback) {
  std::shared_ptr<HostCapture> capture = current();
  if (capture == nullptr) return std::move(callback)(absl::OkStatus());
  capture->OnComplete(std::move(callback));
}

uint64_t HostEvent::recorded_stream_id() const {
  return recorded_stream_id_.load(std::memory_order_relaxed);
}

std::optional<absl::Time> HostEvent::completed_at() const {
  std::shared_ptr<HostCapture> capture = current();
  if (capture == nullptr) return std::nullopt;
  return capture->completed_at();
}

absl::StatusOr<WaitTarget> SnapshotWaitTarget(Event& event, const Stream& waiter) {
  WaitTarget target;
  // HostEvent is final: comparing the type is exact, and cheaper than a dynamic_cast.
  if (auto* host = typeid(event) == typeid(HostEvent) ? static_cast<HostEvent*>(&event) : nullptr) {
    target.capture = host->current();
    if (target.capture != nullptr) target.source = target.capture->stream_name();
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
  return tracer.RunWait(target.source, clock,
                        [&] { return RunWait(target, timeout, clock, stream_name); });
}

std::shared_ptr<HostEvent> NewHostEvent() {
  ++call_stats.events;
  return std::allocate_shared<HostEvent>(RecyclingAllocator<HostEvent>());
}

}  // namespace stream_internal

std::shared_ptr<Event> CreateHostEvent() { return stream_internal::NewHostEvent(); }

}  // namespace shardline
