// Tests of runtime/shared_memory.h and of the host allocators' choice of memory: arena blocks
// (which spans are found, with which offsets), many blocks on a handful of file descriptors,
// freed blocks reused and zero-filled, freeing that returns the pages while a "peer" (a second
// mapping of the arena's memory file, what a peer does after pidfd_getfd) maps them, private
// memory by default and shared memory only when asked for, across fork().

#include "runtime/shared_memory.h"

#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/allocator.h"
#include "runtime/caching_pool.h"
#include "tests/common/scoped_env.h"

namespace shardline {
namespace {

using testing::ScopedEnv;

constexpr size_t kPage = 4096;

// File descriptors open in this process now.
int CountOpenFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int n = 0;
  while (readdir(dir) != nullptr) ++n;
  closedir(dir);
  return n - 3;  // ".", "..", and the directory's own descriptor
}

// Bytes the memory file behind `fd` holds (its allocated pages).
int64_t FileResidentBytes(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return -1;
  return static_cast<int64_t>(st.st_blocks) * 512;
}

uint8_t PatternByte(size_t i, int salt) {
  uint64_t x = i * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(salt) * 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return static_cast<uint8_t>(x * 0x94d049bb133111ebull >> 56);
}

TEST(SharedMemoryTest, BlocksAreSpansOfOneArena) {
  constexpr size_t kBytes = 3 * kPage + 100;  // not a whole number of pages
  absl::StatusOr<void*> a = AllocateShareable(kBytes);
  absl::StatusOr<void*> b = AllocateShareable(kBytes);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  auto* pa = static_cast<uint8_t*>(*a);
  auto* pb = static_cast<uint8_t*>(*b);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pa) % kPage, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pb) % kPage, 0u);

  std::optional<ShareableSpan> sa = FindShareable(pa, kBytes);
  std::optional<ShareableSpan> sb = FindShareable(pb, kBytes);
  ASSERT_TRUE(sa.has_value() && sb.has_value());
  // One arena: one memory file and one reservation for both blocks, at different offsets.
  EXPECT_EQ(sa->region_id, sb->region_id);
  EXPECT_EQ(sa->fd, sb->fd);
  EXPECT_GE(sa->fd, 0);
  EXPECT_EQ(sa->region_bytes, sb->region_bytes);
  EXPECT_GE(sa->file_bytes, sa->offset + kBytes);
  EXPECT_LE(sa->file_bytes, sa->region_bytes);
  EXPECT_EQ(pb - pa, static_cast<ptrdiff_t>(sb->offset) - static_cast<ptrdiff_t>(sa->offset));
  // Whole pages each: the blocks do not overlap.
  EXPECT_TRUE(pb >= pa + 4 * kPage || pa >= pb + 4 * kPage);

  std::optional<ShareableSpan> inner = FindShareable(pa + 5000, 1000);
  ASSERT_TRUE(inner.has_value());
  EXPECT_EQ(inner->offset, sa->offset + 5000);
  EXPECT_EQ(inner->region_id, sa->region_id);

  // Beyond the memory file (where no block is) or private memory: not shareable.
  EXPECT_FALSE(FindShareable(pa, sa->file_bytes - sa->offset + 1).has_value());
  std::vector<uint8_t> private_memory(8192);
  EXPECT_FALSE(FindShareable(private_memory.data(), 16).has_value());

  FreeShareable(pa, kBytes);
  FreeShareable(pb, kBytes);
}

