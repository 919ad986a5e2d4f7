// File: scheduler/scheduler_setup.cc
// -----------------------------------------------------------------------------
// Setting a scheduler up: the mesh, communicators, streams and pools of Create; the units
// (RegisterUnit); the minimum budget they need, which RegisterUnit, SetBudget and
// SetReshardAfterBackward enforce; and the staging memory that device worlds need for the order
// check and ClipGradNorm. The hooks are in scheduler.cc.

#include "scheduler/scheduler.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/caching_pool.h"
#include "runtime/config.h"
#include "runtime/status.h"
#include "scheduler/internal/scheduler_internal.h"

namespace shardline {

using scheduler_internal::FormatBytes;
using scheduler_internal::UnitKey;

absl::string_view ShardingStrategyName(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard:
      return "full_shard";
    case ShardingStrategy::kShardGradOp:
      return "shard_grad_op";
    case ShardingStrategy::kNoShard:
      return "no_shard";
    case ShardingStrategy::kHybridShard:
      return "hybrid_shard";
  }
  return "?";
}

absl::string_view BackwardPrefetchName(BackwardPrefetch prefetch) {
  switch (prefetch) {
    case BackwardPrefetch::kOff:
      return "off";
    case BackwardPrefetch::kBeforeGrad:
      return "before_grad";
    case BackwardPrefetch::kAfterGrad:
      return "after_grad";
  }
  return "?";
}

// --- Creation -------------------------------------------------------------------------------

