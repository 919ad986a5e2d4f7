// Tests of runtime/caching_pool.h: size classes against an independent definition, reuse of a
// block only after its guard events complete (test-controlled events and a real host stream),
// accounting of the pool against its backing allocator, EmptyCache, the cache limit, the
// out-of-memory retry, concurrency.

#include "runtime/caching_pool.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "runtime/allocator.h"
#include "runtime/status.h"
#include "runtime/stream.h"
#include "tests/common/gate.h"
#include "tests/common/rank_threads.h"
#include "tests/runtime/manual_event.h"

namespace shardline {
namespace {

using ::shardline::testing::RunRankThreads;
using testing::ManualEvent;

// A host allocator with a hard capacity, to make the backing allocator run out on purpose.
class LimitedAllocator final : public Allocator {
 public:
  explicit LimitedAllocator(size_t capacity)
      : Allocator(Device::Host(), "limited"), capacity_(capacity) {}
  ~LimitedAllocator() override { DrainPending(); }

 protected:
  absl::StatusOr<void*> AllocateRaw(size_t bytes, Stream*) override {
    if (used_ + bytes > capacity_) return absl::ResourceExhaustedError("over capacity");
    used_ += bytes;
    return std::malloc(bytes);
  }
  void DeallocateRaw(void* data, size_t bytes) override {
    used_ -= bytes;
    std::free(data);
  }

