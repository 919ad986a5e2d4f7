// File: examples/model/sharded_trainer.cc
// -----------------------------------------------------------------------------
// The glue between the model's UnitAccess hooks and the Scheduler, and the training loop.

#include "examples/model/sharded_trainer.h"

#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/host_kernels.h"
#include "runtime/status.h"
#include "runtime/trace.h"

namespace shardline::examples {
namespace {

absl::Time Deadline(const Communicator& world) { return absl::Now() + world.timeout(); }

// UnitAccess over the scheduler, the compute being the calling thread. Traces each unit's
// forward and backward compute on the "compute" track.
class ShardedAccess final : public UnitAccess {
 public:
  ShardedAccess(Scheduler& scheduler, TraceWriter* trace)
      : s_(scheduler),
        trace_(trace),
        staged_(scheduler.num_units()),
        staged_grad_(scheduler.num_units()) {
    if (trace_ != nullptr) track_ = trace_->Track("compute");
  }

  absl::Status PreForward(int unit) override {
    SL_RETURN_IF_ERROR(s_.PreForward(unit));
    SL_RETURN_IF_ERROR(Stage(unit, /*grads=*/false));
    start_ = absl::Now();
    return absl::OkStatus();
  }
  absl::Status PostForward(int unit) override {
    Span(absl::StrCat("forward ", s_.unit(unit).name()));
    return s_.PostForward(unit);
  }
  absl::Status PreBackward(int unit) override {
    SL_RETURN_IF_ERROR(s_.PreBackward(unit));
    SL_RETURN_IF_ERROR(Stage(unit, /*grads=*/true));
    start_ = absl::Now();
    return absl::OkStatus();
  }
  absl::Status PostBackward(int unit) override {
    Span(absl::StrCat("backward ", s_.unit(unit).name()));
    FlatParameter& p = s_.unit(unit);
    if (p.policy().param_dtype != DType::kF32) {
      // The f32 gradient of the model's kernels goes into the param-dtype unsharded gradient.
      // g = param_dtype(f32(g) + staged): one rounding, as an f32 add into a bf16 gradient.
      std::vector<float> sum;
      for (int t = 0; t < p.layout().num_tensors(); ++t) {
        SL_ASSIGN_OR_RETURN(TensorView g, p.GradView(t));
        const std::vector<float>& staged = staged_grad_[unit][t];
        sum.resize(g.numel);
        SL_RETURN_IF_ERROR(Cast(g.data, g.dtype, sum.data(), DType::kF32, g.numel));
        for (size_t i = 0; i < g.numel; ++i) sum[i] += staged[i];
        SL_RETURN_IF_ERROR(Cast(sum.data(), DType::kF32, g.data, g.dtype, g.numel));
      }
    }
    return s_.PostBackward(unit);
  }
  const float* Param(int unit, int tensor) override {
    FlatParameter& p = s_.unit(unit);
    if (p.policy().param_dtype != DType::kF32) return staged_[unit][tensor].data();
    absl::StatusOr<TensorView> v = p.View(tensor);
    return v.ok() ? static_cast<const float*>(v->data) : nullptr;
  }
  float* Grad(int unit, int tensor) override {
    FlatParameter& p = s_.unit(unit);
    if (p.policy().param_dtype != DType::kF32) return staged_grad_[unit][tensor].data();
    absl::StatusOr<TensorView> g = p.GradView(tensor);
    return g.ok() ? static_cast<float*>(g->data) : nullptr;
  }

 private:
  // Low-precision parameters: cast to f32 for the model's kernels; a zero f32 gradient.
  absl::Status Stage(int unit, bool grads) {
    FlatParameter& p = s_.unit(unit);
    if (p.policy().param_dtype == DType::kF32) return absl::OkStatus();
    const int n = p.layout().num_tensors();
    staged_[unit].resize(n);
    if (grads) staged_grad_[unit].assign(n, {});
    for (int t = 0; t < n; ++t) {
      SL_ASSIGN_OR_RETURN(TensorView v, p.View(t));
      std::vector<float>& out = staged_[unit][t];
      out.resize(v.numel);
      SL_RETURN_IF_ERROR(Cast(v.data, v.dtype, out.data(), DType::kF32, v.numel));
      if (grads) staged_grad_[unit][t].assign(v.numel, 0.0f);
    }
    return absl::OkStatus();
  }
  void Span(const std::string& name) {
    if (trace_ != nullptr)
      trace_->AddComplete(track_, name, "compute", start_, absl::Now() - start_);
  }

