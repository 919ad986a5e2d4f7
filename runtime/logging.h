// File: runtime/logging.h
// -----------------------------------------------------------------------------
// Leveled, per-subsystem logging in NCCL's grammar, so that users already know it:
//
//   SHARDLINE_DEBUG=VERSION|WARN|INFO|TRACE   (default: WARN; unset or NONE: warnings only)
//   SHARDLINE_DEBUG_SUBSYS=INIT,COLL,...       (default INIT,ENV; "ALL"; a leading ^ excludes)
//   SHARDLINE_DEBUG_FILE=/tmp/sl.%h.%p.log     (%h hostname, %p pid; default stderr)
//
// Subsystems: INIT, ENV, STREAM, ALLOC, COLL, STORE, NET, SCHED, BENCH.
// Every line reads "host:pid:tid [rank] shardline LEVEL SUBSYS message". WARN lines are
// printed regardless of SUBSYS (as NCCL does); INFO and TRACE lines only for enabled subsystems.
//
//   SL_LOG(WARN, STORE) << "dropping connection from " << peer << ": " << status;
//   if (SL_LOG_ENABLED(TRACE, COLL)) { ...expensive formatting... }
//
// Log once, where an error starts: the site that builds a Status does not also log it unless the
// error is swallowed there (a connection dropped by a server that keeps serving, say).

#ifndef SHARDLINE_RUNTIME_LOGGING_H_
#define SHARDLINE_RUNTIME_LOGGING_H_

#include <cstdint>
#include <mutex>
#include <sstream>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace shardline {

enum class LogLevel : int { kNone = 0, kVersion = 1, kWarn = 2, kInfo = 3, kTrace = 4 };

enum LogSubsys : uint32_t {
  kLogInit = 1u << 0,
  kLogEnv = 1u << 1,
  kLogStream = 1u << 2,
  kLogAlloc = 1u << 3,
  kLogColl = 1u << 4,
  kLogStore = 1u << 5,
  kLogNet = 1u << 6,
  kLogSched = 1u << 7,
  kLogBench = 1u << 8,
  kLogAll = ~0u,
};

// Parsers for the environment values (exposed for tests and for --debug flags of tools).
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view text);
absl::StatusOr<uint32_t> ParseLogSubsys(absl::string_view text);
// Expands %h (hostname) and %p (pid) in a SHARDLINE_DEBUG_FILE pattern; %% is a literal %.
std::string ExpandDebugFilePattern(absl::string_view pattern);

// True if a message at `level` for `subsys` would be written.
bool LogEnabled(LogLevel level, uint32_t subsys);

// The rank printed in every line once known (collectives set it at init); -1 prints no rank.
void SetLogRank(int rank);

// Re-reads the SHARDLINE_DEBUG* variables (tests; normally they are read once).
void ReinitLoggingForTesting();

// Throttles a warning that a peer can trigger at will (a flood of bad connections): at most
// `burst` events per `period` are let through, the rest are counted, and the next event let
// through reports how many were held back. Thread-safe.
//
//   static LogRateLimiter limiter(10, absl::Seconds(10));
//   if (int64_t held_back; limiter.Allow(&held_back)) {
//     SL_LOG(WARN, STORE) << "dropping " << peer << SuppressedSuffix(held_back);
//   }
class LogRateLimiter {
 public:
  LogRateLimiter(int burst, absl::Duration period) : burst_(burst), period_(period) {}

  // True if the event at `now` may be logged; then `*suppressed` (optional) receives the number
  // of events refused since the last one let through.
  bool Allow(int64_t* suppressed = nullptr, absl::Time now = absl::Now());
  // Events refused since the last one let through (for a summary line at shutdown, say); resets
  // the count.
  int64_t TakeSuppressed();

 private:
  const int burst_;
  const absl::Duration period_;
  std::mutex mu_;
  absl::Time window_start_ = absl::InfinitePast();
  int in_window_ = 0;
  int64_t suppressed_ = 0;
};

// "" if `suppressed` is 0, else " (N similar messages suppressed)".
std::string SuppressedSuffix(int64_t suppressed);

namespace logging_internal {

class LogMessage {
 public:
  LogMessage(LogLevel level, uint32_t subsys, const char* file, int line);
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  uint32_t subsys_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};

struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace logging_internal
}  // namespace shardline

#define SL_LOG_LEVEL_WARN ::shardline::LogLevel::kWarn
#define SL_LOG_LEVEL_INFO ::shardline::LogLevel::kInfo
#define SL_LOG_LEVEL_TRACE ::shardline::LogLevel::kTrace
#define SL_LOG_LEVEL_VERSION ::shardline::LogLevel::kVersion
#define SL_LOG_SUBSYS_INIT ::shardline::kLogInit
#define SL_LOG_SUBSYS_ENV ::shardline::kLogEnv
#define SL_LOG_SUBSYS_STREAM ::shardline::kLogStream
#define SL_LOG_SUBSYS_ALLOC ::shardline::kLogAlloc
#define SL_LOG_SUBSYS_COLL ::shardline::kLogColl
#define SL_LOG_SUBSYS_STORE ::shardline::kLogStore
#define SL_LOG_SUBSYS_NET ::shardline::kLogNet
#define SL_LOG_SUBSYS_SCHED ::shardline::kLogSched
#define SL_LOG_SUBSYS_BENCH ::shardline::kLogBench
#define SL_LOG_SUBSYS_ALL ::shardline::kLogAll

#define SL_LOG_ENABLED(level, subsys) \
  ::shardline::LogEnabled(SL_LOG_LEVEL_##level, SL_LOG_SUBSYS_##subsys)

#define SL_LOG(level, subsys)                                                                     \
  !SL_LOG_ENABLED(level, subsys)                                                                  \
      ? (void)0                                                                                   \
      : ::shardline::logging_internal::LogVoidify() &                                             \
            ::shardline::logging_internal::LogMessage(SL_LOG_LEVEL_##level,                       \
                                                      SL_LOG_SUBSYS_##subsys, __FILE__, __LINE__) \
                .stream()

#endif  // SHARDLINE_RUNTIME_LOGGING_H_
