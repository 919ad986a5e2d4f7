// Multi-process test program of the ucx backend, started by shardline-launch (RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT) and driven by tests/scripts/multiprocess_test.py:
//
//   collectives_mp correctness   every op x dtype x count {0, 1, 7, 4097, 8192, 8193, 2^20+3}, in
//                                place and out of place, against plain-loop references (8192 f32
//                                elements: per-peer payload = SHARDLINE_UCX_SMALL_BYTES, the
//                                largest that travels with the fingerprint; 8193: the smallest
//                                that does not); then splits
//   collectives_mp mismatch      ranks disagree on counts, then on dtypes, then on the protocol
//                                (a count just past the small-message limit on one rank): every
//                                rank must get the mismatch error naming two ranks (exit 0 if so)
//   collectives_mp kill          rank 1 SIGKILLs itself in the middle of a large all-reduce;
//                                survivors must fail within the deadline + a few seconds, shut
//                                down cleanly and exit with kSurvivorExit
//   collectives_mp skipped       rank 1's stream is poisoned after it enqueued an all-reduce, so
//                                the collective never runs there; every rank (timeout 600 s) must
//                                fail within seconds, naming the collective; prints the time
//   collectives_mp flood         rank 0 floods the store's port with garbage and oversized
//                                frames from a thread while the collectives run; they must pass
//   collectives_mp quick         a few collectives of every kind (used over TCP)
//   collectives_mp init          the world from InitProcessGroup (the launcher's environment),
//                                collectives, a split, and with 4 ranks a 2 x 2 ProcessMesh:
//                                shard all-gather / reduce-scatter + replicate all-reduce
//   collectives_mp init_error [NAME=VALUE]
//                                InitProcessGroup with NAME=VALUE set on rank 1 only (a wrong
//                                token, another timeout...); prints "INIT_ERROR rank r: <status>"
//                                and exits kInitErrorExit if it fails, "OK" and 0 otherwise
//   collectives_mp hosts         across test hosts (tests/scripts/multihost_test.py):
//   InitProcessGroup,
//                                every op x dtype at odd counts, splits, then the ProcessMesh whose
//                                shard group is the host (RanksPerHost): shard groups within one
//                                hostname, replicate groups across, the hybrid gradient path
//   collectives_mp crossing      known large collectives (f32, checked) whose cross-host bytes
//                                the test bounds from below with the veth counters
//   collectives_mp cut           all-reduces in a loop ("LOOPING rank r" after the first) until one
//                                fails (the test cuts a link); prints "FAILED rank r: <status>",
//                                shuts down, exits kSurvivorExit
//   collectives_mp pause         checked collectives for SL_MP_RUN_S seconds (rank 0 decides when
//                                to stop); prints the longest iteration (the test pauses a rank)
//   collectives_mp store_dies    rank 0 (the store's host) SIGKILLs itself; the others, creating a
//                                communicator through the store, must fail naming the store
//   collectives_mp shrink        the last rank SIGKILLs itself during a large all-reduce; the
//                                survivors see the error, Shrink the world without it and run
//                                every collective on the shrunk communicator (checked)
//   collectives_mp register      RegisterMemory on the communicator's host allocator's memory
//                                (shareable) and on private memory: the reported path (mapped /
//                                process_read; both transport with SHARDLINE_UCX_CMA=0, both
//                                process_read with SHARDLINE_UCX_MAP=0), an all-gather and a
//                                reduce-scatter from each, every element checked; then the
//                                shareable input is freed while the peers map it and the arena's
//                                resident bytes must drop by its size. Prints "OK register rank r
//                                path <name>"
//   collectives_mp p2p           Send / Recv: a ring of hashed messages of odd sizes (up to 16 MiB
//                                + 3 bytes) with sends first on one stream, then receives first;
//                                every rank's message received from any source on rank 0; every
//                                byte checked
//   collectives_mp p2p_kill      rank 1 SIGKILLs itself while every other rank waits for its
//                                message; survivors fail within the deadline (as kill)
//   collectives_mp bench         ad-hoc timings on rank 0 and each rank's memcpy reference
//                                (SL_BENCH_HUGE=1: buffers on transparent huge pages)
//
// Prints "OK <scenario> rank <r>" on success; failures print the reason and exit 1.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "collectives/bootstrap.h"
#include "collectives/process_mesh.h"
#include "collectives/store/tcp_store.h"
#include "collectives/ucx/ucx_communicator.h"
#include "runtime/allocator.h"
#include "runtime/shared_memory.h"
#include "runtime/stream.h"
#include "testing/typed_values.h"
#include "tests/common/hashed_bytes.h"

