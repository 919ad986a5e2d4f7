// The nccl backend. Everywhere: creation errors (no GPU, missing device, bad options) are clear
// Statuses, never crashes. With one GPU: every collective, dtype, op and count on device memory
// against plain-loop references (a group of one), validation, abort. With two or more GPUs
// (ranks as threads, one device each): the same for the whole group, Split, the fingerprint
// debug mode, and a missing rank turning into an error instead of a hang. Tests that need a GPU
// skip with the reason when there is none.

#include <gtest/gtest.h>

#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/bootstrap.h"
#include "collectives/store/memory_store.h"

#ifndef SHARDLINE_WITH_CUDA

namespace shardline {
namespace {

TEST(NcclCommunicatorTest, NeedsCuda) { GTEST_SKIP() << "shardline was built without CUDA"; }

TEST(NcclCommunicatorTest, BootstrapSaysTheBackendIsMissing) {
  absl::StatusOr<std::shared_ptr<Communicator>> comm = CreateCommunicator(
      {.backend = "nccl", .store = std::make_shared<MemoryStore>(), .device = Device::Cuda(0)});
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kUnimplemented) << comm.status();
  EXPECT_TRUE(absl::StrContains(comm.status().message(), "without CUDA")) << comm.status();
}

}  // namespace
}  // namespace shardline

#else  // SHARDLINE_WITH_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "collectives/flight_recorder.h"
#include "collectives/nccl/nccl_communicator.h"
#include "runtime/config.h"
#include "runtime/stream.h"
#include "testing/typed_values.h"
#include "tests/collectives/rank_comms.h"
#include "tests/common/rank_threads.h"
#include "tests/common/scoped_env.h"

namespace shardline {
namespace {

using ::shardline::testing::GetElement;
using ::shardline::testing::PatternBuffer;
using ::shardline::testing::PatternReductionFits;
using ::shardline::testing::PatternValue;
using ::shardline::testing::ReferenceReduce;
using ::shardline::testing::RunRankThreads;
using ::shardline::testing::ScopedEnv;
using ::shardline::testing::Tolerance;
using ::shardline::testing::WaitFor;

constexpr DType kReduceDTypes[] = {DType::kF32,  DType::kF64, DType::kF16,
                                   DType::kBF16, DType::kI32, DType::kI64};
constexpr size_t kCounts[] = {0, 1, 7, 4097};
constexpr int kMaxRanks = 4;

// The number of CUDA devices; 0 with the reason in `why` when there is none.
int DeviceCount(std::string* why) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    *why = absl::StrCat("no CUDA device: ", cudaGetErrorString(error));
    return 0;
  }
  if (count == 0) *why = "no CUDA device: cudaGetDeviceCount reports 0";
  return count;
}

#define SKIP_UNLESS_GPUS(k)                                                               \
  do {                                                                                    \
    std::string why;                                                                      \
    const int found = DeviceCount(&why);                                                  \
    if (found == 0) GTEST_SKIP() << why;                                                  \
    if (found < (k)) GTEST_SKIP() << "needs " << (k) << " CUDA devices, found " << found; \
  } while (0)

// ---- Without a GPU ------------------------------------------------------------------------

TEST(NcclCommunicatorTest, MissingDeviceIsUnavailableAndNamesIt) {
  std::string why;
  const int missing = DeviceCount(&why);  // one past the last device: cuda:0 when there is none
  absl::StatusOr<std::shared_ptr<Communicator>> comm =
      CreateNcclCommunicator({.rank = 0,
                              .size = 1,
                              .store = std::make_shared<MemoryStore>(),
                              .device = missing,
                              .timeout = absl::Seconds(10)});
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kUnavailable) << comm.status();
  EXPECT_TRUE(absl::StrContains(comm.status().message(), absl::StrCat("cuda:", missing)))
      << comm.status();
}