TEST(SharedMemoryTest, ASecondMappingOfTheArenaSeesTheSameBytes) {
  constexpr size_t kBytes = 1 << 20;
  absl::StatusOr<void*> p = AllocateShareable(kBytes);
  ASSERT_TRUE(p.ok()) << p.status();
  auto* data = static_cast<uint8_t*>(*p);
  for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(data[i], 0) << "not zero-filled at " << i;
  for (size_t i = 0; i < kBytes; ++i) data[i] = PatternByte(i, 1);

  std::optional<ShareableSpan> span = FindShareable(data, kBytes);
  ASSERT_TRUE(span.has_value());
  // What a peer does: map the whole arena once, read the block at its offset.
  void* view =
      mmap(nullptr, span->region_bytes, PROT_READ, MAP_SHARED | MAP_NORESERVE, span->fd, 0);
  ASSERT_NE(view, MAP_FAILED);
  const uint8_t* seen = static_cast<const uint8_t*>(view) + span->offset;
  for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(seen[i], PatternByte(i, 1)) << i;
  data[12345] = 99;  // later writes show through too
  EXPECT_EQ(seen[12345], 99);
  munmap(view, span->region_bytes);
  FreeShareable(data, kBytes);
}

TEST(SharedMemoryTest, AThousandBlocksUseAHandfulOfDescriptors) {
  // One memory file per block would need 1000 descriptors (and used to stop at a quarter of
  // RLIMIT_NOFILE, 256 under the usual soft limit of 1024, beyond which blocks were private).
  ParamHostShareableBytes().ResetCacheForTesting();
  std::unique_ptr<Allocator> allocator = CreateShareableHostAllocator(64, "thousand");
  const int fds_before = CountOpenFds();
  const ShareableArenaStats before = GetShareableArenaStats();
  constexpr int kBlocks = 1000;
  constexpr size_t kBytes = 1 << 20;
  std::vector<Buffer> blocks;
  std::set<uint64_t> arenas;
  for (int i = 0; i < kBlocks; ++i) {
    absl::StatusOr<Buffer> block = allocator->Allocate(kBytes);
    ASSERT_TRUE(block.ok()) << "block " << i << ": " << block.status();
    std::optional<ShareableSpan> span = FindShareable(block->data(), kBytes);
    ASSERT_TRUE(span.has_value()) << "block " << i << " is not shareable";
    arenas.insert(span->region_id);
    // One byte per page: the blocks are distinct memory.
    for (size_t off = 0; off < kBytes; off += kPage)
      block->as<uint8_t>()[off] = PatternByte(off, i);
    blocks.push_back(*std::move(block));
  }
  const int fds_during = CountOpenFds();
  const ShareableArenaStats during = GetShareableArenaStats();
  EXPECT_LE(fds_during - fds_before, 2) << "descriptors for " << kBlocks << " blocks";
  EXPECT_LE(during.arenas - before.arenas, 2);
  EXPECT_LE(arenas.size(), 3u);
  EXPECT_EQ(during.live_blocks - before.live_blocks, kBlocks);
  EXPECT_EQ(during.allocated_bytes - before.allocated_bytes, int64_t{kBlocks} * kBytes);
  for (int i = 0; i < kBlocks; ++i) {
    for (size_t off = 0; off < kBytes; off += kPage) {
      ASSERT_EQ(blocks[i].as<uint8_t>()[off], PatternByte(off, i)) << "block " << i << ", " << off;
    }
  }
  EXPECT_EQ(allocator->stats().current_bytes, int64_t{kBlocks} * kBytes);
  blocks.clear();
  const ShareableArenaStats after = GetShareableArenaStats();
  EXPECT_EQ(after.live_blocks, before.live_blocks);
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_LE(after.resident_bytes, before.resident_bytes) << "freed blocks keep no pages";
  EXPECT_EQ(CountOpenFds(), fds_during) << "arenas are kept for reuse, nothing else is open";
}

