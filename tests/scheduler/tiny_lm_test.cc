// TinyLM (examples/model): gradients against central finite differences of an independent f64
// forward (every element of every tensor, the tied embedding included), recompute gives
// bit-identical gradients and the documented hook sequence, a batch split in pieces sums to the
// whole batch, AdamW against a plain f64 loop and bit-exact over shards, the synthetic data's
// slicing, input validation, the reference's call-discipline checks, and training reduces loss.
#include "examples/model/tiny_lm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "runtime/flat_layout.h"

namespace shardline::examples {
namespace {

using Tensors = std::vector<std::vector<std::vector<float>>>;     // [unit][tensor][element]
using Tensors64 = std::vector<std::vector<std::vector<double>>>;  // same, f64

// A small odd-sized config: every dimension differs, none a multiple of 8 (the Dot blocking).
ModelConfig TinyConfig() {
  return ModelConfig{
      .vocab = 7, .dim = 5, .hidden = 9, .blocks = 3, .tokens_per_rank = 6, .seed = 11};
}

// Deterministic values in [-1, 1): a hashed pattern independent of the model's own hashing.
float Pattern(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t x = a * 0x9e3779b97f4a7c15ULL ^ (b + 0x632be59bd9b4e019ULL) * 0xc2b2ae3d27d4eb4fULL ^
               (c + 1) * 0x165667b19e3779f9ULL;
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 32;
  return static_cast<float>(static_cast<int64_t>(x >> 40) - (int64_t{1} << 23)) /
         static_cast<float>(int64_t{1} << 23);
}

// Overwrites every parameter (biases included) with `scale` * Pattern, so that no gradient is
// trivially small.
void RandomizeParams(ReferenceAccess& access, float scale, uint64_t salt) {
  const int units = access.config().num_units();
  for (int u = 0; u < units; ++u) {
    for (int t = 0; t < static_cast<int>(access.params()[u].size()); ++t) {
      std::vector<float>& p = access.param(u, t);
      for (size_t e = 0; e < p.size(); ++e) p[e] = scale * Pattern(salt, u * 16 + t, e);
    }
  }
}

// A batch with repeated tokens, a token equal to its target and a token that is another's target.
std::vector<Example> TinyBatch() { return {{3, 5}, {0, 0}, {6, 2}, {3, 1}, {5, 3}, {2, 6}}; }

// ---- An independent f64 forward (plain loops) ----------------------------------------------

double Gelu64(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

double ReferenceLoss(const ModelConfig& c, const Tensors64& p, const std::vector<Example>& batch,
                     int denominator) {
  const int V = c.vocab, D = c.dim, H = c.hidden;
  const std::vector<double>& E = p[0][0];
  const std::vector<double>& bias = p[0][1];
  double total = 0.0;
  for (const Example& ex : batch) {
    std::vector<double> h(E.begin() + ex.token * D, E.begin() + (ex.token + 1) * D);
    for (int i = 1; i <= c.blocks; ++i) {
      const auto& w1 = p[i][0];
      const auto& b1 = p[i][1];
      const auto& w2 = p[i][2];
      const auto& b2 = p[i][3];
      std::vector<double> a(H);
      for (int j = 0; j < H; ++j) {
        double u = b1[j];
        for (int k = 0; k < D; ++k) u += w1[j * D + k] * h[k];
        a[j] = Gelu64(u);
      }
      std::vector<double> out(D);
      for (int r = 0; r < D; ++r) {
        double s = b2[r];
        for (int j = 0; j < H; ++j) s += w2[r * H + j] * a[j];
        out[r] = h[r] + s;
      }
      h = out;
    }
    std::vector<double> logits(V);
    for (int v = 0; v < V; ++v) {
      double s = bias[v];
      for (int k = 0; k < D; ++k) s += E[v * D + k] * h[k];
      logits[v] = s;
    }
    const double m = *std::max_element(logits.begin(), logits.end());
    double sum = 0.0;
    for (double l : logits) sum += std::exp(l - m);
    total += m + std::log(sum) - logits[ex.target];
  }
  return total / denominator;
}

Tensors64 ToF64(const Tensors& t) {
  Tensors64 out(t.size());
  for (size_t u = 0; u < t.size(); ++u) {
    for (const auto& tensor : t[u]) out[u].emplace_back(tensor.begin(), tensor.end());
  }
  return out;
}

std::string LogString(const std::vector<HookCall>& log) {
  std::ostringstream os;
  for (size_t i = 0; i < log.size(); ++i) os << (i ? " " : "") << log[i];
  return os.str();
}

// Bitwise equality of every gradient element.
void ExpectBitIdentical(const Tensors& a, const Tensors& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t u = 0; u < a.size(); ++u) {
    ASSERT_EQ(a[u].size(), b[u].size());
    for (size_t t = 0; t < a[u].size(); ++t) {
      ASSERT_EQ(a[u][t].size(), b[u][t].size());
      for (size_t e = 0; e < a[u][t].size(); ++e) {
        uint32_t x, y;
        std::memcpy(&x, &a[u][t][e], 4);
        std::memcpy(&y, &b[u][t][e], 4);
        ASSERT_EQ(x, y) << "unit " << u << " tensor " << t << " element " << e << ": " << a[u][t][e]
                        << " vs " << b[u][t][e];
      }
    }
  }
}

// ---- Gradients -------------------------------------------------------------------------------

TEST(TinyLmTest, GradientsMatchFiniteDifferencesOfAnF64Forward) {
  const ModelConfig c = TinyConfig();
  const std::vector<Example> batch = TinyBatch();
  const int denominator = 9;  // not the batch size: the loss is sum / denominator
  for (bool recompute : {false, true}) {
    SCOPED_TRACE(recompute ? "recompute" : "no recompute");
    ReferenceAccess access(c);
    RandomizeParams(access, 0.7f, 3);
    // Non-zero starting gradients: the model must add, not overwrite.
    Tensors start = access.grads();
    for (size_t u = 0; u < start.size(); ++u) {
      for (size_t t = 0; t < start[u].size(); ++t) {
        for (size_t e = 0; e < start[u][t].size(); ++e) {
          start[u][t][e] = 0.25f * Pattern(99, u * 16 + t, e);
        }
        access.grad(u, t) = start[u][t];
      }
    }
    absl::StatusOr<double> loss =
        TrainStepForwardBackward(c, access, batch, denominator, {.recompute = recompute});
    ASSERT_TRUE(loss.ok()) << loss.status();
    ASSERT_TRUE(access.status().ok()) << access.status();

    Tensors64 p = ToF64(access.params());
    const double ref_loss = ReferenceLoss(c, p, batch, denominator);
    EXPECT_NEAR(*loss, ref_loss, 1e-5 * std::abs(ref_loss));

    const double step = 1e-5;
    for (int u = 0; u < c.num_units(); ++u) {
      for (size_t t = 0; t < p[u].size(); ++t) {
        double max_abs = 0.0;
        for (size_t e = 0; e < p[u][t].size(); ++e) {
          const double saved = p[u][t][e];
          p[u][t][e] = saved + step;
          const double plus = ReferenceLoss(c, p, batch, denominator);
          p[u][t][e] = saved - step;
          const double minus = ReferenceLoss(c, p, batch, denominator);
          p[u][t][e] = saved;
          const double fd = (plus - minus) / (2 * step);
          const double got = access.grads()[u][t][e] - start[u][t][e];
          max_abs = std::max(max_abs, std::abs(fd));
          EXPECT_NEAR(got, fd, 2e-6 + 1e-4 * std::abs(fd))
              << "unit " << u << " tensor " << t << " element " << e;
        }
        // Every tensor takes part: a dropped gradient would be caught above, not pass as zero.
        EXPECT_GT(max_abs, 1e-3) << "unit " << u << " tensor " << t;
      }
    }
  }
}

TEST(TinyLmTest, RecomputeGivesBitIdenticalGradientsAndTheDocumentedHookOrder) {
  const ModelConfig c = TinyConfig();
  const std::vector<Example> batch = TinyBatch();
  ReferenceAccess plain(c), recomputed(c);
  RandomizeParams(plain, 0.7f, 5);
  RandomizeParams(recomputed, 0.7f, 5);
  absl::StatusOr<double> a = TrainStepForwardBackward(c, plain, batch, 6, {});
  absl::StatusOr<double> b = TrainStepForwardBackward(c, recomputed, batch, 6, {.recompute = true});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*a, *b);
  ExpectBitIdentical(plain.grads(), recomputed.grads());

