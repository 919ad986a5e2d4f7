// The Communicator API over the ucx backend with ranks as threads of one process, each with its
// own UCX worker, connected over a shared MemoryStore: this runs the real UCX paths (shared
// memory, the single-copy protocol — ranks of one process can read each other's memory — and
// mapped shareable memory) cheaply. The conformance suite (tests/collectives/conformance.h) for
// world sizes 1 to 4, plus what is ucx-specific: collectives issued on two streams, large
// collectives on shareable memory (mapped, borrowed reductions), UCX's own shared memory
// (SHARDLINE_UCX_CMA=0), creation without peers.
#include "collectives/ucx/ucx_communicator.h"

#include <gtest/gtest.h>

#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/local/local_communicator.h"
#include "collectives/store/memory_store.h"
#include "collectives/ucx/internal/ucx_collective.h"
#include "collectives/ucx/internal/ucx_communicator_internal.h"
#include "collectives/ucx/internal/ucx_context.h"
#include "collectives/ucx/internal/ucx_transport.h"
#include "runtime/allocator.h"
#include "runtime/check.h"
#include "runtime/config.h"
#include "runtime/shared_memory.h"
#include "runtime/stream.h"
#include "tests/collectives/conformance.h"
#include "tests/collectives/rank_comms.h"
#include "tests/common/gate.h"
#include "tests/common/rank_threads.h"
#include "tests/common/sanitizers.h"
#include "tests/common/scoped_env.h"

namespace shardline {
namespace {

using ::shardline::testing::Comms;
using ::shardline::testing::Gate;
using ::shardline::testing::GetElement;
using ::shardline::testing::MakeUcxComms;
using ::shardline::testing::PatternBuffer;
using ::shardline::testing::PatternValue;
using ::shardline::testing::ReferenceReduce;
using ::shardline::testing::RunRanks;
using ::shardline::testing::RunRankThreads;
using ::shardline::testing::ScopedEnv;
using ::shardline::testing::WaitFor;

// The same through CreateUcxCommunicatorWithTuning: rank r with tuning_of(r).
Comms MakeCommsWithTunings(int n, absl::Duration timeout,
                           absl::FunctionRef<ucx_internal::Tuning(int)> tuning_of) {
  auto store = std::make_shared<MemoryStore>();
  Comms comms(n);
  RunRankThreads(n, [&](int r) {
    absl::StatusOr<std::shared_ptr<Communicator>> comm =
        ucx_internal::CreateUcxCommunicatorWithTuning(
            {.rank = r, .size = n, .store = store, .timeout = timeout}, tuning_of(r));
    SL_CHECK_OK(comm.status());
    comms[r] = *std::move(comm);
  });
  return comms;
}

// Every rank with `tuning`.
Comms MakeCommsWithTuning(int n, absl::Duration timeout, const ucx_internal::Tuning& tuning) {
  return MakeCommsWithTunings(n, timeout, [&](int) { return tuning; });
}

// n transports created concurrently under `name`, rank r with tuning_of(r) after on_thread(r)
// ran on its thread; each rank's creation status beside it.
struct Transports {
  std::vector<std::unique_ptr<ucx_internal::UcxTransport>> transports;
  std::vector<absl::Status> created;
};
Transports CreateTransports(int n, Store& store, const std::string& name,
                            absl::FunctionRef<ucx_internal::Tuning(int)> tuning_of,
                            absl::FunctionRef<void(int)> on_thread) {
  Transports out;
  out.transports.resize(n);
  out.created.resize(n);
  RunRankThreads(n, [&](int r) {
    on_thread(r);
    absl::StatusOr<std::unique_ptr<ucx_internal::UcxTransport>> t =
        ucx_internal::UcxTransport::Create(r, n, store, name, tuning_of(r),
                                           absl::Now() + absl::Seconds(20));
    out.created[r] = t.status();
    if (t.ok()) out.transports[r] = *std::move(t);
  });
  return out;
}

struct UcxBackend {
  static constexpr const char* kName = "ucx";
  static constexpr int kWorldSizes[] = {1, 2, 3, 4};
  static Comms Make(int n, absl::Duration timeout) { return MakeUcxComms(n, timeout); }
};

// The same with the fingerprint round through UCX messages (SHARDLINE_UCX_MAILBOX=0): the path
// of communicators whose ranks do not all share a host.
struct UcxMessagesBackend {
  static constexpr const char* kName = "ucx";
  static constexpr int kWorldSizes[] = {1, 2, 3, 4};
  static Comms Make(int n, absl::Duration timeout) {
    absl::StatusOr<ucx_internal::Tuning> tuning = ucx_internal::Tuning::FromEnvironment();
    SL_CHECK_OK(tuning.status());
    tuning->mailbox = false;
    return MakeCommsWithTuning(n, timeout, *tuning);
  }
};

}  // namespace

namespace testing {
INSTANTIATE_TYPED_TEST_SUITE_P(Ucx, CommunicatorConformanceTest, UcxBackend);
INSTANTIATE_TYPED_TEST_SUITE_P(UcxMessages, CommunicatorConformanceTest, UcxMessagesBackend);
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
    uint8_t* b = *batch.Buffer(sizes[i]);
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
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(*batch.Buffer(sizes[i]), buffers[i]) << i;
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
  ASSERT_TRUE(batch.Buffer(Batch::kRetainBytes + 1).ok());
  EXPECT_GT(batch.held_bytes(), Batch::kRetainBytes);
  batch.Reset();
  EXPECT_EQ(batch.held_bytes(), 0u);
  uint8_t* fresh = *batch.Buffer(10);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(fresh) % 64, 0u);
  EXPECT_EQ(batch.held_bytes(), 64u << 10);

  // Memory that cannot be had is an error naming the bytes, not an abort; the batch stays
  // usable. An impossible size, then the test limit.
  absl::StatusOr<uint8_t*> impossible = batch.Buffer(~size_t{0} - 10);
  EXPECT_TRUE(absl::IsResourceExhausted(impossible.status())) << impossible.status();
  EXPECT_TRUE(absl::StrContains(impossible.status().message(), "ucx staging"));
  batch.set_limit_bytes(100u << 10);
  absl::StatusOr<uint8_t*> limited = batch.Buffer(200u << 10);
  EXPECT_TRUE(absl::IsResourceExhausted(limited.status())) << limited.status();
  // The arena's size may exceed the buffer's (alignment padding differs between builds).
  EXPECT_TRUE(absl::StrContains(limited.status().message(), "for a buffer of 204800 bytes"))
      << limited.status();
  EXPECT_EQ(batch.held_bytes(), 64u << 10);
  EXPECT_TRUE(batch.Buffer(1000).ok());
}

