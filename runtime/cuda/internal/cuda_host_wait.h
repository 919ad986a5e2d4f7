// File: runtime/cuda/internal/cuda_host_wait.h
// -----------------------------------------------------------------------------
// Internal to runtime/cuda/ (not installed): what a CUDA stream needs to wait for a host event on
// the device, instead of in a host function that blocks CUDA's host-callback thread.
//
//   HostFlag        a 32-bit word of pinned, device-mapped host memory, from a process-wide pool
//                   (pages are allocated once and kept; a wait costs no cudaHostAlloc). A stream
//                   waits until the word reaches the flag's target (cuStreamWaitValue32, cyclic
//                   >=); the host releases it by storing the target. A word only counts up, so it
//                   returns to the pool the moment it is signalled: a later wait on it has a higher
//                   target, and a wait the device has not evaluated yet is already satisfied.
//   cuStreamWaitValue32 is reached through cudaGetDriverEntryPoint rather than by linking
//                   libcuda: a binary linked against libcuda does not even load on a machine
//                   without the NVIDIA driver, where the CPU-only parts must still run.
//   Watchdog        one process-wide thread that runs a callback at a wall-clock deadline unless
//                   the callback was cancelled first (a device wait has no timeout of its own).
//
// CUDA builds only. Thread safety: every function may be called from any thread.

#ifndef SHARDLINE_RUNTIME_CUDA_INTERNAL_CUDA_HOST_WAIT_H_
#define SHARDLINE_RUNTIME_CUDA_INTERNAL_CUDA_HOST_WAIT_H_

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardline::cuda_internal {

// One wait's word and the value that releases it.
struct HostFlag {
  std::atomic<uint32_t>* word = nullptr;
  uint32_t target = 0;
};

// A word of the pool and a target above its current value. Allocates a page of pinned,
// device-mapped memory when the pool is empty (ResourceExhausted/Internal if CUDA cannot).
absl::StatusOr<HostFlag> AcquireHostFlag();

// Stores flag.target (releasing every device wait on it) and returns the word to the pool. Pure
// host code that never blocks: safe in an event callback.
void SignalHostFlag(const HostFlag& flag);

// Returns a word on which no wait was enqueued, without signalling it.
void ReturnHostFlag(const HostFlag& flag);

// Whether streams of `device` can wait on host flags: the driver provides cuStreamWaitValue32
// and the device can map host memory. (A platform may still refuse stream memory operations at
// the call: EnqueueHostFlagWait then says Unimplemented.)
bool DeviceWaitsAvailable(int device);

// Enqueues on `stream` a wait until *flag.word >= flag.target (cyclic). The stream's device must
// be current (a legacy default stream is resolved through it). Unimplemented if the platform
// does not support stream memory operations; Internal for any other driver error.
absl::Status EnqueueHostFlagWait(cudaStream_t stream, const HostFlag& flag);

// Runs `on_expiry` on the watchdog thread once the wall clock reaches `deadline`, unless
// CancelWatchdog(id) came first. It must be short and must not call CUDA. Returns the id.
uint64_t ArmWatchdog(absl::Time deadline, absl::AnyInvocable<void() &&> on_expiry);

// Drops the callback of `id` if it has not started (no effect otherwise). Never blocks on a
// running callback, so a callback may cancel itself.
void CancelWatchdog(uint64_t id);

}  // namespace shardline::cuda_internal

#endif  // SHARDLINE_RUNTIME_CUDA_INTERNAL_CUDA_HOST_WAIT_H_