Scheduler::Scheduler(ProcessMesh mesh, Stream& compute, SchedulerOptions options)
    : mesh_(std::move(mesh)),
      compute_(compute),
      options_(std::move(options)),
      budget_({.bytes = options_.budget_bytes,
               .units = options_.budget_units,
               .trace = options_.trace,
               .counter = absl::StrCat(options_.name, " in flight"),
               .clock = &compute_.clock()}) {}

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(std::shared_ptr<Communicator> world,
                                                             Stream& compute,
                                                             SchedulerOptions options,
                                                             absl::Time deadline) {
  const std::string what = absl::StrCat("scheduler '", options.name, "'");
  if (world == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, ": world is null"));
  if (options.forward_prefetch < 0 || options.backward_prefetch_depth < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": prefetch depths must be >= 0 (forward_prefetch ", options.forward_prefetch,
        ", backward_prefetch_depth ", options.backward_prefetch_depth, ")"));
  }
  if (options.budget_units < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": budget_units ", options.budget_units, " is negative"));
  }
  int shard_size = world->size();
  switch (options.strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      break;
    case ShardingStrategy::kNoShard:
      shard_size = 1;
      break;
    case ShardingStrategy::kHybridShard:
      if (options.shard_size > 0) {
        shard_size = options.shard_size;
      } else {
        SL_ASSIGN_OR_RETURN(shard_size, RanksPerHost(*world, deadline));
      }
      if (world->size() % shard_size != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": shard_size ", shard_size, " does not divide the world size ", world->size()));
      }
      break;
  }
  absl::StatusOr<ProcessMesh> mesh = ProcessMesh::Create(world, shard_size, deadline);
  if (!mesh.ok()) return Annotate(mesh.status(), what);
  return Create(*std::move(mesh), compute, std::move(options), deadline);
}

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(ProcessMesh mesh, Stream& compute,
                                                             SchedulerOptions options,
                                                             absl::Time deadline) {
  const std::string what = absl::StrCat("scheduler '", options.name, "'");
  if (mesh.shard() == nullptr || mesh.world() == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the mesh has no shard group"));
  }
  if (options.forward_prefetch < 0 || options.backward_prefetch_depth < 0 ||
      options.budget_units < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": prefetch depths and budget_units must be >= 0"));
  }
  const bool one_replica = mesh.replicate_size() == 1;
  const bool fits = options.strategy == ShardingStrategy::kHybridShard ||
                    (one_replica && options.strategy != ShardingStrategy::kNoShard) ||
                    (options.strategy == ShardingStrategy::kNoShard && mesh.shard_size() == 1);
  if (!fits) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the mesh ", mesh.ToString(), " does not fit the sharding strategy"));
  }
  const std::shared_ptr<Communicator> world = mesh.world();
  std::unique_ptr<Scheduler> s(new Scheduler(std::move(mesh), compute, std::move(options)));
  const SchedulerOptions& o = s->options_;

  s->gather_comm_ = s->mesh_.shard();
  absl::StatusOr<std::shared_ptr<Communicator>> reduce = s->mesh_.shard()->Dup(deadline);
  if (!reduce.ok()) return Annotate(reduce.status(), absl::StrCat(what, ": reduce communicator"));
  s->reduce_comm_ = *std::move(reduce);
  if (s->mesh_.replicate_size() > 1) s->replicate_comm_ = s->mesh_.replicate();

  // The communication streams are more urgent than the rest (on CUDA: a higher stream
  // priority, as FSDP2's all-gather and reduce-scatter streams), so that a gather's or a
  // reduction's copies and kernels are not queued behind the compute's.
  auto make_stream = [&](absl::string_view role,
                         int priority = 0) -> absl::StatusOr<std::unique_ptr<Stream>> {
    StreamOptions so{
        .name = absl::StrCat(o.name, ".", role), .trace = o.trace, .track = std::string(role)};
    so.priority = priority;
    absl::StatusOr<std::unique_ptr<Stream>> stream =
        o.stream_factory ? o.stream_factory(std::move(so)) : CreateStream(compute.device(), so);
    if (!stream.ok()) return Annotate(stream.status(), absl::StrCat(what, ": ", role, " stream"));
    if ((*stream)->device() != compute.device()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the ", role, " stream is on ", (*stream)->device().ToString(),
          " but the compute stream '", compute.name(), "' is on ", compute.device().ToString()));
    }
    return stream;
  };
  SL_ASSIGN_OR_RETURN(s->gather_stream_, make_stream("gather", /*priority=*/1));
  SL_ASSIGN_OR_RETURN(s->reduce_stream_, make_stream("reduce", /*priority=*/1));
  SL_ASSIGN_OR_RETURN(s->all_reduce_stream_, make_stream("all_reduce", /*priority=*/1));
  SL_ASSIGN_OR_RETURN(s->control_stream_, make_stream("control"));
  SL_ASSIGN_OR_RETURN(s->grad_stream_, make_stream("grad"));

  if (o.gather_pool == nullptr || o.reduce_pool == nullptr || o.shard_allocator == nullptr) {
    if (compute.device().is_host()) {
      // Shareable where the world's backend maps it (ucx): the single-copy mapped path.
      s->backing_ = world->CreateHostAllocatorForTransfers(64, absl::StrCat(o.name, ".host"));
    } else {
      absl::StatusOr<std::unique_ptr<Allocator>> device =
          CreateCudaAllocator(compute.device().index(), absl::StrCat(o.name, ".device"));
      if (!device.ok()) return Annotate(device.status(), what);
      s->backing_ = *std::move(device);
    }
  }
  s->gather_pool_ = o.gather_pool;
  if (s->gather_pool_ == nullptr) {
    s->own_gather_pool_ = std::make_unique<CachingPool>(
        *s->backing_, CachingPoolOptions{.name = absl::StrCat(o.name, ".gather pool")});
    s->gather_pool_ = s->own_gather_pool_.get();
  }
  s->reduce_pool_ = o.reduce_pool;
  if (s->reduce_pool_ == nullptr) {
    s->own_reduce_pool_ = std::make_unique<CachingPool>(
        *s->backing_, CachingPoolOptions{.name = absl::StrCat(o.name, ".reduce pool")});
    s->reduce_pool_ = s->own_reduce_pool_.get();
  }
  s->shard_allocator_ = o.shard_allocator != nullptr ? o.shard_allocator : s->backing_.get();
  if (o.cpu_offload) {
    s->offload_allocator_ = o.offload_allocator;
    if (s->offload_allocator_ == nullptr) {
      if (compute.device().is_host()) {
        // No device here: a host allocator of its own, apart from the pools (the "device").
        s->own_offload_ = CreateHostAllocator(64, absl::StrCat(o.name, ".offload"));
      } else {
        absl::StatusOr<std::unique_ptr<Allocator>> pinned =
            CreatePinnedAllocator(absl::StrCat(o.name, ".offload"));
        if (!pinned.ok()) return Annotate(pinned.status(), absl::StrCat(what, ": cpu_offload"));
        s->own_offload_ = *std::move(pinned);
      }
      s->offload_allocator_ = s->own_offload_.get();
    }
  } else if (o.offload_allocator != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": offload_allocator is set but cpu_offload is false"));
  }
  s->order_ = o.forward_order;
  s->order_known_ = !s->order_.empty();
  return s;
}