// SHARDLINE_UCX_CHUNK_BYTES=99999999999999 used to pass and abort both ranks at the first large
// all-reduce (staging of a window of chunks); now the knob's bounds refuse it at creation,
// naming the knob, the value and the bounds.
TEST(UcxCommunicatorTest, ChunkKnobOutOfBoundsIsRefusedAtCreation) {
  ScopedEnv env("SHARDLINE_UCX_CHUNK_BYTES", "99999999999999");
  ucx_internal::ParamUcxChunkBytes().ResetCacheForTesting();
  auto store = std::make_shared<MemoryStore>();
  absl::StatusOr<std::shared_ptr<Communicator>> comm =
      CreateUcxCommunicator({.rank = 0, .size = 2, .store = store, .timeout = absl::Seconds(5)});
  ucx_internal::ParamUcxChunkBytes().ResetCacheForTesting();
  ASSERT_FALSE(comm.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(comm.status())) << comm.status();
  EXPECT_TRUE(absl::StrContains(comm.status().message(),
                                "SHARDLINE_UCX_CHUNK_BYTES: 99999999999999 is out of range "
                                "[4096, 268435456]"))
      << comm.status();
}

// A rank whose staging cannot be allocated mid-collective (the test limit stands in for an
// exhausted system) fails its collective with ResourceExhausted naming the collective and the
// bytes, and every peer gets that error too (naming the rank), long before the deadline: no
// rank aborts, none hangs. Both fingerprint paths (mailboxes, UCX messages); the failure in
// the first staging of the collective (limit 1 byte: the fingerprint message's buffers, or,
// with mailboxes, the single-copy descriptors of an all-gather's data phase) and in the
// pipelined reduction's scratch (limit 1 MiB, below the window of chunks a 4 MiB all-reduce
// stages).
TEST(UcxCommunicatorTest, StagingThatCannotBeAllocatedFailsEveryRankWithoutAbort) {
  absl::StatusOr<ucx_internal::Tuning> base = ucx_internal::Tuning::FromEnvironment();
  ASSERT_TRUE(base.ok()) << base.status();
  const int n = 3;
  const int failing = 1;
  const size_t count = size_t{1} << 20;
  struct Case {
    bool mailbox;
    size_t limit;
    bool all_gather;  // else all-reduce
  };
  for (const Case& c : {Case{true, 1, false}, Case{true, 1, true}, Case{true, 1 << 20, false},
                        Case{false, 1, false}, Case{false, 1 << 20, false}}) {
    SCOPED_TRACE(
        absl::StrCat("mailbox ", c.mailbox, " limit ", c.limit, " all_gather ", c.all_gather));
    Comms comms = MakeCommsWithTunings(n, absl::Seconds(60), [&](int r) {
      ucx_internal::Tuning t = *base;
      t.mailbox = c.mailbox;
      if (r == failing) t.staging_limit_bytes = c.limit;
      return t;
    });
    std::vector<absl::Status> statuses(n);
    std::vector<absl::Duration> took(n);
    RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
      std::vector<float> input(count, 1.0f), output(n * count);
      const absl::Time start = absl::Now();
      statuses[r] = WaitFor(
          c.all_gather ? comm.AllGather(input.data(), output.data(), count, DType::kF32, stream)
                       : comm.AllReduce(input.data(), output.data(), count, DType::kF32, stream));
      took[r] = absl::Now() - start;
    });
    for (int r = 0; r < n; ++r) {
      const absl::Status& s = statuses[r];
      EXPECT_TRUE(absl::IsResourceExhausted(s)) << "rank " << r << ": " << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "ucx staging: cannot allocate"))
          << "rank " << r << ": " << s;
      EXPECT_TRUE(absl::StrContains(s.message(), c.all_gather ? "all_gather" : "all_reduce"))
          << "rank " << r << ": " << s;
      if (r != failing) {
        EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat("peer rank ", failing)))
            << "rank " << r << ": " << s;
      }
      EXPECT_LT(took[r], absl::Seconds(10)) << "rank " << r;
    }
  }
}

TEST(UcxCommunicatorTest, RecreatedUnderTheSameNameNeverReadsTheOldAddresses) {
  // The keys of the first communicator stay in the store. Its re-creation must wait for the
  // peers' new addresses instead of connecting to the dead workers the old keys name: rank 1
  // only starts once rank 0 waits for the addresses, so rank 0 would find stale ones first.
  const int n = 2;
  auto store = std::make_shared<MemoryStore>();
  {
    Comms comms = MakeUcxComms(n, absl::Seconds(30), store, "again");
    RunRanks(comms, [&](int, Communicator& comm, Stream& stream) {
      CheckCollectives(comm, stream, 70000, /*salt=*/1);
    });
    comms[0]->Abort(absl::CancelledError("the test discards this communicator"));
  }
  for (int round = 2; round <= 3; ++round) {
    auto watched = std::make_shared<WatchedStore>(store);
    Comms comms(n);
    std::vector<absl::Status> created(n);
    RunRankThreads(n, [&](int r) {
      if (r == 1) {
        ASSERT_TRUE(watched->address_wait.Wait());
      }
      absl::StatusOr<std::shared_ptr<Communicator>> comm = CreateUcxCommunicator(
          {.rank = r, .size = n, .store = watched, .name = "again", .timeout = absl::Seconds(10)});
      created[r] = comm.status();
      if (comm.ok()) comms[r] = *std::move(comm);
    });
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
    const absl::Time start = absl::Now();
    std::vector<absl::Status> created = RunRankThreads(n, [&](int r) {
      return ucx_internal::CreateUcxCommunicatorWithTuning(
                 {.rank = r, .size = n, .store = store, .timeout = absl::Seconds(20)},
                 r == 1 ? other : *base)
          .status();
    });
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
    Comms comms = MakeUcxComms(2);
    RunRanks(comms, [&](int, Communicator& comm, Stream& stream) {
      CheckCollectives(comm, stream, 70000, /*salt=*/4);
    });
  }
  EXPECT_EQ(std::getenv("UCX_MM_ERROR_HANDLING"), nullptr);
}

