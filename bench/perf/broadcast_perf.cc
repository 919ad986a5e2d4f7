// broadcast_perf: nccl-tests' broadcast_perf over Communicator::Broadcast.
// Size = the buffer size; busbw = algbw. The Communicator API broadcasts within one buffer, so
// only the in-place columns are measured (out-of-place prints N/A).

#include "bench/perf/common.h"

namespace shardline::perf {
namespace {

CollCounts Counts(size_t count, int n) { return {.send = count, .recv = count, .param = count}; }

double AlgBytes(size_t param, size_t element_size, int n) {
  return static_cast<double>(param) * element_size;
}

double BusFactor(int n) { return 1.0; }

absl::StatusOr<Work> Issue(const IssueArgs& a) {
  return a.comm.Broadcast(a.recv, a.count, a.dtype, a.stream, {.root = a.root});
}

double Expected(const CheckArgs& a, size_t j) {
  return InputValue(a.dtype, false, a.root, j, a.seed);
}

constexpr CollectiveSpec kSpec = {
    .binary = "broadcast_perf",
    .kind = CollectiveKind::kBroadcast,
    .reduces = false,
    .rooted = true,
    .has_out_of_place = false,
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
