// The simulation driver (scheduler/tune/simulate.h). One driver plays the framework for every
// rank; a Backend (internal/simulate_backend.h, simulate_backends.cc) says where the ranks'
// streams, communicators and memory come from (virtual time and phantom memory, or the local
// backend and host memory), so that both runs call the same hooks in the same order. The
// clusters are in simulate_clusters.cc.

#include "scheduler/tune/simulate.h"

#include <algorithm>
#include <initializer_list>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "runtime/caching_pool.h"
#include "runtime/status.h"
#include "scheduler/tune/internal/simulate_backend.h"

namespace shardline {

using tune_internal::Backend;
using tune_internal::Rank;
using tune_internal::SubAllocator;

namespace {

constexpr absl::Duration kCreateTimeout = absl::Seconds(60);

// The ranks, torn down in dependency order (schedulers return buffers to the pools, the pools
// to their sub-allocators, those to the device; compute streams outlive the schedulers).
struct Ranks {
  std::vector<Rank> ranks;
  ~Ranks() {
    for (Rank& r : ranks) {
      r.scheduler.reset();
      r.activations_held.clear();
      r.optimizer_state.Reset();
      r.gather_pool.reset();
      r.reduce_pool.reset();
      r.shards.reset();
      r.gather_blocks.reset();
      r.reduce_blocks.reset();
      r.optimizer.reset();
      r.activations.reset();
      r.host_shards.reset();
      r.host_optimizer.reset();
      r.host.reset();
      r.compute.reset();
      r.device.reset();
    }
  }
};

absl::Status CheckConfig(const ModelDescription& model, const SimulationConfig& c) {
  SL_RETURN_IF_ERROR(model.Validate());
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("simulation config: ", parts...));
  };
  if (c.world_size < 1) return bad("world_size must be at least 1, got ", c.world_size);
  if (c.strategy == ShardingStrategy::kHybridShard &&
      (c.shard_size < 1 || c.world_size % c.shard_size != 0)) {
    return bad("hybrid shard_size ", c.shard_size, " must be positive and divide world_size ",
               c.world_size);
  }
  if (c.forward_prefetch < 0 || c.backward_prefetch_depth < 0) {
    return bad("prefetch depths must not be negative (forward ", c.forward_prefetch, ", backward ",
               c.backward_prefetch_depth, ")");
  }
  if (c.micro_batches < 1) return bad("micro_batches must be at least 1, got ", c.micro_batches);
  if (c.activation_checkpointing.mode == CheckpointMode::kLayer &&
      c.activation_checkpointing.every < 1) {
    return bad("layer checkpointing needs every >= 1, got ", c.activation_checkpointing.every);
  }
  if (c.root_unit < -1 || c.root_unit >= static_cast<int>(model.units.size())) {
    return bad("root_unit ", c.root_unit, " is not -1 or a unit (", model.units.size(), " units)");
  }
  return absl::OkStatus();
}

// What a use keeps from its forward to its backward, what its backward recomputes, and how
// long its forward and backward compute take.
struct UsePlan {
  uint64_t kept = 0;
  uint64_t recompute_flops = 0;
  bool recomputes = false;  // then it holds activation_bytes during its own backward
  ComputeWork recompute_work;
  absl::Duration forward, backward;
};

// A use's work by kind, or all of its FLOPs as `other` where the model does not say (model.h).
ComputeWork ForwardWork(const UnitUse& use) {
  if (use.has_work) return use.forward_work;
  return {.other_flops = static_cast<double>(use.forward_flops)};
}
ComputeWork BackwardWork(const UnitUse& use) {
  if (!use.has_work) return {.other_flops = static_cast<double>(use.backward_flops)};
  ComputeWork w = use.forward_work;
  w.matmul_flops *= 2;
  w.elementwise_bytes *= 2;
  w.backward = true;
  return w;
}

