// The Communicator API over the ucx backend with ranks as threads of one process, each with its
// own UCX worker, connected over a shared MemoryStore: this runs the real UCX paths (shared
// memory, the single-copy protocol — ranks of one process can read each other's memory — and
// mapped shareable memory) cheaply. The conformance suite (tests/collectives/conformance.h) for
// world sizes 1 to 4, plus what is ucx-specific: collectives issued on two streams, large
// collectives on shareable memory (mapped, borrowed reductions), UCX's own shared memory
// (SHARDLINE_UCX_CMA=0), creation without peers.
#include "collectives/ucx/ucx_communicator.h"

#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/local/local_communicator.h"
#include "collectives/store/memory_store.h"
#include "collectives/ucx/internal/ucx_communicator_internal.h"
#include "collectives/ucx/internal/ucx_transport.h"
#include "runtime/allocator.h"
#include "runtime/check.h"
#include "runtime/config.h"
#include "runtime/shared_memory.h"
#include "runtime/stream.h"
#include "tests/collectives/conformance.h"
#include "tests/common/gate.h"
#include "tests/common/scoped_env.h"

namespace shardline {
namespace {

using ::shardline::testing::Comms;
using ::shardline::testing::Gate;
using ::shardline::testing::GetElement;
using ::shardline::testing::PatternBuffer;
using ::shardline::testing::PatternValue;
using ::shardline::testing::ReferenceReduce;
using ::shardline::testing::RunRanks;
using ::shardline::testing::ScopedEnv;
using ::shardline::testing::WaitFor;

// Creates the n communicators concurrently (creation waits for every peer's address).
Comms MakeComms(int n, absl::Duration timeout = absl::Seconds(30),
                std::shared_ptr<Store> store = nullptr, const std::string& name = "world") {
  if (store == nullptr) store = std::make_shared<MemoryStore>();
  Comms comms(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::shared_ptr<Communicator>> comm = CreateUcxCommunicator(
          {.rank = r, .size = n, .store = store, .name = name, .timeout = timeout});
      SL_CHECK_OK(comm.status());
      comms[r] = *std::move(comm);
    });
  }
  for (std::thread& t : threads) t.join();
  return comms;
}

struct UcxBackend {
  static constexpr const char* kName = "ucx";
  static constexpr int kWorldSizes[] = {1, 2, 3, 4};
  static Comms Make(int n, absl::Duration timeout) { return MakeComms(n, timeout); }
};

}  // namespace

namespace testing {
INSTANTIATE_TYPED_TEST_SUITE_P(Ucx, CommunicatorConformanceTest, UcxBackend);
}  // namespace testing

namespace {

// A float from a hash of (rank, i, salt): no period, so a misplaced block always shows. A
// multiple of 1/1024 below 2^13 in magnitude, so that sums of a few ranks are exact.
float HashedFloat(int rank, size_t i, int salt) {
  uint64_t x = (uint64_t(rank) << 48) ^ (uint64_t(salt) << 40) ^ i;
  x += 0x9e3779b97f4a7c15;  // splitmix64
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9;
  x = (x ^ (x >> 27)) * 0x94d049bb133111eb;
  x ^= x >> 31;
  return static_cast<float>(static_cast<int64_t>(x >> 41) - (int64_t{1} << 22)) / 1024.0f;
}

std::vector<float> HashedFloats(int rank, size_t count, int salt) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = HashedFloat(rank, i, salt);
  return v;
}

// An all-gather and an all-reduce of `count` hashed floats per rank, every element checked.
void CheckCollectives(Communicator& comm, Stream& stream, size_t count, int salt) {
  const int n = comm.size(), r = comm.rank();
  const std::vector<float> input = HashedFloats(r, count, salt);
  std::vector<float> gathered(n * count);
  ASSERT_TRUE(
      WaitFor(comm.AllGather(input.data(), gathered.data(), count, DType::kF32, stream)).ok());
  for (int s = 0; s < n; ++s) {
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(gathered[s * count + i], HashedFloat(s, i, salt)) << "from rank " << s << ", " << i;
    }
  }
  std::vector<float> reduced(count);
  ASSERT_TRUE(
      WaitFor(comm.AllReduce(input.data(), reduced.data(), count, DType::kF32, stream)).ok());
  for (size_t i = 0; i < count; ++i) {
    float sum = 0;
    for (int s = 0; s < n; ++s) sum += HashedFloat(s, i, salt);
    ASSERT_EQ(reduced[i], sum) << "element " << i;
  }
}

