// TinyLM: forward, backward, data, AdamW and the unsharded reference (see tiny_lm.h).
//
// Layout of the activations: row-major [examples, features]. The kernels below are written so
// that every inner loop runs over contiguous memory with __restrict pointers (GCC vectorises
// them at -O3), and so that every gradient is accumulated example by example, in batch order,
// straight into the Grad buffer. The latter makes two calls on the halves of a batch produce
// bit-identical gradients to one call on the whole batch (the forward of an example does not
// depend on the other examples) for every tensor used once; embed.weight, used twice, sees its
// two contributions interleaved differently and matches up to rounding.
#include "examples/model/tiny_lm.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "runtime/check.h"
#include "runtime/status.h"

namespace shardline::examples {
namespace {

// ---- Hashing (initial values, data) ------------------------------------------------------

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t Hash(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  return SplitMix64(SplitMix64(SplitMix64(SplitMix64(a) ^ b) ^ c) ^ d);
}

// Uniform in [-1, 1), from the top 24 bits (exact in f32).
float UnitUniform(uint64_t h) {
  return static_cast<float>(static_cast<int64_t>(h >> 40) - (int64_t{1} << 23)) /
         static_cast<float>(int64_t{1} << 23);
}

// ---- Kernels -----------------------------------------------------------------------------

// dot(a, b) with 8 independent partial sums (a fixed order, so deterministic, and a shape GCC
// vectorises without -ffast-math).
inline float Dot(const float* __restrict a, const float* __restrict b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  }
  float tail = 0;
  for (; i < n; ++i) tail += a[i] * b[i];
  return (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))) + tail;
}

// y += alpha * x
inline void Axpy(float alpha, const float* __restrict x, float* __restrict y, int n) {
  for (int i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// y += x
inline void Add(const float* __restrict x, float* __restrict y, int n) {
  for (int i = 0; i < n; ++i) y[i] += x[i];
}

// y[r] = bias[r] + dot(w[r, :], x) for r in [0, rows); w is [rows, cols].
void MatVec(const float* __restrict w, const float* __restrict bias, const float* __restrict x,
            int rows, int cols, float* __restrict y) {
  for (int r = 0; r < rows; ++r) y[r] = bias[r] + Dot(w + static_cast<size_t>(r) * cols, x, cols);
}

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;

void Gelu(const float* __restrict u, float* __restrict a, int n) {
  for (int i = 0; i < n; ++i) {
    const float x = u[i];
    a[i] = 0.5f * x * (1.0f + std::tanh(kGeluC * (x + kGeluA * x * x * x)));
  }
}

// du = da * gelu'(u)
void GeluBackward(const float* __restrict u, const float* __restrict da, float* __restrict du,
                  int n) {
  for (int i = 0; i < n; ++i) {
    const float x = u[i];
    const float t = std::tanh(kGeluC * (x + kGeluA * x * x * x));
    const float dt = (1.0f - t * t) * kGeluC * (1.0f + 3.0f * kGeluA * x * x);
    du[i] = da[i] * (0.5f * (1.0f + t) + 0.5f * x * dt);
  }
}

// ---- Plumbing ----------------------------------------------------------------------------

struct BlockParams {
  const float* w1;
  const float* b1;
  const float* w2;
  const float* b2;
};

struct BlockGrads {
  float* w1;
  float* b1;
  float* w2;
  float* b2;
};

absl::StatusOr<const float*> GetParam(UnitAccess& access, int unit, int tensor) {
  const float* p = access.Param(unit, tensor);
  if (p == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("tiny_lm: Param(unit ", unit, ", tensor ", tensor, ") returned nullptr"));
  }
  return p;
}

absl::StatusOr<float*> GetGrad(UnitAccess& access, int unit, int tensor) {
  float* g = access.Grad(unit, tensor);
  if (g == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("tiny_lm: Grad(unit ", unit, ", tensor ", tensor, ") returned nullptr"));
  }
  return g;
}

absl::StatusOr<BlockParams> GetBlockParams(UnitAccess& access, int unit) {
  BlockParams p;
  SL_ASSIGN_OR_RETURN(p.w1, GetParam(access, unit, kW1));
  SL_ASSIGN_OR_RETURN(p.b1, GetParam(access, unit, kB1));
  SL_ASSIGN_OR_RETURN(p.w2, GetParam(access, unit, kW2));
  SL_ASSIGN_OR_RETURN(p.b2, GetParam(access, unit, kB2));
  return p;
}