TEST(UcxCommunicatorTest, TcpEndpointsSendNoZeroCopyActiveMessages) {
  // UCX 1.13's TCP transport completes a zero-copy send twice when the peer dies while the send
  // is still going out, and Debian's UCX asserts on that (see ucx_context.cc): a survivor
  // aborted instead of failing its collective. The context must keep eager messages (and with
  // them the rendezvous data, which TCP carries as active messages) off zero-copy.
  if (std::getenv("UCX_ZCOPY_THRESH") != nullptr) GTEST_SKIP() << "UCX_ZCOPY_THRESH is set";
  absl::StatusOr<std::shared_ptr<ucx_internal::UcxContext>> context =
      ucx_internal::UcxContext::Acquire(/*shm=*/false);
  ASSERT_TRUE(context.ok()) << context.status();
  ucp_worker_params_t worker_params{};
  ucp_worker_h workers[2] = {};
  for (ucp_worker_h& w : workers) {
    ASSERT_EQ(ucp_worker_create((*context)->get(), &worker_params, &w), UCS_OK);
  }
  absl::Cleanup destroy_workers = [&] {
    for (ucp_worker_h w : workers) ucp_worker_destroy(w);
  };
  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  ASSERT_EQ(ucp_worker_get_address(workers[1], &address, &address_length), UCS_OK);
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                         UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep_params.address = address;
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep_params.err_handler.cb = [](void*, ucp_ep_h, ucs_status_t) {};
  ucp_ep_h ep = nullptr;
  const ucs_status_t created = ucp_ep_create(workers[0], &ep_params, &ep);
  ucp_worker_release_address(workers[1], address);
  ASSERT_EQ(created, UCS_OK);
  char* text = nullptr;
  size_t text_length = 0;
  FILE* stream = open_memstream(&text, &text_length);
  ASSERT_NE(stream, nullptr);
  ucp_ep_print_info(ep, stream);
  std::fclose(stream);
  const std::string info(text, text_length);
  std::free(text);
  ucp_request_param_t close_param{};
  close_param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  close_param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t closing = ucp_ep_close_nbx(ep, &close_param);
  while (UCS_PTR_IS_PTR(closing) && ucp_request_check_status(closing) == UCS_INPROGRESS) {
    ucp_worker_progress(workers[0]);
    ucp_worker_progress(workers[1]);
  }
  if (UCS_PTR_IS_PTR(closing)) ucp_request_free(closing);
  if (!absl::StrContains(info, "tcp/")) GTEST_SKIP() << "no TCP lane here:\n" << info;
  EXPECT_TRUE(absl::StrContains(info, "<egr/bcopy>")) << info;
  EXPECT_FALSE(absl::StrContains(info, "zcopy")) << info;
}

// Makes the next communicator read SHARDLINE_UCX_CMA again.
void ReReadCmaKnob() {
  for (const ParamBase* param : AllParams()) {
    if (param->env_name() == "SHARDLINE_UCX_CMA") param->ResetCacheForTesting();
  }
}

TEST(UcxCommunicatorTest, YieldKnobIsCheckedAndEveryPolicyMovesDataCorrectly) {
  auto reread = [] {
    for (const ParamBase* param : AllParams()) {
      if (param->env_name() == "SHARDLINE_UCX_YIELD") param->ResetCacheForTesting();
    }
  };
  {
    ScopedEnv bad("SHARDLINE_UCX_YIELD", "sometimes");
    reread();
    // Every rank reads the knob before it connects: each fails at once, nobody waits for a peer.
    auto store = std::make_shared<MemoryStore>();
    std::vector<absl::Status> created = RunRankThreads(2, [&](int r) {
      return CreateUcxCommunicator({.rank = r,
                                    .size = 2,
                                    .store = store,
                                    .name = "yield",
                                    .timeout = absl::Seconds(20)})
          .status();
    });
    for (const absl::Status& status : created) {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_TRUE(absl::StrContains(status.message(), "SHARDLINE_UCX_YIELD")) << status;
      EXPECT_TRUE(absl::StrContains(status.message(), "sometimes")) << status;
    }
  }
  for (const char* policy : {"never", "always", "auto"}) {
    ScopedEnv set("SHARDLINE_UCX_YIELD", policy);
    reread();
    Comms comms = MakeUcxComms(3);
    RunRanks(comms, [&](int, Communicator& comm, Stream& stream) {
      CheckCollectives(comm, stream, 2049, /*salt=*/7);    // the small path
      CheckCollectives(comm, stream, 100003, /*salt=*/8);  // the pipelined one
    });
  }
  reread();
}

TEST(UcxCommunicatorTest, RanksPinnedToOneCpuKnowWhichPeersShareIt) {
  // Each rank's thread pins itself before creating its transport (affinity is per thread):
  // rank r on the (r mod k)-th allowed CPU, so with 4 ranks on k >= 2 CPUs ranks r and r + k
  // share one. Every rank learns every local peer's CPU at wire-up.
  cpu_set_t allowed_set;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed_set), &allowed_set), 0);
  std::vector<int> allowed;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed_set)) allowed.push_back(c);
  }
  const int n = 4;
  auto cpu_of = [&](int r) { return allowed[r % allowed.size()]; };
  absl::StatusOr<ucx_internal::Tuning> tuning = ucx_internal::Tuning::FromEnvironment();
  ASSERT_TRUE(tuning.ok()) << tuning.status();
  MemoryStore store;
  auto [transports, created] = CreateTransports(
      n, store, "pinned", [&](int) { return *tuning; },
      [&](int r) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu_of(r), &one);
        ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
      });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(created[r].ok()) << "rank " << r << ": " << created[r];
    EXPECT_TRUE(transports[r]->pinned()) << r;
    bool mate = false;
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      EXPECT_EQ(transports[r]->SharesCpu(p), cpu_of(p) == cpu_of(r)) << r << " and " << p;
      mate = mate || cpu_of(p) == cpu_of(r);
    }
    // A pinned rank yields its core only where another rank is pinned to it too.
    EXPECT_EQ(transports[r]->oversubscribed(), mate) << r;
  }
  // Unpinned (this thread): no peer shares "its" CPU.
  std::unique_ptr<ucx_internal::UcxTransport> alone;
  {
    absl::StatusOr<std::unique_ptr<ucx_internal::UcxTransport>> t =
        ucx_internal::UcxTransport::Create(0, 1, store, "unpinned", *tuning,
                                           absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(t.ok()) << t.status();
    alone = *std::move(t);
  }
  EXPECT_EQ(alone->pinned(), allowed.size() == 1);
}

