#include "runtime/config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "runtime/logging.h"

extern char** environ;

namespace shardline {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, const ParamBase*> params;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry;
  return *registry;
}

absl::Status BadValue(absl::string_view text, absl::string_view expected) {
  return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not ", expected));
}

}  // namespace

ParamBase::ParamBase(absl::string_view suffix, absl::string_view type_name, absl::string_view help)
    : env_name_(absl::StrCat("SHARDLINE_", suffix)), type_name_(type_name), help_(help) {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  registry.params[env_name_] = this;
}

std::optional<std::string> ParamBase::RawValue() const {
  const char* value = std::getenv(env_name_.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

namespace config_internal {

absl::StatusOr<bool> ParseParamValue(absl::string_view text, bool*) {
  const std::string lower = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  if (lower == "1" || lower == "true" || lower == "yes" || lower == "on") return true;
  if (lower == "0" || lower == "false" || lower == "no" || lower == "off") return false;
  return BadValue(text, "a boolean (1/0, true/false, yes/no, on/off)");
}

absl::StatusOr<int64_t> ParseParamValue(absl::string_view text, int64_t*) {
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value)) return BadValue(text, "an integer");
  return value;
}

absl::StatusOr<double> ParseParamValue(absl::string_view text, double*) {
  double value = 0;
  if (!absl::SimpleAtod(text, &value) || !std::isfinite(value)) {
    return BadValue(text, "a finite number");
  }
  return value;
}

absl::StatusOr<std::string> ParseParamValue(absl::string_view text, std::string*) {
  return std::string(text);
}

std::string ParamValueText(bool v) { return v ? "1" : "0"; }
std::string ParamValueText(int64_t v) { return absl::StrCat(v); }
std::string ParamValueText(double v) { return absl::StrFormat("%.15g", v); }
std::string ParamValueText(const std::string& v) { return v; }

std::string OutOfRangeMessage(absl::string_view value, absl::string_view min,
                              absl::string_view max) {
  return absl::StrCat(value, " is out of range [", min, ", ", max, "]");
}

void MissingBounds(absl::string_view env_name) {
  // Before main: logging may not be configured yet.
  std::fprintf(stderr,
               "shardline: the knob %.*s is an integer or floating knob declared without bounds "
               "(pass InRange<T>(min, max) to SL_PARAM)\n",
               static_cast<int>(env_name.size()), env_name.data());
  std::abort();
}

}  // namespace config_internal

template <typename T>
absl::StatusOr<T> Param<T>::Read() const {
  std::optional<std::string> raw = RawValue();
  if (!raw.has_value()) return default_;
  absl::StatusOr<T> value = config_internal::ParseParamValue(*raw, static_cast<T*>(nullptr));
  absl::Status status = value.status();
  if (status.ok() && check_) status = check_(*value);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", env_name(), ": ", status.message()));
  }
  return value;
}

template <typename T>
T Param<T>::GetOrDefault() const {
  absl::StatusOr<T> value = Get();
  if (value.ok()) return *std::move(value);
  std::call_once(warned_, [&] {
    SL_LOG(WARN, ENV) << value.status().message() << "; using the default, "
                      << config_internal::ParamValueText(default_);
  });
  return default_;
}

template class Param<bool>;
template class Param<int64_t>;
template class Param<double>;
template class Param<std::string>;

std::vector<const ParamBase*> AllParams() {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  std::vector<const ParamBase*> params;
  params.reserve(registry.params.size());
  for (const auto& [name, param] : registry.params) params.push_back(param);
  return params;
}

absl::Status ValidateAllParams() {
  for (const ParamBase* param : AllParams()) {
    absl::Status status = param->Validate();
    if (!status.ok()) return status;
  }
  std::vector<const ParamBase*> params = AllParams();
  for (char** env = environ; env != nullptr && *env != nullptr; ++env) {
    absl::string_view entry(*env);
    if (!absl::StartsWith(entry, "SHARDLINE_")) continue;
    absl::string_view name = entry.substr(0, entry.find('='));
    bool known = std::any_of(params.begin(), params.end(),
                             [&](const ParamBase* p) { return p->env_name() == name; });
    if (!known) SL_LOG(WARN, ENV) << name << " is set but no shardline knob of that name exists";
  }
  return absl::OkStatus();
}

std::string DescribeParams() {
  std::string out;
  for (const ParamBase* param : AllParams()) {
    std::optional<std::string> raw = param->RawValue();
    absl::StrAppendFormat(&out, "%-32s %-12s default=%s%s\n    %s\n", param->env_name(),
                          param->type_name(), param->DefaultText(),
                          raw ? absl::StrCat(" set=", *raw) : std::string(), param->help());
  }
  return out;
}

SL_PARAM(double, Timeout, "TIMEOUT_S", 600.0,
         "Deadline in seconds for every blocking wait: collectives, events, streams, the store "
         "(0.001 to 30 days).",
         InRange<double>(0.001, 30 * 86400.0));

absl::StatusOr<absl::Duration> DefaultTimeout() {
  absl::StatusOr<double> seconds = ParamTimeout().Get();
  if (!seconds.ok()) return seconds.status();
  return absl::Seconds(*seconds);
}

absl::Time DefaultDeadline() { return absl::Now() + absl::Seconds(ParamTimeout().GetOrDefault()); }

}  // namespace shardline
