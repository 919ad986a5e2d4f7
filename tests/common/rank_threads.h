// File: tests/common/rank_threads.h
// Runs one function per rank, each rank on a thread of its own (ranks as threads, the way the
// unit tests run a group), and returns once every rank has finished. The same runner serves
// workers that are not ranks of a group (threads hammering one pool).
//
//   RunRankThreads(4, [&](int rank) { ... });                      // void: nothing returned
//   std::vector<absl::Status> statuses =
//       RunRankThreads(4, [&](int rank) { return Step(rank); });   // one result per rank
//
// gtest assertions work on the rank threads; a failed ASSERT_* returns from that rank's call
// only.

#ifndef SHARDLINE_TESTS_COMMON_RANK_THREADS_H_
#define SHARDLINE_TESTS_COMMON_RANK_THREADS_H_

#include <functional>
#include <thread>
#include <type_traits>
#include <vector>

namespace shardline::testing {

// fn(rank) for rank in [0, world), each on its own thread, all at once. When fn returns a value
// (a Status, a StatusOr, ...), the result is those values indexed by rank (the type must be
// default-constructible; not bool: std::vector<bool> packs bits that the threads would share).
template <typename Fn>
auto RunRankThreads(int world, Fn&& fn) {
  using Result = std::invoke_result_t<Fn&, int>;
  std::vector<std::thread> threads;
  threads.reserve(world);
  if constexpr (std::is_void_v<Result>) {
    for (int r = 0; r < world; ++r) threads.emplace_back([&fn, r] { fn(r); });
    for (std::thread& t : threads) t.join();
  } else {
    static_assert(!std::is_same_v<Result, bool>, "return an int or a Status, not a bool");
    std::vector<Result> results(world);
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&fn, &results, r] { results[r] = fn(r); });
    }
    for (std::thread& t : threads) t.join();
    return results;
  }
}

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_COMMON_RANK_THREADS_H_
