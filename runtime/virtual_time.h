// File: runtime/virtual_time.h
// -----------------------------------------------------------------------------
// Virtual time: streams that account time instead of spending it, so that the scheduler's exact
// issue order, overlap and memory budget can be tested deterministically, for many ranks in one
// process, with no thread ever sleeping.
//
// A VirtualTimeline is one simulation: a virtual clock (it starts at absl::UnixEpoch()) and a
// discrete-event engine shared by every virtual stream, virtual event and sim communicator
// (collectives/sim/) of that simulation. A virtual stream has no thread: Submit(), WaitEvent()
// and Event::Record() only append to its FIFO. Nothing runs until a thread drives the engine,
// with a blocking call:
//
//   Stream::Synchronize(deadline), Event::Synchronize(deadline), Work::Wait(deadline)
//   VirtualTimeline::RunUntilIdle(), VirtualTimeline::RunUntil(t)
//
// The driving thread processes the engine's events in (virtual time, sequence number) order
// (ties: the order in which they were scheduled, i.e. submission order) until its condition
// holds, moving the clock forward to each event's time. Ops' `run` closures, `cancel` closures
// and Event::OnComplete callbacks run on the driving thread at their virtual time. The same
// calls give the same timeline, every time.
//
// Semantics are runtime/stream.h's: FIFO per stream, streams concurrent, events capture what
// was enqueued before Record(), waits, poisoning (and its propagation through waits), `cancel`
// for dropped ops, OnComplete callbacks before Query()/Synchronize() report the completion. On
// top of them, an op occupies its stream for a duration:
//   * StreamOp::duration if set, else the timeline's cost model (VirtualTimelineOptions):
//     overhead + bytes / the kind's throughput (copy, cast, reduce, fill, collective),
//     overhead + flops / compute throughput, overhead alone for host work; with host sharing
//     (VirtualTimelineOptions::host_cores) a memory op's time is that alone, stretched while
//     more ops and collectives than the host has cores run on it;
//   * `run` is called at the op's virtual start (unless VirtualTimelineOptions::run_ops is
//     false: phantom-memory simulations); a failure poisons the stream at the op's end;
//   * a wait blocks the stream until the captured work completes, at that completion's time;
//     a wait longer than the stream's wait_timeout (virtual) poisons it with DeadlineExceeded;
//   * a record completes its capture when the stream reaches it.
//
// Stalls: if nothing can progress and the driver's condition does not hold (a stream waits for
// an event whose stream is blocked, a collective waits for a rank that has not issued it), the
// blocking call returns FailedPrecondition at once, naming every blocked stream and what it waits
// for:
//   "stream 'x': Synchronize: virtual time stalled at +1.2ms: stream 'rank1.gather' waits for
//    all_gather #3 on world (sim; ranks waiting: 0; not issued: 1)"
// Timeouts (wait_timeout, a collective's timeout) fire only when other work moves the clock past
// them; they never count as progress, so a stall is reported instead of waited out. Deadlines
// of blocking calls are virtual: DeadlineExceeded once the clock would pass them (the clock is
// then left at the deadline).
//
// Driving from inside an op, a cancel or a callback (re-entrancy) returns FailedPrecondition
// unless the condition already holds. A second thread that drives while another does waits for
// that one to finish, then drives itself. Everything assumes that the work a condition needs
// has been issued before someone drives: a stall is reported at once, not waited out for
// another thread.
//
// Events: CreateEvent() of a virtual stream gives a virtual event: completed_at() is virtual
// time; Query() never drives (it reports what the engine has processed so far). A virtual
// stream may wait for an event of another kind (host, another timeline) only if it has already
// completed; waiting for a pending one is InvalidArgument naming it (virtual time cannot wait
// for wall time and stay deterministic).
//
// Tracing: StreamOptions::trace works as on host streams, with spans at virtual times: one per
// op, from its start to its end (including declared durations), one per wait that held the
// stream up.
//
// Lifetimes: a timeline must outlive its streams, events' pending callbacks and communicators.
// Destroying a virtual stream lets its queued work finish (driving the engine) as a host stream
// does; if that stalls, or it is destroyed from inside the engine, its remaining ops are
// cancelled with FailedPrecondition and its records complete with that error.
//
//   VirtualTimeline timeline;
//   SL_ASSIGN_OR_RETURN(auto stream, CreateVirtualStream(timeline, {.name = "gather"}));
//   StreamOp op;
//   op.kind = StreamOpKind::kCopy;
//   op.bytes = 1 << 20;
//   SL_RETURN_IF_ERROR(stream->Submit(std::move(op)));
//   SL_RETURN_IF_ERROR(timeline.RunUntilIdle());   // timeline.Now() is now 1 MiB / copy rate
//
// Thread safety: every method may be called from any thread (one mutex per timeline).

