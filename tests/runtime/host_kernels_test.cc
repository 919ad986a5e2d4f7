// Tests of runtime/host_kernels.h: every cast pair against the reference of half_reference.h
// (every 16-bit pattern, random f32/f64), reductions / ReduceMany / Scale for every dtype and op
// against plain loops, at counts {0, 1, 7, 4097, large odd}, on deliberately misaligned pointers.

#include "runtime/host_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/runtime/half_reference.h"

namespace shardline {
namespace {

using testing::HalfFormat;
using ::testing::HasSubstr;
using testing::kBf16Format;
using testing::kF16Format;
using testing::RefDecode;
using testing::RefIsNaN;
using testing::RefRounder;

const RefRounder& F16Ref() {
  static const RefRounder* r = new RefRounder(kF16Format);
  return *r;
}
const RefRounder& Bf16Ref() {
  static const RefRounder* r = new RefRounder(kBf16Format);
  return *r;
}

const size_t kCounts[] = {0, 1, 7, 4097, 100003};

// A byte buffer whose data() is `misalign` bytes past a 64-byte boundary, so typed pointers into
// it are misaligned for every type wider than a byte when misalign is odd.
class RawBuffer {
 public:
  RawBuffer(size_t bytes, size_t misalign) : storage_(bytes + 128), misalign_(misalign) {
    const uintptr_t base = reinterpret_cast<uintptr_t>(storage_.data());
    offset_ = (64 - base % 64) % 64 + misalign_;
  }
  std::byte* data() { return storage_.data() + offset_; }
  const std::byte* data() const { return storage_.data() + offset_; }
  template <typename T>
  T Get(size_t i) const {
    T v;
    std::memcpy(&v, storage_.data() + offset_ + i * sizeof(T), sizeof(T));
    return v;
  }
  template <typename T>
  void Set(size_t i, T v) {
    std::memcpy(storage_.data() + offset_ + i * sizeof(T), &v, sizeof(T));
  }

 private:
  std::vector<std::byte> storage_;
  size_t misalign_;
  size_t offset_ = 0;
};

// ---- reference element model -----------------------------------------------------------------
// Values are handled as double in the reference; 16-bit formats decode/round via the reference.

double RefLoad(const RawBuffer& b, size_t i, DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return b.Get<float>(i);
    case DType::kF64:
      return b.Get<double>(i);
    case DType::kF16:
      return RefDecode(kF16Format, b.Get<uint16_t>(i));
    case DType::kBF16:
      return RefDecode(kBf16Format, b.Get<uint16_t>(i));
    case DType::kI8:
      return b.Get<int8_t>(i);
    case DType::kU8:
      return b.Get<uint8_t>(i);
    case DType::kI32:
      return b.Get<int32_t>(i);
    case DType::kI64:
      return static_cast<double>(b.Get<int64_t>(i));
  }
  return 0;
}

// Fills with random values: floats in [-100, 100] (exactly representable), integers over their
// whole range.
void FillRandom(RawBuffer& b, size_t count, DType dtype, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> real(-100, 100);
  for (size_t i = 0; i < count; ++i) {
    const uint64_t r = rng();
    switch (dtype) {
      case DType::kF32:
        b.Set<float>(i, static_cast<float>(real(rng)));
        break;
      case DType::kF64:
        b.Set<double>(i, real(rng));
        break;
      case DType::kF16:
        b.Set<uint16_t>(i, F16Ref().Round(real(rng)));
        break;
      case DType::kBF16:
        b.Set<uint16_t>(i, Bf16Ref().Round(real(rng)));
        break;
      case DType::kI8:
        b.Set<int8_t>(i, static_cast<int8_t>(r));
        break;
      case DType::kU8:
        b.Set<uint8_t>(i, static_cast<uint8_t>(r));
        break;
      case DType::kI32:
        b.Set<int32_t>(i, static_cast<int32_t>(r));
        break;
      case DType::kI64:
        b.Set<int64_t>(i, static_cast<int64_t>(r));
        break;
    }
  }
}

// inout op= in for one element, computed independently: floats in the reference's double (one
// correct rounding, which is what f32 arithmetic gives for two 16-bit inputs), integers in
// unsigned (wrapping) arithmetic.
template <typename T>
T WrapAdd(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
}

template <typename T>
T RefOp(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      if constexpr (std::is_integral_v<T>) {
        return WrapAdd(a, b);
      } else {
        return a + b;
      }
    case ReduceOp::kMin:
      return a < b ? a : b;
    case ReduceOp::kMax:
      return a > b ? a : b;
    case ReduceOp::kProduct:
      if constexpr (std::is_integral_v<T>) {
        // Modulo 2^bits: the low bits of the 64-bit product of the sign-extended operands.
        return static_cast<T>(static_cast<uint64_t>(static_cast<int64_t>(a)) *
                              static_cast<uint64_t>(static_cast<int64_t>(b)));
      } else {
        return a * b;
      }
  }
  return a;
}

