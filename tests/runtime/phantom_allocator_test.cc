// Tests of runtime/phantom_allocator.h: accounting identical to a host allocator's for the same
// requests, capacity errors, a CachingPool over phantom memory (hits, misses, stream-ordered
// hits), terabytes of live buffers without resident memory, distinct non-overlapping addresses.

#include "runtime/phantom_allocator.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/allocator.h"
#include "runtime/caching_pool.h"
#include "runtime/stream.h"
#include "tests/runtime/manual_event.h"

namespace shardline {
namespace {

using ::shardline::testing::ManualEvent;
using ::testing::HasSubstr;

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

void ExpectSameStats(const Allocator& a, const Allocator& b, int step) {
  const MemoryStats x = a.stats();
  const MemoryStats y = b.stats();
  EXPECT_EQ(x.current_bytes, y.current_bytes) << "step " << step;
  EXPECT_EQ(x.peak_bytes, y.peak_bytes) << "step " << step;
  EXPECT_EQ(x.live_allocations, y.live_allocations) << "step " << step;
  EXPECT_EQ(x.total_allocations, y.total_allocations) << "step " << step;
  EXPECT_EQ(x.total_bytes, y.total_bytes) << "step " << step;
  EXPECT_EQ(a.pending_blocks(), b.pending_blocks()) << "step " << step;
}

// Checks that the buffers' byte ranges are disjoint, aligned and phantom.
void ExpectDisjointPhantom(const std::vector<const Buffer*>& buffers) {
  std::vector<std::pair<uintptr_t, size_t>> ranges;
  for (const Buffer* b : buffers) {
    ASSERT_NE(b->data(), nullptr);
    EXPECT_TRUE(IsPhantomAddress(b->data()));
    EXPECT_TRUE(IsPhantomAddress(static_cast<const char*>(b->data()) + b->size() - 1));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % kPhantomAlignment, 0u);
    ranges.emplace_back(reinterpret_cast<uintptr_t>(b->data()), b->size());
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 0; i + 1 < ranges.size(); ++i) {
    ASSERT_LE(ranges[i].first + ranges[i].second, ranges[i + 1].first) << "overlap at " << i;
  }
}

// Resident bytes of this process (/proc/self/statm, second field, in pages).
int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size_pages = 0;
  int64_t resident_pages = 0;
  statm >> size_pages >> resident_pages;
  return resident_pages * sysconf(_SC_PAGESIZE);
}

// The same script of allocations, plain releases, guarded releases, guard completions and
// collections on a host allocator and a phantom one: the counters agree after every step.
TEST(PhantomAllocatorTest, AccountingMatchesAHostAllocator) {
  std::unique_ptr<Allocator> host = CreateHostAllocator(64, "host");
  std::unique_ptr<Allocator> phantom = CreatePhantomAllocator(Device::Host(), "phantom");
  std::vector<std::pair<Buffer, Buffer>> live;  // (host, phantom)
  std::vector<std::shared_ptr<ManualEvent>> guards;
  int64_t max_pending = 0;
  for (int step = 0; step < 2000; ++step) {
    const uint64_t h = Mix(step);
    const int action = static_cast<int>(h % 10);
    if (action < 4 || live.empty()) {
      const size_t bytes = (h >> 8) % 65536;  // 0 included: an empty Buffer on both sides
      absl::StatusOr<Buffer> a = host->Allocate(bytes);
      absl::StatusOr<Buffer> b = phantom->Allocate(bytes);
      ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
      EXPECT_EQ(b->size(), bytes);
      live.emplace_back(*std::move(a), *std::move(b));
    } else if (action < 8) {
      const size_t index = (h >> 20) % live.size();
      auto [a, b] = std::move(live[index]);
      live.erase(live.begin() + static_cast<ptrdiff_t>(index));
      if (action >= 6) {  // guarded by one or two events, some already complete
        for (int g = 0; g < 1 + static_cast<int>((h >> 40) % 2); ++g) {
          auto guard = ManualEvent::Create();
          if ((h >> (44 + g)) % 4 == 0) guard->Complete();
          a.ReleaseAfter(guard);
          b.ReleaseAfter(guard);
          guards.push_back(std::move(guard));
        }
      }
      a.Reset();
      b.Reset();
    } else if (action == 8 && !guards.empty()) {
      const size_t index = (h >> 20) % guards.size();
      guards[index]->Complete();
      guards.erase(guards.begin() + static_cast<ptrdiff_t>(index));
    } else {
      EXPECT_EQ(host->Collect(), phantom->Collect()) << "step " << step;
    }
    ExpectSameStats(*host, *phantom, step);
    if (::testing::Test::HasFailure()) return;
    max_pending = std::max(max_pending, phantom->pending_blocks());
  }
  EXPECT_GT(phantom->stats().peak_bytes, 0);
  EXPECT_GT(max_pending, 1);  // the script did hold guarded blocks
  live.clear();
  for (auto& guard : guards) guard->Complete();
  host->Collect();
  phantom->Collect();
  ExpectSameStats(*host, *phantom, -1);
  EXPECT_EQ(phantom->stats().current_bytes, 0);
  EXPECT_EQ(phantom->stats().live_allocations, 0);
}