absl::StatusOr<BlockGrads> GetBlockGrads(UnitAccess& access, int unit) {
  BlockGrads g;
  SL_ASSIGN_OR_RETURN(g.w1, GetGrad(access, unit, kW1));
  SL_ASSIGN_OR_RETURN(g.b1, GetGrad(access, unit, kB1));
  SL_ASSIGN_OR_RETURN(g.w2, GetGrad(access, unit, kW2));
  SL_ASSIGN_OR_RETURN(g.b2, GetGrad(access, unit, kB2));
  return g;
}

absl::Status CallHook(UnitAccess& access, Hook hook, int unit) {
  absl::Status status;
  switch (hook) {
    case Hook::kPreForward:
      status = access.PreForward(unit);
      break;
    case Hook::kPostForward:
      status = access.PostForward(unit);
      break;
    case Hook::kPreBackward:
      status = access.PreBackward(unit);
      break;
    case Hook::kPostBackward:
      status = access.PostBackward(unit);
      break;
  }
  if (status.ok()) return status;
  std::ostringstream context;
  context << "tiny_lm: hook " << HookCall{hook, unit};
  return Annotate(status, context.str());
}

// The forward of one block over n examples: u = W1 h + b1, a = gelu(u) ([n, H] each) and, if
// `out` is not null, out = h + W2 a + b2 ([n, D]).
void BlockForward(const ModelConfig& c, const BlockParams& p, const float* h, int n, float* u,
                  float* a, float* out) {
  const int d = c.dim, hid = c.hidden;
  for (int e = 0; e < n; ++e) {
    const float* he = h + static_cast<size_t>(e) * d;
    float* ue = u + static_cast<size_t>(e) * hid;
    float* ae = a + static_cast<size_t>(e) * hid;
    MatVec(p.w1, p.b1, he, hid, d, ue);
    Gelu(ue, ae, hid);
    if (out != nullptr) {
      float* oe = out + static_cast<size_t>(e) * d;
      MatVec(p.w2, p.b2, ae, d, hid, oe);
      Add(he, oe, d);
    }
  }
}

// The backward of one block: adds the parameter gradients into `g` (example by example) and
// replaces dh (the gradient w.r.t. the block's output, [n, D]) by the gradient w.r.t. its input.
// `scratch` holds 2 H + D floats.
void BlockBackward(const ModelConfig& c, const BlockParams& p, const BlockGrads& g,
                   const float* h_in, const float* u, const float* a, int n, float* dh,
                   float* scratch) {
  const int d = c.dim, hid = c.hidden;
  float* da = scratch;
  float* du = scratch + hid;
  float* dh_in = scratch + 2 * hid;
  for (int e = 0; e < n; ++e) {
    const float* he = h_in + static_cast<size_t>(e) * d;
    const float* ue = u + static_cast<size_t>(e) * hid;
    const float* ae = a + static_cast<size_t>(e) * hid;
    float* dhe = dh + static_cast<size_t>(e) * d;
    // out = h + W2 a + b2
    Add(dhe, g.b2, d);
    std::fill(da, da + hid, 0.0f);
    for (int r = 0; r < d; ++r) {
      Axpy(dhe[r], ae, g.w2 + static_cast<size_t>(r) * hid, hid);
      Axpy(dhe[r], p.w2 + static_cast<size_t>(r) * hid, da, hid);
    }
    // a = gelu(u), u = W1 h + b1
    GeluBackward(ue, da, du, hid);
    Add(du, g.b1, hid);
    std::copy(dhe, dhe + d, dh_in);
    for (int j = 0; j < hid; ++j) {
      Axpy(du[j], he, g.w1 + static_cast<size_t>(j) * d, d);
      Axpy(du[j], p.w1 + static_cast<size_t>(j) * d, dh_in, d);
    }
    std::copy(dh_in, dh_in + d, dhe);
  }
}

