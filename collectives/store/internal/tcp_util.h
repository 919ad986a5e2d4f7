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
#include "absl/time/time.h"

namespace shardline::store_internal {

// `option` if set, else SHARDLINE_STORE_TOKEN.
absl::StatusOr<std::string> ResolveToken(const std::optional<std::string>& option);
// `option` if non-zero (checked against the same range as the knob), else
// SHARDLINE_STORE_MAX_MESSAGE_BYTES.
absl::StatusOr<uint32_t> ResolveMaxMessageBytes(int64_t option);
// `option` if non-zero, else SHARDLINE_STORE_MAX_BUFFERED_BYTES.
absl::StatusOr<int64_t> ResolveMaxBufferedBytes(int64_t option);
// `option` if non-zero, else SHARDLINE_STORE_IDLE_TIMEOUT_S.
absl::StatusOr<absl::Duration> ResolveIdleTimeout(absl::Duration option);
// InvalidArgument naming `what` (e.g. "MASTER_ADDR") if `host` carries a port ("node0:29500",
// "[::1]:29500") or a scheme ("tcp://node0"): a name that would never resolve, retried until the
// deadline otherwise.
absl::Status CheckHostHasNoPort(absl::string_view host, absl::string_view what);
// Whether `address` (a numeric IPv4/IPv6 address) is a loopback one: 127.0.0.0/8 (Debian maps
// the hostname to 127.0.1.1), ::1, or an IPv4-mapped loopback.
bool IsLoopbackAddress(const std::string& address);
// Compares without an early exit, so the time taken does not reveal the matching prefix.
bool TokensEqual(absl::string_view a, absl::string_view b);
// "host:port", bracketing IPv6 literals.
std::string HostPort(absl::string_view host, int port);

}  // namespace shardline::store_internal

#endif  // SHARDLINE_COLLECTIVES_STORE_INTERNAL_TCP_UTIL_H_
