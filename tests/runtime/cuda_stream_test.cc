// CUDA streams and events: host-function order, cross-stream waits (CUDA and host events in both
// directions), poisoning and deadlines; wrapped framework streams and events; host-event waits on
// the device and their blocking fallback; a failed stream's guard keeps memory that a kernel
// still uses. Needs a GPU; skipped otherwise (except the argument checks of
// CudaWrapArgumentsTest, which need no device).

#include <gtest/gtest.h>

#ifdef SHARDLINE_WITH_CUDA

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "runtime/allocator.h"
#include "runtime/caching_pool.h"
#include "runtime/config.h"
#include "runtime/cuda/cuda_stream.h"
#include "runtime/cuda/internal/cuda_host_wait.h"
#include "runtime/stream.h"
#include "tests/common/cuda_device.h"
#include "tests/common/gate.h"
#include "tests/runtime/cuda_test_kernels.h"

namespace shardline {
namespace {

using ::testing::HasSubstr;

absl::Time Soon() { return absl::Now() + absl::Seconds(20); }

class CudaStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = ::shardline::testing::NoCudaDevice(); !why.empty()) {
      GTEST_SKIP() << why;
    }
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
using ::shardline::testing::LaunchSpinThenFill;
using ::shardline::testing::SpinFillValue;

// Polls `done` until it holds or `deadline` passes, for states that no event reports (a stream's
// poisoning by a host function that has returned).
template <typename Done>
bool PollUntil(Done done, absl::Time deadline) {
  while (!done()) {
    if (absl::Now() >= deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

// Polls cudaStreamQuery on a framework stream until its work has run (bounded).
cudaError_t DrainRaw(cudaStream_t stream, absl::Time deadline) {
  while (true) {
    const cudaError_t error = cudaStreamQuery(stream);
    if (error != cudaErrorNotReady || absl::Now() >= deadline) return error;
    std::this_thread::yield();
  }
}

// A device-mapped host word that releases LaunchSpinThenFill.
class SpinFlag {
 public:
  SpinFlag() {
    EXPECT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof(uint32_t),
                            cudaHostAllocMapped | cudaHostAllocPortable),
              cudaSuccess);
    *host_ = 0;
    EXPECT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0), cudaSuccess);
  }
  ~SpinFlag() {
    Release();  // never leave a kernel spinning on freed memory
    (void)cudaFreeHost(host_);
  }
  SpinFlag(const SpinFlag&) = delete;
  SpinFlag& operator=(const SpinFlag&) = delete;

  const uint32_t* device() const { return device_; }
  void Release() { __atomic_store_n(host_, 1u, __ATOMIC_RELEASE); }

 private:
  uint32_t* host_ = nullptr;
  uint32_t* device_ = nullptr;
};

// Sets an environment knob for the scope and makes the knobs read it afresh.
class ScopedKnob {
 public:
  ScopedKnob(const char* name, const char* value) : name_(name) {
    setenv(name, value, 1);
    Reset();
  }
  ~ScopedKnob() {
    unsetenv(name_);
    Reset();
  }

 private:
  void Reset() {
    for (const ParamBase* param : AllParams()) {
      if (param->env_name() == name_) param->ResetCacheForTesting();
    }
  }
  const char* name_;
};

constexpr uint64_t kSpinTimeoutNs = 20'000'000'000ull;  // a failing test frees the GPU after 20 s

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