// Delegates to `inner`, and opens `address_wait` when a rank first waits for the UCX addresses
// of its peers.
class WatchedStore final : public Store {
 public:
  explicit WatchedStore(std::shared_ptr<Store> inner) : inner_(std::move(inner)) {}
  Gate address_wait;

 protected:
  absl::Status DoSet(absl::string_view key, absl::string_view value) override {
    return inner_->Set(key, value);
  }
  absl::StatusOr<std::string> DoGet(absl::string_view key, absl::Time deadline) override {
    return inner_->Get(key, deadline);
  }
  absl::StatusOr<int64_t> DoAdd(absl::string_view key, int64_t delta) override {
    return inner_->Add(key, delta);
  }
  absl::StatusOr<std::string> DoCompareSet(absl::string_view key, absl::string_view expected,
                                           absl::string_view desired) override {
    return inner_->CompareSet(key, expected, desired);
  }
  absl::Status DoWait(absl::Span<const std::string> keys, absl::Time deadline) override {
    for (const std::string& key : keys) {
      if (absl::StrContains(key, "/addr/")) address_wait.Open();
    }
    return inner_->Wait(keys, deadline);
  }
  absl::StatusOr<bool> DoCheck(absl::Span<const std::string> keys) override {
    return inner_->Check(keys);
  }
  absl::StatusOr<bool> DoDelete(absl::string_view key) override { return inner_->Delete(key); }
  absl::StatusOr<int64_t> DoNumKeys() override { return inner_->NumKeys(); }

 private:
  std::shared_ptr<Store> inner_;
};

// A communicator reuses one batch for all its collectives: its slots come back reset, its buffers
// are aligned, disjoint and the same memory after Reset, and a large collective's scratch is
// given back at Reset.
TEST(UcxCommunicatorTest, BatchReusesSlotsAndBuffersAndGivesBackLargeScratch) {
  using ucx_internal::Batch;
  using ucx_internal::Completion;
  Batch batch;
  // Odd sizes, some larger than the first arena: every buffer aligned and disjoint (each is
  // filled with its own byte, then all are checked).
  const std::vector<size_t> sizes = {1, 24, 8192 + 24, 7, 100000, 63, 64, 65, 300000, 5};
  std::vector<uint8_t*> buffers;
  for (size_t i = 0; i < sizes.size(); ++i) {
    uint8_t* b = batch.Buffer(sizes[i]);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 64, 0u) << "buffer " << i;
    std::memset(b, static_cast<int>(i + 1), sizes[i]);
    buffers.push_back(b);
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (size_t k = 0; k < sizes[i]; ++k) {
      ASSERT_EQ(buffers[i][k], static_cast<uint8_t>(i + 1)) << "buffer " << i << " byte " << k;
    }
  }
  Completion* first = batch.Add(1, /*is_send=*/true);
  first->done.store(true);
  first->status = UCS_ERR_CANCELED;
  first->length = 99;
  first->any_length = true;
  first->view = buffers[0];
  Completion* second = batch.Add(2, /*is_send=*/false);
  EXPECT_NE(first, second);

  const size_t held = batch.held_bytes();
  EXPECT_GE(held, 8192u + 24 + 100000 + 300000);
  EXPECT_LE(held, Batch::kRetainBytes);
  batch.Reset();
  EXPECT_EQ(batch.held_bytes(), held);  // kept
  // The same requests again get the same memory and the same slots, reset.
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(batch.Buffer(sizes[i]), buffers[i]) << i;
  Completion* again = batch.Add(3, /*is_send=*/false);
  EXPECT_EQ(again, first);
  EXPECT_FALSE(again->done.load());
  EXPECT_EQ(again->status, UCS_OK);
  EXPECT_EQ(again->length, 0u);
  EXPECT_FALSE(again->any_length);
  EXPECT_FALSE(again->is_send);
  EXPECT_EQ(again->peer, 3);
  EXPECT_EQ(again->view, nullptr);
  EXPECT_EQ(again->request, nullptr);
  int slots = 0;
  for (Completion& c : batch.slots()) {
    EXPECT_EQ(&c, again);
    ++slots;
  }
  EXPECT_EQ(slots, 1);

  // More than kRetainBytes in one collective: given back at Reset.
  batch.Buffer(Batch::kRetainBytes + 1);
  EXPECT_GT(batch.held_bytes(), Batch::kRetainBytes);
  batch.Reset();
  EXPECT_EQ(batch.held_bytes(), 0u);
  uint8_t* fresh = batch.Buffer(10);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(fresh) % 64, 0u);
  EXPECT_EQ(batch.held_bytes(), 64u << 10);
}

