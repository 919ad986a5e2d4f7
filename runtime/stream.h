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
// (Virtual-time streams for the simulator are in runtime/virtual_time.h: every stream has a
// Clock, and work is submitted as a StreamOp that declares its cost, so a simulated stream can
// advance its clock by the cost without running the op.)
// (Callback streams, whose work another runtime's queue runs through function pointers, are in
// runtime/callback_stream.h.)
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
// Dropped work: an op that a poisoned stream drops instead of running is told so: its
// StreamOp::cancel runs with the poison Status (this is how a collective that never ran aborts
// its communicator at once instead of stalling its peers). Exactly one of run and cancel is
// called for every op a stream accepted; neither for an op that Submit() refused.
//
// Completion means the device is done: an event reports completion, or a failure, only once
// nothing its capture covers can still be running. (A CUDA stream's kernels keep running after a
// host function poisons the stream; its events stay "not done" until the device reaches them.)
// Memory guarded by an event may therefore be reused as soon as the event reports anything.
//
// Deadlines and clocks: every blocking call takes an absl::Time deadline on a Clock
// (runtime/clock.h): a stream's Synchronize on the stream's clock(), an event's on the clock of
// the stream it was recorded on. DeadlineExceeded names what was being waited for. A stream's
// worker waiting on an event gives up at the stream's `wait_timeout` (default
// SHARDLINE_TIMEOUT_S) and poisons the stream with DeadlineExceeded.
//
// Timing and tracing: an event reports the time at which its capture completed on the recording
// stream's clock (Event::completed_at, ElapsedBetween). A stream given a TraceWriter
// (StreamOptions::trace) emits one Chrome-trace span per StreamOp it runs and per wait it honours,
// at execution time, timed on its clock (see StreamOptions for what each kind of stream shows).
//
// Thread safety: every method may be called from any thread.

#ifndef SHARDLINE_RUNTIME_STREAM_H_
#define SHARDLINE_RUNTIME_STREAM_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "runtime/clock.h"
#include "runtime/device.h"

namespace shardline {

class Stream;
class TraceWriter;

// A callback run once when an event's capture completes, with OK or the failure.
using EventCallback = absl::AnyInvocable<void(absl::Status) &&>;

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
  // DeadlineExceeded if `deadline` (on the recording stream's clock) passes first.
  virtual absl::Status Synchronize(absl::Time deadline) = 0;

  // Runs `callback` once the work captured by the latest Record() (as of this call) completes,
  // with what Query() would then report (OK or the failure). Runs it at once, on this thread, if
  // that has already happened or the event was never recorded. Otherwise it runs on whichever
  // thread completes the capture (a stream's worker, a CUDA host-callback thread): it must be
  // short, must not block and must not call CUDA. This is the open path for waiting on an event
  // of a kind a stream does not know, and for bookkeeping that needs neither polling nor a
  // blocked thread. Host events run the callbacks before Query()/Synchronize() report the
  // completion, so a thread that saw the completion also sees the callbacks' effects.
  virtual void OnComplete(EventCallback callback) = 0;

  // Stream::id() of the stream of the latest Record(); 0 if never recorded or unknown. Lets a
  // stream skip waiting for its own earlier work (stream order already covers it).
  virtual uint64_t recorded_stream_id() const { return 0; }

  // The time, on the recording stream's clock, at which the capture of the latest Record()
  // completed (whether it succeeded or failed); on a ManualClock stream that is virtual time.
  // nullopt while it is pending, if the event was never recorded, or if this kind of event does
  // not know (the default; CUDA events, which are created with cudaEventDisableTiming).
  virtual std::optional<absl::Time> completed_at() const { return std::nullopt; }
};

// end.completed_at() - start.completed_at(): how long after `start`'s capture completed `end`'s
// did (negative if it completed first). FailedPrecondition, naming which one, if either has no
// completion time (see completed_at()). Both must have been recorded on streams that share a
// clock; the difference of two clocks' times means nothing.
absl::StatusOr<absl::Duration> ElapsedBetween(const Event& start, const Event& end);