 private:
  const size_t capacity_;
  std::atomic<size_t> used_{0};
};

// The size classes written out independently of the implementation: the smallest allowed value
// >= bytes, by search over the allowed set.
size_t RefSizeClass(size_t bytes) {
  if (bytes <= 65536) return (bytes + 511) / 512 * 512 + (bytes == 0 ? 512 : 0);
  size_t p = 65536;
  while (p * 2 <= bytes) p *= 2;
  for (size_t q : {4, 5, 6, 7, 8}) {
    if (p / 4 * q >= bytes) return p / 4 * q;
  }
  return 0;
}

TEST(CachingPoolTest, SizeClasses) {
  std::mt19937_64 rng(1);
  std::vector<size_t> sizes;
  for (size_t n = 1; n <= 300000; n += (n < 70000 ? 1 : 97)) sizes.push_back(n);
  for (int i = 0; i < 100000; ++i) sizes.push_back(1 + rng() % (size_t{1} << (rng() % 40)));
  for (size_t p = 1; p < (size_t{1} << 40); p *= 2) {
    for (size_t d : {p - 1, p, p + 1}) sizes.push_back(std::max<size_t>(d, 1));
  }
  for (size_t n : sizes) {
    const size_t c = CachingPool::SizeClass(n);
    ASSERT_EQ(c, RefSizeClass(n)) << n;
    ASSERT_GE(c, n);
    ASSERT_EQ(CachingPool::SizeClass(c), c) << n;  // classes are fixed points
    if (n <= 65536) {
      ASSERT_LT(c - n, 512u) << n;
    } else {
      ASSERT_LT(static_cast<double>(c - n), 0.25 * static_cast<double>(n)) << n;
    }
  }
}

TEST(CachingPoolTest, ReusesTheSameBlockOnlyAfterItsGuardCompletes) {
  auto host = CreateHostAllocator();
  CachingPool pool(*host);
  auto event = ManualEvent::Create();
  absl::StatusOr<Buffer> a = pool.Allocate(1000);
  ASSERT_TRUE(a.ok());
  void* const first = a->data();
  a->ReleaseAfter(event);
  a->Reset();

  // The reader has not finished: a same-class request gets a different block.
  absl::StatusOr<Buffer> b = pool.Allocate(1000);
  ASSERT_TRUE(b.ok());
  EXPECT_NE(b->data(), first);
  EXPECT_EQ(pool.cache_stats().hits, 0);

  event->Complete();
  // Same class (1000 and 1024 both round to 1024): the identical block comes back.
  absl::StatusOr<Buffer> c = pool.Allocate(1024);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->data(), first);
  EXPECT_EQ(pool.cache_stats().hits, 1);
  EXPECT_EQ(pool.cache_stats().misses, 2);
}

TEST(CachingPoolTest, UnguardedReleaseIsReusedAtOnceAndOnlyWithinItsClass) {
  auto host = CreateHostAllocator();
  CachingPool pool(*host);
  absl::StatusOr<Buffer> a = pool.Allocate(3000);
  ASSERT_TRUE(a.ok());
  void* const p = a->data();
  a->Reset();
  absl::StatusOr<Buffer> other_class = pool.Allocate(5000);
  ASSERT_TRUE(other_class.ok());
  EXPECT_NE(other_class->data(), p);
  absl::StatusOr<Buffer> same_class = pool.Allocate(2600);  // 2560 < 2600 <= 3072
  ASSERT_TRUE(same_class.ok());
  EXPECT_EQ(same_class->data(), p);
  EXPECT_EQ(same_class->size(), 2600u);
  EXPECT_EQ(same_class->allocator(), &pool);
}

TEST(CachingPoolTest, AccountingOfPoolAndBacking) {
  auto host = CreateHostAllocator(64, "backing");
  CachingPool pool(*host, {.name = "pool"});
  const std::vector<size_t> requests = {1, 1000, 70000, 513, 200000};
  std::vector<Buffer> live;
  int64_t requested = 0, reserved = 0;
  for (size_t n : requests) {
    absl::StatusOr<Buffer> b = pool.Allocate(n);
    ASSERT_TRUE(b.ok());
    live.push_back(*std::move(b));
    requested += static_cast<int64_t>(n);
    reserved += static_cast<int64_t>(RefSizeClass(n));
  }
  // The pool counts what it handed out, the backing allocator what the pool reserved.
  EXPECT_EQ(pool.stats().current_bytes, requested);
  EXPECT_EQ(pool.stats().live_allocations, 5);
  EXPECT_EQ(host->stats().current_bytes, reserved);
  EXPECT_EQ(host->stats().live_allocations, 5);
  PoolCacheStats cs = pool.cache_stats();
  EXPECT_EQ(cs.reserved_bytes, reserved);
  EXPECT_EQ(cs.in_use_bytes, reserved);
  EXPECT_EQ(cs.cached_bytes, 0);

  // Free two: the pool's usage drops, the backing allocator's does not (cached).
  const int64_t freed_requested = static_cast<int64_t>(live[1].size() + live[4].size());
  const int64_t freed_classes = static_cast<int64_t>(RefSizeClass(1000) + RefSizeClass(200000));
  live[1].Reset();
  live[4].Reset();
  EXPECT_EQ(pool.stats().current_bytes, requested - freed_requested);
  EXPECT_EQ(pool.stats().peak_bytes, requested);
  EXPECT_EQ(host->stats().current_bytes, reserved);
  cs = pool.cache_stats();
  EXPECT_EQ(cs.cached_bytes, freed_classes);
  EXPECT_EQ(cs.cached_blocks, 2);
  EXPECT_EQ(cs.in_use_bytes, reserved - freed_classes);
  EXPECT_EQ(cs.reserved_bytes, cs.in_use_bytes + cs.cached_bytes);

  // EmptyCache hands the free blocks back to the backing allocator.
  EXPECT_EQ(pool.EmptyCache(), static_cast<size_t>(freed_classes));
  EXPECT_EQ(host->stats().current_bytes, reserved - freed_classes);
  EXPECT_EQ(host->stats().live_allocations, 3);
  EXPECT_EQ(pool.cache_stats().cached_bytes, 0);
  EXPECT_EQ(pool.cache_stats().reserved_bytes, reserved - freed_classes);

  live.clear();
  EXPECT_EQ(pool.stats().current_bytes, 0);
  EXPECT_EQ(pool.EmptyCache(), static_cast<size_t>(reserved - freed_classes));
  EXPECT_EQ(host->stats().current_bytes, 0);
  EXPECT_EQ(host->stats().live_allocations, 0);
}

TEST(CachingPoolTest, EmptyCacheLeavesGuardedBlocksAlone) {
  auto host = CreateHostAllocator();
  CachingPool pool(*host);
  auto event = ManualEvent::Create();
  absl::StatusOr<Buffer> a = pool.Allocate(4096);
  ASSERT_TRUE(a.ok());
  a->ReleaseAfter(event);
  a->Reset();
  EXPECT_EQ(pool.EmptyCache(), 0u);  // still guarded: neither cached nor returned
  EXPECT_EQ(host->stats().current_bytes, 4096);
  EXPECT_EQ(pool.stats().current_bytes, 4096);
  event->Complete();
  EXPECT_EQ(pool.EmptyCache(), 4096u);  // collected, then returned
  EXPECT_EQ(host->stats().current_bytes, 0);
  EXPECT_EQ(pool.stats().current_bytes, 0);
}

TEST(CachingPoolTest, MaxCachedBytes) {
  auto host = CreateHostAllocator();
  CachingPool pool(*host, {.name = "small-cache", .max_cached_bytes = 2048});
  absl::StatusOr<Buffer> a = pool.Allocate(1024);
  absl::StatusOr<Buffer> b = pool.Allocate(1024);
  absl::StatusOr<Buffer> c = pool.Allocate(1024);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  a->Reset();
  b->Reset();
  c->Reset();  // would exceed 2048 cached bytes: returned to the backing allocator
  EXPECT_EQ(pool.cache_stats().cached_bytes, 2048);
  EXPECT_EQ(host->stats().current_bytes, 2048);

  CachingPool none(*host, {.name = "no-cache", .max_cached_bytes = 0});
  absl::StatusOr<Buffer> d = none.Allocate(100);
  ASSERT_TRUE(d.ok());
  d->Reset();
  EXPECT_EQ(none.cache_stats().cached_bytes, 0);
  EXPECT_EQ(host->stats().current_bytes, 2048);
}

TEST(CachingPoolTest, OutOfMemoryEmptiesTheCacheAndRetries) {
  LimitedAllocator limited(8192);
  CachingPool pool(limited);
  absl::StatusOr<Buffer> a = pool.Allocate(6000);  // class 6144
  ASSERT_TRUE(a.ok());
  a->Reset();  // cached: the backing allocator is still 6144 of 8192 full
  absl::StatusOr<Buffer> b = pool.Allocate(4000);  // class 4096: needs the cached block freed
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(limited.stats().current_bytes, 4096);
  // Beyond capacity even with an empty cache: ResourceExhausted naming the pool.
  absl::StatusOr<Buffer> c = pool.Allocate(8000);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("'pool'"), absl::string_view::npos) << c.status();
  EXPECT_NE(c.status().message().find("'limited'"), absl::string_view::npos) << c.status();
}