TEST(SharedMemoryTest, FreedBlocksAreReusedZeroFilledAndMerged) {
  constexpr size_t kBytes = 5 * kPage + 1;  // 6 pages
  absl::StatusOr<void*> a = AllocateShareable(kBytes);
  absl::StatusOr<void*> b = AllocateShareable(kBytes);
  absl::StatusOr<void*> c = AllocateShareable(kBytes);  // keeps a and b below the arena's top
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  auto* pa = static_cast<uint8_t*>(*a);
  auto* pb = static_cast<uint8_t*>(*b);
  ASSERT_EQ(pb, pa + 6 * kPage) << "consecutive blocks of a fresh stretch of the arena";
  for (size_t i = 0; i < kBytes; ++i) pa[i] = PatternByte(i, 2) | 1;
  for (size_t i = 0; i < kBytes; ++i) pb[i] = PatternByte(i, 3) | 1;

  // The freed block comes back for a request of its size, zero-filled.
  FreeShareable(pa, kBytes);
  absl::StatusOr<void*> again = AllocateShareable(kBytes);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, pa) << "a freed block is reused";
  for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(pa[i], 0) << "reused block not zeroed at " << i;
  for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(pb[i], PatternByte(i, 3) | 1) << i;

  // Two freed neighbours merge into one range that serves a request of both their sizes.
  FreeShareable(pa, kBytes);
  FreeShareable(pb, kBytes);
  absl::StatusOr<void*> both = AllocateShareable(12 * kPage);
  ASSERT_TRUE(both.ok());
  EXPECT_EQ(*both, pa) << "neighbouring free blocks merge";
  for (size_t i = 0; i < 12 * kPage; ++i) ASSERT_EQ(pa[i], 0) << i;
  FreeShareable(*both, 12 * kPage);
  FreeShareable(*c, kBytes);
}

TEST(SharedMemoryTest, FreeingReturnsThePagesWhileAPeerMapsThem) {
  // A peer's mapping of the arena (here: a second mapping through a duplicated descriptor, what
  // pidfd_getfd gives a peer) must not keep a freed block's pages: the memory is freed.
  constexpr size_t kBytes = 8 << 20;
  absl::StatusOr<void*> p = AllocateShareable(kBytes);
  ASSERT_TRUE(p.ok()) << p.status();
  auto* data = static_cast<uint8_t*>(*p);
  for (size_t i = 0; i < kBytes; ++i) data[i] = PatternByte(i, 4) | 1;
  std::optional<ShareableSpan> span = FindShareable(data, kBytes);
  ASSERT_TRUE(span.has_value());
  const int peer_fd = dup(span->fd);
  ASSERT_GE(peer_fd, 0);
  void* view = mmap(nullptr, span->region_bytes, PROT_READ, MAP_SHARED | MAP_NORESERVE, peer_fd, 0);
  ASSERT_NE(view, MAP_FAILED);
  const uint8_t* seen = static_cast<const uint8_t*>(view) + span->offset;
  for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(seen[i], PatternByte(i, 4) | 1) << i;

  const int64_t file_before = FileResidentBytes(peer_fd);
  const ShareableArenaStats before = GetShareableArenaStats();
  EXPECT_GE(file_before, static_cast<int64_t>(kBytes));
  EXPECT_GE(before.resident_bytes, static_cast<int64_t>(kBytes));
  FreeShareable(data, kBytes);
  const ShareableArenaStats after = GetShareableArenaStats();
  EXPECT_EQ(FileResidentBytes(peer_fd), file_before - static_cast<int64_t>(kBytes))
      << "the peer's descriptor and mapping keep the freed pages";
  EXPECT_EQ(after.resident_bytes, before.resident_bytes - static_cast<int64_t>(kBytes));
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes - static_cast<int64_t>(kBytes));
  // The peer's mapping stays valid (no SIGBUS) and reads zeros.
  for (size_t i = 0; i < kBytes; i += 997) ASSERT_EQ(seen[i], 0) << i;
  munmap(view, span->region_bytes);
  close(peer_fd);
}