TEST_F(CudaStreamTest, CudaEventCannotBeRecordedOnAHostStream) {
  auto cuda = Make("cuda");
  auto host = std::move(CreateHostStream()).value();
  std::shared_ptr<Event> event = cuda->CreateEvent();
  EXPECT_EQ(event->Record(*host).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(event->Query().value_or(false), true);  // never recorded
}

// --- Host events gating CUDA streams: waited for on the device, or in the blocking fallback ---

// The host work that releases a CUDA stream's wait is itself released by a host function of
// another CUDA stream. A wait that blocked CUDA's host-callback thread would hold that host
// function back until the gated stream's wait_timeout: a cross-stream cycle.
TEST_F(CudaStreamTest, AHostEventWaitLeavesTheHostCallbackThreadFree) {
  if (!cuda_internal::DeviceWaitsAvailable(0)) {
    GTEST_SKIP() << "cuda:0 cannot wait on host memory (no cuStreamWaitValue32 or no mapped "
                    "host memory): CUDA streams use the blocking fallback";
  }
  auto host = std::move(CreateHostStream()).value();
  auto gated = Make("gated", absl::Seconds(10));
  auto other = Make("other");
  Gate gate;
  const uint32_t kValue = SpinFillValue(17);
  std::atomic<uint32_t> produced{0}, seen{0};
  ASSERT_TRUE(host->Enqueue(BlockOn(gate)).ok());
  ASSERT_TRUE(host->Enqueue([&] {
                    produced = kValue;
                    return absl::OkStatus();
                  })
                  .ok());
  absl::StatusOr<std::shared_ptr<Event>> host_event = RecordEvent(*host);
  ASSERT_TRUE(host_event.ok()) << host_event.status();
  ASSERT_TRUE(gated->WaitEvent(**host_event).ok());
  ASSERT_TRUE(gated
                  ->Enqueue([&] {
                    seen = produced.load();
                    return absl::OkStatus();
                  })
                  .ok());
  ASSERT_TRUE(other
                  ->Enqueue([&] {
                    gate.Open();
                    return absl::OkStatus();
                  })
                  .ok());
  EXPECT_TRUE(other->Synchronize(absl::Now() + absl::Seconds(5)).ok())
      << "a host function of another stream did not run while a stream waited for a host event";
  const absl::Status gated_status = gated->Synchronize(Soon());
  EXPECT_TRUE(gated_status.ok())
      << gated_status << " (DeadlineExceeded: the wait held CUDA's host-callback thread; see the "
      << "WARN log for a fallback to blocking waits)";
  EXPECT_EQ(seen.load(), kValue);
}

// A failed host event poisons the waiting stream at the wait, in its order: host work before the
// wait still runs (even when it runs after the failure is known), work after it is cancelled,
// and only events recorded after the wait report the failure.
TEST_F(CudaStreamTest, AFailedHostEventPoisonsTheStreamAtTheWait) {
  auto host = std::move(CreateHostStream()).value();
  auto cuda = Make("cuda");
  Gate host_gate, cuda_gate;
  ASSERT_TRUE(host->Enqueue(BlockOn(host_gate)).ok());
  ASSERT_TRUE(host->Enqueue([] { return absl::InternalError("host producer failed"); }).ok());
  absl::StatusOr<std::shared_ptr<Event>> host_event = RecordEvent(*host);
  ASSERT_TRUE(host_event.ok()) << host_event.status();

  std::atomic<bool> before_ran{false}, after_ran{false};
  absl::Status after_cancelled;
  std::mutex mu;
  // Holds the CUDA stream (and the host-callback thread) until the failure is known.
  ASSERT_TRUE(cuda->Enqueue(BlockOn(cuda_gate)).ok());
  ASSERT_TRUE(cuda->Enqueue([&] {
                    before_ran = true;
                    return absl::OkStatus();
                  })
                  .ok());
  absl::StatusOr<std::shared_ptr<Event>> before = RecordEvent(*cuda);
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_TRUE(cuda->WaitEvent(**host_event).ok());
  StreamOp after;
  after.name = "after the wait";
  after.run = [&] {
    after_ran = true;
    return absl::OkStatus();
  };
  after.cancel = [&](const absl::Status& status) {
    std::lock_guard<std::mutex> lock(mu);
    after_cancelled = status;
  };
  ASSERT_TRUE(cuda->Submit(std::move(after)).ok());
  std::shared_ptr<Event> after_event = cuda->CreateEvent();
  ASSERT_TRUE(after_event->Record(*cuda).ok());

  host_gate.Open();
  const absl::Status failure = host->Synchronize(Soon());
  ASSERT_EQ(failure.code(), absl::StatusCode::kInternal) << failure;
  cuda_gate.Open();
  EXPECT_EQ(cuda->Synchronize(Soon()), failure);
  EXPECT_TRUE(before_ran);
  EXPECT_FALSE(after_ran);
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(after_cancelled, failure);
  }
  EXPECT_TRUE((*before)->Synchronize(Soon()).ok());
  EXPECT_EQ(after_event->Synchronize(Soon()), failure);
}

