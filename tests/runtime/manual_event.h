// File: tests/runtime/manual_event.h
// -----------------------------------------------------------------------------
// An Event whose completion the test controls (Complete(), Fail()), for deterministic tests of
// code that polls events (allocators, pools). Query() never blocks; Synchronize() waits for
// Complete()/Fail() or the deadline. std::mutex, not absl::Mutex: Debian's abseil is not built
// with ThreadSanitizer, so TSan cannot see absl::Mutex's happens-before edges.

#ifndef SHARDLINE_TESTS_RUNTIME_MANUAL_EVENT_H_
#define SHARDLINE_TESTS_RUNTIME_MANUAL_EVENT_H_

#include <condition_variable>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
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
    std::lock_guard<std::mutex> lock(mu_);
    ++queries_;
    if (!status_.ok()) return status_;
    return done_;
  }
  absl::Status Synchronize(absl::Time deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, absl::ToChronoTime(deadline),
                        [this] { return done_ || !status_.ok(); })) {
      return absl::DeadlineExceededError("ManualEvent not completed");
    }
    return status_;
  }

  void Complete() {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    cv_.notify_all();
  }
  void Fail(absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = std::move(status);
    cv_.notify_all();
  }
  int queries() const {
    std::lock_guard<std::mutex> lock(mu_);
    return queries_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  absl::Status status_;
  int queries_ = 0;
};

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_RUNTIME_MANUAL_EVENT_H_