// The plan of each use of the forward under the config's checkpointing (simulate.h), with the
// cluster's durations in `dtype` (zero without a cluster).
absl::StatusOr<std::vector<UsePlan>> PlanCheckpointing(const ModelDescription& model,
                                                       const SimulationConfig& c,
                                                       const SimCluster* cluster, DType dtype) {
  std::vector<UsePlan> plan;
  int layer = 0;  // the uses checkpointing applies to, counted from 1
  for (size_t k = 0; k < model.forward.size(); ++k) {
    const UnitUse& use = model.forward[k];
    UsePlan p{.kept = use.activation_bytes};
    const bool applies = use.checkpointed_activation_bytes < use.activation_bytes;
    layer += applies ? 1 : 0;
    const CheckpointMode mode = c.activation_checkpointing.mode;
    const bool full =
        mode == CheckpointMode::kFull ||
        (mode == CheckpointMode::kLayer && layer % c.activation_checkpointing.every == 0);
    if (applies && full) {
      p = {.kept = use.checkpointed_activation_bytes,
           .recompute_flops = use.forward_flops,
           .recomputes = true,
           .recompute_work = ForwardWork(use)};
    } else if (applies && mode == CheckpointMode::kOp) {
      if (!use.selective) {
        return absl::InvalidArgumentError(absl::StrCat(
            "simulation config: op checkpointing needs the model's selective figures, and forward "
            "use ",
            k, " (unit '", model.units[use.unit].name, "') has none"));
      }
      p = {.kept = use.selective_activation_bytes,
           .recompute_flops = use.selective_recompute_flops,
           .recomputes = use.selective_activation_bytes < use.activation_bytes,
           .recompute_work = use.has_work ? use.selective_recompute_work
                                          : ComputeWork{.other_flops = static_cast<double>(
                                                            use.selective_recompute_flops)}};
    }
    if (cluster != nullptr) {
      p.forward = cluster->ComputeDuration(ForwardWork(use), dtype);
      p.backward = cluster->ComputeDuration(BackwardWork(use), dtype);
      if (p.recompute_flops > 0 || p.recompute_work.elementwise_bytes > 0) {
        p.backward += cluster->ComputeDuration(p.recompute_work, dtype);
      }
    }
    plan.push_back(p);
  }
  return plan;
}

// Appends the rank's issue-log entries made since the last call to its current step's log.
void TakeIssues(Rank& r) {
  const std::vector<std::string>& issued = r.scheduler->issue_log();
  for (; r.issues_seen < issued.size(); ++r.issues_seen) {
    r.logs.back().push_back(issued[r.issues_seen]);
  }
}

// HostLead::kOneUse: every rank's host waits for the compute it has enqueued so far.
absl::Status WaitForCompute(Backend& backend, std::vector<Rank>& ranks, const SimulationConfig& c) {
  if (c.host_lead != HostLead::kOneUse) return absl::OkStatus();
  for (Rank& r : ranks) {
    SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> done, RecordEvent(*r.compute));
    SL_RETURN_IF_ERROR(done->Synchronize(backend.Deadline()));
  }
  return absl::OkStatus();
}

absl::Status RunStep(Backend& backend, std::vector<Rank>& ranks, const ModelDescription& model,
                     const SimulationConfig& c, const std::vector<UsePlan>& plan) {
  for (Rank& r : ranks) r.logs.emplace_back();
  for (size_t k = 0; k < model.forward.size(); ++k) {
    const UnitUse& use = model.forward[k];
    const std::string& name = model.units[use.unit].name;
    for (Rank& r : ranks) {
      SL_RETURN_IF_ERROR(r.scheduler->PreForward(use.unit));
      TakeIssues(r);
      SL_ASSIGN_OR_RETURN(r.activations_held[k], r.activations->Allocate(plan[k].kept));
      SL_RETURN_IF_ERROR(backend.Compute(*r.compute, absl::StrCat("f ", name), use.forward_flops,
                                         plan[k].forward));
      r.logs.back().push_back(absl::StrCat("f ", name));
      SL_RETURN_IF_ERROR(r.scheduler->PostForward(use.unit));
      TakeIssues(r);
    }
    SL_RETURN_IF_ERROR(WaitForCompute(backend, ranks, c));
  }
  for (size_t k = model.forward.size(); k-- > 0;) {
    const UnitUse& use = model.forward[k];
    const std::string& name = model.units[use.unit].name;
    for (Rank& r : ranks) {
      SL_RETURN_IF_ERROR(r.scheduler->PreBackward(use.unit));
      TakeIssues(r);
      // Checkpointing: what the use did not keep is recomputed, and lives beside what it kept
      // during its backward (activation_bytes in all). The memory is the framework's and the
      // compute ops never touch it, so it is released on the host at once (issue order, as the
      // framework's own caching allocator reuses it stream-ordered).
      Buffer recomputed;
      const uint64_t flops = use.backward_flops + plan[k].recompute_flops;
      if (plan[k].recomputes) {
        SL_ASSIGN_OR_RETURN(recomputed,
                            r.activations->Allocate(use.activation_bytes - plan[k].kept));
      }
      SL_RETURN_IF_ERROR(
          backend.Compute(*r.compute, absl::StrCat("b ", name), flops, plan[k].backward));
      r.logs.back().push_back(absl::StrCat("b ", name));
      SL_RETURN_IF_ERROR(r.scheduler->PostBackward(use.unit));
      TakeIssues(r);
      r.activations_held[k].Reset();
    }
    SL_RETURN_IF_ERROR(WaitForCompute(backend, ranks, c));
  }
  for (Rank& r : ranks) {
    SL_RETURN_IF_ERROR(r.scheduler->FinishBackward());
    TakeIssues(r);
  }
  return backend.Drain(ranks);
}