namespace shardline {
namespace {

using testing::GetElement;
using testing::HashedBytes;
using testing::PatternBuffer;
using testing::PatternReductionFits;
using testing::PatternValue;
using testing::ReferenceReduce;
using testing::SetElement;
using testing::Tolerance;

constexpr int kSurvivorExit = 3;
constexpr int kInitErrorExit = 4;

int g_rank = 0;
int g_size = 1;

// SHARDLINE_MP_MEMORY=shareable: the collectives' buffers are shareable memory
// (runtime/shared_memory.h), which local peers map and copy from; otherwise private memory,
// which they read with process_vm_readv.
bool UseShareable() {
  static const bool shareable = [] {
    const char* v = std::getenv("SHARDLINE_MP_MEMORY");
    return v != nullptr && std::string(v) == "shareable";
  }();
  return shareable;
}

template <typename T>
struct TestMemory {
  using value_type = T;
  TestMemory() = default;
  template <typename U>
  TestMemory(const TestMemory<U>& /*other*/) {}
  T* allocate(size_t n) {
    if (UseShareable() && n * sizeof(T) >= 4096) {
      absl::StatusOr<void*> p = AllocateShareable(n * sizeof(T));
      if (!p.ok()) {
        std::fprintf(stderr, "FAIL rank %d: %s\n", g_rank, p.status().ToString().c_str());
        std::exit(1);
      }
      return static_cast<T*>(*p);
    }
    return std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, size_t n) {
    // Private memory is never inside a shareable arena.
    if (FindShareable(p, 1).has_value()) return FreeShareable(p, n * sizeof(T));
    std::allocator<T>().deallocate(p, n);
  }
  bool operator==(const TestMemory& /*other*/) const { return true; }
};
using Bytes = std::vector<uint8_t, TestMemory<uint8_t>>;
Bytes ToMemory(const std::vector<uint8_t>& v) { return Bytes(v.begin(), v.end()); }

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "FAIL rank %d: %s\n", g_rank, what.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

int EnvInt(const char* name) {
  const char* v = std::getenv(name);
  int out = 0;
  if (v == nullptr || !absl::SimpleAtoi(v, &out)) Fail(absl::StrCat("bad or missing ", name));
  return out;
}

struct World {
  std::shared_ptr<Store> store;
  std::shared_ptr<Communicator> comm;
  std::unique_ptr<Stream> stream;
};

World Join(absl::Duration timeout) {
  g_rank = EnvInt("RANK");
  g_size = EnvInt("WORLD_SIZE");
  const char* addr = std::getenv("MASTER_ADDR");
  TcpStoreOptions options;
  options.host = addr != nullptr ? addr : "127.0.0.1";
  options.port = EnvInt("MASTER_PORT");
  options.rank = g_rank;
  options.timeout = timeout;
  absl::StatusOr<std::unique_ptr<TcpStore>> store =
      TcpStore::Create(options, /*is_server=*/g_rank == 0, absl::Now() + timeout);
  if (!store.ok()) Fail(absl::StrCat("store: ", store.status().ToString()));
  World world;
  world.store = std::shared_ptr<Store>(std::move(*store));
  absl::StatusOr<std::shared_ptr<Communicator>> comm = CreateUcxCommunicator(
      {.rank = g_rank, .size = g_size, .store = world.store, .timeout = timeout});
  if (!comm.ok()) Fail(absl::StrCat("create: ", comm.status().ToString()));
  world.comm = *comm;
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream({.name = "mp"});
  if (!stream.ok()) Fail(stream.status().ToString());
  world.stream = std::move(*stream);
  return world;
}

absl::Status WaitFor(const absl::StatusOr<Work>& work) {
  if (!work.ok()) return work.status();
  return work->Wait(absl::Now() + absl::Seconds(120));
}

void Expect(bool ok, const std::string& what) {
  if (!ok) Fail(what);
}

void ExpectOk(const absl::Status& status, const std::string& what) {
  if (!status.ok()) Fail(absl::StrCat(what, ": ", status.ToString()));
}

// Checks every `stride`-th element (all of them for small counts).
size_t Stride(size_t count) { return count > 100000 ? 101 : 1; }

void CheckAllKinds(Communicator& comm, Stream& stream, const std::vector<size_t>& counts,
                   bool big_subset) {
  const int n = comm.size();
  const int r = comm.rank();
  for (size_t count : counts) {
    const bool big = count > 100000;
    for (DType dtype : kAllDTypes) {
      if (big && big_subset && dtype != DType::kF32 && dtype != DType::kBF16 &&
          dtype != DType::kI64 && dtype != DType::kU8) {
        continue;
      }
      const size_t e = DTypeSize(dtype);
      const std::string tag = absl::StrCat(DTypeName(dtype), " count ", count);
      // all_gather, in and out of place.
      for (bool in_place : {false, true}) {
        Bytes input = ToMemory(PatternBuffer(dtype, r, count));
        Bytes output(n * count * e, 0xAB);
        const void* in = input.data();
        if (in_place) {
          std::copy(input.begin(), input.end(), output.begin() + r * count * e);
          in = output.data() + r * count * e;
        }
        ExpectOk(WaitFor(comm.AllGather(in, output.data(), count, dtype, stream)),
                 "all_gather " + tag);
        for (int s = 0; s < n; ++s) {
          for (size_t i = 0; i < count; i += Stride(count)) {
            Expect(GetElement(dtype, output.data(), s * count + i) == PatternValue(dtype, s, i),
                   absl::StrCat("all_gather ", tag, " wrong at ", s, ":", i));
          }
        }
      }
      // broadcast from the last rank, all_to_all (smaller: count per peer).
      {
        const int root = n - 1;
        Bytes buffer = ToMemory(PatternBuffer(dtype, r, count, /*salt=*/3));
        ExpectOk(WaitFor(comm.Broadcast(buffer.data(), count, dtype, stream, {.root = root})),
                 "broadcast " + tag);
        for (size_t i = 0; i < count; i += Stride(count)) {
          Expect(GetElement(dtype, buffer.data(), i) == PatternValue(dtype, root, i, 3),
                 "broadcast " + tag);
        }
        const size_t per = big ? count / n : count;
        Bytes input = ToMemory(PatternBuffer(dtype, r, n * per));
        Bytes output(input.size());
        ExpectOk(WaitFor(comm.AllToAll(input.data(), output.data(), per, dtype, stream)),
                 "all_to_all " + tag);
        for (int s = 0; s < n; ++s) {
          for (size_t i = 0; i < per; i += Stride(per)) {
            Expect(GetElement(dtype, output.data(), s * per + i) ==
                       PatternValue(dtype, s, r * per + i),
                   "all_to_all " + tag);
          }
        }
      }
      if (dtype == DType::kU8 || dtype == DType::kI8) continue;
      for (ReduceOp op : kAllReduceOps) {
        if (big && big_subset && op != ReduceOp::kSum && op != ReduceOp::kAvg) continue;
        if (!PatternReductionFits(dtype, op, n)) continue;
        const std::string rtag = absl::StrCat(tag, " ", ReduceOpName(op));
        for (bool in_place : {false, true}) {
          Bytes input = ToMemory(PatternBuffer(dtype, r, n * count));
          Bytes separate(count * e);
          void* out = in_place ? input.data() + r * count * e : separate.data();
          ExpectOk(WaitFor(comm.ReduceScatter(input.data(), out, count, dtype, stream, {.op = op})),
                   "reduce_scatter " + rtag);
          for (size_t i = 0; i < count; i += Stride(count)) {
            const double want = ReferenceReduce(dtype, op, n, r * count + i);
            Expect(std::abs(GetElement(dtype, out, i) - want) <= Tolerance(dtype, op, want),
                   absl::StrCat("reduce_scatter ", rtag, " wrong at ", i));
          }
          Bytes all = ToMemory(PatternBuffer(dtype, r, count, /*salt=*/1));
          Bytes all_out(all.size());
          void* aout = in_place ? all.data() : all_out.data();
          ExpectOk(WaitFor(comm.AllReduce(all.data(), aout, count, dtype, stream, {.op = op})),
                   "all_reduce " + rtag);
          for (size_t i = 0; i < count; i += Stride(count)) {
            const double want = ReferenceReduce(dtype, op, n, i, /*salt=*/1);
            Expect(std::abs(GetElement(dtype, aout, i) - want) <= Tolerance(dtype, op, want),
                   absl::StrCat("all_reduce ", rtag, " wrong at ", i));
          }
        }
      }
    }
  }
  ExpectOk(WaitFor(comm.Barrier(stream)), "barrier");
}

void CheckSplit(World& w) {
  const int r = g_rank;
  const int n = g_size;
  // Odd and even ranks, reversed; the subgroup runs next to the world.
  const int color = r % 2;
  absl::StatusOr<std::shared_ptr<Communicator>> sub =
      w.comm->Split(color, -r, absl::Now() + absl::Seconds(60));
  ExpectOk(sub.status(), "split");
  std::vector<int> members;
  for (int s = n - 1; s >= 0; --s) {
    if (s % 2 == color) members.push_back(s);
  }
  Expect((*sub)->size() == static_cast<int>(members.size()), "split size");
  int32_t mine = r;
  std::vector<int32_t> got(members.size());
  ExpectOk(WaitFor((*sub)->AllGather(&mine, got.data(), 1, DType::kI32, *w.stream)),
           "split all_gather");
  Expect(got == std::vector<int32_t>(members.begin(), members.end()), "split membership");
  CheckAllKinds(**sub, *w.stream, {7, 4097}, true);
  ExpectOk(WaitFor(w.comm->Barrier(*w.stream)), "world barrier after split");
}

int Correctness() {
  World w = Join(absl::Seconds(60));
  CheckAllKinds(*w.comm, *w.stream, {0, 1, 7, 4097, 8192, 8193, (1 << 20) + 3}, true);
  CheckSplit(w);
  std::printf("OK correctness rank %d\n", g_rank);
  return 0;
}

int Quick() {
  World w = Join(absl::Seconds(60));
  CheckAllKinds(*w.comm, *w.stream, {1, 4097, 300000}, true);
  std::printf("OK quick rank %d\n", g_rank);
  return 0;
}

// A float from a hash of (rank, i, salt), a multiple of 1/1024 below 2^12 in magnitude, so that
// sums over a few ranks are exact in any order.
float RegisterValue(int rank, size_t i, int salt) {
  uint64_t x = (uint64_t(rank) << 48) ^ (uint64_t(salt) << 40) ^ i;
  x += 0x9e3779b97f4a7c15;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9;
  x = (x ^ (x >> 27)) * 0x94d049bb133111eb;
  x ^= x >> 31;
  return static_cast<float>(static_cast<int64_t>(x >> 42) - (int64_t{1} << 21)) / 1024.0f;
}

// All-gather of `count` floats per rank from `input` and sum reduce-scatter of `count` per rank
// from `input2`, every element checked.
void GatherAndReduceScatter(World& w, float* input, float* output, float* input2, float* shard,
                            size_t count, int salt, const std::string& what) {
  const int n = g_size;
  for (size_t i = 0; i < count; ++i) input[i] = RegisterValue(g_rank, i, salt);
  for (size_t i = 0; i < n * count; ++i) input2[i] = RegisterValue(g_rank, i, salt + 1);
  ExpectOk(WaitFor(w.comm->AllGather(input, output, count, DType::kF32, *w.stream)),
           what + ": all_gather");
  for (int s = 0; s < n; ++s) {
    for (size_t i = 0; i < count; ++i) {
      Expect(output[s * count + i] == RegisterValue(s, i, salt),
             absl::StrCat(what, ": all_gather element ", i, " from rank ", s));
    }
  }
  ExpectOk(WaitFor(w.comm->ReduceScatter(input2, shard, count, DType::kF32, *w.stream)),
           what + ": reduce_scatter");
  for (size_t i = 0; i < count; ++i) {
    float sum = 0;
    for (int s = 0; s < n; ++s) sum += RegisterValue(s, g_rank * count + i, salt + 1);
    Expect(shard[i] == sum, absl::StrCat(what, ": reduce_scatter element ", i));
  }
}

int Register() {
  World w = Join(absl::Seconds(60));
  const int n = g_size;
  const size_t count = 300007;  // 1.2 MB per rank: shareable, and the single-copy protocol
  const char* cma = std::getenv("SHARDLINE_UCX_CMA");
  const char* map = std::getenv("SHARDLINE_UCX_MAP");
  const bool no_cma = cma != nullptr && std::string(cma) == "0";
  const bool no_map = map != nullptr && std::string(map) == "0";
  const TransferPath want_shareable = no_cma   ? TransferPath::kTransport
                                      : no_map ? TransferPath::kProcessRead
                                               : TransferPath::kMapped;
  const TransferPath want_private = no_cma ? TransferPath::kTransport : TransferPath::kProcessRead;

  std::unique_ptr<Allocator> host = w.comm->CreateHostAllocatorForTransfers(64, "register");
  auto make = [&](size_t floats) {
    absl::StatusOr<Buffer> b = host->Allocate(floats * 4);
    ExpectOk(b.status(), "allocate");
    return *std::move(b);
  };
  Buffer input = make(count), output = make(n * count), input2 = make(n * count),
         shard = make(count);
  Expect(FindShareable(input.data(), input.size()).has_value() == (!no_cma && !no_map),
         "the communicator's host memory is shareable exactly when peers map it");
  {
    absl::StatusOr<Registration> reg = w.comm->RegisterMemory(input.data(), input.size());
    absl::StatusOr<Registration> reg2 = w.comm->RegisterMemory(input2.data(), input2.size());
    ExpectOk(reg.status(), "register shareable");
    ExpectOk(reg2.status(), "register shareable 2");
    Expect(reg->path() == want_shareable,
           absl::StrCat("shareable memory registered as ", TransferPathName(reg->path()),
                        ", expected ", TransferPathName(want_shareable)));
    GatherAndReduceScatter(w, input.as<float>(), output.as<float>(), input2.as<float>(),
                           shard.as<float>(), count, 10, "shareable");
  }
  {
    std::vector<float> p_input(count), p_output(n * count), p_input2(n * count), p_shard(count);
    absl::StatusOr<Registration> reg = w.comm->RegisterMemory(p_input.data(), count * 4);
    ExpectOk(reg.status(), "register private");
    Expect(reg->path() == want_private,
           absl::StrCat("private memory registered as ", TransferPathName(reg->path()),
                        ", expected ", TransferPathName(want_private)));
    Expect(w.comm->live_registrations() == 1, "registrations left behind");
    GatherAndReduceScatter(w, p_input.data(), p_output.data(), p_input2.data(), p_shard.data(),
                           count, 20, "private");
  }
  Expect(w.comm->live_registrations() == 0, "registrations left behind");
  if (!no_cma && !no_map) {
    // The peers map this rank's arena now (and keep the mapping): freeing the input must still
    // return its pages. Every rank reads first, then frees.
    ExpectOk(WaitFor(w.comm->Barrier(*w.stream)), "barrier");
    const ShareableArenaStats before = GetShareableArenaStats();
    const int64_t bytes = static_cast<int64_t>(input.size() + input2.size());
    input.Reset();
    input2.Reset();
    const ShareableArenaStats after = GetShareableArenaStats();
    Expect(after.resident_bytes <= before.resident_bytes - bytes,
           absl::StrCat("freed blocks mapped by peers stayed resident: ", before.resident_bytes,
                        " -> ", after.resident_bytes, " bytes after freeing ", bytes));
    Expect(host->stats().current_bytes == static_cast<int64_t>(output.size() + shard.size()),
           "allocator counters");
    ExpectOk(WaitFor(w.comm->Barrier(*w.stream)), "barrier");
  }
  std::printf("OK register rank %d path %s\n", g_rank,
              std::string(TransferPathName(want_shareable)).c_str());
  return 0;
}

int Mismatch() {
  World w = Join(absl::Seconds(30));
  const int last = g_size - 1;
  {
    const size_t count = g_rank == last ? 8 : 7;
    std::vector<float> in(8), out(8 * g_size, -1.0f);
    absl::Status s =
        WaitFor(w.comm->AllGather(in.data(), out.data(), count, DType::kF32, *w.stream));
    const std::string want = absl::StrCat("rank 0 called all_gather(count=7, f32) but rank ", last,
                                          " called all_gather(count=8, f32)");
    Expect(s.code() == absl::StatusCode::kInvalidArgument && absl::StrContains(s.message(), want),
           absl::StrCat("expected the count mismatch, got ", s.ToString()));
    Expect(out[0] == -1.0f, "output written despite the mismatch");
  }
  // The communicator is aborted now; a fresh one for the dtype mismatch.
  absl::StatusOr<std::shared_ptr<Communicator>> second =
      CreateUcxCommunicator({.rank = g_rank,
                             .size = g_size,
                             .store = w.store,
                             .name = "second",
                             .timeout = absl::Seconds(30)});
  ExpectOk(second.status(), "second communicator");
  // The failed collective poisoned the stream too: a fresh one.
  absl::StatusOr<std::unique_ptr<Stream>> fresh = CreateHostStream({.name = "mp2"});
  ExpectOk(fresh.status(), "stream");
  w.stream = std::move(*fresh);
  {
    const DType dtype = g_rank == last ? DType::kI32 : DType::kF32;
    std::vector<float> buffer(200000, 1.0f);  // large: the zero-copy path
    absl::Status s = WaitFor(
        (*second)->AllReduce(buffer.data(), buffer.data(), buffer.size(), dtype, *w.stream));
    const std::string want =
        absl::StrCat("but rank ", last, " called all_reduce(count=200000, i32");
    Expect(s.code() == absl::StatusCode::kInvalidArgument && absl::StrContains(s.message(), want),
           absl::StrCat("expected the dtype mismatch, got ", s.ToString()));
    Expect(buffer[0] == 1.0f && buffer.back() == 1.0f, "buffer written despite the mismatch");
  }
  // The last rank's payload is one element past SHARDLINE_UCX_SMALL_BYTES (32 KiB), the others'
  // exactly at it: the last rank takes the large protocol and sends a bare fingerprint, the
  // others send theirs with 32 KiB attached. Every rank must still see a mismatch (no truncated
  // message, no length error).
  absl::StatusOr<std::shared_ptr<Communicator>> third =
      CreateUcxCommunicator({.rank = g_rank,
                             .size = g_size,
                             .store = w.store,
                             .name = "third",
                             .timeout = absl::Seconds(30)});
  ExpectOk(third.status(), "third communicator");
  fresh = CreateHostStream({.name = "mp3"});
  ExpectOk(fresh.status(), "stream");
  w.stream = std::move(*fresh);
  {
    const size_t count = g_rank == last ? 8193 : 8192;
    std::vector<float> in(8193, 2.0f), out(8193, -1.0f);
    absl::Status s =
        WaitFor((*third)->AllReduce(in.data(), out.data(), count, DType::kF32, *w.stream));
    const std::string want =
        absl::StrCat("rank 0 called all_reduce(count=8192, f32, sum) but rank ", last,
                     " called all_reduce(count=8193, f32, sum)");
    Expect(s.code() == absl::StatusCode::kInvalidArgument && absl::StrContains(s.message(), want),
           absl::StrCat("expected the protocol mismatch, got ", s.ToString()));
    Expect(out[0] == -1.0f && out.back() == -1.0f, "output written despite the mismatch");
  }
  std::printf("OK mismatch rank %d\n", g_rank);
  return 0;
}

// A survivor of a killed rank: reports its error and how long it took to come (at most the
// deadline + 5 s), shuts its world down, and returns kSurvivorExit (the exit code).
int SurvivorShutsDown(World& w, const absl::Status& status, absl::Duration took,
                      absl::Duration timeout) {
  std::printf("SURVIVOR rank %d failed after %.2f s: %s\n", g_rank, absl::ToDoubleSeconds(took),
              status.ToString().c_str());
  Expect(took < timeout + absl::Seconds(5), "survivor took longer than the deadline");
  std::fflush(stdout);
  const absl::Time shutdown = absl::Now();
  w.stream.reset();
  w.comm.reset();
  w.store.reset();
  std::printf("SHUTDOWN rank %d in %.2f s\n", g_rank,
              absl::ToDoubleSeconds(absl::Now() - shutdown));
  std::fflush(stdout);
  return kSurvivorExit;
}

int Kill() {
  const absl::Duration timeout = absl::Seconds(20);
  World w = Join(timeout);
  ExpectOk(WaitFor(w.comm->Barrier(*w.stream)), "barrier");
  std::vector<float, TestMemory<float>> buffer(8 << 20, 1.0f);
  if (g_rank == 1) {
    // Dies while the collective is in flight on the stream's thread.
    std::thread killer([] {
      absl::SleepFor(absl::Milliseconds(20));
      raise(SIGKILL);
    });
    killer.detach();
  }
  const absl::Time start = absl::Now();
  absl::Status status;
  for (int i = 0; i < 1000 && status.ok(); ++i) {
    status = WaitFor(
        w.comm->AllReduce(buffer.data(), buffer.data(), buffer.size(), DType::kF32, *w.stream));
  }
  const absl::Duration took = absl::Now() - start;
  if (g_rank == 1) Fail("rank 1 survived its own SIGKILL");
  if (status.ok()) Fail("survivor finished 1000 all_reduces without noticing rank 1's death");
  return SurvivorShutsDown(w, status, took, timeout);
}

int Skipped() {
  World w = Join(absl::Seconds(600));  // SHARDLINE_TIMEOUT_S's default: nobody may wait for it
  std::vector<float> buffer(1 << 16, 1.0f);
  const absl::Time start = absl::Now();
  // A rank still finishing the barrier when rank 1 aborts fails the barrier with rank 1's error
  // (rank 1 and the others are past it): the same error, one collective earlier.
  absl::Status status = WaitFor(w.comm->Barrier(*w.stream));
  if (!status.ok()) {
    Expect(g_rank != 1, absl::StrCat("barrier: ", status.ToString()));
  } else if (g_rank == 1) {
    // The framework's work ahead of the collective fails once the collective is enqueued.
    std::mutex mu;
    std::condition_variable cv;
    bool issued = false;
    ExpectOk(w.stream->Enqueue([&]() -> absl::Status {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, std::chrono::seconds(30), [&] { return issued; });
      return absl::InternalError("the framework's kernel failed");
    }),
             "enqueue");
    absl::StatusOr<Work> work =
        w.comm->AllReduce(buffer.data(), buffer.data(), buffer.size(), DType::kF32, *w.stream);
    {
      std::lock_guard<std::mutex> lock(mu);
      issued = true;
    }
    cv.notify_all();
    status = WaitFor(work);
  } else {
    status = WaitFor(
        w.comm->AllReduce(buffer.data(), buffer.data(), buffer.size(), DType::kF32, *w.stream));
  }
  const absl::Duration took = absl::Now() - start;
  Expect(!status.ok(), "the collective succeeded although rank 1 never ran it");
  if (g_rank != 1) {
    Expect(absl::StrContains(status.message(), "all_reduce #1") &&
               absl::StrContains(status.message(), "never ran"),
           absl::StrCat("the error does not name the skipped collective: ", status.ToString()));
  }
  std::printf("SKIPPED rank %d failed after %.3f s: %s\n", g_rank, absl::ToDoubleSeconds(took),
              status.ToString().c_str());
  std::printf("OK skipped rank %d\n", g_rank);
  return 0;
}

// The 2 x 2 mesh of hybrid sharding: parameters sharded over the row, gradients reduced over
// the row and then all-reduced over the column, against plain-loop sums over all four ranks.
void CheckMesh(const std::shared_ptr<Communicator>& world, Stream& stream) {
  absl::StatusOr<ProcessMesh> mesh =
      ProcessMesh::Create(world, /*shard_size=*/2, absl::Now() + absl::Seconds(60));
  ExpectOk(mesh.status(), "mesh");
  const int r = world->rank();
  Expect(mesh->shard_rank() == r % 2 && mesh->replicate_rank() == r / 2,
         absl::StrCat("mesh coordinates of rank ", r, ": shard ", mesh->shard_rank(),
                      ", replicate ", mesh->replicate_rank()));
  const DType f32 = DType::kF32;
  const size_t k = 100003;  // per shard: the large, pipelined path with a ragged last chunk
  const int s = mesh->shard_rank();
  // Parameters: the same full vector on every row; this rank holds shard s.
  std::vector<uint8_t> full(2 * k * 4, 0);
  for (size_t i = 0; i < k; ++i) {
    SetElement(f32, full.data(), s * k + i, PatternValue(f32, 0, s * k + i, /*salt=*/5));
  }
  ExpectOk(WaitFor(mesh->shard()->AllGather(full.data() + s * k * 4, full.data(), k, f32, stream)),
           "mesh shard all_gather");
  for (size_t i = 0; i < 2 * k; i += 7) {
    Expect(GetElement(f32, full.data(), i) == PatternValue(f32, 0, i, 5),
           absl::StrCat("mesh all_gather wrong at ", i));
  }
  // Gradients: reduce-scatter over the row, all-reduce of the shard over the column.
  std::vector<uint8_t> grad = PatternBuffer(f32, r, 2 * k, /*salt=*/7);
  std::vector<uint8_t> shard(k * 4);
  ExpectOk(WaitFor(mesh->shard()->ReduceScatter(grad.data(), shard.data(), k, f32, stream)),
           "mesh shard reduce_scatter");
  ExpectOk(WaitFor(mesh->replicate()->AllReduce(shard.data(), shard.data(), k, f32, stream)),
           "mesh replicate all_reduce");
  for (size_t i = 0; i < k; i += 7) {
    double want = 0;
    for (int rank = 0; rank < 4; ++rank) want += PatternValue(f32, rank, s * k + i, 7);
    Expect(GetElement(f32, shard.data(), i) == want, absl::StrCat("mesh gradient wrong at ", i));
  }
}

int InitScenario() {
  absl::StatusOr<ProcessGroup> group = InitProcessGroup();
  if (!group.ok()) Fail(absl::StrCat("InitProcessGroup: ", group.status().ToString()));
  g_rank = group->launch.rank;
  g_size = group->launch.world_size;
  Expect(group->world->size() == g_size && group->world->rank() == g_rank &&
             group->world->backend() == "ucx",
         "world communicator does not match the launch environment");
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream({.name = "mp"});
  ExpectOk(stream.status(), "stream");
  World w{group->store, group->world, std::move(*stream)};
  CheckAllKinds(*w.comm, *w.stream, {1, 4097, 300000}, true);
  CheckSplit(w);
  if (g_size == 4) CheckMesh(w.comm, *w.stream);
  ExpectOk(WaitFor(w.comm->Barrier(*w.stream)), "final barrier");
  std::printf("OK init rank %d\n", g_rank);
  return 0;
}

int InitError(const char* assignment) {
  g_rank = EnvInt("RANK");
  if (assignment != nullptr && g_rank == 1) {
    const std::string text = assignment;
    const size_t eq = text.find('=');
    if (eq == std::string::npos) Fail(absl::StrCat("expected NAME=VALUE, got ", text));
    setenv(text.substr(0, eq).c_str(), text.substr(eq + 1).c_str(), 1);
  }
  absl::StatusOr<ProcessGroup> group = InitProcessGroup();
  if (!group.ok()) {
    std::printf("INIT_ERROR rank %d: %s\n", g_rank, group.status().ToString().c_str());
    std::fflush(stdout);
    return kInitErrorExit;
  }
  std::printf("OK init_error rank %d\n", g_rank);
  return 0;
}

// Opens raw connections to the store and writes garbage, truncated and oversized frames.
void Flood(const std::string& host, int port, std::atomic<bool>* stop, int* sent) {
  uint32_t seed = 12345;
  while (!stop->load()) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) break;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, host.c_str(), &addr.sin_addr);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      std::vector<uint8_t> junk(1 + seed % 4096);
      for (uint8_t& b : junk) {
        seed = seed * 1103515245 + 12345;
        b = static_cast<uint8_t>(seed >> 16);
      }
      if (seed % 3 == 0) std::memset(junk.data(), 0xFF, std::min<size_t>(junk.size(), 16));
      (void)!send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
      ++*sent;
    }
    close(fd);
    absl::SleepFor(absl::Milliseconds(2));
  }
}

