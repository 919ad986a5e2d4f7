// Multi-process test program of the flight recorder, started by shardline-launch (the world from
// InitProcessGroup, ucx) and driven by tests/scripts/flight_test.py, which sets
// SHARDLINE_FLIGHT_RECORDER_DIR and reads the dumps with shardline-flight:
//
//   flight_mp straggler <iteration>   a barrier, then iterations i = 0, 1, ... of an all-gather
//                                     (unit "block.<i>") and a reduce-scatter (same unit), each
//                                     checked against a plain-loop reference. Rank 2 stops itself
//                                     with SIGSTOP before issuing iteration <iteration>; the
//                                     others wait in its all-gather until their deadline. The
//                                     driver resumes rank 2 (SIGCONT) once they have failed.
//   flight_mp diverge <iteration>     the same loop, but at <iteration> rank 1 calls the
//                                     all-gather where the others call the reduce-scatter.
//
// Prints "READY rank <r> pid <pid>" after the barrier and "FAILED rank <r> at iteration <i>:
// <status>" when a collective fails; exits kExpectedFailure then (the scenario's outcome), 1 on
// anything unexpected (a wrong result, no failure within 60 s).
//
//   flight_mp trials <ms>[,<ms>...]   one trial per number: after a world barrier, a fresh ucx
//                                     communicator "trial<t>" whose collectives time out after
//                                     <ms>, and on it a loop of mixed collectives (all_reduce,
//                                     all_gather, broadcast, barrier; 1 to 2^20 elements; one
//                                     or two in flight), the same on every rank and each
//                                     checked, until one fails. The driver stops a rank of its
//                                     choice (SIGSTOP) at a moment of its choice; the others
//                                     hang until their deadline, or until the driver sends
//                                     SIGUSR2 to one of them, which aborts the trial's
//                                     communicator. Prints "READY rank <r> pid <pid>" once,
//                                     "START trial <t> rank <r>" when its loop starts, "FAILED
//                                     trial <t> rank <r>: <status>" when it ends, "DONE rank
//                                     <r>" after the last trial (exit 0).

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "collectives/bootstrap.h"
#include "runtime/status.h"
#include "runtime/stream.h"
#include "testing/typed_values.h"

