#include "collectives/ucx/internal/ucx_transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collectives/communicator.h"
#include "runtime/logging.h"
#include "runtime/stream.h"

namespace shardline::ucx_internal {

bool UcxTransport::Progress() {
  bool activity = false;
  for (int i = 0; i < 64 && ucp_worker_progress(worker_) != 0; ++i) activity = true;

  std::vector<absl::Status> notices;
  std::vector<absl::Status> reports;
  // Both checks look at an atomic first: a poll that finds nothing (the usual case while a
  // collective waits) takes no lock.
  if (control_.done.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(control_mu_);
    while (control_posted_ && control_.done.load(std::memory_order_acquire)) {
      activity = true;
      HandleControl(control_, &notices);
      PostControlRecv();
    }
  }
  if (failures_pending_.load(std::memory_order_acquire) &&
      failures_pending_.exchange(false, std::memory_order_acq_rel)) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Failure& f : failures_) {
      Peer& peer = peers_[f.peer];
      if (peer.failed) continue;
      peer.failed = true;
      if (peer.departed) {
        SL_LOG(INFO, COLL) << "ucx communicator " << name_ << " rank " << rank_ << ": peer rank "
                           << f.peer << " closed its endpoint";
        continue;
      }
      reports.push_back(
          MarkPeerError(absl::UnavailableError(absl::StrCat(
                            "peer rank ", f.peer, " unreachable (ucx: ", UcxError(f.status), ")")),
                        absl::StrCat(f.peer)));
    }
    failures_.clear();
  }
  for (const absl::Status& s : notices) Report(s, /*forward=*/false);
  for (const absl::Status& s : reports) Report(s, /*forward=*/true);
  return activity || !reports.empty() || !notices.empty();
}

bool UcxTransport::Sleep(absl::Time until) {
  if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) return true;
  const int64_t ms = std::clamp<int64_t>(
      absl::ToInt64Milliseconds(until - absl::Now() + absl::Microseconds(999)), 0, 200);
  pollfd fd{efd_, POLLIN, 0};
  return poll(&fd, 1, static_cast<int>(ms)) != 0 || ms == 0;
}

namespace {
std::atomic<uint64_t> collective_sleeps_run_out{0};
}  // namespace

uint64_t CollectiveSleepsRunOut() {
  return collective_sleeps_run_out.load(std::memory_order_relaxed);
}

void CountCollectiveSleepRunOut() {
  collective_sleeps_run_out.fetch_add(1, std::memory_order_relaxed);
}

namespace {

// Whether more threads were runnable on this host than `cpus` when last looked at (the first
// number of /proc/loadavg's "runnable/total", which counts the caller), looked at again at most
// every 10 ms. Half of the auto yield rule: a busy host is a reason to yield only where a thread
// of this process may take the core (YieldIfOversubscribed).
bool HostBusy(int cpus, absl::Time at) {
  static std::atomic<int64_t> next_look_ns{0};
  static std::atomic<bool> busy{false};
  const int64_t now = absl::ToUnixNanos(at);
  if (now < next_look_ns.load(std::memory_order_relaxed)) {
    return busy.load(std::memory_order_relaxed);
  }
  next_look_ns.store(now + 10'000'000, std::memory_order_relaxed);
  const int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char text[128];
  const ssize_t n = read(fd, text, sizeof(text) - 1);
  close(fd);
  if (n <= 0) return false;
  text[n] = '\0';
  // "0.52 0.58 0.59 3/517 12345": the fourth field's numerator.
  const char* field = text;
  for (int spaces = 0; spaces < 3 && field != nullptr; ++spaces) {
    field = std::strchr(field, ' ');
    if (field != nullptr) ++field;
  }
  const bool now_busy = field != nullptr && std::atoi(field) > cpus;
  busy.store(now_busy, std::memory_order_relaxed);
  return now_busy;
}

}  // namespace

void UcxTransport::YieldIfOversubscribed(absl::Time now, absl::Duration idle,
                                         bool mates_pending) const {
  // How long a wait on a busy host spins without yielding when no thread of this process wants
  // the core: a peer that takes longer may be one of the runnable threads (ranks of another
  // communicator or another test host on this machine, which `oversubscribed_` does not count).
  constexpr absl::Duration kBusyHostPatience = absl::Microseconds(50);
  switch (yield_) {
    case YieldPolicy::kNever:
      return;
    case YieldPolicy::kAlways:
      sched_yield();
      return;
    case YieldPolicy::kAuto:
      // A busy host alone is no reason at once: yielding to another process's busy thread
      // gives it a whole time slice while the peer waits (an 8 KiB 2-rank collective beside four
      // busy loops took 0.4-1.9 ms per call that way, 8-35 us without; docs/benchmarks.md). A
      // thread of this process that may want the core (another host stream's worker) is, and
      // so is a wait that has stalled for a while.
      if ((oversubscribed_ && mates_pending) ||
          (HostBusy(cpus_, now) &&
           (OtherAwakeHostStreamWorkers() > 0 || idle >= kBusyHostPatience))) {
        sched_yield();
      }
      return;
  }
}

void UcxTransport::Wake() {
  if (worker_ != nullptr) ucp_worker_signal(worker_);
}

void UcxTransport::BeginCollective() {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(idle_mu_);
    ++active_;
    wake = polling_;
  }
  // Only a progress thread asleep on the event fd must be told; one waiting out the grace
  // period (the usual case between back-to-back collectives) sees active_ when it next looks.
  if (wake) Wake();
}

void UcxTransport::EndCollective() {
  // No notify: waking the progress thread after every collective (and again at the next one)
  // costs two context switches per collective, which dominates small-message latency on a
  // loaded host. It takes over once no collective ran for kIdleGrace.
  std::lock_guard<std::mutex> lock(idle_mu_);
  if (--active_ == 0) last_end_ = absl::Now();
}

void UcxTransport::SetPendingWork(std::function<bool()> pending) {
  std::lock_guard<std::mutex> lock(pending_mu_);
  pending_work_ = std::move(pending);
}

void UcxTransport::Urge() {
  {
    std::lock_guard<std::mutex> lock(idle_mu_);
    ++urges_;
    if (urged_) return;
    urged_ = true;
  }
  idle_cv_.notify_all();
}

void UcxTransport::ProgressThread() {
  // How long after the last collective the progress thread takes over polling the worker.
  constexpr absl::Duration kIdleGrace = absl::Milliseconds(20);
  std::unique_lock<std::mutex> lock(idle_mu_);
  while (!stop_) {
    const absl::Time now = absl::Now();
    if (active_ > 0 || (now < last_end_ + kIdleGrace && !urged_)) {
      const absl::Time until = active_ > 0 ? now + kIdleGrace : last_end_ + kIdleGrace;
      idle_cv_.wait_until(lock, absl::ToChronoTime(until));
      continue;
    }
    polling_ = true;
    const bool urged = urged_;
    const uint64_t urges = urges_;
    lock.unlock();
    Progress();
    bool still_urged = false;
    if (urged) {
      std::lock_guard<std::mutex> pending_lock(pending_mu_);
      still_urged = pending_work_ != nullptr && pending_work_();
    }
    // Urged: the worker's events (the receiver's reads, their completions) wake the sleep.
    Sleep(absl::Now() + (still_urged ? absl::Milliseconds(5) : absl::Seconds(1)));
    lock.lock();
    polling_ = false;
    // An Urge() since the question was asked may be for work the answer did not see.
    if (urged && !still_urged && urges_ == urges) urged_ = false;
  }
}

}  // namespace shardline::ucx_internal
