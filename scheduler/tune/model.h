// File: scheduler/tune/model.h
// -----------------------------------------------------------------------------
// What the simulation driver (scheduler/tune/simulate.h) needs to know about a model to run the
// scheduler on it without its math: the units the framework would register (their tensors and
// dtypes), the forward's sequence of unit uses with the FLOPs and activation memory of each, and
// the optimizer's state per parameter. A description comes from JSON (ParseModelJson, the form
// is in docs/tuning-model.md) or from a preset for a decoder-only transformer
// (TransformerModel).
//
//   SL_ASSIGN_OR_RETURN(ModelDescription m, TransformerModel(Llama3_8B({.seq_len = 8192})));
//   m.ParameterCount();   // 8'030'261'248
//
// FLOPs and activations of the transformer presets (per micro-batch of b sequences of s tokens,
// t = b*s; hidden h, FFN width f, a heads of width d = h/a, k KV heads, vocabulary V, L layers,
// p bytes per activation element = the param dtype's size):
//
//   forward FLOPs of a layer   2 * t * P_matmul + 4 * t * s * h   (P_matmul: the layer's matmul
//                              weights; the attention term counts QK^T and AV over the full
//                              s x s square, as Megatron-LM and PaLM's MFU do)
//   forward FLOPs of the head  2 * t * V * h;  of the embedding lookup: 0
//   backward FLOPs             2 x forward (gradients of inputs and of weights)
//   so one step's FLOPs are 6 * N_matmul * t + 12 * L * s * h * t: the "6N" rule plus attention.
//
//   activations of a layer, bytes per token, kept from forward to backward (Korthikanti et al.
//   2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.1,
//   generalised to grouped KV heads, gated FFNs, dropout on or off and fused attention):
//     attention  p*(h [norm input] + h [QKV input] + h [Q] + 2*k*d [K, V] + h [output-projection
//                input]) + (dropout ? h : 0)
//                + unfused: a*s*(p [softmax output] + (dropout ? 1 + p : 0) [mask, output])
//                + fused (FlashAttention): 4*a [the softmax's log-sum-exp, f32]
//     FFN        p*(h [norm input] + h [FFN input] + (gated ? 3f : 2f)) + (dropout ? h : 0)
//   For GPT-3's layer (p = 2, k = a, f = 4h, dropout, unfused) this is Korthikanti's
//   34*h + 5*a*s bytes per token.
//   With activation checkpointing a layer keeps only its input (p*h per token) and recomputes
//   the rest in its backward (one extra forward's FLOPs; its activations live during its own
//   backward only).
//   Selective op checkpointing follows torchtitan's `op` policy as its published Llama 3 runs
//   used it (torchtitan/parallelisms/parallelize_llama.py, commit 9dec370 of 2024-12-26,
//   `_save_list` and `_custom_policy`): inside a checkpointed block the outputs of aten.mm, of
//   the fused attention kernels (and of reduce-scatters) are saved, except every second mm
//   (the 2nd, 4th, ... of the block's forward), and everything else is recomputed. A layer's
//   matmuls run in the order wq, wk, wv, wo, w1, (w3,) w2, so it saves wq, wv, w1 and w2's
//   outputs when gated (wq, wv and w1 otherwise) and recomputes wk, wo and w3 (wk, wo and w2).
//   Linear layers with biases run aten.addmm, which the list does not name: a layer with
//   biases saves none of them and recomputes them all. Fused attention saves its output (p*h)
//   and log-sum-exp (4*a bytes); unfused attention (bmm, softmax) is recomputed,
//   4*t*s*h FLOPs. Bytes per token kept: p*h (the block's input) + the saved outputs.
//   The embedding and the head are not checkpointed (torchtitan wraps the blocks only).
//   The head keeps its norm's input and output and the logits in f32 for the loss
//   (2p*h + 4*V per token); the embedding its output (p*h per token).
//
// Parameter counts of the presets (checked in tests/scheduler/tune/tune_model_test.cc against the
// published figures): per layer 2*h*h + 2*h*k*d (attention) + (gated ? 3 : 2)*h*f (FFN) + the
// norms' weights (RMSNorm: h each; LayerNorm: 2h each) + biases where the model has them; the
// embedding V*h (+ s_max*h learned positions), the head V*h unless tied, the final norm.

#ifndef SHARDLINE_SCHEDULER_TUNE_MODEL_H_
#define SHARDLINE_SCHEDULER_TUNE_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "collectives/sim/topology.h"
#include "runtime/flat_layout.h"
#include "scheduler/mixed_precision.h"

namespace shardline {

// One unit the framework registers with the scheduler.
struct UnitDescription {
  std::string name;
  // Its parameters as the framework would register them (names unique within the unit).
  std::vector<TensorSpec> tensors;
  // The unit's dtypes (param, reduce, master) when they differ from the model's.
  bool has_precision = false;
  MixedPrecisionPolicy precision;

