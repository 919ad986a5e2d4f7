// File: collectives/store/memory_store.h
// -----------------------------------------------------------------------------
// An in-process Store: a table under one mutex, with a condition variable that Get and Wait
// block on until a writer changes the table or their deadline passes (no polling). For ranks
// as threads (unit tests, the local backend) — share one MemoryStore between them.

#ifndef SHARDLINE_COLLECTIVES_STORE_MEMORY_STORE_H_
#define SHARDLINE_COLLECTIVES_STORE_MEMORY_STORE_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "collectives/store/store.h"

namespace shardline {

namespace store_internal {
class KvTable;  // the table's semantics, shared with the TCP store server (not installed)
}  // namespace store_internal

class MemoryStore final : public Store {
 public:
  MemoryStore();
  ~MemoryStore() override;

 protected:
  absl::Status DoSet(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> DoGet(absl::string_view key, absl::Time deadline) override;
  absl::StatusOr<int64_t> DoAdd(absl::string_view key, int64_t delta) override;
  absl::StatusOr<std::string> DoCompareSet(absl::string_view key, absl::string_view expected,
                                           absl::string_view desired) override;
  absl::Status DoWait(absl::Span<const std::string> keys, absl::Time deadline) override;
  absl::StatusOr<bool> DoCheck(absl::Span<const std::string> keys) override;
  absl::StatusOr<bool> DoDelete(absl::string_view key) override;
  absl::StatusOr<int64_t> DoNumKeys() override;

 private:
  // Blocks on cv_ until `ready()` holds or `deadline` passes; returns ready().
  template <typename Pred>
  bool WaitUntil(std::unique_lock<std::mutex>& lock, absl::Time deadline, Pred ready);

  std::mutex mu_;
  std::condition_variable cv_;
  const std::unique_ptr<store_internal::KvTable> table_;  // guarded by mu_
};

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_STORE_MEMORY_STORE_H_