Scheduler::~Scheduler() {
  // Destroyed mid-step (the framework gave up on an error that no hook saw, say): the peers are
  // owed the rest of this step's collectives, and the order check's all-gather if this is the
  // step that records the order. Once this rank's own collectives are done (bounded by the
  // world's timeout; a failed one returns at once), abort the communicators the peers would wait
  // on, so that they fail now instead of at their deadline (as Fail() does when a hook sees an
  // error). Communicators of one rank owe nobody anything.
  std::vector<Communicator*> owed;
  if (failed_.ok() && (phase_ != Phase::kIdle || record_pending_check_)) {
    for (Communicator* comm : {gather_comm_.get(), reduce_comm_.get(), replicate_comm_.get()}) {
      if (comm != nullptr && comm->size() > 1) owed.push_back(comm);
    }
    if (OrderCheckUnread() && mesh_.world()->size() > 1) {
      owed.push_back(mesh_.world().get());
    }
  }
  if (!owed.empty()) {
    const absl::Time deadline = control_stream_->clock().Now() + mesh_.world()->timeout();
    for (Stream* stream : {gather_stream_.get(), reduce_stream_.get(), all_reduce_stream_.get()}) {
      if (stream != nullptr) stream->Synchronize(deadline).IgnoreError();
    }
    const absl::Status gone = absl::AbortedError(absl::StrCat(
        "scheduler '", options_.name, "' was destroyed in the middle of step ", step_));
    for (Communicator* comm : owed) comm->Abort(gone);
  }
  // The order check's all-gather writes order_check_: let it finish (bounded by the world's
  // timeout; a failure was or will never be reported, the scheduler is going away).
  if (order_check_pending_) {
    const absl::Time deadline = control_stream_->clock().Now() + mesh_.world()->timeout();
    order_check_work_.Wait(deadline).IgnoreError();
    if (order_check_copied_ != nullptr) order_check_copied_->Synchronize(deadline).IgnoreError();
  }
  // Buffers go back to the pools guarded by their events (FlatParameter's destructor); the
  // streams then drain; the pools wait for the guards.
  units_.clear();
}

