// Tests of runtime/shared_memory.h: the registry (which spans are found, with which offsets),
// that a second mapping of a region's memory file sees the same bytes (what a peer does after
// pidfd_getfd), and HostAllocator's choice of shareable memory by size and knob.

#include "runtime/shared_memory.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/allocator.h"
#include "tests/common/scoped_env.h"

namespace shardline {
namespace {

using testing::ScopedEnv;

TEST(SharedMemoryTest, FindsSpansInsideRegionsOnly) {
  constexpr size_t kBytes = 3 * 4096 + 100;  // not a whole number of pages
  absl::StatusOr<void*> a = AllocateShareable(kBytes);
  absl::StatusOr<void*> b = AllocateShareable(kBytes);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  auto* pa = static_cast<uint8_t*>(*a);
  auto* pb = static_cast<uint8_t*>(*b);

  std::optional<ShareableSpan> whole = FindShareable(pa, kBytes);
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(whole->offset, 0u);
  EXPECT_EQ(whole->region_bytes, 4u * 4096);  // rounded to pages
  EXPECT_GE(whole->fd, 0);

  std::optional<ShareableSpan> inner = FindShareable(pa + 5000, 1000);
  ASSERT_TRUE(inner.has_value());
  EXPECT_EQ(inner->offset, 5000u);
  EXPECT_EQ(inner->region_id, whole->region_id);

  std::optional<ShareableSpan> other = FindShareable(pb, 1);
  ASSERT_TRUE(other.has_value());
  EXPECT_NE(other->region_id, whole->region_id);
  EXPECT_NE(other->fd, whole->fd);

  // Past the end of the region, or not shareable memory at all.
  EXPECT_FALSE(FindShareable(pa + 4096, 4 * 4096).has_value());
  std::vector<uint8_t> private_memory(8192);
  EXPECT_FALSE(FindShareable(private_memory.data(), 16).has_value());

  const uint64_t freed_id = whole->region_id;
  FreeShareable(pa, kBytes);
  EXPECT_FALSE(FindShareable(pa, 1).has_value());
  absl::StatusOr<void*> c = AllocateShareable(kBytes);
  ASSERT_TRUE(c.ok()) << c.status();
  std::optional<ShareableSpan> fresh = FindShareable(*c, 1);
  ASSERT_TRUE(fresh.has_value());
  EXPECT_NE(fresh->region_id, freed_id) << "region ids are never reused";
  FreeShareable(*c, kBytes);
  FreeShareable(pb, kBytes);
}

TEST(SharedMemoryTest, ASecondMappingOfTheFileSeesTheSameBytes) {
  constexpr size_t kBytes = 1 << 20;
  absl::StatusOr<void*> p = AllocateShareable(kBytes);
  ASSERT_TRUE(p.ok()) << p.status();
  auto* data = static_cast<uint8_t*>(*p);
  for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(data[i], 0) << "not zero-filled at " << i;
  for (size_t i = 0; i < kBytes; ++i) data[i] = static_cast<uint8_t>(i * 7 + 3);

  std::optional<ShareableSpan> span = FindShareable(data, kBytes);
  ASSERT_TRUE(span.has_value());
  void* view = mmap(nullptr, span->region_bytes, PROT_READ, MAP_SHARED, span->fd, 0);
  ASSERT_NE(view, MAP_FAILED);
  EXPECT_EQ(std::memcmp(view, data, kBytes), 0);
  data[12345] = 99;  // later writes show through too
  EXPECT_EQ(static_cast<const uint8_t*>(view)[12345], 99);
  munmap(view, span->region_bytes);
  FreeShareable(data, kBytes);
}

TEST(SharedMemoryTest, UsesAtMostAQuarterOfTheDescriptorLimit) {
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = 64;  // 16 regions at most
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<void*> regions;
  absl::Status refused;
  for (int i = 0; i < 32 && refused.ok(); ++i) {
    absl::StatusOr<void*> p = AllocateShareable(4096);
    if (p.ok()) {
      regions.push_back(*p);
    } else {
      refused = p.status();
    }
  }
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  EXPECT_EQ(regions.size(), 16u);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("RLIMIT_NOFILE"), absl::string_view::npos) << refused;
  // A HostAllocator falls back to private memory at the limit instead of failing.
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  ParamHostShareableBytes().ResetCacheForTesting();
  std::unique_ptr<Allocator> allocator = CreateHostAllocator(64, "limited");
  absl::StatusOr<Buffer> large = allocator->Allocate(2 << 20);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  ASSERT_TRUE(large.ok()) << large.status();
  EXPECT_FALSE(FindShareable(large->data(), large->size()).has_value());
  for (void* p : regions) FreeShareable(p, 4096);
}

TEST(SharedMemoryTest, HostAllocatorSharesLargeAllocations) {
  ParamHostShareableBytes().ResetCacheForTesting();
  std::unique_ptr<Allocator> allocator = CreateHostAllocator(64, "shared");
  absl::StatusOr<Buffer> small = allocator->Allocate(1000);
  absl::StatusOr<Buffer> large = allocator->Allocate(4 << 20);
  ASSERT_TRUE(small.ok() && large.ok());
  EXPECT_FALSE(FindShareable(small->data(), small->size()).has_value());
  std::optional<ShareableSpan> span = FindShareable(large->data(), large->size());
  ASSERT_TRUE(span.has_value()) << "a 4 MiB host allocation should be shareable by default";
  EXPECT_EQ(allocator->stats().current_bytes, 1000 + (4 << 20));
  void* freed = large->data();
  large->Reset();
  EXPECT_FALSE(FindShareable(freed, 1).has_value()) << "freed regions leave the registry";
  EXPECT_EQ(allocator->stats().current_bytes, 1000);
}

TEST(SharedMemoryTest, KnobZeroKeepsHostMemoryPrivate) {
  ScopedEnv env("SHARDLINE_HOST_SHAREABLE_BYTES", "0");
  ParamHostShareableBytes().ResetCacheForTesting();
  std::unique_ptr<Allocator> allocator = CreateHostAllocator(64, "private");
  absl::StatusOr<Buffer> large = allocator->Allocate(4 << 20);
  ASSERT_TRUE(large.ok());
  EXPECT_FALSE(FindShareable(large->data(), large->size()).has_value());
  ParamHostShareableBytes().ResetCacheForTesting();
}

TEST(SharedMemoryTest, AlignmentBeyondAPageKeepsHostMemoryPrivate) {
  ParamHostShareableBytes().ResetCacheForTesting();
  std::unique_ptr<Allocator> allocator = CreateHostAllocator(1 << 16, "aligned");
  absl::StatusOr<Buffer> large = allocator->Allocate(4 << 20);
  ASSERT_TRUE(large.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(large->data()) % (1 << 16), 0u);
  EXPECT_FALSE(FindShareable(large->data(), large->size()).has_value());
}

}  // namespace
}  // namespace shardline