// Reference for ReduceMany (and Reduce = ReduceMany of {inout, in}): accumulates left to right
// in the compute type (f32 for 16-bit formats, via the reference decoder) and rounds once.
void RefReduceMany(RawBuffer& out, const std::vector<const RawBuffer*>& inputs, size_t count,
                   DType dtype, ReduceOp op) {
  for (size_t i = 0; i < count; ++i) {
    switch (dtype) {
      case DType::kF32: {
        float acc = inputs[0]->Get<float>(i);
        for (size_t k = 1; k < inputs.size(); ++k) acc = RefOp(acc, inputs[k]->Get<float>(i), op);
        out.Set<float>(i, acc);
        break;
      }
      case DType::kF64: {
        double acc = inputs[0]->Get<double>(i);
        for (size_t k = 1; k < inputs.size(); ++k) {
          acc = RefOp(acc, inputs[k]->Get<double>(i), op);
        }
        out.Set<double>(i, acc);
        break;
      }
      case DType::kF16:
      case DType::kBF16: {
        const HalfFormat& f = dtype == DType::kF16 ? kF16Format : kBf16Format;
        const RefRounder& r = dtype == DType::kF16 ? F16Ref() : Bf16Ref();
        float acc = static_cast<float>(RefDecode(f, inputs[0]->Get<uint16_t>(i)));
        for (size_t k = 1; k < inputs.size(); ++k) {
          acc = RefOp(acc, static_cast<float>(RefDecode(f, inputs[k]->Get<uint16_t>(i))), op);
        }
        out.Set<uint16_t>(i, r.Round(acc));
        break;
      }
#define SL_REF_INT_CASE(D, T)                                                              \
  case D: {                                                                                \
    T acc = inputs[0]->Get<T>(i);                                                          \
    for (size_t k = 1; k < inputs.size(); ++k) acc = RefOp(acc, inputs[k]->Get<T>(i), op); \
    out.Set<T>(i, acc);                                                                    \
    break;                                                                                 \
  }
        SL_REF_INT_CASE(DType::kI8, int8_t)
        SL_REF_INT_CASE(DType::kU8, uint8_t)
        SL_REF_INT_CASE(DType::kI32, int32_t)
        SL_REF_INT_CASE(DType::kI64, int64_t)
#undef SL_REF_INT_CASE
    }
  }
}

void ExpectSameBytes(const RawBuffer& got, const RawBuffer& want, size_t count, DType dtype,
                     const std::string& what) {
  const size_t size = DTypeSize(dtype);
  for (size_t i = 0; i < count; ++i) {
    // Bit patterns are exact; print values.
    ASSERT_EQ(std::memcmp(got.data() + i * size, want.data() + i * size, size), 0)
        << what << " element " << i << ": got " << RefLoad(got, i, dtype) << " want "
        << RefLoad(want, i, dtype);
  }
}

// ---- Cast ------------------------------------------------------------------------------------

const DType kFloatTypes[] = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16};

// The reference conversion of one value (already decoded to double) to `dst`, as stored bytes.
void RefStore(RawBuffer& b, size_t i, DType dst, double v) {
  switch (dst) {
    case DType::kF32:
      b.Set<float>(i, static_cast<float>(v));  // the compiler's conversion is the reference
      break;
    case DType::kF64:
      b.Set<double>(i, v);
      break;
    case DType::kF16:
      b.Set<uint16_t>(i, F16Ref().Round(v));
      break;
    case DType::kBF16:
      b.Set<uint16_t>(i, Bf16Ref().Round(v));
      break;
    default:
      FAIL();
  }
}

