#include "runtime/clock.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>

#include "absl/time/clock.h"
#include "runtime/check.h"
#include "runtime/internal/clock_internal.h"

namespace shardline {

int64_t WallNowNanos() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

absl::Time WallNow() { return absl::FromUnixNanos(WallNowNanos()); }

namespace {

std::atomic<clock_internal::BeforeBlockHook> before_block_hook{nullptr};

// The calling thread is about to block (holding `lock`): it must not hold back work it may be
// waiting for.
void BeforeBlock(std::unique_lock<std::mutex>& lock) {
  if (clock_internal::BeforeBlockHook hook = before_block_hook.load(std::memory_order_acquire)) {
    hook(lock);
  }
}

class WallClockImpl final : public Clock {
 public:
  absl::Time Now() const override { return WallNow(); }
  bool WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                 absl::Time deadline, absl::FunctionRef<bool()> done) const override {
    BeforeBlock(lock);
    if (deadline == absl::InfiniteFuture()) {
      cv.wait(lock, [&] { return done(); });
      return true;
    }
    return cv.wait_until(lock, absl::ToChronoTime(deadline), [&] { return done(); });
  }
  std::string name() const override { return "wall"; }
};

}  // namespace

namespace clock_internal {
void SetBeforeBlockHook(BeforeBlockHook hook) {
  before_block_hook.store(hook, std::memory_order_release);
}
}  // namespace clock_internal

const Clock& WallClock() {
  static const WallClockImpl* const clock = new WallClockImpl();
  return *clock;
}

absl::Time ManualClock::Now() const {
  std::lock_guard<std::mutex> lock(mu_);
  return now_;
}

bool ManualClock::WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                            absl::Time deadline, absl::FunctionRef<bool()> done) const {
  BeforeBlock(lock);
  if (deadline == absl::InfiniteFuture()) {
    cv.wait(lock, [&] { return done(); });
    return true;
  }
  // Advance() notifies `cv` without holding the waiter's mutex (it cannot take it safely: the
  // waiter holds it while registering here), so a notification can fall between the waiter's
  // check and its wait. The short wall-clock re-check bounds how late such a waiter wakes.
  constexpr auto kRecheck = std::chrono::milliseconds(2);
  while (!done()) {
    {
      std::lock_guard<std::mutex> clock_lock(mu_);
      if (now_ >= deadline) return false;
      waiting_.push_back(&cv);
    }
    cv.wait_for(lock, kRecheck);
    std::lock_guard<std::mutex> clock_lock(mu_);
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), &cv));
  }
  return true;
}

void ManualClock::Advance(absl::Duration d) {
  SL_CHECK(d >= absl::ZeroDuration())
      << "ManualClock::Advance: negative duration " << absl::FormatDuration(d);
  std::lock_guard<std::mutex> lock(mu_);
  now_ += d;
  for (std::condition_variable* cv : waiting_) cv->notify_all();
}

void ManualClock::Set(absl::Time t) {
  std::lock_guard<std::mutex> lock(mu_);
  now_ = std::max(now_, t);
  for (std::condition_variable* cv : waiting_) cv->notify_all();
}

int ManualClock::waiters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(waiting_.size());
}

}  // namespace shardline