TEST(PhantomAllocatorTest, CapacityErrorsNameTheNumbers) {
  std::unique_ptr<Allocator> phantom = CreatePhantomAllocator(Device::Cuda(3), "hbm", 1000);
  EXPECT_EQ(phantom->device(), Device::Cuda(3));
  Buffer a = *phantom->Allocate(600);
  absl::StatusOr<Buffer> over = phantom->Allocate(500);
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  const std::string message(over.status().message());
  EXPECT_THAT(message, HasSubstr("'hbm'"));
  EXPECT_THAT(message, HasSubstr("cuda:3"));
  EXPECT_THAT(message, HasSubstr("capacity of 1000 bytes"));
  EXPECT_THAT(message, HasSubstr("500 bytes requested with 600 bytes in use (400 left)"));
  // Up to the capacity exactly.
  Buffer b = *phantom->Allocate(400);
  EXPECT_EQ(phantom->stats().current_bytes, 1000);
  b.Reset();

  // A block whose guard is pending still counts; once the guard completes, it does not.
  auto guard = ManualEvent::Create();
  a.ReleaseAfter(guard);
  a.Reset();
  EXPECT_EQ(phantom->Allocate(500).status().code(), absl::StatusCode::kResourceExhausted);
  guard->Complete();
  absl::StatusOr<Buffer> fits = phantom->Allocate(1000);
  EXPECT_TRUE(fits.ok()) << fits.status();
  fits->Reset();

  // Larger than the phantom range itself.
  std::unique_ptr<Allocator> unlimited = CreatePhantomAllocator(Device::Host(), "unlimited");
  absl::StatusOr<Buffer> huge = unlimited->Allocate(size_t{1} << 60);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_THAT(std::string(huge.status().message()), HasSubstr("phantom address range"));
  EXPECT_EQ(unlimited->stats().current_bytes, 0);
}