TEST(NcclCommunicatorTest, RankZeroFailureReachesTheOtherRanks) {
  std::string why;
  const int missing = DeviceCount(&why);
  auto store = std::make_shared<MemoryStore>();
  // Rank 0 cannot use its device and publishes why; rank 1 (on cuda:0, which exists if there is
  // a GPU) must fail at once with rank 0's reason, not at the deadline. Without a GPU rank 1
  // fails its own device check, as quickly.
  absl::StatusOr<std::shared_ptr<Communicator>> zero = CreateNcclCommunicator(
      {.rank = 0, .size = 2, .store = store, .device = missing, .timeout = absl::Seconds(30)});
  ASSERT_FALSE(zero.ok());
  const absl::Time start = absl::Now();
  absl::StatusOr<std::shared_ptr<Communicator>> one = CreateNcclCommunicator(
      {.rank = 1, .size = 2, .store = store, .device = 0, .timeout = absl::Seconds(30)});
  ASSERT_FALSE(one.ok());
  EXPECT_EQ(one.status().code(), absl::StatusCode::kUnavailable) << one.status();
  EXPECT_TRUE(absl::StrContains(one.status().message(), absl::StrCat("cuda:", missing)))
      << one.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(NcclCommunicatorTest, BadOptionsAreInvalidArgument) {
  auto store = std::make_shared<MemoryStore>();
  const NcclOptions bad[] = {
      {.rank = 0, .size = 1, .store = nullptr},
      {.rank = 2, .size = 2, .store = store},
      {.rank = 0, .size = 0, .store = store},
      {.rank = 0, .size = 1, .store = store, .device = -1},
      {.rank = 0, .size = 1, .store = store, .timeout = absl::Seconds(-1)},
  };
  for (const NcclOptions& options : bad) {
    absl::StatusOr<std::shared_ptr<Communicator>> comm = CreateNcclCommunicator(options);
    EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument) << comm.status();
  }
}

TEST(NcclCommunicatorTest, BootstrapDispatchesToNccl) {
  auto store = std::make_shared<MemoryStore>();
  absl::StatusOr<std::shared_ptr<Communicator>> host =
      CreateCommunicator({.backend = "nccl", .store = store, .device = Device::Host()});
  EXPECT_EQ(host.status().code(), absl::StatusCode::kInvalidArgument) << host.status();
  std::string why;
  const int missing = DeviceCount(&why);
  absl::StatusOr<std::shared_ptr<Communicator>> comm =
      CreateCommunicator({.backend = "nccl",
                          .store = store,
                          .device = Device::Cuda(missing),
                          .timeout = absl::Seconds(10)});
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kUnavailable) << comm.status();
  EXPECT_TRUE(absl::StrContains(comm.status().message(), absl::StrCat("cuda:", missing)))
      << comm.status();
}

// ---- Device helpers -----------------------------------------------------------------------

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)), cudaSuccess);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
  }
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }

 private:
  void* ptr_ = nullptr;
};

cudaStream_t Native(Stream& stream) { return static_cast<cudaStream_t>(stream.native_handle()); }

void Upload(Stream& stream, void* dst, const std::vector<uint8_t>& src) {
  if (src.empty()) return;
  ASSERT_EQ(cudaMemcpyAsync(dst, src.data(), src.size(), cudaMemcpyHostToDevice, Native(stream)),
            cudaSuccess);
  ASSERT_TRUE(stream.Synchronize(absl::Now() + absl::Seconds(60)).ok());
}

void Fill(Stream& stream, void* dst, size_t bytes) {
  ASSERT_EQ(cudaMemsetAsync(dst, 0xAB, bytes, Native(stream)), cudaSuccess);
}

std::vector<uint8_t> Download(Stream& stream, const void* src, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  if (bytes == 0) return out;
  EXPECT_EQ(cudaMemcpyAsync(out.data(), src, bytes, cudaMemcpyDeviceToHost, Native(stream)),
            cudaSuccess);
  EXPECT_TRUE(stream.Synchronize(absl::Now() + absl::Seconds(60)).ok());
  return out;
}