// The shard-group size of the strategy's ProcessMesh (scheduler.cc).
int MeshShardSize(const SimulationConfig& c) {
  switch (c.strategy) {
    case ShardingStrategy::kNoShard:
      return 1;
    case ShardingStrategy::kHybridShard:
      return c.shard_size;
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      break;
  }
  return c.world_size;
}

// What every device has sent so far, by device id (empty without a topology).
std::vector<SimLinkTraffic> Traffic(const std::vector<std::shared_ptr<Communicator>>& world) {
  return world.empty() ? std::vector<SimLinkTraffic>{} : SimTrafficByDevice(*world[0]);
}

absl::StatusOr<SimulationReport> Run(Backend& backend, const ModelDescription& model,
                                     const SimulationConfig& c, const SimCluster* cluster) {
  SL_RETURN_IF_ERROR(CheckConfig(model, c));
  const DType compute_dtype = c.param_dtype.value_or(model.precision.param_dtype);
  SL_ASSIGN_OR_RETURN(const std::vector<UsePlan> plan,
                      PlanCheckpointing(model, c, cluster, compute_dtype));
  bool representative = false;
  if (c.ranks != RankMode::kAll && cluster != nullptr) {
    const bool symmetric = cluster->RanksSymmetric(c.world_size, MeshShardSize(c));
    if (c.ranks == RankMode::kRepresentative && !symmetric) {
      return absl::FailedPreconditionError(absl::StrCat(
          "simulation config: a representative rank needs symmetric ranks, but on ",
          cluster->Describe(), " a world of ", c.world_size, " with shard groups of ",
          MeshShardSize(c), " places groups differently (use RankMode::kAll or kAuto)"));
    }
    representative = symmetric;
  } else if (c.ranks == RankMode::kRepresentative) {
    return absl::InvalidArgumentError(
        "the host backend runs every rank: a representative rank exists only on virtual time");
  }
  std::vector<std::shared_ptr<Communicator>> world;
  if (representative) {
    SL_ASSIGN_OR_RETURN(world, backend.Representative(c.world_size, MeshShardSize(c)));
    backend.UseRepresentative(c.world_size);
  } else {
    SL_ASSIGN_OR_RETURN(world, backend.World(c.world_size));
  }
  const int simulated = static_cast<int>(world.size());
  Ranks owner;
  std::vector<Rank>& ranks = owner.ranks;
  ranks.resize(simulated);
  std::vector<SchedulerOptions> options(simulated);
  for (int i = 0; i < simulated; ++i) {
    Rank& r = ranks[i];
    r.device = backend.DeviceMemory(i);
    r.shards = std::make_unique<SubAllocator>(*r.device, absl::StrCat("rank", i, ".shards"));
    r.gather_blocks = std::make_unique<SubAllocator>(*r.device, absl::StrCat("rank", i, ".gather"));
    r.reduce_blocks = std::make_unique<SubAllocator>(*r.device, absl::StrCat("rank", i, ".reduce"));
    r.optimizer = std::make_unique<SubAllocator>(*r.device, absl::StrCat("rank", i, ".optimizer"));
    r.activations =
        std::make_unique<SubAllocator>(*r.device, absl::StrCat("rank", i, ".activations"));
    r.host = backend.HostMemory(i);
    r.host_shards =
        std::make_unique<SubAllocator>(*r.host, absl::StrCat("rank", i, ".host shards"));
    r.host_optimizer =
        std::make_unique<SubAllocator>(*r.host, absl::StrCat("rank", i, ".host optimizer"));
    r.gather_pool = std::make_unique<CachingPool>(
        *r.gather_blocks, CachingPoolOptions{.name = absl::StrCat("rank", i, ".gather pool")});
    r.reduce_pool = std::make_unique<CachingPool>(
        *r.reduce_blocks, CachingPoolOptions{.name = absl::StrCat("rank", i, ".reduce pool")});
    TraceWriter* trace = i == 0 ? c.trace : nullptr;
    SL_ASSIGN_OR_RETURN(
        r.compute,
        backend.ComputeStream(
            i, {.name = absl::StrCat("rank", i, ".compute"), .trace = trace, .track = "compute"}));
    r.counter = std::make_shared<CollectiveCounter>();
    r.activations_held.resize(model.forward.size());
    SchedulerOptions& o = options[i];
    o.name = absl::StrCat("rank", i);
    o.strategy = c.strategy;
    o.shard_size = c.strategy == ShardingStrategy::kHybridShard ? c.shard_size : 0;
    o.forward_prefetch = c.forward_prefetch;
    o.backward_prefetch = c.backward_prefetch;
    o.backward_prefetch_depth = c.backward_prefetch_depth;
    o.budget_bytes = c.budget_bytes;
    o.budget_units = c.budget_units;
    o.root_unit = c.root_unit;
    o.stream_factory = backend.Factory(i);
    o.gather_pool = r.gather_pool.get();
    o.reduce_pool = r.reduce_pool.get();
    o.shard_allocator = r.shards.get();
    o.cpu_offload = c.cpu_offload;
    o.offload_allocator = c.cpu_offload ? r.host_shards.get() : nullptr;
    o.trace = trace;
  }

  // Creating the mesh splits the world: a rendezvous, one thread per rank.
  {
    std::vector<absl::Status> created(simulated);
    std::vector<std::thread> threads;
    threads.reserve(simulated);
    const absl::Time deadline = absl::Now() + kCreateTimeout;
    for (int i = 0; i < simulated; ++i) {
      threads.emplace_back([&, i] {
        absl::StatusOr<std::unique_ptr<Scheduler>> s = Scheduler::Create(
            WrapCounting(world[i], ranks[i].counter), *ranks[i].compute, options[i], deadline);
        if (s.ok()) {
          ranks[i].scheduler = *std::move(s);
        } else {
          created[i] = s.status();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (const absl::Status& s : created) SL_RETURN_IF_ERROR(s);
  }

  for (int i = 0; i < simulated; ++i) {
    Rank& r = ranks[i];
    for (size_t u = 0; u < model.units.size(); ++u) {
      UnitSpec spec{.name = model.units[u].name, .tensors = model.units[u].tensors};
      spec.policy.precision = model.PrecisionOf(static_cast<int>(u));
      if (c.param_dtype.has_value()) spec.policy.precision.param_dtype = *c.param_dtype;
      if (c.reduce_dtype.has_value()) spec.policy.precision.reduce_dtype = *c.reduce_dtype;
      spec.policy.reshard_after_forward = c.reshard_after_forward;
      SL_RETURN_IF_ERROR(r.scheduler->RegisterUnit(std::move(spec)).status());
    }
    uint64_t shard_elements = 0;
    for (int u = 0; u < r.scheduler->num_units(); ++u) {
      shard_elements += r.scheduler->unit(u).layout().shard_elements();
    }
    SubAllocator& optimizer = c.cpu_offload ? *r.host_optimizer : *r.optimizer;
    SL_ASSIGN_OR_RETURN(r.optimizer_state,
                        optimizer.Allocate(shard_elements * model.optimizer_state_bytes_per_param));
    r.master_shard_bytes =
        static_cast<uint64_t>((c.cpu_offload ? *r.host_shards : *r.shards).stats().current_bytes);
  }

  // One optimizer step: c.micro_batches forward and backward passes. With `sums`, per rank the
  // sums over the micro-batches of the scheduler's step, exposed and communication times, and
  // its last metrics.
  struct Sums {
    std::optional<absl::Duration> step, exposed, communication;
    StepMetrics last;
  };
  auto add = [](std::optional<absl::Duration>& sum, const std::optional<absl::Duration>& d) {
    if (d.has_value()) sum = sum.value_or(absl::ZeroDuration()) + *d;
  };
  auto run_step = [&](std::vector<Sums>* sums) -> absl::Status {
    for (int mb = 0; mb < c.micro_batches; ++mb) {
      if (c.micro_batches > 1 && c.accumulation == GradientAccumulation::kNoSync) {
        for (Rank& r : ranks) r.scheduler->SetRequiresGradientSync(mb == c.micro_batches - 1);
      }
      SL_RETURN_IF_ERROR(RunStep(backend, ranks, model, c, plan));
      if (sums == nullptr) continue;
      for (size_t i = 0; i < ranks.size(); ++i) {
        SL_ASSIGN_OR_RETURN(StepMetrics m, ranks[i].scheduler->LastStepMetrics(backend.Deadline()));
        Sums& s = (*sums)[i];
        add(s.step, m.step_time);
        add(s.exposed, m.exposed_communication);
        add(s.communication, m.communication_time);
        s.last = std::move(m);
      }
    }
    return absl::OkStatus();
  };

  // Warm-up: records the forward order.
  SL_RETURN_IF_ERROR(run_step(nullptr));
  for (Rank& r : ranks) {
    SL_RETURN_IF_ERROR(r.scheduler->ZeroGrad());
    r.counter->Reset();
  }
  SL_RETURN_IF_ERROR(backend.Drain(ranks));
  for (Rank& r : ranks) {
    for (Allocator* a : std::initializer_list<Allocator*>{
             r.gather_pool.get(), r.reduce_pool.get(), r.shards.get(), r.gather_blocks.get(),
             r.reduce_blocks.get(), r.optimizer.get(), r.activations.get(), r.device.get(),
             r.host_shards.get(), r.host_optimizer.get(), r.host.get()}) {
      a->Collect();
      a->ResetPeak();
    }
  }

  // The measured step.
  const std::vector<SimLinkTraffic> traffic_before = Traffic(world);
  std::vector<Sums> sums(ranks.size());
  SL_RETURN_IF_ERROR(run_step(&sums));
  const std::vector<SimLinkTraffic> traffic_after = Traffic(world);

  SimulationReport report;
  report.world_size = c.world_size;
  report.ranks_simulated = simulated;
  report.representative = representative;
  for (size_t d = 0; d < traffic_after.size(); ++d) {
    const SimLinkTraffic before = d < traffic_before.size() ? traffic_before[d] : SimLinkTraffic{};
    report.intra_node_bytes_per_device =
        std::max(report.intra_node_bytes_per_device,
                 traffic_after[d].intra_node_bytes - before.intra_node_bytes);
    report.inter_node_bytes_per_device =
        std::max(report.inter_node_bytes_per_device,
                 traffic_after[d].inter_node_bytes - before.inter_node_bytes);
  }
  report.cluster = cluster != nullptr ? cluster->Describe() : "local backend (host memory)";
  for (size_t k = 0; k < model.forward.size(); ++k) {
    report.model_flops += model.forward[k].forward_flops + model.forward[k].backward_flops;
    report.step_flops += plan[k].recompute_flops;
    report.compute_time += (plan[k].forward + plan[k].backward) * c.micro_batches;
  }
  report.model_flops *= static_cast<uint64_t>(c.micro_batches);
  report.step_flops =
      report.step_flops * static_cast<uint64_t>(c.micro_batches) + report.model_flops;
  for (int i = 0; i < simulated; ++i) {
    Rank& r = ranks[i];
    const StepMetrics& m = sums[i].last;
    if (sums[i].step.has_value() && cluster != nullptr) {
      report.step_time = std::max(report.step_time.value_or(absl::ZeroDuration()), *sums[i].step);
    }
    MemoryReport& mem = report.memory;
    auto peak = [](const Allocator& a) { return static_cast<uint64_t>(a.stats().peak_bytes); };
    SubAllocator& shards = c.cpu_offload ? *r.host_shards : *r.shards;
    shards.Collect();  // buffers released after events that have completed (CPU offload's copies)
    mem.master_shards = std::max(mem.master_shards, r.master_shard_bytes);
    mem.sharded_grads =
        std::max(mem.sharded_grads,
                 static_cast<uint64_t>(shards.stats().current_bytes) - r.master_shard_bytes);
    mem.optimizer_state =
        std::max(mem.optimizer_state, peak(c.cpu_offload ? *r.host_optimizer : *r.optimizer));
    mem.host_peak = std::max(mem.host_peak, peak(*r.host));
    mem.unsharded_params_peak = std::max(mem.unsharded_params_peak, peak(*r.gather_blocks));
    mem.grad_buffers_peak = std::max(mem.grad_buffers_peak, peak(*r.reduce_blocks));
    mem.activations_peak = std::max(mem.activations_peak, peak(*r.activations));
    mem.total_peak = std::max(mem.total_peak, peak(*r.device));
    mem.unsharded_params_requested_peak =
        std::max(mem.unsharded_params_requested_peak, peak(*r.gather_pool));
    if (i == 0) {
      report.metrics = m;
      if (cluster != nullptr) {
        report.exposed_communication = sums[i].exposed;
        report.communication_time = sums[i].communication;
      }
      report.collectives = r.counter->Totals();
      report.ring_sent_bytes_per_rank = r.counter->RingSentBytes();
    }
    report.event_logs.push_back(std::move(r.logs));
  }
  if (report.step_time.has_value() && model.tokens_per_micro_batch > 0) {
    report.tokens_per_s_per_device = static_cast<double>(model.tokens_per_micro_batch) *
                                     c.micro_batches / absl::ToDoubleSeconds(*report.step_time);
  }
  if (cluster != nullptr && cluster->device_memory_bytes() > 0) {
    report.fits = report.memory.total_peak <= cluster->device_memory_bytes();
  }
  return report;
}

}  // namespace

absl::string_view HostLeadName(HostLead lead) {
  switch (lead) {
    case HostLead::kOneUse:
      return "one_use";
    case HostLead::kWholeStep:
      return "whole_step";
  }
  return "?";
}

std::string ActivationCheckpointingName(ActivationCheckpointing checkpointing) {
  switch (checkpointing.mode) {
    case CheckpointMode::kOff:
      return "off";
    case CheckpointMode::kFull:
      return "full";
    case CheckpointMode::kOp:
      return "op";
    case CheckpointMode::kLayer:
      return absl::StrCat("layer:", checkpointing.every);
  }
  return "?";
}

absl::StatusOr<ActivationCheckpointing> ParseActivationCheckpointing(absl::string_view text) {
  const absl::string_view original = text;
  if (text == "off") return ActivationCheckpointing{};
  if (text == "full" || text == "on") return ActivationCheckpointing{.mode = CheckpointMode::kFull};
  if (text == "op") return ActivationCheckpointing{.mode = CheckpointMode::kOp};
  int every = 0;
  if (absl::ConsumePrefix(&text, "layer:") && absl::SimpleAtoi(text, &every) && every >= 1) {
    return ActivationCheckpointing{.mode = CheckpointMode::kLayer, .every = every};
  }
  return absl::InvalidArgumentError(
      absl::StrCat("'", original, "' is not off, full (or on), op or layer:K with K >= 1"));
}

absl::string_view GradientAccumulationName(GradientAccumulation accumulation) {
  switch (accumulation) {
    case GradientAccumulation::kNoSync:
      return "no_sync";
    case GradientAccumulation::kSync:
      return "sync";
  }
  return "?";
}

absl::string_view RankModeName(RankMode mode) {
  switch (mode) {
    case RankMode::kAll:
      return "all";
    case RankMode::kRepresentative:
      return "representative";
    case RankMode::kAuto:
      return "auto";
  }
  return "?";
}

absl::StatusOr<SimulationReport> Simulate(const ModelDescription& model,
                                          const SimulationConfig& config,
                                          const SimCluster& cluster) {
  // The matrix products run in the param dtype (the model's, or the config's override).
  const DType compute_dtype = config.param_dtype.value_or(model.precision.param_dtype);
  if (!(cluster.compute_flops_per_s(compute_dtype) > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "simulation config: ", cluster.Describe(), " states no compute throughput for ",
        DTypeName(compute_dtype), " (the topology's compute_TFLOPs)"));
  }
  VirtualTimelineOptions options = cluster.TimelineOptions();
  options.run_ops = false;
  if (config.cpu_offload) {
    // The scheduler's only copy ops are CPU offload's host transfers (flat_parameter.cc).
    if (!(cluster.host_link_bytes_per_s() > 0)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "simulation config: cpu_offload needs the bandwidth of the devices' host link "
          "(a topology's host_link_GBps), and ",
          cluster.Describe(), " has none"));
    }
    options.copy_bytes_per_s = cluster.host_link_bytes_per_s();
  }
  SL_ASSIGN_OR_RETURN(std::unique_ptr<VirtualTimeline> timeline, VirtualTimeline::Create(options));
  std::unique_ptr<Backend> backend =
      tune_internal::CreateVirtualBackend(cluster, std::move(timeline));
  return Run(*backend, model, config, &cluster);
}

absl::StatusOr<SimulationReport> RunOnHostBackend(const ModelDescription& model,
                                                  const SimulationConfig& config) {
  std::unique_ptr<Backend> backend = tune_internal::CreateHostBackend();
  return Run(*backend, model, config, nullptr);
}

}  // namespace shardline