bool IsNaNElem(const RawBuffer& b, size_t i, DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return RefIsNaN(kF16Format, b.Get<uint16_t>(i));
    case DType::kBF16:
      return RefIsNaN(kBf16Format, b.Get<uint16_t>(i));
    default:
      return std::isnan(RefLoad(b, i, dtype));
  }
}

// Casts src (count elements of `from`) to `to` and checks against RefStore elementwise. NaNs must
// stay NaNs with their sign.
void CheckCast(RawBuffer& src, DType from, DType to, size_t count, size_t misalign) {
  RawBuffer got(count * DTypeSize(to), misalign), want(count * DTypeSize(to), misalign);
  ASSERT_TRUE(Cast(src.data(), from, got.data(), to, count).ok());
  for (size_t i = 0; i < count; ++i) {
    const double v = RefLoad(src, i, from);
    if (std::isnan(v)) {
      ASSERT_TRUE(IsNaNElem(got, i, to)) << from << "->" << to << " element " << i;
      ASSERT_EQ(std::signbit(RefLoad(got, i, to)), std::signbit(v));
      continue;
    }
    RefStore(want, i, to, v);
  }
  for (size_t i = 0; i < count; ++i) {
    if (IsNaNElem(src, i, from)) {
      RefStore(want, i, to, 0);  // make the byte comparison skip NaNs
      RefStore(got, i, to, 0);
    }
  }
  ExpectSameBytes(got, want, count, to, absl::StrCat(DTypeName(from), "->", DTypeName(to)));
}

// CopyStreaming against memcpy: sizes around the non-temporal threshold and the 64-byte body,
// every alignment of source and destination within 16 bytes, neighbours left untouched.
TEST(CopyStreamingTest, MatchesMemcpyForEverySizeAndAlignment) {
  const size_t kMin = kStreamingCopyMinBytes;
  const std::vector<size_t> sizes = {0,    1,        15,        64,        kMin - 1,
                                     kMin, kMin + 1, kMin + 63, kMin + 64, (1 << 20) + 37};
  std::mt19937_64 rng(7);
  for (size_t bytes : sizes) {
    for (size_t src_offset : {0, 1, 8, 15}) {
      for (size_t dst_offset : {0, 3, 16, 17}) {
        std::vector<uint8_t> src(bytes + 32), dst(bytes + 64, 0xEE), want(bytes + 64, 0xEE);
        for (uint8_t& b : src) b = static_cast<uint8_t>(rng());
        std::memcpy(want.data() + dst_offset, src.data() + src_offset, bytes);
        CopyStreaming(dst.data() + dst_offset, src.data() + src_offset, bytes);
        ASSERT_EQ(dst, want) << bytes << " bytes, src+" << src_offset << ", dst+" << dst_offset;
      }
    }
  }
}

TEST(CastTest, EverySixteenBitPatternToEveryFloatType) {
  for (DType from : {DType::kF16, DType::kBF16}) {
    RawBuffer src(2 * 65536, 1);
    for (uint32_t b = 0; b < 65536; ++b) src.Set<uint16_t>(b, static_cast<uint16_t>(b));
    for (DType to : kFloatTypes) {
      SCOPED_TRACE(absl::StrCat(DTypeName(from), "->", DTypeName(to)));
      CheckCast(src, from, to, 65536, 3);
    }
  }
}

TEST(CastTest, RandomF32AndF64ToEveryFloatType) {
  std::mt19937_64 rng(7);
  const size_t n = 100003;
  RawBuffer f32(4 * n, 1), f64(8 * n, 5);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = rng();
    float x;
    const uint32_t u = static_cast<uint32_t>(r);
    std::memcpy(&x, &u, 4);
    if (i % 3 == 0)
      x = static_cast<float>(std::ldexp(static_cast<double>(r >> 40), -50 + int(r % 70)));
    f32.Set<float>(i, x);
    f64.Set<double>(i, static_cast<double>(x) * (1 + static_cast<double>(r >> 44) * 0x1p-46));
  }
  for (DType to : kFloatTypes) {
    SCOPED_TRACE(DTypeName(to));
    CheckCast(f32, DType::kF32, to, n, 2);
    CheckCast(f64, DType::kF64, to, n, 1);
  }
}

