// File: runtime/internal/virtual_time_internal.h
// -----------------------------------------------------------------------------
// Internal to the virtual-time implementation: the engine's state (VCapture, Item, VStream) and
// the engine itself (VirtualTimeline::Impl, runtime/virtual_engine.cc), shared with the virtual
// streams and events (runtime/virtual_stream.cc) and the timeline (runtime/virtual_time.cc).
// Not part of the public API (not installed).

#ifndef SHARDLINE_RUNTIME_INTERNAL_VIRTUAL_TIME_INTERNAL_H_
#define SHARDLINE_RUNTIME_INTERNAL_VIRTUAL_TIME_INTERNAL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "runtime/clock.h"
#include "runtime/internal/stream_internal.h"
#include "runtime/stream.h"
#include "runtime/virtual_sharing.h"
#include "runtime/virtual_time.h"

namespace shardline {

struct VStream;

// One Record() of a virtual event. Guarded by the timeline's mutex.
struct VCapture {
  VCapture(std::string name, uint64_t id) : stream_name(std::move(name)), stream_id(id) {}

  const std::string stream_name;
  const uint64_t stream_id;
  bool done = false;
  bool completing = false;  // the callbacks are running
  absl::Time completed_at;
  absl::Status status;
  std::vector<EventCallback> callbacks;
  std::vector<std::shared_ptr<VStream>> waiters;  // streams blocked on this capture
};

// One entry of a stream's FIFO.
struct Item {
  enum Kind : uint8_t { kOp, kAsync, kRecord, kWait };
  Kind kind = kOp;
  StreamOp op;
  VirtualAsyncOp async;
  std::shared_ptr<VCapture> capture;  // kRecord: to complete; kWait: to wait for
};

using EventKey = std::pair<absl::Time, uint64_t>;

// The engine's view of one virtual stream. Guarded by the timeline's mutex.
struct VStream {
  VStream(std::string n, uint64_t i, absl::Duration timeout, stream_internal::StreamTracer t, int h)
      : name(std::move(n)), id(i), wait_timeout(timeout), tracer(t), host(h) {}

  enum class State : uint8_t {
    kIdle,       // nothing queued
    kScheduled,  // an advance is scheduled, or the engine is advancing it now
    kBusy,       // an op runs until its end event (or its async done)
    kBlocked,    // a wait holds it until a capture completes (or its timeout)
  };

  const std::string name;
  const uint64_t id;
  const absl::Duration wait_timeout;
  const stream_internal::StreamTracer tracer;
  const int host;  // -1: none (its ops never share a host)

  State state = State::kIdle;
  bool dead = false;  // the Stream was destroyed
  std::deque<Item> queue;
  absl::Status status;
  uint64_t enqueued = 0;
  uint64_t finished = 0;
  uint64_t token = 0;  // identifies the current op or wait, so that stale events are ignored

  // kBusy: the op that runs.
  struct Running {
    std::string name;
    StreamOpKind kind = StreamOpKind::kHost;
    uint64_t bytes = 0;
    uint64_t flops = 0;
    absl::Time start;
    absl::Status result;  // a plain op's `run` result, applied at its end
    bool async = false;
    std::function<std::string()> describe;
  } running;

  // kBlocked: what it waits for, since when, and its timeout event.
  std::shared_ptr<VCapture> blocked_on;
  absl::Time blocked_since;
  EventKey timeout_key;
};

class VirtualTimeline::Impl : public std::enable_shared_from_this<VirtualTimeline::Impl> {
 public:
  using Lock = std::unique_lock<std::mutex>;

  explicit Impl(const VirtualTimelineOptions& options) : options_(options) {}
  // Host sharing (options_.host_cores > 0): set once, before any stream exists.
  void SetSharing(VirtualSharing* sharing) { sharing_ = sharing; }

  absl::Time Now() const { return clock_.Now(); }
  const ManualClock& clock() const { return clock_; }
  bool OnDriverThread() const {
    return driver_.load(std::memory_order_acquire) == std::this_thread::get_id();
  }

  absl::Duration OpDuration(const StreamOp& op) const;

  // ---- streams ----
  void AddStream(const std::shared_ptr<VStream>& s) {
    Lock lock(mu_);
    streams_.emplace(s->id, s);
  }
  void DestroyStream(const std::shared_ptr<VStream>& s);
  absl::Status Push(const std::shared_ptr<VStream>& s, Item item);
  absl::Status PushWait(const std::shared_ptr<VStream>& s, std::shared_ptr<VCapture> capture);
  absl::Status Synchronize(const std::shared_ptr<VStream>& s, absl::Time deadline);
  absl::Status StreamStatus(const VStream& s) const {
    Lock lock(mu_);
    return s.status;
  }