absl::StatusOr<int> Scheduler::RegisterUnit(UnitSpec spec) {
  const std::string what =
      absl::StrCat("scheduler '", options_.name, "': RegisterUnit('", spec.name, "')");
  if (step_ > 0 || phase_ != Phase::kIdle) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": units can only be registered before the first step"));
  }
  if (spec.name.empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": empty name"));
  if (FindUnit(spec.name).has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": a unit of that name exists"));
  }
  const MixedPrecisionPolicy& mp = spec.policy.precision;
  SL_RETURN_IF_ERROR(Annotate(mp.Validate(), what));
  if (spec.policy.reduce_op != ReduceOp::kAvg && spec.policy.reduce_op != ReduceOp::kSum) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": reduce_op must be avg or sum, not ",
                                                   ReduceOpName(spec.policy.reduce_op)));
  }
  absl::StatusOr<FlatLayout> layout = FlatLayout::Create(
      spec.tensors, {.num_shards = mesh_.shard_size(), .element_dtype = mp.master_dtype});
  if (!layout.ok()) return Annotate(layout.status(), what);
  const int id = num_units();
  Unit unit;
  unit.name = spec.name;
  unit.reduce_op = spec.policy.reduce_op;
  const bool strategy_reshards = options_.strategy == ShardingStrategy::kFullShard ||
                                 options_.strategy == ShardingStrategy::kHybridShard;
  unit.reshard_after_forward =
      spec.policy.reshard_after_forward.value_or(strategy_reshards && id != options_.root_unit);
  const uint64_t total = layout->total_elements();
  unit.param_bytes = total * DTypeSize(mp.param_dtype);
  if (offload_allocator_ != nullptr) {
    unit.param_bytes += layout->shard_elements() * DTypeSize(mp.master_dtype);  // the staging
  }
  uint64_t grad = total * DTypeSize(mp.param_dtype);
  if (mp.reduce_dtype != mp.param_dtype) grad += total * DTypeSize(mp.reduce_dtype);
  if (mp.reduce_dtype != mp.sharded_grad_dtype()) {
    grad += layout->shard_elements() * DTypeSize(mp.sharded_grad_dtype());
  }
  unit.backward_bytes = unit.param_bytes + grad;
  absl::StatusOr<std::unique_ptr<FlatParameter>> param =
      FlatParameter::Create(*std::move(layout), mesh_.shard_rank(), mp,
                            {.unsharded_pool = gather_pool_,
                             .grad_pool = reduce_pool_,
                             .stream_ordered_grad = false,
                             .shard_allocator = shard_allocator_,
                             .offload_allocator = offload_allocator_,
                             .name = spec.name,
                             .master_shard = std::move(spec.master_shard),
                             .init_stream = gather_stream_.get()});
  if (!param.ok()) return Annotate(param.status(), what);
  // The master shard's zero-fill runs on the gather stream: wait for it, so that the framework
  // may write the shard (SetShardFromTensors, or its own optimizer state copy) at once.
  if (absl::Status filled = gather_stream_->Synchronize(DefaultDeadline()); !filled.ok()) {
    return Annotate(filled, absl::StrCat(what, ": initialising the master shard"));
  }
  unit.param = *std::move(param);
  units_.push_back(std::move(unit));

  if (options_.budget_bytes > 0 && MinimumBudgetBytes() > options_.budget_bytes) {
    const uint64_t minimum = MinimumBudgetBytes();
    units_.pop_back();
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": budget_bytes ", options_.budget_bytes, " (", FormatBytes(options_.budget_bytes),
        ") is below the ", minimum, " bytes (", FormatBytes(minimum),
        ") the units need: those kept unsharded after forward plus the largest backward "
        "footprint (parameters + gradient)"));
  }
  if (options_.budget_units > 0 && MinimumBudgetUnits() > options_.budget_units) {
    const int minimum = MinimumBudgetUnits();
    units_.pop_back();
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": budget_units ", options_.budget_units, " is below ", minimum,
        " (the units kept unsharded after forward, those used more than once, plus one)"));
  }
  // The unit's name for its key, before any of its collectives is issued here: a peer whose
  // collective for this unit disagrees with one of this rank's is then named by unit, whichever
  // rank sees the disagreement first.
  for (Communicator* comm : {gather_comm_.get(), reduce_comm_.get(), replicate_comm_.get()}) {
    if (comm != nullptr) comm->NameKey(UnitKey(id), units_.back().name);
  }
  return id;
}

bool Scheduler::Kept(const Unit& unit) {
  return !unit.reshard_after_forward || !unit.reshard_after_backward;
}

uint64_t Scheduler::MinimumBudgetBytes() const {
  uint64_t kept = 0;
  uint64_t largest = 0;
  for (const Unit& u : units_) {
    const uint64_t extra = Kept(u) ? u.backward_bytes - u.param_bytes : u.backward_bytes;
    if (Kept(u)) kept += u.param_bytes;
    largest = std::max(largest, extra);
  }
  // A unit used more than once keeps its gradient from its first backward use to its last.
  uint64_t reused = 0;
  std::vector<int> uses(units_.size(), 0);
  for (int u : order_) {
    if (u >= 0 && u < num_units() && ++uses[u] == 2) {
      reused += units_[u].backward_bytes - units_[u].param_bytes;
    }
  }
  return kept + largest + reused;
}