using RankFn = std::function<void(int rank, int n, Communicator& comm, Stream& stream)>;

// Runs fn on one thread per rank, rank r on cuda:r with its own CUDA stream.
void RunRanks(int n, const RankFn& fn, absl::Duration timeout = absl::Seconds(60)) {
  auto store = std::make_shared<MemoryStore>();
  RunRankThreads(n, [&](int r) {
    ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
    absl::StatusOr<std::shared_ptr<Communicator>> comm = CreateNcclCommunicator(
        {.rank = r, .size = n, .store = store, .device = r, .timeout = timeout});
    ASSERT_TRUE(comm.ok()) << comm.status();
    EXPECT_EQ((*comm)->backend(), "nccl");
    EXPECT_EQ((*comm)->device(), Device::Cuda(r));
    absl::StatusOr<std::unique_ptr<Stream>> stream =
        CreateStream(Device::Cuda(r), {.name = absl::StrCat("nccl", r)});
    ASSERT_TRUE(stream.ok()) << stream.status();
    fn(r, n, **comm, **stream);
  });
}

// 2 or 4 ranks: a power of two, so that NCCL's avg of f16/bf16 (a pre-multiplication by 1/n)
// stays exact on the test pattern.
int GroupSize() {
  std::string why;
  return DeviceCount(&why) >= 4 ? 4 : 2;
}

// ---- Every collective against plain loops ---------------------------------------------------

void CheckAllGather(int r, int n, Communicator& comm, Stream& stream, uint8_t* in_buf,
                    uint8_t* out_buf) {
  for (DType dtype : kAllDTypes) {
    for (size_t count : kCounts) {
      for (bool in_place : {false, true}) {
        const size_t e = DTypeSize(dtype);
        Fill(stream, out_buf, n * count * e);
        const uint8_t* in = in_place ? out_buf + r * count * e : in_buf;
        Upload(stream, const_cast<uint8_t*>(in), PatternBuffer(dtype, r, count));
        ASSERT_TRUE(WaitFor(comm.AllGather(in, out_buf, count, dtype, stream)).ok());
        const std::vector<uint8_t> out = Download(stream, out_buf, n * count * e);
        for (int s = 0; s < n; ++s) {
          for (size_t i = 0; i < count; ++i) {
            ASSERT_EQ(GetElement(dtype, out.data(), s * count + i), PatternValue(dtype, s, i))
                << DTypeName(dtype) << " count " << count << " in_place " << in_place << " from "
                << s;
          }
        }
      }
    }
  }
}

void CheckReductions(int r, int n, Communicator& comm, Stream& stream, uint8_t* in_buf,
                     uint8_t* out_buf) {
  for (DType dtype : kReduceDTypes) {
    for (ReduceOp op : kAllReduceOps) {
      if (!PatternReductionFits(dtype, op, n)) continue;
      for (size_t count : kCounts) {
        for (bool in_place : {false, true}) {
          const size_t e = DTypeSize(dtype);
          const std::string where = absl::StrCat(DTypeName(dtype), " ", ReduceOpName(op), " count ",
                                                 count, " in_place ", in_place);
          // Reduce-scatter: rank r receives elements [r * count, (r + 1) * count) reduced.
          Upload(stream, in_buf, PatternBuffer(dtype, r, n * count));
          uint8_t* out = in_place ? in_buf + r * count * e : out_buf;
          if (!in_place) Fill(stream, out_buf, count * e);
          ASSERT_TRUE(
              WaitFor(comm.ReduceScatter(in_buf, out, count, dtype, stream, {.op = op})).ok())
              << where;
          std::vector<uint8_t> got = Download(stream, out, count * e);
          for (size_t i = 0; i < count; ++i) {
            const double want = ReferenceReduce(dtype, op, n, r * count + i);
            ASSERT_NEAR(GetElement(dtype, got.data(), i), want, Tolerance(dtype, op, want))
                << "reduce_scatter " << where << " element " << i;
          }
          // All-reduce.
          Upload(stream, in_buf, PatternBuffer(dtype, r, count));
          out = in_place ? in_buf : out_buf;
          if (!in_place) Fill(stream, out_buf, count * e);
          ASSERT_TRUE(WaitFor(comm.AllReduce(in_buf, out, count, dtype, stream, {.op = op})).ok())
              << where;
          got = Download(stream, out, count * e);
          for (size_t i = 0; i < count; ++i) {
            const double want = ReferenceReduce(dtype, op, n, i);
            ASSERT_NEAR(GetElement(dtype, got.data(), i), want, Tolerance(dtype, op, want))
                << "all_reduce " << where << " element " << i;
          }
        }
      }
    }
  }
}

