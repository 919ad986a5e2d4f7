// Virtual streams and events (CreateVirtualStream): the Stream and Event faces of the engine
// (runtime/virtual_engine.cc), and the timeline's calls that take a virtual stream.

#include "runtime/virtual_time.h"

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "runtime/internal/stream_internal.h"
#include "runtime/internal/virtual_time_internal.h"
#include "runtime/status.h"
#include "runtime/stream.h"

namespace shardline {
namespace {

using stream_internal::StreamTracer;

class VirtualEvent final : public Event {
 public:
  explicit VirtualEvent(std::shared_ptr<VirtualTimeline::Impl> impl) : impl_(std::move(impl)) {}

  Device device() const override { return Device::Host(); }
  absl::Status Record(Stream& stream) override;

  absl::StatusOr<bool> Query() override {
    std::shared_ptr<VCapture> capture = current();
    if (capture == nullptr) return true;
    absl::Status status;
    if (!impl_->CaptureDone(*capture, &status)) return false;
    if (!status.ok()) return status;
    return true;
  }

  absl::Status Synchronize(absl::Time deadline) override {
    std::shared_ptr<VCapture> capture = current();
    if (capture == nullptr) return absl::OkStatus();
    return impl_->SynchronizeCapture(*capture, deadline);
  }

  void OnComplete(EventCallback callback) override {
    std::shared_ptr<VCapture> capture = current();
    if (capture == nullptr) return std::move(callback)(absl::OkStatus());
    impl_->OnComplete(*capture, std::move(callback));
  }

  uint64_t recorded_stream_id() const override {
    std::shared_ptr<VCapture> capture = current();
    return capture == nullptr ? 0 : capture->stream_id;
  }

  std::optional<absl::Time> completed_at() const override {
    std::shared_ptr<VCapture> capture = current();
    if (capture == nullptr) return std::nullopt;
    return impl_->CompletedAt(*capture);
  }

  const VirtualTimeline::Impl* impl() const { return impl_.get(); }

  std::shared_ptr<VCapture> current() const {
    std::lock_guard<std::mutex> lock(mu_);
    return current_;
  }

 private:
  const std::shared_ptr<VirtualTimeline::Impl> impl_;
  mutable std::mutex mu_;
  std::shared_ptr<VCapture> current_;
};

class VirtualStream final : public Stream {
 public:
  VirtualStream(const VirtualTimeline& timeline, std::shared_ptr<VirtualTimeline::Impl> impl,
                std::string name, absl::Duration wait_timeout, StreamTracer tracer, int host)
      : timeline_(timeline),
        impl_(std::move(impl)),
        state_(std::make_shared<VStream>(std::move(name), id(), wait_timeout, tracer, host)) {
    impl_->AddStream(state_);
  }
  ~VirtualStream() override { impl_->DestroyStream(state_); }

  Device device() const override { return Device::Host(); }
  const std::string& name() const override { return state_->name; }
  const Clock& clock() const override { return timeline_; }

  absl::Status Submit(StreamOp op) override {
    Item item;
    item.kind = Item::kOp;
    item.op = std::move(op);
    return impl_->Push(state_, std::move(item));
  }

  absl::Status SubmitAsync(VirtualAsyncOp op) {
    Item item;
    item.kind = Item::kAsync;
    item.async = std::move(op);
    return impl_->Push(state_, std::move(item));
  }

  absl::Status WaitEvent(Event& event) override;

  absl::Status Synchronize(absl::Time deadline) override {
    return impl_->Synchronize(state_, deadline);
  }

  absl::Status status() const override { return impl_->StreamStatus(*state_); }

  std::shared_ptr<Event> CreateEvent() override { return std::make_shared<VirtualEvent>(impl_); }

  absl::Status Record(std::shared_ptr<VCapture> capture) {
    Item item;
    item.kind = Item::kRecord;
    item.capture = std::move(capture);
    return impl_->Push(state_, std::move(item));
  }

  const VirtualTimeline::Impl* impl() const { return impl_.get(); }