// The ranks of a communicator on one host take the mailboxes all together, or none does: one
// rank without them (SHARDLINE_UCX_MAILBOX=0) turns them off on every rank.
TEST(UcxCommunicatorTest, MailboxesAreTakenByEveryRankOrByNone) {
  absl::StatusOr<ucx_internal::Tuning> base = ucx_internal::Tuning::FromEnvironment();
  ASSERT_TRUE(base.ok()) << base.status();
  for (const bool rank1_wants : {true, false}) {
    const int n = 3;
    MemoryStore store;
    auto [transports, created] = CreateTransports(
        n, store, rank1_wants ? "all" : "one-off",
        [&](int r) {
          ucx_internal::Tuning tuning = *base;
          tuning.mailbox = r == 1 ? rank1_wants : true;
          return tuning;
        },
        [](int) {});
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(created[r].ok()) << "rank " << r << ": " << created[r];
      EXPECT_EQ(transports[r]->mailboxes() != nullptr, rank1_wants) << "rank " << r;
    }
  }
}

// With no spin at all (SHARDLINE_UCX_SPIN_US=0, as the training example runs) every wait of the
// fingerprint round sleeps on a peer's mailbox at once and is woken by the peer's store: small
// and large collectives of three ranks stay right, every element checked.
TEST(UcxCommunicatorTest, MailboxWaitsThatSleepAtOnceMoveDataCorrectly) {
  absl::StatusOr<ucx_internal::Tuning> tuning = ucx_internal::Tuning::FromEnvironment();
  ASSERT_TRUE(tuning.ok()) << tuning.status();
  tuning->spin = absl::ZeroDuration();
  ASSERT_TRUE(tuning->mailbox);
  const int n = 3;
  Comms comms = MakeCommsWithTuning(n, absl::Seconds(30), *tuning);
  RunRanks(comms, [&](int /*r*/, Communicator& comm, Stream& stream) {
    // 61 elements: small; 3 * 32 Ki + 5: above SHARDLINE_UCX_SMALL_BYTES per peer.
    for (int salt = 0; salt < 40; ++salt) {
      CheckCollectives(comm, stream, salt % 8 == 7 ? 3 * 32768 + 5 : 61, salt);
    }
  });
}

// The rank whose large collectives stall after their fingerprint round (the hook below) until
// `g_straggler_resume` opens; -1: none.
std::atomic<int> g_straggler{-1};
Gate* g_straggler_resume = nullptr;
void StallTheStraggler(int rank, uint64_t /*seq*/) {
  if (rank == g_straggler.load()) {
    EXPECT_TRUE(g_straggler_resume->Wait()) << "never resumed";
  }
}

// Runs `rank_body` on two ranks with mailboxes and without, on private and on shareable memory
// (`elements` floats of it per rank, handed to the body), with rank 1 stalled after each large
// collective's fingerprint round until the body opens `resume`.
void WithAStraggler(
    size_t elements,
    absl::FunctionRef<void(int r, Communicator& comm, Stream& stream, float* data, Gate& resume)>
        rank_body) {
  absl::StatusOr<ucx_internal::Tuning> tuning = ucx_internal::Tuning::FromEnvironment();
  ASSERT_TRUE(tuning.ok()) << tuning.status();
  ucx_internal::SetBeforeDataHookForTesting(&StallTheStraggler);
  absl::Cleanup unhook = [] { ucx_internal::SetBeforeDataHookForTesting(nullptr); };
  for (const bool mailbox : {true, false}) {
    for (const bool shareable : {false, true}) {
      SCOPED_TRACE(absl::StrCat(mailbox ? "mailboxes" : "messages", ", ",
                                shareable ? "shareable" : "private", " memory"));
      tuning->mailbox = mailbox;
      Comms comms = MakeCommsWithTuning(2, absl::Seconds(30), *tuning);
      Gate resume;
      g_straggler_resume = &resume;
      g_straggler = 1;
      RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
        std::unique_ptr<Allocator> host =
            comm.CreateHostAllocatorForTransfers(64, absl::StrCat("rank", r));
        std::vector<float> vec;
        absl::StatusOr<Buffer> block;
        float* data;
        if (shareable) {
          block = host->Allocate(elements * sizeof(float));
          ASSERT_TRUE(block.ok()) << block.status();
          data = block->as<float>();
        } else {
          vec.resize(elements);
          data = vec.data();
        }
        rank_body(r, comm, stream, data, resume);
      });
      g_straggler = -1;
    }
  }
}

// A straggler resumed after its peer gave up on a collective never returns OK from it: rank 1
// stalls inside a large broadcast (its fingerprint round done, its read of the root's buffer not
// yet) until the root has timed out, aborted and reused its buffer; then it reads the buffer —
// private memory (process_vm_readv) or shareable (mapped) — and its fin and every completion go
// well. It must fail naming rank 0, with mailboxes (the abort mark) and without (the notice,
// queued by then). Before the check after the reads it returned OK with the reused bytes.
TEST(UcxCommunicatorTest, AStragglerNeverReturnsOkFromACollectiveItsPeerGaveUpOn) {
  constexpr size_t kCount = 64 * 1024;  // 256 KiB: above SHARDLINE_UCX_SMALL_BYTES
  WithAStraggler(kCount, [&](int r, Communicator& comm, Stream& stream, float* data, Gate& resume) {
    const std::vector<float> sent = HashedFloats(0, kCount, 1);
    if (r == 0) {
      std::copy(sent.begin(), sent.end(), data);
    } else {
      std::fill(data, data + kCount, -1.0f);
    }
    BroadcastOptions options;
    options.root = 0;
    options.timeout = r == 0 ? absl::Milliseconds(300) : absl::Seconds(20);
    const absl::Status status = WaitFor(comm.Broadcast(data, kCount, DType::kF32, stream, options));
    if (r == 0) {
      EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
      // The root's buffer is the caller's again, and reused: not what it broadcast.
      std::fill(data, data + kCount, 7.0f);
      resume.Open();
      return;
    }
    EXPECT_FALSE(status.ok()) << "returned OK; element 0 reads " << data[0] << " where rank 0 "
                              << "sent " << sent[0];
    EXPECT_TRUE(IsPeerError(status)) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), "rank 0")) << status;
  });
}

