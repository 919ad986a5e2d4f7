// Virtual-time streams and events: a discrete-event engine driven by whichever thread blocks.
//
// Everything lives under the timeline's one mutex (Impl::mu_). The driving thread releases it
// around every piece of user code — ops' run and cancel, async starts, OnComplete callbacks,
// ScheduleAt callbacks, the destruction of their closures — because that code calls back into
// streams and events (a pool's release callback enqueues work; a closure's destructor frees a
// Buffer whose pool records an event). Only one thread drives at a time, so the engine's state
// is consistent whenever the lock is released; other threads only append to FIFOs meanwhile.

#include "runtime/virtual_time.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runtime/check.h"
#include "runtime/internal/stream_internal.h"
#include "runtime/logging.h"
#include "runtime/status.h"
#include "runtime/virtual_sharing.h"

namespace shardline {
namespace {

using Lock = std::unique_lock<std::mutex>;
using stream_internal::StreamTracer;

// "+1.2ms": a virtual time as an offset from the timeline's start.
std::string Offset(absl::Time t) {
  return absl::StrCat("+", absl::FormatDuration(t - absl::UnixEpoch()));
}

// Replays a span's start and end to StreamTracer, which reads its clock around the work.
class SpanClock final : public Clock {
 public:
  SpanClock(absl::Time start, absl::Time end) : times_{start, end} {}
  absl::Time Now() const override { return times_[std::min(reads_++, 1)]; }
  bool WaitUntil(std::condition_variable&, std::unique_lock<std::mutex>&, absl::Time,
                 absl::FunctionRef<bool()> done) const override {
    return done();
  }
  std::string name() const override { return "virtual"; }

