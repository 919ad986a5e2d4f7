// Model descriptions (scheduler/tune/model.h):
//   * the transformer presets' parameter counts against the published figures (Llama 3 8B, 70B,
//     405B; GPT-3 175B) and against a plain per-tensor sum written out here;
//   * FLOPs: every use against the 6N-plus-attention formula, summed independently;
//   * activations: GPT-3's layer equals Korthikanti et al.'s 34h + 5as bytes per token; Llama's
//     fused-attention layer equals its term-by-term count;
//   * the JSON form: a preset written and read back is the same description; a hand-written
//     file with the shorthand and a per-unit dtype policy reads as intended; malformed files are
//     errors naming the member.
#include "scheduler/tune/model.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "absl/strings/match.h"

namespace shardline {
namespace {

ModelDescription MustModel(const TransformerConfig& c) {
  absl::StatusOr<ModelDescription> m = TransformerModel(c);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *std::move(m) : ModelDescription{};
}

TEST(TuneModelTest, LlamaParameterCountsMatchThePublishedOnes) {
  // "The Llama 3 Herd of Models": 8.03B, 70.6B, 405.9B (rounded there to these digits).
  const ModelDescription m8 = MustModel(Llama3_8B());
  const ModelDescription m70 = MustModel(Llama3_70B());
  const ModelDescription m405 = MustModel(Llama3_405B());
  EXPECT_NEAR(static_cast<double>(m8.ParameterCount()), 8.03e9, 0.005e9);
  EXPECT_NEAR(static_cast<double>(m70.ParameterCount()), 70.6e9, 0.05e9);
  EXPECT_NEAR(static_cast<double>(m405.ParameterCount()), 405.9e9, 0.05e9);
  // Exactly, from the architecture: per layer 2h^2 + 2h(8*128) + 3hf + 2h, embedding and head
  // V*h each, the final norm h.
  auto llama = [](uint64_t L, uint64_t h, uint64_t f) {
    const uint64_t V = 128256;
    return L * (2 * h * h + 2 * h * 1024 + 3 * h * f + 2 * h) + 2 * V * h + h;
  };
  EXPECT_EQ(m8.ParameterCount(), llama(32, 4096, 14336));
  EXPECT_EQ(m8.ParameterCount(), 8030261248u);
  EXPECT_EQ(m70.ParameterCount(), llama(80, 8192, 28672));
  EXPECT_EQ(m405.ParameterCount(), llama(126, 16384, 53248));
  // Units: embed, the layers, head; each used once.
  EXPECT_EQ(m8.units.size(), 34u);
  EXPECT_EQ(m8.forward.size(), 34u);
  EXPECT_EQ(m8.units.front().name, "embed");
  EXPECT_EQ(m8.units.back().name, "head");
}

TEST(TuneModelTest, GptParameterCountMatchesThePublishedOne) {
  const ModelDescription m = MustModel(Gpt3_175B());
  // Brown et al. 2020 call it 175.0B; the architecture gives 174.6B (the paper rounds).
  EXPECT_NEAR(static_cast<double>(m.ParameterCount()), 175.0e9, 0.5e9);
  const uint64_t h = 12288, L = 96, V = 50257;
  // Per layer 12h^2 + 13h (weights, biases, two LayerNorms); embeddings V*h + 2048*h, the final
  // LayerNorm 2h; the head is tied.
  EXPECT_EQ(m.ParameterCount(), L * (12 * h * h + 13 * h) + V * h + 2048 * h + 2 * h);
  // Tied: unit 0 is used first and last.
  EXPECT_EQ(m.units.size(), 97u);
  ASSERT_EQ(m.forward.size(), 98u);
  EXPECT_EQ(m.forward.front().unit, 0);
  EXPECT_EQ(m.forward.back().unit, 0);
}

TEST(TuneModelTest, FlopsAreSixNPlusAttention) {
  for (const TransformerConfig& base : {Llama3_8B({.seq_len = 4096, .micro_batch = 2}),
                                        Gpt3_175B({.seq_len = 2048, .micro_batch = 1})}) {
    TransformerConfig c = base;
    const ModelDescription m = MustModel(c);
    const uint64_t t = static_cast<uint64_t>(c.seq_len) * c.micro_batch;
    EXPECT_EQ(m.tokens_per_micro_batch, t);
    // Matmul weights: everything but the embeddings, norms and biases (the tied head's V*h is
    // a matmul: counted once more).
    uint64_t matmul = 0;
    for (const UnitDescription& u : m.units) {
      for (const TensorSpec& s : u.tensors) {
        if (s.shape.size() == 2 && !absl::StrContains(s.name, "embeddings")) {
          matmul += static_cast<uint64_t>(s.shape[0] * s.shape[1]);
        }
      }
    }
    if (c.tied_embeddings) matmul += static_cast<uint64_t>(c.vocab * c.hidden);
    const uint64_t attention = 12ull * c.layers * c.seq_len * c.hidden * t;
    EXPECT_EQ(m.ForwardFlops() + m.BackwardFlops(), 6 * matmul * t + attention) << c.name;
    EXPECT_EQ(m.BackwardFlops(), 2 * m.ForwardFlops()) << c.name;
    EXPECT_EQ(m.forward.front().forward_flops, 0u);  // the embedding lookup
  }
}

TEST(TuneModelTest, GptLayerActivationsAreKorthikantis) {
  // 34*h + 5*a*s bytes per token and layer, 16-bit activations, dropout, no fused attention.
  const TransformerConfig c = Gpt3_175B({.seq_len = 2048, .micro_batch = 3});
  const ModelDescription m = MustModel(c);
  const uint64_t t = 2048 * 3;
  const uint64_t per_token = 34 * 12288 + 5 * 96 * 2048;
  EXPECT_EQ(m.forward[1].activation_bytes, per_token * t);
  // Checkpointed: the layer's input only.
  EXPECT_EQ(m.forward[1].checkpointed_activation_bytes, 2 * 12288 * t);
  // The head: norm input and output, f32 logits.
  EXPECT_EQ(m.forward.back().activation_bytes, (4 * 12288 + 4 * 50257) * t);
}

TEST(TuneModelTest, LlamaLayerActivationsTermByTerm) {
  const TransformerConfig c = Llama3_8B({.seq_len = 8192, .micro_batch = 1});
  const ModelDescription m = MustModel(c);
  const uint64_t h = 4096, f = 14336, kvd = 8 * 128, a = 32, p = 2, t = 8192;
  // Norm input, QKV input, Q, K, V, output-projection input, log-sum-exp; norm input, FFN input,
  // gate, up, down-projection input.
  const uint64_t attention = p * h + p * h + p * h + 2 * p * kvd + p * h + 4 * a;
  const uint64_t ffn = p * h + p * h + 3 * p * f;
  EXPECT_EQ(m.forward[5].activation_bytes, (attention + ffn) * t);
}

// torchtitan's `op` policy (model.h): of wq, wk, wv, wo, w1, w3, w2 the 1st, 3rd, 5th and 7th
// mm outputs are saved with the flash attention's output and log-sum-exp and the block's input;
// wk, wo and w3 are recomputed.
TEST(TuneModelTest, LlamaSelectiveOpCheckpointingTermByTerm) {
  const ModelDescription m = MustModel(Llama3_8B({.seq_len = 8192, .micro_batch = 2}));
  const uint64_t h = 4096, f = 14336, kvd = 8 * 128, a = 32, p = 2, t = 2 * 8192;
  const UnitUse& layer = m.forward[7];
  ASSERT_TRUE(layer.selective);
  // Input, wq, wv, attention output, log-sum-exp, w1, w2.
  EXPECT_EQ(layer.selective_activation_bytes,
            (p * h + p * h + p * kvd + p * h + 4 * a + p * f + p * h) * t);
  EXPECT_EQ(layer.selective_recompute_flops, 2 * (h * kvd + h * h + h * f) * t);
  // Between full checkpointing and none, and a fraction of the forward recomputed.
  EXPECT_GT(layer.selective_activation_bytes, layer.checkpointed_activation_bytes);
  EXPECT_LT(layer.selective_activation_bytes, layer.activation_bytes);
  EXPECT_LT(layer.selective_recompute_flops, layer.forward_flops / 3);
  // The embedding and the head are not checkpointed.
  EXPECT_EQ(m.forward.front().selective_activation_bytes, m.forward.front().activation_bytes);
  EXPECT_EQ(m.forward.back().selective_activation_bytes, m.forward.back().activation_bytes);
  EXPECT_EQ(m.forward.back().selective_recompute_flops, 0u);
}

// The work by kind (model.h): matmul and attention FLOPs adding up to the forward's, and the
// bytes of its memory-bound ops: two norms, rotary Q and K, SwiGLU, two residual adds.
TEST(TuneModelTest, LlamaLayerWorkTermByTerm) {
  const ModelDescription m = MustModel(Llama3_8B({.seq_len = 8192, .micro_batch = 2}));
  const double h = 4096, f = 14336, kvd = 8 * 128, p = 2, t = 2 * 8192, s = 8192;
  const UnitUse& layer = m.forward[3];
  ASSERT_TRUE(layer.has_work);
  const ComputeWork& w = layer.forward_work;
  EXPECT_EQ(w.matmul_flops, 2 * t * (2 * h * h + 2 * h * kvd + 3 * h * f));
  EXPECT_EQ(w.attention_flops, 4 * t * s * h);
  EXPECT_TRUE(w.causal);
  EXPECT_EQ(w.attention_seq_len, s);
  EXPECT_EQ(w.elementwise_bytes, p * t * (2 * h + 2 * h + 2 * (h + kvd) + 3 * f + 3 * h + 3 * h));
  EXPECT_EQ(static_cast<uint64_t>(w.matmul_flops + w.attention_flops), layer.forward_flops);
  // Op checkpointing recomputes wk, wo and w3 and every memory-bound op, not the attention.
  const ComputeWork& r = layer.selective_recompute_work;
  EXPECT_EQ(r.matmul_flops, 2 * t * (h * kvd + h * h + h * f));
  EXPECT_EQ(r.attention_flops, 0);
  EXPECT_EQ(r.elementwise_bytes, w.elementwise_bytes);
  // The head: its projection, the final norm and the f32 softmax over the vocabulary.
  const ComputeWork& head = m.forward.back().forward_work;
  EXPECT_EQ(head.matmul_flops, 2 * t * 128256 * h);
  EXPECT_EQ(head.elementwise_bytes, (2 * p * h + 8 * 128256) * t);
}

// GPT's linear layers have biases (aten.addmm, not on torchtitan's list): none is saved, every
// matmul is recomputed, and its unfused attention too.
TEST(TuneModelTest, GptSelectiveOpCheckpointingSavesNoLinear) {
  const ModelDescription m = MustModel(Gpt3_175B({.seq_len = 2048, .micro_batch = 1}));
  const uint64_t h = 12288, p = 2, t = 2048, s = 2048;
  const UnitUse& layer = m.forward[1];
  EXPECT_EQ(layer.selective_activation_bytes, p * h * t);
  EXPECT_EQ(layer.selective_recompute_flops, layer.forward_flops);
  EXPECT_EQ(layer.selective_recompute_flops, (2 * 12 * h * h + 4 * s * h) * t);
}

TEST(TuneModelTest, PresetErrorsNameTheDimension) {
  TransformerConfig c = Llama3_8B();
  c.heads = 33;
  absl::StatusOr<ModelDescription> m = TransformerModel(c);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(m.status().message(), "heads (33) must divide hidden"))
      << m.status();
  c = Llama3_8B();
  c.layers = 0;
  m = TransformerModel(c);
  ASSERT_FALSE(m.ok());
  EXPECT_TRUE(absl::StrContains(m.status().message(), "layers must be positive")) << m.status();
  EXPECT_FALSE(PresetByName("llama2-7b", {}).ok());
  ASSERT_TRUE(PresetByName("gpt3-175b", {}).ok());
  EXPECT_EQ(PresetByName("gpt3-175b", {}).value().layers, 96);
}

void ExpectSameModel(const ModelDescription& a, const ModelDescription& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.precision, b.precision);
  EXPECT_EQ(a.optimizer_state_bytes_per_param, b.optimizer_state_bytes_per_param);
  EXPECT_EQ(a.tokens_per_micro_batch, b.tokens_per_micro_batch);
  ASSERT_EQ(a.units.size(), b.units.size());
  for (size_t u = 0; u < a.units.size(); ++u) {
    EXPECT_EQ(a.units[u].name, b.units[u].name);
    EXPECT_EQ(a.units[u].tensors, b.units[u].tensors);
    EXPECT_EQ(a.units[u].has_precision, b.units[u].has_precision);
    if (a.units[u].has_precision) {
      EXPECT_EQ(a.units[u].precision, b.units[u].precision);
    }
  }
  ASSERT_EQ(a.forward.size(), b.forward.size());
  for (size_t k = 0; k < a.forward.size(); ++k) {
    EXPECT_EQ(a.forward[k].unit, b.forward[k].unit);
    EXPECT_EQ(a.forward[k].forward_flops, b.forward[k].forward_flops);
    EXPECT_EQ(a.forward[k].backward_flops, b.forward[k].backward_flops);
    EXPECT_EQ(a.forward[k].activation_bytes, b.forward[k].activation_bytes);
    EXPECT_EQ(a.forward[k].checkpointed_activation_bytes,
              b.forward[k].checkpointed_activation_bytes);
    EXPECT_EQ(a.forward[k].selective, b.forward[k].selective);
    EXPECT_EQ(a.forward[k].selective_activation_bytes, b.forward[k].selective_activation_bytes);
    EXPECT_EQ(a.forward[k].selective_recompute_flops, b.forward[k].selective_recompute_flops);
    EXPECT_EQ(a.forward[k].has_work, b.forward[k].has_work);
    for (const auto& [x, y] : {std::pair(a.forward[k].forward_work, b.forward[k].forward_work),
                               std::pair(a.forward[k].selective_recompute_work,
                                         b.forward[k].selective_recompute_work)}) {
      EXPECT_EQ(x.matmul_flops, y.matmul_flops);
      EXPECT_EQ(x.attention_flops, y.attention_flops);
      EXPECT_EQ(x.causal, y.causal);
      EXPECT_EQ(x.attention_seq_len, y.attention_seq_len);
      EXPECT_EQ(x.elementwise_bytes, y.elementwise_bytes);
    }
  }
}

