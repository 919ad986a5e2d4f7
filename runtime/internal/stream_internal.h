// File: runtime/internal/stream_internal.h
// -----------------------------------------------------------------------------
// Internal to the stream implementations (runtime/host_event.cc, the host and caller streams,
// runtime/cuda/):
// the shared state of a host event and the two small interfaces through which one kind of stream
// records or waits for another kind's events. Not part of the public API (not installed).
//
// A host event's Record() on a host stream (CreateHostStream) is a position in the stream's
// HostStreamProgress: the number of items (ops and queued waits) enqueued before it. It completes
// once the stream has finished that many items, and it failed if one of them did; nothing is
// handed to the stream's worker, which only counts and stamps what it finishes. On any other
// stream that can record host events (caller, callback, CUDA) Record() makes a fresh HostCapture
// and hands it to the stream, which completes it when the work enqueued before it has run.
// Waiters (Event::Synchronize, a host stream's worker, a caller stream's thread, a CUDA host
// function) hold the position or capture they saw when they started, so re-recording the event
// never changes what an earlier wait waits for, which is CUDA's rule.
//
// StreamTracer turns StreamOptions::trace into spans; every stream kind uses it.

#ifndef SHARDLINE_RUNTIME_INTERNAL_STREAM_INTERNAL_H_
#define SHARDLINE_RUNTIME_INTERNAL_STREAM_INTERNAL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/inlined_vector.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "runtime/stream.h"

namespace shardline::stream_internal {

// The stream code uses std::mutex and std::condition_variable rather than absl::Mutex: the
// system's abseil is not built with ThreadSanitizer, which then cannot see absl::Mutex's
// synchronization. Waits go through Clock::WaitUntil (runtime/clock.h).

// One Record() of a host event.
class HostCapture {
 public:
  // `clock` is the recording stream's (it must outlive the capture: streams' clocks outlive
  // the streams, and a capture is completed at the latest when its stream is destroyed).
  // `shared_name` is the stream's name, shared by the stream and its captures (which may outlive
  // it: HostCaptureRecorder::shared_name()); null: the capture keeps a copy of stream.name().
  explicit HostCapture(const Stream& stream,
                       std::shared_ptr<const std::string> shared_name = nullptr)
      : shared_name_(std::move(shared_name)),
        own_name_(shared_name_ == nullptr ? stream.name() : std::string()),
        stream_id_(stream.id()),
        clock_(&stream.clock()) {}
  // The same for a stream known by its parts (`shared_name` non-null).
  HostCapture(std::shared_ptr<const std::string> shared_name, uint64_t stream_id,
              const Clock& clock)
      : shared_name_(std::move(shared_name)), stream_id_(stream_id), clock_(&clock) {}

  // Marks the capture complete with `status` (OK, or the failure of the stream it was recorded
  // on) at clock().Now(): runs the callbacks, then wakes every waiter. Only the first call counts.
  void Complete(absl::Status status);

  // The clock time of the first Complete() call; nullopt until the capture reports done.
  std::optional<absl::Time> completed_at();

  // OK once complete: the failure's Status if the captured work failed. DeadlineExceeded if
  // `deadline` (on the recording stream's clock) passes first, naming `waiter`
  // ("Event::Synchronize", "stream 'x'") and the stream the event was recorded on.
  absl::Status Wait(absl::Time deadline, absl::string_view waiter);
  // The same, with the waiter's name formatted only if the wait times out.
  absl::Status Wait(absl::Time deadline, absl::FunctionRef<std::string()> waiter);

  // false while pending; true once complete, with the outcome in *status.
  bool done(absl::Status* status);

  // Runs `callback` when complete (at once, here, if it already is).
  void OnComplete(EventCallback callback);

  const std::string& stream_name() const {
    return shared_name_ != nullptr ? *shared_name_ : own_name_;
  }
  uint64_t stream_id() const { return stream_id_; }
  const Clock& clock() const { return *clock_; }