#ifndef SHARDLINE_RUNTIME_VIRTUAL_TIME_H_
#define SHARDLINE_RUNTIME_VIRTUAL_TIME_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "runtime/clock.h"
#include "runtime/stream.h"

namespace shardline {

// The cost model of ops that declare no StreamOp::duration. Throughputs must be positive
// (infinity: the kind costs only the overhead).
struct VirtualTimelineOptions {
  double copy_bytes_per_s = 100e9;
  double cast_bytes_per_s = 50e9;
  double reduce_bytes_per_s = 50e9;
  double fill_bytes_per_s = 200e9;
  // kCollective ops submitted as plain StreamOps (the sim communicator decides its own times).
  double collective_bytes_per_s = 10e9;
  double compute_flops_per_s = 100e12;
  // Added to every op without a declared duration (kHost ops cost only this).
  absl::Duration op_overhead = absl::ZeroDuration();
  // false: ops' `run` closures are never called (the memory may be phantom); ops still take
  // their time, and sim communicators move no data.
  bool run_ops = true;
  // Host sharing (runtime/virtual_sharing.h), for machines whose memory ops and collectives
  // are copies by the host's cores (the UCX backend in host memory): the cores of each host,
  // > 0 (may be fractional). Every copy, cast, reduce and fill op without a declared duration
  // on a stream created with a host (CreateVirtualStream's `host`) is then a flow of demand 1
  // on that host: k such ops at once on a host of c cores each progress at min(1, c / k) of
  // their speed alone (their time alone is the cost model's). Sim collectives add their ranks'
  // threads there too (collectives/sim/). 0: ops take their time alone (GPU-like devices, whose
  // copies do not take the host's cores).
  double host_cores = 0;
  // With host_cores: a sim collective progresses only while all of its ranks' threads on a host
  // run at once (they work in lock-step), so its share there is (cores / threads)^ranks instead
  // of cores / threads.
  bool host_lockstep = false;
};

// The end of an asynchronous op: call it exactly once, from within the engine (an op's start, a
// ScheduleAt callback, an OnComplete callback the engine runs), with the op's outcome and its
// virtual end time (clamped to no earlier than the engine's current time).
using VirtualAsyncDone = absl::AnyInvocable<void(absl::Status status, absl::Time end) &&>;

// An op whose end is decided by its user (collectives/sim): the stream stays busy from the op's
// start until `done` is called.
struct VirtualAsyncOp {
  // Shown in traces and errors; the span's category is StreamOpKindName(kind).
  std::string name = "async op";
  StreamOpKind kind = StreamOpKind::kHost;
  uint64_t bytes = 0;
  // Called when the stream reaches the op, at virtual time `start`, on the driving thread (no
  // lock of the timeline held). Always called, whatever VirtualTimelineOptions::run_ops says.
  absl::AnyInvocable<void(absl::Time start, VirtualAsyncDone done) &&> start;
  // Optional. Called with the poison instead of `start` if the stream drops the op.
  StreamOp::Cancel cancel;
  // Optional. While started and not done: what the op waits for, for stall reports
  // ("all_gather #3 on world (sim; ranks waiting: 0; not issued: 1)"). Called on the driving
  // thread without the timeline's lock.
  std::function<std::string()> describe;
};

// A callback scheduled with VirtualTimeline::ScheduleAt, for Cancel().
struct VirtualTimer {
  absl::Time at;
  uint64_t seq = 0;
};

class VirtualSharing;  // runtime/virtual_sharing.h

class VirtualTimeline final : public Clock {
 public:
  // A timeline with the default cost model.
  VirtualTimeline();
  // InvalidArgument naming the option if a throughput is not positive or the overhead is
  // negative.
  static absl::StatusOr<std::unique_ptr<VirtualTimeline>> Create(VirtualTimelineOptions options);
  VirtualTimeline(const VirtualTimeline&) = delete;
  VirtualTimeline& operator=(const VirtualTimeline&) = delete;
  // Every stream of the timeline must have been destroyed (checked).
  ~VirtualTimeline() override;