TEST(TuneModelTest, JsonRoundTripsEveryPreset) {
  for (const TransformerConfig& c : {Llama3_8B(), Gpt3_175B()}) {
    ModelDescription m = MustModel(c);
    m.units[3].has_precision = true;
    m.units[3].precision = {.param_dtype = DType::kF16,
                            .reduce_dtype = DType::kF16,
                            .master_dtype = DType::kF32,
                            .keep_low_precision_grads = true};
    absl::StatusOr<ModelDescription> back = ParseModelJson(ModelToJson(m));
    ASSERT_TRUE(back.ok()) << back.status();
    ExpectSameModel(m, *back);
  }
}

TEST(TuneModelTest, JsonShorthandAndPerUnitPrecision) {
  absl::StatusOr<ModelDescription> m = ParseModelJson(R"({
    "name": "tiny",
    "precision": {"param_dtype": "bf16"},
    "optimizer_state_bytes_per_param": 4,
    "units": [
      {"name": "a", "params": 1001},
      {"name": "b", "tensors": [{"name": "w", "shape": [7, 13]}, {"name": "v", "shape": [7, 13],
                                 "tied_to": "w"}],
       "precision": {"reduce_dtype": "bfloat16"}}
    ],
    "forward": [
      {"unit": "a", "forward_flops": 10, "backward_flops": 20, "activation_bytes": 300,
       "checkpointed_activation_bytes": 30},
      {"unit": "b", "forward_flops": 11},
      {"unit": "a"}
    ]
  })");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->name, "tiny");
  EXPECT_EQ(m->precision.param_dtype, DType::kBF16);
  EXPECT_EQ(m->precision.reduce_dtype, DType::kF32);
  EXPECT_EQ(m->optimizer_state_bytes_per_param, 4u);
  ASSERT_EQ(m->units.size(), 2u);
  EXPECT_EQ(m->units[0].ParameterCount(), 1001u);
  EXPECT_EQ(m->units[1].ParameterCount(), 91u);  // the tie counts once
  EXPECT_FALSE(m->units[0].has_precision);
  ASSERT_TRUE(m->units[1].has_precision);
  // A unit's policy starts from the model's and overrides what it names.
  EXPECT_EQ(m->PrecisionOf(1).param_dtype, DType::kBF16);
  EXPECT_EQ(m->PrecisionOf(1).reduce_dtype, DType::kBF16);
  ASSERT_EQ(m->forward.size(), 3u);
  EXPECT_EQ(m->forward[0].checkpointed_activation_bytes, 30u);
  EXPECT_EQ(m->forward[1].unit, 1);
  EXPECT_EQ(m->forward[1].forward_flops, 11u);
  EXPECT_EQ(m->forward[1].backward_flops, 0u);
  EXPECT_EQ(m->forward[2].unit, 0);
  EXPECT_EQ(m->ForwardFlops(), 21u);
}

