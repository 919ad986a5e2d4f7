#include "runtime/device.h"

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace shardline {

absl::StatusOr<Device> Device::Parse(absl::string_view text) {
  const std::string lower = absl::AsciiStrToLower(text);
  if (lower == "host" || lower == "cpu") return Host();
  if (lower == "cuda") return Cuda(0);
  if (absl::StartsWith(lower, "cuda:")) {
    int index = -1;
    if (absl::SimpleAtoi(absl::string_view(lower).substr(5), &index) && index >= 0) {
      return Cuda(index);
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown device '", text, "' (expected 'host', 'cpu', 'cuda' or 'cuda:N')"));
}

std::string Device::ToString() const {
  return is_host() ? std::string("host") : absl::StrCat("cuda:", index_);
}

std::ostream& operator<<(std::ostream& os, const Device& device) { return os << device.ToString(); }

}  // namespace shardline
