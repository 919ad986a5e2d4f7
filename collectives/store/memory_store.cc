#include "collectives/store/memory_store.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collectives/store/internal/kv_table.h"

namespace shardline {

MemoryStore::MemoryStore() : table_(std::make_unique<store_internal::KvTable>()) {}

MemoryStore::~MemoryStore() = default;

template <typename Pred>
bool MemoryStore::WaitUntil(std::unique_lock<std::mutex>& lock, absl::Time deadline, Pred ready) {
  if (deadline == absl::InfiniteFuture()) {
    cv_.wait(lock, ready);
    return true;
  }
  // A system_clock time point: absl::Time is wall-clock, and libstdc++ waits on it with
  // pthread_cond_timedwait, which every sanitizer intercepts.
  return cv_.wait_until(lock, absl::ToChronoTime(deadline), ready);
}

absl::Status MemoryStore::DoSet(absl::string_view key, absl::string_view value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    table_->Set(key, value);
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<std::string> MemoryStore::DoGet(absl::string_view key, absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!WaitUntil(lock, deadline, [&] { return table_->Find(key) != nullptr; })) {
    return absl::DeadlineExceededError(
        absl::StrCat("store Get: key ", PrintableKey(key), " was not set before the deadline"));
  }
  return *table_->Find(key);
}

absl::StatusOr<int64_t> MemoryStore::DoAdd(absl::string_view key, int64_t delta) {
  absl::StatusOr<int64_t> result;
  {
    std::lock_guard<std::mutex> lock(mu_);
    result = table_->Add(key, delta);
  }
  if (result.ok()) cv_.notify_all();
  return result;
}

absl::StatusOr<std::string> MemoryStore::DoCompareSet(absl::string_view key,
                                                      absl::string_view expected,
                                                      absl::string_view desired) {
  bool changed = false;
  std::string result;
  {
    std::lock_guard<std::mutex> lock(mu_);
    result = table_->CompareSet(key, expected, desired, &changed);
  }
  if (changed) cv_.notify_all();
  return result;
}

absl::Status MemoryStore::DoWait(absl::Span<const std::string> keys, absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!WaitUntil(lock, deadline, [&] { return table_->ContainsAll(keys); })) {
    return absl::DeadlineExceededError(absl::StrCat(
        "store Wait: keys ", PrintableKeys(table_->Missing(keys)), " not set before the deadline"));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> MemoryStore::DoCheck(absl::Span<const std::string> keys) {
  std::lock_guard<std::mutex> lock(mu_);
  return table_->ContainsAll(keys);
}

absl::StatusOr<bool> MemoryStore::DoDelete(absl::string_view key) {
  std::lock_guard<std::mutex> lock(mu_);
  return table_->Delete(key);
}

absl::StatusOr<int64_t> MemoryStore::DoNumKeys() {
  std::lock_guard<std::mutex> lock(mu_);
  return table_->size();
}

}  // namespace shardline
