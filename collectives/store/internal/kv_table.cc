#include "collectives/store/internal/kv_table.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "collectives/store/store.h"

namespace shardline::store_internal {

void KvTable::Set(absl::string_view key, absl::string_view value) {
  map_.insert_or_assign(std::string(key), std::string(value));
}

const std::string* KvTable::Find(absl::string_view key) const {
  auto it = map_.find(key);
  return it == map_.end() ? nullptr : &it->second;
}

absl::StatusOr<int64_t> KvTable::Add(absl::string_view key, int64_t delta) {
  auto [it, inserted] = map_.try_emplace(std::string(key), "0");
  int64_t current = 0;
  if (!absl::SimpleAtoi(it->second, &current)) {
    return absl::InvalidArgumentError(absl::StrCat("store Add on key ", PrintableKey(key),
                                                   " whose value is not a decimal int64 (",
                                                   it->second.size(), " bytes)"));
  }
  int64_t sum = 0;
  if (__builtin_add_overflow(current, delta, &sum)) {
    if (inserted) map_.erase(it);
    return absl::InvalidArgumentError(absl::StrCat("store Add on key ", PrintableKey(key), ": ",
                                                   current, " + ", delta, " overflows int64"));
  }
  it->second = absl::StrCat(sum);
  return sum;
}

std::string KvTable::CompareSet(absl::string_view key, absl::string_view expected,
                                absl::string_view desired, bool* changed) {
  auto it = map_.find(key);
  const bool matches = it == map_.end() ? expected.empty() : it->second == expected;
  if (changed != nullptr) *changed = matches;
  if (matches) {
    Set(key, desired);
    return std::string(desired);
  }
  return it == map_.end() ? std::string() : it->second;
}

bool KvTable::ContainsAll(absl::Span<const std::string> keys) const {
  for (const std::string& key : keys) {
    if (!map_.contains(key)) return false;
  }
  return true;
}

std::vector<std::string> KvTable::Missing(absl::Span<const std::string> keys) const {
  std::vector<std::string> missing;
  for (const std::string& key : keys) {
    if (!map_.contains(key)) missing.push_back(key);
  }
  return missing;
}

bool KvTable::Delete(absl::string_view key) { return map_.erase(key) > 0; }

}  // namespace shardline::store_internal
