// The ucx backend over CUDA memory, staged through pinned host memory
// (collectives/staged/staged_communicator.h): ranks as threads sharing cuda:0. Without a GPU
// only the refusals run; the rest skips and says so.

#include <gtest/gtest.h>

#include <memory>

#include "absl/strings/match.h"
#include "collectives/bootstrap.h"
#include "collectives/store/memory_store.h"

#ifndef SHARDLINE_WITH_CUDA

namespace shardline {
namespace {

TEST(StagedCommunicatorTest, BootstrapSaysCudaIsMissing) {
  absl::StatusOr<std::shared_ptr<Communicator>> comm = CreateCommunicator(
      {.backend = "ucx", .store = std::make_shared<MemoryStore>(), .device = Device::Cuda(0)});
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kUnimplemented) << comm.status();
  EXPECT_TRUE(absl::StrContains(comm.status().message(), "without CUDA")) << comm.status();
}

}  // namespace
}  // namespace shardline

#else  // SHARDLINE_WITH_CUDA

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/staged/staged_communicator.h"
#include "runtime/cuda/cuda_stream.h"
#include "tests/collectives/rank_comms.h"
#include "tests/common/cuda_device.h"
#include "tests/common/rank_threads.h"

namespace shardline {
namespace {

using ::shardline::testing::MakeUcxComms;
using ::shardline::testing::RunRankThreads;
using ::shardline::testing::WaitFor;

#define SKIP_WITHOUT_GPU()                                                            \
  do {                                                                                \
    if (std::string why = testing::NoCudaDevice(); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

// Hashed floats of rank r (no small integers: sums are inexact, order shows).
float Value(int rank, size_t i) {
  uint64_t x =
      (static_cast<uint64_t>(rank) + 1) * 0x9E3779B97F4A7C15ULL ^ (i * 0xBF58476D1CE4E5B9ULL);
  x ^= x >> 31;
  return static_cast<float>(static_cast<double>(x % 2000003) / 2000003.0 - 0.5);
}

// Device memory holding `host`, freed with the object.
struct DeviceFloats {
  explicit DeviceFloats(const std::vector<float>& host) : n(host.size()) {
    EXPECT_EQ(cudaMalloc(&data, std::max<size_t>(n, 1) * sizeof(float)), cudaSuccess);
    if (n > 0) {
      EXPECT_EQ(cudaMemcpy(data, host.data(), n * sizeof(float), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }
  ~DeviceFloats() { (void)cudaFree(data); }
  std::vector<float> Read() const {
    std::vector<float> out(n);
    if (n > 0) {
      EXPECT_EQ(cudaMemcpy(out.data(), data, n * sizeof(float), cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    return out;
  }
  float* data = nullptr;
  size_t n = 0;
};

testing::Comms StagedComms(int n) {
  testing::Comms hosts = MakeUcxComms(n);
  testing::Comms staged(n);
  for (int r = 0; r < n; ++r) {
    absl::StatusOr<std::shared_ptr<Communicator>> comm = CreateStagedCommunicator(hosts[r], 0);
    EXPECT_TRUE(comm.ok()) << comm.status();
    if (comm.ok()) staged[r] = *std::move(comm);
  }
  return staged;
}

TEST(StagedCommunicatorTest, MissingDeviceIsUnavailable) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;
  }
  testing::Comms hosts = MakeUcxComms(1);
  absl::StatusOr<std::shared_ptr<Communicator>> comm = CreateStagedCommunicator(hosts[0], count);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kUnavailable) << comm.status();
  EXPECT_TRUE(absl::StrContains(comm.status().message(), absl::StrCat("cuda:", count)))
      << comm.status();
}

TEST(StagedCommunicatorTest, RefusesADeviceCommunicatorAsItsHost) {
  EXPECT_EQ(CreateStagedCommunicator(nullptr, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Every collective at two ranks, odd counts, on each rank's own CUDA stream, every element against
// a plain loop.
TEST(StagedCommunicatorTest, CollectivesMatchPlainLoops) {
  SKIP_WITHOUT_GPU();
  constexpr int kRanks = 2;
  constexpr size_t kCount = 1237;
  testing::Comms comms = StagedComms(kRanks);
  RunRankThreads(kRanks, [&](int r) {
    absl::StatusOr<std::unique_ptr<Stream>> stream = CreateCudaStream(0, {.name = "compute"});
    ASSERT_TRUE(stream.ok()) << stream.status();
    Communicator& comm = *comms[r];
    EXPECT_EQ(comm.device(), Device::Cuda(0));
    std::vector<float> mine(kCount * kRanks);
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = Value(r, i);

    // all_reduce (sum), out of place
    DeviceFloats in(std::vector<float>(mine.begin(), mine.begin() + kCount));
    DeviceFloats out(std::vector<float>(kCount, 0.f));
    ASSERT_TRUE(WaitFor(comm.AllReduce(in.data, out.data, kCount, DType::kF32, **stream)).ok());
    std::vector<float> got = out.Read();
    for (size_t i = 0; i < kCount; ++i) {
      float want = 0;
      for (int k = 0; k < kRanks; ++k) want += Value(k, i);
      ASSERT_FLOAT_EQ(got[i], want) << "all_reduce element " << i;
    }
    // all_gather
    DeviceFloats gathered(std::vector<float>(kCount * kRanks, 0.f));
    ASSERT_TRUE(
        WaitFor(comm.AllGather(in.data, gathered.data, kCount, DType::kF32, **stream)).ok());
    got = gathered.Read();
    for (int k = 0; k < kRanks; ++k) {
      for (size_t i = 0; i < kCount; ++i) {
        ASSERT_EQ(got[k * kCount + i], Value(k, i)) << "all_gather rank " << k << " element " << i;
      }
    }
    // reduce_scatter (avg)
    DeviceFloats full(mine);
    DeviceFloats part(std::vector<float>(kCount, 0.f));
    ReduceOptions avg;
    avg.op = ReduceOp::kAvg;
    ASSERT_TRUE(
        WaitFor(comm.ReduceScatter(full.data, part.data, kCount, DType::kF32, **stream, avg)).ok());
    got = part.Read();
    for (size_t i = 0; i < kCount; ++i) {
      float want = 0;
      for (int k = 0; k < kRanks; ++k) want += Value(k, r * kCount + i);
      ASSERT_NEAR(got[i], want / kRanks, 1e-6f) << "reduce_scatter element " << i;
    }
    // broadcast from rank 1, in place
    DeviceFloats buffer(std::vector<float>(mine.begin(), mine.begin() + kCount));
    BroadcastOptions from1;
    from1.root = 1;
    ASSERT_TRUE(WaitFor(comm.Broadcast(buffer.data, kCount, DType::kF32, **stream, from1)).ok());
    got = buffer.Read();
    for (size_t i = 0; i < kCount; ++i) ASSERT_EQ(got[i], Value(1, i)) << "broadcast " << i;
    // send / recv: rank 0 sends its block to rank 1
    if (r == 0) {
      ASSERT_TRUE(WaitFor(comm.Send(in.data, kCount, DType::kF32, 1, **stream)).ok());
    } else {
      DeviceFloats received(std::vector<float>(kCount, 0.f));
      absl::StatusOr<Work> recv = comm.Recv(received.data, kCount, DType::kF32, 0, **stream);
      ASSERT_TRUE(WaitFor(recv).ok());
      EXPECT_EQ(recv->source(), 0);
      got = received.Read();
      for (size_t i = 0; i < kCount; ++i) ASSERT_EQ(got[i], Value(0, i)) << "recv " << i;
    }
  });
}

TEST(StagedCommunicatorTest, RefusesHostMemoryAndMixesNamingThem) {
  SKIP_WITHOUT_GPU();
  testing::Comms comms = StagedComms(1);
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateCudaStream(0, {.name = "compute"});
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::vector<float> host(64, 1.f);
  DeviceFloats device(host);
  absl::StatusOr<Work> all_host =
      comms[0]->AllReduce(host.data(), host.data(), 64, DType::kF32, **stream);
  EXPECT_EQ(all_host.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(all_host.status().message(), "is host memory"))
      << all_host.status();
  absl::StatusOr<Work> mixed =
      comms[0]->AllReduce(device.data, host.data(), 64, DType::kF32, **stream);
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(mixed.status().message(), "is cuda:0 memory but output"))
      << mixed.status();
  absl::StatusOr<std::unique_ptr<Stream>> host_stream = CreateHostStream({.name = "host"});
  ASSERT_TRUE(host_stream.ok());
  absl::StatusOr<Work> wrong_stream =
      comms[0]->AllReduce(device.data, device.data, 64, DType::kF32, **host_stream);
  EXPECT_EQ(wrong_stream.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(wrong_stream.status().message(), "not a CUDA stream"))
      << wrong_stream.status();
  // A refused call spends nothing: the communicator still works.
  EXPECT_TRUE(
      WaitFor(comms[0]->AllReduce(device.data, device.data, 64, DType::kF32, **stream)).ok());
}

}  // namespace
}  // namespace shardline

#endif  // SHARDLINE_WITH_CUDA