absl::Status ValidateStep(const ModelConfig& config, absl::Span<const Example> batch,
                          int loss_denominator, const StepOptions& options) {
  SL_RETURN_IF_ERROR(ValidateConfig(config));
  if (batch.empty()) return absl::InvalidArgumentError("tiny_lm: empty batch");
  if (loss_denominator < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tiny_lm: loss_denominator ", loss_denominator, " < 1"));
  }
  if (!options.skip_backward.empty() &&
      options.skip_backward.size() != static_cast<size_t>(config.num_units())) {
    return absl::InvalidArgumentError(
        absl::StrCat("tiny_lm: skip_backward has ", options.skip_backward.size(),
                     " entries, expected 0 or num_units() = ", config.num_units()));
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    const Example& ex = batch[i];
    if (ex.token < 0 || ex.token >= config.vocab || ex.target < 0 || ex.target >= config.vocab) {
      return absl::InvalidArgumentError(absl::StrCat("tiny_lm: example ", i, " (token ", ex.token,
                                                     ", target ", ex.target,
                                                     ") outside [0, vocab = ", config.vocab, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// ---- Config and units --------------------------------------------------------------------

std::ostream& operator<<(std::ostream& os, const ModelConfig& c) {
  return os << absl::StrFormat(
             "ModelConfig{vocab=%d dim=%d hidden=%d blocks=%d tokens_per_rank=%d seed=%d}", c.vocab,
             c.dim, c.hidden, c.blocks, c.tokens_per_rank, c.seed);
}

absl::Status ValidateConfig(const ModelConfig& c) {
  const std::pair<const char*, int> fields[] = {{"vocab", c.vocab},
                                                {"dim", c.dim},
                                                {"hidden", c.hidden},
                                                {"blocks", c.blocks},
                                                {"tokens_per_rank", c.tokens_per_rank}};
  for (const auto& [name, value] : fields) {
    if (value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("tiny_lm: ModelConfig.", name, " = ", value, ", must be >= 1"));
    }
  }
  return absl::OkStatus();
}

std::vector<UnitDef> ModelUnits(const ModelConfig& c) {
  SL_CHECK_OK(ValidateConfig(c));
  const int64_t v = c.vocab, d = c.dim, h = c.hidden;
  std::vector<UnitDef> units;
  units.push_back({"embed", {{"embed.weight", {v, d}}, {"head.bias", {v}}}});
  for (int i = 1; i <= c.blocks; ++i) {
    const std::string p = absl::StrCat("block", i, ".");
    units.push_back({absl::StrCat("block", i),
                     {{p + "w1", {h, d}}, {p + "b1", {h}}, {p + "w2", {d, h}}, {p + "b2", {d}}}});
  }
  return units;
}

size_t TensorNumel(const ModelConfig& c, int unit, int tensor) {
  SL_CHECK(unit >= 0 && unit < c.num_units()) << "unit " << unit;
  const size_t v = c.vocab, d = c.dim, h = c.hidden;
  if (unit == 0) {
    SL_CHECK(tensor == kEmbedWeight || tensor == kHeadBias) << "tensor " << tensor;
    return tensor == kEmbedWeight ? v * d : v;
  }
  switch (tensor) {
    case kW1:
    case kW2:
      return h * d;
    case kB1:
      return h;
    case kB2:
      return d;
  }
  SL_CHECK(false) << "unit " << unit << " has no tensor " << tensor;
  return 0;
}

void InitUnit(const ModelConfig& c, int unit, std::vector<std::vector<float>>& tensors) {
  SL_CHECK_OK(ValidateConfig(c));
  SL_CHECK(unit >= 0 && unit < c.num_units()) << "unit " << unit;
  const int num_tensors = unit == 0 ? 2 : 4;
  tensors.resize(num_tensors);
  for (int t = 0; t < num_tensors; ++t) {
    float scale = 0.0f;  // biases
    if (unit == 0 && t == kEmbedWeight) scale = 0.5f;
    if (unit > 0 && t == kW1) scale = 1.0f / std::sqrt(static_cast<float>(c.dim));
    if (unit > 0 && t == kW2) {
      scale = 0.5f / std::sqrt(static_cast<float>(c.hidden) * static_cast<float>(c.blocks));
    }
    std::vector<float>& values = tensors[t];
    values.assign(TensorNumel(c, unit, t), 0.0f);
    if (scale == 0.0f) continue;
    for (size_t e = 0; e < values.size(); ++e) {
      values[e] = scale * UnitUniform(Hash(c.seed, static_cast<uint64_t>(unit),
                                           static_cast<uint64_t>(t), e));
    }
  }
}

std::ostream& operator<<(std::ostream& os, const HookCall& call) {
  const bool forward = call.hook == Hook::kPreForward || call.hook == Hook::kPostForward;
  const bool pre = call.hook == Hook::kPreForward || call.hook == Hook::kPreBackward;
  return os << (forward ? 'F' : 'B') << (pre ? '+' : '-') << call.unit;
}

std::vector<HookCall> ExpectedHookSequence(const ModelConfig& c, const StepOptions& options) {
  auto skipped = [&](int unit) {
    return !options.skip_backward.empty() && options.skip_backward[unit];
  };
  std::vector<HookCall> seq;
  auto span = [&](Hook pre, Hook post, int unit) {
    seq.push_back({pre, unit});
    seq.push_back({post, unit});
  };
  span(Hook::kPreForward, Hook::kPostForward, 0);
  for (int i = 1; i <= c.blocks; ++i) span(Hook::kPreForward, Hook::kPostForward, i);
  span(Hook::kPreForward, Hook::kPostForward, 0);
  if (!skipped(0)) span(Hook::kPreBackward, Hook::kPostBackward, 0);
  for (int i = c.blocks; i >= 1; --i) {
    if (skipped(i)) continue;
    if (options.recompute) span(Hook::kPreForward, Hook::kPostForward, i);
    span(Hook::kPreBackward, Hook::kPostBackward, i);
  }
  if (!skipped(0)) span(Hook::kPreBackward, Hook::kPostBackward, 0);
  return seq;
}

// ---- One step ----------------------------------------------------------------------------

absl::StatusOr<double> TrainStepForwardBackward(const ModelConfig& c, UnitAccess& access,
                                                absl::Span<const Example> batch,
                                                int loss_denominator, const StepOptions& options) {
  SL_RETURN_IF_ERROR(ValidateStep(c, batch, loss_denominator, options));
  const int n = static_cast<int>(batch.size());
  const int v = c.vocab, d = c.dim, hid = c.hidden, blocks = c.blocks;
  const size_t nd = static_cast<size_t>(n) * d, nh = static_cast<size_t>(n) * hid;
  auto skipped = [&](int unit) {
    return !options.skip_backward.empty() && options.skip_backward[unit];
  };

  // hs[i] = input of block i+1 (hs[blocks] = the head's input). Without recompute every
  // block's u and a are kept; with it, one scratch pair serves every block.
  std::vector<std::vector<float>> hs(blocks + 1, std::vector<float>(nd));
  const int kept = options.recompute ? 1 : blocks;
  std::vector<std::vector<float>> us(kept, std::vector<float>(nh));
  std::vector<std::vector<float>> as(kept, std::vector<float>(nh));
  std::vector<float> probs(static_cast<size_t>(n) * v);
  double loss_sum = 0.0;

  // ---- Forward.
  SL_RETURN_IF_ERROR(CallHook(access, Hook::kPreForward, 0));
  {
    SL_ASSIGN_OR_RETURN(const float* embed, GetParam(access, 0, kEmbedWeight));
    for (int e = 0; e < n; ++e) {
      const float* row = embed + static_cast<size_t>(batch[e].token) * d;
      std::copy(row, row + d, hs[0].data() + static_cast<size_t>(e) * d);
    }
  }
  SL_RETURN_IF_ERROR(CallHook(access, Hook::kPostForward, 0));

  for (int i = 1; i <= blocks; ++i) {
    const int k = options.recompute ? 0 : i - 1;
    SL_RETURN_IF_ERROR(CallHook(access, Hook::kPreForward, i));
    SL_ASSIGN_OR_RETURN(const BlockParams p, GetBlockParams(access, i));
    BlockForward(c, p, hs[i - 1].data(), n, us[k].data(), as[k].data(), hs[i].data());
    SL_RETURN_IF_ERROR(CallHook(access, Hook::kPostForward, i));
  }

  SL_RETURN_IF_ERROR(CallHook(access, Hook::kPreForward, 0));
  {
    SL_ASSIGN_OR_RETURN(const float* embed, GetParam(access, 0, kEmbedWeight));
    SL_ASSIGN_OR_RETURN(const float* bias, GetParam(access, 0, kHeadBias));
    const float* h = hs[blocks].data();
    for (int e = 0; e < n; ++e) {
      float* logits = probs.data() + static_cast<size_t>(e) * v;
      MatVec(embed, bias, h + static_cast<size_t>(e) * d, v, d, logits);
      const float max = *std::max_element(logits, logits + v);
      double sum = 0.0;
      for (int j = 0; j < v; ++j) sum += std::exp(static_cast<double>(logits[j] - max));
      const double lse = static_cast<double>(max) + std::log(sum);
      loss_sum += lse - static_cast<double>(logits[batch[e].target]);
      for (int j = 0; j < v; ++j) {
        logits[j] = static_cast<float>(std::exp(static_cast<double>(logits[j]) - lse));
      }
    }
  }
  SL_RETURN_IF_ERROR(CallHook(access, Hook::kPostForward, 0));

  // ---- Backward. dh = d(loss) / d(h_i), walking i down from blocks to 0.
  std::vector<float> dh(nd, 0.0f);
  const float inv_denominator = 1.0f / static_cast<float>(loss_denominator);
  if (!skipped(0)) {
    SL_RETURN_IF_ERROR(CallHook(access, Hook::kPreBackward, 0));
    SL_ASSIGN_OR_RETURN(const float* embed, GetParam(access, 0, kEmbedWeight));
    SL_ASSIGN_OR_RETURN(float* d_embed, GetGrad(access, 0, kEmbedWeight));
    SL_ASSIGN_OR_RETURN(float* d_bias, GetGrad(access, 0, kHeadBias));
    const float* h = hs[blocks].data();
    std::vector<float> dlogits(v);
    for (int e = 0; e < n; ++e) {
      const float* p = probs.data() + static_cast<size_t>(e) * v;
      const float* he = h + static_cast<size_t>(e) * d;
      float* dhe = dh.data() + static_cast<size_t>(e) * d;
      for (int j = 0; j < v; ++j) dlogits[j] = p[j] * inv_denominator;
      dlogits[batch[e].target] = (p[batch[e].target] - 1.0f) * inv_denominator;
      Add(dlogits.data(), d_bias, v);
      for (int j = 0; j < v; ++j) {
        Axpy(dlogits[j], he, d_embed + static_cast<size_t>(j) * d, d);
        Axpy(dlogits[j], embed + static_cast<size_t>(j) * d, dhe, d);
      }
    }
    SL_RETURN_IF_ERROR(CallHook(access, Hook::kPostBackward, 0));
  }

  std::vector<float> scratch(2 * static_cast<size_t>(hid) + d);
  for (int i = blocks; i >= 1; --i) {
    if (skipped(i)) continue;  // the residual passes dh through unchanged (see StepOptions)
    const int k = options.recompute ? 0 : i - 1;
    if (options.recompute) {
      SL_RETURN_IF_ERROR(CallHook(access, Hook::kPreForward, i));
      SL_ASSIGN_OR_RETURN(const BlockParams p, GetBlockParams(access, i));
      BlockForward(c, p, hs[i - 1].data(), n, us[k].data(), as[k].data(), nullptr);
      SL_RETURN_IF_ERROR(CallHook(access, Hook::kPostForward, i));
    }
    SL_RETURN_IF_ERROR(CallHook(access, Hook::kPreBackward, i));
    SL_ASSIGN_OR_RETURN(const BlockParams p, GetBlockParams(access, i));
    SL_ASSIGN_OR_RETURN(const BlockGrads g, GetBlockGrads(access, i));
    BlockBackward(c, p, g, hs[i - 1].data(), us[k].data(), as[k].data(), n, dh.data(),
                  scratch.data());
    SL_RETURN_IF_ERROR(CallHook(access, Hook::kPostBackward, i));
  }

  if (!skipped(0)) {
    SL_RETURN_IF_ERROR(CallHook(access, Hook::kPreBackward, 0));
    SL_ASSIGN_OR_RETURN(float* d_embed, GetGrad(access, 0, kEmbedWeight));
    for (int e = 0; e < n; ++e) {
      Add(dh.data() + static_cast<size_t>(e) * d, d_embed + static_cast<size_t>(batch[e].token) * d,
          d);
    }
    SL_RETURN_IF_ERROR(CallHook(access, Hook::kPostBackward, 0));
  }
  return loss_sum / loss_denominator;
}

// ---- Data --------------------------------------------------------------------------------

absl::StatusOr<std::vector<Example>> SyntheticBatch(const ModelConfig& c, uint64_t seed, int step,
                                                    int rank, int world_data_parallel) {
  SL_RETURN_IF_ERROR(ValidateConfig(c));
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("tiny_lm: step ", step, " < 0"));
  if (world_data_parallel < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tiny_lm: world_data_parallel ", world_data_parallel, " < 1"));
  }
  if (rank < 0 || rank >= world_data_parallel) {
    return absl::InvalidArgumentError(
        absl::StrCat("tiny_lm: rank ", rank, " outside [0, ", world_data_parallel, ")"));
  }
  std::vector<Example> batch(c.tokens_per_rank);
  const uint64_t vocab = static_cast<uint64_t>(c.vocab);
  for (int e = 0; e < c.tokens_per_rank; ++e) {
    const uint64_t g = static_cast<uint64_t>(rank) * c.tokens_per_rank + e;
    const uint64_t h = Hash(seed, static_cast<uint64_t>(step), g, 0x7a);
    const uint64_t token = (h >> 8) % vocab;
    uint64_t target = (5 * token + 3) % vocab;
    if ((h & 0xff) < 26) target = SplitMix64(h) % vocab;  // ~10% noise
    batch[e] = {static_cast<int32_t>(token), static_cast<int32_t>(target)};
  }
  return batch;
}

// ---- Optimizer ---------------------------------------------------------------------------

void AdamWStep(const AdamW& o, int step, float* __restrict param, const float* __restrict grad,
               float* __restrict m, float* __restrict v, size_t n) {
  SL_CHECK(step >= 1) << "AdamWStep: step " << step;
  const float c1 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(o.beta1), step)));
  const float c2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(o.beta2), step)));
  const float decay = 1.0f - o.lr * o.weight_decay;
  const float b1 = o.beta1, b2 = o.beta2, one_b1 = 1.0f - o.beta1, one_b2 = 1.0f - o.beta2;
  for (size_t i = 0; i < n; ++i) {
    const float g = grad[i];
    m[i] = b1 * m[i] + one_b1 * g;
    v[i] = b2 * v[i] + one_b2 * g * g;
    param[i] = param[i] * decay - o.lr * (m[i] * c1) / (std::sqrt(v[i] * c2) + o.eps);
  }
}