 private:
  const std::shared_ptr<const std::string> shared_name_;
  const std::string own_name_;  // without a shared name
  const uint64_t stream_id_;
  const Clock* const clock_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool completing_ ABSL_GUARDED_BY(mu_) = false;  // Complete() is running the callbacks
  absl::Time completed_at_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  // Inline: most captures get one or two callbacks (the allocator's guards, a stream's wait).
  using Callbacks = absl::InlinedVector<EventCallback, 2>;
  Callbacks callbacks_ ABSL_GUARDED_BY(mu_);
};

// The completion times of kTimeBlockItems consecutive items of a host stream, stamped by its
// worker as it finishes them. Shared by the events recorded behind pending work (so an event's
// completion time stays readable for as long as the event lives, however far the stream has
// moved on); one allocation per kTimeBlockItems items.
// A block also keeps the stream's progress alive, so that a record behind pending work holds one
// reference, not two.
inline constexpr uint64_t kTimeBlockItems = 64;
class HostStreamProgress;
struct TimeBlock {
  explicit TimeBlock(std::shared_ptr<HostStreamProgress> p) : progress(std::move(p)) {}
  const std::shared_ptr<HostStreamProgress> progress;
  // Item i (numbered from 1) finished at at[(i - 1) % kTimeBlockItems]. Written by the worker
  // before it publishes the item finished; read only after seeing it finished. On lines of its
  // own: the worker writes them while the hook thread counts references to the block.
  alignas(64) absl::Time at[kTimeBlockItems];
};

// What a host stream has finished, shared by the stream and the events recorded on it (which may
// outlive it). The stream's items (ops, and waits it had to queue) are numbered 1, 2, ... in
// enqueue order; a record at position p captures items 1..p. Dropped items (after a failure)
// count as finished. A stream stays poisoned once an item fails and drops the rest, so "item
// f was the first to fail" decides every position exactly: p failed iff f <= p.
//
// The worker publishes each item's end in order: it stamps the item's time, runs the callbacks
// due (OnComplete) and only then publishes the count, so a thread that sees a position done also
// sees its callbacks' effects. Readers need no lock: the count and the first failure are atomics.
class HostStreamProgress {
 public:
  static constexpr uint64_t kNever = ~uint64_t{0};

  HostStreamProgress(std::shared_ptr<const std::string> name, uint64_t stream_id,
                     const Clock& clock)
      : name_(std::move(name)), stream_id_(stream_id), clock_(&clock) {}

  // Whether items 1..position have finished.
  bool Done(uint64_t position) const {
    return finished_.load(std::memory_order_acquire) >= position;
  }
  // The outcome of a position that is Done: OK, or the first failure if it is among its items.
  absl::Status OutcomeAt(uint64_t position) const {
    if (failed_at_.load(std::memory_order_acquire) > position) return absl::OkStatus();
    return failure_;
  }
  // The first failed item; kNever while none failed.
  uint64_t failed_at() const { return failed_at_.load(std::memory_order_acquire); }

  // Items finished so far.
  uint64_t finished() const { return finished_.load(std::memory_order_acquire); }

  // Blocks until `position` is done (true), or `deadline` (on clock()) passes first (false).
  bool WaitUntilDone(uint64_t position, absl::Time deadline);

  // Blocks until `position` is done: its outcome, or DeadlineExceeded at `deadline` (on clock())
  // naming `waiter` and the stream.
  absl::Status Wait(uint64_t position, absl::Time deadline,
                    absl::FunctionRef<std::string()> waiter);

  // Runs `callback` with the outcome once `position` is done: at once, here, if it is.
  void OnComplete(uint64_t position, EventCallback callback);

  // The worker, when item `item` is the first to fail (before anyone may learn of the failure
  // from the stream): records `failure` for the positions from `item` on.
  void Fail(uint64_t item, absl::Status failure);

  // The worker, after item `item` (the next in order) ran or was dropped: stores `at`, its end
  // time, into `times` (the item's block), runs the callbacks due, publishes the item finished
  // and wakes waiters.
  void Finish(uint64_t item, absl::Time at, TimeBlock* times);

  const std::string& stream_name() const { return *name_; }
  const std::shared_ptr<const std::string>& shared_name() const { return name_; }
  uint64_t stream_id() const { return stream_id_; }
  const Clock& clock() const { return *clock_; }

 private:
  // Runs the callbacks of positions <= `finished` (cb_mu_ not held).
  void RunDueCallbacks(uint64_t finished);

