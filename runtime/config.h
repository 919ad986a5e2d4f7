// File: runtime/config.h
// -----------------------------------------------------------------------------
// Environment knobs. Every SHARDLINE_* variable is declared exactly once, next to the code that
// uses it, with its type, default and help text:
//
//   SL_PARAM(double, Timeout, "TIMEOUT_S", 600.0,
//            "Deadline in seconds for every blocking wait (collectives, events, the store).");
//
// declares `const shardline::Param<double>& ParamTimeout()`. Get() reads the environment once
// and caches the result; a value that does not parse is an InvalidArgument naming the variable,
// the text and the expected type, returned on every Get(). The registry lists every declared
// knob (for `--help` screens and docs) and ValidateAllParams() checks them all at once, which
// init paths call so that a typo surfaces before any work starts.
//
// Types: bool (1/0, true/false, yes/no, on/off), int64_t, double, std::string. An optional
// sixth argument checks the parsed value (a range, a grammar).
//
// Bounds. Every int64_t and double knob declares its bounds where it is declared, with
// InRange<T>(min, max) (or a check of its own that bounds it): a knob of either type without a
// check is a bug, and its declaration aborts the program at start-up (every test binary that
// links it fails). A value out of bounds is InvalidArgument naming the variable, the value and
// the bounds: "environment variable SHARDLINE_UCX_CHUNK_BYTES: 99999999999999 is out of range
// [4096, 268435456]".
//
// What the reader does with an invalid value: where the knob is read on a path that returns a
// Status (creating a communicator, a stream, a checkpointer), it returns that error, so the
// call fails before any work starts. Where the reading code cannot fail (a deadline, a
// threshold consulted per allocation, the flight recorder's capacity), it takes
// GetOrDefault(): the default, with one warning naming the error; ValidateAllParams, which init
// paths call, reports the invalid value as an error there too.

#ifndef SHARDLINE_RUNTIME_CONFIG_H_
#define SHARDLINE_RUNTIME_CONFIG_H_

#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardline {

class ParamBase {
 public:
  // `suffix` is the name without the SHARDLINE_ prefix. Registers itself in the global registry.
  ParamBase(absl::string_view suffix, absl::string_view type_name, absl::string_view help);
  ParamBase(const ParamBase&) = delete;
  ParamBase& operator=(const ParamBase&) = delete;

  // "SHARDLINE_<suffix>".
  const std::string& env_name() const { return env_name_; }
  absl::string_view type_name() const { return type_name_; }
  absl::string_view help() const { return help_; }
  virtual std::string DefaultText() const = 0;
  // The raw environment text, if the variable is set.
  std::optional<std::string> RawValue() const;
  // OK if unset or parses.
  virtual absl::Status Validate() const = 0;
  // Forgets the cached value so the next Get() reads the environment again (tests only).
  virtual void ResetCacheForTesting() const = 0;

 protected:
  ~ParamBase() = default;

 private:
  std::string env_name_;
  absl::string_view type_name_;
  absl::string_view help_;
};

namespace config_internal {
absl::StatusOr<bool> ParseParamValue(absl::string_view text, bool*);
absl::StatusOr<int64_t> ParseParamValue(absl::string_view text, int64_t*);
absl::StatusOr<double> ParseParamValue(absl::string_view text, double*);
absl::StatusOr<std::string> ParseParamValue(absl::string_view text, std::string*);
std::string ParamValueText(bool v);
std::string ParamValueText(int64_t v);
std::string ParamValueText(double v);
std::string ParamValueText(const std::string& v);
// "<value> is out of range [<min>, <max>]".
std::string OutOfRangeMessage(absl::string_view value, absl::string_view min,
                              absl::string_view max);
// Aborts: the int64_t or double knob `env_name` was declared without bounds (a bug).
[[noreturn]] void MissingBounds(absl::string_view env_name);
}  // namespace config_internal

template <typename T>
class Param final : public ParamBase {
 public:
  // `check`, if given, validates a parsed value beyond its type (a range, a grammar); its error
  // message is prefixed with the variable's name.
  using Check = std::function<absl::Status(const T&)>;

