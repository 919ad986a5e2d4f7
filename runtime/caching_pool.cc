#include "runtime/caching_pool.h"

#include <bit>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "runtime/check.h"
#include "runtime/logging.h"

namespace shardline {
namespace {

constexpr size_t kSmallLimit = size_t{64} << 10;
constexpr size_t kSmallGranule = 512;

size_t RoundUp(size_t bytes, size_t granule) {
  const size_t rem = bytes % granule;
  if (rem == 0) return bytes;
  // Sizes within a granule of SIZE_MAX cannot be rounded; the backing allocator rejects them.
  if (bytes > std::numeric_limits<size_t>::max() - (granule - rem)) return bytes;
  return bytes + (granule - rem);
}

}  // namespace

CachingPool::CachingPool(Allocator& backing, CachingPoolOptions options)
    : Allocator(backing.device(), std::move(options.name)),
      backing_(backing),
      max_cached_bytes_(options.max_cached_bytes) {}

CachingPool::~CachingPool() {
  DrainPending();
  std::vector<Buffer> cached;
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    SL_CHECK(in_use_.empty()) << "caching pool '" << name() << "' destroyed while "
                              << in_use_.size() << " of its blocks are handed out";
    cached = TakeCacheLocked();
  }
  // `cached` returns its blocks to the backing allocator here, outside the lock.
}

size_t CachingPool::SizeClass(size_t bytes) {
  if (bytes <= kSmallLimit) return RoundUp(bytes == 0 ? 1 : bytes, kSmallGranule);
  return RoundUp(bytes, std::bit_floor(bytes) / 4);
}

absl::StatusOr<void*> CachingPool::AllocateRaw(size_t bytes, Stream* first_user) {
  const size_t cls = SizeClass(bytes);
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    auto it = cache_.find(cls);
    if (it != cache_.end() && !it->second.empty()) {
      Buffer block = std::move(it->second.back());
      // An emptied class keeps its entry (and the vector's storage) for the block's return.
      it->second.pop_back();
      void* data = block.data();
      in_use_.emplace(data, std::move(block));
      cache_stats_.cached_bytes -= static_cast<int64_t>(cls);
      --cache_stats_.cached_blocks;
      cache_stats_.in_use_bytes += static_cast<int64_t>(cls);
      ++cache_stats_.hits;
      return data;
    }
  }
  if (first_user != nullptr) {
    // Stream-ordered reuse: a block of this class whose last users have not finished yet, once
    // `first_user` waits for them.
    std::optional<PendingBlock> pending =
        TakePending([cls](size_t block_bytes) { return SizeClass(block_bytes) == cls; });
    if (pending.has_value()) {
      absl::Status waited;
      for (const std::shared_ptr<Event>& guard : pending->outstanding) {
        waited = WaitUnlessSameStream(*first_user, guard);
        if (!waited.ok()) break;
      }
      if (waited.ok()) {
        std::lock_guard<std::mutex> lock(pool_mu_);
        ++cache_stats_.stream_ordered_hits;
        return pending->data;  // still in in_use_: it never left
      }
      // `first_user` is poisoned: it will run nothing that could use the block.
      ReturnPending(*std::move(pending));
    }
  }
  // The backing allocator may be slow: not under the pool's lock.
  absl::StatusOr<Buffer> block =
      first_user != nullptr ? backing_.Allocate(cls, *first_user) : backing_.Allocate(cls);
  if (absl::IsResourceExhausted(block.status())) {
    const size_t freed = EmptyCache();
    if (freed > 0) {
      SL_LOG(INFO, ALLOC) << "caching pool '" << name() << "': backing allocator '"
                          << backing_.name() << "' out of memory for " << cls
                          << " bytes; emptied the cache (" << freed << " bytes) and retrying";
      block = first_user != nullptr ? backing_.Allocate(cls, *first_user) : backing_.Allocate(cls);
    }
  }
  if (!block.ok()) return block.status();
  std::lock_guard<std::mutex> lock(pool_mu_);
  void* data = block->data();
  in_use_.emplace(data, *std::move(block));
  cache_stats_.reserved_bytes += static_cast<int64_t>(cls);
  cache_stats_.in_use_bytes += static_cast<int64_t>(cls);
  ++cache_stats_.misses;
  return data;
}

void CachingPool::DeallocateRaw(void* data, size_t bytes) {
  const size_t cls = SizeClass(bytes);
  Buffer release;  // a block that does not fit in the cache; freed after the lock is dropped
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    auto it = in_use_.find(data);
    SL_CHECK(it != in_use_.end()) << "caching pool '" << name() << "': freeing unknown block "
                                  << data;
    Buffer block = std::move(it->second);
    in_use_.erase(it);
    cache_stats_.in_use_bytes -= static_cast<int64_t>(cls);
    const size_t cached = static_cast<size_t>(cache_stats_.cached_bytes);
    if (cls <= max_cached_bytes_ && cached <= max_cached_bytes_ - cls) {
      cache_[cls].push_back(std::move(block));
      cache_stats_.cached_bytes += static_cast<int64_t>(cls);
      ++cache_stats_.cached_blocks;
    } else {
      cache_stats_.reserved_bytes -= static_cast<int64_t>(cls);
      release = std::move(block);
    }
  }
}

void CachingPool::LeakRaw(void* data, size_t bytes) {
  const size_t cls = SizeClass(bytes);
  Buffer block;
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    auto it = in_use_.find(data);
    SL_CHECK(it != in_use_.end()) << "caching pool '" << name() << "': leaking unknown block "
                                  << data;
    block = std::move(it->second);
    in_use_.erase(it);
    cache_stats_.in_use_bytes -= static_cast<int64_t>(cls);
    cache_stats_.reserved_bytes -= static_cast<int64_t>(cls);
  }
  block.Leak();
}

std::vector<Buffer> CachingPool::TakeCacheLocked() {
  std::vector<Buffer> blocks;
  for (auto& [cls, list] : cache_) {
    for (Buffer& b : list) blocks.push_back(std::move(b));
  }
  cache_.clear();
  cache_stats_.reserved_bytes -= cache_stats_.cached_bytes;
  cache_stats_.cached_bytes = 0;
  cache_stats_.cached_blocks = 0;
  return blocks;
}

size_t CachingPool::EmptyCache() {
  Collect();
  std::vector<Buffer> blocks;
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    blocks = TakeCacheLocked();
  }
  size_t bytes = 0;
  for (const Buffer& b : blocks) bytes += b.size();
  blocks.clear();  // returned to the backing allocator here, outside the lock
  return bytes;
}

PoolCacheStats CachingPool::cache_stats() const {
  std::lock_guard<std::mutex> lock(pool_mu_);
  return cache_stats_;
}

}  // namespace shardline
