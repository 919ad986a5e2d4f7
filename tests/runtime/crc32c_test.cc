// CRC-32C: the dispatched implementation (the SSE4.2 instruction with three interleaved streams
// on x86-64) and the portable table-driven one, each against a bit-at-a-time reference, at
// lengths around the interleaved loop's 24 KiB rounds, unaligned starts and arbitrary splits.

#include "runtime/crc32c.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace shardline {
namespace {

// The definition: one bit at a time, reflected polynomial 0x82F63B78.
uint32_t BitwiseCrc32c(const unsigned char* p, size_t n) {
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ ((crc & 1u) ? 0x82F63B78u : 0u);
  }
  return ~crc;
}

std::vector<unsigned char> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<unsigned char> data(n);
  for (unsigned char& b : data) b = static_cast<unsigned char>(gen());
  return data;
}

using ExtendFn = uint32_t (*)(uint32_t, const void*, size_t);

void CheckAgainstReference(ExtendFn extend, const char* name) {
  const std::vector<unsigned char> data = RandomBytes(3 * 3 * 8192 + 64, 11);
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 80; ++n) lengths.push_back(n);
  for (size_t round : {size_t{3 * 8192}, size_t{6 * 8192}, size_t{9 * 8192}}) {
    for (size_t d = 0; d < 10; ++d) {
      lengths.push_back(round - 5 + d);
    }
  }
  lengths.push_back(12345);
  std::mt19937 gen(5);
  for (size_t n : lengths) {
    for (size_t start : {size_t{0}, size_t{1}, size_t{3}, size_t{7}}) {
      if (start + n > data.size()) continue;
      const unsigned char* p = data.data() + start;
      const uint32_t want = BitwiseCrc32c(p, n);
      ASSERT_EQ(extend(0, p, n), want) << name << ": length " << n << " start " << start;
      const size_t split = n == 0 ? 0 : gen() % (n + 1);
      ASSERT_EQ(extend(extend(0, p, split), p + split, n - split), want)
          << name << ": length " << n << " split " << split;
    }
  }
}

TEST(Crc32cImplementations, DispatchedMatchesTheBitwiseDefinition) {
  CheckAgainstReference(&Crc32cExtend, "dispatched");
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
}

TEST(Crc32cImplementations, PortableMatchesTheBitwiseDefinition) {
  CheckAgainstReference(&Crc32cExtendPortable, "portable");
  EXPECT_EQ(Crc32cExtendPortable(0, "123456789", 9), 0xE3069283u);
}

TEST(Crc32cImplementations, BothAgreeOnAMebibyteAndDetectOneFlippedBit) {
  std::vector<unsigned char> data = RandomBytes((size_t{1} << 20) + 13, 3);
  const uint32_t crc = Crc32c(data.data(), data.size());
  EXPECT_EQ(crc, Crc32cExtendPortable(0, data.data(), data.size()));
  data[777777] ^= 0x10;
  EXPECT_NE(Crc32c(data.data(), data.size()), crc);
  EXPECT_EQ(Crc32c(data.data(), data.size()), Crc32cExtendPortable(0, data.data(), data.size()));
}

}  // namespace
}  // namespace shardline