void CheckBroadcastAndAllToAll(int r, int n, Communicator& comm, Stream& stream, uint8_t* in_buf,
                               uint8_t* out_buf) {
  for (DType dtype : kAllDTypes) {
    for (size_t count : kCounts) {
      const size_t e = DTypeSize(dtype);
      for (int root : {0, n - 1}) {
        Fill(stream, out_buf, count * e);
        if (r == root) Upload(stream, out_buf, PatternBuffer(dtype, root, count, /*salt=*/1));
        ASSERT_TRUE(WaitFor(comm.Broadcast(out_buf, count, dtype, stream, {.root = root})).ok());
        const std::vector<uint8_t> got = Download(stream, out_buf, count * e);
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(GetElement(dtype, got.data(), i), PatternValue(dtype, root, i, 1))
              << "broadcast " << DTypeName(dtype) << " count " << count << " root " << root;
        }
      }
      // All-to-all: block j of rank r's input goes to rank j, landing in block r there.
      Upload(stream, in_buf, PatternBuffer(dtype, r, n * count, /*salt=*/2));
      Fill(stream, out_buf, n * count * e);
      ASSERT_TRUE(WaitFor(comm.AllToAll(in_buf, out_buf, count, dtype, stream)).ok());
      const std::vector<uint8_t> got = Download(stream, out_buf, n * count * e);
      for (int s = 0; s < n; ++s) {
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(GetElement(dtype, got.data(), s * count + i),
                    PatternValue(dtype, s, r * count + i, 2))
              << "all_to_all " << DTypeName(dtype) << " count " << count << " from " << s;
        }
      }
    }
  }
  ASSERT_TRUE(WaitFor(comm.Barrier(stream)).ok());
}

void CheckEveryCollective(int r, int n, Communicator& comm, Stream& stream) {
  const size_t max_bytes = static_cast<size_t>(n) * 4097 * 8;
  DeviceBuffer in(max_bytes);
  DeviceBuffer out(max_bytes);
  CheckAllGather(r, n, comm, stream, in.get(), out.get());
  CheckReductions(r, n, comm, stream, in.get(), out.get());
  CheckBroadcastAndAllToAll(r, n, comm, stream, in.get(), out.get());
  EXPECT_TRUE(comm.status().ok()) << comm.status();
}

TEST(NcclCommunicatorTest, EveryCollectiveOnOneGpu) {
  SKIP_UNLESS_GPUS(1);
  RunRanks(1, CheckEveryCollective);
}