// ---- ReferenceAccess ---------------------------------------------------------------------

ReferenceAccess::ReferenceAccess(const ModelConfig& config) : config_(config) {
  SL_CHECK_OK(ValidateConfig(config));
  const int units = config.num_units();
  params_.resize(units);
  for (int u = 0; u < units; ++u) InitUnit(config, u, params_[u]);
  grads_ = params_;
  ZeroGrads();
  adam_m_ = grads_;
  adam_v_ = grads_;
}

absl::Status ReferenceAccess::Fail(absl::Status status) {
  if (status_.ok()) status_ = status;
  return status;
}

absl::Status ReferenceAccess::Open(Hook hook, int unit) {
  log_.push_back({hook, unit});
  std::ostringstream call;
  call << HookCall{hook, unit};
  if (unit < 0 || unit >= config_.num_units()) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("ReferenceAccess: ", call.str(), ": no unit ", unit)));
  }
  if (open_unit_ >= 0) {
    return Fail(absl::FailedPreconditionError(absl::StrCat(
        "ReferenceAccess: ", call.str(), " while unit ", open_unit_, " is still open")));
  }
  open_unit_ = unit;
  open_backward_ = hook == Hook::kPreBackward;
  return absl::OkStatus();
}

absl::Status ReferenceAccess::Close(Hook hook, int unit) {
  log_.push_back({hook, unit});
  const bool backward = hook == Hook::kPostBackward;
  if (open_unit_ != unit || open_backward_ != backward) {
    std::ostringstream call;
    call << HookCall{hook, unit};
    return Fail(absl::FailedPreconditionError(absl::StrCat(
        "ReferenceAccess: ", call.str(), " but the open unit is ",
        open_unit_ < 0 ? std::string("none")
                       : absl::StrCat(open_unit_, open_backward_ ? " (backward)" : " (forward)"))));
  }
  open_unit_ = -1;
  return absl::OkStatus();
}