namespace shardline {
namespace {

constexpr int kExpectedFailure = 3;
constexpr size_t kCount = 16;  // elements per rank: the ucx backend's small path

int g_rank = 0;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "FAIL rank %d: %s\n", g_rank, what.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

absl::Status WaitFor(const absl::StatusOr<Work>& work) {
  if (!work.ok()) return work.status();
  return work->Wait(absl::Now() + absl::Seconds(120));
}

// One iteration: all-gather then reduce-scatter of f32 patterns (salted by the iteration),
// both checked. `diverge`: this rank calls the all-gather in the reduce-scatter's place.
absl::Status Iteration(Communicator& comm, Stream& stream, int i, bool diverge) {
  const int n = comm.size();
  const int r = comm.rank();
  const std::string unit = absl::StrCat("block.", i);
  std::vector<uint8_t> in = testing::PatternBuffer(DType::kF32, r, kCount, i);
  std::vector<float> gathered(n * kCount, -1.0f);
  CollectiveOptions options;
  options.tag = unit;
  SL_RETURN_IF_ERROR(
      WaitFor(comm.AllGather(in.data(), gathered.data(), kCount, DType::kF32, stream, options)));
  for (int s = 0; s < n; ++s) {
    for (size_t k = 0; k < kCount; ++k) {
      if (gathered[s * kCount + k] != testing::PatternValue(DType::kF32, s, k, i)) {
        Fail(absl::StrCat("all_gather of ", unit, " wrong at ", s, ":", k));
      }
    }
  }
  std::vector<uint8_t> full = testing::PatternBuffer(DType::kF32, r, n * kCount, i);
  std::vector<float> reduced(kCount, -1.0f);
  if (diverge) {
    std::vector<float> out(n * kCount);
    return WaitFor(comm.AllGather(full.data(), out.data(), kCount, DType::kF32, stream, options));
  }
  ReduceOptions reduce;
  reduce.tag = unit;
  SL_RETURN_IF_ERROR(WaitFor(
      comm.ReduceScatter(full.data(), reduced.data(), kCount, DType::kF32, stream, reduce)));
  for (size_t k = 0; k < kCount; ++k) {
    const size_t at = r * kCount + k;
    double want = 0;
    for (int s = 0; s < n; ++s) want += testing::PatternValue(DType::kF32, s, at, i);
    if (std::abs(reduced[k] - want) > 1e-4 * (1 + std::abs(want))) {
      Fail(absl::StrCat("reduce_scatter of ", unit, " wrong at ", k, ": ", reduced[k], " want ",
                        want));
    }
  }
  return absl::OkStatus();
}

int Scenario(const std::string& scenario, int at) {
  absl::StatusOr<ProcessGroup> group = InitProcessGroup();
  if (!group.ok()) Fail(absl::StrCat("InitProcessGroup: ", group.status().ToString()));
  g_rank = group->launch.rank;
  Communicator& comm = *group->world;
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream({.name = "mp"});
  if (!stream.ok()) Fail(stream.status().ToString());
  if (absl::Status s = WaitFor(comm.Barrier(**stream, {.tag = "start"})); !s.ok()) {
    Fail(absl::StrCat("barrier: ", s.ToString()));
  }
  std::printf("READY rank %d pid %d\n", g_rank, static_cast<int>(getpid()));
  std::fflush(stdout);
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  for (int i = 0; absl::Now() < give_up; ++i) {
    if (scenario == "straggler" && g_rank == 2 && i == at) raise(SIGSTOP);
    const bool diverge = scenario == "diverge" && g_rank == 1 && i == at;
    absl::Status status = Iteration(comm, **stream, i, diverge);
    if (!status.ok()) {
      std::printf("FAILED rank %d at iteration %d: %s\n", g_rank, i, status.ToString().c_str());
      std::fflush(stdout);
      return kExpectedFailure;
    }
  }
  Fail("no collective failed within 60 s");
}

// The same on every rank: which collective step `step` of trial `trial` runs (splitmix64).
uint64_t Mix(uint64_t trial, uint64_t step) {
  uint64_t z = (trial << 40) + step + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

int32_t Value(int rank, size_t k, uint64_t salt) {
  return static_cast<int32_t>(rank * 131 + static_cast<int>(k % 1000) +
                              static_cast<int>(salt % 997));
}

// One collective of the mixed loop with its buffers.
struct Mixed {
  CollectiveKind kind = CollectiveKind::kBarrier;
  size_t count = 0;
  int root = 0;
  uint64_t salt = 0;
  std::vector<int32_t> in, out;
  absl::StatusOr<Work> work = absl::UnknownError("not issued");
};

void Issue(Communicator& comm, Stream& stream, Mixed& m) {
  const int n = comm.size();
  const int r = comm.rank();
  const std::string tag = absl::StrCat("step.", m.salt);
  m.in.resize(m.count);
  for (size_t k = 0; k < m.count; ++k) m.in[k] = Value(r, k, m.salt);
  switch (m.kind) {
    case CollectiveKind::kAllReduce: {
      m.out.assign(m.count, -1);
      ReduceOptions options;
      options.tag = tag;
      m.work = comm.AllReduce(m.in.data(), m.out.data(), m.count, DType::kI32, stream, options);
      return;
    }
    case CollectiveKind::kAllGather:
      m.out.assign(m.count * n, -1);
      m.work =
          comm.AllGather(m.in.data(), m.out.data(), m.count, DType::kI32, stream, {.tag = tag});
      return;
    case CollectiveKind::kBroadcast: {
      if (r != m.root) m.in.assign(m.count, -1);
      BroadcastOptions options;
      options.tag = tag;
      options.root = m.root;
      m.work = comm.Broadcast(m.in.data(), m.count, DType::kI32, stream, options);
      return;
    }
    default:
      m.work = comm.Barrier(stream, {.tag = tag});
      return;
  }
}

// What is wrong with the result of `m` (empty: nothing). The sequence number of step `salt` is
// salt + 1 (the trial's barrier is #0).
std::string Check(const Communicator& comm, const Mixed& m) {
  const int n = comm.size();
  const std::string what = absl::StrCat(CollectiveName(m.kind), " #", m.salt + 1, " (count ",
                                        m.count, ", root ", m.root, ") wrong at ");
  for (size_t k = 0; k < m.count; ++k) {
    switch (m.kind) {
      case CollectiveKind::kAllReduce: {
        int64_t want = 0;
        for (int s = 0; s < n; ++s) want += Value(s, k, m.salt);
        if (m.out[k] != want) return absl::StrCat(what, k, ": ", m.out[k], " want ", want);
        break;
      }
      case CollectiveKind::kAllGather:
        for (int s = 0; s < n; ++s) {
          if (m.out[s * m.count + k] != Value(s, k, m.salt)) {
            return absl::StrCat(what, s, ":", k, ": ", m.out[s * m.count + k], " want ",
                                Value(s, k, m.salt));
          }
        }
        break;
      case CollectiveKind::kBroadcast:
        if (m.in[k] != Value(m.root, k, m.salt)) {
          return absl::StrCat(what, k, ": ", m.in[k], " want ", Value(m.root, k, m.salt));
        }
        break;
      default:
        break;
    }
  }
  return "";
}

// The mixed loop of one trial, until a collective fails (its status) or `give_up` passes (OK).
absl::Status MixedLoop(Communicator& comm, Stream& stream, int trial, absl::Time give_up) {
  static constexpr size_t kCounts[] = {1, 13, 700, 60000, 1 << 20};
  static constexpr CollectiveKind kKinds[] = {CollectiveKind::kAllReduce,
                                              CollectiveKind::kAllGather,
                                              CollectiveKind::kBroadcast, CollectiveKind::kBarrier};
  uint64_t salt = 0;
  for (uint64_t step = 0; absl::Now() < give_up; ++step) {
    const uint64_t h = Mix(static_cast<uint64_t>(trial), step);
    // One collective, or two issued back to back (the second queued behind the first).
    std::vector<Mixed> ops(h % 3 == 0 ? 2 : 1);
    for (size_t j = 0; j < ops.size(); ++j) {
      const uint64_t hj = h >> (16 * j);
      ops[j].kind = kKinds[(hj >> 2) % 4];
      ops[j].count = ops[j].kind == CollectiveKind::kBarrier ? 0 : kCounts[(hj >> 4) % 5];
      ops[j].root = static_cast<int>((hj >> 8) % static_cast<uint64_t>(comm.size()));
      ops[j].salt = salt++;
      Issue(comm, stream, ops[j]);
    }
    absl::Status first;
    for (Mixed& m : ops) {
      const absl::Status s = WaitFor(m.work);
      if (first.ok()) first = s;
    }
    if (!first.ok()) return first;
    for (const Mixed& m : ops) {
      const std::string wrong = Check(comm, m);
      if (wrong.empty()) continue;
      // A collective that returned OK with wrong data is a bug of the backend, also after an
      // abort: a rank resumed after its peers gave up on a collective must fail it, not
      // complete it out of their buffers (freed and reused by then).
      Fail(absl::StrCat("WRONG trial ", trial, ": ", wrong,
                        ", returned OK; the communicator's status: ", comm.status().ToString()));
    }
  }
  return absl::OkStatus();
}

int Trials(const std::vector<int>& timeouts_ms) {
  // SIGUSR2 ends a trial: blocked in every thread (none exists yet), taken by the one below.
  sigset_t usr2;
  sigemptyset(&usr2);
  sigaddset(&usr2, SIGUSR2);
  pthread_sigmask(SIG_BLOCK, &usr2, nullptr);
  absl::StatusOr<ProcessGroup> group = InitProcessGroup();
  if (!group.ok()) Fail(absl::StrCat("InitProcessGroup: ", group.status().ToString()));
  g_rank = group->launch.rank;
  static std::mutex mu;
  static std::shared_ptr<Communicator> current;  // the trial's communicator, guarded by mu
  std::thread([usr2] {
    int sig = 0;
    while (sigwait(&usr2, &sig) == 0) {
      std::shared_ptr<Communicator> comm;
      {
        std::lock_guard<std::mutex> lock(mu);
        comm = current;
      }
      if (comm != nullptr) comm->Abort(absl::AbortedError("the driver ended the trial (SIGUSR2)"));
    }
  }).detach();
  // The world's stream; each trial gets its own (a failed collective poisons its stream).
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream({.name = "mp"});
  if (!stream.ok()) Fail(stream.status().ToString());
  Communicator& world = *group->world;
  const int n = world.size();
  std::printf("READY rank %d pid %d\n", g_rank, static_cast<int>(getpid()));
  std::fflush(stdout);
  for (int t = 0; t < static_cast<int>(timeouts_ms.size()); ++t) {
    if (absl::Status s = WaitFor(world.Barrier(**stream, {.tag = absl::StrCat("trial.", t)}));
        !s.ok()) {
      Fail(absl::StrCat("world barrier before trial ", t, ": ", s.ToString()));
    }
    absl::StatusOr<std::shared_ptr<Communicator>> comm =
        CreateCommunicator({.rank = g_rank,
                            .size = n,
                            .store = group->store,
                            .name = absl::StrCat("trial", t),
                            .timeout = absl::Milliseconds(timeouts_ms[t])});
    if (!comm.ok()) Fail(absl::StrCat("trial ", t, ": ", comm.status().ToString()));
    {
      std::lock_guard<std::mutex> lock(mu);
      current = *comm;
    }
    absl::StatusOr<std::unique_ptr<Stream>> trial_stream =
        CreateHostStream({.name = absl::StrCat("trial", t)});
    if (!trial_stream.ok()) Fail(trial_stream.status().ToString());
    if (absl::Status s = WaitFor((*comm)->Barrier(**trial_stream, {.tag = "start"})); !s.ok()) {
      Fail(absl::StrCat("trial ", t, " barrier: ", s.ToString()));
    }
    std::printf("START trial %d rank %d\n", t, g_rank);
    std::fflush(stdout);
    const absl::Status status =
        MixedLoop(**comm, **trial_stream, t, absl::Now() + absl::Seconds(60));
    if (status.ok()) Fail(absl::StrCat("trial ", t, ": no collective failed within 60 s"));
    std::printf("FAILED trial %d rank %d: %s\n", t, g_rank, status.ToString().c_str());
    std::fflush(stdout);
    std::lock_guard<std::mutex> lock(mu);
    current.reset();
  }
  std::printf("DONE rank %d\n", g_rank);
  std::fflush(stdout);
  return 0;
}

}  // namespace
}  // namespace shardline

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "trials") {
    std::vector<int> timeouts;
    for (absl::string_view ms : absl::StrSplit(argv[2], ',')) {
      int v = 0;
      if (!absl::SimpleAtoi(ms, &v) || v <= 0) {
        std::fprintf(stderr, "flight_mp trials: '%s' is not a timeout in ms\n",
                     std::string(ms).c_str());
        return 2;
      }
      timeouts.push_back(v);
    }
    return shardline::Trials(timeouts);
  }
  int at = 0;
  if (argc != 3 || !absl::SimpleAtoi(argv[2], &at) || at < 0) {
    std::fprintf(stderr,
                 "usage: flight_mp straggler|diverge <iteration> | trials <ms>[,<ms>...]\n");
    return 2;
  }
  const std::string scenario = argv[1];
  if (scenario != "straggler" && scenario != "diverge") {
    std::fprintf(stderr, "unknown scenario '%s'\n", scenario.c_str());
    return 2;
  }
  return shardline::Scenario(scenario, at);
}
