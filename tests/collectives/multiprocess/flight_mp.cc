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

#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
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

}  // namespace
}  // namespace shardline

int main(int argc, char** argv) {
  int at = 0;
  if (argc != 3 || !absl::SimpleAtoi(argv[2], &at) || at < 0) {
    std::fprintf(stderr, "usage: flight_mp straggler|diverge <iteration>\n");
    return 2;
  }
  const std::string scenario = argv[1];
  if (scenario != "straggler" && scenario != "diverge") {
    std::fprintf(stderr, "unknown scenario '%s'\n", scenario.c_str());
    return 2;
  }
  return shardline::Scenario(scenario, at);
}