// The watchdog records when each collective started and ended on the device (as it sees the
// CUDA events, up to one polling interval late), with the caller's tag.
TEST(NcclCommunicatorTest, FlightRecorderSeesCollectivesEnd) {
  SKIP_UNLESS_GPUS(1);
  RunRanks(1, [](int, int, Communicator& comm, Stream& stream) {
    DeviceBuffer buf(4097 * sizeof(float));
    for (int i = 0; i < 3; ++i) {
      ReduceOptions options;
      options.tag = absl::StrCat("unit.", i);
      ASSERT_TRUE(
          WaitFor(comm.AllReduce(buf.get(), buf.get(), 4097, DType::kF32, stream, options)).ok());
    }
    // The work is done; the watchdog's next sweeps record it (bounded poll: no event for them).
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    std::vector<FlightRecord> records = comm.FlightRecords();
    while (absl::Now() < deadline &&
           !std::all_of(records.begin(), records.end(),
                        [](const FlightRecord& r) { return r.state == FlightState::kDone; })) {
      absl::SleepFor(absl::Milliseconds(1));
      records = comm.FlightRecords();
    }
    ASSERT_EQ(records.size(), 3u);
    for (int i = 0; i < 3; ++i) {
      const FlightRecord& r = records[i];
      EXPECT_EQ(r.seq, static_cast<uint64_t>(i));
      EXPECT_EQ(r.kind, CollectiveKind::kAllReduce);
      EXPECT_EQ(r.count, 4097u);
      EXPECT_EQ(r.tag, absl::StrCat("unit.", i));
      EXPECT_EQ(r.state, FlightState::kDone) << FlightStateName(r.state);
      EXPECT_GT(r.enqueued_ns, 0);
      EXPECT_LE(r.enqueued_ns, r.started_ns);
      EXPECT_LE(r.started_ns, r.ended_ns);
    }
  });
}

TEST(NcclCommunicatorTest, EveryCollectiveAcrossGpus) {
  SKIP_UNLESS_GPUS(2);
  RunRanks(GroupSize(), CheckEveryCollective);
}

// Point-to-point across GPUs: a ring of odd-sized messages of every dtype, every element (the
// receive on a stream of its own, so that the send ahead of it on the other stream can complete);
// any source and message tags are refused, naming why, and abort nothing.
TEST(NcclCommunicatorTest, SendAndRecvAcrossGpus) {
  SKIP_UNLESS_GPUS(2);
  RunRanks(GroupSize(), [](int r, int n, Communicator& comm, Stream& stream) {
    absl::StatusOr<std::unique_ptr<Stream>> recv_stream =
        CreateStream(Device::Cuda(r), {.name = absl::StrCat("recv", r)});
    ASSERT_TRUE(recv_stream.ok()) << recv_stream.status();
    const int to = (r + 1) % n, from = (r + n - 1) % n;
    for (DType dtype : kAllDTypes) {
      for (size_t count : kCounts) {
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " x ", count));
        const size_t bytes = count * DTypeSize(dtype);
        DeviceBuffer out(bytes), in(bytes);
        Upload(stream, out.get(), PatternBuffer(dtype, r, count));
        absl::StatusOr<Work> received = comm.Recv(in.get(), count, dtype, from, **recv_stream);
        absl::StatusOr<Work> sent = comm.Send(out.get(), count, dtype, to, stream);
        ASSERT_TRUE(WaitFor(sent).ok()) << WaitFor(sent);
        ASSERT_TRUE(WaitFor(received).ok()) << WaitFor(received);
        EXPECT_EQ(received->source(), from);
        EXPECT_EQ(Download(**recv_stream, in.get(), bytes), PatternBuffer(dtype, from, count));
      }
    }
    DeviceBuffer x(4);
    absl::StatusOr<Work> any = comm.Recv(x.get(), 1, DType::kF32, kAnySource, stream);
    EXPECT_EQ(any.status().code(), absl::StatusCode::kUnimplemented) << any.status();
    EXPECT_TRUE(absl::StrContains(any.status().message(), "any rank")) << any.status();
    absl::StatusOr<Work> tagged = comm.Send(x.get(), 1, DType::kF32, to, stream, {.match_tag = 3});
    EXPECT_EQ(tagged.status().code(), absl::StatusCode::kInvalidArgument) << tagged.status();
    EXPECT_TRUE(absl::StrContains(tagged.status().message(), "no tags")) << tagged.status();
    EXPECT_TRUE(comm.status().ok()) << comm.status();
  });
}