  const std::shared_ptr<const std::string> name_;
  const uint64_t stream_id_;
  const Clock* const clock_;
  // Each group on cache lines of its own: the worker writes finished_ per item, readers poll it,
  // and registrations and waits come from other threads.
  alignas(64) std::atomic<uint64_t> finished_{0};
  alignas(64) std::atomic<uint64_t> failed_at_{kNever};
  absl::Status failure_;  // written once, before failed_at_ is published
  // OnComplete callbacks of positions not yet done, and the smallest of those positions (kNever
  // if none), which the worker compares each item with before it takes cb_mu_.
  alignas(64) std::atomic<uint64_t> first_callback_{kNever};
  std::mutex cb_mu_;
  absl::InlinedVector<std::pair<uint64_t, EventCallback>, 4> callbacks_ ABSL_GUARDED_BY(cb_mu_);
  // The positions threads are blocked in Wait for, and the smallest of them (kNever if none),
  // which the worker compares each item with before it takes wait_mu_: a waiter is woken when
  // its position is done, not at every item before it (a burst of work behind one Synchronize
  // would otherwise cost the waiter a wake-up per item).
  alignas(64) std::atomic<uint64_t> first_wait_{kNever};
  std::mutex wait_mu_;
  std::condition_variable wait_cv_;
  absl::InlinedVector<uint64_t, 4> waits_ ABSL_GUARDED_BY(wait_mu_);
};

// A host event's record on a host stream: a position in its progress, and how to know when it
// completed. One reference either way: the time block of a record behind pending work, or the
// progress of one that was done at the record.
struct HostMark {
  // Pending at the record: the block in which the worker stamps item `position`'s end.
  std::shared_ptr<const TimeBlock> times;
  // Done at the record (the stream had finished everything, or was poisoned): when.
  std::shared_ptr<HostStreamProgress> done_on;
  absl::Time done_at;
  uint64_t position = 0;

  bool recorded() const { return times != nullptr || done_on != nullptr; }
  // The stream's progress; recorded() only.
  HostStreamProgress& progress() const { return times != nullptr ? *times->progress : *done_on; }
  bool Done() const { return done_on != nullptr || times->progress->Done(position); }
  // The completion time, once done (nullopt before).
  std::optional<absl::Time> completed_at() const {
    if (done_on != nullptr) return done_at;
    if (!times->progress->Done(position)) return std::nullopt;
    return times->at[(position - 1) % kTimeBlockItems];
  }
};

// Implemented by every stream a host event can be recorded on (host, caller and CUDA streams).
class HostCaptureRecorder {
 public:
  // Completes `capture` once the work enqueued so far has run. If the stream is poisoned the
  // capture completes at once with the stream's Status, which is also returned.
  virtual absl::Status RecordHostCapture(std::shared_ptr<HostCapture> capture) = 0;

  // The stream's name, for its captures to share without copying it; null: each capture copies
  // it.
  virtual std::shared_ptr<const std::string> shared_name() const { return nullptr; }

 protected:
  ~HostCaptureRecorder() = default;
};

// Implemented by events of other kinds (CUDA) that host and caller streams can wait for by
// blocking a host thread.
class HostWaitable {
 public:
  using Waiter = absl::AnyInvocable<absl::Status(absl::Time deadline) &&>;

  // A closure that blocks until the work captured by the event's latest Record() (as of this call)
  // has completed: OK, the failure's Status, or DeadlineExceeded at `deadline`. It keeps what it
  // needs alive, so the event may be destroyed before it runs. InvalidArgument if this event cannot
  // be waited for from the host.
  virtual absl::StatusOr<Waiter> SnapshotForHostWait() = 0;

  // The name of the stream of the latest Record() ("" if never recorded), for wait spans.
  virtual std::string recorded_stream_name() const = 0;

 protected:
  ~HostWaitable() = default;
};

// Wakes the workers whose wake-ups the calling thread's HostStreamWakeBatch holds back. It takes
// the first held worker's stream lock (to relay the others' wake-ups through that worker): the
// caller holds no host stream's lock.
void WakeHeldWorkers();

// WakeHeldWorkers for a thread about to block in a clock's WaitUntil with `lock` held: releases
// `lock` meanwhile, if there is anything to wake. The built-in clocks call it before blocking
// (the hook of runtime/internal/clock_internal.h, installed by CreateHostStream).
void WakeHeldWorkersBeforeBlock(std::unique_lock<std::mutex>& lock);

// The wait_timeout a stream named options.name uses: options.wait_timeout if set, else
// SHARDLINE_TIMEOUT_S. InvalidArgument if it is negative, or unset and the knob is invalid.
absl::StatusOr<absl::Duration> ResolveWaitTimeout(const StreamOptions& options);

// The event of host and caller streams. Record() works on any stream that implements
// HostCaptureRecorder. On a host stream a record is a HostMark (no capture, nothing shared with
// the worker); on the others a HostCapture.
//
// The first capture Record() of an event owned by a std::shared_ptr (CreateHostEvent) uses a
// capture stored inside the event, shared through aliasing shared_ptrs that keep the event alive;
// later ones allocate. Most events are recorded once (RecordEvent), so a record on a caller
// stream costs one allocation (the event's) instead of two.
class HostEvent final : public Event, public std::enable_shared_from_this<HostEvent> {
 public:
  Device device() const override { return Device::Host(); }
  absl::Status Record(Stream& stream) override;
  absl::StatusOr<bool> Query() override;
  absl::Status Synchronize(absl::Time deadline) override;
  void OnComplete(EventCallback callback) override;
  uint64_t recorded_stream_id() const override;
  std::optional<absl::Time> completed_at() const override;

