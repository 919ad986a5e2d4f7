// File: tests/common/local_ranks.h
// Runs one function per rank of an in-process group (local communicators, ranks as threads) and
// returns every rank's status: the harness of the scheduler and checkpoint tests.

#ifndef SHARDLINE_TESTS_COMMON_LOCAL_RANKS_H_
#define SHARDLINE_TESTS_COMMON_LOCAL_RANKS_H_

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/local/local_communicator.h"
#include "runtime/check.h"
#include "tests/common/rank_threads.h"

namespace shardline::testing {

// fn(rank, that rank's communicator) on `world` threads; communicators with `timeout`.
inline std::vector<absl::Status> RunLocalRanks(
    int world, absl::Duration timeout,
    const std::function<absl::Status(int, std::shared_ptr<Communicator>)>& fn) {
  auto comms = CreateLocalCommunicators(world, {.timeout = timeout});
  SL_CHECK(comms.ok());
  return RunRankThreads(world, [&](int r) { return fn(r, (*comms)[r]); });
}

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_COMMON_LOCAL_RANKS_H_
