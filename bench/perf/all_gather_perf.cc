// all_gather_perf: nccl-tests' all_gather_perf over shardline's Communicator::AllGather.
// Size = the gathered (total) size; count = elements per rank; busbw = algbw * (n-1)/n.
// In place (the FSDP case): the input is this rank's slice of the output.

#include "bench/perf/common.h"

namespace shardline::perf {
namespace {

CollCounts Counts(size_t count, int n) {
  const size_t per_rank = count / n;
  return {.send = per_rank,
          .recv = per_rank * n,
          .param = per_rank,
          .send_inplace_offset = per_rank,
          .recv_inplace_offset = 0};
}

double AlgBytes(size_t param, size_t element_size, int n) {
  return static_cast<double>(param) * element_size * n;
}

double BusFactor(int n) { return static_cast<double>(n - 1) / n; }

absl::StatusOr<Work> Issue(const IssueArgs& a) {
  return a.comm.AllGather(a.send, a.recv, a.count, a.dtype, a.stream);
}

// Output block s is rank s's input.
double Expected(const CheckArgs& a, size_t j) {
  return InputValue(a.dtype, false, static_cast<int>(j / a.count), j % a.count, a.seed);
}

constexpr CollectiveSpec kSpec = {
    .binary = "all_gather_perf",
    .kind = CollectiveKind::kAllGather,
    .reduces = false,
    .rooted = false,
    .has_out_of_place = true,
    .has_in_place = true,
    .counts = Counts,
    .alg_bytes = AlgBytes,
    .bus_factor = BusFactor,
    .issue = Issue,
    .expected = Expected,
};

}  // namespace
}  // namespace shardline::perf

int main(int argc, char** argv) {
  return shardline::perf::PerfMain(shardline::perf::kSpec, argc, argv);
}