// How a CUDA stream waits for a host event: as SHARDLINE_CUDA_WAIT_VALUE is by default (on the
// device, where the platform can), or with it set to 0 (the blocking fallback, a host function).
// Both must order the stream's work after the event and time out at wait_timeout.
enum class HostWaitMode { kDefault, kBlockingFallback };

class CudaHostWaitTest : public CudaStreamTest, public ::testing::WithParamInterface<HostWaitMode> {
 protected:
  void SetUp() override {
    CudaStreamTest::SetUp();
    if (IsSkipped()) return;
    if (GetParam() == HostWaitMode::kBlockingFallback) {
      knob_.emplace("SHARDLINE_CUDA_WAIT_VALUE", "0");
    }
  }

 private:
  std::optional<ScopedKnob> knob_;  // outlives the streams of the test body
};

TEST_P(CudaHostWaitTest, OrdersWorkAfterAHostEvent) {
  auto host = std::move(CreateHostStream()).value();
  auto cuda = Make("waiter");
  Gate gate;
  const uint32_t kValue = SpinFillValue(3);
  std::atomic<uint32_t> produced{0}, seen{0};
  ASSERT_TRUE(host->Enqueue(BlockOn(gate)).ok());
  ASSERT_TRUE(host->Enqueue([&] {
                    produced = kValue;
                    return absl::OkStatus();
                  })
                  .ok());
  absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(*host);
  ASSERT_TRUE(event.ok()) << event.status();
  ASSERT_TRUE(cuda->WaitEvent(**event).ok());
  ASSERT_TRUE(cuda->Enqueue([&] {
                    seen = produced.load();
                    return absl::OkStatus();
                  })
                  .ok());
  gate.Open();
  ASSERT_TRUE(cuda->Synchronize(Soon()).ok());
  EXPECT_EQ(seen.load(), kValue);
}

TEST_P(CudaHostWaitTest, WaitTimeoutOnHostEventPoisons) {
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

INSTANTIATE_TEST_SUITE_P(WaitModes, CudaHostWaitTest,
                         ::testing::Values(HostWaitMode::kDefault, HostWaitMode::kBlockingFallback),
                         [](const ::testing::TestParamInfo<HostWaitMode>& info) {
                           return info.param == HostWaitMode::kDefault ? "Default"
                                                                       : "BlockingFallback";
                         });

// --- Wrapped framework streams and events ---

TEST_F(CudaStreamTest, AWrappedStreamBehavesAsOurs) {
  cudaStream_t raw = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking), cudaSuccess);
  StreamOptions options;
  options.name = "framework";
  options.wait_timeout = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<Stream>> wrapped = WrapCudaStream(raw, 0, options);
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  Stream& framework = **wrapped;
  EXPECT_EQ(framework.native_handle(), raw);
  EXPECT_EQ(framework.device(), Device::Cuda(0));
  EXPECT_EQ(framework.name(), "framework");
  auto ours = Make("ours");

  // Host functions in order, and CUDA-event waits in both directions.
  Gate gate;
  std::vector<uint32_t> order;
  std::atomic<bool> framework_done{false}, ours_saw{false}, framework_saw{false};
  ASSERT_TRUE(framework.Enqueue(BlockOn(gate)).ok());
  for (uint32_t i = 0; i < 100; ++i) {
    ASSERT_TRUE(framework
                    .Enqueue([&order, i] {
                      order.push_back(SpinFillValue(i));
                      return absl::OkStatus();
                    })
                    .ok());
  }
  ASSERT_TRUE(framework
                  .Enqueue([&] {
                    framework_done = true;
                    return absl::OkStatus();
                  })
                  .ok());
  absl::StatusOr<std::shared_ptr<Event>> from_framework = RecordEvent(framework);
  ASSERT_TRUE(from_framework.ok()) << from_framework.status();
  EXPECT_EQ((*from_framework)->recorded_stream_id(), framework.id());
  ASSERT_TRUE(ours->WaitEvent(**from_framework).ok());
  ASSERT_TRUE(ours->Enqueue([&] {
                    ours_saw = framework_done.load();
                    return absl::OkStatus();
                  })
                  .ok());
  absl::StatusOr<std::shared_ptr<Event>> from_ours = RecordEvent(*ours);
  ASSERT_TRUE(from_ours.ok()) << from_ours.status();
  ASSERT_TRUE(framework.WaitEvent(**from_ours).ok());
  ASSERT_TRUE(framework
                  .Enqueue([&] {
                    framework_saw = ours_saw.load();
                    return absl::OkStatus();
                  })
                  .ok());
  EXPECT_EQ((*from_framework)->Query().value_or(true), false);
  gate.Open();
  ASSERT_TRUE(framework.Synchronize(Soon()).ok());
  std::vector<uint32_t> expected;
  for (uint32_t i = 0; i < 100; ++i) expected.push_back(SpinFillValue(i));
  EXPECT_EQ(order, expected);
  EXPECT_TRUE(ours_saw);
  EXPECT_TRUE(framework_saw);

  // Poisoning skips our host work, not the framework's own device work on the stream.
  ASSERT_TRUE(framework.Enqueue([] { return absl::InternalError("framework-side failure"); }).ok());
  const absl::Status failure = framework.Synchronize(Soon());
  EXPECT_EQ(failure.code(), absl::StatusCode::kInternal) << failure;
  EXPECT_THAT(std::string(failure.message()), HasSubstr("framework"));
  EXPECT_EQ(framework.Enqueue([] { return absl::OkStatus(); }), failure);
  uint32_t* device_word = nullptr;
  ASSERT_EQ(cudaMalloc(&device_word, sizeof(uint32_t)), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(device_word, 0x5A, sizeof(uint32_t), raw), cudaSuccess);
  uint32_t host_word = 0;
  ASSERT_EQ(cudaMemcpyAsync(&host_word, device_word, sizeof(uint32_t), cudaMemcpyDeviceToHost, raw),
            cudaSuccess);
  EXPECT_EQ(DrainRaw(raw, Soon()), cudaSuccess);
  EXPECT_EQ(host_word, 0x5A5A5A5Au);
  EXPECT_EQ(cudaFree(device_word), cudaSuccess);

  wrapped->reset();
  EXPECT_EQ(cudaStreamDestroy(raw), cudaSuccess);
}