  // The parameter count: the tensors' elements (ties counted once).
  uint64_t ParameterCount() const;
};

// One use of a unit in the forward (a unit used twice, e.g. a tied embedding, appears twice).
struct UnitUse {
  int unit = 0;  // index into ModelDescription::units
  // Per micro-batch, per rank.
  uint64_t forward_flops = 0;
  uint64_t backward_flops = 0;
  // Bytes kept from this use's forward to its backward, per micro-batch, without and with
  // activation checkpointing. With checkpointing, a use whose checkpointed_activation_bytes is
  // below its activation_bytes recomputes its forward in its backward (forward_flops again) and
  // holds activation_bytes during its own backward; a use that keeps as much either way (the
  // presets' embedding and head) is not checkpointed.
  uint64_t activation_bytes = 0;
  uint64_t checkpointed_activation_bytes = 0;
  // Selective per-op checkpointing (Checkpointing::kOp, simulate.h): the bytes the use keeps
  // from its forward to its backward and the FLOPs its backward recomputes (it too holds
  // activation_bytes during its own backward). Only where `selective` is set: a JSON model gives
  // both members or neither, and op checkpointing refuses a model whose recomputing uses lack
  // them.
  bool selective = false;
  uint64_t selective_activation_bytes = 0;
  uint64_t selective_recompute_flops = 0;
  // The work by kind (collectives/sim/topology.h's ComputeWork, what a topology's
  // compute_efficiency times), where the model gives it (the presets do): the forward's, whose
  // matmul and attention FLOPs add up to forward_flops, and what op checkpointing recomputes
  // (adding up to selective_recompute_flops). The backward's work is twice the forward's matmul
  // FLOPs and elementwise bytes and the attention's backward kernel. Without it, every FLOP is
  // timed at the topology's compute_TFLOPs.
  bool has_work = false;
  ComputeWork forward_work;
  ComputeWork selective_recompute_work;
};

struct ModelDescription {
  std::string name;
  std::vector<UnitDescription> units;
  // The forward's sequence of unit uses; the backward runs it in reverse.
  std::vector<UnitUse> forward;
  // The default dtypes of every unit (UnitDescription::precision overrides).
  MixedPrecisionPolicy precision;
  // Optimizer state per parameter of the master shard (Adam in f32: 8; SGD with momentum: 4).
  uint64_t optimizer_state_bytes_per_param = 8;
  // Tokens per micro-batch per rank (for tokens/s; 0 if not a token model).
  uint64_t tokens_per_micro_batch = 0;

  // OK, or InvalidArgument naming what is wrong: no units, an empty or duplicate unit name, a
  // unit without tensors, a bad tensor (FlatLayout's check), a use naming no unit, a unit never
  // used, an invalid dtype policy.
  absl::Status Validate() const;
  uint64_t ParameterCount() const;
  // The precision unit `u` runs with.
  const MixedPrecisionPolicy& PrecisionOf(int u) const {
    return units[u].has_precision ? units[u].precision : precision;
  }
  // Sums over `forward` (per micro-batch).
  uint64_t ForwardFlops() const;
  uint64_t BackwardFlops() const;
};

// The JSON form (docs/tuning-model.md). InvalidArgument naming the member and the reason
// (unknown member, wrong type, missing member), or Validate()'s error.
absl::StatusOr<ModelDescription> ParseModelJson(absl::string_view json);
// The JSON form of `model` (ParseModelJson reads it back to an equal description).
std::string ModelToJson(const ModelDescription& model);

// A decoder-only transformer.
struct TransformerConfig {
  std::string name = "transformer";
  int layers = 0;
  int64_t hidden = 0;
  int64_t ffn = 0;
  int heads = 0;
  int kv_heads = 0;  // 0: heads (multi-head attention)
  int64_t vocab = 0;
  int64_t seq_len = 2048;
  int micro_batch = 1;
  bool gated_ffn = true;          // SwiGLU (three FFN matrices) or a GELU MLP (two)
  bool layer_norm = false;        // LayerNorm (weight and bias) or RMSNorm (weight)
  bool biases = false;            // biases on every linear layer (GPT)
  bool tied_embeddings = false;   // the head reuses the embedding: unit 0 is used twice
  int64_t learned_positions = 0;  // rows of a learned position embedding (GPT: seq_len)
  bool dropout = false;
  bool fused_attention = true;  // FlashAttention: no s x s activations
  MixedPrecisionPolicy precision = {
      .param_dtype = DType::kBF16, .reduce_dtype = DType::kF32, .master_dtype = DType::kF32};
  uint64_t optimizer_state_bytes_per_param = 8;  // AdamW in f32
};

// Units: "embed" (the token embedding, learned positions; with tied embeddings also the final
// norm, and its second use is the head), "layer0" ... "layer{L-1}", and without tied embeddings
// "head" (final norm and output projection). InvalidArgument for a non-positive dimension,
// heads not dividing hidden, or kv_heads not dividing heads.
absl::StatusOr<ModelDescription> TransformerModel(const TransformerConfig& config);

// Shapes of published models, with a sequence length and micro-batch of the caller's. Llama 3
// (Meta, "The Llama 3 Herd of Models", 2024, table 3): vocabulary 128256, SwiGLU, RMSNorm, 8 KV
// heads, untied. GPT-3 175B (Brown et al. 2020, table 2.1): 96 layers, hidden 12288, 96 heads,
// vocabulary 50257, learned positions, LayerNorm, biases, tied embeddings, dropout.
struct PresetShape {
  int64_t seq_len = 8192;
  int micro_batch = 1;
};
TransformerConfig Llama3_8B(PresetShape shape = {});
TransformerConfig Llama3_70B(PresetShape shape = {});
TransformerConfig Llama3_405B(PresetShape shape = {});
TransformerConfig Gpt3_175B(PresetShape shape = {.seq_len = 2048});
// "llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b"; InvalidArgument naming the known ones.
absl::StatusOr<TransformerConfig> PresetByName(absl::string_view name, PresetShape shape);

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_TUNE_MODEL_H_
