#include "runtime/logging.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "runtime/config.h"

namespace shardline {
namespace {

absl::Status CheckLevel(const std::string& text) { return ParseLogLevel(text).status(); }
absl::Status CheckSubsys(const std::string& text) { return ParseLogSubsys(text).status(); }

SL_PARAM(std::string, Debug, "DEBUG", "WARN",
         "Log level: NONE, VERSION, WARN, INFO or TRACE (NCCL_DEBUG's grammar). Warnings are "
         "always printed.",
         CheckLevel);
SL_PARAM(std::string, DebugSubsys, "DEBUG_SUBSYS", "INIT,ENV",
         "Comma-separated subsystems for INFO/TRACE lines: INIT, ENV, STREAM, ALLOC, COLL, STORE, "
         "NET, SCHED, BENCH or ALL; a leading ^ selects all but those listed.",
         CheckSubsys);
SL_PARAM(std::string, DebugFile, "DEBUG_FILE", "",
         "Write log lines to this file instead of stderr; %h is the hostname, %p the pid.");

struct SubsysName {
  absl::string_view name;
  uint32_t bit;
};
constexpr SubsysName kSubsysNames[] = {
    {"INIT", kLogInit},   {"ENV", kLogEnv},     {"STREAM", kLogStream},
    {"ALLOC", kLogAlloc}, {"COLL", kLogColl},   {"STORE", kLogStore},
    {"NET", kLogNet},     {"SCHED", kLogSched}, {"BENCH", kLogBench},
};

absl::string_view SubsysLabel(uint32_t subsys) {
  for (const SubsysName& s : kSubsysNames) {
    if (s.bit == subsys) return s.name;
  }
  return "ALL";
}

absl::string_view LevelLabel(LogLevel level) {
  switch (level) {
    case LogLevel::kVersion:
      return "VERSION";
    case LogLevel::kWarn:
      return "WARN";
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kTrace:
      return "TRACE";
    case LogLevel::kNone:
      break;
  }
  return "NONE";
}

std::string Hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown";
  return name;
}

struct LogState {
  std::mutex mu;
  bool initialised = false;
  LogLevel level = LogLevel::kWarn;
  uint32_t subsys = kLogInit | kLogEnv;
  FILE* file = stderr;
  std::string host;
  std::vector<std::string> config_errors;  // reported on the first line written
};

LogState& State() {
  static LogState* state = new LogState;
  return *state;
}

std::atomic<int> g_rank{-1};
std::atomic<int> g_level{-1};  // cached LogLevel for the fast path; -1 until initialised
std::atomic<uint32_t> g_subsys{0};

void InitLocked(LogState& state) {
  if (state.initialised) return;
  state.initialised = true;
  state.host = Hostname();
  state.config_errors.clear();
  state.level = LogLevel::kWarn;
  state.subsys = kLogInit | kLogEnv;
  if (state.file != stderr && state.file != nullptr) std::fclose(state.file);
  state.file = stderr;

  // Warnings are never silenced: NONE and VERSION still print WARN lines.
  absl::StatusOr<std::string> level_text = ParamDebug().Get();
  if (level_text.ok()) {
    state.level = std::max(*ParseLogLevel(*level_text), LogLevel::kWarn);
  } else {
    state.config_errors.push_back(std::string(level_text.status().message()));
  }
  absl::StatusOr<std::string> subsys_text = ParamDebugSubsys().Get();
  if (subsys_text.ok()) {
    state.subsys = *ParseLogSubsys(*subsys_text);
  } else {
    state.config_errors.push_back(std::string(subsys_text.status().message()));
  }
  absl::StatusOr<std::string> file_text = ParamDebugFile().Get();
  if (file_text.ok() && !file_text->empty()) {
    std::string path = ExpandDebugFilePattern(*file_text);
    FILE* file = std::fopen(path.c_str(), "a");
    if (file != nullptr) {
      std::setvbuf(file, nullptr, _IOLBF, 0);
      state.file = file;
    } else {
      state.config_errors.push_back(absl::StrCat(
          "environment variable SHARDLINE_DEBUG_FILE: ", "cannot open '", path, "' for appending"));
    }
  }
  g_subsys.store(state.subsys, std::memory_order_relaxed);
  g_level.store(static_cast<int>(state.level), std::memory_order_release);
}

void EnsureInit() {
  if (g_level.load(std::memory_order_acquire) >= 0) return;
  LogState& state = State();
  std::lock_guard<std::mutex> lock(state.mu);
  InitLocked(state);
}

}  // namespace

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view text) {
  const std::string upper = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(text));
  for (LogLevel level :
       {LogLevel::kNone, LogLevel::kVersion, LogLevel::kWarn, LogLevel::kInfo, LogLevel::kTrace}) {
    if (upper == LevelLabel(level)) return level;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown log level '", text, "' (expected NONE, VERSION, WARN, INFO or TRACE)"));
}

