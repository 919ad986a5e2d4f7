#include "collectives/store/store.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "runtime/config.h"
#include "runtime/status.h"

namespace shardline {
namespace {

absl::Status CheckKey(absl::string_view key) {
  if (key.empty()) return absl::InvalidArgumentError("store key must not be empty");
  return absl::OkStatus();
}

absl::Status CheckKeys(absl::Span<const std::string> keys) {
  for (const std::string& key : keys) {
    if (key.empty()) {
      return absl::InvalidArgumentError("store key must not be empty (in a list of keys)");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Store::Set(absl::string_view key, absl::string_view value) {
  SL_RETURN_IF_ERROR(CheckKey(key));
  return DoSet(key, value);
}

absl::StatusOr<std::string> Store::Get(absl::string_view key, absl::Time deadline) {
  SL_RETURN_IF_ERROR(CheckKey(key));
  return DoGet(key, deadline);
}

absl::StatusOr<std::string> Store::Get(absl::string_view key) {
  return Get(key, DefaultDeadline());
}

absl::StatusOr<int64_t> Store::Add(absl::string_view key, int64_t delta) {
  SL_RETURN_IF_ERROR(CheckKey(key));
  return DoAdd(key, delta);
}

absl::StatusOr<std::string> Store::CompareSet(absl::string_view key, absl::string_view expected,
                                              absl::string_view desired) {
  SL_RETURN_IF_ERROR(CheckKey(key));
  return DoCompareSet(key, expected, desired);
}

absl::Status Store::Wait(absl::Span<const std::string> keys, absl::Time deadline) {
  SL_RETURN_IF_ERROR(CheckKeys(keys));
  if (keys.empty()) return absl::OkStatus();
  return DoWait(keys, deadline);
}

absl::Status Store::Wait(absl::Span<const std::string> keys) {
  return Wait(keys, DefaultDeadline());
}

absl::StatusOr<bool> Store::Check(absl::Span<const std::string> keys) {
  SL_RETURN_IF_ERROR(CheckKeys(keys));
  if (keys.empty()) return true;
  return DoCheck(keys);
}

absl::StatusOr<bool> Store::Delete(absl::string_view key) {
  SL_RETURN_IF_ERROR(CheckKey(key));
  return DoDelete(key);
}

absl::StatusOr<int64_t> Store::NumKeys() { return DoNumKeys(); }

absl::Status Store::AppendOnClose(absl::string_view log, absl::string_view entry,
                                  absl::Time deadline) {
  SL_RETURN_IF_ERROR(CheckKey(log));
  return DoAppendOnClose(log, entry, deadline);
}

absl::Status Store::DoAppendOnClose(absl::string_view log, absl::string_view, absl::Time) {
  return absl::UnimplementedError(absl::StrCat(
      "AppendOnClose to log ", PrintableKey(log),
      ": this store has no connection whose closing would mark a client gone (use a TcpStore)"));
}

std::string PrintableKey(absl::string_view key) {
  constexpr size_t kMaxChars = 120;
  std::string escaped = absl::CHexEscape(key);
  if (escaped.size() > kMaxChars) {
    escaped.resize(kMaxChars);
    escaped += "...";
  }
  return absl::StrCat("'", escaped, "'");
}

std::string PrintableKeys(absl::Span<const std::string> keys) {
  constexpr size_t kMaxNamed = 4;
  std::string out;
  for (size_t i = 0; i < keys.size() && i < kMaxNamed; ++i) {
    if (i > 0) out += ", ";
    out += PrintableKey(keys[i]);
  }
  if (keys.size() > kMaxNamed) absl::StrAppend(&out, " and ", keys.size() - kMaxNamed, " more");
  return out;
}

}  // namespace shardline