// The same for a reduce-scatter, whose local peers lease each other's whole blocks: the straggler
// reads (or maps) the block its peer offered before that peer gave up, reused its input and
// returned; it must still fail naming rank 0, never return OK with what it reduced.
TEST(UcxCommunicatorTest, AStragglerNeverReturnsOkFromAReduceScatterItsPeerGaveUpOn) {
  constexpr size_t kCount = 64 * 1024;  // per rank, 256 KiB: above SHARDLINE_UCX_SMALL_BYTES
  WithAStraggler(
      2 * kCount, [&](int r, Communicator& comm, Stream& stream, float* data, Gate& resume) {
        const std::vector<float> sent = HashedFloats(r, 2 * kCount, 1);
        std::copy(sent.begin(), sent.end(), data);
        std::vector<float> shard(kCount, -1.0f);
        ReduceOptions options;
        options.timeout = r == 0 ? absl::Milliseconds(300) : absl::Seconds(20);
        const absl::Status status =
            WaitFor(comm.ReduceScatter(data, shard.data(), kCount, DType::kF32, stream, options));
        if (r == 0) {
          EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
          // The input is the caller's again, and reused: not what rank 0 offered.
          std::fill(data, data + 2 * kCount, 7.0f);
          resume.Open();
          return;
        }
        EXPECT_FALSE(status.ok()) << "returned OK; element 0 reads " << shard[0];
        EXPECT_TRUE(IsPeerError(status)) << status;
        EXPECT_TRUE(absl::StrContains(status.message(), "rank 0")) << status;
      });
}

// With no spin every wait of a pipelined reduction sleeps on the worker's event fd. Reductions
// of many more chunks than a shared-memory queue between two ranks holds (4 KiB chunks, 257 per
// peer; UCX's mm FIFO holds 64 messages) stay right and never sleep out a poll: every sleep ends
// with a peer's message. Offering every chunk at once left offers in UCX's pending queue on
// both sides, which nothing woke either rank to move: each such wait ran to the 200 ms poll
// limit (0.3-0.9 s per collective of this size).
TEST(UcxCommunicatorTest, PipelinedReductionsOfManyChunksNeverSleepOutAPoll) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "under ThreadSanitizer a rank can stall 200 ms without losing a wake-up";
#endif
  absl::StatusOr<ucx_internal::Tuning> tuning = ucx_internal::Tuning::FromEnvironment();
  ASSERT_TRUE(tuning.ok()) << tuning.status();
  tuning->spin = absl::ZeroDuration();
  tuning->chunk_bytes = 4096;
  for (const int n : {2, 3}) {
    SCOPED_TRACE(absl::StrCat(n, " ranks"));
    const size_t count = 257 * 1024 + 3;  // per rank: 257 chunks and a ragged one
    Comms comms = MakeCommsWithTuning(n, absl::Seconds(60), *tuning);
    const uint64_t run_out_before = ucx_internal::CollectiveSleepsRunOut();
    RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
      std::unique_ptr<Allocator> host =
          comm.CreateHostAllocatorForTransfers(64, absl::StrCat("rank", r));
      absl::StatusOr<Buffer> input = host->Allocate(n * count * 4);
      absl::StatusOr<Buffer> output = host->Allocate(n * count * 4);
      ASSERT_TRUE(input.ok() && output.ok());
      const std::vector<uint8_t> pattern = PatternBuffer(DType::kF32, r, n * count);
      for (int round = 0; round < 2; ++round) {
        std::copy(pattern.begin(), pattern.end(), input->as<uint8_t>());
        ASSERT_TRUE(
            WaitFor(comm.ReduceScatter(input->data(), output->data(), count, DType::kF32, stream))
                .ok());
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(GetElement(DType::kF32, output->data(), i),
                    ReferenceReduce(DType::kF32, ReduceOp::kSum, n, r * count + i))
              << "reduce-scatter element " << i;
        }
        ASSERT_TRUE(
            WaitFor(comm.AllReduce(input->data(), output->data(), n * count, DType::kF32, stream))
                .ok());
        for (size_t i = 0; i < n * count; ++i) {
          ASSERT_EQ(GetElement(DType::kF32, output->data(), i),
                    ReferenceReduce(DType::kF32, ReduceOp::kSum, n, i))
              << "all-reduce element " << i;
        }
      }
    });
    EXPECT_EQ(ucx_internal::CollectiveSleepsRunOut(), run_out_before)
        << "a wait slept out its poll: a lost wake-up";
  }
}

TEST(UcxMailboxTest, ASleeperWakesWhenItsPeerPublishesThroughAnotherMapping) {
  using ucx_internal::Mailboxes;
  constexpr size_t kFingerprint = 24, kPayload = 4096;
  absl::StatusOr<std::unique_ptr<Mailboxes>> a = Mailboxes::Create(0, 2, kFingerprint, kPayload);
  absl::StatusOr<std::unique_ptr<Mailboxes>> b = Mailboxes::Create(1, 2, kFingerprint, kPayload);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  // Each maps the other's file read-only, as a peer process does.
  auto map = [](const Mailboxes& m) {
    void* p = mmap(nullptr, m.bytes(), PROT_READ, MAP_SHARED, m.fd(), 0);
    SL_CHECK(p != MAP_FAILED);
    return static_cast<const uint8_t*>(p);
  };
  const uint8_t* a_seen_by_b = map(**a);
  const uint8_t* b_seen_by_a = map(**b);
  (*a)->SetPeer(1, b_seen_by_a);
  (*b)->SetPeer(0, a_seen_by_b);
  for (int round = 0; round < 3; ++round) {
    const uint64_t count = (*a)->Next();
    ASSERT_EQ((*b)->Next(), count);
    EXPECT_FALSE((*a)->Arrived(1, count));
    std::promise<void> woke;
    std::future<void> woken = woke.get_future();
    std::thread sleeper([&] {
      // A timeout far beyond the bound below: only the peer's wake-up ends this in time.
      while (!(*a)->Arrived(1, count)) (*a)->Sleep(1, count, absl::Seconds(30));
      woke.set_value();
    });
    // Rank 0 says in its mailbox which peer it sleeps on (1 + the peer), before it sleeps.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (__atomic_load_n(reinterpret_cast<const uint32_t*>(a_seen_by_b), __ATOMIC_ACQUIRE) != 2) {
      ASSERT_LT(absl::Now(), deadline) << "rank 0 never went to sleep";
      std::this_thread::yield();
    }
    for (size_t i = 0; i < kFingerprint; ++i) (*b)->fingerprint(count)[i] = uint8_t(round * 31 + i);
    for (size_t i = 0; i < kPayload; ++i) (*b)->payload(count)[i] = uint8_t(round * 7 + i * 13);
    (*b)->Publish(count);
    const bool in_time = woken.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
    sleeper.join();
    ASSERT_TRUE(in_time) << "round " << round << ": the publish did not wake the sleeper";
    for (size_t i = 0; i < kFingerprint; ++i) {
      ASSERT_EQ((*a)->fingerprint(1, count)[i], uint8_t(round * 31 + i)) << i;
    }
    for (size_t i = 0; i < kPayload; ++i) {
      ASSERT_EQ((*a)->payload(1, count)[i], uint8_t(round * 7 + i * 13)) << i;
    }
    // The next collective uses the other slot: nothing there for count + 1 yet.
    EXPECT_FALSE((*a)->Arrived(1, count + 1));
    (*a)->Publish(count);
  }
  munmap(const_cast<uint8_t*>(a_seen_by_b), (*a)->bytes());
  munmap(const_cast<uint8_t*>(b_seen_by_a), (*b)->bytes());
}

