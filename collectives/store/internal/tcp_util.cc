#include "collectives/store/internal/tcp_util.h"

#include <algorithm>

#include <boost/asio/ip/address.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/store/store_protocol.h"
#include "collectives/store/tcp_store.h"
#include "runtime/status.h"

namespace shardline {
namespace {

constexpr int64_t kMinMaxMessageBytes = 4096;
constexpr int64_t kMaxMaxMessageBytes = int64_t{1} << 31;

absl::Status CheckMaxMessageBytes(const int64_t& bytes) {
  if (bytes < kMinMaxMessageBytes || bytes > kMaxMaxMessageBytes) {
    return absl::InvalidArgumentError(absl::StrCat("'", bytes, "' must be between ",
                                                   kMinMaxMessageBytes, " and ",
                                                   kMaxMaxMessageBytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status CheckMaxBufferedBytes(const int64_t& bytes) {
  if (bytes < kMinMaxMessageBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", bytes, "' must be at least ", kMinMaxMessageBytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status CheckIdleTimeout(const double& seconds) {
  if (!(seconds > 0) || seconds > 30 * 24 * 3600) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", seconds, "' must be a positive number of seconds (at most 30 days)"));
  }
  return absl::OkStatus();
}

}  // namespace

SL_PARAM(std::string, StoreToken, "STORE_TOKEN", "",
         "Shared secret of the rendezvous store: clients must present it or are refused. Empty: "
         "no authentication.");
SL_PARAM(int64_t, StoreMaxMessageBytes, "STORE_MAX_MESSAGE_BYTES",
         int64_t{store_protocol::kDefaultMaxPayloadBytes},
         "Largest store message payload (a value plus a few bytes) that a store server or client "
         "accepts; a larger one closes the connection.",
         CheckMaxMessageBytes);
SL_PARAM(int64_t, StoreMaxBufferedBytes, "STORE_MAX_BUFFERED_BYTES", int64_t{256} << 20,
         "Bytes of incomplete requests a store server buffers for all its connections together; "
         "a request that would exceed it is answered ResourceExhausted.",
         CheckMaxBufferedBytes);
SL_PARAM(double, StoreIdleTimeout, "STORE_IDLE_TIMEOUT_S", 120.0,
         "Seconds after which a store server closes a connection that has no Get/Wait waiting "
         "and has moved no byte (clients reopen it on their next call).",
         CheckIdleTimeout);

namespace store_internal {

absl::StatusOr<std::string> ResolveToken(const std::optional<std::string>& option) {
  if (option.has_value()) return *option;
  return ParamStoreToken().Get();
}

absl::StatusOr<uint32_t> ResolveMaxMessageBytes(int64_t option) {
  if (option != 0) {
    absl::Status status = CheckMaxMessageBytes(option);
    if (!status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("store option max_message_bytes: ", status.message()));
    }
    return static_cast<uint32_t>(option);
  }
  absl::StatusOr<int64_t> bytes = ParamStoreMaxMessageBytes().Get();
  if (!bytes.ok()) return bytes.status();
  return static_cast<uint32_t>(*bytes);
}

absl::StatusOr<int64_t> ResolveMaxBufferedBytes(int64_t option) {
  if (option != 0) {
    absl::Status status = CheckMaxBufferedBytes(option);
    if (!status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("store server option max_buffered_bytes: ", status.message()));
    }
    return option;
  }
  return ParamStoreMaxBufferedBytes().Get();
}

absl::StatusOr<absl::Duration> ResolveIdleTimeout(absl::Duration option) {
  if (option != absl::ZeroDuration()) {
    if (option < absl::ZeroDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "store server option idle_timeout ", absl::FormatDuration(option), " must be positive"));
    }
    return option;
  }
  SL_ASSIGN_OR_RETURN(double seconds, ParamStoreIdleTimeout().Get());
  return absl::Seconds(seconds);
}

absl::Status CheckHostHasNoPort(absl::string_view host, absl::string_view what) {
  // One colon: "host:port". An IPv6 literal has several; brackets only appear around one that
  // is followed by a port.
  const size_t colons = std::count(host.begin(), host.end(), ':');
  if (colons == 1 || absl::StrContains(host, "://") || absl::StartsWith(host, "[")) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, "='", host,
        "' is not a plain host name or address: give the port separately (MASTER_PORT), "
        "e.g. MASTER_ADDR=node0 MASTER_PORT=29500; an IPv6 address goes without brackets"));
  }
  return absl::OkStatus();
}

bool IsLoopbackAddress(const std::string& address) {
  boost::system::error_code ec;
  const boost::asio::ip::address parsed = boost::asio::ip::make_address(address, ec);
  if (ec) return false;
  if (parsed.is_v6() && parsed.to_v6().is_v4_mapped()) {
    return boost::asio::ip::make_address_v4(boost::asio::ip::v4_mapped, parsed.to_v6())
        .is_loopback();
  }
  return parsed.is_loopback();
}

bool TokensEqual(absl::string_view a, absl::string_view b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned>(x ^ y);
  }
  return diff == 0;
}

std::string HostPort(absl::string_view host, int port) {
  if (absl::StrContains(host, ':')) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

}  // namespace store_internal
}  // namespace shardline
