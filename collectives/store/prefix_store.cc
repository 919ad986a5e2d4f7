#include "collectives/store/prefix_store.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/check.h"

namespace shardline {

PrefixStore::PrefixStore(absl::string_view prefix, Store& base) : prefix_(prefix), base_(&base) {}

PrefixStore::PrefixStore(absl::string_view prefix, std::shared_ptr<Store> base)
    : prefix_(prefix), owned_(std::move(base)), base_(owned_.get()) {
  SL_CHECK(base_ != nullptr) << "PrefixStore '" << prefix_ << "' over a null store";
}

std::string PrefixStore::Prefixed(absl::string_view key) const {
  return absl::StrCat(prefix_, "/", key);
}

std::vector<std::string> PrefixStore::Prefixed(absl::Span<const std::string> keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const std::string& key : keys) out.push_back(Prefixed(key));
  return out;
}

absl::Status PrefixStore::DoSet(absl::string_view key, absl::string_view value) {
  return base_->Set(Prefixed(key), value);
}

absl::StatusOr<std::string> PrefixStore::DoGet(absl::string_view key, absl::Time deadline) {
  return base_->Get(Prefixed(key), deadline);
}

absl::StatusOr<int64_t> PrefixStore::DoAdd(absl::string_view key, int64_t delta) {
  return base_->Add(Prefixed(key), delta);
}

absl::StatusOr<std::string> PrefixStore::DoCompareSet(absl::string_view key,
                                                      absl::string_view expected,
                                                      absl::string_view desired) {
  return base_->CompareSet(Prefixed(key), expected, desired);
}

absl::Status PrefixStore::DoWait(absl::Span<const std::string> keys, absl::Time deadline) {
  return base_->Wait(Prefixed(keys), deadline);
}

absl::StatusOr<bool> PrefixStore::DoCheck(absl::Span<const std::string> keys) {
  return base_->Check(Prefixed(keys));
}

absl::StatusOr<bool> PrefixStore::DoDelete(absl::string_view key) {
  return base_->Delete(Prefixed(key));
}

absl::StatusOr<int64_t> PrefixStore::DoNumKeys() { return base_->NumKeys(); }

absl::Status PrefixStore::DoAppendOnClose(absl::string_view log, absl::string_view entry,
                                          absl::Time deadline) {
  return base_->AppendOnClose(Prefixed(log), entry, deadline);
}

}  // namespace shardline