TEST(CastTest, CountsAndIdentity) {
  std::mt19937_64 rng(3);
  for (size_t count : kCounts) {
    for (DType from : kFloatTypes) {
      RawBuffer src(count * DTypeSize(from) + 1, 1);
      FillRandom(src, count, from, rng);
      for (DType to : kFloatTypes) CheckCast(src, from, to, count, 3);
      // In place, same dtype: a no-op.
      RawBuffer copy = src;
      ASSERT_TRUE(Cast(src.data(), from, src.data(), from, count).ok());
      ExpectSameBytes(src, copy, count, from, "in-place identity");
    }
  }
  // count 0 with null pointers is fine.
  EXPECT_TRUE(Cast(nullptr, DType::kF32, nullptr, DType::kBF16, 0).ok());
}

TEST(CastTest, RejectsNonFloatingPairs) {
  float f = 0;
  int32_t i = 0;
  absl::Status s = Cast(&i, DType::kI32, &f, DType::kF32, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("i32 -> f32"));
  s = Cast(&f, DType::kF32, &i, DType::kI8, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("f32 -> i8"));
  EXPECT_EQ(Cast(nullptr, DType::kF32, &f, DType::kF16, 1).code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- Reduce / ReduceMany / Scale --------------------------------------------------------------

TEST(ReduceTest, EveryDTypeOpAndCount) {
  std::mt19937_64 rng(11);
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : kAllReduceOps) {
      for (size_t count : kCounts) {
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " ", ReduceOpName(op), " count=", count));
        const size_t bytes = count * DTypeSize(dtype);
        RawBuffer a(bytes, 1), b(bytes, 3), want(bytes, 0);
        FillRandom(a, count, dtype, rng);
        FillRandom(b, count, dtype, rng);
        RefReduceMany(want, {&a, &b}, count, dtype, op);
        ASSERT_TRUE(Reduce(a.data(), b.data(), count, dtype, op).ok());
        ExpectSameBytes(a, want, count, dtype, "Reduce");
      }
    }
  }
}

TEST(ReduceTest, InPlaceWithItself) {
  std::mt19937_64 rng(5);
  for (DType dtype : kAllDTypes) {
    const size_t count = 4097;
    RawBuffer a(count * DTypeSize(dtype), 1), want(count * DTypeSize(dtype), 0);
    FillRandom(a, count, dtype, rng);
    RefReduceMany(want, {&a, &a}, count, dtype, ReduceOp::kSum);
    ASSERT_TRUE(Reduce(a.data(), a.data(), count, dtype, ReduceOp::kSum).ok());
    ExpectSameBytes(a, want, count, dtype, absl::StrCat("x+x ", DTypeName(dtype)));
  }
}

// Sums and products that overflow: f16 to Inf, integers wrap.
TEST(ReduceTest, OverflowBehaviour) {
  uint16_t a = 0x7bff, b = 0x7bff;  // 65504 + 65504
  ASSERT_TRUE(Reduce(&a, &b, 1, DType::kF16, ReduceOp::kSum).ok());
  EXPECT_EQ(a, 0x7c00);
  int32_t x = std::numeric_limits<int32_t>::max(), y = 1;
  ASSERT_TRUE(Reduce(&x, &y, 1, DType::kI32, ReduceOp::kSum).ok());
  EXPECT_EQ(x, std::numeric_limits<int32_t>::min());
  uint8_t u = 200, v = 200;  // 40000 = 156 * 256 + 64
  ASSERT_TRUE(Reduce(&u, &v, 1, DType::kU8, ReduceOp::kProduct).ok());
  EXPECT_EQ(u, 64);
  int32_t p = std::numeric_limits<int32_t>::max(), q = 3;  // 3 * (2^31 - 1) = 2^32 + 2^31 - 3
  ASSERT_TRUE(Reduce(&p, &q, 1, DType::kI32, ReduceOp::kProduct).ok());
  EXPECT_EQ(p, std::numeric_limits<int32_t>::max() - 2);
  uint16_t h = 0x7bff, k = 0x4000;  // 65504 * 2
  ASSERT_TRUE(Reduce(&h, &k, 1, DType::kF16, ReduceOp::kProduct).ok());
  EXPECT_EQ(h, 0x7c00);
}

