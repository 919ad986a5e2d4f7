// The virtual-time engine (VirtualTimeline::Impl): a discrete-event engine driven by whichever
// thread blocks.
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
#include "runtime/internal/virtual_time_internal.h"
#include "runtime/logging.h"
#include "runtime/status.h"
#include "runtime/virtual_sharing.h"

namespace shardline {
namespace {

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

}  // namespace shardline