TEST_F(CudaStreamTest, DestroyingAWrappedStreamNeitherWaitsNorDestroys) {
  cudaStream_t raw = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking), cudaSuccess);
  Gate gate;
  std::atomic<bool> ran{false};
  {
    absl::StatusOr<std::unique_ptr<Stream>> wrapped = WrapCudaStream(raw, 0);
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    ASSERT_TRUE((*wrapped)->Enqueue(BlockOn(gate)).ok());
    ASSERT_TRUE((*wrapped)
                    ->Enqueue([&] {
                      ran = true;
                      return absl::OkStatus();
                    })
                    .ok());
  }  // returns at once: a drain would wait for the gate
  EXPECT_FALSE(ran);
  EXPECT_EQ(cudaStreamQuery(raw), cudaErrorNotReady);
  gate.Open();
  EXPECT_EQ(DrainRaw(raw, Soon()), cudaSuccess);
  EXPECT_TRUE(ran);
  // The handle is still the framework's: usable, and destroyed by it.
  int* device_int = nullptr;
  ASSERT_EQ(cudaMalloc(&device_int, sizeof(int)), cudaSuccess);
  EXPECT_EQ(cudaMemsetAsync(device_int, 0, sizeof(int), raw), cudaSuccess);
  EXPECT_EQ(DrainRaw(raw, Soon()), cudaSuccess);
  EXPECT_EQ(cudaFree(device_int), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(raw), cudaSuccess);
}