TEST(UcxCommunicatorTest, RecreatedUnderTheSameNameNeverReadsTheOldAddresses) {
  // The keys of the first communicator stay in the store. Its re-creation must wait for the
  // peers' new addresses instead of connecting to the dead workers the old keys name: rank 1
  // only starts once rank 0 waits for the addresses, so rank 0 would find stale ones first.
  const int n = 2;
  auto store = std::make_shared<MemoryStore>();
  {
    Comms comms = MakeComms(n, absl::Seconds(30), store, "again");
    RunRanks(comms, [&](int, Communicator& comm, Stream& stream) {
      CheckCollectives(comm, stream, 70000, /*salt=*/1);
    });
    comms[0]->Abort(absl::CancelledError("the test discards this communicator"));
  }
  for (int round = 2; round <= 3; ++round) {
    auto watched = std::make_shared<WatchedStore>(store);
    Comms comms(n);
    std::vector<absl::Status> created(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        if (r == 1) {
          ASSERT_TRUE(watched->address_wait.Wait());
        }
        absl::StatusOr<std::shared_ptr<Communicator>> comm =
            CreateUcxCommunicator({.rank = r,
                                   .size = n,
                                   .store = watched,
                                   .name = "again",
                                   .timeout = absl::Seconds(10)});
        created[r] = comm.status();
        if (comm.ok()) comms[r] = *std::move(comm);
      });
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < n; ++r)
      ASSERT_TRUE(created[r].ok()) << "round " << round << ": " << created[r];
    RunRanks(comms, [&](int, Communicator& comm, Stream& stream) {
      CheckCollectives(comm, stream, 70000, /*salt=*/round);
    });
  }
  // Each rank deleted its keys once its peers had read them; only the creation counters stay.
  EXPECT_EQ(*store->NumKeys(), n);
}

TEST(UcxCommunicatorTest, DifferentWireTuningFailsCreationOnEveryRankNamingTheKnob) {
  // Rank 1 of 3 differs from the others in one knob of the wire protocol at a time.
  using ucx_internal::Tuning;
  absl::StatusOr<Tuning> base = Tuning::FromEnvironment();
  ASSERT_TRUE(base.ok()) << base.status();
  struct Case {
    std::string knob;
    void (*change)(Tuning&);
    std::string theirs, first;
  };
  const Case cases[] = {
      {"SHARDLINE_UCX_CHUNK_BYTES", [](Tuning& t) { t.chunk_bytes = 8192; }, "8192",
       absl::StrCat(base->chunk_bytes)},
      {"SHARDLINE_UCX_SMALL_BYTES", [](Tuning& t) { t.small_bytes = 777; }, "777",
       absl::StrCat(base->small_bytes)},
      {"SHARDLINE_UCX_WINDOW", [](Tuning& t) { t.window = 7; }, "7", absl::StrCat(base->window)}};
  for (const Case& c : cases) {
    ASSERT_NE(c.theirs, c.first) << c.knob;
    Tuning other = *base;
    c.change(other);
    const int n = 3;
    auto store = std::make_shared<MemoryStore>();
    std::vector<absl::Status> created(n);
    std::vector<std::thread> threads;
    const absl::Time start = absl::Now();
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        created[r] = ucx_internal::CreateUcxCommunicatorWithTuning(
                         {.rank = r, .size = n, .store = store, .timeout = absl::Seconds(20)},
                         r == 1 ? other : *base)
                         .status();
      });
    }
    for (std::thread& t : threads) t.join();
    EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << c.knob;
    const std::string expected = absl::StrCat("rank 1 has ", c.knob, "=", c.theirs,
                                              " but rank 0 has ", c.knob, "=", c.first);
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(created[r].code(), absl::StatusCode::kInvalidArgument) << created[r];
      EXPECT_TRUE(absl::StrContains(created[r].message(), expected))
          << "rank " << r << ": " << created[r] << "\nexpected: " << expected;
    }
  }
}

