// File: runtime/cuda/cuda_util.h
// -----------------------------------------------------------------------------
// Small helpers shared by the CUDA code of every layer (streams, allocators, the NCCL backend).
// CUDA builds only.

#ifndef SHARDLINE_RUNTIME_CUDA_CUDA_UTIL_H_
#define SHARDLINE_RUNTIME_CUDA_CUDA_UTIL_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/stream.h"

namespace shardline {

// Polling a device for completion (cudaEventQuery, ncclCommGetAsyncError): yields a few times,
// then sleeps 1 us, 2 us, ... up to 1 ms, so a short wait costs little latency and a long one
// little CPU. The caller bounds the loop with its deadline. The first pause wakes the host-stream
// workers the thread holds back (HostStreamWakeBatch): what is polled for may wait on them.
class PollBackoff {
 public:
  void Pause() {
    if (spins_ == 0) HostStreamWakeBatch::WakeHeld();
    if (spins_ < 16) {
      ++spins_;
      std::this_thread::yield();
      return;
    }
    absl::SleepFor(sleep_);
    sleep_ = std::min(sleep_ * 2, absl::Milliseconds(1));
  }

 private:
  int spins_ = 0;
  absl::Duration sleep_ = absl::Microseconds(1);
};

// Makes a device current for the guard's lifetime (creating streams, events and communicators
// needs it) and restores the previous one.
class CudaDeviceGuard {
 public:
  CudaDeviceGuard() = default;
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;
  ~CudaDeviceGuard() {
    if (restore_ >= 0) (void)cudaSetDevice(restore_);
  }

  absl::Status Set(int device) {
    int current = 0;
    SL_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
    if (current != device) {
      SL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
      restore_ = current;
    }
    return absl::OkStatus();
  }

 private:
  int restore_ = -1;
};

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_CUDA_CUDA_UTIL_H_