int FloodScenario() {
  World w = Join(absl::Seconds(60));
  std::atomic<bool> stop{false};
  int sent = 0;
  std::thread flooder;
  if (g_rank == 0) {
    const char* addr = std::getenv("MASTER_ADDR");
    flooder = std::thread(Flood, addr != nullptr ? addr : "127.0.0.1", EnvInt("MASTER_PORT"), &stop,
                          &sent);
  }
  CheckAllKinds(*w.comm, *w.stream, {7, 4097}, true);
  CheckSplit(w);  // uses the store while it is flooded
  stop = true;
  if (flooder.joinable()) flooder.join();
  if (g_rank == 0) Expect(sent > 0, "the flood never connected");
  std::printf("OK flood rank %d (%d garbage connections)\n", g_rank, sent);
  return 0;
}

// Every rank's hostname (an all-gather of fixed-size names over `comm`).
std::vector<std::string> Hostnames(Communicator& comm, Stream& stream) {
  constexpr size_t kBytes = 64;
  std::vector<char> mine(kBytes, '\0'), all(kBytes * comm.size());
  gethostname(mine.data(), kBytes - 1);
  ExpectOk(WaitFor(comm.AllGather(mine.data(), all.data(), kBytes, DType::kU8, stream)),
           "hostname all_gather");
  std::vector<std::string> names;
  for (int r = 0; r < comm.size(); ++r) names.emplace_back(all.data() + r * kBytes);
  return names;
}

