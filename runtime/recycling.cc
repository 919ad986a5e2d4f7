#include "runtime/recycling.h"

#include <algorithm>

#include "runtime/internal/lock_spinning.h"

namespace shardline::recycling_internal {

size_t BlockList::TakeMany(void** out, size_t n) {
  std::unique_lock<std::mutex> lock = stream_internal::LockSpinning(mu_);
  const size_t taken = std::min(n, blocks_.size());
  for (size_t i = 0; i < taken; ++i) {
    out[i] = blocks_.back();
    blocks_.pop_back();
  }
  return taken;
}

size_t BlockList::GiveMany(void* const* blocks, size_t n) {
  std::unique_lock<std::mutex> lock = stream_internal::LockSpinning(mu_);
  const size_t given = std::min(n, kMaxBlocks - blocks_.size());
  blocks_.insert(blocks_.end(), blocks, blocks + given);
  return given;
}

}  // namespace shardline::recycling_internal