  // Clock. Now() is the virtual time. WaitUntil serves code that waits on this clock with a
  // condition variable (not virtual streams, which never wait): it returns once `done()` holds
  // or the engine has moved the clock to `deadline`; on the thread that is driving the engine,
  // where the clock cannot move while it waits, it returns done() at once.
  absl::Time Now() const override;
  bool WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                 absl::Time deadline, absl::FunctionRef<bool()> done) const override;
  std::string name() const override { return "virtual"; }

  const VirtualTimelineOptions& options() const { return options_; }

  // How long `op` occupies a virtual stream: op.duration if positive, else the cost model.
  absl::Duration OpDuration(const StreamOp& op) const;

  // Drives the engine until no stream has work that can progress. OK if every stream is then
  // idle; FailedPrecondition (the stall message) if some are blocked. Pending timeouts do not
  // fire.
  absl::Status RunUntilIdle();
  // Drives the engine through every event at or before `t` (timeouts included), then moves the
  // clock to `t` (if it is later than Now()). Never reports a stall.
  absl::Status RunUntil(absl::Time t);

  // Events the engine has processed.
  int64_t steps() const;
  // How many blocking calls had to drive the engine (their condition did not already hold):
  // a test asserts that some code never blocked the host by reading it before and after.
  int64_t host_blocking_runs() const;

  // Whether `stream` is a virtual stream of this timeline.
  bool Owns(const Stream& stream) const;

  // Appends an asynchronous op to `stream`'s FIFO. InvalidArgument if `stream` is not a
  // virtual stream of this timeline or op.start is null; the stream's error if it is poisoned
  // (op.cancel is not called then).
  absl::Status SubmitAsync(Stream& stream, VirtualAsyncOp op);

  // Runs `callback` on the driving thread at virtual time `at` (Now() if earlier), without the
  // timeline's lock. `progress`: whether it counts as work that can progress for stall
  // detection (false for timeouts: they fire only if other work moves the clock past them).
  VirtualTimer ScheduleAt(absl::Time at, absl::AnyInvocable<void() &&> callback,
                          bool progress = true);
  // Drops a callback that has not run yet (nothing if it has).
  void Cancel(const VirtualTimer& timer);

  // The capacity sharing of this simulation (runtime/virtual_sharing.h): hosts (with
  // options().host_cores > 0) and the sim backend's link ports.
  VirtualSharing& sharing() const { return *sharing_; }

  class Impl;  // runtime/internal/virtual_time_internal.h, runtime/virtual_engine.cc

 private:
  explicit VirtualTimeline(VirtualTimelineOptions options);
  friend absl::StatusOr<std::unique_ptr<Stream>> CreateVirtualStream(VirtualTimeline& timeline,
                                                                     StreamOptions options);
  friend absl::StatusOr<std::unique_ptr<Stream>> CreateVirtualStream(VirtualTimeline& timeline,
                                                                     StreamOptions options,
                                                                     int host);

  const VirtualTimelineOptions options_;
  std::shared_ptr<Impl> impl_;
  std::shared_ptr<VirtualSharing> sharing_;
};

// A stream on `timeline`. InvalidArgument if options.clock is neither null nor `timeline`, or if
// options.wait_timeout is negative (or unset and SHARDLINE_TIMEOUT_S is invalid). priority is
// ignored. The stream's clock() is the timeline.
absl::StatusOr<std::unique_ptr<Stream>> CreateVirtualStream(VirtualTimeline& timeline,
                                                            StreamOptions options = {});
// The same on host `host` (>= 0; InvalidArgument otherwise): with options().host_cores > 0 its
// copy, cast, reduce and fill ops without a declared duration share that host's cores with every
// other such op and collective on it (VirtualTimelineOptions::host_cores); otherwise the host
// changes nothing.
absl::StatusOr<std::unique_ptr<Stream>> CreateVirtualStream(VirtualTimeline& timeline,
                                                            StreamOptions options, int host);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_VIRTUAL_TIME_H_