TEST(UcxCommunicatorTest, CreationLeavesTheEnvironmentAlone) {
  // UCX's settings go through its configuration object: setenv in a library races every other
  // thread's getenv. (The first communicator of the process creates the UCX context.)
  ScopedEnv unset("UCX_MM_ERROR_HANDLING", nullptr);
  {
    Comms comms = MakeComms(2);
    RunRanks(comms, [&](int, Communicator& comm, Stream& stream) {
      CheckCollectives(comm, stream, 70000, /*salt=*/4);
    });
  }
  EXPECT_EQ(std::getenv("UCX_MM_ERROR_HANDLING"), nullptr);
}

// Makes the next communicator read SHARDLINE_UCX_CMA again.
void ReReadCmaKnob() {
  for (const ParamBase* param : AllParams()) {
    if (param->env_name() == "SHARDLINE_UCX_CMA") param->ResetCacheForTesting();
  }
}

TEST(UcxCommunicatorTest, LargeMessagesThroughUcxSharedMemory) {
  // SHARDLINE_UCX_CMA=0: no single-copy reads, UCX moves the large messages itself.
  setenv("SHARDLINE_UCX_CMA", "0", 1);
  ReReadCmaKnob();
  Comms comms = MakeComms(2);
  unsetenv("SHARDLINE_UCX_CMA");
  ReReadCmaKnob();
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    const size_t count = 300001;
    std::vector<uint8_t> input = PatternBuffer(DType::kF32, r, 2 * count);
    std::vector<uint8_t> output(input.size());
    ASSERT_TRUE(
        WaitFor(comm.AllReduce(input.data(), output.data(), 2 * count, DType::kF32, stream)).ok());
    for (size_t i = 0; i < 2 * count; i += 101) {
      ASSERT_EQ(GetElement(DType::kF32, output.data(), i),
                ReferenceReduce(DType::kF32, ReduceOp::kSum, 2, i));
    }
    std::vector<uint8_t> gathered(2 * count * 4);
    ASSERT_TRUE(
        WaitFor(comm.AllGather(input.data(), gathered.data(), count, DType::kF32, stream)).ok());
    for (size_t i = 0; i < count; i += 101) {
      ASSERT_EQ(GetElement(DType::kF32, gathered.data(), (1 - r) * count + i),
                PatternValue(DType::kF32, 1 - r, i));
    }
  });
}

TEST(UcxCommunicatorTest, LargeCollectivesOnShareableMemory) {
  // Buffers from the host allocator (shareable from 1 MiB): peers copy out of their mappings of
  // each other's memory and reduce straight out of them (borrowed chunks).
  const int n = 3;
  const size_t count = 300001;  // per rank: several chunks, a ragged last one
  Comms comms = MakeComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    std::unique_ptr<Allocator> host = CreateHostAllocator(64, absl::StrCat("rank", r));
    auto make = [&](size_t bytes) {
      absl::StatusOr<Buffer> b = host->Allocate(bytes);
      SL_CHECK_OK(b.status());
      return *std::move(b);
    };
    Buffer input = make(n * count * 4), output = make(n * count * 4);
    ASSERT_TRUE(FindShareable(input.data(), input.size()).has_value());
    const std::vector<uint8_t> pattern = PatternBuffer(DType::kF32, r, n * count);
    std::copy(pattern.begin(), pattern.end(), input.as<uint8_t>());
    ASSERT_TRUE(
        WaitFor(comm.AllReduce(input.data(), output.data(), n * count, DType::kF32, stream)).ok());
    for (size_t i = 0; i < n * count; i += 499) {
      ASSERT_EQ(GetElement(DType::kF32, output.data(), i),
                ReferenceReduce(DType::kF32, ReduceOp::kSum, n, i));
    }
    // In place: the reduce-scatter's shard is this rank's block of its input.
    uint8_t* shard = input.as<uint8_t>() + r * count * 4;
    ASSERT_TRUE(WaitFor(comm.ReduceScatter(input.data(), shard, count, DType::kF32, stream,
                                           {.op = ReduceOp::kMax}))
                    .ok());
    for (size_t i = 0; i < count; i += 499) {
      ASSERT_EQ(GetElement(DType::kF32, shard, i),
                ReferenceReduce(DType::kF32, ReduceOp::kMax, n, r * count + i));
    }
    // The FSDP case: in-place all-gather of the shards.
    ASSERT_TRUE(WaitFor(comm.AllGather(shard, input.data(), count, DType::kF32, stream)).ok());
    for (size_t i = 0; i < n * count; i += 499) {
      ASSERT_EQ(GetElement(DType::kF32, input.data(), i),
                ReferenceReduce(DType::kF32, ReduceOp::kMax, n, i));
    }
  });
}

