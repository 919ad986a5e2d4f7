// File: collectives/store/prefix_store.h
// -----------------------------------------------------------------------------
// A view of another store in which every key is "<prefix>/<key>": sub-groups of a job share
// one store without their keys colliding. Nesting works (PrefixStore over a PrefixStore gives
// "outer/inner/key"). NumKeys() counts the keys of the whole underlying store, not only this
// prefix (a remote store has no cheap way to count by prefix).

#ifndef SHARDLINE_COLLECTIVES_STORE_PREFIX_STORE_H_
#define SHARDLINE_COLLECTIVES_STORE_PREFIX_STORE_H_

#include <memory>
#include <string>
#include <vector>

#include "collectives/store/store.h"

namespace shardline {

class PrefixStore final : public Store {
 public:
  // Borrows `base`, which must outlive this store.
  PrefixStore(absl::string_view prefix, Store& base);
  // Shares ownership of `base` (must not be null).
  PrefixStore(absl::string_view prefix, std::shared_ptr<Store> base);
  ~PrefixStore() override = default;

  const std::string& prefix() const { return prefix_; }
  Store& base() const { return *base_; }

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
  absl::Status DoAppendOnClose(absl::string_view log, absl::string_view entry,
                               absl::Time deadline) override;

 private:
  std::string Prefixed(absl::string_view key) const;
  std::vector<std::string> Prefixed(absl::Span<const std::string> keys) const;

  std::string prefix_;
  std::shared_ptr<Store> owned_;  // null when borrowed
  Store* base_;
};

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_STORE_PREFIX_STORE_H_