TEST(TuneModelTest, MalformedJsonNamesTheProblem) {
  const std::string unit = R"({"name": "a", "params": 5})";
  const std::string use = R"({"unit": "a"})";
  struct Case {
    std::string json;
    std::string expected;
  };
  const Case cases[] = {
      {"{", "JSON"},
      {R"({"name": "m", "units": [)" + unit + R"(], "forward": [)" + use + R"(], "extra": 1})",
       "unknown member \"extra\""},
      {R"({"units": [)" + unit + R"(], "forward": [)" + use + "]}", "missing member \"name\""},
      {R"({"name": "m", "units": [)" + unit + R"(], "forward": [{"unit": "b"}]})",
       "forward[0]: no unit named \"b\""},
      {R"({"name": "m", "units": [)" + unit + R"(], "forward": [{"unit": 3}]})",
       "\"unit\" must be a string"},
      {R"({"name": "m", "units": [)" + unit + "," + unit + R"(], "forward": [)" + use + "]}",
       "duplicate unit name \"a\""},
      {R"({"name": "m", "units": [)" + unit + R"(, {"name": "b", "params": 1}], "forward": [)" +
           use + "]}",
       "unit 'b' is never used"},
      {R"({"name": "m", "units": [{"name": "a"}], "forward": [)" + use + "]}",
       "exactly one of \"tensors\" and \"params\""},
      {R"({"name": "m", "units": [{"name": "a", "params": -4}], "forward": [)" + use + "]}",
       "\"params\" must not be negative"},
      {R"({"name": "m", "precision": {"param_dtype": "i32"}, "units": [)" + unit +
           R"(], "forward": [)" + use + "]}",
       "param_dtype is i32"},
      {R"({"name": "m", "units": [)" + unit + R"(], "forward": [{"unit": "a", "flops": 1}]})",
       "unknown member \"flops\""},
      {R"({"name": "m", "units": [)" + unit +
           R"(], "forward": [{"unit": "a", "selective_activation_bytes": 1}]})",
       "selective_activation_bytes and selective_recompute_flops go together"},
      {R"({"name": "m", "units": [)" + unit +
           R"(], "forward": [{"unit": "a", "forward_flops": 10, "activation_bytes": 4, )" +
           R"("selective_activation_bytes": 5, "selective_recompute_flops": 1}]})",
       "keeps more with selective checkpointing (5 bytes) than without (4)"},
      {R"({"name": "m", "units": [)" + unit +
           R"(], "forward": [{"unit": "a", "selective_recompute_work": {}}]})",
       "selective_recompute_work needs forward_work"},
      {R"({"name": "m", "units": [)" + unit +
           R"(], "forward": [{"unit": "a", "forward_flops": 10, "forward_work": {"matmul_flops": 9}}]})",
       "must add up to forward_flops (10)"},
      {R"({"name": "m", "units": [)" + unit +
           R"(], "forward": [{"unit": "a", "forward_work": {"matmul": 9}}]})",
       "unknown member \"matmul\""},
  };
  for (const Case& c : cases) {
    absl::StatusOr<ModelDescription> m = ParseModelJson(c.json);
    ASSERT_FALSE(m.ok()) << c.json;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
    EXPECT_TRUE(absl::StrContains(m.status().message(), c.expected))
        << m.status() << "\nexpected: " << c.expected;
  }
}

}  // namespace
}  // namespace shardline
