// File: runtime/internal/flat_layout_internal.h
// -----------------------------------------------------------------------------
// Internal to FlatLayout's sources (runtime/flat_layout.cc, runtime/flat_layout_serialize.cc):
// how their messages name a tensor. Not part of the public API (not installed).

#ifndef SHARDLINE_RUNTIME_INTERNAL_FLAT_LAYOUT_INTERNAL_H_
#define SHARDLINE_RUNTIME_INTERNAL_FLAT_LAYOUT_INTERNAL_H_

#include <string>

#include "absl/strings/string_view.h"

namespace shardline::flat_layout_internal {

// `name` in single quotes, its unprintable bytes C-escaped: 'layers.0.w'.
std::string QuoteName(absl::string_view name);

}  // namespace shardline::flat_layout_internal

#endif  // SHARDLINE_RUNTIME_INTERNAL_FLAT_LAYOUT_INTERNAL_H_