absl::Status ReferenceAccess::PreForward(int unit) { return Open(Hook::kPreForward, unit); }
absl::Status ReferenceAccess::PostForward(int unit) { return Close(Hook::kPostForward, unit); }
absl::Status ReferenceAccess::PreBackward(int unit) { return Open(Hook::kPreBackward, unit); }
absl::Status ReferenceAccess::PostBackward(int unit) { return Close(Hook::kPostBackward, unit); }

const float* ReferenceAccess::Param(int unit, int tensor) {
  if (unit != open_unit_ || tensor < 0 || tensor >= static_cast<int>(params_[unit].size())) {
    (void)Fail(absl::FailedPreconditionError(absl::StrCat(
        "ReferenceAccess: Param(", unit, ", ", tensor, ") with open unit ", open_unit_)));
    return nullptr;
  }
  return params_[unit][tensor].data();
}

float* ReferenceAccess::Grad(int unit, int tensor) {
  if (unit != open_unit_ || !open_backward_ || tensor < 0 ||
      tensor >= static_cast<int>(grads_[unit].size())) {
    (void)Fail(absl::FailedPreconditionError(
        absl::StrCat("ReferenceAccess: Grad(", unit, ", ", tensor, ") with open unit ", open_unit_,
                     open_backward_ ? " (backward)" : " (forward or none)")));
    return nullptr;
  }
  return grads_[unit][tensor].data();
}