TEST(UcxCommunicatorTest, FreshShareableBuffersEveryIterationStayCorrect) {
  // A new shareable input every iteration, freed after it: its memory-file descriptor number is
  // reused by the next one (a different region), and more regions pass than a peer's mapping
  // cache holds (64), so stale mappings must never be read and eviction must keep working.
  const int n = 2;
  const size_t count = 64 * 1024;  // 256 KiB per rank: the single-copy path
  Comms comms = MakeComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    std::vector<uint8_t> output(n * count * 4);
    for (int iter = 0; iter < 80; ++iter) {
      absl::StatusOr<void*> input = AllocateShareable(count * 4);
      ASSERT_TRUE(input.ok()) << input.status();
      const std::vector<uint8_t> pattern = PatternBuffer(DType::kF32, r, count, /*salt=*/iter);
      std::copy(pattern.begin(), pattern.end(), static_cast<uint8_t*>(*input));
      ASSERT_TRUE(WaitFor(comm.AllGather(*input, output.data(), count, DType::kF32, stream)).ok());
      for (int s = 0; s < n; ++s) {
        for (size_t i = 0; i < count; i += 4093) {
          ASSERT_EQ(GetElement(DType::kF32, output.data(), s * count + i),
                    PatternValue(DType::kF32, s, i, iter))
              << "iteration " << iter << ", from rank " << s;
        }
      }
      FreeShareable(*input, count * 4);
    }
  });
}

// Mappings of shareable memory in this process (the owners' and the peers' alike).
int CountShareableMappings() {
  std::ifstream maps("/proc/self/maps");
  int count = 0;
  for (std::string line; std::getline(maps, line);) count += absl::StrContains(line, "memfd:");
  return count;
}

TEST(UcxCommunicatorTest, PeersMapEachOtherAgainAfterRunningOutOfDescriptors) {
  // Mapping a peer's region takes a descriptor (pidfd_getfd). While the process has none to
  // spare, large messages fall back to process_vm_readv; once it has, they are mapped again.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // The limit is process-wide: the sanitizer runtimes' own threads need descriptors meanwhile
  // (UBSan reported a broken stream object here). The normal build runs this test.
  GTEST_SKIP() << "lowers RLIMIT_NOFILE for the whole process; not under sanitizers";
#endif
  const int n = 2;
  const size_t count = 64 * 1024;  // 256 KiB per rank: the single-copy path
  Comms comms = MakeComms(n);
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  std::vector<void*> inputs(n);
  for (void*& input : inputs) {
    absl::StatusOr<void*> allocated = AllocateShareable(count * 4);
    ASSERT_TRUE(allocated.ok()) << allocated.status();
    input = *allocated;
  }
  const int before = CountShareableMappings();
  int starved = 0;
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    std::vector<float> output(n * count);
    for (int iter = 0; iter < 2; ++iter) {
      const std::vector<float> values = HashedFloats(r, count, /*salt=*/iter);
      std::copy(values.begin(), values.end(), static_cast<float*>(inputs[r]));
      // Rank 0 changes the limit before it sends its descriptors, and back once its all-gather
      // is done (the peer has read its memory then): every mapping attempt of the first
      // all-gather happens without a descriptor to spare, every one of the second with.
      if (r == 0 && iter == 0) {
        const int lowest_free = dup(0);
        close(lowest_free);
        rlimit starving = saved;
        starving.rlim_cur = static_cast<rlim_t>(lowest_free);
        ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &starving), 0);
      }
      absl::Status status =
          WaitFor(comm.AllGather(inputs[r], output.data(), count, DType::kF32, stream));
      if (r == 0 && iter == 0) {
        ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
        starved = CountShareableMappings();
      }
      ASSERT_TRUE(status.ok()) << status;
      for (int s = 0; s < n; ++s) {
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(output[s * count + i], HashedFloat(s, i, iter))
              << "iteration " << iter << ", from rank " << s << ", element " << i;
        }
      }
    }
  });
  EXPECT_EQ(starved, before);                       // nothing mapped without descriptors
  EXPECT_EQ(CountShareableMappings(), before + n);  // each rank mapped the other's input since
  for (void* input : inputs) FreeShareable(input, count * 4);
}

