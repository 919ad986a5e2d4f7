// File: tests/runtime/random_layout.h
// -----------------------------------------------------------------------------
// Random FlatLayout specs and options for the property tests of flat_layout and reshard_plan:
// 1-200 tensors (mostly few), shapes with zeros, ones and primes, every dtype, explicit ties,
// 1-16 shards, alignments from one element to 256 bytes, odd and power-of-two blocks. Buffers
// stay small (a few thousand elements) so thousands of layouts run in well under a second.

#ifndef SHARDLINE_TESTS_RUNTIME_RANDOM_LAYOUT_H_
#define SHARDLINE_TESTS_RUNTIME_RANDOM_LAYOUT_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/dtype.h"
#include "runtime/flat_layout.h"
#include "tests/common/sanitizers.h"

namespace shardline::testing {

// Sanitizer builds run the same properties over fewer layouts.
inline int IterationScale() { return UnderSanitizer() ? 2 : 1; }

inline int UniformInt(std::mt19937_64& rng, int lo, int hi) {
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}

inline std::vector<int64_t> RandomShape(std::mt19937_64& rng) {
  static constexpr int64_t kDims[] = {0, 1, 1, 2, 3, 5, 7, 11, 13, 17, 31};
  for (;;) {
    const int rank = UniformInt(rng, 0, 4);
    std::vector<int64_t> shape;
    int64_t numel = 1;
    for (int d = 0; d < rank; ++d) {
      // Zeros are rarer than the table suggests: one tensor in ~25 is empty.
      int64_t dim = kDims[UniformInt(rng, 0, std::size(kDims) - 1)];
      if (dim == 0 && UniformInt(rng, 0, 5) != 0) dim = 1;
      shape.push_back(dim);
      numel *= dim;
    }
    if (numel <= 400) return shape;
  }
}

inline int RandomTensorCount(std::mt19937_64& rng) {
  const int r = UniformInt(rng, 0, 99);
  if (r < 50) return UniformInt(rng, 1, 8);
  if (r < 88) return UniformInt(rng, 1, 60);
  return UniformInt(rng, 1, 200);
}

// Specs named "t<i>"; about one in twelve (after the first) is a tie "tie<i>" to an earlier spec
// (possibly to another tie).
inline std::vector<TensorSpec> RandomSpecs(std::mt19937_64& rng, int count) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < count; ++i) {
    TensorSpec spec;
    if (i > 0 && UniformInt(rng, 0, 11) == 0) {
      const TensorSpec& target = specs[UniformInt(rng, 0, i - 1)];
      spec.name = absl::StrCat("tie", i);
      spec.shape = target.shape;
      spec.dtype = target.dtype;
      spec.tied_to = target.name;
    } else {
      spec.name = absl::StrCat("t", i);
      spec.shape = RandomShape(rng);
      spec.dtype = kAllDTypes[UniformInt(rng, 0, kAllDTypes.size() - 1)];
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

// Options for `element_dtype`: a valid power-of-two alignment of at least one element.
inline FlatLayoutOptions RandomOptions(std::mt19937_64& rng, DType element_dtype) {
  FlatLayoutOptions options;
  options.element_dtype = element_dtype;
  options.num_shards = UniformInt(rng, 0, 3) == 0 ? 1 : UniformInt(rng, 1, 16);
  static constexpr size_t kAlignments[] = {1, 2, 4, 8, 16, 16, 16, 64, 256};
  size_t align = kAlignments[UniformInt(rng, 0, std::size(kAlignments) - 1)];
  if (align < DTypeSize(element_dtype)) align = DTypeSize(element_dtype);
  options.alignment_bytes = align;
  static constexpr size_t kBlocks[] = {1, 1, 1, 2, 3, 8, 64};
  options.block_elements = kBlocks[UniformInt(rng, 0, std::size(kBlocks) - 1)];
  return options;
}

inline DType RandomDType(std::mt19937_64& rng) {
  return kAllDTypes[UniformInt(rng, 0, kAllDTypes.size() - 1)];
}

// Fills `bytes` with random bytes.
inline void FillRandom(std::mt19937_64& rng, std::vector<uint8_t>& bytes) {
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
}

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_RUNTIME_RANDOM_LAYOUT_H_
