// File: runtime/stream.h
// -----------------------------------------------------------------------------
// Streams and events: the only vocabulary the scheduler uses to order work. One interface, three
// implementations:
//
//   host     a worker thread that runs enqueued work in FIFO order (CPU training, unit tests)
//   caller   runs work inline on the calling thread; its waits block that thread. This is the
//            "compute stream" of a CPU framework, whose compute happens on its own thread.
//   cuda     cudaStream_t / cudaEvent_t (built with SHARDLINE_WITH_CUDA)
//
// (A virtual-clock implementation for the simulator comes with the sim backend.)
//
// Semantics follow CUDA's, so the scheduler's code means the same thing on every device:
//   * Work enqueued on one stream runs in order. Streams run concurrently with each other.
//   * Event::Record(stream) captures the work enqueued on `stream` so far; the event completes
//     when that work has run. Recording again replaces the capture. An event that was never
//     recorded counts as complete.
//   * Stream::WaitEvent(event) makes work enqueued on the stream afterwards wait until the event's
//     captured work completes. The host thread does not block (except on a caller stream, whose
//     "device" is the host thread itself).
//
// Failure: work that returns a non-OK Status poisons its stream. Later work on it does not run;
// its status(), Synchronize() and the Query()/Synchronize() of every event recorded on it after
// the failure return that Status (annotated with the stream's name). A stream that waits on a
// failed event is poisoned with the same Status, so an error travels along the happens-before
// edges instead of turning into a hang. A poisoned stream stays poisoned.
//
// Deadlines: every blocking call takes an absl::Time deadline; DeadlineExceeded names what was
// being waited for. A host stream's worker waiting on an event gives up at the stream's
// `wait_timeout` (default SHARDLINE_TIMEOUT_S) and poisons the stream with DeadlineExceeded.
//
// Thread safety: every method may be called from any thread.

#ifndef SHARDLINE_RUNTIME_STREAM_H_
#define SHARDLINE_RUNTIME_STREAM_H_

#include <memory>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "runtime/device.h"

namespace shardline {

class Stream;

class Event {
 public:
  virtual ~Event() = default;

  virtual Device device() const = 0;

  // Captures the work enqueued on `stream` so far. InvalidArgument if this kind of event cannot
  // be recorded on that kind of stream (a CUDA event on a host stream, say).
  virtual absl::Status Record(Stream& stream) = 0;

  // true: the captured work has run (or nothing was ever recorded). false: not yet.
  // An error: the captured work, or work it waited on, failed with that Status.
  virtual absl::StatusOr<bool> Query() = 0;

  // Blocks the calling thread until the captured work has run: OK, the failure's Status, or
  // DeadlineExceeded if `deadline` passes first.
  virtual absl::Status Synchronize(absl::Time deadline) = 0;
};

struct StreamOptions {
  // Shown in errors, logs and traces ("gather", "reduce", "compute").
  std::string name = "stream";
  // How long a stream's worker waits for an event before poisoning the stream with
  // DeadlineExceeded. absl::ZeroDuration() means "unset": use SHARDLINE_TIMEOUT_S.
  absl::Duration wait_timeout = absl::ZeroDuration();
};

class Stream {
 public:
  using Work = absl::AnyInvocable<absl::Status() &&>;

  virtual ~Stream() = default;

  virtual Device device() const = 0;
  virtual const std::string& name() const = 0;

  // Enqueues host work. On a host stream it runs on the worker thread, on a caller stream
  // immediately on this thread, on a CUDA stream as a host function ordered on the stream (it
  // must not call CUDA). Returns the stream's error without enqueueing if it is poisoned.
  virtual absl::Status Enqueue(Work work) = 0;

  // Makes work enqueued after this call wait for `event`. Does not block the host, except on a
  // caller stream, where it blocks until the event completes or the stream's wait_timeout passes.
  virtual absl::Status WaitEvent(Event& event) = 0;

  // Blocks until all work enqueued so far has run. Returns status() then, or DeadlineExceeded.
  virtual absl::Status Synchronize(absl::Time deadline) = 0;

  // OK, or the Status that poisoned the stream.
  virtual absl::Status status() const = 0;

  // A new event of the kind that records on this stream.
  virtual std::shared_ptr<Event> CreateEvent() = 0;

  // The cudaStream_t of a CUDA stream; nullptr for the others.
  virtual void* native_handle() const { return nullptr; }
};

// A stream with its own worker thread. InvalidArgument if SHARDLINE_TIMEOUT_S is invalid and
// options.wait_timeout is unset. The destructor lets enqueued work finish (each wait still
// bounded by wait_timeout), then joins the worker.
absl::StatusOr<std::unique_ptr<Stream>> CreateHostStream(StreamOptions options = {});

// A stream whose work runs on the thread that enqueues it.
absl::StatusOr<std::unique_ptr<Stream>> CreateCallerStream(StreamOptions options = {});

// A stream on `device`: a host stream for Device::Host(), a CUDA stream for cuda:N.
// Unimplemented if shardline was built without CUDA; Unavailable if the device does not exist.
absl::StatusOr<std::unique_ptr<Stream>> CreateStream(Device device, StreamOptions options = {});

// An event for host and caller streams (what their CreateEvent() returns).
std::shared_ptr<Event> CreateHostEvent();

// Records a fresh event on `stream` and returns it: the common "mark this point" idiom.
absl::StatusOr<std::shared_ptr<Event>> RecordEvent(Stream& stream);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_STREAM_H_
