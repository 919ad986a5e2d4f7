// File: tests/common/gate.h
// A one-shot gate for tests, and a stream work item that blocks on it. Not absl::Notification:
// the system's abseil is not built with ThreadSanitizer, which then cannot see the ordering it
// provides.

#ifndef SHARDLINE_TESTS_COMMON_GATE_H_
#define SHARDLINE_TESTS_COMMON_GATE_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/status/status.h"
#include "runtime/stream.h"

namespace shardline::testing {

class Gate {
 public:
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  // Bounded, so that a broken test fails instead of hanging.
  bool Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(20), [this] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// A work item that blocks until `gate` opens (bounded, so that a broken test cannot hang).
inline Stream::Work BlockOn(Gate& gate) {
  return [&gate] {
    gate.Wait();
    return absl::OkStatus();
  };
}

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_COMMON_GATE_H_