TEST(CachingPoolTest, DestructorDrainsGuardedBlocksAndReturnsTheCache) {
  auto host = CreateHostAllocator();
  auto event = ManualEvent::Create();
  {
    CachingPool pool(*host);
    absl::StatusOr<Buffer> a = pool.Allocate(100);
    absl::StatusOr<Buffer> b = pool.Allocate(100000);
    ASSERT_TRUE(a.ok() && b.ok());
    a->ReleaseAfter(event);
    a->Reset();
    b->Reset();
    event->Complete();
  }
  EXPECT_EQ(host->stats().current_bytes, 0);
  EXPECT_EQ(host->stats().live_allocations, 0);
}

// Reuse across a real host stream: the block a stream is still reading is not handed out
// again until the event recorded after the read has completed.
TEST(CachingPoolTest, RealHostStreamGuard) {
  auto host = CreateHostAllocator();
  CachingPool pool(*host);
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream({.name = "reader"});
  ASSERT_TRUE(stream.ok()) << stream.status();
  auto gate = ManualEvent::Create();
  absl::StatusOr<Buffer> a = pool.Allocate(2048);
  ASSERT_TRUE(a.ok());
  std::memset(a->data(), 7, 2048);
  void* const block = a->data();
  const std::byte* data = a->as<std::byte>();
  std::atomic<int> first_byte{0};
  ASSERT_TRUE((*stream)
                  ->Enqueue([gate, data, &first_byte]() -> absl::Status {
                    SL_RETURN_IF_ERROR(gate->Synchronize(absl::Now() + absl::Seconds(30)));
                    first_byte = static_cast<int>(data[0]);
                    return absl::OkStatus();
                  })
                  .ok());
  absl::StatusOr<std::shared_ptr<Event>> read = RecordEvent(**stream);
  ASSERT_TRUE(read.ok());
  a->ReleaseAfter(*read);
  a->Reset();
  absl::StatusOr<Buffer> b = pool.Allocate(2048);  // reader still blocked
  ASSERT_TRUE(b.ok());
  EXPECT_NE(b->data(), block);
  std::memset(b->data(), 9, 2048);  // must not disturb the reader's block
  gate->Complete();
  ASSERT_TRUE((*read)->Synchronize(absl::Now() + absl::Seconds(30)).ok());
  EXPECT_EQ(first_byte.load(), 7);
  absl::StatusOr<Buffer> c = pool.Allocate(2048);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->data(), block);
}

