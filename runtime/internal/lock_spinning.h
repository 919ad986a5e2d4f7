// File: runtime/internal/lock_spinning.h
// -----------------------------------------------------------------------------
// Internal to the runtime (not installed): a mutex lock that polls a little before it sleeps.

#ifndef SHARDLINE_RUNTIME_INTERNAL_LOCK_SPINNING_H_
#define SHARDLINE_RUNTIME_INTERNAL_LOCK_SPINNING_H_

#include <mutex>

namespace shardline::stream_internal {

// Locks `mu`, polling it a little first. The stream code's critical sections are a few dozen
// instructions, and the thread that finds one held is typically a worker popping while the
// submitter pushes (or the reverse): waiting that long in user space spares it a futex wait and
// the holder a futex wake, each a system call and the wake often a cross-CPU interrupt.
inline std::unique_lock<std::mutex> LockSpinning(std::mutex& mu) {
  for (int i = 0; i < 32; ++i) {
    if (mu.try_lock()) return std::unique_lock<std::mutex>(mu, std::adopt_lock);
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  return std::unique_lock<std::mutex>(mu);
}

}  // namespace shardline::stream_internal

#endif  // SHARDLINE_RUNTIME_INTERNAL_LOCK_SPINNING_H_