// A rank's abort mark names the last collective it finished: a peer fails only later ones.
TEST(UcxMailboxTest, TheAbortMarkSparesWhatTheAbortingRankFinished) {
  using ucx_internal::Mailboxes;
  absl::StatusOr<std::unique_ptr<Mailboxes>> a = Mailboxes::Create(0, 2, 24, 64);
  absl::StatusOr<std::unique_ptr<Mailboxes>> b = Mailboxes::Create(1, 2, 24, 64);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  void* b_mapped = mmap(nullptr, (*b)->bytes(), PROT_READ, MAP_SHARED, (*b)->fd(), 0);
  ASSERT_NE(b_mapped, MAP_FAILED);
  (*a)->SetPeer(1, static_cast<const uint8_t*>(b_mapped));
  for (uint64_t c = 1; c <= 3; ++c) (*b)->Completed(c);
  EXPECT_FALSE((*a)->AbortedBefore(1, 4)) << "not aborted yet";
  (*b)->MarkAborted();
  EXPECT_FALSE((*a)->AbortedBefore(1, 3)) << "rank 1 finished collective 3";
  EXPECT_TRUE((*a)->AbortedBefore(1, 4)) << "rank 1 aborted before it finished collective 4";
  munmap(b_mapped, (*b)->bytes());
}

TEST(UcxCommunicatorTest, LargeMessagesThroughUcxSharedMemory) {
  // SHARDLINE_UCX_CMA=0: no single-copy reads, UCX moves the large messages itself.
  setenv("SHARDLINE_UCX_CMA", "0", 1);
  ReReadCmaKnob();
  Comms comms = MakeUcxComms(2);
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
  // Buffers from the communicator's host allocator (shareable from 1 MiB): peers copy out of
  // their mappings of each other's memory and reduce straight out of them (borrowed chunks).
  const int n = 3;
  const size_t count = 300001;  // per rank: several chunks, a ragged last one
  Comms comms = MakeUcxComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    std::unique_ptr<Allocator> host =
        comm.CreateHostAllocatorForTransfers(64, absl::StrCat("rank", r));
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

// Reduce-scatters whose blocks are large enough for every output path: leased whole from the
// peer (mapped, or read with process_vm_readv for private memory), written with streaming stores
// out of place and, from 16 MiB blocks on, in place too (a ragged tail past the last whole line).
// Every element checked against the exact reference.
TEST(UcxCommunicatorTest, LargeReduceScattersStreamTheirOutputRight) {
  const int n = 2;
  const size_t count = (size_t{16} << 20) / 4 + 5;  // per rank: a block of 16 MiB + 20 bytes
  Comms comms = MakeUcxComms(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    std::unique_ptr<Allocator> host =
        comm.CreateHostAllocatorForTransfers(64, absl::StrCat("rank", r));
    for (const bool shareable : {true, false}) {
      for (const bool in_place : {false, true}) {
        for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
          SCOPED_TRACE(absl::StrCat(shareable ? "shareable" : "private",
                                    in_place ? ", in place" : "", " ", ReduceOpName(op)));
          absl::StatusOr<Buffer> buffer;
          std::vector<uint8_t> vec;
          uint8_t* input;
          if (shareable) {
            buffer = host->Allocate(n * count * 4);
            ASSERT_TRUE(buffer.ok()) << buffer.status();
            input = buffer->as<uint8_t>();
          } else {
            vec.resize(n * count * 4);
            input = vec.data();
          }
          const std::vector<uint8_t> pattern = PatternBuffer(DType::kF32, r, n * count);
          std::copy(pattern.begin(), pattern.end(), input);
          std::vector<uint8_t> separate(in_place ? 0 : count * 4);
          uint8_t* shard = in_place ? input + r * count * 4 : separate.data();
          ASSERT_TRUE(
              WaitFor(comm.ReduceScatter(input, shard, count, DType::kF32, stream, {.op = op}))
                  .ok());
          for (size_t i = 0; i < count; ++i) {
            ASSERT_EQ(GetElement(DType::kF32, shard, i),
                      ReferenceReduce(DType::kF32, op, n, r * count + i))
                << i;
          }
        }
      }
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

TEST(UcxCommunicatorTest, FreshShareableBuffersEveryIterationStayCorrect) {
  // A new shareable input every iteration, freed after it: the arena hands the freed block (or
  // another) out again with new contents, which the peer reads through the mapping it made
  // once — never stale bytes, and no new mapping per block.
  const int n = 2;
  const size_t count = 64 * 1024;  // 256 KiB per rank: the single-copy path
  Comms comms = MakeUcxComms(n);
  const int mappings_before = CountShareableMappings();
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
  // One mapping per peer arena, however many blocks passed.
  EXPECT_LE(CountShareableMappings() - mappings_before, n * GetShareableArenaStats().arenas);
}

TEST(UcxCommunicatorTest, PeersMapAnArenaAgainWhenItsFileGrows) {
  // A peer maps an arena as far as its memory file reaches (not its whole reservation). A block
  // allocated later past that end makes the file longer: the reader maps the arena again, and
  // what it mapped before stays readable.
  const int n = 2;
  const size_t small_count = 64 * 1024 + 3;          // 256 KiB per rank: the single-copy path
  const size_t large_count = (size_t{6} << 20) + 5;  // 24 MiB per rank: past the file's end
  Comms comms = MakeUcxComms(n);
  const int mappings_before = CountShareableMappings();
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    auto check = [&](const void* input, size_t count, uint64_t salt) {
      const std::vector<uint8_t> pattern = PatternBuffer(DType::kF32, r, count, salt);
      std::copy(pattern.begin(), pattern.end(), static_cast<uint8_t*>(const_cast<void*>(input)));
      std::vector<uint8_t> output(n * count * 4);
      ASSERT_TRUE(WaitFor(comm.AllGather(input, output.data(), count, DType::kF32, stream)).ok());
      for (int s = 0; s < n; ++s) {
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(GetElement(DType::kF32, output.data(), s * count + i),
                    PatternValue(DType::kF32, s, i, salt))
              << "from rank " << s << ", element " << i << " of " << count;
        }
      }
    };
    absl::StatusOr<void*> small = AllocateShareable(small_count * 4);
    ASSERT_TRUE(small.ok()) << small.status();
    check(*small, small_count, 1);
    absl::StatusOr<void*> large = AllocateShareable(large_count * 4);
    ASSERT_TRUE(large.ok()) << large.status();
    check(*large, large_count, 2);
    check(*small, small_count, 3);  // the first block, through the new mapping
    FreeShareable(*large, large_count * 4);
    FreeShareable(*small, small_count * 4);
  });
  // The ranks share this process's arenas, so each rank's large block may grow a file once:
  // at most three mappings per reader and arena (the first, and one per growth).
  EXPECT_LE(CountShareableMappings() - mappings_before, 3 * n * GetShareableArenaStats().arenas);
}