// The mesh of hybrid sharding with the shard group = the host: RanksPerHost from the hostnames,
// then shard groups within one host, replicate groups across hosts, and the gradient path
// (reduce-scatter within the host, all-reduce across) against plain-loop sums over all ranks.
void CheckHostMesh(const std::shared_ptr<Communicator>& world, Stream& stream) {
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  absl::StatusOr<int> per_host = RanksPerHost(*world, deadline);
  ExpectOk(per_host.status(), "RanksPerHost");
  absl::StatusOr<ProcessMesh> mesh = ProcessMesh::Create(world, *per_host, deadline);
  ExpectOk(mesh.status(), "mesh");
  const int n = world->size();
  const int r = world->rank();
  const int S = mesh->shard_size();
  const int R = mesh->replicate_size();
  char host[64] = {};
  gethostname(host, sizeof(host) - 1);
  const std::vector<std::string> world_hosts = Hostnames(*world, stream);
  const std::vector<std::string> shard_hosts = Hostnames(*mesh->shard(), stream);
  const std::vector<std::string> replicate_hosts = Hostnames(*mesh->replicate(), stream);
  for (const std::string& h : shard_hosts) {
    Expect(h == host, absl::StrCat("shard group of rank ", r, " spans host ", h, " and ", host));
  }
  for (int i = 0; i < R; ++i) {
    for (int j = i + 1; j < R; ++j) {
      Expect(replicate_hosts[i] != replicate_hosts[j],
             absl::StrCat("replicate group of rank ", r, " has two ranks on ", replicate_hosts[i]));
    }
  }
  int hosts = 0;
  for (int i = 0; i < n; ++i) hosts += (i == 0 || world_hosts[i] != world_hosts[i - 1]) ? 1 : 0;
  Expect(R == hosts && S * R == n,
         absl::StrCat("mesh ", mesh->ToString(), " on ", hosts, " hosts"));
  const DType f32 = DType::kF32;
  const size_t k = 100003;  // per shard: the pipelined path with a ragged last chunk
  const int s = mesh->shard_rank();
  std::vector<uint8_t> full(S * k * 4, 0);
  for (size_t i = 0; i < k; ++i) {
    SetElement(f32, full.data(), s * k + i, PatternValue(f32, 0, s * k + i, /*salt=*/5));
  }
  ExpectOk(WaitFor(mesh->shard()->AllGather(full.data() + s * k * 4, full.data(), k, f32, stream)),
           "host mesh shard all_gather");
  for (size_t i = 0; i < S * k; ++i) {
    Expect(GetElement(f32, full.data(), i) == PatternValue(f32, 0, i, 5),
           absl::StrCat("host mesh all_gather wrong at ", i));
  }
  std::vector<uint8_t> grad = PatternBuffer(f32, r, S * k, /*salt=*/7);
  std::vector<uint8_t> shard(k * 4);
  ExpectOk(WaitFor(mesh->shard()->ReduceScatter(grad.data(), shard.data(), k, f32, stream)),
           "host mesh shard reduce_scatter");
  ExpectOk(WaitFor(mesh->replicate()->AllReduce(shard.data(), shard.data(), k, f32, stream)),
           "host mesh replicate all_reduce");
  for (size_t i = 0; i < k; ++i) {
    double want = 0;
    for (int rank = 0; rank < n; ++rank) want += PatternValue(f32, rank, s * k + i, 7);
    Expect(
        std::abs(GetElement(f32, shard.data(), i) - want) <= 1e-5 * std::max(1.0, std::abs(want)),
        absl::StrCat("host mesh gradient wrong at ", i));
  }
  std::printf("MESH rank %d on %s: %s, shard rank %d, replicate rank %d\n", r, host,
              mesh->ToString().c_str(), mesh->shard_rank(), mesh->replicate_rank());
}