TEST(SharedMemoryTest, EmptyingAPoolFreesMemoryThatPeersMap) {
  // CachingPool's answer to running out of memory is to empty its cache and retry: over a
  // shareable allocator that must give the memory back although peers map the arena.
  ParamHostShareableBytes().ResetCacheForTesting();
  std::unique_ptr<Allocator> host = CreateShareableHostAllocator(64, "pool backing");
  CachingPool pool(*host, {.name = "pool"});
  constexpr size_t kBytes = 6 << 20;
  absl::StatusOr<Buffer> block = pool.Allocate(kBytes);
  ASSERT_TRUE(block.ok()) << block.status();
  std::memset(block->data(), 0x5a, kBytes);
  std::optional<ShareableSpan> span = FindShareable(block->data(), kBytes);
  ASSERT_TRUE(span.has_value());
  const int peer_fd = dup(span->fd);
  ASSERT_GE(peer_fd, 0);
  void* view = mmap(nullptr, span->region_bytes, PROT_READ, MAP_SHARED | MAP_NORESERVE, peer_fd, 0);
  ASSERT_NE(view, MAP_FAILED);
  EXPECT_EQ(static_cast<const uint8_t*>(view)[span->offset + 4321], 0x5a);
  block->Reset();  // into the pool's cache: still held
  const int64_t cached = FileResidentBytes(peer_fd);
  EXPECT_EQ(pool.cache_stats().cached_blocks, 1);
  const size_t emptied = pool.EmptyCache();
  EXPECT_GE(emptied, kBytes);
  EXPECT_LE(FileResidentBytes(peer_fd), cached - static_cast<int64_t>(kBytes))
      << "emptying the cache freed nothing physical";
  EXPECT_EQ(host->stats().current_bytes, 0);
  munmap(view, span->region_bytes);
  close(peer_fd);
}

TEST(SharedMemoryTest, ALargerRequestOpensANewArena) {
  // Only address space: the blocks' pages are touched at their ends only.
  const ShareableArenaStats before = GetShareableArenaStats();
  const size_t bytes = static_cast<size_t>(before.reserved_bytes) + (1 << 20);
  absl::StatusOr<void*> p = AllocateShareable(bytes);
  ASSERT_TRUE(p.ok()) << p.status();
  auto* data = static_cast<uint8_t*>(*p);
  data[0] = 1;
  data[bytes - 1] = 2;
  const ShareableArenaStats during = GetShareableArenaStats();
  EXPECT_EQ(during.arenas, before.arenas + 1);
  EXPECT_GE(during.reserved_bytes - before.reserved_bytes, static_cast<int64_t>(bytes));
  std::optional<ShareableSpan> span = FindShareable(data, bytes);
  ASSERT_TRUE(span.has_value());
  EXPECT_EQ(span->offset, 0u);
  EXPECT_EQ(data[0], 1);
  EXPECT_EQ(data[bytes - 1], 2);
  FreeShareable(data, bytes);
  EXPECT_EQ(GetShareableArenaStats().allocated_bytes, before.allocated_bytes);
}

