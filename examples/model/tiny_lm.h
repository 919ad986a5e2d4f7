// File: examples/model/tiny_lm.h
// -----------------------------------------------------------------------------
// TinyLM: the small per-token language model that the sharded training example trains, written
// in plain C++ (no BLAS) against a four-hook interface (UnitAccess), so that the same model code
// runs unsharded (ReferenceAccess, in this file) and sharded (the FSDP scheduler's access).
//
// The model, for ModelConfig {V = vocab, D = dim, H = hidden, L = blocks}:
//   unit 0 "embed"      embed.weight E [V, D] (tied: the embedding AND the output head),
//                       head.bias c [V]
//   unit i "block<i>"   block<i>.w1 [H, D], block<i>.b1 [H], block<i>.w2 [D, H], block<i>.b2 [D]
//   (i = 1..L)
// For each example (token, target) of a batch:
//   h_0 = E[token];  h_i = h_{i-1} + W2_i gelu_tanh(W1_i h_{i-1} + b1_i) + b2_i;
//   logits = E h_L + c;  loss = -log_softmax(logits)[target]
// and the step's loss is the SUM over the batch divided by `loss_denominator` (the global batch
// size), so that the losses and gradients of the pieces of a global batch (ranks, micro-batches)
// add up to the global mean's.
//
// Hook order of one step (U(i) = Pre..Post of unit i):
//   forward   F(0) [embedding lookup], F(1) .. F(L), F(0) [head: logits and loss]
//   backward  B(0) [head], B(L) .. B(1), B(0) [embedding: scatter-add of the input gradient]
// With recompute (activation checkpointing) the forward keeps only each block's input, and the
// backward of block i is F(i) [re-run of its forward] immediately followed by B(i).
// Param(u, t) may be used only between Pre* and Post* of unit u, Grad(u, t) only between
// PreBackward and PostBackward: the sharded access frees them otherwise. The model never keeps a
// weight pointer past Post*; it keeps activations. Gradients are ADDED (+=): unit 0 receives two
// contributions per step, and micro-batches accumulate.
//
// Numbers: f32 storage and f32 arithmetic, except the loss (summed in f64). Everything is
// deterministic: the same inputs give bit-identical outputs, whatever the hooks do.
//
// Data parallelism: each rank runs its slice of the global batch with loss_denominator = the
// global batch size, so the global gradient is the SUM of the ranks' gradients (reduce with
// kSum, not kAvg) and the global loss the sum of the returned losses.
//
// Thread safety: the free functions keep no state (one call per thread at a time per UnitAccess);
// a ReferenceAccess is used by one thread at a time.
//
//   ReferenceAccess ref(config);
//   SL_ASSIGN_OR_RETURN(std::vector<double> losses,
//                       TrainReference(config, /*steps=*/20, /*data_parallel_world=*/2,
//                                      /*micro_batches=*/1, {}, ref));

#ifndef SHARDLINE_EXAMPLES_MODEL_TINY_LM_H_
#define SHARDLINE_EXAMPLES_MODEL_TINY_LM_H_

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "runtime/flat_layout.h"

namespace shardline::examples {

struct ModelConfig {
  int vocab = 96;
  int dim = 48;
  int hidden = 96;
  int blocks = 10;
  int tokens_per_rank = 64;  // examples per data-parallel rank per step
  uint64_t seed = 1;         // the initial parameters (InitUnit)