// What an op costs, for streams that account time instead of spending it (the simulator) and
// for traces.
enum class StreamOpKind : uint8_t {
  kHost,        // opaque host work
  kCopy,        // bytes moved within one memory
  kCast,        // a dtype conversion of `bytes` input bytes
  kReduce,      // an elementwise reduction over `bytes` input bytes
  kFill,        // a memset of `bytes`
  kCollective,  // a collective moving `bytes` per rank
  kCompute,     // the framework's compute (`flops`)
};

// "host", "copy", "cast", "reduce", "fill", "collective", "compute".
absl::string_view StreamOpKindName(StreamOpKind kind);

// One unit of work for a stream: what it is and costs, the closure that does it, and what to do
// if the stream drops it.
struct StreamOp {
  using Run = absl::AnyInvocable<absl::Status() &&>;
  using Cancel = absl::AnyInvocable<void(const absl::Status&) &&>;

  // Shown in traces and errors ("all_gather #12", "cast f32->bf16"). Owned.
  std::string name = "host work";
  StreamOpKind kind = StreamOpKind::kHost;
  uint64_t bytes = 0;
  uint64_t flops = 0;
  // The op's declared duration on virtual-time streams (runtime/virtual_time.h); zero: the
  // timeline's cost model decides from kind, bytes and flops. Other streams ignore it.
  absl::Duration duration = absl::ZeroDuration();
  // The work. A non-OK result poisons the stream.
  Run run;
  // Optional. Called with the poison Status instead of `run` if the stream drops the op.
  Cancel cancel;
};

struct StreamOptions {
  // Shown in errors, logs and traces ("gather", "reduce", "compute").
  std::string name = "stream";
  // How long a stream's worker waits for an event before poisoning the stream with
  // DeadlineExceeded. absl::ZeroDuration() means "unset": use SHARDLINE_TIMEOUT_S.
  absl::Duration wait_timeout = absl::ZeroDuration();
  // The clock of the stream's deadlines. Null: WallClock(). Must outlive the stream. Host and
  // caller streams accept any clock (tests drive them with a ManualClock); CUDA streams only the
  // wall clock.
  const Clock* clock = nullptr;
  // A scheduling hint: higher is more urgent, 0 is the default. Host and caller streams ignore
  // it. A CUDA stream maps it onto the device's cudaDeviceGetStreamPriorityRange: priority p
  // becomes CUDA priority (least - p) clamped to [greatest, least], so 0 and below are CUDA's
  // default and values past the device's few levels act as its most urgent.
  int priority = 0;
  // Where the stream's spans go; null: no tracing. Must outlive the stream (and, for a CUDA
  // stream, its host functions). Each StreamOp that runs becomes one complete event on `track`:
  // name = op.name, category = StreamOpKindName(op.kind), args {bytes, flops (if nonzero),
  // error (if it failed)}, start and end read from the stream's clock() around `run`, so a
  // ManualClock stream shows virtual time. Each wait the stream executes (WaitEvent on an
  // event not yet complete) becomes a span named "wait <recording stream's name>", category
  // "wait", covering the time the stream was held up. Dropped ops make no span.
  //   host     spans are timed on the worker thread
  //   caller   spans are timed on the calling thread
  //   cuda     host functions (Submit'ed ops; waits for host events only where the device
  //            cannot wait itself, see cuda_stream.h) are timed on CUDA's host-callback
  //            thread. Kernels and copies that runtime/stream_ops.h enqueues
  //            directly, and waits for CUDA events (cudaStreamWaitEvent), are not StreamOps and
  //            make no span.
  TraceWriter* trace = nullptr;
  // The trace track (Chrome-trace tid) of the spans; empty: `name`. Streams that share a track
  // share a lane in the viewer.
  std::string track;
};

class Stream {
 public:
  using Work = StreamOp::Run;

  Stream();
  virtual ~Stream() = default;

  virtual Device device() const = 0;
  virtual const std::string& name() const = 0;
  // The clock of this stream's deadlines (runtime/clock.h).
  virtual const Clock& clock() const { return WallClock(); }
  // Unique in the process for the process's lifetime (never reused, unlike an address).
  uint64_t id() const { return id_; }