 private:
  const VirtualTimeline& timeline_;
  const std::shared_ptr<VirtualTimeline::Impl> impl_;
  const std::shared_ptr<VStream> state_;
};

absl::Status VirtualEvent::Record(Stream& stream) {
  auto* target = dynamic_cast<VirtualStream*>(&stream);
  if (target == nullptr || target->impl() != impl_.get()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a virtual event cannot be recorded on stream '", stream.name(), "' (",
        target == nullptr ? "not a virtual stream" : "a virtual stream of another timeline",
        "); create the event with that stream's CreateEvent()"));
  }
  auto capture = std::make_shared<VCapture>(stream.name(), stream.id());
  {
    std::lock_guard<std::mutex> lock(mu_);
    current_ = capture;
  }
  return target->Record(std::move(capture));
}

absl::Status VirtualStream::WaitEvent(Event& event) {
  std::string source;
  if (auto* virtual_event = dynamic_cast<VirtualEvent*>(&event)) {
    std::shared_ptr<VCapture> capture = virtual_event->current();
    if (capture == nullptr) return status();
    if (virtual_event->impl() == impl_.get()) return impl_->PushWait(state_, std::move(capture));
    source = absl::StrCat("a virtual event of another timeline, recorded on stream '",
                          capture->stream_name, "'");
  } else if (auto* host = dynamic_cast<stream_internal::HostEvent*>(&event)) {
    std::shared_ptr<stream_internal::HostCapture> capture = host->current();
    source = capture == nullptr
                 ? std::string("a host event")
                 : absl::StrCat("a host event recorded on stream '", capture->stream_name(), "'");
  } else {
    source = absl::StrCat("an event (", event.device().ToString(), ")");
  }
  // A foreign event: only its outcome, if it has one already, can enter virtual time.
  absl::StatusOr<bool> outcome = event.Query();
  if (outcome.ok() && *outcome) return status();
  if (outcome.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "virtual stream '", name(), "' cannot wait for ", source,
        ": it is still pending, and virtual time cannot wait for work outside its timeline "
        "(wait for it on the host first, or record it on a virtual stream of this timeline)"));
  }
  // Failed: the failure poisons this stream in order, like a failed virtual event.
  auto failed = std::make_shared<VCapture>(source, 0);
  failed->done = true;
  failed->status = outcome.status();
  return impl_->PushWait(state_, std::move(failed));
}

}  // namespace

bool VirtualTimeline::Owns(const Stream& stream) const {
  const auto* target = dynamic_cast<const VirtualStream*>(&stream);
  return target != nullptr && target->impl() == impl_.get();
}

absl::Status VirtualTimeline::SubmitAsync(Stream& stream, VirtualAsyncOp op) {
  if (!Owns(stream)) {
    return absl::InvalidArgumentError(absl::StrCat("VirtualTimeline::SubmitAsync: stream '",
                                                   stream.name(),
                                                   "' is not a virtual stream of this timeline"));
  }
  if (op.start == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("VirtualTimeline::SubmitAsync: op '", op.name,
                                                   "' on stream '", stream.name(),
                                                   "' has no start"));
  }
  return static_cast<VirtualStream&>(stream).SubmitAsync(std::move(op));
}

namespace {

absl::StatusOr<std::unique_ptr<Stream>> MakeVirtualStream(
    VirtualTimeline& timeline, const std::shared_ptr<VirtualTimeline::Impl>& impl,
    StreamOptions options, int host) {
  if (options.clock != nullptr && options.clock != &timeline) {
    return absl::InvalidArgumentError(absl::StrCat(
        "virtual stream '", options.name, "': its clock is its timeline, but StreamOptions.clock ",
        "is a ", options.clock->name(), " clock (leave it null)"));
  }
  SL_ASSIGN_OR_RETURN(const absl::Duration wait_timeout,
                      stream_internal::ResolveWaitTimeout(options));
  const StreamTracer tracer(options);
  return std::unique_ptr<Stream>(std::make_unique<VirtualStream>(
      timeline, impl, std::move(options.name), wait_timeout, tracer, host));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Stream>> CreateVirtualStream(VirtualTimeline& timeline,
                                                            StreamOptions options) {
  return MakeVirtualStream(timeline, timeline.impl_, std::move(options), -1);
}

absl::StatusOr<std::unique_ptr<Stream>> CreateVirtualStream(VirtualTimeline& timeline,
                                                            StreamOptions options, int host) {
  if (host < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("virtual stream '", options.name, "': host must not be negative, got ", host));
  }
  return MakeVirtualStream(timeline, timeline.impl_, std::move(options), host);
}

}  // namespace shardline
