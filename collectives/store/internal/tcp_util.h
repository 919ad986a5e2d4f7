// File: collectives/store/internal/tcp_util.h
// -----------------------------------------------------------------------------
// Helpers shared by the TCP store's server and client (not part of the public API).

#ifndef SHARDLINE_COLLECTIVES_STORE_INTERNAL_TCP_UTIL_H_
#define SHARDLINE_COLLECTIVES_STORE_INTERNAL_TCP_UTIL_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardline::store_internal {

// `option` if set, else SHARDLINE_STORE_TOKEN.
absl::StatusOr<std::string> ResolveToken(const std::optional<std::string>& option);
// `option` if non-zero (checked against the same range as the knob), else
// SHARDLINE_STORE_MAX_MESSAGE_BYTES.
absl::StatusOr<uint32_t> ResolveMaxMessageBytes(int64_t option);
// Compares without an early exit, so the time taken does not reveal the matching prefix.
bool TokensEqual(absl::string_view a, absl::string_view b);
// "host:port", bracketing IPv6 literals.
std::string HostPort(absl::string_view host, int port);

}  // namespace shardline::store_internal

#endif  // SHARDLINE_COLLECTIVES_STORE_INTERNAL_TCP_UTIL_H_