TEST_F(CudaStreamTest, TheLegacyDefaultStreamCanBeWrapped) {
  absl::StatusOr<std::unique_ptr<Stream>> wrapped = WrapCudaStream(nullptr, 0);
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  EXPECT_EQ((*wrapped)->native_handle(), static_cast<void*>(cudaStreamLegacy));
  std::atomic<int> ran{0};
  ASSERT_TRUE((*wrapped)
                  ->Enqueue([&] {
                    ran.fetch_add(1);
                    return absl::OkStatus();
                  })
                  .ok());
  absl::StatusOr<std::shared_ptr<Event>> event = RecordEvent(**wrapped);
  ASSERT_TRUE(event.ok()) << event.status();
  auto ours = Make("ours");
  ASSERT_TRUE(ours->WaitEvent(**event).ok());
  ASSERT_TRUE(ours->Enqueue([&] {
                    ran.fetch_add(1);
                    return absl::OkStatus();
                  })
                  .ok());
  ASSERT_TRUE(ours->Synchronize(Soon()).ok());
  EXPECT_EQ(ran.load(), 2);
  EXPECT_TRUE((*wrapped)->Synchronize(Soon()).ok());
}

TEST_F(CudaStreamTest, AWrappedEventIsWaitedForQueriedAndRecorded) {
  cudaEvent_t raw = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&raw, cudaEventDisableTiming), cudaSuccess);
  auto producer = Make("producer");
  auto consumer = Make("consumer");

  // Recorded by the framework (a plain cudaEventRecord): our streams wait for it.
  Gate gate;
  std::atomic<bool> produced{false}, consumer_saw{false};
  ASSERT_TRUE(producer->Enqueue(BlockOn(gate)).ok());
  ASSERT_TRUE(producer
                  ->Enqueue([&] {
                    produced = true;
                    return absl::OkStatus();
                  })
                  .ok());
  ASSERT_EQ(cudaEventRecord(raw, static_cast<cudaStream_t>(producer->native_handle())),
            cudaSuccess);
  absl::StatusOr<std::shared_ptr<Event>> wrapped = WrapCudaEvent(raw, 0);
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  Event& event = **wrapped;
  EXPECT_EQ(event.device(), Device::Cuda(0));
  EXPECT_EQ(event.recorded_stream_id(), 0u);  // recorded by the framework: unknown
  ASSERT_TRUE(consumer->WaitEvent(event).ok());
  ASSERT_TRUE(consumer
                  ->Enqueue([&] {
                    consumer_saw = produced.load();
                    return absl::OkStatus();
                  })
                  .ok());
  auto host = std::move(CreateHostStream()).value();
  std::atomic<bool> host_saw{false};
  ASSERT_TRUE(host->WaitEvent(event).ok());
  ASSERT_TRUE(host->Enqueue([&] {
                    host_saw = produced.load();
                    return absl::OkStatus();
                  })
                  .ok());
  EXPECT_EQ(event.Query().value_or(true), false);
  gate.Open();
  ASSERT_TRUE(consumer->Synchronize(Soon()).ok());
  ASSERT_TRUE(host->Synchronize(Soon()).ok());
  EXPECT_TRUE(consumer_saw);
  EXPECT_TRUE(host_saw);
  EXPECT_EQ(event.Query().value_or(false), true);

  // Recorded here, on one of our streams: the framework waits on the same cudaEvent_t.
  Gate second;
  ASSERT_TRUE(producer->Enqueue(BlockOn(second)).ok());
  ASSERT_TRUE(event.Record(*producer).ok());
  EXPECT_EQ(event.recorded_stream_id(), producer->id());
  EXPECT_EQ(cudaEventQuery(raw), cudaErrorNotReady);
  second.Open();
  EXPECT_TRUE(event.Synchronize(Soon()).ok());
  EXPECT_EQ(cudaEventQuery(raw), cudaSuccess);

  // A failure of our stream before the record is reported through it, once the device is there.
  ASSERT_TRUE(producer->Enqueue([] { return absl::InternalError("producer failed"); }).ok());
  (void)event.Record(*producer);  // may already report the failure; the record is made anyway
  EXPECT_EQ(event.Synchronize(Soon()).code(), absl::StatusCode::kInternal);

  // The Event never destroys the framework's handle.
  wrapped->reset();
  EXPECT_EQ(cudaEventQuery(raw), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(raw), cudaSuccess);
}

// --- A poisoned stream's guard event keeps pool memory a kernel still writes ---

