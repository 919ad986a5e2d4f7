// File: tests/common/status_and_hash.h
// Two things many tests need: gtest assertions on an absl::Status (EXPECT_OK / ASSERT_OK, which
// print the expression and the status), and SplitMix64's finalizer (HashMix), from which tests
// derive their hashed floats and bytes — every element different, no exact sums.

#ifndef SHARDLINE_TESTS_COMMON_STATUS_AND_HASH_H_
#define SHARDLINE_TESTS_COMMON_STATUS_AND_HASH_H_

#include <gtest/gtest.h>

#include <cstdint>

#include "absl/status/status.h"

#define EXPECT_OK(expr)                                                      \
  do {                                                                       \
    const absl::Status expect_ok_status = (expr);                            \
    EXPECT_TRUE(expect_ok_status.ok()) << #expr << ": " << expect_ok_status; \
  } while (false)
#define ASSERT_OK(expr)                                                      \
  do {                                                                       \
    const absl::Status assert_ok_status = (expr);                            \
    ASSERT_TRUE(assert_ok_status.ok()) << #expr << ": " << assert_ok_status; \
  } while (false)

namespace shardline::testing {

inline uint64_t HashMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_COMMON_STATUS_AND_HASH_H_
