// Caller streams (CreateCallerStream): work runs inline on the thread that enqueues it.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "runtime/internal/host_stream_internal.h"
#include "runtime/internal/stream_internal.h"
#include "runtime/status.h"
#include "runtime/stream.h"

namespace shardline {
namespace stream_internal {
namespace {

// Work runs inline on the thread that enqueues it; waits block that thread. Work enqueued from
// several threads at once runs concurrently: the order is each thread's call order.
//
// Every item gets a ticket when it starts. An event recorded while items run captures the items
// started before the record: it completes when the last of those has finished, whatever started
// later (so it does not starve under steady use from several threads), and also when the stream
// is poisoned (an item that failed does not make one still running on another thread finish).
class CallerStream final : public Stream, public HostCaptureRecorder {
 public:
  CallerStream(std::string name, absl::Duration wait_timeout, const Clock& clock,
               StreamTracer tracer)
      : name_(std::make_shared<const std::string>(std::move(name))),
        wait_timeout_(wait_timeout),
        clock_(clock),
        tracer_(tracer) {}

  Device device() const override { return Device::Host(); }
  const std::string& name() const override { return *name_; }
  std::shared_ptr<const std::string> shared_name() const override { return name_; }
  const Clock& clock() const override { return clock_; }

  absl::Status Submit(StreamOp op) override {
    SL_ASSIGN_OR_RETURN(const uint64_t ticket, Start());
    absl::Status result = tracer_.RunOp(op, clock_);
    op = StreamOp();
    if (!result.ok()) result = Annotate(result, absl::StrCat("stream '", *name_, "'"));
    return Finish(ticket, std::move(result));
  }

  absl::Status WaitEvent(Event& event) override {
    SL_RETURN_IF_ERROR(status());
    SL_ASSIGN_OR_RETURN(WaitTarget target, SnapshotWaitTarget(event, *this));
    if (target.empty()) return absl::OkStatus();
    SL_ASSIGN_OR_RETURN(const uint64_t ticket, Start());
    return Finish(ticket, RunTracedWait(tracer_, target, wait_timeout_, clock_, *name_));
  }

  absl::Status Synchronize(absl::Time deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!clock_.WaitUntil(idle_cv_, lock, deadline, [this] { return running_.empty(); })) {
      return absl::DeadlineExceededError(
          absl::StrCat("stream '", *name_, "': Synchronize timed out with ", running_.size(),
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
    return RecordCapture(std::move(capture), nullptr);
  }

  // RecordSharedEvent on this stream: the position is the next ticket (items started so far).
  absl::StatusOr<std::shared_ptr<Event>> RecordShared() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (status_.ok()) {
        if (std::shared_ptr<Event> shared = mark_.At(next_ticket_)) return shared;
      }
    }
    std::shared_ptr<HostEvent> event = NewHostEvent();
    SL_RETURN_IF_ERROR(RecordCapture(HostEvent::PrepareFresh(event, *this, *this), &event));
    return event;
  }

 private:
  // Records `capture`; with `mark` (and the stream healthy) its event becomes the shared mark at
  // the ticket read under the same lock.
  absl::Status RecordCapture(std::shared_ptr<HostCapture> capture,
                             const std::shared_ptr<HostEvent>* mark) {
    absl::Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      status = status_;
      if (status.ok()) mark_.Set(mark, next_ticket_);
      // Items running on other threads may predate this record, even on a poisoned stream:
      // complete once the last of them has finished.
      if (!running_.empty()) {
        pending_.push_back({next_ticket_, std::move(capture)});
        return status;
      }
    }
    capture->Complete(status);
    return status;
  }

  // Starts an item: its ticket, or the stream's error if it is poisoned.
  absl::StatusOr<uint64_t> Start() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status_.ok()) return status_;
    const uint64_t ticket = next_ticket_++;
    running_.insert(ticket);
    return ticket;
  }

  // Ends item `ticket`: records its failure and completes the captures whose items have all
  // finished.
  absl::Status Finish(uint64_t ticket, absl::Status result) {
    std::vector<std::shared_ptr<HostCapture>> completed;
    absl::Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!result.ok() && status_.ok()) status_ = std::move(result);
      status = status_;
      running_.erase(ticket);
      // Captures are in ticket order; one completes when no item started before it still runs.
      const uint64_t oldest = running_.empty() ? next_ticket_ : *running_.begin();
      while (!pending_.empty() && pending_.front().first <= oldest) {
        completed.push_back(std::move(pending_.front().second));
        pending_.pop_front();
      }
      if (running_.empty()) idle_cv_.notify_all();
    }
    for (auto& capture : completed) capture->Complete(status);
    return status;
  }

  const std::shared_ptr<const std::string> name_;  // shared with the captures
  const absl::Duration wait_timeout_;
  const Clock& clock_;
  const StreamTracer tracer_;

  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<uint64_t> running_ ABSL_GUARDED_BY(mu_);
  // (tickets handed out before the record, capture), in record order.
  std::deque<std::pair<uint64_t, std::shared_ptr<HostCapture>>> pending_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  SharedMark mark_ ABSL_GUARDED_BY(mu_);  // the last RecordSharedEvent's, at next_ticket_
};

}  // namespace

HostCaptureRecorder* AsCallerStream(Stream& stream) {
  return typeid(stream) == typeid(CallerStream) ? static_cast<CallerStream*>(&stream) : nullptr;
}

absl::StatusOr<std::shared_ptr<Event>> RecordSharedOnCallerStream(Stream& stream) {
  return static_cast<CallerStream&>(stream).RecordShared();
}

}  // namespace stream_internal

absl::StatusOr<std::unique_ptr<Stream>> CreateCallerStream(StreamOptions options) {
  SL_ASSIGN_OR_RETURN(absl::Duration wait_timeout, stream_internal::ResolveWaitTimeout(options));
  const Clock& clock = options.clock != nullptr ? *options.clock : WallClock();
  const stream_internal::StreamTracer tracer(options);
  return std::make_unique<stream_internal::CallerStream>(std::move(options.name), wait_timeout,
                                                         clock, tracer);
}

}  // namespace shardline