  int num_units() const { return blocks + 1; }
  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};
std::ostream& operator<<(std::ostream& os, const ModelConfig& config);

// OK, or InvalidArgument naming the first field that is not >= 1.
absl::Status ValidateConfig(const ModelConfig& config);

// Tensor indices within a unit (the order of UnitDef::tensors).
inline constexpr int kEmbedWeight = 0;  // unit 0
inline constexpr int kHeadBias = 1;     // unit 0
inline constexpr int kW1 = 0;           // units 1..blocks
inline constexpr int kB1 = 1;
inline constexpr int kW2 = 2;
inline constexpr int kB2 = 3;

// One unit as the scheduler registers it: its name and its f32 tensors, in index order.
struct UnitDef {
  std::string name;
  std::vector<TensorSpec> tensors;
};

// The units of the model: "embed" (embed.weight, head.bias), then "block1" .. "block<L>"
// (block<i>.w1, .b1, .w2, .b2). Requires a valid config (SL_CHECK).
std::vector<UnitDef> ModelUnits(const ModelConfig& config);

// Element count of tensor `tensor` of unit `unit`. Requires valid indices (SL_CHECK).
size_t TensorNumel(const ModelConfig& config, int unit, int tensor);

// Fills `tensors` (resized to the unit's tensors, each to its numel) with the unit's initial
// values, a pure function of (config.seed, unit, tensor, element): uniform in [-s, s) with
// s = 0.5 for the embedding, 1/sqrt(D) for w1, 0.5/sqrt(H * L) for w2; biases are zero.
// Requires a valid config and 0 <= unit < num_units() (SL_CHECK).
void InitUnit(const ModelConfig& config, int unit, std::vector<std::vector<float>>& tensors);

// ---- The hooks ------------------------------------------------------------------------------

// What the model needs from whoever holds the parameters (see the file comment for the order
// and the rules). A hook's error aborts the step and is returned by TrainStepForwardBackward.
class UnitAccess {
 public:
  virtual ~UnitAccess() = default;
  virtual absl::Status PreForward(int unit) = 0;  // after it: Param(unit, t) readable
  virtual absl::Status PostForward(int unit) = 0;
  // After it: Param readable, Grad(unit, t) writable. The model ADDS into the gradients.
  virtual absl::Status PreBackward(int unit) = 0;
  virtual absl::Status PostBackward(int unit) = 0;
  // TensorNumel(config, unit, tensor) elements. nullptr (a broken call discipline) makes the
  // step fail with FailedPrecondition.
  virtual const float* Param(int unit, int tensor) = 0;
  virtual float* Grad(int unit, int tensor) = 0;
};

enum class Hook { kPreForward, kPostForward, kPreBackward, kPostBackward };
struct HookCall {
  Hook hook = Hook::kPreForward;
  int unit = 0;
  friend bool operator==(const HookCall&, const HookCall&) = default;
};
std::ostream& operator<<(std::ostream& os, const HookCall& call);  // "F+3", "B-0", ...

// ---- One step -------------------------------------------------------------------------------

struct Example {
  int32_t token = 0;   // in [0, vocab)
  int32_t target = 0;  // in [0, vocab)
  friend bool operator==(const Example&, const Example&) = default;
};

struct StepOptions {
  // Activation checkpointing: see the file comment.
  bool recompute = false;
  // Tests only. Empty, or one flag per unit: a flagged unit's backward does not run at all (no
  // PreBackward/PostBackward, no gradient, and with recompute no re-run of its forward). This is
  // deliberately WRONG math, for testing how the scheduler treats a unit without a backward:
  // the gradient flowing through a skipped block is taken to pass through its residual only
  // (dh_{i-1} = dh_i), and skipping unit 0 skips both of its backward uses (the head gives no
  // gradient: the blocks' backwards run on zeros).
  std::vector<bool> skip_backward;
};

// The hook sequence of one TrainStepForwardBackward with these options (see the file comment).
std::vector<HookCall> ExpectedHookSequence(const ModelConfig& config, const StepOptions& options);

// Runs the forward and the backward of `batch` through `access`, adding the gradients of
// sum(loss) / loss_denominator into access.Grad, and returns this batch's sum(loss) /
// loss_denominator. InvalidArgument for an invalid config, an empty batch, a token or target
// outside [0, vocab) (naming the example), loss_denominator < 1, or skip_backward of a size
// other than 0 or num_units(); FailedPrecondition if Param/Grad return nullptr; a hook's error
// as the hook returned it (annotated with the unit).
absl::StatusOr<double> TrainStepForwardBackward(const ModelConfig& config, UnitAccess& access,
                                                absl::Span<const Example> batch,
                                                int loss_denominator, const StepOptions& options);

// ---- Data -----------------------------------------------------------------------------------

// This rank's slice of the global batch of `step`. The global batch has tokens_per_rank *
// world_data_parallel examples; rank r gets examples [r * tokens_per_rank, (r + 1) *
// tokens_per_rank). Example g of step s is a pure function of (seed, s, g): a uniform token and
// target = (5 * token + 3) mod vocab, except that one example in 10 gets a uniform random target
// (noise). So concatenating the slices of ranks 0..W-1 gives the global batch. InvalidArgument
// for an invalid config, step < 0, world_data_parallel < 1 or rank outside [0, world).
absl::StatusOr<std::vector<Example>> SyntheticBatch(const ModelConfig& config, uint64_t seed,
                                                    int step, int rank, int world_data_parallel);

// ---- Optimizer ------------------------------------------------------------------------------

struct AdamW {
  float lr = 3e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;  // decoupled, applied to every tensor (biases included)
};

// One AdamW update of n elements, purely elementwise (so an update over shards equals the update
// of the whole tensor, element by element, bit for bit). `step` counts from 1 (bias correction).
// For each i: m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
//             p = p (1 - lr wd) - lr (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps).
// Requires step >= 1 (SL_CHECK).
void AdamWStep(const AdamW& adamw, int step, float* param, const float* grad, float* m, float* v,
               size_t n);

// ---- The unsharded reference ----------------------------------------------------------------

// Every unit's parameters, gradients and AdamW moments in memory, in one process. The hooks do
// nothing but check the call discipline and log the calls: a Pre* while another unit is open,
// a Post* that does not close the open unit, Param outside Pre..Post of its unit, or Grad outside
// PreBackward..PostBackward of its unit is an error: the hook returns FailedPrecondition (Param
// and Grad return nullptr) and the first such error is kept in status().
class ReferenceAccess : public UnitAccess {
 public:
  // Parameters from InitUnit, gradients and moments zero. Requires a valid config (SL_CHECK).
  explicit ReferenceAccess(const ModelConfig& config);