World InitWorld() {
  absl::StatusOr<ProcessGroup> group = InitProcessGroup();
  if (!group.ok()) Fail(absl::StrCat("InitProcessGroup: ", group.status().ToString()));
  g_rank = group->launch.rank;
  g_size = group->launch.world_size;
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream({.name = "mp"});
  ExpectOk(stream.status(), "stream");
  return World{group->store, group->world, std::move(*stream)};
}

int HostsScenario() {
  World w = InitWorld();
  CheckAllKinds(*w.comm, *w.stream, {1, 7, 4097, 300001}, true);
  CheckSplit(w);
  CheckHostMesh(w.comm, *w.stream);
  ExpectOk(WaitFor(w.comm->Barrier(*w.stream)), "final barrier");
  std::printf("OK hosts rank %d\n", g_rank);
  return 0;
}

// Cross-host lower bounds are computed by the test from these sizes: keep them in step with
// tests/scripts/multihost_test.py (CROSSING_COUNT).
int Crossing() {
  World w = InitWorld();
  const int n = g_size;
  const int r = g_rank;
  const DType f32 = DType::kF32;
  const size_t c = (size_t{1} << 20) + 3;
  Bytes in = ToMemory(PatternBuffer(f32, r, c));
  Bytes out(n * c * 4);
  ExpectOk(WaitFor(w.comm->AllGather(in.data(), out.data(), c, f32, *w.stream)), "all_gather");
  for (int s = 0; s < n; ++s) {
    for (size_t i = 0; i < c; i += 13) {
      Expect(GetElement(f32, out.data(), s * c + i) == PatternValue(f32, s, i),
             absl::StrCat("crossing all_gather wrong at ", s, ":", i));
    }
  }
  Bytes rs_in = ToMemory(PatternBuffer(f32, r, n * c, /*salt=*/2));
  Bytes rs_out(c * 4);
  ExpectOk(WaitFor(w.comm->ReduceScatter(rs_in.data(), rs_out.data(), c, f32, *w.stream)),
           "reduce_scatter");
  for (size_t i = 0; i < c; i += 13) {
    const double want = ReferenceReduce(f32, ReduceOp::kSum, n, r * c + i, 2);
    Expect(std::abs(GetElement(f32, rs_out.data(), i) - want) <= Tolerance(f32, ReduceOp::kSum),
           absl::StrCat("crossing reduce_scatter wrong at ", i));
  }
  Bytes ar = ToMemory(PatternBuffer(f32, r, c, /*salt=*/1));
  ExpectOk(WaitFor(w.comm->AllReduce(ar.data(), ar.data(), c, f32, *w.stream)), "all_reduce");
  for (size_t i = 0; i < c; i += 13) {
    const double want = ReferenceReduce(f32, ReduceOp::kSum, n, i, 1);
    Expect(std::abs(GetElement(f32, ar.data(), i) - want) <= Tolerance(f32, ReduceOp::kSum),
           absl::StrCat("crossing all_reduce wrong at ", i));
  }
  Bytes bc = ToMemory(PatternBuffer(f32, r, c, /*salt=*/3));
  ExpectOk(WaitFor(w.comm->Broadcast(bc.data(), c, f32, *w.stream, {.root = n - 1})), "broadcast");
  for (size_t i = 0; i < c; i += 13) {
    Expect(GetElement(f32, bc.data(), i) == PatternValue(f32, n - 1, i, 3), "crossing broadcast");
  }
  const size_t per = c / n;
  Bytes a2a_in = ToMemory(PatternBuffer(f32, r, n * per));
  Bytes a2a_out(a2a_in.size());
  ExpectOk(WaitFor(w.comm->AllToAll(a2a_in.data(), a2a_out.data(), per, f32, *w.stream)),
           "all_to_all");
  for (int s = 0; s < n; ++s) {
    for (size_t i = 0; i < per; i += 13) {
      Expect(GetElement(f32, a2a_out.data(), s * per + i) == PatternValue(f32, s, r * per + i),
             "crossing all_to_all");
    }
  }
  ExpectOk(WaitFor(w.comm->Barrier(*w.stream)), "barrier");
  std::printf("OK crossing rank %d\n", g_rank);
  return 0;
}

