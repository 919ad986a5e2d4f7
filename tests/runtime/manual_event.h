// File: tests/runtime/manual_event.h
// -----------------------------------------------------------------------------
// An Event whose completion the test controls (Complete(), Fail()), for deterministic tests of
// code that polls events (allocators, pools). Query() never blocks; Synchronize() waits for
// Complete()/Fail() or the deadline.

#ifndef SHARDLINE_TESTS_RUNTIME_MANUAL_EVENT_H_
#define SHARDLINE_TESTS_RUNTIME_MANUAL_EVENT_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "runtime/stream.h"

namespace shardline::testing {

class ManualEvent : public Event {
 public:
  static std::shared_ptr<ManualEvent> Create() { return std::make_shared<ManualEvent>(); }

  Device device() const override { return Device::Host(); }
  absl::Status Record(Stream&) override {
    return absl::UnimplementedError("ManualEvent cannot be recorded");
  }
  absl::StatusOr<bool> Query() override {
    absl::MutexLock lock(&mu_);
    ++queries_;
    if (!status_.ok()) return status_;
    return done_;
  }
  absl::Status Synchronize(absl::Time deadline) override {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithDeadline(absl::Condition(&Ready, this), deadline)) {
      return absl::DeadlineExceededError("ManualEvent not completed");
    }
    return status_;
  }

  void Complete() {
    absl::MutexLock lock(&mu_);
    done_ = true;
  }
  void Fail(absl::Status status) {
    absl::MutexLock lock(&mu_);
    status_ = std::move(status);
  }
  int queries() const {
    absl::MutexLock lock(&mu_);
    return queries_;
  }

 private:
  static bool Ready(ManualEvent* e) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return e->done_ || !e->status_.ok();
  }

  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  int queries_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_RUNTIME_MANUAL_EVENT_H_
