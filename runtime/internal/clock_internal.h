// File: runtime/internal/clock_internal.h
// -----------------------------------------------------------------------------
// Internal to runtime/clock.cc and the streams that hook into its waits. Not part of the public
// API (not installed).
//
// A thread about to block in a clock's WaitUntil must first release what it holds back that the
// awaited work may need: the host streams' HostStreamWakeBatch holds back wake-ups of their
// workers. The clock does not know about host streams; they install a hook instead.

#ifndef SHARDLINE_RUNTIME_INTERNAL_CLOCK_INTERNAL_H_
#define SHARDLINE_RUNTIME_INTERNAL_CLOCK_INTERNAL_H_

#include <mutex>

namespace shardline::clock_internal {

// Runs on the calling thread at the start of every WaitUntil of the built-in clocks (WallClock,
// ManualClock), before the thread blocks, with the WaitUntil's `lock` held. A hook that takes
// other locks releases `lock` meanwhile (the waiter may hold the very lock the hook needs) and
// takes it again before it returns; WaitUntil checks `done` after it.
using BeforeBlockHook = void (*)(std::unique_lock<std::mutex>& lock);

// Installs `hook` for every later WaitUntil on any thread; null removes it. runtime/host_stream.cc
// installs stream_internal::WakeHeldWorkersBeforeBlock before the first host stream exists.
void SetBeforeBlockHook(BeforeBlockHook hook);

}  // namespace shardline::clock_internal

#endif  // SHARDLINE_RUNTIME_INTERNAL_CLOCK_INTERNAL_H_