  absl::Status PreForward(int unit) override;
  absl::Status PostForward(int unit) override;
  absl::Status PreBackward(int unit) override;
  absl::Status PostBackward(int unit) override;
  const float* Param(int unit, int tensor) override;
  float* Grad(int unit, int tensor) override;

  const ModelConfig& config() const { return config_; }
  // Direct access, outside the hook discipline (for initialisation, tests and comparisons).
  std::vector<float>& param(int unit, int tensor) { return params_[unit][tensor]; }
  std::vector<float>& grad(int unit, int tensor) { return grads_[unit][tensor]; }
  const std::vector<std::vector<std::vector<float>>>& params() const { return params_; }
  const std::vector<std::vector<std::vector<float>>>& grads() const { return grads_; }

  void ZeroGrads();
  // AdamWStep on every tensor of every unit with its gradient (step counts from 1).
  void Step(const AdamW& adamw, int step);

  // The first discipline error (OK if none), and the hooks called since the last ClearLog().
  const absl::Status& status() const { return status_; }
  const std::vector<HookCall>& log() const { return log_; }
  void ClearLog() { log_.clear(); }

 private:
  absl::Status Open(Hook hook, int unit);
  absl::Status Close(Hook hook, int unit);
  absl::Status Fail(absl::Status status);

  ModelConfig config_;
  // [unit][tensor][element]
  std::vector<std::vector<std::vector<float>>> params_, grads_, adam_m_, adam_v_;
  int open_unit_ = -1;
  bool open_backward_ = false;
  absl::Status status_;
  std::vector<HookCall> log_;
};

struct TrainOptions {
  AdamW adamw;
  StepOptions step;
  uint64_t data_seed = 7;  // SyntheticBatch's seed
};

// The single-process, unsharded run of the whole global batch: what a sharded run on
// data_parallel_world ranks must reproduce. For step s = 0 .. steps-1: ZeroGrads; the global
// batch (SyntheticBatch of ranks 0..W-1, concatenated) split into micro_batches contiguous pieces
// (piece k = examples [k G / m, (k + 1) G / m)), each run by TrainStepForwardBackward with
// loss_denominator = G; then access.Step(adamw, s + 1). Returns the loss of each step (the sum of
// its pieces' losses: the global mean). InvalidArgument for steps < 0, data_parallel_world < 1,
// micro_batches outside [1, G], a config other than access.config(); errors of the step as
// TrainStepForwardBackward returns them.
absl::StatusOr<std::vector<double>> TrainReference(const ModelConfig& config, int steps,
                                                   int data_parallel_world, int micro_batches,
                                                   const TrainOptions& options,
                                                   ReferenceAccess& access);

}  // namespace shardline::examples

#endif  // SHARDLINE_EXAMPLES_MODEL_TINY_LM_H_