// All-reduces until one fails; the test cuts a host's link meanwhile.
int Cut() {
  World w = InitWorld();
  std::vector<float, TestMemory<float>> buffer(1 << 20, 1.0f);
  const absl::Time start = absl::Now();
  absl::Status status;
  for (int i = 0; status.ok(); ++i) {
    status = WaitFor(
        w.comm->AllReduce(buffer.data(), buffer.data(), buffer.size(), DType::kF32, *w.stream));
    if (i == 0 && status.ok()) {
      std::printf("LOOPING rank %d\n", g_rank);
      std::fflush(stdout);
    }
    if (absl::Now() - start > absl::Seconds(120)) Fail("no collective failed within 120 s");
  }
  std::printf("FAILED rank %d: %s\n", g_rank, status.ToString().c_str());
  std::fflush(stdout);
  const absl::Time shutdown = absl::Now();
  w.stream.reset();
  w.comm.reset();
  w.store.reset();
  std::printf("SHUTDOWN rank %d in %.2f s\n", g_rank,
              absl::ToDoubleSeconds(absl::Now() - shutdown));
  std::fflush(stdout);
  return kSurvivorExit;
}

// Checked collectives for SL_MP_RUN_S seconds of rank 0's clock (it broadcasts whether to go on,
// so every rank runs the same number); the test pauses a rank meanwhile.
int Pause() {
  World w = InitWorld();
  const char* run_s = std::getenv("SL_MP_RUN_S");
  const absl::Duration run = absl::Seconds(run_s != nullptr ? std::atof(run_s) : 8.0);
  const int n = g_size;
  const int r = g_rank;
  const DType f32 = DType::kF32;
  const size_t c = (size_t{1} << 17) + 1;
  const absl::Time start = absl::Now();
  absl::Duration longest;
  int iterations = 0;
  for (;; ++iterations) {
    const absl::Time t0 = absl::Now();
    Bytes ar = ToMemory(PatternBuffer(f32, r, c, /*salt=*/iterations % 7));
    ExpectOk(WaitFor(w.comm->AllReduce(ar.data(), ar.data(), c, f32, *w.stream)), "all_reduce");
    for (size_t i = 0; i < c; ++i) {
      const double want = ReferenceReduce(f32, ReduceOp::kSum, n, i, iterations % 7);
      Expect(std::abs(GetElement(f32, ar.data(), i) - want) <= Tolerance(f32, ReduceOp::kSum),
             absl::StrCat("pause all_reduce #", iterations, " wrong at ", i));
    }
    Bytes in = ToMemory(PatternBuffer(f32, r + iterations, c));
    Bytes out(n * c * 4);
    ExpectOk(WaitFor(w.comm->AllGather(in.data(), out.data(), c, f32, *w.stream)), "all_gather");
    for (int s = 0; s < n; ++s) {
      for (size_t i = 0; i < c; ++i) {
        Expect(GetElement(f32, out.data(), s * c + i) == PatternValue(f32, s + iterations, i),
               absl::StrCat("pause all_gather #", iterations, " wrong at ", s, ":", i));
      }
    }
    int32_t go = absl::Now() - start < run ? 1 : 0;
    ExpectOk(WaitFor(w.comm->Broadcast(&go, 1, DType::kI32, *w.stream, {.root = 0})), "go");
    longest = std::max(longest, absl::Now() - t0);
    if (iterations == 0) {
      std::printf("LOOPING rank %d\n", r);
      std::fflush(stdout);
    }
    if (go == 0) break;
  }
  std::printf("OK pause rank %d: %d iterations, longest %.2f s\n", r, iterations + 1,
              absl::ToDoubleSeconds(longest));
  return 0;
}