// A block whose last reader has not finished is handed to the next user of another stream
// after that stream waits for the reader: the host does not block, nothing new is allocated, and
// the new user's writes come after the old reader's reads.
TEST(CachingPoolTest, StreamOrderedReuseMakesTheFirstUserWaitForTheLastReader) {
  auto host = CreateHostAllocator();
  CachingPool pool(*host);
  auto reader = *CreateHostStream({.name = "compute"});
  auto writer = *CreateHostStream({.name = "gather"});
  constexpr size_t kBytes = 200000;
  absl::StatusOr<Buffer> a = pool.Allocate(kBytes, *writer);
  ASSERT_TRUE(a.ok());
  std::memset(a->data(), 7, kBytes);
  void* const block = a->data();
  auto* bytes = a->as<unsigned char>();
  testing::Gate gate;
  std::atomic<int> seen_sum{0};
  ASSERT_TRUE(reader
                  ->Enqueue([&gate, bytes, &seen_sum] {
                    gate.Wait();
                    int sum = 0;
                    for (size_t i = 0; i < kBytes; i += 4096) sum += bytes[i];
                    seen_sum = sum;
                    return absl::OkStatus();
                  })
                  .ok());
  a->ReleaseAfter(*RecordEvent(*reader));
  a->Reset();
  const PoolCacheStats before = pool.cache_stats();
  // The reader is still blocked: a plain Allocate cannot reuse the block...
  absl::StatusOr<Buffer> plain = pool.Allocate(kBytes);
  ASSERT_TRUE(plain.ok());
  EXPECT_NE(plain->data(), block);
  EXPECT_EQ(pool.cache_stats().misses, before.misses + 1) << "a miss is counted";
  // ...a stream-ordered one can, after making the writer wait (`plain` stays alive: a cached
  // block would be preferred).
  absl::StatusOr<Buffer> b = pool.Allocate(kBytes - 100, *writer);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->data(), block);
  EXPECT_EQ(pool.cache_stats().stream_ordered_hits, before.stream_ordered_hits + 1);
  EXPECT_EQ(pool.stats().stream_ordered_reuses, 1);
  auto* mine = b->as<unsigned char>();
  ASSERT_TRUE(writer
                  ->Enqueue([mine] {
                    std::memset(mine, 9, kBytes - 100);
                    return absl::OkStatus();
                  })
                  .ok());
  // The writer is held back by the reader: nothing written yet.
  EXPECT_FALSE(writer->Synchronize(absl::Now() + absl::Milliseconds(30)).ok());
  gate.Open();
  ASSERT_TRUE(writer->Synchronize(absl::Now() + absl::Seconds(30)).ok());
  EXPECT_EQ(seen_sum.load(), 7 * static_cast<int>((kBytes + 4095) / 4096));
  EXPECT_EQ(mine[0], 9);
  // Exact accounting: the two live buffers.
  EXPECT_EQ(pool.stats().current_bytes, static_cast<int64_t>(2 * kBytes - 100));
  EXPECT_EQ(pool.stats().live_allocations, 2);
}