TEST(ReduceManyTest, EveryDTypeOpAndFanIn) {
  std::mt19937_64 rng(13);
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : kAllReduceOps) {
      for (int k : {1, 2, 3, 8}) {
        for (size_t count : {size_t{0}, size_t{7}, size_t{4097}}) {
          SCOPED_TRACE(
              absl::StrCat(DTypeName(dtype), " ", ReduceOpName(op), " k=", k, " count=", count));
          const size_t bytes = count * DTypeSize(dtype);
          std::vector<RawBuffer> in;
          for (int j = 0; j < k; ++j) in.emplace_back(bytes, j % 4);
          std::vector<const RawBuffer*> refs;
          std::vector<const void*> ptrs;
          for (RawBuffer& b : in) {
            FillRandom(b, count, dtype, rng);
            refs.push_back(&b);
            ptrs.push_back(b.data());
          }
          RawBuffer out(bytes, 1), want(bytes, 0);
          RefReduceMany(want, refs, count, dtype, op);
          ASSERT_TRUE(ReduceMany(out.data(), ptrs.data(), k, count, dtype, op).ok());
          ExpectSameBytes(out, want, count, dtype, "ReduceMany");
          // out aliasing inputs[0] gives the same result.
          ASSERT_TRUE(ReduceMany(in[0].data(), ptrs.data(), k, count, dtype, op).ok());
          ExpectSameBytes(in[0], want, count, dtype, "ReduceMany into inputs[0]");
        }
      }
    }
  }
}

// Large odd count across the internal chunking, bf16 with one rounding: the reference
// accumulates in f32 and rounds once, which differs from rounding after every step.
TEST(ReduceManyTest, Bf16RoundsOnceOverLargeOddCount) {
  std::mt19937_64 rng(17);
  const size_t count = 100003;
  const int k = 5;
  std::vector<RawBuffer> in;
  std::vector<const RawBuffer*> refs;
  std::vector<const void*> ptrs;
  for (int j = 0; j < k; ++j) in.emplace_back(count * 2, 1);
  for (RawBuffer& b : in) {
    FillRandom(b, count, DType::kBF16, rng);
    refs.push_back(&b);
    ptrs.push_back(b.data());
  }
  RawBuffer out(count * 2, 3), want(count * 2, 0), stepwise(count * 2, 1);
  RefReduceMany(want, refs, count, DType::kBF16, ReduceOp::kSum);
  ASSERT_TRUE(ReduceMany(out.data(), ptrs.data(), k, count, DType::kBF16, ReduceOp::kSum).ok());
  ExpectSameBytes(out, want, count, DType::kBF16, "bf16 ReduceMany");
  // Repeated pairwise Reduce rounds k-1 times; with random data some elements must differ, or
  // this test could not tell the two apart.
  std::memcpy(stepwise.data(), in[0].data(), count * 2);
  for (int j = 1; j < k; ++j) {
    ASSERT_TRUE(Reduce(stepwise.data(), in[j].data(), count, DType::kBF16, ReduceOp::kSum).ok());
  }
  size_t differ = 0;
  for (size_t i = 0; i < count; ++i) differ += stepwise.Get<uint16_t>(i) != out.Get<uint16_t>(i);
  EXPECT_GT(differ, 0u);
}

