// File: tests/common/hashed_bytes.h
// Test messages that expose misplaced bytes: hashed bytes of (sender, message, index), with no
// period along the buffer and different for every message, so that a byte from the wrong offset
// or the wrong message never compares equal by accident.

#ifndef SHARDLINE_TESTS_COMMON_HASHED_BYTES_H_
#define SHARDLINE_TESTS_COMMON_HASHED_BYTES_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace shardline::testing {

inline std::vector<uint8_t> HashedBytes(int from, int message, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  for (size_t i = 0; i < bytes; ++i) {
    uint64_t x = (static_cast<uint64_t>(from) << 56) ^ (static_cast<uint64_t>(message) << 40) ^ i;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    out[i] = static_cast<uint8_t>(x ^ (x >> 31));
  }
  return out;
}

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_COMMON_HASHED_BYTES_H_
