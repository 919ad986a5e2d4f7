// reduce_scatter_perf: nccl-tests' reduce_scatter_perf over Communicator::ReduceScatter.
// Size = the input (total) size; count = elements each rank receives; busbw = algbw * (n-1)/n.
// In place: the output is this rank's block of the input.

#include "bench/perf/common.h"

namespace shardline::perf {
namespace {

CollCounts Counts(size_t count, int n) {
  const size_t per_rank = count / n;
  return {.send = per_rank * n,
          .recv = per_rank,
          .param = per_rank,
          .send_inplace_offset = 0,
          .recv_inplace_offset = per_rank};
}

double AlgBytes(size_t param, size_t element_size, int n) {
  return static_cast<double>(param) * element_size * n;
}

double BusFactor(int n) { return static_cast<double>(n - 1) / n; }

absl::StatusOr<Work> Issue(const IssueArgs& a) {
  return a.comm.ReduceScatter(a.send, a.recv, a.count, a.dtype, a.stream, {.op = a.op});
}

// Element j of this rank's block: the reduction of every rank's element rank * count + j.
double Expected(const CheckArgs& a, size_t j) {
  return ReducedValue(a, static_cast<size_t>(a.rank) * a.count + j);
}

constexpr CollectiveSpec kSpec = {
    .binary = "reduce_scatter_perf",
    .kind = CollectiveKind::kReduceScatter,
    .reduces = true,
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