// Rank 0 hosts the store and dies; the others then create a communicator through the store.
int StoreDies() {
  World w = InitWorld();
  ExpectOk(WaitFor(w.comm->Barrier(*w.stream)), "barrier");
  absl::Duration timeout = absl::Seconds(EnvInt("SHARDLINE_TIMEOUT_S"));
  // Rank 0 dies only once every peer is past the barrier: its last barrier message to a peer on
  // another host may still be in flight when its own barrier returns, and that peer would then
  // fail the barrier (the peer unreachable) before it ever reached the store.
  if (g_rank != 0) ExpectOk(w.store->Set(absl::StrCat("past_barrier/", g_rank), "1"), "set");
  if (g_rank == 0) {
    std::vector<std::string> keys;
    for (int r = 1; r < g_size; ++r) keys.push_back(absl::StrCat("past_barrier/", r));
    ExpectOk(w.store->Wait(keys, absl::Now() + timeout), "wait for the peers");
    std::fflush(stdout);
    raise(SIGKILL);
  }
  // Rank 0 may still be alive for a moment: keep creating until the store is gone.
  const absl::Time start = absl::Now();
  absl::Status status;
  for (int i = 0; status.ok(); ++i) {
    status = CreateUcxCommunicator({.rank = g_rank,
                                    .size = g_size,
                                    .store = w.store,
                                    .name = absl::StrCat("after", i),
                                    .timeout = timeout})
                 .status();
  }
  const absl::Duration took = absl::Now() - start;
  std::printf("STORE_ERROR rank %d after %.2f s: %s\n", g_rank, absl::ToDoubleSeconds(took),
              status.ToString().c_str());
  std::fflush(stdout);
  w.stream.reset();
  w.comm.reset();
  w.store.reset();
  return kSurvivorExit;
}

// The last rank dies mid-collective; the survivors shrink the world and carry on.
int ShrinkScenario() {
  World w = InitWorld();
  const int lost = g_size - 1;
  ExpectOk(WaitFor(w.comm->Barrier(*w.stream)), "barrier");
  std::vector<float, TestMemory<float>> buffer(4 << 20, 1.0f);
  if (g_rank == lost) {
    std::thread killer([] {
      absl::SleepFor(absl::Milliseconds(20));
      raise(SIGKILL);
    });
    killer.detach();
  }
  absl::Status status;
  for (int i = 0; i < 1000 && status.ok(); ++i) {
    status = WaitFor(
        w.comm->AllReduce(buffer.data(), buffer.data(), buffer.size(), DType::kF32, *w.stream));
  }
  if (g_rank == lost) Fail("the lost rank survived its own SIGKILL");
  Expect(!status.ok(), "1000 all_reduces passed although a rank died");
  std::printf("LOST rank %d saw: %s\n", g_rank, status.ToString().c_str());
  const absl::Time start = absl::Now();
  absl::StatusOr<std::shared_ptr<Communicator>> small =
      w.comm->Shrink({lost}, absl::Now() + absl::Seconds(60));
  ExpectOk(small.status(), "shrink");
  Expect((*small)->size() == g_size - 1 && (*small)->rank() == g_rank, "shrunk rank and size");
  std::printf("SHRUNK rank %d in %.2f s: %s, rank %d of %d\n", g_rank,
              absl::ToDoubleSeconds(absl::Now() - start), (*small)->name().c_str(),
              (*small)->rank(), (*small)->size());
  // The stream ran the failed collective: poisoned. A fresh one.
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream({.name = "after_shrink"});
  ExpectOk(stream.status(), "stream");
  CheckAllKinds(**small, **stream, {1, 7, 4097, 300001}, true);
  std::printf("OK shrink rank %d\n", g_rank);
  std::fflush(stdout);
  return 0;
}

void ExpectBytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                 const std::string& what) {
  Expect(got.size() == want.size(), absl::StrCat(what, ": size"));
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) Fail(absl::StrCat(what, ": byte ", i, " differs"));
  }
}

