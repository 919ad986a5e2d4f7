// all_reduce_perf: nccl-tests' all_reduce_perf over Communicator::AllReduce.
// Size = the buffer size; count = its elements; busbw = algbw * 2(n-1)/n.

#include "bench/perf/common.h"

namespace shardline::perf {
namespace {

CollCounts Counts(size_t count, int n) { return {.send = count, .recv = count, .param = count}; }

double AlgBytes(size_t param, size_t element_size, int n) {
  return static_cast<double>(param) * element_size;
}

double BusFactor(int n) { return 2.0 * (n - 1) / n; }

absl::StatusOr<Work> Issue(const IssueArgs& a) {
  return a.comm.AllReduce(a.send, a.recv, a.count, a.dtype, a.stream, {.op = a.op});
}

double Expected(const CheckArgs& a, size_t j) { return ReducedValue(a, j); }

constexpr CollectiveSpec kSpec = {
    .binary = "all_reduce_perf",
    .kind = CollectiveKind::kAllReduce,
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
