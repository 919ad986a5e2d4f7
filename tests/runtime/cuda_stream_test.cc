// CUDA streams and events: host-function order, cross-stream waits (CUDA and host events in both
// directions), poisoning and deadlines. Needs a GPU; skipped otherwise.

#include <gtest/gtest.h>

#ifdef SHARDLINE_WITH_CUDA

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "runtime/cuda/cuda_stream.h"
#include "runtime/stream.h"
#include "tests/common/gate.h"

namespace shardline {
namespace {

using ::testing::HasSubstr;

absl::Time Soon() { return absl::Now() + absl::Seconds(20); }

class CudaStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    const cudaError_t error = cudaGetDeviceCount(&count);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount failed with " << cudaGetErrorName(error);
    }
    if (count == 0) GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount returned 0";
  }

  std::unique_ptr<Stream> Make(const std::string& name,
                               absl::Duration wait_timeout = absl::Seconds(20)) {
    StreamOptions options;
    options.name = name;
    options.wait_timeout = wait_timeout;
    absl::StatusOr<std::unique_ptr<Stream>> stream = CreateCudaStream(0, options);
    EXPECT_TRUE(stream.ok()) << stream.status();
    return std::move(stream).value();
  }
};

using ::shardline::testing::BlockOn;
using ::shardline::testing::Gate;

TEST_F(CudaStreamTest, HostFunctionsRunInOrder) {
  auto stream = Make("order");
  EXPECT_EQ(stream->device(), Device::Cuda(0));
  EXPECT_NE(stream->native_handle(), nullptr);
  std::vector<int> order;
  for (int i = 0; i < 1000; ++i) {
    ASSERT_TRUE(stream
                    ->Enqueue([&order, i] {
                      order.push_back(i);
                      return absl::OkStatus();
                    })
                    .ok());
  }
  ASSERT_TRUE(stream->Synchronize(Soon()).ok());
  std::vector<int> expected;
  for (int i = 0; i < 1000; ++i) expected.push_back(i);
  EXPECT_EQ(order, expected);
}

TEST_F(CudaStreamTest, CrossStreamWaitOnCudaEvent) {
  auto a = Make("a");
  auto b = Make("b");
  Gate gate;
  std::atomic<bool> a_done{false}, b_saw{false};
  ASSERT_TRUE(a->Enqueue(BlockOn(gate)).ok());
  ASSERT_TRUE(a->Enqueue([&] {
                 a_done = true;
                 return absl::OkStatus();
               }).ok());
  absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*a);
  ASSERT_TRUE(event.ok()) << event.status();
  EXPECT_EQ((*event)->device(), Device::Cuda(0));
  ASSERT_TRUE(b->WaitEvent(**event).ok());
  ASSERT_TRUE(b->Enqueue([&] {
                 b_saw = a_done.load();
                 return absl::OkStatus();
               }).ok());
  EXPECT_EQ((*event)->Query().value_or(true), false);
  EXPECT_EQ((*event)->Synchronize(absl::Now() + absl::Milliseconds(20)).code(),
            absl::StatusCode::kDeadlineExceeded);
  gate.Open();
  ASSERT_TRUE(b->Synchronize(Soon()).ok());
  EXPECT_TRUE(b_saw);
  EXPECT_TRUE((*event)->Synchronize(Soon()).ok());
}

TEST_F(CudaStreamTest, HostAndCudaStreamsWaitForEachOther) {
  auto cuda = Make("cuda");
  StreamOptions options;
  options.name = "host";
  auto host = std::move(CreateHostStream(options)).value();

  // CUDA waits for a host event.
  Gate gate;
  std::atomic<bool> host_done{false}, cuda_saw{false};
  ASSERT_TRUE(host->Enqueue(BlockOn(gate)).ok());
  ASSERT_TRUE(host->Enqueue([&] {
                    host_done = true;
                    return absl::OkStatus();
                  })
                  .ok());
  absl::StatusOr<std::shared_ptr<Event>> host_event = RecordEvent(*host);
  ASSERT_TRUE(host_event.ok());
  ASSERT_TRUE(cuda->WaitEvent(**host_event).ok());
  ASSERT_TRUE(cuda->Enqueue([&] {
                    cuda_saw = host_done.load();
                    return absl::OkStatus();
                  })
                  .ok());

  // The host stream waits for a CUDA event recorded after that.
  absl::StatusOr<std::shared_ptr<Event>> cuda_event = RecordEvent(*cuda);
  ASSERT_TRUE(cuda_event.ok());
  auto host2 = std::move(CreateHostStream()).value();
  std::atomic<bool> host2_saw{false};
  ASSERT_TRUE(host2->WaitEvent(**cuda_event).ok());
  ASSERT_TRUE(host2
                  ->Enqueue([&] {
                    host2_saw = cuda_saw.load();
                    return absl::OkStatus();
                  })
                  .ok());
  gate.Open();
  ASSERT_TRUE(host2->Synchronize(Soon()).ok());
  EXPECT_TRUE(host2_saw);
  ASSERT_TRUE(cuda->Synchronize(Soon()).ok());
}

TEST_F(CudaStreamTest, FailurePoisonsStreamAndTravelsAlongWaits) {
  auto a = Make("gather");
  auto b = Make("reduce");
  std::atomic<int> ran{0};
  ASSERT_TRUE(a->Enqueue([] { return absl::InternalError("boom"); }).ok());
  absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*a);
  absl::Status status = a->Synchronize(Soon());
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(status.message()), HasSubstr("gather"));
  EXPECT_EQ(a->Enqueue([&] {
    ran.fetch_add(1);
    return absl::OkStatus();
  }),
            status);
  if (event.ok()) {
    EXPECT_EQ((*event)->Query().status(), status);
    ASSERT_TRUE(b->WaitEvent(**event).ok());
    ASSERT_TRUE(b->Enqueue([&] {
                   ran.fetch_add(1);
                   return absl::OkStatus();
                 }).ok());
    EXPECT_EQ(b->Synchronize(Soon()), status);
  }
  EXPECT_EQ(ran.load(), 0);
}

TEST_F(CudaStreamTest, WaitTimeoutOnHostEventPoisons) {
  auto host = std::move(CreateHostStream()).value();
  auto cuda = Make("cuda", absl::Milliseconds(30));
  Gate gate;
  ASSERT_TRUE(host->Enqueue(BlockOn(gate)).ok());
  absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*host);
  ASSERT_TRUE(event.ok());
  ASSERT_TRUE(cuda->WaitEvent(**event).ok());
  absl::Status status = cuda->Synchronize(Soon());
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("cuda"));
  gate.Open();
  EXPECT_TRUE(host->Synchronize(Soon()).ok());
}

TEST_F(CudaStreamTest, CudaEventCannotBeRecordedOnAHostStream) {
  auto cuda = Make("cuda");
  auto host = std::move(CreateHostStream()).value();
  std::shared_ptr<Event> event = cuda->CreateEvent();
  EXPECT_EQ(event->Record(*host).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(event->Query().value_or(false), true);  // never recorded
}

}  // namespace
}  // namespace shardline

#else  // !SHARDLINE_WITH_CUDA

TEST(CudaStreamTest, NotCompiledIn) {
  GTEST_SKIP() << "CUDA is not compiled in (SHARDLINE_WITH_CUDA=OFF)";
}

#endif  // SHARDLINE_WITH_CUDA