// ReduceManyStreaming against the plain-loop reference: below and above the non-temporal
// threshold, counts that end mid-chunk and mid-line, outputs at every alignment within 16 bytes
// (unaligned heads and tails), and the bytes around the output left untouched.
TEST(ReduceManyStreamingTest, MatchesReferenceAtEveryAlignment) {
  std::mt19937_64 rng(19);
  constexpr size_t kGuard = 64;
  for (DType dtype : kAllDTypes) {
    const size_t size = DTypeSize(dtype);
    const size_t at_threshold = kStreamingCopyMinBytes / size;
    for (ReduceOp op : kAllReduceOps) {
      const bool large = op == ReduceOp::kSum || op == ReduceOp::kMin;
      std::vector<size_t> counts = {1, 7, 1029};
      if (large) counts.insert(counts.end(), {at_threshold - 1, at_threshold, at_threshold + 1029});
      for (int k : {1, 2, 3}) {
        for (size_t count : counts) {
          for (size_t misalign : {size_t{0}, size_t{3}, size_t{8}, size_t{13}}) {
            if (!large && misalign != 3) continue;
            SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " ", ReduceOpName(op), " k=", k,
                                      " count=", count, " out+", misalign));
            const size_t bytes = count * size;
            std::vector<RawBuffer> in;
            for (int j = 0; j < k; ++j) in.emplace_back(bytes, (j * 5) % 16);
            std::vector<const RawBuffer*> refs;
            std::vector<const void*> ptrs;
            for (RawBuffer& b : in) {
              FillRandom(b, count, dtype, rng);
              refs.push_back(&b);
              ptrs.push_back(b.data());
            }
            RawBuffer want(bytes, 0);
            RefReduceMany(want, refs, count, dtype, op);
            RawBuffer out(bytes + 2 * kGuard, misalign);
            std::memset(out.data(), 0xEE, bytes + 2 * kGuard);
            std::byte* dst = out.data() + kGuard;
            ASSERT_TRUE(ReduceManyStreaming(dst, ptrs.data(), k, count, dtype, op).ok());
            for (size_t i = 0; i < count; ++i) {
              ASSERT_EQ(std::memcmp(dst + i * size, want.data() + i * size, size), 0)
                  << "element " << i << ": want " << RefLoad(want, i, dtype);
            }
            for (size_t i = 0; i < kGuard; ++i) {
              ASSERT_EQ(out.data()[i], std::byte{0xEE}) << "guard byte " << i << " before";
              ASSERT_EQ(dst[bytes + i], std::byte{0xEE}) << "guard byte " << i << " after";
            }
          }
        }
      }
    }
  }
}

// The output may be one of the inputs, as for ReduceMany, also on the non-temporal path.
TEST(ReduceManyStreamingTest, IntoAnInput) {
  std::mt19937_64 rng(23);
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kI8}) {
    const size_t count = kStreamingCopyMinBytes / DTypeSize(dtype) + 4099;
    const size_t bytes = count * DTypeSize(dtype);
    RawBuffer a(bytes, 1), b(bytes, 2), want(bytes, 0);
    FillRandom(a, count, dtype, rng);
    FillRandom(b, count, dtype, rng);
    RefReduceMany(want, {&a, &b}, count, dtype, ReduceOp::kSum);
    const void* ptrs[] = {a.data(), b.data()};
    ASSERT_TRUE(ReduceManyStreaming(b.data(), ptrs, 2, count, dtype, ReduceOp::kSum).ok());
    ExpectSameBytes(b, want, count, dtype, absl::StrCat(DTypeName(dtype), " into inputs[1]"));
  }
}

TEST(ReduceManyStreamingTest, RejectsBadArguments) {
  float x = 0;
  const void* ptrs[] = {&x, nullptr};
  EXPECT_EQ(ReduceManyStreaming(&x, ptrs, 0, 1, DType::kF32, ReduceOp::kSum).code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status s = ReduceManyStreaming(&x, ptrs, 2, 1, DType::kF32, ReduceOp::kSum);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("ReduceManyStreaming: inputs[1]"));
  EXPECT_TRUE(ReduceManyStreaming(nullptr, nullptr, 1, 0, DType::kF32, ReduceOp::kSum).ok());
}

TEST(ReduceManyTest, RejectsBadArguments) {
  float x = 0;
  const void* ptrs[] = {&x, nullptr};
  EXPECT_EQ(ReduceMany(&x, ptrs, 0, 1, DType::kF32, ReduceOp::kSum).code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status s = ReduceMany(&x, ptrs, 2, 1, DType::kF32, ReduceOp::kSum);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("inputs[1]"));
  EXPECT_TRUE(ReduceMany(nullptr, nullptr, 1, 0, DType::kF32, ReduceOp::kSum).ok());
}