  Param(absl::string_view suffix, absl::string_view type_name, T default_value,
        absl::string_view help, Check check = nullptr)
      : ParamBase(suffix, type_name, help),
        default_(std::move(default_value)),
        check_(std::move(check)) {
    if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double>) {
      if (!check_) config_internal::MissingBounds(env_name());
    }
  }

  // The value from the environment, else the default. Cached after the first call.
  absl::StatusOr<T> Get() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (!cached_.has_value()) cached_ = Read();
    return *cached_;
  }
  // Get()'s value, or the default if the environment's value is invalid (logged at WARN once
  // per process, naming the error). For readers that cannot return a Status.
  T GetOrDefault() const;
  const T& default_value() const { return default_; }

  std::string DefaultText() const override { return config_internal::ParamValueText(default_); }
  absl::Status Validate() const override { return Get().status(); }
  void ResetCacheForTesting() const override {
    std::lock_guard<std::mutex> lock(mu_);
    cached_.reset();
  }

 private:
  absl::StatusOr<T> Read() const;

  T default_;
  Check check_;
  mutable std::mutex mu_;
  mutable std::optional<absl::StatusOr<T>> cached_;
  mutable std::once_flag warned_;
};

// The check of a knob whose value must lie in [min, max]: "<value> is out of range [min, max]".
// The type is explicit (InRange<int64_t>(4096, 1 << 28)): an int literal would deduce int.
template <typename T>
typename Param<T>::Check InRange(std::type_identity_t<T> min, std::type_identity_t<T> max) {
  static_assert(std::is_same_v<T, int64_t> || std::is_same_v<T, double>);
  return [min, max](const T& v) -> absl::Status {
    if (v >= min && v <= max) return absl::OkStatus();
    return absl::InvalidArgumentError(config_internal::OutOfRangeMessage(
        config_internal::ParamValueText(v), config_internal::ParamValueText(min),
        config_internal::ParamValueText(max)));
  };
}

// Every registered knob, sorted by name.
std::vector<const ParamBase*> AllParams();
// The first invalid knob's error, or OK. SHARDLINE_* variables that no registered knob matches
// are logged at WARN (a likely typo), not rejected: knobs of layers that are not linked into
// this binary are legitimately absent from the registry.
absl::Status ValidateAllParams();
// A human-readable table of every knob: name, type, default, current value, help.
std::string DescribeParams();

// The knobs the runtime itself owns.
const Param<double>& ParamTimeout();  // SHARDLINE_TIMEOUT_S
// SHARDLINE_STREAM_SPIN_US (runtime/host_stream.cc): how long an idle host stream's worker polls
// before it sleeps (default -1, auto: 50 us while few workers are awake for the hardware threads).
const Param<int64_t>& ParamStreamSpinUs();
// SHARDLINE_STREAM_BATCH_SCHED (runtime/host_stream.cc): host streams' workers run under
// SCHED_BATCH (default true).
const Param<bool>& ParamStreamBatchSched();

// The default deadline of every blocking wait: SHARDLINE_TIMEOUT_S (default 600 s).
absl::StatusOr<absl::Duration> DefaultTimeout();
// Now + DefaultTimeout(); if the knob is invalid, falls back to its default (the invalid value
// is reported by ValidateAllParams and at init, not by every wait).
absl::Time DefaultDeadline();

}  // namespace shardline

// SL_PARAM(type, FnName, "SUFFIX", default, "help"[, check]) defines Param<type>& ParamFnName().
#define SL_PARAM(type, fn_name, suffix, default_value, help, ...)                      \
  const ::shardline::Param<type>& Param##fn_name() {                                   \
    static const ::shardline::Param<type>* const param = new ::shardline::Param<type>( \
        suffix, #type, default_value, help __VA_OPT__(, ) __VA_ARGS__);                \
    return *param;                                                                     \
  }                                                                                    \
  [[maybe_unused]] static const ::shardline::ParamBase& sl_param_registrar_##fn_name = \
      Param##fn_name()

#endif  // SHARDLINE_RUNTIME_CONFIG_H_