absl::StatusOr<uint32_t> ParseLogSubsys(absl::string_view text) {
  std::string upper = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(text));
  absl::string_view list = upper;
  const bool invert = absl::ConsumePrefix(&list, "^");
  uint32_t mask = 0;
  for (absl::string_view item : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    if (item == "ALL") {
      mask = kLogAll;
      continue;
    }
    bool found = false;
    for (const SubsysName& s : kSubsysNames) {
      if (item == s.name) {
        mask |= s.bit;
        found = true;
      }
    }
    if (!found) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown subsystem '", item,
          "' (expected INIT, ENV, STREAM, ALLOC, COLL, STORE, NET, SCHED, BENCH or ALL)"));
    }
  }
  return invert ? ~mask : mask;
}

std::string ExpandDebugFilePattern(absl::string_view pattern) {
  std::string out;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '%' && i + 1 < pattern.size()) {
      char next = pattern[i + 1];
      if (next == 'h') {
        out += Hostname();
        ++i;
        continue;
      }
      if (next == 'p') {
        absl::StrAppend(&out, getpid());
        ++i;
        continue;
      }
      if (next == '%') {
        out += '%';
        ++i;
        continue;
      }
    }
    out += pattern[i];
  }
  return out;
}

bool LogEnabled(LogLevel level, uint32_t subsys) {
  EnsureInit();
  const int current = g_level.load(std::memory_order_relaxed);
  if (static_cast<int>(level) > current) return false;
  if (level <= LogLevel::kWarn) return true;
  return (g_subsys.load(std::memory_order_relaxed) & subsys) != 0;
}

bool LogRateLimiter::Allow(int64_t* suppressed, absl::Time now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (now - window_start_ >= period_) {
    window_start_ = now;
    in_window_ = 0;
  }
  if (in_window_ >= burst_) {
    ++suppressed_;
    return false;
  }
  ++in_window_;
  if (suppressed != nullptr) *suppressed = suppressed_;
  suppressed_ = 0;
  return true;
}

int64_t LogRateLimiter::TakeSuppressed() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(suppressed_, 0);
}

std::string SuppressedSuffix(int64_t suppressed) {
  if (suppressed == 0) return "";
  return absl::StrCat(" (", suppressed, " similar message", suppressed == 1 ? "" : "s",
                      " suppressed)");
}

void SetLogRank(int rank) { g_rank.store(rank, std::memory_order_relaxed); }

void ReinitLoggingForTesting() {
  LogState& state = State();
  std::lock_guard<std::mutex> lock(state.mu);
  ParamDebug().ResetCacheForTesting();
  ParamDebugSubsys().ResetCacheForTesting();
  ParamDebugFile().ResetCacheForTesting();
  state.initialised = false;
  InitLocked(state);
}

namespace logging_internal {

LogMessage::LogMessage(LogLevel level, uint32_t subsys, const char* file, int line)
    : level_(level), subsys_(subsys), file_(file), line_(line) {}

LogMessage::~LogMessage() {
  LogState& state = State();
  std::lock_guard<std::mutex> lock(state.mu);
  InitLocked(state);
  std::string prefix = absl::StrCat(state.host, ":", getpid(), ":", syscall(SYS_gettid), " ");
  const int rank = g_rank.load(std::memory_order_relaxed);
  if (rank >= 0) absl::StrAppend(&prefix, "[", rank, "] ");
  for (const std::string& error : state.config_errors) {
    std::fprintf(state.file, "%sshardline WARN ENV ignoring %s\n", prefix.c_str(), error.c_str());
  }
  state.config_errors.clear();
  std::string body = stream_.str();
  if (level_ == LogLevel::kTrace) {
    absl::string_view base(file_);
    if (size_t slash = base.rfind('/'); slash != absl::string_view::npos) {
      base = base.substr(slash + 1);
    }
    body = absl::StrCat(base, ":", line_, " ", body);
  }
  std::fprintf(state.file, "%sshardline %s %s %s\n", prefix.c_str(),
               std::string(LevelLabel(level_)).c_str(), std::string(SubsysLabel(subsys_)).c_str(),
               body.c_str());
  std::fflush(state.file);
}

}  // namespace logging_internal
}  // namespace shardline