// Reference of Scale for one element, per the contract in host_kernels.h.
void RefScale(RawBuffer& b, size_t count, DType dtype, double factor) {
  const double n = std::round(1 / factor);
  const bool divide = factor > 0 && n >= 1 && std::fabs(1 / factor - n) <= 1e-9 * n;
  for (size_t i = 0; i < count; ++i) {
    switch (dtype) {
      case DType::kF32:
        b.Set<float>(i, b.Get<float>(i) * static_cast<float>(factor));
        break;
      case DType::kF64:
        b.Set<double>(i, b.Get<double>(i) * factor);
        break;
      case DType::kF16:
      case DType::kBF16: {
        const HalfFormat& f = dtype == DType::kF16 ? kF16Format : kBf16Format;
        const RefRounder& r = dtype == DType::kF16 ? F16Ref() : Bf16Ref();
        const float v = static_cast<float>(RefDecode(f, b.Get<uint16_t>(i)));
        b.Set<uint16_t>(i, r.Round(v * static_cast<float>(factor)));
        break;
      }
#define SL_REF_SCALE_CASE(D, T)                                                       \
  case D: {                                                                           \
    const T v = b.Get<T>(i);                                                          \
    if (divide) {                                                                     \
      b.Set<T>(i, static_cast<T>(static_cast<int64_t>(v) / static_cast<int64_t>(n))); \
    } else {                                                                          \
      const long double p = std::trunc(static_cast<long double>(v) * factor);         \
      const long double lo = std::numeric_limits<T>::min();                           \
      const long double hi = std::numeric_limits<T>::max();                           \
      b.Set<T>(i, p <= lo   ? std::numeric_limits<T>::min()                           \
                  : p >= hi ? std::numeric_limits<T>::max()                           \
                            : static_cast<T>(p));                                     \
    }                                                                                 \
    break;                                                                            \
  }
        SL_REF_SCALE_CASE(DType::kI8, int8_t)
        SL_REF_SCALE_CASE(DType::kU8, uint8_t)
        SL_REF_SCALE_CASE(DType::kI32, int32_t)
        SL_REF_SCALE_CASE(DType::kI64, int64_t)
#undef SL_REF_SCALE_CASE
    }
  }
}

TEST(ScaleTest, EveryDTypeAndFactor) {
  std::mt19937_64 rng(19);
  for (DType dtype : kAllDTypes) {
    for (double factor : {1.0 / 3, 0.125, 1.0, 1.0 / 7, -0.5, 2.5, 0.0}) {
      for (size_t count : kCounts) {
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " factor=", factor, " count=", count));
        RawBuffer a(count * DTypeSize(dtype), 3);
        FillRandom(a, count, dtype, rng);
        if (!IsFloatingPoint(dtype) && DTypeSize(dtype) == 8) {
          // Keep i64 magnitudes where double multiplication is exact enough to compare.
          for (size_t i = 0; i < count; ++i) a.Set<int64_t>(i, a.Get<int64_t>(i) >> 20);
        }
        RawBuffer want = a;
        RefScale(want, count, dtype, factor);
        ASSERT_TRUE(Scale(a.data(), count, dtype, factor).ok());
        ExpectSameBytes(a, want, count, dtype, "Scale");
      }
    }
  }
}

TEST(ScaleTest, IntegerAverageTruncatesTowardZero) {
  int32_t v[] = {7, -7, 6, -6, 2, -2};
  ASSERT_TRUE(Scale(v, 6, DType::kI32, 1.0 / 3).ok());
  EXPECT_THAT(v, ::testing::ElementsAre(2, -2, 2, -2, 0, 0));
  EXPECT_EQ(Scale(v, 6, DType::kI32, std::nan("")).code(), absl::StatusCode::kInvalidArgument);
}

// Avg = Sum then Scale(1/n), every dtype.
TEST(ScaleTest, AverageOfThree) {
  std::mt19937_64 rng(23);
  const size_t count = 4097;
  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(DTypeName(dtype));
    const size_t bytes = count * DTypeSize(dtype);
    RawBuffer a(bytes, 1), b(bytes, 2), c(bytes, 3), out(bytes, 1), want(bytes, 0);
    FillRandom(a, count, dtype, rng);
    FillRandom(b, count, dtype, rng);
    FillRandom(c, count, dtype, rng);
    RefReduceMany(want, {&a, &b, &c}, count, dtype, ReduceOp::kAvg);
    RefScale(want, count, dtype, 1.0 / 3);
    const void* ptrs[] = {a.data(), b.data(), c.data()};
    ASSERT_TRUE(ReduceMany(out.data(), ptrs, 3, count, dtype, ReduceOp::kAvg).ok());
    ASSERT_TRUE(Scale(out.data(), count, dtype, 1.0 / 3).ok());
    ExpectSameBytes(out, want, count, dtype, "avg");
  }
}

}  // namespace
}  // namespace shardline