  EXPECT_EQ(LogString(plain.log()),
            "F+0 F-0 F+1 F-1 F+2 F-2 F+3 F-3 F+0 F-0 "
            "B+0 B-0 B+3 B-3 B+2 B-2 B+1 B-1 B+0 B-0");
  EXPECT_EQ(LogString(recomputed.log()),
            "F+0 F-0 F+1 F-1 F+2 F-2 F+3 F-3 F+0 F-0 "
            "B+0 B-0 F+3 F-3 B+3 B-3 F+2 F-2 B+2 B-2 F+1 F-1 B+1 B-1 B+0 B-0");
  EXPECT_EQ(plain.log(), ExpectedHookSequence(c, {}));
  EXPECT_EQ(recomputed.log(), ExpectedHookSequence(c, {.recompute = true}));
  EXPECT_TRUE(plain.status().ok()) << plain.status();
  EXPECT_TRUE(recomputed.status().ok()) << recomputed.status();
}

TEST(TinyLmTest, RecomputeIsBitIdenticalOnTheDefaultConfig) {
  const ModelConfig c;
  absl::StatusOr<std::vector<Example>> batch = SyntheticBatch(c, 3, 0, 0, 1);
  ASSERT_TRUE(batch.ok()) << batch.status();
  ReferenceAccess plain(c), recomputed(c);
  ASSERT_TRUE(TrainStepForwardBackward(c, plain, *batch, 64, {}).ok());
  ASSERT_TRUE(TrainStepForwardBackward(c, recomputed, *batch, 64, {.recompute = true}).ok());
  ExpectBitIdentical(plain.grads(), recomputed.grads());
}

TEST(TinyLmTest, SkippedBackwardsCallNoHooksAndPassTheGradientThroughTheResidual) {
  const ModelConfig c = TinyConfig();
  const std::vector<Example> batch = TinyBatch();
  for (bool recompute : {false, true}) {
    SCOPED_TRACE(recompute ? "recompute" : "no recompute");
    StepOptions options{.recompute = recompute, .skip_backward = {false, false, true, false}};
    ReferenceAccess access(c);
    RandomizeParams(access, 0.7f, 8);
    ASSERT_TRUE(TrainStepForwardBackward(c, access, batch, 6, options).ok());
    EXPECT_EQ(LogString(access.log()), recompute ? "F+0 F-0 F+1 F-1 F+2 F-2 F+3 F-3 F+0 F-0 "
                                                   "B+0 B-0 F+3 F-3 B+3 B-3 F+1 F-1 B+1 B-1 B+0 B-0"
                                                 : "F+0 F-0 F+1 F-1 F+2 F-2 F+3 F-3 F+0 F-0 "
                                                   "B+0 B-0 B+3 B-3 B+1 B-1 B+0 B-0");
    EXPECT_EQ(access.log(), ExpectedHookSequence(c, options));
    for (const auto& g : access.grads()[2]) {
      EXPECT_TRUE(std::all_of(g.begin(), g.end(), [](float x) { return x == 0.0f; }));
    }

    // Block 3's backward runs before the skipped block: as in a normal step. Block 1 receives
    // dh_1 = dh_2 (the residual only): not zero, and not the normal step's gradient.
    ReferenceAccess normal(c);
    RandomizeParams(normal, 0.7f, 8);
    ASSERT_TRUE(TrainStepForwardBackward(c, normal, batch, 6, {}).ok());
    ExpectBitIdentical({access.grads()[3]}, {normal.grads()[3]});
    const std::vector<float>& skip_w1 = access.grads()[1][kW1];
    EXPECT_TRUE(std::any_of(skip_w1.begin(), skip_w1.end(), [](float x) { return x != 0.0f; }));
    EXPECT_NE(skip_w1, normal.grads()[1][kW1]);
  }

  // Skipping unit 0 skips both of its backward uses; the blocks run on a zero gradient.
  StepOptions options{.skip_backward = {true, false, false, false}};
  ReferenceAccess access(c);
  RandomizeParams(access, 0.7f, 8);
  ASSERT_TRUE(TrainStepForwardBackward(c, access, batch, 6, options).ok());
  EXPECT_EQ(LogString(access.log()),
            "F+0 F-0 F+1 F-1 F+2 F-2 F+3 F-3 F+0 F-0 B+3 B-3 B+2 B-2 B+1 B-1");
  for (const auto& unit : access.grads()) {
    for (const auto& g : unit) {
      EXPECT_TRUE(std::all_of(g.begin(), g.end(), [](float x) { return x == 0.0f; }));
    }
  }
}

TEST(TinyLmTest, BatchPiecesWithTheGlobalDenominatorSumToTheWholeBatch) {
  const ModelConfig c;
  absl::StatusOr<std::vector<Example>> batch = SyntheticBatch(c, 4, 2, 0, 2);
  ASSERT_TRUE(batch.ok()) << batch.status();
  const int n = static_cast<int>(batch->size());
  const absl::Span<const Example> all(*batch);

  ReferenceAccess whole(c), first(c), second(c), accumulated(c);
  absl::StatusOr<double> lw = TrainStepForwardBackward(c, whole, all, n, {});
  absl::StatusOr<double> l1 = TrainStepForwardBackward(c, first, all.subspan(0, 27), n, {});
  absl::StatusOr<double> l2 = TrainStepForwardBackward(c, second, all.subspan(27), n, {});
  ASSERT_TRUE(lw.ok() && l1.ok() && l2.ok());
  EXPECT_NEAR(*l1 + *l2, *lw, 1e-12 * *lw);
  // Separate buffers, summed afterwards (what a cross-rank reduction does): equal up to f32
  // rounding of the sum.
  double worst = 0.0;
  for (int u = 0; u < c.num_units(); ++u) {
    for (size_t t = 0; t < whole.grads()[u].size(); ++t) {
      const auto& w = whole.grads()[u][t];
      double scale = 0.0;
      for (float x : w) scale = std::max(scale, static_cast<double>(std::abs(x)));
      ASSERT_GT(scale, 0.0) << "unit " << u << " tensor " << t;
      for (size_t e = 0; e < w.size(); ++e) {
        const double sum = static_cast<double>(first.grads()[u][t][e]) + second.grads()[u][t][e];
        const double rel = std::abs(sum - w[e]) / scale;
        worst = std::max(worst, rel);
        ASSERT_LE(rel, 1e-6) << "unit " << u << " tensor " << t << " element " << e << ": " << sum
                             << " vs " << w[e];
      }
    }
  }
  std::cout << "worst relative difference of the summed pieces: " << worst << "\n";
  // One buffer, the two pieces one after the other (micro-batching): bit-identical for every
  // tensor used once; embed.weight's two uses interleave differently (head 1, embedding 1, head
  // 2, embedding 2), so it matches only up to rounding.
  ASSERT_TRUE(TrainStepForwardBackward(c, accumulated, all.subspan(0, 27), n, {}).ok());
  ASSERT_TRUE(TrainStepForwardBackward(c, accumulated, all.subspan(27), n, {}).ok());
  Tensors a = whole.grads(), b = accumulated.grads();
  float embed_scale = 0.0f;
  for (float x : a[0][kEmbedWeight]) embed_scale = std::max(embed_scale, std::abs(x));
  for (size_t e = 0; e < a[0][kEmbedWeight].size(); ++e) {
    EXPECT_NEAR(a[0][kEmbedWeight][e], b[0][kEmbedWeight][e], 1e-6 * embed_scale);
  }
  a[0][kEmbedWeight].clear();
  b[0][kEmbedWeight].clear();
  ExpectBitIdentical(a, b);
}

// ---- Training --------------------------------------------------------------------------------

TEST(TinyLmTest, TrainingTheDefaultConfigReducesTheLoss) {
  const ModelConfig c;
  ReferenceAccess access(c);
  absl::StatusOr<std::vector<double>> losses = TrainReference(c, 20, 1, 1, {}, access);
  ASSERT_TRUE(losses.ok()) << losses.status();
  ASSERT_EQ(losses->size(), 20u);
  std::ostringstream all;
  for (double l : *losses) all << l << " ";
  std::cout << "losses: " << all.str() << "\n";
  EXPECT_NEAR((*losses)[0], std::log(96.0), 0.5) << all.str();
  EXPECT_LT(losses->back(), 0.7 * losses->front()) << all.str();
  EXPECT_TRUE(access.status().ok()) << access.status();
}

TEST(TinyLmTest, RecomputeReproducesTrainingExactlyAndMicroBatchesClosely) {
  ModelConfig c;
  c.blocks = 3;
  c.tokens_per_rank = 21;
  const int steps = 5;
  ReferenceAccess one(c), micro(c), recompute(c);
  absl::StatusOr<std::vector<double>> a = TrainReference(c, steps, 2, 1, {}, one);
  absl::StatusOr<std::vector<double>> b = TrainReference(c, steps, 2, 5, {}, micro);
  absl::StatusOr<std::vector<double>> r =
      TrainReference(c, steps, 2, 1, {.step = {.recompute = true}}, recompute);
  ASSERT_TRUE(a.ok() && b.ok() && r.ok());
  EXPECT_EQ(*a, *r);
  ExpectBitIdentical(one.params(), recompute.params());
  double worst_loss = 0.0, worst_param = 0.0;
  for (int s = 0; s < steps; ++s) {
    worst_loss = std::max(worst_loss, std::abs((*a)[s] - (*b)[s]) / (*a)[s]);
  }
  for (int u = 0; u < c.num_units(); ++u) {
    for (size_t t = 0; t < one.params()[u].size(); ++t) {
      for (size_t e = 0; e < one.params()[u][t].size(); ++e) {
        worst_param = std::max(worst_param, std::abs(static_cast<double>(one.params()[u][t][e]) -
                                                     micro.params()[u][t][e]));
      }
    }
  }
  std::cout << "micro-batching: worst relative loss difference " << worst_loss
            << ", worst parameter difference " << worst_param << "\n";
  EXPECT_LT(worst_loss, 1e-6);
  EXPECT_LT(worst_param, 1e-4);
}

// ---- AdamW -----------------------------------------------------------------------------------

TEST(TinyLmTest, AdamWMatchesAnF64LoopAndIsElementwiseOverShards) {
  const AdamW o{.lr = 0.01f, .beta1 = 0.8f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.1f};
  const size_t n = 37;
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
  for (size_t i = 0; i < n; ++i) p[i] = Pattern(1, 0, i);
  std::vector<double> p64(p.begin(), p.end()), m64(n, 0.0), v64(n, 0.0);
  std::vector<float> ps = p, ms = m, vs = v;  // updated shard by shard
  for (int step = 1; step <= 3; ++step) {
    std::vector<float> g(n);
    for (size_t i = 0; i < n; ++i) g[i] = Pattern(2, step, i) * (i % 5 == 0 ? 0.0f : 1.0f);
    AdamWStep(o, step, p.data(), g.data(), m.data(), v.data(), n);
    for (size_t begin : {size_t{0}, size_t{10}, size_t{11}, size_t{30}}) {
      const size_t end = begin == 30 ? n : (begin == 0 ? 10 : (begin == 10 ? 11 : 30));
      AdamWStep(o, step, ps.data() + begin, g.data() + begin, ms.data() + begin, vs.data() + begin,
                end - begin);
    }
    for (size_t i = 0; i < n; ++i) {
      m64[i] = 0.8 * m64[i] + 0.2 * g[i];
      v64[i] = 0.95 * v64[i] + 0.05 * double{g[i]} * g[i];
      const double mh = m64[i] / (1 - std::pow(0.8, step));
      const double vh = v64[i] / (1 - std::pow(0.95, step));
      p64[i] = p64[i] * (1 - 0.01 * 0.1) - 0.01 * mh / (std::sqrt(vh) + 1e-6);
      EXPECT_NEAR(p[i], p64[i], 1e-6) << "step " << step << " element " << i;
    }
  }
  EXPECT_EQ(std::memcmp(p.data(), ps.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(m.data(), ms.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(v.data(), vs.data(), n * 4), 0);
}

// ---- Units, init, data -----------------------------------------------------------------------

TEST(TinyLmTest, UnitsNameEveryTensorWithItsShapeAndFormValidLayouts) {
  const ModelConfig c = TinyConfig();
  const std::vector<UnitDef> units = ModelUnits(c);
  ASSERT_EQ(units.size(), 4u);
  EXPECT_EQ(units[0].name, "embed");
  ASSERT_EQ(units[0].tensors.size(), 2u);
  EXPECT_EQ(units[0].tensors[kEmbedWeight].name, "embed.weight");
  EXPECT_EQ(units[0].tensors[kEmbedWeight].shape, (std::vector<int64_t>{7, 5}));
  EXPECT_EQ(units[0].tensors[kHeadBias].name, "head.bias");
  EXPECT_EQ(units[0].tensors[kHeadBias].shape, (std::vector<int64_t>{7}));
  for (int i = 1; i <= 3; ++i) {
    const std::string p = "block" + std::to_string(i) + ".";
    EXPECT_EQ(units[i].name, "block" + std::to_string(i));
    ASSERT_EQ(units[i].tensors.size(), 4u);
    EXPECT_EQ(units[i].tensors[kW1].name, p + "w1");
    EXPECT_EQ(units[i].tensors[kW1].shape, (std::vector<int64_t>{9, 5}));
    EXPECT_EQ(units[i].tensors[kB1].name, p + "b1");
    EXPECT_EQ(units[i].tensors[kB1].shape, (std::vector<int64_t>{9}));
    EXPECT_EQ(units[i].tensors[kW2].name, p + "w2");
    EXPECT_EQ(units[i].tensors[kW2].shape, (std::vector<int64_t>{5, 9}));
    EXPECT_EQ(units[i].tensors[kB2].name, p + "b2");
    EXPECT_EQ(units[i].tensors[kB2].shape, (std::vector<int64_t>{5}));
  }
  for (int u = 0; u < 4; ++u) {
    for (const TensorSpec& spec : units[u].tensors) EXPECT_EQ(spec.dtype, DType::kF32);
    for (size_t t = 0; t < units[u].tensors.size(); ++t) {
      size_t numel = 1;
      for (int64_t dim : units[u].tensors[t].shape) numel *= dim;
      EXPECT_EQ(TensorNumel(c, u, static_cast<int>(t)), numel);
    }
    absl::StatusOr<FlatLayout> layout =
        FlatLayout::Create(units[u].tensors, {.num_shards = 3, .element_dtype = DType::kF32});
    EXPECT_TRUE(layout.ok()) << layout.status();
  }
}

TEST(TinyLmTest, InitIsDeterministicSeededAndScaled) {
  ModelConfig c;
  std::vector<std::vector<float>> a, b, other;
  for (int u : {0, 1, 10}) {
    InitUnit(c, u, a);
    InitUnit(c, u, b);
    ModelConfig c2 = c;
    c2.seed = 2;
    InitUnit(c2, u, other);
    ASSERT_EQ(a.size(), u == 0 ? 2u : 4u);
    EXPECT_EQ(a, b);
    EXPECT_NE(a, other);
    for (size_t t = 0; t < a.size(); ++t) {
      EXPECT_EQ(a[t].size(), TensorNumel(c, u, static_cast<int>(t)));
      const bool bias = (u == 0 && t == kHeadBias) || (u > 0 && (t == kB1 || t == kB2));
      float max_abs = 0.0f;
      for (float x : a[t]) max_abs = std::max(max_abs, std::abs(x));
      if (bias) {
        EXPECT_EQ(max_abs, 0.0f);
      } else {
        EXPECT_GT(max_abs, 0.0f);
        EXPECT_LT(max_abs, 1.0f);
      }
    }
  }
  // Units differ from each other.
  InitUnit(c, 1, a);
  InitUnit(c, 2, b);
  EXPECT_NE(a, b);
}

TEST(TinyLmTest, SyntheticBatchSlicesOneGlobalBatchAndIsLearnable) {
  const ModelConfig c;
  std::vector<Example> global;
  for (int r = 0; r < 3; ++r) {
    absl::StatusOr<std::vector<Example>> slice = SyntheticBatch(c, 9, 4, r, 3);
    ASSERT_TRUE(slice.ok()) << slice.status();
    ASSERT_EQ(slice->size(), 64u);
    global.insert(global.end(), slice->begin(), slice->end());
  }
  // Rank 0 of a smaller world is the start of the same global batch; other steps and seeds
  // differ.
  absl::StatusOr<std::vector<Example>> r0 = SyntheticBatch(c, 9, 4, 0, 1);
  ASSERT_TRUE(r0.ok());
  EXPECT_TRUE(std::equal(r0->begin(), r0->end(), global.begin()));
  EXPECT_NE(*SyntheticBatch(c, 9, 5, 0, 1), *r0);
  EXPECT_NE(*SyntheticBatch(c, 10, 4, 0, 1), *r0);
  int rule = 0;
  std::vector<int> seen(c.vocab, 0);
  for (const Example& ex : global) {
    ASSERT_GE(ex.token, 0);
    ASSERT_LT(ex.token, c.vocab);
    ASSERT_GE(ex.target, 0);
    ASSERT_LT(ex.target, c.vocab);
    rule += ex.target == (5 * ex.token + 3) % c.vocab;
    ++seen[ex.token];
  }
  EXPECT_GT(rule, 0.8 * global.size());
  EXPECT_LT(rule, global.size());  // some noise
  EXPECT_GT(std::count_if(seen.begin(), seen.end(), [](int k) { return k > 0; }), c.vocab / 2);

  EXPECT_EQ(SyntheticBatch(c, 9, 0, 3, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SyntheticBatch(c, 9, 0, -1, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SyntheticBatch(c, 9, 0, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SyntheticBatch(c, 9, -1, 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
}

// ---- Validation and the call discipline ------------------------------------------------------

TEST(TinyLmTest, BadInputIsAnInvalidArgumentNamingIt) {
  const ModelConfig c = TinyConfig();
  ReferenceAccess access(c);
  std::vector<Example> batch = TinyBatch();
  auto expect = [&](absl::Status status, const char* needle) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), needle)) << status;
  };
  batch[4].target = 7;
  expect(TrainStepForwardBackward(c, access, batch, 6, {}).status(), "example 4");
  batch[4].target = 1;
  batch[2].token = -1;
  expect(TrainStepForwardBackward(c, access, batch, 6, {}).status(), "example 2");
  batch[2].token = 1;
  expect(TrainStepForwardBackward(c, access, batch, 0, {}).status(), "loss_denominator");
  expect(TrainStepForwardBackward(c, access, {}, 6, {}).status(), "empty batch");
  expect(TrainStepForwardBackward(c, access, batch, 6, {.skip_backward = {true}}).status(),
         "skip_backward");
  ModelConfig bad = c;
  bad.hidden = 0;
  expect(TrainStepForwardBackward(bad, access, batch, 6, {}).status(), "hidden");
  expect(ValidateConfig(bad), "hidden");
  // Nothing ran: no hook was called, no gradient touched.
  EXPECT_TRUE(access.log().empty());
  ModelConfig other = c;
  other.seed = 12;
  expect(TrainReference(other, 1, 1, 1, {}, access).status(), "config");
  expect(TrainReference(c, 1, 1, 7, {}, access).status(), "micro_batches");
  expect(TrainReference(c, 1, 0, 1, {}, access).status(), "data_parallel_world");
}

TEST(TinyLmTest, ReferenceAccessRejectsCallsOutsideTheirWindow) {
  const ModelConfig c = TinyConfig();
  {
    ReferenceAccess access(c);
    EXPECT_EQ(access.Param(1, kW1), nullptr);
    EXPECT_EQ(access.status().code(), absl::StatusCode::kFailedPrecondition);
  }
  {
    ReferenceAccess access(c);
    ASSERT_TRUE(access.PreForward(1).ok());
    EXPECT_NE(access.Param(1, kW1), nullptr);
    EXPECT_EQ(access.Param(2, kW1), nullptr);  // another unit
    EXPECT_EQ(access.Grad(1, kW1), nullptr);   // forward: no gradient
    EXPECT_EQ(access.status().code(), absl::StatusCode::kFailedPrecondition);
  }
  {
    ReferenceAccess access(c);
    ASSERT_TRUE(access.PreBackward(2).ok());
    EXPECT_NE(access.Grad(2, kB2), nullptr);
    EXPECT_EQ(access.PreForward(1).code(), absl::StatusCode::kFailedPrecondition);   // nested
    EXPECT_EQ(access.PostForward(2).code(), absl::StatusCode::kFailedPrecondition);  // wrong kind
    EXPECT_TRUE(access.PostBackward(2).ok());
    EXPECT_EQ(access.Grad(2, kB2), nullptr);  // closed
    EXPECT_EQ(access.PostBackward(2).code(), absl::StatusCode::kFailedPrecondition);
  }
}

// A hook that fails: the step stops there and returns the error, naming the hook.
class FailingAccess : public ReferenceAccess {
 public:
  using ReferenceAccess::ReferenceAccess;
  absl::Status PreBackward(int unit) override {
    if (unit == 2) return absl::UnavailableError("peer gone");
    return ReferenceAccess::PreBackward(unit);
  }
};

TEST(TinyLmTest, AHookErrorEndsTheStepAndIsReturned) {
  const ModelConfig c = TinyConfig();
  FailingAccess access(c);
  absl::StatusOr<double> loss = TrainStepForwardBackward(c, access, TinyBatch(), 6, {});
  EXPECT_EQ(loss.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(loss.status().message(), "B+2")) << loss.status();
  EXPECT_TRUE(absl::StrContains(loss.status().message(), "peer gone")) << loss.status();
  EXPECT_EQ(LogString(access.log()), "F+0 F-0 F+1 F-1 F+2 F-2 F+3 F-3 F+0 F-0 B+0 B-0 B+3 B-3");
}

}  // namespace
}  // namespace shardline::examples