  Scheduler& s_;
  TraceWriter* trace_;
  int track_ = 0;
  absl::Time start_;
  std::vector<std::vector<std::vector<float>>> staged_;
  std::vector<std::vector<std::vector<float>>> staged_grad_;
};

}  // namespace

absl::StatusOr<ShardedRun> TrainSharded(const ModelConfig& config,
                                        std::shared_ptr<Communicator> world,
                                        const ShardedRunOptions& options) {
  SL_RETURN_IF_ERROR(ValidateConfig(config));
  const int world_size = world->size();
  const int rank = world->rank();
  if (options.micro_batches < 1 || config.tokens_per_rank % options.micro_batches != 0) {
    return absl::InvalidArgumentError(absl::StrCat("micro_batches ", options.micro_batches,
                                                   " must be >= 1 and divide tokens_per_rank ",
                                                   config.tokens_per_rank));
  }
  if (options.precision.sharded_grad_dtype() != DType::kF32 ||
      options.precision.master_dtype != DType::kF32) {
    return absl::InvalidArgumentError(
        "the example's AdamW runs on f32 master shards and f32 sharded gradients");
  }
  SL_ASSIGN_OR_RETURN(
      std::unique_ptr<Stream> compute,
      CreateCallerStream(
          {.name = "compute", .trace = options.scheduler.trace, .track = "compute"}));
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Scheduler> sched,
                      Scheduler::Create(world, *compute, options.scheduler, Deadline(*world)));
  const std::vector<UnitDef> defs = ModelUnits(config);
  std::vector<std::vector<float>> adam_m(defs.size()), adam_v(defs.size());
  for (size_t u = 0; u < defs.size(); ++u) {
    UnitPolicy policy{.precision = options.precision, .reduce_op = ReduceOp::kSum};
    SL_ASSIGN_OR_RETURN(
        int id,
        sched->RegisterUnit({.name = defs[u].name, .tensors = defs[u].tensors, .policy = policy}));
    std::vector<std::vector<float>> values;
    InitUnit(config, id, values);
    std::vector<const void*> pointers;
    for (const auto& v : values) pointers.push_back(v.data());
    SL_RETURN_IF_ERROR(sched->unit(id).SetShardFromTensors(pointers, Deadline(*world)));
    adam_m[u].assign(sched->unit(id).layout().shard_elements(), 0.0f);
    adam_v[u].assign(sched->unit(id).layout().shard_elements(), 0.0f);
  }

  ShardedAccess access(*sched, options.scheduler.trace);
  ShardedRun run;
  const int global_batch = config.tokens_per_rank * world_size;
  const int piece = config.tokens_per_rank / options.micro_batches;
  for (int step = 0; step < options.steps; ++step) {
    const absl::Time started = absl::Now();
    SL_ASSIGN_OR_RETURN(std::vector<Example> batch,
                        SyntheticBatch(config, options.train.data_seed, step, rank, world_size));
    double loss = 0;
    for (int mb = 0; mb < options.micro_batches; ++mb) {
      const bool last = mb + 1 == options.micro_batches;
      sched->SetRequiresGradientSync(options.accumulation != Accumulation::kNoSync || last);
      sched->SetRequiresAllReduce(options.accumulation != Accumulation::kDeferAllReduce || last);
      SL_ASSIGN_OR_RETURN(double part,
                          TrainStepForwardBackward(
                              config, access, absl::MakeConstSpan(batch).subspan(mb * piece, piece),
                              global_batch, options.train.step));
      loss += part;
      SL_RETURN_IF_ERROR(sched->FinishBackward());
    }
    // AdamW on this rank's shards (the compute stream is this thread: the reductions are done).
    for (int u = 0; u < sched->num_units(); ++u) {
      FlatShardView p = sched->unit(u).master_shard();
      SL_ASSIGN_OR_RETURN(FlatShardView g, sched->unit(u).ShardGrad());
      AdamWStep(options.train.adamw, step + 1, static_cast<float*>(p.data),
                static_cast<const float*>(g.data), adam_m[u].data(), adam_v[u].data(), p.elements);
    }
    SL_RETURN_IF_ERROR(sched->ZeroGrad());
    ReduceOptions sum;
    sum.op = ReduceOp::kSum;
    SL_ASSIGN_OR_RETURN(Work work, world->AllReduce(&loss, &loss, 1, DType::kF64, *compute, sum));
    SL_RETURN_IF_ERROR(work.Wait(Deadline(*world)));
    SL_ASSIGN_OR_RETURN(StepMetrics metrics, sched->LastStepMetrics(Deadline(*world)));
    run.losses.push_back(loss);
    run.metrics.push_back(metrics);
    if (options.on_step) options.on_step(step, loss, metrics, absl::Now() - started);
  }

  for (int u = 0; u < sched->num_units(); ++u) {
    const FlatLayout& layout = sched->unit(u).layout();
    const FlatShardView p = sched->unit(u).master_shard();
    std::vector<std::vector<float>> tensors;
    std::vector<std::vector<uint8_t>> owned;
    for (int t = 0; t < layout.num_tensors(); ++t) {
      tensors.emplace_back(layout.tensor(t).numel, 0.0f);
      owned.emplace_back(layout.tensor(t).numel, 0);
      std::optional<ShardSlice> slice = layout.Intersection(t, p.shard);
      if (!slice.has_value()) continue;
      for (size_t i = 0; i < slice->length; ++i) {
        tensors.back()[slice->tensor_offset + i] =
            static_cast<const float*>(p.data)[slice->shard_offset + i];
        owned.back()[slice->tensor_offset + i] = 1;
      }
    }
    run.params.push_back(std::move(tensors));
    run.owned.push_back(std::move(owned));
  }
  return run;
}

