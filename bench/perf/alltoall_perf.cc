// alltoall_perf: nccl-tests' alltoall_perf over Communicator::AllToAll.
// Size = the send (= receive) buffer size; count = elements per peer; busbw = algbw * (n-1)/n.
// All-to-all has no in-place form in the Communicator API: the in-place columns print N/A.

#include "bench/perf/common.h"

namespace shardline::perf {
namespace {

CollCounts Counts(size_t count, int n) {
  const size_t per_peer = count / n;
  return {.send = per_peer * n, .recv = per_peer * n, .param = per_peer};
}

double AlgBytes(size_t param, size_t element_size, int n) {
  return static_cast<double>(param) * element_size * n;
}

double BusFactor(int n) { return static_cast<double>(n - 1) / n; }

absl::StatusOr<Work> Issue(const IssueArgs& a) {
  return a.comm.AllToAll(a.send, a.recv, a.count, a.dtype, a.stream);
}

// Block s of the output is block `rank` of rank s's input.
double Expected(const CheckArgs& a, size_t j) {
  const size_t s = j / a.count;
  return InputValue(a.dtype, false, static_cast<int>(s), a.rank * a.count + j % a.count, a.seed);
}

constexpr CollectiveSpec kSpec = {
    .binary = "alltoall_perf",
    .kind = CollectiveKind::kAllToAll,
    .reduces = false,
    .rooted = false,
    .has_out_of_place = true,
    .has_in_place = false,
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