// Runs `child` in a forked child (which must not return from it), waits for it at most 30 s
// (killed then), and returns its exit status (-1 if it had to be killed).
int RunForked(void (*child)(void*), void* arg) {
  const pid_t pid = fork();
  if (pid == 0) {
    child(arg);
    _exit(0);
  }
  if (pid < 0) return -2;
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  bool exited = true;
  if (pidfd >= 0) {
    pollfd fd{pidfd, POLLIN, 0};
    int ready;
    do {
      ready = poll(&fd, 1, 30000);
    } while (ready < 0 && errno == EINTR);
    exited = ready > 0;
    close(pidfd);
  }
  if (!exited) kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!exited || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

struct ForkBuffers {
  uint8_t* plain;
  uint8_t* shared;
  size_t bytes;
};

void OverwriteInChild(void* arg) {
  auto* b = static_cast<ForkBuffers*>(arg);
  std::memset(b->plain, 0xee, b->bytes);
  for (size_t i = 0; i < b->bytes; ++i) b->shared[i] = PatternByte(i, 6);
  _exit(0);
}

TEST(SharedMemoryTest, HostMemoryIsPrivateAcrossForkUnlessShareable) {
  // A DataLoader-style forked child writes into both blocks: the plain HostAllocator's block is
  // copied on write (the parent's bytes stay), the shareable allocator's is shared.
  ParamHostShareableBytes().ResetCacheForTesting();
  std::unique_ptr<Allocator> plain = CreateHostAllocator(64, "plain");
  std::unique_ptr<Allocator> shareable = CreateShareableHostAllocator(64, "shareable");
  constexpr size_t kBytes = (4 << 20) + 12345;
  absl::StatusOr<Buffer> a = plain->Allocate(kBytes);
  absl::StatusOr<Buffer> b = shareable->Allocate(kBytes);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_FALSE(FindShareable(a->data(), kBytes).has_value()) << "plain memory is shareable";
  EXPECT_TRUE(FindShareable(b->data(), kBytes).has_value());
  for (size_t i = 0; i < kBytes; ++i) a->as<uint8_t>()[i] = PatternByte(i, 5);
  for (size_t i = 0; i < kBytes; ++i) b->as<uint8_t>()[i] = PatternByte(i, 5);
  ForkBuffers buffers{a->as<uint8_t>(), b->as<uint8_t>(), kBytes};
  ASSERT_EQ(RunForked(&OverwriteInChild, &buffers), 0);
  for (size_t i = 0; i < kBytes; ++i) {
    ASSERT_EQ(a->as<uint8_t>()[i], PatternByte(i, 5))
        << "the child's write reached the parent at " << i;
  }
  for (size_t i = 0; i < kBytes; ++i) {
    ASSERT_EQ(b->as<uint8_t>()[i], PatternByte(i, 6)) << "shareable memory not shared at " << i;
  }
}

TEST(SharedMemoryTest, ShareableAllocatorSharesLargeAllocationsOnly) {
  ParamHostShareableBytes().ResetCacheForTesting();
  std::unique_ptr<Allocator> allocator = CreateShareableHostAllocator(64, "shared");
  absl::StatusOr<Buffer> small = allocator->Allocate(1000);
  absl::StatusOr<Buffer> large = allocator->Allocate(4 << 20);
  ASSERT_TRUE(small.ok() && large.ok());
  EXPECT_FALSE(FindShareable(small->data(), small->size()).has_value());
  ASSERT_TRUE(FindShareable(large->data(), large->size()).has_value());
  EXPECT_EQ(allocator->stats().current_bytes, 1000 + (4 << 20));
  const int64_t live = GetShareableArenaStats().live_blocks;
  large->Reset();
  EXPECT_EQ(GetShareableArenaStats().live_blocks, live - 1) << "the block went back to the arena";
  EXPECT_EQ(allocator->stats().current_bytes, 1000);
}

TEST(SharedMemoryTest, KnobZeroKeepsShareableAllocatorsPrivate) {
  ScopedEnv env("SHARDLINE_HOST_SHAREABLE_BYTES", "0");
  ParamHostShareableBytes().ResetCacheForTesting();
  std::unique_ptr<Allocator> allocator = CreateShareableHostAllocator(64, "private");
  absl::StatusOr<Buffer> large = allocator->Allocate(4 << 20);
  ASSERT_TRUE(large.ok());
  EXPECT_FALSE(FindShareable(large->data(), large->size()).has_value());
  ParamHostShareableBytes().ResetCacheForTesting();
}

TEST(SharedMemoryTest, AlignmentBeyondAPageKeepsHostMemoryPrivate) {
  ParamHostShareableBytes().ResetCacheForTesting();
  std::unique_ptr<Allocator> allocator = CreateShareableHostAllocator(1 << 16, "aligned");
  absl::StatusOr<Buffer> large = allocator->Allocate(4 << 20);
  ASSERT_TRUE(large.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(large->data()) % (1 << 16), 0u);
  EXPECT_FALSE(FindShareable(large->data(), large->size()).has_value());
}

}  // namespace
}  // namespace shardline