// Same-stream reuse needs no wait at all: stream order covers it. On a caller stream a wait
// would block the calling thread until the guard completes; here the guard's work (on another
// thread of the same caller stream) only finishes after the reuse returned.
TEST(CachingPoolTest, SameStreamReuseNeedsNoWait) {
  auto host = CreateHostAllocator();
  CachingPool pool(*host);
  auto compute = *CreateCallerStream({.name = "compute"});
  testing::Gate started, gate;
  std::atomic<bool> gate_opened_in_time{false};
  std::thread worker([&] {
    EXPECT_TRUE(compute
                    ->Enqueue([&] {
                      started.Open();
                      gate_opened_in_time = gate.Wait();
                      return absl::OkStatus();
                    })
                    .ok());
  });
  ASSERT_TRUE(started.Wait());
  absl::StatusOr<Buffer> a = pool.Allocate(5000, *compute);
  ASSERT_TRUE(a.ok());
  void* const block = a->data();
  a->ReleaseAfter(*RecordEvent(*compute));  // pending until the worker's item ends
  a->Reset();
  absl::StatusOr<Buffer> b = pool.Allocate(5000, *compute);  // must not block
  ASSERT_TRUE(b.ok());
  gate.Open();
  worker.join();
  EXPECT_TRUE(gate_opened_in_time) << "the reuse blocked the calling thread";
  EXPECT_EQ(b->data(), block);
  EXPECT_EQ(pool.cache_stats().stream_ordered_hits, 1);
}

// A guard whose work fails poisons the stream that reuses its block (the memory's last user
// failed), and a poisoned first user gets a fresh block's error path, never a block under a
// running reader.
TEST(CachingPoolTest, StreamOrderedReuseCarriesTheReadersFailure) {
  auto host = CreateHostAllocator();
  CachingPool pool(*host);
  auto reader = *CreateHostStream({.name = "compute"});
  auto writer = *CreateHostStream({.name = "gather"});
  testing::Gate gate;
  ASSERT_TRUE(reader
                  ->Enqueue([&gate] {
                    gate.Wait();
                    return absl::InternalError("the reader's kernel failed");
                  })
                  .ok());
  absl::StatusOr<Buffer> a = pool.Allocate(3000);
  ASSERT_TRUE(a.ok());
  a->ReleaseAfter(*RecordEvent(*reader));
  a->Reset();
  absl::StatusOr<Buffer> b = pool.Allocate(3000, *writer);
  ASSERT_TRUE(b.ok());
  gate.Open();
  EXPECT_EQ(writer->Synchronize(absl::Now() + absl::Seconds(30)).code(),
            absl::StatusCode::kInternal);
}

