// File: collectives/elastic/store_log.h
// -----------------------------------------------------------------------------
// One log in a store (store.h, "Logs": the keys "<key>/1", "<key>/2", ..., each written once),
// as the elastic protocol uses it: appends by compare-and-set on the first index not yet read
// (so an append is atomic and leaves no hole; entries must be unique, so that finding one's own
// entry at an index means it landed there), and reads in order, each blocking until the next
// entry exists or a deadline passes.

#ifndef SHARDLINE_COLLECTIVES_ELASTIC_STORE_LOG_H_
#define SHARDLINE_COLLECTIVES_ELASTIC_STORE_LOG_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collectives/store/store.h"

namespace shardline::elastic {

class StoreLog {
 public:
  // Borrows `store`, which must outlive the log.
  StoreLog(Store& store, std::string key) : store_(&store), key_(std::move(key)) {}

  const std::string& key() const { return key_; }
  // Entries read so far.
  int64_t read() const { return read_; }

  absl::Status Append(absl::string_view entry);
  // The next entry; nullopt if none appeared before `until`.
  absl::StatusOr<std::optional<std::string>> Next(absl::Time until);
  // The next entry if it exists now (waits only for the store's answers, until `deadline`).
  absl::StatusOr<std::optional<std::string>> TryNext(absl::Time deadline);

 private:
  std::string Key(int64_t index) const;

  Store* store_;
  std::string key_;
  int64_t read_ = 0;
  int64_t appended_ = 0;  // the index of this log's last own append (every index before is set)
};

}  // namespace shardline::elastic

#endif  // SHARDLINE_COLLECTIVES_ELASTIC_STORE_LOG_H_