TEST(UcxCommunicatorTest, CreationWithoutPeersTimesOutNamingThem) {
  auto store = std::make_shared<MemoryStore>();
  absl::StatusOr<std::shared_ptr<Communicator>> comm = CreateUcxCommunicator(
      {.rank = 0, .size = 3, .store = store, .timeout = absl::Milliseconds(200)});
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_TRUE(absl::StrContains(comm.status().message(), "rank(s) 1, 2")) << comm.status();
  EXPECT_EQ(CreateUcxCommunicator({.rank = 3, .size = 3, .store = store}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateUcxCommunicator({.rank = 0, .size = 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardline

namespace shardline::testing {
namespace {

// docs/collectives.md promises that the local and ucx backends reduce in rank order, so their
// floating-point results are the same bits. Hashed floats (sums are not exact), odd sizes on both
// sides of the small-message threshold and across chunk boundaries, f32 and bf16 (accumulated in
// f32, rounded once), sum and avg: both backends bit for bit, each within a tolerance of a double
// reference.
TEST(UcxCommunicatorTest, ReductionsMatchTheLocalBackendBitForBit) {
  const int n = 3;
  Comms ucx = MakeComms(n);
  absl::StatusOr<Comms> local = CreateLocalCommunicators(n, {.timeout = absl::Seconds(30)});
  ASSERT_TRUE(local.ok()) << local.status();
  struct Case {
    DType dtype;
    ReduceOp op;
    size_t count;
  };
  const Case cases[] = {{DType::kF32, ReduceOp::kSum, 1001},
                        {DType::kF32, ReduceOp::kAvg, 300007},
                        {DType::kBF16, ReduceOp::kSum, 5003},
                        {DType::kBF16, ReduceOp::kAvg, 400009},
                        {DType::kF32, ReduceOp::kSum, 262147}};
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(DTypeName(c.dtype), " ", ReduceOpName(c.op), " x ", c.count));
    const size_t esize = DTypeSize(c.dtype);
    // outputs[backend][rank]: all-reduce then reduce-scatter results, as bytes.
    std::vector<std::vector<uint8_t>> allreduce[2], scatter[2];
    for (int b = 0; b < 2; ++b) {
      allreduce[b].resize(n);
      scatter[b].resize(n);
      RunRanks(b == 0 ? *local : ucx, [&](int r, Communicator& comm, Stream& stream) {
        std::vector<uint8_t> input(n * c.count * esize);
        for (size_t i = 0; i < n * c.count; ++i) {
          SetElement(c.dtype, input.data(), i, HashedFloat(r, i, 21));
        }
        std::vector<uint8_t> out(input.size());
        ASSERT_TRUE(WaitFor(comm.AllReduce(input.data(), out.data(), n * c.count, c.dtype, stream,
                                           {.op = c.op}))
                        .ok());
        std::vector<uint8_t> shard(c.count * esize);
        ASSERT_TRUE(WaitFor(comm.ReduceScatter(input.data(), shard.data(), c.count, c.dtype, stream,
                                               {.op = c.op}))
                        .ok());
        allreduce[b][r] = std::move(out);
        scatter[b][r] = std::move(shard);
      });
    }
    // The inputs as the backends saw them (rounded to the dtype), reduced in double.
    auto reference = [&](size_t i) {
      double sum = 0;
      for (int s = 0; s < n; ++s) {
        std::vector<uint8_t> one(esize);
        SetElement(c.dtype, one.data(), 0, HashedFloat(s, i, 21));
        sum += GetElement(c.dtype, one.data(), 0);
      }
      return c.op == ReduceOp::kAvg ? sum / n : sum;
    };
    const double tolerance = c.dtype == DType::kBF16 ? 3.0 / 128 : 1e-5;
    for (int r = 0; r < n; ++r) {
      ASSERT_EQ(allreduce[0][r], allreduce[1][r])
          << "all_reduce differs between backends, rank " << r;
      ASSERT_EQ(scatter[0][r], scatter[1][r])
          << "reduce_scatter differs between backends, rank " << r;
      for (size_t i = 0; i < n * c.count; ++i) {
        ASSERT_NEAR(GetElement(c.dtype, allreduce[1][r].data(), i), reference(i), tolerance) << i;
      }
      for (size_t i = 0; i < c.count; ++i) {
        ASSERT_NEAR(GetElement(c.dtype, scatter[1][r].data(), i), reference(r * c.count + i),
                    tolerance)
            << i;
      }
    }
  }
}

}  // namespace
}  // namespace shardline::testing