// A block taken for stream-ordered reuse leaves its guards' callbacks registered: when they run
// later they must change nothing, neither the blocks released meanwhile (which the allocator
// keeps in recycled records) nor, once the pool is gone, anything at all.
TEST(CachingPoolTest, LateGuardCallbacksOfATakenBlockChangeNothing) {
  auto host = CreateHostAllocator();
  auto pool = std::make_unique<CachingPool>(*host);
  auto writer = *CreateHostStream({.name = "gather"});
  constexpr size_t kBytes = 7001;
  auto e1 = ManualEvent::Create(), e2 = ManualEvent::Create(), e3 = ManualEvent::Create(),
       e4 = ManualEvent::Create();
  absl::StatusOr<Buffer> a = pool->Allocate(kBytes);
  ASSERT_TRUE(a.ok());
  void* const x = a->data();
  a->ReleaseAfter(e1);
  a->ReleaseAfter(e2);
  a->ReleaseAfter(e1);  // the same event twice is one guard
  a->Reset();
  e1->Complete();
  EXPECT_EQ(pool->pending_blocks(), 1);
  // Taken for reuse while e2 is outstanding: the writer waits for e2.
  absl::StatusOr<Buffer> b = pool->Allocate(kBytes, *writer);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->data(), x);
  EXPECT_EQ(pool->pending_blocks(), 0);
  // Two blocks released while e2's callback (of the taken block) is still registered.
  absl::StatusOr<Buffer> c = pool->Allocate(kBytes), d = pool->Allocate(kBytes);
  ASSERT_TRUE(c.ok() && d.ok());
  c->ReleaseAfter(e3);
  c->Reset();
  e2->Complete();  // the taken block's late callback
  d->ReleaseAfter(e4);
  d->Reset();
  EXPECT_EQ(pool->pending_blocks(), 2);
  EXPECT_EQ(pool->Collect(), 0) << "e2 completed no block of the set";
  e4->Complete();
  EXPECT_EQ(pool->Collect(), 1);
  EXPECT_EQ(pool->pending_blocks(), 1);
  e3->Complete();
  EXPECT_EQ(pool->Collect(), 1);
  EXPECT_EQ(pool->pending_blocks(), 0);
  ASSERT_TRUE(writer->Synchronize(absl::Now() + absl::Seconds(30)).ok());
  EXPECT_EQ(pool->stats().live_allocations, 1);  // b
  EXPECT_EQ(pool->stats().current_bytes, static_cast<int64_t>(kBytes));

  // The same once the pool is gone: the late callback runs after its allocator was destroyed.
  auto e5 = ManualEvent::Create(), e6 = ManualEvent::Create();
  pool->EmptyCache();  // c's and d's blocks: the next allocation must take b's pending one
  b->ReleaseAfter(e5);
  b->ReleaseAfter(e6);
  b->Reset();
  e5->Complete();
  absl::StatusOr<Buffer> f = pool->Allocate(kBytes, *writer);  // takes the block; waits for e6
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->data(), x);
  f->Reset();
  pool.reset();
  e6->Complete();
  ASSERT_TRUE(writer->Synchronize(absl::Now() + absl::Seconds(30)).ok());
  EXPECT_EQ(host->stats().live_allocations, 0);
}

TEST(CachingPoolTest, ConcurrentUseKeepsExactCounts) {
  auto host = CreateHostAllocator();
  CachingPool pool(*host);
  constexpr int kThreads = 4;
  constexpr int kIters = 400;
  RunRankThreads(kThreads, [&](int t) {
    std::mt19937 rng(t);
    std::vector<Buffer> keep;
    std::vector<std::shared_ptr<ManualEvent>> events;
    for (int i = 0; i < kIters; ++i) {
      absl::StatusOr<Buffer> b = pool.Allocate(1 + rng() % 20000);
      ASSERT_TRUE(b.ok());
      std::memset(b->data(), t, b->size());
      if (rng() % 4 == 0) {
        auto e = ManualEvent::Create();
        b->ReleaseAfter(e);
        events.push_back(e);
      }
      keep.push_back(*std::move(b));
      if (keep.size() > 6) keep.erase(keep.begin());
      if (events.size() > 3) {
        events.front()->Complete();
        events.erase(events.begin());
      }
    }
    keep.clear();
    for (auto& e : events) e->Complete();
  });
  pool.Collect();
  EXPECT_EQ(pool.stats().current_bytes, 0);
  EXPECT_EQ(pool.stats().live_allocations, 0);
  EXPECT_EQ(pool.stats().total_allocations, kThreads * kIters);
  const PoolCacheStats cs = pool.cache_stats();
  EXPECT_EQ(cs.in_use_bytes, 0);
  EXPECT_EQ(cs.reserved_bytes, cs.cached_bytes);
  EXPECT_EQ(host->stats().current_bytes, cs.reserved_bytes);
  EXPECT_EQ(cs.hits + cs.misses, kThreads * kIters);
  EXPECT_GT(cs.hits, 0);
  pool.EmptyCache();
  EXPECT_EQ(host->stats().current_bytes, 0);
}

}  // namespace
}  // namespace shardline
