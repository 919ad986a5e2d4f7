// The flight recorder's cost (collectives/flight_recorder.h) against the collective it records:
//
//   BM_FlightRecord            one collective's whole life in the ring, as the Communicator
//                              records it: enqueue, start and end, each with its clock read, on a
//                              ring of the default 2048 slots that has wrapped (the steady state).
//   BM_LocalAllReduce8KiB/R    an 8 KiB all-reduce (2048 f32) over the local backend, 2 ranks,
//                              each on its own host stream, issued and waited for by one thread;
//                              R = 1 records (the default), R = 0 does not
//                              (SHARDLINE_FLIGHT_RECORDER=0).
//
//   flight_recorder_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
//
// The recording cost should be under 1% of the all-reduce's time (docs/benchmarks.md).

#include <stdlib.h>

#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "benchmark/benchmark.h"
#include "collectives/communicator.h"
#include "collectives/flight_recorder.h"
#include "collectives/local/local_communicator.h"
#include "runtime/check.h"
#include "runtime/config.h"
#include "runtime/stream.h"

namespace shardline {
namespace {

void BM_FlightRecord(benchmark::State& state) {
  FlightRecorder recorder(2048);
  CollectiveFingerprint fp{
      CollectiveKind::kReduceScatter, 0, 4096, DType::kBF16, ReduceOp::kAvg, 0};
  const absl::Status ok;
  // Wrap the ring once, so that the strings' capacity is in place as in a long run.
  for (int i = 0; i < 2048; ++i, ++fp.seq) {
    recorder.Enqueued(fp, "shardline.reduce", "block.17", absl::GetCurrentTimeNanos());
  }
  for (auto _ : state) {
    recorder.Enqueued(fp, "shardline.reduce", "block.17", absl::GetCurrentTimeNanos());
    recorder.Started(fp.seq, absl::GetCurrentTimeNanos());
    recorder.Ended(fp.seq, ok, absl::GetCurrentTimeNanos());
    ++fp.seq;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_FlightRecord);

void SetRecorder(bool on) {
  SL_CHECK(setenv("SHARDLINE_FLIGHT_RECORDER", on ? "2048" : "0", 1) == 0);
  for (const ParamBase* param : AllParams()) {
    if (param->env_name() == "SHARDLINE_FLIGHT_RECORDER") param->ResetCacheForTesting();
  }
}

void BM_LocalAllReduce8KiB(benchmark::State& state) {
  constexpr int kRanks = 2;
  constexpr size_t kCount = 8192 / sizeof(float);
  SetRecorder(state.range(0) != 0);
  absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> comms =
      CreateLocalCommunicators(kRanks, {.timeout = absl::Seconds(60)});
  SL_CHECK_OK(comms.status());
  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<std::vector<float>> buffers;
  for (int r = 0; r < kRanks; ++r) {
    absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream({.name = "bench"});
    SL_CHECK_OK(stream.status());
    streams.push_back(*std::move(stream));
    buffers.emplace_back(kCount, 1.0f);
  }
  std::vector<Work> works(kRanks);
  for (auto _ : state) {
    for (int r = 0; r < kRanks; ++r) {
      absl::StatusOr<Work> work = (*comms)[r]->AllReduce(buffers[r].data(), buffers[r].data(),
                                                         kCount, DType::kF32, *streams[r]);
      SL_CHECK_OK(work.status());
      works[r] = *std::move(work);
    }
    for (int r = 0; r < kRanks; ++r) SL_CHECK_OK(works[r].Wait(absl::Now() + absl::Seconds(60)));
  }
  SL_CHECK((*comms)[0]->FlightRecords().empty() == (state.range(0) == 0));
  state.SetBytesProcessed(state.iterations() * kCount * sizeof(float));
  SetRecorder(true);
}
BENCHMARK(BM_LocalAllReduce8KiB)->Arg(1)->Arg(0)->UseRealTime();

}  // namespace
}  // namespace shardline

BENCHMARK_MAIN();