  // ---- captures ----
  // false while pending; true once done, with the outcome in *status.
  bool CaptureDone(const VCapture& c, absl::Status* status) const {
    Lock lock(mu_);
    if (c.done) *status = c.status;
    return c.done;
  }
  std::optional<absl::Time> CompletedAt(const VCapture& c) const {
    Lock lock(mu_);
    if (!c.done) return std::nullopt;
    return c.completed_at;
  }
  void OnComplete(VCapture& c, EventCallback callback);
  absl::Status SynchronizeCapture(VCapture& c, absl::Time deadline);

  // ---- driving ----
  absl::Status RunUntilIdle();
  absl::Status RunUntil(absl::Time t);
  int64_t steps() const {
    Lock lock(mu_);
    return steps_;
  }
  int64_t host_blocking_runs() const {
    Lock lock(mu_);
    return host_blocking_runs_;
  }

  // ---- async ops and timers ----
  void FinishAsync(const std::weak_ptr<VStream>& weak, uint64_t token, absl::Status status,
                   absl::Time end);
  VirtualTimer ScheduleCallback(absl::Time at, absl::AnyInvocable<void() &&> callback,
                                bool progress);
  void Cancel(const VirtualTimer& timer);

  // For ~VirtualTimeline: the names of the streams still alive; drops every pending event.
  std::vector<std::string> Shutdown();

 private:
  struct Timed {
    enum Type : uint8_t { kAdvance, kOpEnd, kWaitTimeout, kCallback };
    Type type = kAdvance;
    bool progress = true;
    std::shared_ptr<VStream> stream;
    uint64_t token = 0;
    bool has_status = false;  // kOpEnd of an async op: its outcome
    absl::Status status;
    absl::AnyInvocable<void() &&> callback;
  };

  EventKey Schedule(absl::Time at, Timed timed);
  void SetNow(absl::Time t) {
    if (t > clock_.Now()) clock_.Set(t);
  }
  // Destroys `object` (user closures) once the lock is next released by the driving loop.
  template <typename T>
  void Discard(T object) {
    trash_.push_back([held = std::move(object)]() mutable {});
  }

  // Runs the engine on this thread until done() (read under the lock) holds. report_stalls:
  // FailedPrecondition when only timeouts remain; otherwise stop when nothing is left at all.
  absl::Status Drive(absl::FunctionRef<bool()> done, absl::Time deadline, bool report_stalls,
                     absl::FunctionRef<std::string()> what);
  absl::Status Loop(Lock& lock, absl::FunctionRef<bool()> done, absl::Time deadline,
                    bool report_stalls, absl::FunctionRef<std::string()> what);
  absl::Status StallError(Lock& lock, absl::FunctionRef<std::string()> what);
  void Process(Timed& timed, Lock& lock);
  // Advances `s` through its FIFO at the current time until it is busy, blocked or empty.
  void Pump(const std::shared_ptr<VStream>& s, Lock& lock);
  void EndOp(const std::shared_ptr<VStream>& s, absl::Status result, Lock& lock);
  void CompleteCapture(VCapture& c, absl::Status status, Lock& lock);
  void Unblock(const std::shared_ptr<VStream>& s, absl::Status status, bool timed_out);
  bool HasUnfinishedWork() const;

  // Whether `op` on `s` is a flow on its host's cores rather than a fixed duration.
  bool SharesHost(const VStream& s, const StreamOp& op) const;

  const VirtualTimelineOptions options_;
  VirtualSharing* sharing_ = nullptr;  // owned by the timeline, which outlives the engine's use
  ManualClock clock_;                  // moved only by the driving thread, under mu_
  mutable std::mutex mu_;
  std::condition_variable driver_cv_;  // a second driver waits for the first
  bool driving_ = false;
  std::atomic<std::thread::id> driver_{};
  std::map<EventKey, Timed> queue_;
  uint64_t next_seq_ = 0;
  int64_t progress_pending_ = 0;  // queued events that are not timeouts
  int64_t steps_ = 0;
  int64_t host_blocking_runs_ = 0;
  std::map<uint64_t, std::shared_ptr<VStream>> streams_;  // by id: creation order
  std::vector<absl::AnyInvocable<void()>> trash_;
};

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_INTERNAL_VIRTUAL_TIME_INTERNAL_H_
