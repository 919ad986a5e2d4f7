#include "runtime/recycling.h"

#include "runtime/internal/lock_spinning.h"

namespace shardline::recycling_internal {

void* BlockList::Take() {
  std::unique_lock<std::mutex> lock = stream_internal::LockSpinning(mu_);
  if (blocks_.empty()) return nullptr;
  void* block = blocks_.back();
  blocks_.pop_back();
  return block;
}

bool BlockList::Give(void* block) {
  std::unique_lock<std::mutex> lock = stream_internal::LockSpinning(mu_);
  if (blocks_.size() >= kMaxBlocks) return false;
  blocks_.push_back(block);
  return true;
}

}  // namespace shardline::recycling_internal