TEST(UcxCommunicatorTest, PeersMapEachOtherAgainAfterRunningOutOfDescriptors) {
  // Mapping a peer's region takes a descriptor (pidfd_getfd). While the process has none to
  // spare, large messages fall back to process_vm_readv; once it has, they are mapped again.
  if (testing::UnderSanitizer()) {
    // The limit is process-wide: the sanitizer runtimes' own threads need descriptors meanwhile
    // (UBSan reported a broken stream object here). The normal build runs this test.
    GTEST_SKIP() << "lowers RLIMIT_NOFILE for the whole process; not under sanitizers";
  }
  const int n = 2;
  const size_t count = 64 * 1024;  // 256 KiB per rank: the single-copy path
  Comms comms = MakeUcxComms(n);
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

// Every element of an all-gather of `count` hashed floats per rank from `input` into `output`
// (each `count * n` floats), and of a sum reduce-scatter of `count` per rank from `input2`
// (`count * n` floats) into `shard`.
void CheckGatherAndReduceScatter(Communicator& comm, Stream& stream, float* input, float* output,
                                 float* input2, float* shard, size_t count, int salt) {
  const int n = comm.size(), r = comm.rank();
  for (size_t i = 0; i < count; ++i) input[i] = HashedFloat(r, i, salt);
  for (size_t i = 0; i < n * count; ++i) input2[i] = HashedFloat(r, i, salt + 1);
  absl::Status gathered = WaitFor(comm.AllGather(input, output, count, DType::kF32, stream));
  ASSERT_TRUE(gathered.ok()) << gathered;
  for (int s = 0; s < n; ++s) {
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(output[s * count + i], HashedFloat(s, i, salt))
          << "salt " << salt << ": from rank " << s << ", element " << i;
    }
  }
  absl::Status reduced = WaitFor(comm.ReduceScatter(input2, shard, count, DType::kF32, stream));
  ASSERT_TRUE(reduced.ok()) << reduced;
  for (size_t i = 0; i < count; ++i) {
    float sum = 0;
    for (int s = 0; s < n; ++s) sum += HashedFloat(s, r * count + i, salt + 1);
    ASSERT_EQ(shard[i], sum) << "salt " << salt << ": element " << i;
  }
}

TEST(UcxCommunicatorTest, RegisteredMemorySaysHowPeersReadItAndMovesCorrectly) {
  // Shareable memory (the communicator's host allocator) registers as mapped and is read out of
  // the peers' mappings of its arena; private memory registers as process_vm_readv and still
  // moves correctly. Odd sizes above the shareable threshold, every element checked.
  const int n = 2;
  const size_t count = 300007;  // 1.2 MB per rank
  Comms comms = MakeUcxComms(n);
  const int mappings_before = CountShareableMappings();
  std::vector<int> mappings_after_mapped(n), mappings_after_private(n);
  Gate mapped_done[2];
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    std::unique_ptr<Allocator> host =
        comm.CreateHostAllocatorForTransfers(64, absl::StrCat("rank", r));
    auto make = [&](size_t floats) {
      absl::StatusOr<Buffer> b = host->Allocate(floats * 4);
      SL_CHECK_OK(b.status());
      return *std::move(b);
    };
    Buffer input = make(count), output = make(n * count), input2 = make(n * count),
           shard = make(count);
    ASSERT_TRUE(FindShareable(input.data(), input.size()).has_value());
    absl::StatusOr<Registration> in_reg = comm.RegisterMemory(input.data(), input.size());
    absl::StatusOr<Registration> in2_reg = comm.RegisterMemory(input2.data(), input2.size());
    ASSERT_TRUE(in_reg.ok() && in2_reg.ok()) << in_reg.status() << in2_reg.status();
    EXPECT_EQ(in_reg->path(), TransferPath::kMapped) << TransferPathName(in_reg->path());
    EXPECT_EQ(in2_reg->path(), TransferPath::kMapped);
    EXPECT_EQ(in_reg->data(), input.data());
    EXPECT_EQ(in_reg->size(), input.size());
    CheckGatherAndReduceScatter(comm, stream, input.as<float>(), output.as<float>(),
                                input2.as<float>(), shard.as<float>(), count, /*salt=*/10);
    mapped_done[r].Open();
    ASSERT_TRUE(mapped_done[1 - r].Wait());
    mappings_after_mapped[r] = CountShareableMappings();

    std::vector<float> p_input(count), p_output(n * count), p_input2(n * count), p_shard(count);
    absl::StatusOr<Registration> p_reg = comm.RegisterMemory(p_input.data(), count * 4);
    ASSERT_TRUE(p_reg.ok()) << p_reg.status();
    EXPECT_EQ(p_reg->path(), TransferPath::kProcessRead) << TransferPathName(p_reg->path());
    absl::StatusOr<Registration> p2_reg = comm.RegisterMemory(p_input2.data(), n * count * 4);
    ASSERT_TRUE(p2_reg.ok());
    EXPECT_EQ(comm.live_registrations(), 4);
    CheckGatherAndReduceScatter(comm, stream, p_input.data(), p_output.data(), p_input2.data(),
                                p_shard.data(), count, /*salt=*/20);
    mappings_after_private[r] = CountShareableMappings();

    // Unregistering: RAII, Reset, moves.
    Registration moved = *std::move(p_reg);
    EXPECT_TRUE(moved.registered());
    EXPECT_EQ(comm.live_registrations(), 4);
    moved.Reset();
    EXPECT_FALSE(moved.registered());
    EXPECT_EQ(comm.live_registrations(), 3);
    { Registration gone = *std::move(p2_reg); }
    EXPECT_EQ(comm.live_registrations(), 2);
  });
  // Each rank mapped its peer's arena once (the ranks are threads of this process, so the arena
  // is this process's own, mapped once more per communicator); private memory mapped nothing.
  for (int r = 0; r < n; ++r) {
    EXPECT_GE(mappings_after_mapped[r] - mappings_before, n) << "the mapped path was not taken";
    EXPECT_LE(mappings_after_mapped[r] - mappings_before, n * GetShareableArenaStats().arenas);
    EXPECT_EQ(mappings_after_private[r], mappings_after_mapped[r]);
  }
  for (const std::shared_ptr<Communicator>& comm : comms) EXPECT_EQ(comm->live_registrations(), 0);
}

