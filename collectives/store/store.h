// File: collectives/store/store.h
// -----------------------------------------------------------------------------
// The rendezvous store: a small key-value table that every rank of a job can reach, used to
// exchange addresses and unique ids at init and as a barrier of last resort. Three
// implementations share this interface:
//
//   MemoryStore  (memory_store.h)  one process, ranks as threads (unit tests, the local backend)
//   PrefixStore  (prefix_store.h)  a view of another store under "<prefix>/" (sub-groups)
//   TcpStore     (tcp_store.h)     a client of a TcpStoreServer over TCP (multi-process)
//
// Keys are non-empty byte strings, values are byte strings (std::string; may hold any bytes).
// Every implementation is thread-safe. Every call that can block takes an absl::Time deadline;
// a missed deadline is DeadlineExceeded naming the key(s) still missing. The short operations
// (Set, Add, CompareSet, Check, Delete, NumKeys) never wait for another rank; a remote store
// bounds them by its own operation timeout (TcpStoreOptions::timeout).
//
// Counters: Add stores its value as decimal text, so Get after Add returns e.g. "42" and Add on
// a key holding anything other than a decimal int64 is InvalidArgument.

#ifndef SHARDLINE_COLLECTIVES_STORE_STORE_H_
#define SHARDLINE_COLLECTIVES_STORE_STORE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace shardline {

class Store {
 public:
  Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;
  virtual ~Store() = default;

  // Sets `key` to `value`, replacing any previous value, and wakes every Get/Wait on it.
  absl::Status Set(absl::string_view key, absl::string_view value);

  // The value of `key`, blocking until some rank sets it or `deadline` passes
  // (DeadlineExceeded naming the key). The one-argument form waits until DefaultDeadline().
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Time deadline);
  absl::StatusOr<std::string> Get(absl::string_view key);

  // Atomically adds `delta` to the counter `key` (a missing key counts as 0) and returns the new
  // value. InvalidArgument if the key holds a non-integer or the sum overflows int64.
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta);

  // Atomic compare-and-set. A missing key compares equal to the empty string. If the current
  // value equals `expected`, the key is set to `desired`. Returns the value after the call:
  // `desired` if it was swapped in, else the current value ("" for a missing key).
  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired);

  // Blocks until every key in `keys` exists or `deadline` passes (DeadlineExceeded naming the
  // keys still missing). An empty list returns OK at once.
  absl::Status Wait(absl::Span<const std::string> keys, absl::Time deadline);
  absl::Status Wait(absl::Span<const std::string> keys);

  // True if every key in `keys` exists now (never blocks).
  absl::StatusOr<bool> Check(absl::Span<const std::string> keys);

  // Removes `key`; true if it existed.
  absl::StatusOr<bool> Delete(absl::string_view key);

  // The number of keys in the store (for a PrefixStore: in the underlying store).
  absl::StatusOr<int64_t> NumKeys();

  // Logs: a log is the keys "<log>/1", "<log>/2", ... set in order, each once (appended with
  // CompareSet on the first missing index, so an append is atomic and leaves no hole).
  // AppendOnClose registers `entry` to be appended to `log` when this client goes away: its
  // process dies (the connection to a remote store closes) or the store object is destroyed.
  // It is how the elastic protocol (collectives/elastic/) learns that a process is gone without
  // waiting for a deadline. Unimplemented for stores without a connection to lose (MemoryStore);
  // a PrefixStore prefixes the log key.
  absl::Status AppendOnClose(absl::string_view log, absl::string_view entry, absl::Time deadline);

 protected:
  // Implementations override these. The public wrappers above have already checked that every
  // key is non-empty, so implementations may assume it.
  virtual absl::Status DoSet(absl::string_view key, absl::string_view value) = 0;
  virtual absl::StatusOr<std::string> DoGet(absl::string_view key, absl::Time deadline) = 0;
  virtual absl::StatusOr<int64_t> DoAdd(absl::string_view key, int64_t delta) = 0;
  virtual absl::StatusOr<std::string> DoCompareSet(absl::string_view key,
                                                   absl::string_view expected,
                                                   absl::string_view desired) = 0;
  virtual absl::Status DoWait(absl::Span<const std::string> keys, absl::Time deadline) = 0;
  virtual absl::StatusOr<bool> DoCheck(absl::Span<const std::string> keys) = 0;
  virtual absl::StatusOr<bool> DoDelete(absl::string_view key) = 0;
  virtual absl::StatusOr<int64_t> DoNumKeys() = 0;
  virtual absl::Status DoAppendOnClose(absl::string_view log, absl::string_view entry,
                                       absl::Time deadline);
};

// A key made printable for error messages and logs: C-escaped, cut to 120 characters.
std::string PrintableKey(absl::string_view key);

// "'a', 'b' and 3 more": the keys of `keys` that messages name, bounded in length.
std::string PrintableKeys(absl::Span<const std::string> keys);

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_STORE_STORE_H_
