// File: collectives/store/internal/kv_table.h
// -----------------------------------------------------------------------------
// The non-blocking semantics of a store, shared by MemoryStore and TcpStoreServer so that both
// behave identically: counters as decimal text, compare-set with "missing equals empty".
// Not thread-safe: the owner serialises access (a mutex, or the server's single I/O thread).

#ifndef SHARDLINE_COLLECTIVES_STORE_INTERNAL_KV_TABLE_H_
#define SHARDLINE_COLLECTIVES_STORE_INTERNAL_KV_TABLE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace shardline::store_internal {

class KvTable {
 public:
  void Set(absl::string_view key, absl::string_view value);
  // nullptr if missing. Valid until the next mutation.
  const std::string* Find(absl::string_view key) const;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta);
  // Returns the value after the call; `*changed` (optional) says whether the key was written.
  std::string CompareSet(absl::string_view key, absl::string_view expected,
                         absl::string_view desired, bool* changed = nullptr);
  bool ContainsAll(absl::Span<const std::string> keys) const;
  // The keys of `keys` that are missing, in order.
  std::vector<std::string> Missing(absl::Span<const std::string> keys) const;
  bool Delete(absl::string_view key);
  int64_t size() const { return static_cast<int64_t>(map_.size()); }
  void Clear() { map_.clear(); }

 private:
  absl::flat_hash_map<std::string, std::string> map_;
};

}  // namespace shardline::store_internal

#endif  // SHARDLINE_COLLECTIVES_STORE_INTERNAL_KV_TABLE_H_