 private:
  const absl::Time times_[2];
  mutable int reads_ = 0;
};

}  // namespace

// ---- Engine state ----------------------------------------------------------------------------

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
  VStream(std::string n, uint64_t i, absl::Duration timeout, StreamTracer t, int h)
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
  const StreamTracer tracer;
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

bool VirtualTimeline::Impl::SharesHost(const VStream& s, const StreamOp& op) const {
  if (sharing_ == nullptr || s.host < 0 || op.duration > absl::ZeroDuration()) return false;
  switch (op.kind) {
    case StreamOpKind::kCopy:
    case StreamOpKind::kCast:
    case StreamOpKind::kReduce:
    case StreamOpKind::kFill:
      return true;
    default:
      return false;
  }
}

absl::Duration VirtualTimeline::Impl::OpDuration(const StreamOp& op) const {
  if (op.duration > absl::ZeroDuration()) return op.duration;
  double amount = static_cast<double>(op.bytes);
  double rate = std::numeric_limits<double>::infinity();
  switch (op.kind) {
    case StreamOpKind::kHost:
      amount = 0;
      break;
    case StreamOpKind::kCopy:
      rate = options_.copy_bytes_per_s;
      break;
    case StreamOpKind::kCast:
      rate = options_.cast_bytes_per_s;
      break;
    case StreamOpKind::kReduce:
      rate = options_.reduce_bytes_per_s;
      break;
    case StreamOpKind::kFill:
      rate = options_.fill_bytes_per_s;
      break;
    case StreamOpKind::kCollective:
      rate = options_.collective_bytes_per_s;
      break;
    case StreamOpKind::kCompute:
      amount = static_cast<double>(op.flops);
      rate = options_.compute_flops_per_s;
      break;
  }
  absl::Duration cost = options_.op_overhead;
  if (amount > 0 && std::isfinite(rate)) cost += absl::Nanoseconds(amount * 1e9 / rate);
  return cost;
}

// ---- the event queue and the driving loop ----------------------------------------------------

EventKey VirtualTimeline::Impl::Schedule(absl::Time at, Timed timed) {
  const EventKey key{std::max(at, clock_.Now()), next_seq_++};
  if (timed.progress) ++progress_pending_;
  queue_.emplace(key, std::move(timed));
  return key;
}

absl::Status VirtualTimeline::Impl::Drive(absl::FunctionRef<bool()> done, absl::Time deadline,
                                          bool report_stalls,
                                          absl::FunctionRef<std::string()> what) {
  Lock lock(mu_);
  if (done()) return absl::OkStatus();
  if (driving_ && OnDriverThread()) {
    return absl::FailedPreconditionError(
        absl::StrCat(what(), ": called from inside an op or callback that virtual time is ",
                     "running (at ", Offset(clock_.Now()),
                     "); it cannot drive the engine re-entrantly and the condition does not hold "
                     "yet"));
  }
  while (driving_) {
    driver_cv_.wait(lock);
    if (done()) return absl::OkStatus();
  }
  ++host_blocking_runs_;
  driving_ = true;
  driver_.store(std::this_thread::get_id(), std::memory_order_release);
  absl::Status result = Loop(lock, done, deadline, report_stalls, what);
  driver_.store(std::thread::id(), std::memory_order_release);
  driving_ = false;
  std::vector<absl::AnyInvocable<void()>> trash;
  trash.swap(trash_);
  lock.unlock();
  driver_cv_.notify_all();
  return result;
}

absl::Status VirtualTimeline::Impl::Loop(Lock& lock, absl::FunctionRef<bool()> done,
                                         absl::Time deadline, bool report_stalls,
                                         absl::FunctionRef<std::string()> what) {
  while (!done()) {
    if (!trash_.empty()) {
      std::vector<absl::AnyInvocable<void()>> trash;
      trash.swap(trash_);
      lock.unlock();
      trash.clear();
      lock.lock();
      continue;  // the destructors may have changed what done() sees
    }
    if (queue_.empty() || (report_stalls && progress_pending_ == 0)) {
      if (!report_stalls) return absl::OkStatus();
      return StallError(lock, what);
    }
    auto it = queue_.begin();
    const absl::Time at = it->first.first;
    if (at > deadline) {
      SetNow(deadline);
      return absl::DeadlineExceededError(
          absl::StrCat(what(), ": timed out at the virtual deadline ", Offset(deadline),
                       " (next event at ", Offset(at), ")"));
    }
    Timed timed = std::move(it->second);
    queue_.erase(it);
    if (timed.progress) --progress_pending_;
    SetNow(at);
    ++steps_;
    Process(timed, lock);
  }
  return absl::OkStatus();
}

void VirtualTimeline::Impl::Process(Timed& timed, Lock& lock) {
  const std::shared_ptr<VStream>& s = timed.stream;
  switch (timed.type) {
    case Timed::kAdvance:
      if (!s->dead && s->state == VStream::State::kScheduled) Pump(s, lock);
      return;
    case Timed::kOpEnd:
      if (s->dead || s->state != VStream::State::kBusy || s->token != timed.token) return;
      EndOp(s, timed.has_status ? std::move(timed.status) : s->running.result, lock);
      return;
    case Timed::kWaitTimeout: {
      if (s->dead || s->state != VStream::State::kBlocked || s->token != timed.token) return;
      VCapture& capture = *s->blocked_on;
      capture.waiters.erase(std::remove(capture.waiters.begin(), capture.waiters.end(), s),
                            capture.waiters.end());
      Unblock(s,
              absl::DeadlineExceededError(absl::StrCat(
                  "stream '", s->name, "' (wait_timeout ", absl::FormatDuration(s->wait_timeout),
                  "): timed out waiting for an event recorded on stream '", capture.stream_name,
                  "' (virtual time ", Offset(clock_.Now()), ")")),
              /*timed_out=*/true);
      Pump(s, lock);
      return;
    }
    case Timed::kCallback: {
      absl::AnyInvocable<void()&&> callback = std::move(timed.callback);
      lock.unlock();
      std::move(callback)();
      callback = nullptr;
      lock.lock();
      return;
    }
  }
}

void VirtualTimeline::Impl::Pump(const std::shared_ptr<VStream>& sp, Lock& lock) {
  VStream& s = *sp;
  while (!s.dead && s.state == VStream::State::kScheduled) {
    if (s.queue.empty()) {
      s.state = VStream::State::kIdle;
      return;
    }
    Item item = std::move(s.queue.front());
    s.queue.pop_front();
    const absl::Status poison = s.status;
    const absl::Time now = clock_.Now();
    switch (item.kind) {
      case Item::kRecord:
        CompleteCapture(*item.capture, poison, lock);
        ++s.finished;
        break;

      case Item::kWait: {
        VCapture& capture = *item.capture;
        if (!poison.ok() || (capture.done && capture.status.ok())) {
          ++s.finished;
          break;
        }
        if (capture.done) {  // failed: the failure travels along the wait, in stream order
          s.status = capture.status;
          ++s.finished;
          break;
        }
        s.state = VStream::State::kBlocked;
        s.blocked_on = item.capture;
        s.blocked_since = now;
        ++s.token;
        capture.waiters.push_back(sp);
        Timed timeout;
        timeout.type = Timed::kWaitTimeout;
        timeout.progress = false;
        timeout.stream = sp;
        timeout.token = s.token;
        s.timeout_key = Schedule(now + s.wait_timeout, std::move(timeout));
        break;
      }

      case Item::kOp: {
        if (!poison.ok()) {
          lock.unlock();
          if (item.op.cancel != nullptr) std::move(item.op.cancel)(poison);
          item.op = StreamOp();
          lock.lock();
          ++s.finished;
          break;
        }
        const absl::Duration duration = OpDuration(item.op);
        const bool shared = SharesHost(s, item.op) && duration > absl::ZeroDuration();
        const uint64_t token = ++s.token;
        s.state = VStream::State::kBusy;
        // A shared op ends through FinishAsync, as an async op does.
        s.running = VStream::Running{item.op.name, item.op.kind,     item.op.bytes, item.op.flops,
                                     now,          absl::OkStatus(), shared,        nullptr};
        absl::Status result;
        lock.unlock();
        if (options_.run_ops && item.op.run != nullptr) result = std::move(item.op.run)();
        item.op = StreamOp();
        if (shared) {
          sharing_->Start({{VirtualSharing::Host(s.host), 1.0}}, absl::ToDoubleSeconds(duration),
                          [impl = weak_from_this(), stream = std::weak_ptr<VStream>(sp), token,
                           result = std::move(result)]() mutable {
                            if (std::shared_ptr<Impl> self = impl.lock()) {
                              const absl::Time end = self->Now();
                              self->FinishAsync(stream, token, std::move(result), end);
                            }
                          });
          lock.lock();
          break;
        }
        lock.lock();
        if (s.dead || s.token != token) break;
        s.running.result = std::move(result);
        Timed end;
        end.type = Timed::kOpEnd;
        end.stream = sp;
        end.token = token;
        Schedule(now + duration, std::move(end));
        break;
      }

      case Item::kAsync: {
        if (!poison.ok()) {
          lock.unlock();
          if (item.async.cancel != nullptr) std::move(item.async.cancel)(poison);
          item.async = VirtualAsyncOp();
          lock.lock();
          ++s.finished;
          break;
        }
        const uint64_t token = ++s.token;
        s.state = VStream::State::kBusy;
        s.running = VStream::Running{item.async.name,
                                     item.async.kind,
                                     item.async.bytes,
                                     0,
                                     now,
                                     absl::OkStatus(),
                                     true,
                                     std::move(item.async.describe)};
        VirtualAsyncDone done = [impl = weak_from_this(), stream = std::weak_ptr<VStream>(sp),
                                 token](absl::Status status, absl::Time end) mutable {
          if (std::shared_ptr<Impl> self = impl.lock()) {
            self->FinishAsync(stream, token, std::move(status), end);
          }
        };
        lock.unlock();
        std::move(item.async.start)(now, std::move(done));
        item.async = VirtualAsyncOp();
        lock.lock();
        break;
      }
    }
  }
}

void VirtualTimeline::Impl::EndOp(const std::shared_ptr<VStream>& sp, absl::Status result,
                                  Lock& lock) {
  VStream& s = *sp;
  if (s.tracer.enabled()) {
    StreamOp span;
    span.name = s.running.name;
    span.kind = s.running.kind;
    span.bytes = s.running.bytes;
    span.flops = s.running.flops;
    span.run = [&result]() { return result; };
    s.tracer.RunOp(span, SpanClock(s.running.start, clock_.Now())).IgnoreError();
  }
  if (!result.ok() && s.status.ok())
    s.status = Annotate(result, absl::StrCat("stream '", s.name, "'"));
  ++s.finished;
  Discard(std::move(s.running.describe));
  s.running = VStream::Running();
  s.state = VStream::State::kScheduled;
  Pump(sp, lock);
}

void VirtualTimeline::Impl::Unblock(const std::shared_ptr<VStream>& sp, absl::Status status,
                                    bool timed_out) {
  VStream& s = *sp;
  if (!timed_out) {
    if (auto it = queue_.find(s.timeout_key); it != queue_.end()) {
      if (it->second.progress) --progress_pending_;
      queue_.erase(it);
    }
  }
  s.tracer
      .RunWait(s.blocked_on->stream_name, SpanClock(s.blocked_since, clock_.Now()),
               [&status]() { return status; })
      .IgnoreError();  // the span records it; the outcome is applied below
  if (!status.ok() && s.status.ok()) s.status = std::move(status);
  ++s.finished;
  s.blocked_on = nullptr;
  s.state = VStream::State::kScheduled;
}

void VirtualTimeline::Impl::CompleteCapture(VCapture& c, absl::Status status, Lock& lock) {
  if (c.done || c.completing) return;
  c.completing = true;
  c.completed_at = clock_.Now();
  c.status = std::move(status);
  // The callbacks run before the capture reports done (as a host event's): whoever sees it done
  // also sees their effects. One registered meanwhile joins the next round.
  while (!c.callbacks.empty()) {
    std::vector<EventCallback> callbacks;
    callbacks.swap(c.callbacks);
    const absl::Status outcome = c.status;
    lock.unlock();
    for (EventCallback& callback : callbacks) std::move(callback)(outcome);
    callbacks.clear();
    lock.lock();
  }
  c.done = true;
  std::vector<std::shared_ptr<VStream>> waiters;
  waiters.swap(c.waiters);
  for (const std::shared_ptr<VStream>& w : waiters) {
    if (w->dead || w->state != VStream::State::kBlocked || w->blocked_on.get() != &c) continue;
    Unblock(w, c.status, /*timed_out=*/false);
    Timed advance;
    advance.type = Timed::kAdvance;
    advance.stream = w;
    Schedule(clock_.Now(), std::move(advance));
  }
}

bool VirtualTimeline::Impl::HasUnfinishedWork() const {
  for (const auto& [id, s] : streams_) {
    if (s->finished < s->enqueued) return true;
  }
  return false;
}

absl::Status VirtualTimeline::Impl::StallError(Lock& lock, absl::FunctionRef<std::string()> what) {
  struct Blocked {
    std::string prefix;
    std::function<std::string()> describe;
    std::string fallback;
  };
  std::vector<Blocked> blocked;
  for (const auto& [id, s] : streams_) {
    if (s->state == VStream::State::kBlocked) {
      blocked.push_back(
          {absl::StrCat("stream '", s->name, "' waits for an event recorded on stream '",
                        s->blocked_on->stream_name, "'"),
           nullptr, ""});
    } else if (s->state == VStream::State::kBusy && s->running.async) {
      blocked.push_back({absl::StrCat("stream '", s->name, "' waits for "), s->running.describe,
                         absl::StrCat("its op '", s->running.name, "' to complete")});
    }
  }
  const absl::Time now = clock_.Now();
  lock.unlock();
  std::vector<std::string> parts;
  for (Blocked& b : blocked) {
    if (b.describe == nullptr && b.fallback.empty()) {
      parts.push_back(std::move(b.prefix));
    } else {
      parts.push_back(absl::StrCat(b.prefix, b.describe != nullptr ? b.describe() : b.fallback));
    }
  }
  blocked.clear();
  std::string message =
      absl::StrCat(what(), ": virtual time stalled at ", Offset(now), ": ",
                   parts.empty() ? std::string("no stream is blocked, but the condition cannot "
                                               "be reached")
                                 : absl::StrJoin(parts, "; "));
  lock.lock();
  return absl::FailedPreconditionError(std::move(message));
}

absl::Status VirtualTimeline::Impl::RunUntilIdle() {
  SL_RETURN_IF_ERROR(Drive([&] { return progress_pending_ == 0; }, absl::InfiniteFuture(),
                           /*report_stalls=*/false,
                           [] { return std::string("VirtualTimeline::RunUntilIdle"); }));
  Lock lock(mu_);
  if (!HasUnfinishedWork()) return absl::OkStatus();
  return StallError(lock, [] { return std::string("VirtualTimeline::RunUntilIdle"); });
}

absl::Status VirtualTimeline::Impl::RunUntil(absl::Time t) {
  SL_RETURN_IF_ERROR(
      Drive([&] { return queue_.empty() || queue_.begin()->first.first > t; },
            absl::InfiniteFuture(), /*report_stalls=*/false,
            [&] { return absl::StrCat("VirtualTimeline::RunUntil(", Offset(t), ")"); }));
  Lock lock(mu_);
  SetNow(t);
  return absl::OkStatus();
}

// ---- streams -----------------------------------------------------------------------------------

absl::Status VirtualTimeline::Impl::Push(const std::shared_ptr<VStream>& sp, Item item) {
  Lock lock(mu_);
  VStream& s = *sp;
  if (!s.status.ok()) {
    absl::Status status = s.status;
    if (item.kind == Item::kRecord) CompleteCapture(*item.capture, status, lock);
    lock.unlock();
    return status;  // `item` (the caller's closures) is destroyed without the lock
  }
  s.queue.push_back(std::move(item));
  ++s.enqueued;
  if (s.state == VStream::State::kIdle) {
    s.state = VStream::State::kScheduled;
    Timed advance;
    advance.type = Timed::kAdvance;
    advance.stream = sp;
    Schedule(clock_.Now(), std::move(advance));
  }
  return absl::OkStatus();
}

absl::Status VirtualTimeline::Impl::PushWait(const std::shared_ptr<VStream>& sp,
                                             std::shared_ptr<VCapture> capture) {
  {
    Lock lock(mu_);
    if (!sp->status.ok()) return sp->status;
    if (capture->done && capture->status.ok()) return absl::OkStatus();
  }
  Item item;
  item.kind = Item::kWait;
  item.capture = std::move(capture);
  return Push(sp, std::move(item));
}

absl::Status VirtualTimeline::Impl::Synchronize(const std::shared_ptr<VStream>& sp,
                                                absl::Time deadline) {
  uint64_t target;
  {
    Lock lock(mu_);
    target = sp->enqueued;
  }
  SL_RETURN_IF_ERROR(Drive([&] { return sp->finished >= target; }, deadline,
                           /*report_stalls=*/true,
                           [&] { return absl::StrCat("stream '", sp->name, "': Synchronize"); }));
  return StreamStatus(*sp);
}

void VirtualTimeline::Impl::DestroyStream(const std::shared_ptr<VStream>& sp) {
  VStream& s = *sp;
  bool pending;
  {
    Lock lock(mu_);
    pending = s.finished < s.enqueued;
  }
  // Let the queued work finish, as a host stream's destructor does, if that can happen here.
  if (pending && !OnDriverThread()) {
    absl::Status drained =
        Drive([&] { return s.finished >= s.enqueued; }, absl::InfiniteFuture(),
              /*report_stalls=*/true,
              [&] { return absl::StrCat("destroying virtual stream '", s.name, "'"); });
    if (!drained.ok()) SL_LOG(WARN, STREAM) << drained;
  }
  std::deque<Item> rest;
  {
    Lock lock(mu_);
    s.dead = true;
    rest.swap(s.queue);
    if (s.state == VStream::State::kBlocked) {
      std::vector<std::shared_ptr<VStream>>& waiters = s.blocked_on->waiters;
      waiters.erase(std::remove(waiters.begin(), waiters.end(), sp), waiters.end());
      if (auto it = queue_.find(s.timeout_key); it != queue_.end()) queue_.erase(it);
      s.blocked_on = nullptr;
    }
    streams_.erase(s.id);
    const absl::Status gone = absl::FailedPreconditionError(
        absl::StrCat("virtual stream '", s.name, "' was destroyed with this work pending (at ",
                     Offset(clock_.Now()), ")"));
    for (Item& item : rest) {
      if (item.kind == Item::kRecord) CompleteCapture(*item.capture, gone, lock);
    }
    lock.unlock();
    for (Item& item : rest) {
      if (item.kind == Item::kOp && item.op.cancel != nullptr) std::move(item.op.cancel)(gone);
      if (item.kind == Item::kAsync && item.async.cancel != nullptr) {
        std::move(item.async.cancel)(gone);
      }
    }
    rest.clear();
    lock.lock();
    Discard(std::move(s.running.describe));
    std::vector<absl::AnyInvocable<void()>> trash;
    if (!driving_) trash.swap(trash_);
    lock.unlock();
  }
}

// ---- captures ----------------------------------------------------------------------------------

void VirtualTimeline::Impl::OnComplete(VCapture& c, EventCallback callback) {
  absl::Status status;
  {
    Lock lock(mu_);
    if (!c.done) {
      c.callbacks.push_back(std::move(callback));
      return;
    }
    status = c.status;
  }
  std::move(callback)(std::move(status));
}

absl::Status VirtualTimeline::Impl::SynchronizeCapture(VCapture& c, absl::Time deadline) {
  SL_RETURN_IF_ERROR(Drive([&] { return c.done; }, deadline, /*report_stalls=*/true,
                           [&] {
                             return absl::StrCat(
                                 "Event::Synchronize (an event recorded on stream '", c.stream_name,
                                 "')");
                           }));
  Lock lock(mu_);
  return c.status;
}

// ---- async ops and timers ----------------------------------------------------------------------

void VirtualTimeline::Impl::FinishAsync(const std::weak_ptr<VStream>& weak, uint64_t token,
                                        absl::Status status, absl::Time end) {
  std::shared_ptr<VStream> sp = weak.lock();
  Lock lock(mu_);
  if (sp == nullptr || sp->dead || sp->state != VStream::State::kBusy || sp->token != token ||
      !sp->running.async) {
    return;
  }
  Timed timed;
  timed.type = Timed::kOpEnd;
  timed.stream = sp;
  timed.token = token;
  timed.has_status = true;
  timed.status = std::move(status);
  Schedule(std::max(end, sp->running.start), std::move(timed));
}

VirtualTimer VirtualTimeline::Impl::ScheduleCallback(absl::Time at,
                                                     absl::AnyInvocable<void() &&> callback,
                                                     bool progress) {
  Lock lock(mu_);
  Timed timed;
  timed.type = Timed::kCallback;
  timed.progress = progress;
  timed.callback = std::move(callback);
  const EventKey key = Schedule(at, std::move(timed));
  return VirtualTimer{key.first, key.second};
}

void VirtualTimeline::Impl::Cancel(const VirtualTimer& timer) {
  absl::AnyInvocable<void() &&> callback;
  {
    Lock lock(mu_);
    auto it = queue_.find(EventKey{timer.at, timer.seq});
    if (it == queue_.end() || it->second.type != Timed::kCallback) return;
    if (it->second.progress) --progress_pending_;
    callback = std::move(it->second.callback);
    queue_.erase(it);
  }
}

std::vector<std::string> VirtualTimeline::Impl::Shutdown() {
  std::map<EventKey, Timed> queue;
  std::vector<std::string> alive;
  {
    Lock lock(mu_);
    for (const auto& [id, s] : streams_) alive.push_back(s->name);
    queue.swap(queue_);
    progress_pending_ = 0;
  }
  return alive;
}

// ---- Stream and Event --------------------------------------------------------------------------

namespace {

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

// ---- VirtualTimeline ---------------------------------------------------------------------------

VirtualTimeline::VirtualTimeline() : VirtualTimeline(VirtualTimelineOptions()) {}

VirtualTimeline::VirtualTimeline(VirtualTimelineOptions options)
    : options_(std::move(options)),
      impl_(std::make_shared<Impl>(options_)),
      sharing_(std::make_shared<VirtualSharing>(
          *this, options_.host_cores > 0 ? options_.host_cores : 1.0)) {
  if (options_.host_cores > 0) impl_->SetSharing(sharing_.get());
}

absl::StatusOr<std::unique_ptr<VirtualTimeline>> VirtualTimeline::Create(
    VirtualTimelineOptions options) {
  const std::pair<const char*, double> rates[] = {
      {"copy_bytes_per_s", options.copy_bytes_per_s},
      {"cast_bytes_per_s", options.cast_bytes_per_s},
      {"reduce_bytes_per_s", options.reduce_bytes_per_s},
      {"fill_bytes_per_s", options.fill_bytes_per_s},
      {"collective_bytes_per_s", options.collective_bytes_per_s},
      {"compute_flops_per_s", options.compute_flops_per_s},
  };
  for (const auto& [name, rate] : rates) {
    if (!(rate > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("VirtualTimelineOptions.", name, " must be positive, got ", rate));
    }
  }
  if (!(options.host_cores >= 0) || std::isinf(options.host_cores)) {
    return absl::InvalidArgumentError(
        absl::StrCat("VirtualTimelineOptions.host_cores must be finite and not negative, got ",
                     options.host_cores));
  }
  if (options.op_overhead < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("VirtualTimelineOptions.op_overhead must not be negative, got ",
                     absl::FormatDuration(options.op_overhead)));
  }
  return std::unique_ptr<VirtualTimeline>(new VirtualTimeline(std::move(options)));
}

VirtualTimeline::~VirtualTimeline() {
  const std::vector<std::string> alive = impl_->Shutdown();
  SL_CHECK(alive.empty()) << "VirtualTimeline destroyed while " << alive.size()
                          << " of its streams are alive ('" << absl::StrJoin(alive, "', '")
                          << "'): destroy the streams first";
}

absl::Time VirtualTimeline::Now() const { return impl_->Now(); }

bool VirtualTimeline::WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                                absl::Time deadline, absl::FunctionRef<bool()> done) const {
  if (done()) return true;
  if (impl_->OnDriverThread()) return false;  // the clock cannot move while its driver waits
  return impl_->clock().WaitUntil(cv, lock, deadline, done);
}

absl::Duration VirtualTimeline::OpDuration(const StreamOp& op) const {
  return impl_->OpDuration(op);
}

absl::Status VirtualTimeline::RunUntilIdle() { return impl_->RunUntilIdle(); }
absl::Status VirtualTimeline::RunUntil(absl::Time t) { return impl_->RunUntil(t); }
int64_t VirtualTimeline::steps() const { return impl_->steps(); }
int64_t VirtualTimeline::host_blocking_runs() const { return impl_->host_blocking_runs(); }

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

VirtualTimer VirtualTimeline::ScheduleAt(absl::Time at, absl::AnyInvocable<void() &&> callback,
                                         bool progress) {
  return impl_->ScheduleCallback(at, std::move(callback), progress);
}

void VirtualTimeline::Cancel(const VirtualTimer& timer) { impl_->Cancel(timer); }

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
