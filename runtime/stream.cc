// The Stream base of runtime/stream.h, the stream factory by device, and the event helpers that
// work on every kind of stream (RecordEvent, RecordSharedEvent, WaitUnlessSameStream).

#include "runtime/stream.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "runtime/config.h"
#include "runtime/internal/host_stream_internal.h"
#include "runtime/internal/stream_internal.h"
#include "runtime/status.h"

#ifdef SHARDLINE_WITH_CUDA
#include "runtime/cuda/cuda_stream.h"
#endif

namespace shardline {

// ---- Stream (the base) -----------------------------------------------------------------------

namespace {
std::atomic<uint64_t> next_stream_id{1};
}  // namespace

Stream::Stream() : id_(next_stream_id.fetch_add(1, std::memory_order_relaxed)) {}

absl::Status Stream::Enqueue(Work work) {
  StreamOp op;
  op.run = std::move(work);
  return Submit(std::move(op));
}

absl::string_view StreamOpKindName(StreamOpKind kind) {
  switch (kind) {
    case StreamOpKind::kHost:
      return "host";
    case StreamOpKind::kCopy:
      return "copy";
    case StreamOpKind::kCast:
      return "cast";
    case StreamOpKind::kReduce:
      return "reduce";
    case StreamOpKind::kFill:
      return "fill";
    case StreamOpKind::kCollective:
      return "collective";
    case StreamOpKind::kCompute:
      return "compute";
  }
  return "invalid";
}

absl::StatusOr<absl::Duration> ElapsedBetween(const Event& start, const Event& end) {
  const std::optional<absl::Time> started = start.completed_at();
  const std::optional<absl::Time> ended = end.completed_at();
  if (!started.has_value() || !ended.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ElapsedBetween: the ", !started.has_value() ? "start" : "end", " event (",
        (!started.has_value() ? start : end).device().ToString(),
        ") has no completion time: it is pending, was never recorded, or its kind does not "
        "record one"));
  }
  return *ended - *started;
}

namespace stream_internal {

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

}  // namespace stream_internal

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

absl::StatusOr<std::shared_ptr<Event>> RecordEvent(Stream& stream) {
  if (stream_internal::AsHostStream(stream) != nullptr) {
    // Their CreateEvent() makes a host event: made and marked here without its lock.
    std::shared_ptr<stream_internal::HostEvent> event = stream_internal::NewHostEvent();
    ++stream_internal::call_stats.records;
    stream_internal::HostMark mark;
    const absl::Status status = stream_internal::MarkHostStream(stream, &mark);
    event->SetFreshMark(std::move(mark), stream.id());
    SL_RETURN_IF_ERROR(status);
    return event;
  }
  if (stream_internal::HostCaptureRecorder* recorder = stream_internal::AsCallerStream(stream)) {
    // Their CreateEvent() makes a host event: made and recorded here without its lock.
    std::shared_ptr<stream_internal::HostEvent> event = stream_internal::NewHostEvent();
    SL_RETURN_IF_ERROR(stream_internal::HostEvent::RecordFresh(event, stream, *recorder));
    return event;
  }
  std::shared_ptr<Event> event = stream.CreateEvent();
  SL_RETURN_IF_ERROR(event->Record(stream));
  return event;
}

absl::StatusOr<std::shared_ptr<Event>> RecordSharedEvent(Stream& stream) {
  if (stream_internal::AsHostStream(stream) != nullptr) {
    return stream_internal::RecordSharedOnHostStream(stream);
  }
  if (stream_internal::AsCallerStream(stream) != nullptr) {
    return stream_internal::RecordSharedOnCallerStream(stream);
  }
  return RecordEvent(stream);
}

absl::Status WaitUnlessSameStream(Stream& stream, const std::shared_ptr<Event>& event) {
  if (event == nullptr || event->recorded_stream_id() == stream.id()) return absl::OkStatus();
  return stream.WaitEvent(*event);
}

}  // namespace shardline