  // The capture of the latest Record(); nullptr if the event was never recorded. For a record
  // on a host stream, a capture made now that the stream's progress completes (for the streams
  // that only know captures: CUDA, callback, virtual).
  std::shared_ptr<HostCapture> current() const;

  // What a stream waits for to honour WaitEvent(*this) (WaitTarget's mark or capture), snapshot
  // now; neither if the event was never recorded or completed OK.
  void SnapshotForWait(std::shared_ptr<const TimeBlock>* times, uint64_t* position,
                       std::shared_ptr<HostCapture>* capture, std::string* source) const;

  // The first Record() of `self`, an event no other thread can see yet (RecordEvent): the same
  // as self->Record(stream) on a stream that `recorder` is, without taking the event's lock.
  static absl::Status RecordFresh(const std::shared_ptr<HostEvent>& self, Stream& stream,
                                  HostCaptureRecorder& recorder);
  // RecordFresh's first half: sets up the first Record() of `self` (no other thread can see it
  // yet) on `stream` (which `recorder` is) and returns its capture, for the stream to record.
  static std::shared_ptr<HostCapture> PrepareFresh(const std::shared_ptr<HostEvent>& self,
                                                   Stream& stream,
                                                   const HostCaptureRecorder& recorder);
  // Makes `mark` (a record on the host stream `stream_id`) this event's latest record. Fresh:
  // an event no other thread can see yet (published by whatever hands it over), without the
  // event's lock.
  void SetMark(HostMark mark, uint64_t stream_id);
  void SetFreshMark(HostMark mark, uint64_t stream_id);

 private:
  // Stream::id() of the latest Record()'s stream, readable without the lock.
  std::atomic<uint64_t> recorded_stream_id_{0};
  mutable std::mutex mu_;
  // The latest Record() on a host stream (mark_.recorded()), else none.
  HostMark mark_ ABSL_GUARDED_BY(mu_);
  // The latest Record()'s capture when it was allocated; null when that is embedded_ (an owning
  // pointer to embedded_ here would keep the event alive forever) or a mark.
  std::shared_ptr<HostCapture> current_ ABSL_GUARDED_BY(mu_);
  bool current_embedded_ ABSL_GUARDED_BY(mu_) = false;
  // The first capture Record()'s capture; constructed once, never replaced.
  std::optional<HostCapture> embedded_ ABSL_GUARDED_BY(mu_);
};

// The spans of one stream (StreamOptions::trace, track). A no-op without a writer, so streams
// call it unconditionally. Cheap to copy; the writer must outlive every copy.
class StreamTracer {
 public:
  StreamTracer() = default;
  // Resolves the track (options.track, else options.name) once.
  explicit StreamTracer(const StreamOptions& options);

  bool enabled() const { return writer_ != nullptr; }

  // Runs `op` (std::move(op.run)()) between two readings of `clock`, emits its span and returns
  // what `run` returned. The op's name, kind and cost stay in `op`; `run` is consumed.
  absl::Status RunOp(StreamOp& op, const Clock& clock) const;

  // Runs `wait` between two readings of `clock` and emits the span "wait <source>".
  absl::Status RunWait(absl::string_view source, const Clock& clock,
                       absl::FunctionRef<absl::Status()> wait) const;

 private:
  TraceWriter* writer_ = nullptr;
  int tid_ = 0;
};

}  // namespace shardline::stream_internal

#endif  // SHARDLINE_RUNTIME_INTERNAL_STREAM_INTERNAL_H_