void ReferenceAccess::ZeroGrads() {
  for (auto& unit : grads_) {
    for (auto& tensor : unit) std::fill(tensor.begin(), tensor.end(), 0.0f);
  }
}

void ReferenceAccess::Step(const AdamW& adamw, int step) {
  for (size_t u = 0; u < params_.size(); ++u) {
    for (size_t t = 0; t < params_[u].size(); ++t) {
      AdamWStep(adamw, step, params_[u][t].data(), grads_[u][t].data(), adam_m_[u][t].data(),
                adam_v_[u][t].data(), params_[u][t].size());
    }
  }
}

absl::StatusOr<std::vector<double>> TrainReference(const ModelConfig& c, int steps,
                                                   int data_parallel_world, int micro_batches,
                                                   const TrainOptions& options,
                                                   ReferenceAccess& access) {
  SL_RETURN_IF_ERROR(ValidateConfig(c));
  if (!(c == access.config())) {
    std::ostringstream msg;
    msg << "TrainReference: config " << c << " differs from the access's " << access.config();
    return absl::InvalidArgumentError(msg.str());
  }
  if (steps < 0) return absl::InvalidArgumentError(absl::StrCat("TrainReference: steps ", steps));
  if (data_parallel_world < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("TrainReference: data_parallel_world ", data_parallel_world, " < 1"));
  }
  const int global = c.tokens_per_rank * data_parallel_world;
  if (micro_batches < 1 || micro_batches > global) {
    return absl::InvalidArgumentError(absl::StrCat("TrainReference: micro_batches ", micro_batches,
                                                   " outside [1, ", global, "]"));
  }
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    std::vector<Example> batch;
    batch.reserve(global);
    for (int r = 0; r < data_parallel_world; ++r) {
      SL_ASSIGN_OR_RETURN(std::vector<Example> slice,
                          SyntheticBatch(c, options.data_seed, s, r, data_parallel_world));
      batch.insert(batch.end(), slice.begin(), slice.end());
    }
    access.ZeroGrads();
    double loss = 0.0;
    for (int k = 0; k < micro_batches; ++k) {
      const size_t begin = static_cast<size_t>(k) * global / micro_batches;
      const size_t end = static_cast<size_t>(k + 1) * global / micro_batches;
      SL_ASSIGN_OR_RETURN(const double piece,
                          TrainStepForwardBackward(
                              c, access, absl::MakeConstSpan(batch).subspan(begin, end - begin),
                              global, options.step));
      loss += piece;
    }
    access.Step(options.adamw, s + 1);
    losses.push_back(loss);
  }
  return losses;
}

}  // namespace shardline::examples
