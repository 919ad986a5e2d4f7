// File: runtime/caching_pool.h
// -----------------------------------------------------------------------------
// A caching allocator over any backing Allocator (host, pinned, CUDA): freed blocks are kept
// and handed out again to requests of the same size class, so steady-state training allocates
// nothing from the backing allocator (cudaMalloc and cudaFree synchronize the device; this does
// not).
//
// Size classes (SizeClass()):
//   bytes <= 64 KiB   rounded up to a multiple of 512 bytes      (waste < 512 bytes)
//   bytes >  64 KiB   rounded up to a multiple of 2^k / 4, where 2^k <= bytes < 2^(k+1),
//                     i.e. classes 2^k, 1.25·2^k, 1.5·2^k, 1.75·2^k (waste < 25% of the request)
// A request is served only by a cached block of exactly its class.
//
// Reuse is safe across streams: a Buffer released with ReleaseAfter(event) stays in the base
// Allocator's pending set until every event completed, and only then reaches the cache (the
// pool's DeallocateRaw). Until then the block counts as in use. Allocate(bytes, first_user)
// serves a request in this order: a cached block of its class (a hit); a pending block of its
// class, after `first_user` waits for its outstanding guards (a stream-ordered hit: the host
// never waits); a new block from the backing allocator (a miss, counted).
//
// Accounting: the pool's own stats() count the bytes handed out (requested sizes, as for every
// allocator); the backing allocator's stats count what the pool reserved (class sizes, cached
// blocks included). cache_stats() reports both sides from the pool's point of view.
//
// If the backing allocator runs out of memory, the pool empties its cache and retries once. The
// emptied blocks' memory really goes back: for shareable host memory too, whose freed pages
// leave the arena even while peers map it (runtime/shared_memory.h).
// The backing allocator must outlive the pool. Thread safety: as every Allocator.

#ifndef SHARDLINE_RUNTIME_CACHING_POOL_H_
#define SHARDLINE_RUNTIME_CACHING_POOL_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "runtime/allocator.h"

namespace shardline {

struct CachingPoolOptions {
  std::string name = "pool";
  // The most bytes kept in free (cached) blocks; a freed block that would exceed it goes back to
  // the backing allocator at once. 0 caches nothing; the default is unlimited.
  size_t max_cached_bytes = std::numeric_limits<size_t>::max();
};

struct PoolCacheStats {
  int64_t reserved_bytes = 0;  // held from the backing allocator: in use + cached
  int64_t in_use_bytes = 0;    // class bytes of blocks handed out (guarded ones included)
  int64_t cached_bytes = 0;    // class bytes of free blocks kept for reuse
  int64_t cached_blocks = 0;
  int64_t hits = 0;                 // requests served from the cache
  int64_t stream_ordered_hits = 0;  // requests served by a pending block after a stream wait
  int64_t misses = 0;               // requests that went to the backing allocator
};

class CachingPool : public Allocator {
 public:
  explicit CachingPool(Allocator& backing, CachingPoolOptions options = {});
  // Waits for guarded blocks (DrainPending), then returns every cached block to the backing
  // allocator. A guarded block whose readers did not finish is leaked in the backing allocator
  // too (Buffer::Leak: counted there, never freed). Blocks still handed out are a bug (checked).
  ~CachingPool() override;

  // The size class of a request of `bytes` > 0 (see the table above).
  static size_t SizeClass(size_t bytes);

  // Frees the guarded blocks whose events completed (Collect()), then returns every cached block
  // to the backing allocator. Returns the bytes returned.
  size_t EmptyCache();

  PoolCacheStats cache_stats() const;
  Allocator& backing() const { return backing_; }

 protected:
  absl::StatusOr<void*> AllocateRaw(size_t bytes, Stream* first_user) override;
  void DeallocateRaw(void* data, size_t bytes) override;
  void LeakRaw(void* data, size_t bytes) override;

 private:
  // Moves every cached block out (pool_mu_ held).
  std::vector<Buffer> TakeCacheLocked();

  Allocator& backing_;
  const size_t max_cached_bytes_;

  mutable std::mutex pool_mu_;
  absl::flat_hash_map<void*, Buffer> in_use_;    // handed-out blocks, by address
  std::map<size_t, std::vector<Buffer>> cache_;  // free blocks, by size class
  PoolCacheStats cache_stats_;
};

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_CACHING_POOL_H_