// A host function fails ahead of a kernel that is still in flight. The guard event recorded
// after the kernel must not report anything (neither done nor the failure) until the kernel has
// finished, so the pool keeps the block the kernel writes.
TEST_F(CudaStreamTest, AFailedHostFunctionDoesNotFreeMemoryUnderAKernelInFlight) {
  auto stream = Make("compute");
  absl::StatusOr<std::unique_ptr<Allocator>> device = CreateCudaAllocator(0, "device");
  ASSERT_TRUE(device.ok()) << device.status();
  CachingPoolOptions pool_options;
  pool_options.name = "unsharded";
  CachingPool pool(**device, pool_options);
  constexpr size_t kCount = size_t{1} << 20;
  constexpr size_t kBytes = kCount * sizeof(uint32_t);
  absl::StatusOr<Buffer> block = pool.Allocate(kBytes);
  ASSERT_TRUE(block.ok()) << block.status();
  void* const address = block->data();
  SpinFlag flag;

  ASSERT_TRUE(stream->Enqueue([] { return absl::InternalError("host function failed"); }).ok());
  ASSERT_EQ(LaunchSpinThenFill(flag.device(), kSpinTimeoutNs, block->as<uint32_t>(), kCount,
                               static_cast<cudaStream_t>(stream->native_handle())),
            cudaSuccess);
  std::shared_ptr<Event> guard = stream->CreateEvent();
  (void)guard->Record(*stream);  // may already report the failure; the record is made anyway
  ASSERT_TRUE(PollUntil([&] { return !stream->status().ok(); }, Soon()))
      << "the failing host function never ran";

  // The stream has failed, the kernel still runs: the guard reports neither.
  absl::StatusOr<bool> done = guard->Query();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_FALSE(*done);
  block->ReleaseAfter(guard);
  block->Reset();
  EXPECT_EQ(pool.Collect(), 0);
  EXPECT_EQ(pool.pending_blocks(), 1);
  absl::StatusOr<Buffer> other = pool.Allocate(kBytes);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_NE(other->data(), address);
  EXPECT_EQ(pool.pending_blocks(), 1);
  EXPECT_EQ(guard->Query().value_or(true), false);

  // Registered after the pool's own callback, on the same side stream: runs after it.
  Gate callbacks_ran;
  absl::Status completion;
  guard->OnComplete([&](absl::Status status) {
    completion = std::move(status);
    callbacks_ran.Open();
  });
  flag.Release();
  EXPECT_EQ(guard->Synchronize(Soon()).code(), absl::StatusCode::kInternal);
  ASSERT_TRUE(callbacks_ran.Wait());
  EXPECT_EQ(completion.code(), absl::StatusCode::kInternal) << completion;
  EXPECT_EQ(pool.Collect(), 1);
  EXPECT_EQ(pool.pending_blocks(), 0);

  // The block went to the cache only now, holding everything the kernel wrote.
  absl::StatusOr<Buffer> reused = pool.Allocate(kBytes);
  ASSERT_TRUE(reused.ok()) << reused.status();
  EXPECT_EQ(reused->data(), address);
  std::vector<uint32_t> contents(kCount);
  ASSERT_EQ(cudaMemcpy(contents.data(), reused->data(), kBytes, cudaMemcpyDeviceToHost),
            cudaSuccess);
  size_t wrong = 0;
  for (size_t i = 0; i < kCount; ++i) wrong += contents[i] != SpinFillValue(i);
  EXPECT_EQ(wrong, 0u);
}

// --- Argument checks that need no device ---

TEST(CudaWrapArgumentsTest, RejectsHandlesItCannotWrap) {
  EXPECT_EQ(WrapCudaEvent(nullptr, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WrapCudaStream(cudaStreamPerThread, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) (void)cudaGetLastError();
  const int missing = error == cudaSuccess ? count : 0;
  absl::StatusOr<std::unique_ptr<Stream>> stream = WrapCudaStream(nullptr, missing);
  EXPECT_EQ(stream.status().code(), absl::StatusCode::kUnavailable) << stream.status();
  EXPECT_THAT(std::string(stream.status().message()), HasSubstr("cuda:"));
}

}  // namespace
}  // namespace shardline

#else  // !SHARDLINE_WITH_CUDA

TEST(CudaStreamTest, NotCompiledIn) {
  GTEST_SKIP() << "CUDA is not compiled in (SHARDLINE_WITH_CUDA=OFF)";
}

#endif  // SHARDLINE_WITH_CUDA
