// File: tests/runtime/manual_event.h
// -----------------------------------------------------------------------------
// An Event whose completion the test controls (Complete(), Fail()), for deterministic tests of
// code that polls events (allocators, pools), and a foreign kind of event for the open event
// protocol: streams wait for it through OnComplete(), whose callbacks Complete()/Fail() run.
// Query() never blocks; Synchronize() waits for Complete()/Fail() or the deadline. std::mutex, not
// absl::Mutex: Debian's abseil is not built with ThreadSanitizer, so TSan cannot see absl::Mutex's
// happens-before edges.

#ifndef SHARDLINE_TESTS_RUNTIME_MANUAL_EVENT_H_
#define SHARDLINE_TESTS_RUNTIME_MANUAL_EVENT_H_

#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

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

  void OnComplete(EventCallback callback) override {
    absl::Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!done_ && status_.ok()) {
        callbacks_.push_back(std::move(callback));
        return;
      }
      status = status_;
    }
    std::move(callback)(status);
  }

  void Complete() { Finish(absl::OkStatus()); }
  void Fail(absl::Status status) { Finish(std::move(status)); }
  int queries() const {
    std::lock_guard<std::mutex> lock(mu_);
    return queries_;
  }

 private:
  void Finish(absl::Status status) {
    std::vector<EventCallback> callbacks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (status.ok()) {
        done_ = true;
      } else {
        status_ = status;
      }
      callbacks.swap(callbacks_);
      cv_.notify_all();
    }
    for (EventCallback& callback : callbacks) std::move(callback)(status);
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  absl::Status status_;
  int queries_ = 0;
  std::vector<EventCallback> callbacks_;
};

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_RUNTIME_MANUAL_EVENT_H_
