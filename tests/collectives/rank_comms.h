// File: tests/collectives/rank_comms.h
// Ranks as threads over a group of communicators, for the collectives tests: a runner that hands
// each rank its communicator and a host stream of its own, n UCX communicators created at once,
// and a bounded wait for a collective's Work.

#ifndef SHARDLINE_TESTS_COLLECTIVES_RANK_COMMS_H_
#define SHARDLINE_TESTS_COLLECTIVES_RANK_COMMS_H_

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/store/memory_store.h"
#include "collectives/ucx/ucx_communicator.h"
#include "runtime/check.h"
#include "runtime/stream.h"
#include "tests/common/rank_threads.h"

namespace shardline::testing {

using Comms = std::vector<std::shared_ptr<Communicator>>;
using RankFn = std::function<void(int rank, Communicator& comm, Stream& stream)>;

// Runs fn on one thread per rank, each with its own host stream named "comm<rank>".
inline void RunRanks(const Comms& comms, const RankFn& fn) {
  RunRankThreads(static_cast<int>(comms.size()), [&](int r) {
    absl::StatusOr<std::unique_ptr<Stream>> stream =
        CreateHostStream({.name = absl::StrCat("comm", r)});
    ASSERT_TRUE(stream.ok()) << stream.status();
    fn(r, *comms[r], **stream);
  });
}

// n UCX communicators named `name` over `store` (a new MemoryStore when null), created
// concurrently: creation waits for every peer's address. A failed creation is a broken test.
inline Comms MakeUcxComms(int n, absl::Duration timeout = absl::Seconds(30),
                          std::shared_ptr<Store> store = nullptr,
                          const std::string& name = "world") {
  if (store == nullptr) store = std::make_shared<MemoryStore>();
  Comms comms(n);
  RunRankThreads(n, [&](int r) {
    absl::StatusOr<std::shared_ptr<Communicator>> comm = CreateUcxCommunicator(
        {.rank = r, .size = n, .store = store, .name = name, .timeout = timeout});
    SL_CHECK_OK(comm.status());
    comms[r] = *std::move(comm);
  });
  return comms;
}

// The status of a collective: its issue's, or its completion's within 60 s.
inline absl::Status WaitFor(const absl::StatusOr<Work>& work) {
  if (!work.ok()) return work.status();
  return work->Wait(absl::Now() + absl::Seconds(60));
}

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_COLLECTIVES_RANK_COMMS_H_
