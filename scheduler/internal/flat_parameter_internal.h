// File: scheduler/internal/flat_parameter_internal.h
// -----------------------------------------------------------------------------
// Internal to FlatParameter's sources (scheduler/flat_parameter.cc: creation, gather, reshard;
// scheduler/flat_parameter_grad.cc: the gradient half): the helpers both halves use. Not part of
// the public API (not installed).

#ifndef SHARDLINE_SCHEDULER_INTERNAL_FLAT_PARAMETER_INTERNAL_H_
#define SHARDLINE_SCHEDULER_INTERNAL_FLAT_PARAMETER_INTERNAL_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "runtime/status.h"

namespace shardline::flat_parameter_internal {

// Element `index` of a buffer of `esize`-byte elements; null for a buffer of no bytes (pointer
// arithmetic on null is undefined).
inline void* ElementAt(void* base, size_t index, size_t esize) {
  return base == nullptr ? nullptr : static_cast<char*>(base) + index * esize;
}

// "flat parameter '<name>': <call><suffix>", formatted only when an error needs it: the hooks'
// successful calls build no strings.
class CallContext {
 public:
  CallContext(const std::string& name, absl::string_view call, absl::string_view suffix = "")
      : name_(name), call_(call), suffix_(suffix) {}
  std::string str() const { return absl::StrCat("flat parameter '", name_, "': ", call_, suffix_); }

 private:
  const std::string& name_;
  absl::string_view call_;
  absl::string_view suffix_;
};

inline absl::Status Annotate(const absl::Status& status, const CallContext& context) {
  if (status.ok()) return status;
  return shardline::Annotate(status, context.str());
}

}  // namespace shardline::flat_parameter_internal

#endif  // SHARDLINE_SCHEDULER_INTERNAL_FLAT_PARAMETER_INTERNAL_H_