// ---- Validation, abort ----------------------------------------------------------------------

TEST(NcclCommunicatorTest, RejectsStreamsOfOtherDevices) {
  SKIP_UNLESS_GPUS(1);
  RunRanks(1, [](int, int, Communicator& comm, Stream&) {
    DeviceBuffer buf(64);
    absl::StatusOr<std::unique_ptr<Stream>> host = CreateHostStream({.name = "host"});
    ASSERT_TRUE(host.ok());
    absl::StatusOr<Work> work = comm.AllReduce(buf.get(), buf.get(), 4, DType::kF32, **host);
    EXPECT_EQ(work.status().code(), absl::StatusCode::kInvalidArgument) << work.status();
    EXPECT_TRUE(absl::StrContains(work.status().message(), "'host'")) << work.status();
    std::string why;
    if (DeviceCount(&why) >= 2) {
      absl::StatusOr<std::unique_ptr<Stream>> other = CreateStream(Device::Cuda(1));
      ASSERT_TRUE(other.ok());
      work = comm.AllReduce(buf.get(), buf.get(), 4, DType::kF32, **other);
      EXPECT_EQ(work.status().code(), absl::StatusCode::kInvalidArgument) << work.status();
    }
    // Rejected before anything was enqueued: the communicator is intact.
    EXPECT_EQ(comm.next_seq(), 0u);
    EXPECT_TRUE(comm.status().ok()) << comm.status();
  });
}

TEST(NcclCommunicatorTest, HostBufferIsInvalidArgument) {
  SKIP_UNLESS_GPUS(1);
  RunRanks(1, [](int, int, Communicator& comm, Stream& stream) {
    std::vector<float> host(16, 1.0f);
    absl::StatusOr<Work> work =
        comm.AllReduce(host.data(), host.data(), host.size(), DType::kF32, stream);
    EXPECT_EQ(work.status().code(), absl::StatusCode::kInvalidArgument) << work.status();
    EXPECT_TRUE(absl::StrContains(work.status().message(), "host memory")) << work.status();
  });
}

TEST(NcclCommunicatorTest, AbortFailsLaterCollectives) {
  SKIP_UNLESS_GPUS(1);
  RunRanks(1, [](int, int, Communicator& comm, Stream& stream) {
    DeviceBuffer buf(64);
    ASSERT_TRUE(WaitFor(comm.AllReduce(buf.get(), buf.get(), 4, DType::kF32, stream)).ok());
    comm.Abort(absl::AbortedError("test abort"));
    EXPECT_EQ(comm.status().code(), absl::StatusCode::kAborted);
    absl::StatusOr<Work> work = comm.AllReduce(buf.get(), buf.get(), 4, DType::kF32, stream);
    EXPECT_EQ(work.status().code(), absl::StatusCode::kAborted) << work.status();
    absl::StatusOr<std::shared_ptr<Communicator>> sub =
        comm.Split(0, 0, absl::Now() + absl::Seconds(10));
    EXPECT_EQ(sub.status().code(), absl::StatusCode::kAborted) << sub.status();
  });
}

// ---- Several GPUs -------------------------------------------------------------------------