TEST(UcxCommunicatorTest, RegisterMemoryRejectsBadRangesAndOutlivesItsCommunicator) {
  Comms comms = MakeUcxComms(1);
  absl::StatusOr<Registration> null = comms[0]->RegisterMemory(nullptr, 16);
  EXPECT_EQ(null.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(null.status().message(), "data is null")) << null.status();
  int x = 0;
  absl::StatusOr<Registration> empty = comms[0]->RegisterMemory(&x, 0);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(empty.status().message(), "bytes is 0")) << empty.status();
  absl::StatusOr<Registration> wraps =
      comms[0]->RegisterMemory(reinterpret_cast<void*>(uintptr_t{1} << 63), uintptr_t{1} << 63 | 1);
  EXPECT_EQ(wraps.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(wraps.status().message(), "wrap around")) << wraps.status();
  // A group of one moves nothing: any memory does.
  absl::StatusOr<Registration> alone = comms[0]->RegisterMemory(&x, sizeof(x));
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(alone->path(), TransferPath::kAny);
  EXPECT_EQ(comms[0]->live_registrations(), 1);
  comms.clear();  // the registration outlives its communicator: resetting it does nothing
  alone->Reset();
  EXPECT_FALSE(alone->registered());

  // The local backend moves any memory alike, and its host allocator is private.
  absl::StatusOr<Comms> local = CreateLocalCommunicators(2, {.timeout = absl::Seconds(30)});
  ASSERT_TRUE(local.ok()) << local.status();
  std::vector<float> v(1 << 20);
  absl::StatusOr<Registration> plain = (*local)[0]->RegisterMemory(v.data(), v.size() * 4);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->path(), TransferPath::kAny);
  std::unique_ptr<Allocator> host = (*local)[0]->CreateHostAllocatorForTransfers(64, "local");
  absl::StatusOr<Buffer> large = host->Allocate(4 << 20);
  ASSERT_TRUE(large.ok());
  EXPECT_FALSE(FindShareable(large->data(), large->size()).has_value())
      << "a local world's host memory needs no sharing";
}

TEST(UcxCommunicatorTest, FreeingBlocksThatPeersMappedReturnsTheirMemory) {
  // After an all-gather the peer maps this rank's arena (for good). Freeing the input must still
  // return its pages: the arenas' resident bytes drop by the freed blocks, the allocator's
  // counters are back to zero, and the peers' mappings stay.
  const int n = 2;
  const size_t count = (8 << 20) / 4 + 3;  // 8 MiB and a bit per rank
  Comms comms = MakeUcxComms(n);
  std::vector<std::unique_ptr<Allocator>> hosts(n);
  std::vector<Buffer> inputs(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    hosts[r] = comm.CreateHostAllocatorForTransfers(64, absl::StrCat("rank", r));
    absl::StatusOr<Buffer> input = hosts[r]->Allocate(count * 4);
    ASSERT_TRUE(input.ok()) << input.status();
    ASSERT_TRUE(FindShareable(input->data(), input->size()).has_value());
    auto* in = input->as<float>();
    for (size_t i = 0; i < count; ++i) in[i] = HashedFloat(r, i, 30);
    std::vector<float> output(n * count);
    ASSERT_TRUE(WaitFor(comm.AllGather(in, output.data(), count, DType::kF32, stream)).ok());
    for (int s = 0; s < n; ++s) {
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(output[s * count + i], HashedFloat(s, i, 30)) << "rank " << s << ", " << i;
      }
    }
    inputs[r] = *std::move(input);
  });
  const int mappings = CountShareableMappings();
  const ShareableArenaStats before = GetShareableArenaStats();
  int64_t freed = 0;
  for (int r = 0; r < n; ++r) {
    freed += static_cast<int64_t>(inputs[r].size());
    inputs[r].Reset();
    EXPECT_EQ(hosts[r]->stats().current_bytes, 0);
  }
  const ShareableArenaStats after = GetShareableArenaStats();
  EXPECT_EQ(CountShareableMappings(), mappings) << "the peers' mappings stay";
  EXPECT_LE(after.resident_bytes, before.resident_bytes - freed)
      << "freed blocks stay resident while peers map them";
  EXPECT_EQ(after.live_blocks, before.live_blocks - n);
  // And the comms still work over the same (now partly freed) arena.
  RunRanks(comms, [&](int, Communicator& comm, Stream& stream) {
    CheckCollectives(comm, stream, 300001, /*salt=*/31);
  });
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
  Comms ucx = MakeUcxComms(n);
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
    std::vector<double> reduced(n * c.count, 0.0);
    std::vector<uint8_t> one(esize);
    for (int s = 0; s < n; ++s) {
      for (size_t i = 0; i < n * c.count; ++i) {
        SetElement(c.dtype, one.data(), 0, HashedFloat(s, i, 21));
        reduced[i] += GetElement(c.dtype, one.data(), 0);
      }
    }
    auto reference = [&](size_t i) { return c.op == ReduceOp::kAvg ? reduced[i] / n : reduced[i]; };
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