int Scheduler::MinimumBudgetUnits() const {
  int kept = 0;
  for (const Unit& u : units_) kept += Kept(u) ? 1 : 0;
  std::vector<int> uses(units_.size(), 0);
  for (int u : order_) {
    if (u >= 0 && u < num_units() && ++uses[u] == 2 && !Kept(units_[u])) ++kept;
  }
  return kept + 1;
}

std::optional<int> Scheduler::FindUnit(absl::string_view name) const {
  for (int i = 0; i < num_units(); ++i) {
    if (units_[i].name == name) return i;
  }
  return std::nullopt;
}

// --- The budget between steps ---------------------------------------------------------------

absl::Status Scheduler::SetBudget(size_t bytes, int units) {
  const std::string what =
      absl::StrCat("scheduler '", options_.name, "': SetBudget(", bytes, ", ", units, ")");
  if (phase_ != Phase::kIdle)
    return absl::FailedPreconditionError(absl::StrCat(what, ": during a step"));
  if (units < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": negative units"));
  if (bytes > 0 && bytes < MinimumBudgetBytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": below the minimum of ", MinimumBudgetBytes(), " bytes"));
  }
  if (units > 0 && units < MinimumBudgetUnits()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": below the minimum of ", MinimumBudgetUnits(), " units"));
  }
  options_.budget_bytes = bytes;
  options_.budget_units = units;
  budget_.SetLimits(bytes, units);
  return absl::OkStatus();
}

absl::Status Scheduler::SetReshardAfterBackward(int unit, bool reshard) {
  SL_ASSIGN_OR_RETURN(Unit * u, Lookup(unit, "SetReshardAfterBackward"));
  if (phase_ != Phase::kIdle) {
    return absl::FailedPreconditionError(absl::StrCat(
        "scheduler '", options_.name, "': SetReshardAfterBackward('", u->name, "') during a step"));
  }
  const bool before = u->reshard_after_backward;
  u->reshard_after_backward = reshard;
  // Parameters kept after a backward stay charged into the next step: the minimum counts them.
  const uint64_t minimum = MinimumBudgetBytes();
  const int minimum_units = MinimumBudgetUnits();
  if ((options_.budget_bytes > 0 && minimum > options_.budget_bytes) ||
      (options_.budget_units > 0 && minimum_units > options_.budget_units)) {
    u->reshard_after_backward = before;
    return absl::InvalidArgumentError(absl::StrCat(
        "scheduler '", options_.name, "': SetReshardAfterBackward('", u->name,
        "', false): ", "the budget (", options_.budget_bytes, " bytes, ", options_.budget_units,
        " units) is below the ", minimum, " bytes and ", minimum_units,
        " units the units need with its parameters kept between micro-batches (SetBudget "
        "first)"));
  }
  return absl::OkStatus();
}

// --- Staging memory of device worlds --------------------------------------------------------

absl::Status Scheduler::EnsureStaging(const std::string& what) {
  if (staging_device_ != nullptr) return absl::OkStatus();
  const Device device = mesh_.world()->device();
  absl::StatusOr<std::unique_ptr<Allocator>> on_device =
      CreateCudaAllocator(device.index(), absl::StrCat(options_.name, ".staging"));
  if (!on_device.ok()) return Annotate(on_device.status(), what);
  absl::StatusOr<std::unique_ptr<Allocator>> pinned =
      CreatePinnedAllocator(absl::StrCat(options_.name, ".staging pinned"));
  if (!pinned.ok()) return Annotate(pinned.status(), what);
  staging_device_ = *std::move(on_device);
  staging_pinned_ = *std::move(pinned);
  return absl::OkStatus();
}

}  // namespace shardline