int PointToPointScenario() {
  World w = Join(absl::Seconds(60));
  absl::StatusOr<std::unique_ptr<Stream>> other = CreateHostStream({.name = "recv"});
  ExpectOk(other.status(), "stream");
  const int to = (g_rank + 1) % g_size, from = (g_rank + g_size - 1) % g_size;
  int message = 0;
  for (bool receive_first : {false, true}) {
    // Sends first: the sends and receives share one stream (a send never waits for its
    // receive). Receives first: on a stream of their own.
    Stream& recv_stream = receive_first ? **other : *w.stream;
    for (size_t bytes :
         {size_t{0}, size_t{1}, size_t{4099}, size_t{1000003}, (size_t{16} << 20) + 3}) {
      const std::string what = absl::StrCat(bytes, " bytes", receive_first ? ", recv first" : "");
      std::vector<uint8_t> out = HashedBytes(g_rank, message, bytes), in(bytes, 0xEE);
      absl::StatusOr<Work> sent, received;
      if (receive_first) {
        received = w.comm->Recv(in.data(), bytes, DType::kU8, from, recv_stream, {.match_tag = 4});
        sent = w.comm->Send(out.data(), bytes, DType::kU8, to, *w.stream, {.match_tag = 4});
      } else {
        sent = w.comm->Send(out.data(), bytes, DType::kU8, to, *w.stream, {.match_tag = 4});
        received = w.comm->Recv(in.data(), bytes, DType::kU8, from, recv_stream, {.match_tag = 4});
      }
      ExpectOk(WaitFor(sent), absl::StrCat("send of ", what));
      ExpectOk(WaitFor(received), absl::StrCat("recv of ", what));
      Expect(received->source() == from, absl::StrCat(what, ": source"));
      ExpectBytes(in, HashedBytes(from, message, bytes), what);
      ++message;
    }
  }
  // Rank 0 receives every other rank's f32 message from any source.
  constexpr size_t kCount = 70001;
  if (g_rank != 0) {
    std::vector<uint8_t> out = HashedBytes(g_rank, 99, kCount * 4);
    ExpectOk(WaitFor(w.comm->Send(out.data(), kCount, DType::kF32, 0, *w.stream)), "send to 0");
  } else {
    std::vector<bool> seen(g_size, false);
    for (int k = 1; k < g_size; ++k) {
      std::vector<uint8_t> in(kCount * 4);
      absl::StatusOr<Work> received =
          w.comm->Recv(in.data(), kCount, DType::kF32, kAnySource, *w.stream);
      ExpectOk(WaitFor(received), "recv from any");
      const int source = received->source();
      Expect(source > 0 && source < g_size && !seen[source], absl::StrCat("source ", source));
      seen[source] = true;
      ExpectBytes(in, HashedBytes(source, 99, kCount * 4), absl::StrCat("from rank ", source));
    }
  }
  ExpectOk(WaitFor(w.comm->Barrier(*w.stream)), "barrier");
  std::printf("OK p2p rank %d\n", g_rank);
  std::fflush(stdout);
  return 0;
}

// Rank 1 dies while every other rank waits in a receive from it.
int PointToPointKill() {
  const absl::Duration timeout = absl::Seconds(20);
  World w = Join(timeout);
  ExpectOk(WaitFor(w.comm->Barrier(*w.stream)), "barrier");
  if (g_rank == 1) {
    absl::SleepFor(absl::Milliseconds(50));
    raise(SIGKILL);
  }
  const absl::Time start = absl::Now();
  std::vector<float> in(1 << 20);
  absl::Status status = WaitFor(w.comm->Recv(in.data(), in.size(), DType::kF32, 1, *w.stream));
  const absl::Duration took = absl::Now() - start;
  if (status.ok()) Fail("a receive from a dead rank succeeded");
  return SurvivorShutsDown(w, status, took, timeout);
}

// Host memory for the benchmark; `huge`: 2 MiB aligned and backed by transparent huge pages
// where the kernel allows it (single-copy reads pin the source page by page: far fewer pages).
std::unique_ptr<float, void (*)(void*)> BenchBuffer(size_t count, bool huge) {
  const size_t bytes = (count * sizeof(float) + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  void* p = std::aligned_alloc(2 << 20, bytes);
  if (p == nullptr) Fail("out of memory");
  if (huge) madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 0, bytes);
  return {static_cast<float*>(p), &std::free};
}

// Ad-hoc timing (not a test): prints per-collective times on rank 0, and each rank's memcpy of
// the bytes it receives in a 64 MiB all-gather (the single-copy reference). SL_BENCH_HUGE=1
// backs the buffers with huge pages.
int Bench() {
  World w = Join(absl::Seconds(120));
  const int n = g_size;
  const bool huge = std::getenv("SL_BENCH_HUGE") != nullptr;
  auto time_it = [&](const char* what, size_t bytes, int iters, auto&& issue) {
    for (int i = 0; i < 2; ++i) ExpectOk(WaitFor(issue()), what);
    ExpectOk(WaitFor(w.comm->Barrier(*w.stream)), "barrier");
    const absl::Time start = absl::Now();
    for (int i = 0; i < iters; ++i) ExpectOk(WaitFor(issue()), what);
    const double us = absl::ToDoubleMicroseconds(absl::Now() - start) / iters;
    if (g_rank == 0) {
      std::printf("%-24s %10zu B  %10.1f us  algbw %6.2f GB/s  received/rank %6.2f GB/s\n", what,
                  bytes, us, bytes / us / 1e3, bytes / n * (n - 1) / us / 1e3);
    }
  };
  {
    const size_t bytes = (size_t{64} << 20) / n * (n - 1);
    auto src = BenchBuffer(bytes / 4, huge);
    auto dst = BenchBuffer(bytes / 4, huge);
    ExpectOk(WaitFor(w.comm->Barrier(*w.stream)), "barrier");
    for (int i = 0; i < 2; ++i) std::memcpy(dst.get(), src.get(), bytes);
    const absl::Time start = absl::Now();
    for (int i = 0; i < 10; ++i) std::memcpy(dst.get(), src.get(), bytes);
    const double us = absl::ToDoubleMicroseconds(absl::Now() - start) / 10;
    std::printf("rank %d memcpy %zu B %10.1f us  %6.2f GB/s\n", g_rank, bytes, us,
                bytes / us / 1e3);
  }
  for (size_t bytes : {size_t{8} << 10, size_t{16} << 20, size_t{64} << 20}) {
    const int iters = bytes < (1 << 20) ? 2000 : 5;
    const size_t count = bytes / 4;
    auto big = BenchBuffer(count, huge);
    auto out = BenchBuffer(count, huge);
    time_it("all_gather in-place", bytes, iters, [&] {
      return w.comm->AllGather(big.get() + g_rank * (count / n), big.get(), count / n, DType::kF32,
                               *w.stream);
    });
    time_it("reduce_scatter", bytes, iters, [&] {
      return w.comm->ReduceScatter(big.get(), out.get(), count / n, DType::kF32, *w.stream);
    });
    time_it("all_reduce", bytes, iters,
            [&] { return w.comm->AllReduce(big.get(), out.get(), count, DType::kF32, *w.stream); });
  }
  return 0;
}

}  // namespace
}  // namespace shardline

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "correctness";
  if (scenario == "correctness") return shardline::Correctness();
  if (scenario == "quick") return shardline::Quick();
  if (scenario == "mismatch") return shardline::Mismatch();
  if (scenario == "kill") return shardline::Kill();
  if (scenario == "flood") return shardline::FloodScenario();
  if (scenario == "skipped") return shardline::Skipped();
  if (scenario == "bench") return shardline::Bench();
  if (scenario == "p2p") return shardline::PointToPointScenario();
  if (scenario == "p2p_kill") return shardline::PointToPointKill();
  if (scenario == "register") return shardline::Register();
  if (scenario == "hosts") return shardline::HostsScenario();
  if (scenario == "crossing") return shardline::Crossing();
  if (scenario == "cut") return shardline::Cut();
  if (scenario == "pause") return shardline::Pause();
  if (scenario == "store_dies") return shardline::StoreDies();
  if (scenario == "shrink") return shardline::ShrinkScenario();
  if (scenario == "init") return shardline::InitScenario();
  if (scenario == "init_error") return shardline::InitError(argc > 2 ? argv[2] : nullptr);
  std::fprintf(stderr, "unknown scenario '%s'\n", scenario.c_str());
  return 2;
}