  // Enqueues an op. On a host stream it runs on the worker thread, on a caller stream
  // immediately on this thread, on a CUDA stream as a host function ordered on the stream (it
  // must not call CUDA). Returns the stream's error without enqueueing (and without calling
  // op.cancel) if it is poisoned.
  virtual absl::Status Submit(StreamOp op) = 0;

  // Submit() of opaque host work.
  absl::Status Enqueue(Work work);

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

 private:
  const uint64_t id_;
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

// Like RecordEvent, but the event may be shared: on host and caller streams, when nothing (no op,
// no wait that had to be queued) was enqueued on `stream` since the last RecordSharedEvent on it,
// and the stream is not poisoned, this returns that call's event again instead of making and
// recording a new one. It then captures exactly what a fresh record would (the same work), so it
// orders and guards the same; but its completed_at() may be earlier than a fresh record's (a
// record on a drained stream completes when it is made), so time with RecordEvent. Callers must
// not Record() the returned event again, since others may hold it. Other kinds of stream:
// RecordEvent. (The scheduler records on the same compute stream point several times per hook:
// the gradient's ready event and zero-fill, the reduction's and the reshard's consumer records.)
absl::StatusOr<std::shared_ptr<Event>> RecordSharedEvent(Stream& stream);

// Holds back the wake-ups of host streams' sleeping workers on the calling thread while it is
// open. A submission (an op, or a wait that has to be queued) to a host stream whose worker sleeps
// does not wake the worker at once (a futex wake, often a cross-CPU interrupt, and on a virtual
// machine an exit): each such worker is woken once, when the thread's outermost batch ends, or
// sooner, when the thread is about to block in any Clock::WaitUntil (every blocking call of the
// streams: Stream::Synchronize, Event::Synchronize, a caller stream's wait), so the thread never
// blocks on work it held back. The work itself is unchanged and keeps its order; it may only start
// later, at the end of the batch. Open one around a burst of submissions (the scheduler's hooks
// do); inside it, code that waits by other means (a spin on a flag, another library's blocking
// call) for something that may need the held-back work calls WakeHeld() first (the CUDA streams'
// and NCCL's polling waits do). Batches nest. Not copyable; End() (or the destructor) runs on the
// thread that opened it.
class HostStreamWakeBatch {
 public:
  HostStreamWakeBatch();
  ~HostStreamWakeBatch() { End(); }
  HostStreamWakeBatch(const HostStreamWakeBatch&) = delete;
  HostStreamWakeBatch& operator=(const HostStreamWakeBatch&) = delete;
  // Ends the batch now (later calls do nothing): the outermost one wakes the workers it held.
  void End();
  // Wakes now the workers whose wake-ups the calling thread holds back; the batches stay open.
  // Cheap when there are none.
  static void WakeHeld();

 private:
  bool open_ = true;
};

// What the calling thread asked of host and caller streams since it started: a diagnostic for
// benchmarks that count the cost of the scheduler's hooks (bench/micro/scheduler_hooks_bench.cc).
// Counted per thread, without synchronization; read it on the thread whose calls you count.
struct HostStreamCallStats {
  uint64_t submits = 0;         // Submit() on host streams
  uint64_t records = 0;         // host-event Record()s on host and caller streams
  uint64_t records_queued = 0;  // ... of which are behind pending work (the rest complete at once)
  uint64_t waits = 0;           // WaitEvent() on host streams
  uint64_t waits_queued = 0;    // ... of which queued a wait (the rest found the event done)
  uint64_t wakes = 0;           // notifies of a sleeping worker (each a futex wake)
  uint64_t events = 0;          // host events created
  uint64_t records_shared = 0;  // RecordSharedEvent() calls that returned an earlier event
};
HostStreamCallStats ThisThreadHostStreamCallStats();

// Host-stream worker threads of this process that are awake (running an op, waiting inside one,
// or polling for work), the calling thread not counted. A thread that polls for a peer asks it
// before giving its core away: yielding helps only if a thread of its own process may take the
// core; yielding to another process's busy thread costs a whole time slice.
int OtherAwakeHostStreamWorkers();

// stream.WaitEvent(*event), skipped when `event` is null or was last recorded on `stream` itself
// (stream order already covers it).
absl::Status WaitUnlessSameStream(Stream& stream, const std::shared_ptr<Event>& event);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_STREAM_H_