absl::StatusOr<std::vector<double>> TrainDataParallelReference(const ModelConfig& config, int steps,
                                                               int world, int micro_batches,
                                                               int group,
                                                               const TrainOptions& options,
                                                               ReferenceAccess& access) {
  if (group < 1 || world % group != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("reference: group ", group, " does not divide the world ", world));
  }
  const int global = config.tokens_per_rank * world;
  const int piece = config.tokens_per_rank / micro_batches;
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    // [unit][tensor][element]: the gradients summed over the ranks of each group in rank order,
    // then the groups' sums in group order.
    std::vector<std::vector<std::vector<float>>> total, partial;
    auto add = [](std::vector<std::vector<std::vector<float>>>& into,
                  const std::vector<std::vector<std::vector<float>>>& g) {
      if (into.empty()) {
        into = g;
        return;
      }
      for (size_t u = 0; u < into.size(); ++u) {
        for (size_t t = 0; t < into[u].size(); ++t) {
          for (size_t i = 0; i < into[u][t].size(); ++i) into[u][t][i] += g[u][t][i];
        }
      }
    };
    double loss = 0;
    for (int r = 0; r < world; ++r) {
      SL_ASSIGN_OR_RETURN(std::vector<Example> slice,
                          SyntheticBatch(config, options.data_seed, s, r, world));
      access.ZeroGrads();
      for (int mb = 0; mb < micro_batches; ++mb) {
        SL_ASSIGN_OR_RETURN(
            double part, TrainStepForwardBackward(
                             config, access, absl::MakeConstSpan(slice).subspan(mb * piece, piece),
                             global, options.step));
        loss += part;
      }
      add(partial, access.grads());
      if ((r + 1) % group == 0) {
        add(total, partial);
        partial.clear();
      }
    }
    for (size_t u = 0; u < total.size(); ++u) {
      for (size_t t = 0; t < total[u].size(); ++t) access.grad(u, t) = total[u][t];
    }
    access.Step(options.adamw, s + 1);
    losses.push_back(loss);
  }
  return losses;
}

absl::StatusOr<ReferenceComparison> CompareWithReference(const ModelConfig& config,
                                                         Communicator& world, const ShardedRun& run,
                                                         const ShardedRunOptions& options) {
  ReferenceAccess reference(config);
  ReferenceComparison out;
  // The groups whose gradients the reduce-scatter sums first: the shard groups.
  int group = world.size();
  if (options.scheduler.strategy == ShardingStrategy::kNoShard) group = 1;
  if (options.scheduler.strategy == ShardingStrategy::kHybridShard &&
      options.scheduler.shard_size > 0) {
    group = options.scheduler.shard_size;
  }
  SL_ASSIGN_OR_RETURN(
      out.reference_losses,
      TrainDataParallelReference(config, options.steps, world.size(), options.micro_batches, group,
                                 options.train, reference));
  // [diff^2, norm^2] per tensor, summed over the ranks.
  std::vector<double> sums;
  for (size_t u = 0; u < run.params.size(); ++u) {
    for (size_t t = 0; t < run.params[u].size(); ++t) {
      const std::vector<float>& want = reference.param(u, t);
      double diff = 0, norm = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        if (!run.owned[u][t][i]) continue;
        const double d = static_cast<double>(run.params[u][t][i]) - want[i];
        diff += d * d;
        norm += static_cast<double>(want[i]) * want[i];
      }
      sums.push_back(diff);
      sums.push_back(norm);
    }
  }
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, CreateCallerStream({.name = "compare"}));
  ReduceOptions sum;
  sum.op = ReduceOp::kSum;
  SL_ASSIGN_OR_RETURN(
      Work work, world.AllReduce(sums.data(), sums.data(), sums.size(), DType::kF64, *stream, sum));
  SL_RETURN_IF_ERROR(work.Wait(absl::Now() + world.timeout()));
  size_t k = 0;
  for (size_t u = 0; u < run.params.size(); ++u) {
    out.relative_error.emplace_back();
    for (size_t t = 0; t < run.params[u].size(); ++t, k += 2) {
      const double rel = sums[k + 1] > 0 ? std::sqrt(sums[k] / sums[k + 1]) : std::sqrt(sums[k]);
      out.relative_error.back().push_back(rel);
      out.max_relative_error = std::max(out.max_relative_error, rel);
    }
  }
  return out;
}

}  // namespace shardline::examples