TEST(NcclCommunicatorTest, SplitReordersAndExcludes) {
  SKIP_UNLESS_GPUS(2);
  RunRanks(GroupSize(), [](int r, int n, Communicator& comm, Stream& stream) {
    // Everyone but the last rank of a group of 3+ joins color 0, in reverse order.
    const bool excluded = n >= 3 && r == n - 1;
    const int members = n >= 3 ? n - 1 : n;
    absl::StatusOr<std::shared_ptr<Communicator>> sub =
        comm.Split(excluded ? -1 : 0, -r, absl::Now() + absl::Seconds(60));
    ASSERT_TRUE(sub.ok()) << sub.status();
    if (excluded) {
      EXPECT_EQ(*sub, nullptr);
      ASSERT_TRUE(WaitFor(comm.Barrier(stream)).ok());  // the parent still works
      return;
    }
    ASSERT_NE(*sub, nullptr);
    Communicator& group = **sub;
    EXPECT_EQ(group.size(), members);
    EXPECT_EQ(group.rank(), members - 1 - r);
    EXPECT_EQ(group.device(), Device::Cuda(r));
    DeviceBuffer buf(sizeof(int32_t));
    std::vector<uint8_t> mine(sizeof(int32_t));
    ::shardline::testing::SetElement(DType::kI32, mine.data(), 0, r);
    Upload(stream, buf.get(), mine);
    ASSERT_TRUE(WaitFor(group.AllReduce(buf.get(), buf.get(), 1, DType::kI32, stream)).ok());
    const std::vector<uint8_t> got = Download(stream, buf.get(), sizeof(int32_t));
    EXPECT_EQ(GetElement(DType::kI32, got.data(), 0), members * (members - 1) / 2);
    ASSERT_TRUE(WaitFor(comm.Barrier(stream)).ok());  // the parent still works
  });
}

// Finds a registered knob by its environment name and forgets its cached value.
void ResetKnob(absl::string_view env_name) {
  for (const ParamBase* param : AllParams()) {
    if (param->env_name() == env_name) param->ResetCacheForTesting();
  }
}

TEST(NcclCommunicatorTest, FingerprintCheckCatchesMismatches) {
  SKIP_UNLESS_GPUS(2);
  ScopedEnv env("SHARDLINE_NCCL_CHECK_FINGERPRINTS", "1");
  ResetKnob("SHARDLINE_NCCL_CHECK_FINGERPRINTS");
  RunRanks(2, [](int r, int, Communicator& comm, Stream& stream) {
    DeviceBuffer buf(64 * sizeof(float));
    // Matching collectives pass the check.
    ASSERT_TRUE(WaitFor(comm.AllReduce(buf.get(), buf.get(), 8, DType::kF32, stream)).ok());
    // Rank 1 asks for one element more: both ranks fail, naming both calls.
    absl::StatusOr<Work> work =
        comm.AllReduce(buf.get(), buf.get(), r == 0 ? 7 : 8, DType::kF32, stream);
    EXPECT_EQ(work.status().code(), absl::StatusCode::kInvalidArgument) << work.status();
    EXPECT_TRUE(absl::StrContains(work.status().message(),
                                  "rank 0 called all_reduce(count=7, f32, sum) but rank 1 called "
                                  "all_reduce(count=8, f32, sum)"))
        << work.status();
  });
  ResetKnob("SHARDLINE_NCCL_CHECK_FINGERPRINTS");
}

TEST(NcclCommunicatorTest, MissingRankFailsTheWorkAtTheDeadline) {
  SKIP_UNLESS_GPUS(2);
  absl::Notification rank0_done;
  RunRanks(
      2,
      [&](int r, int, Communicator& comm, Stream& stream) {
        if (r == 1) {
          // Never issues the collective; stays alive until rank 0 has seen its failure.
          rank0_done.WaitForNotificationWithTimeout(absl::Seconds(60));
          return;
        }
        DeviceBuffer buf(64);
        absl::StatusOr<Work> work = comm.AllReduce(buf.get(), buf.get(), 4, DType::kF32, stream);
        ASSERT_TRUE(work.ok()) << work.status();
        // The watchdog aborts at the deadline; ncclCommAbort ends the kernel and the Work
        // reports the abort instead of success.
        const absl::Status waited = work->Wait(absl::Now() + absl::Seconds(60));
        EXPECT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded) << waited;
        EXPECT_TRUE(absl::StrContains(waited.message(), "all_reduce #0")) << waited;
        EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
        rank0_done.Notify();
      },
      absl::Seconds(3));
}

}  // namespace
}  // namespace shardline

#endif  // SHARDLINE_WITH_CUDA
