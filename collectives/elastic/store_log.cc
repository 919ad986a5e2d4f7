#include "collectives/elastic/store_log.h"

#include <algorithm>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "runtime/status.h"

namespace shardline::elastic {

std::string StoreLog::Key(int64_t index) const { return absl::StrCat(key_, "/", index); }

absl::Status StoreLog::Append(absl::string_view entry) {
  for (int64_t index = std::max(read_, appended_) + 1;; ++index) {
    SL_ASSIGN_OR_RETURN(std::string value, store_->CompareSet(Key(index), "", entry));
    if (value == entry) {
      appended_ = index;
      return absl::OkStatus();
    }
  }
}

absl::StatusOr<std::optional<std::string>> StoreLog::Next(absl::Time until) {
  absl::StatusOr<std::string> entry = store_->Get(Key(read_ + 1), until);
  if (absl::IsDeadlineExceeded(entry.status()) && absl::Now() >= until) return std::nullopt;
  if (!entry.ok()) return entry.status();
  ++read_;
  return *std::move(entry);
}

absl::StatusOr<std::optional<std::string>> StoreLog::TryNext(absl::Time deadline) {
  SL_ASSIGN_OR_RETURN(bool exists, store_->Check({Key(read_ + 1)}));
  if (!exists) return std::nullopt;
  SL_ASSIGN_OR_RETURN(std::optional<std::string> entry, Next(deadline));
  if (!entry.has_value()) {
    return absl::DeadlineExceededError(
        absl::StrCat("log '", key_, "': entry ", read_ + 1, " exists but was not read in time"));
  }
  return entry;
}

}  // namespace shardline::elastic
