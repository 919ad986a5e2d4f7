// File: runtime/internal/host_stream_internal.h
// -----------------------------------------------------------------------------
// Internal to the host-side streams: what runtime/stream.cc, runtime/host_event.cc,
// runtime/host_stream.cc and runtime/caller_stream.cc share beyond
// runtime/internal/stream_internal.h. Not part of the public API (not installed).

#ifndef SHARDLINE_RUNTIME_INTERNAL_HOST_STREAM_INTERNAL_H_
#define SHARDLINE_RUNTIME_INTERNAL_HOST_STREAM_INTERNAL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "runtime/clock.h"
#include "runtime/internal/stream_internal.h"
#include "runtime/stream.h"

namespace shardline::stream_internal {

// ThisThreadHostStreamCallStats(): plain increments, each thread its own (host_stream.cc).
extern constinit thread_local HostStreamCallStats call_stats;

// A new host event, its block recycled (host_event.cc).
std::shared_ptr<HostEvent> NewHostEvent();

// `stream` as the HostCaptureRecorder it is, or null if it is not one. Host and caller streams are
// found by their exact (final) type: a cross-cast dynamic_cast walks the class hierarchy on every
// record.
HostCaptureRecorder* AsRecorder(Stream& stream);

// `stream` as a host stream (host_stream.cc) or a caller stream (caller_stream.cc), by its exact
// type; null for any other kind of stream.
HostCaptureRecorder* AsHostStream(Stream& stream);
HostCaptureRecorder* AsCallerStream(Stream& stream);

// Records a position on `stream`, which must be a host stream (AsHostStream non-null): *mark
// captures the work enqueued so far. If the stream is poisoned the mark is complete at once with
// the stream's Status, which is also returned.
absl::Status MarkHostStream(Stream& stream, HostMark* mark);

// RecordSharedEvent on `stream`, which must be a host stream (AsHostStream non-null), or a caller
// stream (AsCallerStream non-null).
absl::StatusOr<std::shared_ptr<Event>> RecordSharedOnHostStream(Stream& stream);
absl::StatusOr<std::shared_ptr<Event>> RecordSharedOnCallerStream(Stream& stream);

// What a stream has to wait for to honour WaitEvent(event): a host stream's position, a host
// capture, a foreign waiter, or nothing (never recorded, or already complete and OK). `source`
// names what is waited for in trace spans.
struct WaitTarget {
  std::shared_ptr<const TimeBlock> mark;  // a pending position's block (and progress)
  uint64_t position = 0;                  // of `mark`
  std::shared_ptr<HostCapture> capture;
  HostWaitable::Waiter foreign;
  std::string source;
  bool empty() const { return mark == nullptr && capture == nullptr && foreign == nullptr; }
};

// The wait target of `event` for the stream `waiter`, snapshot now (host_event.cc).
absl::StatusOr<WaitTarget> SnapshotWaitTarget(Event& event, const Stream& waiter);

// Runs the wait of `target` on this thread inside a trace span, bounded by `timeout` on `clock`
// (the waiting stream's, named `stream_name`). Errors are what the stream is poisoned with: the
// failed event's own Status, or DeadlineExceeded naming the stream.
absl::Status RunTracedWait(const StreamTracer& tracer, WaitTarget& target, absl::Duration timeout,
                           const Clock& clock, const std::string& stream_name);

// What RecordSharedEvent hands out again: a stream's last shared event and the stream's position
// (work accepted, or started, so far) when it was recorded. Guarded by the stream's lock.
struct SharedMark {
  std::shared_ptr<HostEvent> event;
  uint64_t position = 0;

  // The event again if the stream is still at `now` (counted), else null.
  std::shared_ptr<Event> At(uint64_t now) const {
    if (event == nullptr || position != now) return nullptr;
    ++call_stats.records_shared;
    return event;
  }
  // A new mark at `now`; `mark` null: an ordinary record, nothing to remember.
  void Set(const std::shared_ptr<HostEvent>* mark, uint64_t now) {
    if (mark == nullptr) return;
    event = *mark;
    position = now;
  }
};

}  // namespace shardline::stream_internal

#endif  // SHARDLINE_RUNTIME_INTERNAL_HOST_STREAM_INTERNAL_H_