// A CachingPool keys blocks by address only: over phantom memory it hits, misses and reuses in
// stream order exactly as over real memory.
TEST(PhantomAllocatorTest, CachingPoolOverPhantomMemory) {
  std::unique_ptr<Allocator> phantom = CreatePhantomAllocator(Device::Host(), "phantom");
  {
    CachingPool pool(*phantom);
    void* first = nullptr;
    {
      Buffer a = *pool.Allocate(3000);  // miss
      first = a.data();
    }
    Buffer b = *pool.Allocate(3000);  // hit: the same block
    EXPECT_EQ(b.data(), first);
    auto guard = ManualEvent::Create();
    b.ReleaseAfter(guard);
    b.Reset();

    // Without a stream the pending block cannot be reused: a miss, a distinct block.
    Buffer c = *pool.Allocate(3000);
    EXPECT_NE(c.data(), first);
    ExpectDisjointPhantom({&c});

    // With a first user, the pending block is handed out after the stream waits for its guard.
    std::unique_ptr<Stream> stream = *CreateHostStream({.name = "user"});
    Buffer d = *pool.Allocate(3000, *stream);
    EXPECT_EQ(d.data(), first);
    ExpectDisjointPhantom({&c, &d});
    bool ran = false;
    ASSERT_TRUE(stream
                    ->Enqueue([&ran] {
                      ran = true;
                      return absl::OkStatus();
                    })
                    .ok());
    std::shared_ptr<Event> used = *RecordEvent(*stream);
    EXPECT_FALSE(*used->Query());  // held by the guard
    guard->Complete();
    ASSERT_TRUE(stream->Synchronize(absl::Now() + absl::Seconds(20)).ok());
    EXPECT_TRUE(ran);

    const PoolCacheStats stats = pool.cache_stats();
    EXPECT_EQ(stats.hits, 1);
    EXPECT_EQ(stats.misses, 2);
    EXPECT_EQ(stats.stream_ordered_hits, 1);
    EXPECT_EQ(pool.stats().stream_ordered_reuses, 1);
    // The backing allocator holds two blocks of the class.
    EXPECT_EQ(phantom->stats().current_bytes,
              2 * static_cast<int64_t>(CachingPool::SizeClass(3000)));
    d.ReleaseAfter(used);
  }
  phantom->Collect();
  EXPECT_EQ(phantom->stats().current_bytes, 0);
  // The phantom allocator itself accepts a first user (and ignores it).
  std::unique_ptr<Stream> stream = *CreateCallerStream({.name = "inline"});
  absl::StatusOr<Buffer> e = phantom->Allocate(100, *stream);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE(IsPhantomAddress(e->data()));
}

// 10,000 live buffers of 1 GiB each (10 TiB): the process's resident memory barely moves, and
// the buffers' ranges are distinct, aligned and disjoint, also across allocators.
TEST(PhantomAllocatorTest, TerabytesOfLiveBuffersUseNoMemory) {
  constexpr int kBuffers = 10000;
  constexpr size_t kGiB = size_t{1} << 30;
  std::unique_ptr<Allocator> phantom = CreatePhantomAllocator(Device::Cuda(0), "big");
  std::unique_ptr<Allocator> other = CreatePhantomAllocator(Device::Cuda(1), "other");
  std::vector<Buffer> buffers;
  buffers.reserve(kBuffers + 3);
  const int64_t before = ResidentBytes();
  for (int i = 0; i < kBuffers; ++i) {
    absl::StatusOr<Buffer> b = phantom->Allocate(kGiB);
    ASSERT_TRUE(b.ok()) << i << ": " << b.status();
    buffers.push_back(*std::move(b));
  }
  const int64_t after = ResidentBytes();
  EXPECT_LT(after - before, int64_t{8} << 20) << "resident memory grew by " << (after - before);
  EXPECT_EQ(phantom->stats().current_bytes, int64_t{kBuffers} * static_cast<int64_t>(kGiB));
  EXPECT_EQ(phantom->stats().live_allocations, kBuffers);
  // Odd sizes from another allocator, and a view's address arithmetic stays inside its buffer.
  buffers.push_back(*other->Allocate(1));
  buffers.push_back(*other->Allocate(kGiB + 1));
  buffers.push_back(*other->Allocate(257));
  std::vector<const Buffer*> all;
  for (const Buffer& b : buffers) all.push_back(&b);
  ExpectDisjointPhantom(all);
  // A released range may be handed out again; it never overlaps a live one.
  // (17 and 18 are adjacent: their freed ranges merge into the best fit for 2 GiB.)
  void* const hole = std::min(buffers[17].data(), buffers[18].data());
  buffers[17].Reset();
  buffers[18].Reset();
  Buffer reused = *phantom->Allocate(2 * kGiB);
  EXPECT_EQ(reused.data(), hole);
  all.clear();
  for (const Buffer& b : buffers) {
    if (!b.empty()) all.push_back(&b);
  }
  all.push_back(&reused);
  ExpectDisjointPhantom(all);
  EXPECT_FALSE(IsPhantomAddress(&reused));
  EXPECT_FALSE(IsPhantomAddress(nullptr));
}

}  // namespace
}  // namespace shardline
