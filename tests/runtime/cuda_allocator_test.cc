// CudaAllocator on the device's stream-ordered pool (cudaMallocAsync/cudaFreeAsync): memory
// allocated for a stream, freed after its guard and allocated again comes from the pool, without
// a new cudaMalloc (the pool's reserved memory does not grow). Needs a GPU with memory pools;
// skipped otherwise.

#include <gtest/gtest.h>

#ifdef SHARDLINE_WITH_CUDA

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "runtime/allocator.h"
#include "runtime/cuda/cuda_stream.h"
#include "runtime/stream.h"
#include "tests/common/cuda_device.h"
#include "tests/common/gate.h"

namespace shardline {
namespace {

using ::shardline::testing::Gate;

absl::Time Soon() { return absl::Now() + absl::Seconds(20); }

uint32_t Hash(uint32_t round, size_t i) {
  uint64_t x = (uint64_t{round} << 40 ^ i) * 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  return static_cast<uint32_t>(x * 0xBF58476D1CE4E5B9ull >> 32);
}

class CudaAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = ::shardline::testing::NoCudaDevice(); !why.empty()) {
      GTEST_SKIP() << why;
    }
    int pools = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, 0), cudaSuccess);
    if (pools == 0) GTEST_SKIP() << "cuda:0 has no stream-ordered memory pools";
  }
};

uint64_t ReservedBytes(cudaMemPool_t pool) {
  uint64_t reserved = 0;  // a cuuint64_t
  EXPECT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved),
            cudaSuccess);
  return reserved;
}

TEST_F(CudaAllocatorTest, AStreamOrderedReallocationComesFromThePool) {
  absl::StatusOr<std::unique_ptr<Allocator>> allocator = CreateCudaAllocator(0, "device");
  ASSERT_TRUE(allocator.ok()) << allocator.status();
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateCudaStream(0);
  ASSERT_TRUE(stream.ok()) << stream.status();
  const auto raw = static_cast<cudaStream_t>((*stream)->native_handle());
  cudaMemPool_t pool = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, 0), cudaSuccess);

  constexpr size_t kCount = size_t{16} << 20;  // 64 MiB of uint32
  constexpr size_t kBytes = kCount * sizeof(uint32_t);
  // Page-locked host memory, so that both copies are really asynchronous (a copy to pageable
  // memory returns only when it is done, and the block would be freed at its release).
  uint32_t* in = nullptr;
  uint32_t* out = nullptr;
  ASSERT_EQ(cudaMallocHost(&in, kBytes), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&out, kBytes), cudaSuccess);
  absl::Cleanup free_host = [&] {
    (void)cudaFreeHost(in);
    (void)cudaFreeHost(out);
  };
  uint64_t reserved_after_first = 0;
  for (uint32_t round = 0; round < 3; ++round) {
    absl::StatusOr<Buffer> buffer = (*allocator)->Allocate(kBytes, **stream);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    if (round == 0) {
      reserved_after_first = ReservedBytes(pool);
      EXPECT_GE(reserved_after_first, kBytes);
    } else {
      EXPECT_EQ(ReservedBytes(pool), reserved_after_first)
          << "round " << round << ": the allocation grew the pool instead of reusing its memory";
    }
    // The stream's work uses the memory at once: hashed data in, every element back out.
    for (size_t i = 0; i < kCount; ++i) in[i] = Hash(round, i);
    for (size_t i = 0; i < kCount; ++i) out[i] = ~in[i];
    ASSERT_EQ(cudaMemcpyAsync(buffer->data(), in, kBytes, cudaMemcpyHostToDevice, raw),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(out, buffer->data(), kBytes, cudaMemcpyDeviceToHost, raw),
              cudaSuccess);
    absl::StatusOr<std::shared_ptr<Event>> used = RecordEvent(**stream);
    ASSERT_TRUE(used.ok()) << used.status();
    buffer->ReleaseAfter(*used);
    buffer->Reset();
    // Held while the copies run; freed at the release only if they had already finished.
    const int64_t held = (*allocator)->pending_blocks();
    EXPECT_EQ((*allocator)->stats().live_allocations, held);
    // Registered after the allocator's callback, on the same side stream: runs after it.
    Gate released;
    (*used)->OnComplete([&released](absl::Status) { released.Open(); });
    ASSERT_TRUE((*used)->Synchronize(Soon()).ok());
    ASSERT_TRUE(released.Wait());
    EXPECT_EQ((*allocator)->Collect(), held);
    EXPECT_EQ((*allocator)->pending_blocks(), 0);
    size_t wrong = 0;
    for (size_t i = 0; i < kCount; ++i) wrong += out[i] != in[i];
    EXPECT_EQ(wrong, 0u) << "round " << round;
  }
  EXPECT_EQ((*allocator)->stats().live_allocations, 0);
  EXPECT_EQ((*allocator)->stats().total_allocations, 3);
}

}  // namespace
}  // namespace shardline

#else  // !SHARDLINE_WITH_CUDA

TEST(CudaAllocatorTest, NotCompiledIn) {
  GTEST_SKIP() << "CUDA is not compiled in (SHARDLINE_WITH_CUDA=OFF)";
}

#endif  // SHARDLINE_WITH_CUDA
