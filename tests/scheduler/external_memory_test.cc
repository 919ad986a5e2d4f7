// Framework-owned memory (Buffer::Adopt / Buffer::View) and FlatParameter's
// external master shard and init stream: the unit gathers from the framework's own parameter
// memory, never writes it at creation, and releases it only after the streams that read it.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/local/local_communicator.h"
#include "gtest/gtest.h"
#include "runtime/allocator.h"
#include "runtime/caching_pool.h"
#include "runtime/flat_layout.h"
#include "runtime/stream.h"
#include "scheduler/flat_parameter.h"
#include "tests/common/gate.h"
#include "tests/common/rank_threads.h"
#include "tests/runtime/manual_event.h"

namespace shardline {
namespace {

using testing::BlockOn;
using testing::Gate;
using testing::ManualEvent;
using testing::RunRankThreads;

absl::Time Deadline() { return absl::Now() + absl::Seconds(30); }

float Hashed(int salt, size_t i) {
  uint64_t x = (static_cast<uint64_t>(salt) << 32) ^ i;
  x = (x ^ (x >> 33)) * 0xff51afd7ed558ccdull;
  x = (x ^ (x >> 33)) * 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<float>(static_cast<double>(x >> 40) / (1 << 23) - 1.0);
}

TEST(BufferTest, AdoptReleasesAfterEveryGuardAndViewNever) {
  std::vector<float> memory(100);
  std::atomic<int> released{0};
  void* seen = nullptr;
  {
    Buffer adopted = Buffer::Adopt(memory.data(), 400, Device::Host(), [&](void* data) {
      seen = data;
      ++released;
    });
    EXPECT_EQ(adopted.allocator(), nullptr);
    EXPECT_EQ(adopted.size(), 400u);
    auto a = ManualEvent::Create();
    auto b = ManualEvent::Create();
    adopted.ReleaseAfter(a);
    adopted.ReleaseAfter(b);
    Buffer moved = std::move(adopted);
    moved.Reset();
    EXPECT_EQ(released.load(), 0);
    a->Complete();
    EXPECT_EQ(released.load(), 0);
    b->Fail(absl::InternalError("the reader's stream failed"));  // completion, with a failure
    EXPECT_EQ(released.load(), 1);
    EXPECT_EQ(seen, memory.data());
  }
  EXPECT_EQ(released.load(), 1) << "released once";
  {
    Buffer unguarded =
        Buffer::Adopt(memory.data(), 400, Device::Cuda(1), [&](void*) { ++released; });
    EXPECT_EQ(unguarded.device(), Device::Cuda(1));
  }
  EXPECT_EQ(released.load(), 2);
  Buffer view = Buffer::View(memory.data(), 400, Device::Host());
  view.ReleaseAfter(ManualEvent::Create());  // ignored: nothing to release
  view.Reset();
  EXPECT_TRUE(view.empty());
}

// Two ranks gather a unit whose master shards are the framework's own f32 arrays (views); the
// framework's values appear in the gathered parameters, and nothing zeroed them at creation.
TEST(ExternalMasterShardTest, GathersFromTheFrameworksMemory) {
  const int n = 2;
  auto comms = *CreateLocalCommunicators(n, {.timeout = absl::Seconds(30)});
  const std::vector<TensorSpec> specs = {{.name = "w", .shape = {37, 5}, .dtype = DType::kF32},
                                         {.name = "b", .shape = {37}, .dtype = DType::kF32}};
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(specs, {.num_shards = n});
  ASSERT_TRUE(layout.ok()) << layout.status();
  const MixedPrecisionPolicy policy{DType::kF32, DType::kF32, DType::kF32, false};
  RunRankThreads(n, [&](int r) {
    auto host = CreateHostAllocator();
    CachingPool pool(*host);
    auto gather = *CreateHostStream({.name = "gather"});
    auto compute = *CreateHostStream({.name = "compute"});
    const size_t shard = layout->shard_elements();
    std::vector<float> framework(shard);
    for (size_t i = 0; i < shard; ++i) framework[i] = Hashed(r, i);
    {
      absl::StatusOr<std::unique_ptr<FlatParameter>> unit = FlatParameter::Create(
          *layout, r, policy,
          {.unsharded_pool = &pool,
           .name = "external",
           .master_shard = Buffer::View(framework.data(), shard * 4, Device::Host())});
      ASSERT_TRUE(unit.ok()) << unit.status();
      EXPECT_EQ((*unit)->master_shard().data, framework.data());
      ASSERT_TRUE((*unit)->Gather(*comms[r], *gather).ok());
      ASSERT_TRUE((*unit)->WaitGathered(*compute).ok());
      const TensorView w = *(*unit)->View(0);
      std::vector<float> copy(layout->total_elements());
      const float* base = static_cast<const float*>(w.data);
      ASSERT_TRUE(compute
                      ->Enqueue([&] {
                        std::copy(base, base + copy.size(), copy.begin());
                        return absl::OkStatus();
                      })
                      .ok());
      ASSERT_TRUE((*unit)->Reshard(nullptr).ok());
      ASSERT_TRUE(compute->Synchronize(Deadline()).ok());
      for (size_t i = 0; i < copy.size(); ++i) {
        const int owner = static_cast<int>(i / shard);
        ASSERT_EQ(copy[i], Hashed(owner, i % shard)) << i;
      }
    }
    EXPECT_EQ(framework[0], Hashed(r, 0)) << "the framework's memory was written";
  });
}

TEST(ExternalMasterShardTest, WrongSizeOrDeviceIsAnError) {
  std::vector<TensorSpec> specs = {{.name = "w", .shape = {10}, .dtype = DType::kF32}};
  FlatLayout layout = *FlatLayout::Create(specs, {.num_shards = 1});
  auto host = CreateHostAllocator();
  std::vector<float> memory(64);
  const MixedPrecisionPolicy policy{DType::kF32, DType::kF32, DType::kF32, false};
  absl::StatusOr<std::unique_ptr<FlatParameter>> small =
      FlatParameter::Create(layout, 0, policy,
                            {.unsharded_pool = host.get(),
                             .master_shard = Buffer::View(memory.data(), 4, Device::Host())});
  EXPECT_EQ(small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("master_shard has 4 bytes"), std::string::npos)
      << small.status();
  absl::StatusOr<std::unique_ptr<FlatParameter>> offload = FlatParameter::Create(
      layout, 0, policy,
      {.unsharded_pool = host.get(),
       .master_shard = Buffer::View(memory.data(), layout.shard_bytes(), Device::Cuda(0))});
  EXPECT_EQ(offload.status().code(), absl::StatusCode::kInvalidArgument) << offload.status();
}

// With an init stream, Create does not block: the zero-fill is queued there, and the first
// gather waits for it.
TEST(ExternalMasterShardTest, InitStreamZeroFillIsOrderedBeforeTheFirstGather) {
  auto comms = *CreateLocalCommunicators(1, {.timeout = absl::Seconds(30)});
  std::vector<TensorSpec> specs = {{.name = "w", .shape = {1001}, .dtype = DType::kF32}};
  FlatLayout layout = *FlatLayout::Create(specs, {.num_shards = 1});
  auto host = CreateHostAllocator();
  // Dirty memory, so that a gather that ran before the fill would see garbage.
  {
    std::vector<Buffer> dirty;
    for (int i = 0; i < 4; ++i) {
      dirty.push_back(*host->Allocate(layout.shard_bytes()));
      std::fill_n(dirty.back().as<float>(), layout.shard_elements(), 3.5f);
    }
  }
  auto init = *CreateHostStream({.name = "init"});
  auto gather = *CreateHostStream({.name = "gather"});
  auto compute = *CreateCallerStream({.name = "compute"});
  Gate gate;
  ASSERT_TRUE(init->Enqueue(BlockOn(gate)).ok());
  const MixedPrecisionPolicy policy{DType::kF32, DType::kF32, DType::kF32, false};
  auto unit = *FlatParameter::Create(layout, 0, policy,
                                     {.unsharded_pool = host.get(), .init_stream = init.get()});
  ASSERT_TRUE(unit->Gather(*comms[0], *gather).ok());
  EXPECT_FALSE(gather->Synchronize(absl::Now() + absl::Milliseconds(30)).ok())
      << "the gather ran before the zero-fill";
  gate.Open();
  ASSERT_TRUE(unit->WaitGathered(*compute).ok());
  const float* w = static_cast<const float*>(unit->View(0)->data);
  for (size_t i = 0; i < 1001; ++i) ASSERT_EQ(w[i], 0.0f) << i;
  ASSERT_TRUE(unit->Reshard(nullptr).ok());
}

}  // namespace
}  // namespace shardline
