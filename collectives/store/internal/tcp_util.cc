#include "collectives/store/internal/tcp_util.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/store/store_protocol.h"
#include "collectives/store/tcp_store.h"

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

}  // namespace

SL_PARAM(std::string, StoreToken, "STORE_TOKEN", "",
         "Shared secret of the rendezvous store: clients must present it or are refused. Empty: "
         "no authentication.");
SL_PARAM(int64_t, StoreMaxMessageBytes, "STORE_MAX_MESSAGE_BYTES",
         int64_t{store_protocol::kDefaultMaxPayloadBytes},
         "Largest store message payload (a value plus a few bytes) that a store server or client "
         "accepts; a larger one closes the connection.",
         CheckMaxMessageBytes);

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
