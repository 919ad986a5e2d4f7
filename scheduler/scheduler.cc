// File: scheduler/scheduler.cc
// -----------------------------------------------------------------------------
// The hooks drive three cursors: the forward cursor (prefetch along the recorded order), the
// backward gather cursor (over the reverse of this step's forward sequence) and the reduction
// cursor (over the order of each unit's last backward use). Every decision reads only the hook
// sequence and the host-side budget accounting, so ranks that see the same hooks issue the same
// collectives at the same points.

#include "scheduler/scheduler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "runtime/caching_pool.h"
#include "runtime/config.h"
#include "runtime/host_kernels.h"
#include "runtime/logging.h"
#include "runtime/shard_norms.h"
#include "runtime/status.h"
#include "runtime/stream_ops.h"

namespace shardline {
namespace {

constexpr int kOrderHeader = 3;  // length, hash of the order, hash of the units' layouts

// The unit as every collective the scheduler issues for it names it (CollectiveOptions::key):
// ranks that issue the same collective for different units fail it before any data moves.
uint64_t UnitKey(int unit) { return static_cast<uint64_t>(unit) + 1; }

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h;
}

std::string Bytes(uint64_t bytes) {
  if (bytes >= (1ULL << 20)) return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
  if (bytes >= (1ULL << 10)) return absl::StrFormat("%.1f KiB", bytes / 1024.0);
  return absl::StrCat(bytes, " B");
}

std::string Millis(const std::optional<absl::Duration>& d) {
  if (!d.has_value()) return "n/a";
  return absl::StrFormat("%.2f ms", absl::ToDoubleMilliseconds(*d));
}

std::optional<absl::Duration> Between(const std::shared_ptr<Event>& a,
                                      const std::shared_ptr<Event>& b) {
  if (a == nullptr || b == nullptr) return std::nullopt;
  absl::StatusOr<absl::Duration> d = ElapsedBetween(*a, *b);
  if (!d.ok()) return std::nullopt;
  return std::max(*d, absl::ZeroDuration());
}

}  // namespace

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

std::string StepMetrics::ToString() const {
  std::string budget = budget_bytes == 0 ? "unlimited" : Bytes(budget_bytes);
  std::string out =
      absl::StrCat("step ", step, ": gathered ", Bytes(bytes_gathered), ", reduced ",
                   Bytes(bytes_reduced), ", peak in flight ", Bytes(peak_inflight_bytes), " / ",
                   budget, " (", peak_inflight_units, " units)");
  if (budget_overshoots > 0) absl::StrAppend(&out, ", ", budget_overshoots, " overshoots");
  absl::StrAppend(&out, ", exposed ", Millis(exposed_communication), " of step ",
                  Millis(step_time));
  if (overlap_fraction.has_value()) {
    absl::StrAppend(&out, absl::StrFormat(", overlap %.0f%%", *overlap_fraction * 100));
  }
  return out;
}

// --- Creation -------------------------------------------------------------------------------

Scheduler::Scheduler(ProcessMesh mesh, Stream& compute, SchedulerOptions options)
    : mesh_(std::move(mesh)), compute_(compute), options_(std::move(options)) {}

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
  std::unique_ptr<Scheduler> s(new Scheduler(*std::move(mesh), compute, std::move(options)));
  const SchedulerOptions& o = s->options_;

  s->gather_comm_ = s->mesh_.shard();
  absl::StatusOr<std::shared_ptr<Communicator>> reduce = s->mesh_.shard()->Dup(deadline);
  if (!reduce.ok()) return Annotate(reduce.status(), absl::StrCat(what, ": reduce communicator"));
  s->reduce_comm_ = *std::move(reduce);
  if (s->mesh_.replicate_size() > 1) s->replicate_comm_ = s->mesh_.replicate();

  auto make_stream = [&](absl::string_view role) -> absl::StatusOr<std::unique_ptr<Stream>> {
    StreamOptions so{
        .name = absl::StrCat(o.name, ".", role), .trace = o.trace, .track = std::string(role)};
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
  SL_ASSIGN_OR_RETURN(s->gather_stream_, make_stream("gather"));
  SL_ASSIGN_OR_RETURN(s->reduce_stream_, make_stream("reduce"));
  SL_ASSIGN_OR_RETURN(s->all_reduce_stream_, make_stream("all_reduce"));
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
        what, ": budget_bytes ", options_.budget_bytes, " (", Bytes(options_.budget_bytes),
        ") is below the ", minimum, " bytes (", Bytes(minimum),
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

absl::StatusOr<Scheduler::Unit*> Scheduler::Lookup(int unit, absl::string_view hook) {
  if (unit < 0 || unit >= num_units()) {
    return absl::InvalidArgumentError(absl::StrCat("scheduler '", options_.name, "': ", hook, "(",
                                                   unit, "): no such unit (", num_units(),
                                                   " registered)"));
  }
  if (!failed_.ok()) return failed_;
  return &units_[unit];
}

absl::Status Scheduler::HookError(absl::string_view hook, int unit, absl::Status status) {
  if (status.ok()) return status;
  status = Annotate(status, absl::StrCat("scheduler '", options_.name, "': ", hook, "('",
                                         units_[unit].name, "') in step ", step_));
  // A failed stream or collective leaves the step inconsistent across ranks: stop here. A peer's
  // disagreement is InvalidArgument too, but with the peer payload; a misuse of the hooks on
  // this rank (an unknown unit, a call out of order) issued nothing and poisons nothing.
  if (IsPeerError(status)) return Fail(WithOrderNote(std::move(status)));
  if (!absl::IsInvalidArgument(status) && !absl::IsFailedPrecondition(status)) {
    return Fail(std::move(status));
  }
  return status;
}

absl::Status Scheduler::Fail(absl::Status status) {
  failed_ = std::move(status);
  // The ranks' collectives no longer match: abort the scheduler's communicators, so that a peer
  // blocked in one (a reduction this rank will never issue) fails now, not at its deadline.
  for (Communicator* comm : {gather_comm_.get(), reduce_comm_.get(), replicate_comm_.get()}) {
    if (comm != nullptr) comm->Abort(failed_);
  }
  return failed_;
}

absl::Status Scheduler::WithOrderNote(absl::Status status) const {
  // Ranks that issue the same collective for different units (the unit is in every collective's
  // fingerprint) ran different forwards: say whether this rank kept to the known order.
  // On an asynchronous compute stream the error may surface only in the next step's hooks.
  if (!order_known_ || !IsPeerError(status)) return status;
  if (deviation_step_ >= 0 && deviation_step_ + 1 >= step_) {
    return Annotate(status, absl::StrCat("this rank deviated from the known forward order in step ",
                                         deviation_step_, ": ", deviation_));
  }
  return Annotate(status, step_ == 0 ? std::string("this rank's forward follows the known order")
                                     : absl::StrCat("this rank's forward followed the known "
                                                    "order in steps ",
                                                    step_ - 1, " and ", step_));
}

absl::Status Scheduler::StreamError(absl::string_view hook, int unit, absl::Status status) {
  if (status.ok()) return status;
  return Fail(WithOrderNote(Annotate(
      status, absl::StrCat("scheduler '", options_.name, "': ", hook, "('", units_[unit].name,
                           "') in step ", step_, ": stream '", compute_.name(), "' failed"))));
}

// --- Budget ---------------------------------------------------------------------------------

bool Scheduler::Fits(uint64_t bytes, bool new_unit) const {
  if (options_.budget_bytes > 0 && inflight_bytes_ + bytes > options_.budget_bytes) return false;
  if (options_.budget_units > 0 && new_unit && inflight_units_ + 1 > options_.budget_units) {
    return false;
  }
  return true;
}

void Scheduler::Charge(Unit& unit, uint64_t params, uint64_t grad) {
  const uint64_t bytes = params + grad;
  if (bytes == 0) return;
  if (unit.charged() == 0) ++inflight_units_;
  unit.charged_params += params;
  unit.charged_grad += grad;
  inflight_bytes_ += bytes;
  current_.peak_inflight_bytes = std::max(current_.peak_inflight_bytes, inflight_bytes_);
  current_.peak_inflight_units = std::max(current_.peak_inflight_units, inflight_units_);
  TraceCounters();
}

void Scheduler::Discharge(Unit& unit, bool params, bool grad) {
  const uint64_t bytes = (params ? unit.charged_params : 0) + (grad ? unit.charged_grad : 0);
  if (bytes == 0) return;
  if (params) unit.charged_params = 0;
  if (grad) unit.charged_grad = 0;
  inflight_bytes_ -= bytes;
  if (unit.charged() == 0) --inflight_units_;
  TraceCounters();
}

void Scheduler::TraceCounters() {
  if (options_.trace == nullptr) return;
  options_.trace->AddCounter(absl::StrCat(options_.name, " in flight"), compute_.clock().Now(),
                             {{"bytes", static_cast<double>(inflight_bytes_)},
                              {"budget", static_cast<double>(options_.budget_bytes)}});
}

// --- Gathers --------------------------------------------------------------------------------

absl::Status Scheduler::IssueGather(int u, bool backward, bool demanded) {
  Unit& unit = units_[u];
  // A backward gather also brings the unsharded gradient, unless one is kept from earlier
  // micro-batches (outside the budget) or from an earlier backward use (charged already).
  const uint64_t grad =
      backward && !unit.param->has_unsharded_grad() ? unit.backward_bytes - unit.param_bytes : 0;
  if (!Fits(unit.param_bytes + grad, unit.charged() == 0)) {
    if (!demanded) return absl::OkStatus();
    ++current_.budget_overshoots;
  }
  const bool timed = options_.time_communication;
  std::shared_ptr<Event> start;
  SL_ASSIGN_OR_RETURN(Work work,
                      unit.param->Gather(*gather_comm_, *gather_stream_,
                                         {.collective = {.tag = unit.name, .key = UnitKey(u)},
                                          .collective_start = timed ? &start : nullptr}));
  if (timed) unit.comm.emplace_back(std::move(start), work.event());
  unit.gathered = true;
  unit.backward_gather = backward;
  Charge(unit, unit.param_bytes, grad);
  ++unit.metrics.gathers;
  if (!demanded) ++unit.metrics.prefetched;
  unit.metrics.bytes_gathered += unit.param_bytes;
  current_.bytes_gathered += unit.param_bytes;
  issue_log_.push_back({Issued::kGather, u});
  return absl::OkStatus();
}

absl::Status Scheduler::PrefetchForward() {
  if (!order_known_ || deviated_ || options_.forward_prefetch == 0) return absl::OkStatus();
  const size_t limit = step_sequence_.size() + options_.forward_prefetch;  // positions < limit
  while (forward_cursor_ < order_.size() && forward_cursor_ < limit) {
    Unit& unit = units_[order_[forward_cursor_]];
    if (!unit.gathered) {
      if (!Fits(unit.param_bytes, unit.charged() == 0)) {
        if (deferred_forward_ != forward_cursor_) ++current_.deferred_prefetches;
        deferred_forward_ = forward_cursor_;
        return absl::OkStatus();  // retried at the next hook, in order
      }
      SL_RETURN_IF_ERROR(IssueGather(order_[forward_cursor_], /*backward=*/false,
                                     /*demanded=*/false));
    }
    ++forward_cursor_;
  }
  return absl::OkStatus();
}

absl::Status Scheduler::HandleBackwardPosition(size_t pos, bool demanded, bool* issued) {
  *issued = true;
  const int u = backward_sequence_[pos];
  Unit& unit = units_[u];
  if (!unit.gathered) {
    const uint64_t bytes =
        unit.param->has_unsharded_grad() ? unit.param_bytes : unit.backward_bytes;
    if (!demanded && !Fits(bytes, unit.charged() == 0)) {
      *issued = false;
      return absl::OkStatus();
    }
    SL_RETURN_IF_ERROR(IssueGather(u, /*backward=*/true, demanded));
    return PrepareGradAhead(unit);
  }
  if (!unit.backward_gather) {
    // Kept unsharded since forward: room for its gradient now.
    const uint64_t extra =
        unit.param->has_unsharded_grad() ? 0 : unit.backward_bytes - unit.param_bytes;
    if (!Fits(extra, false)) {
      if (!demanded) {
        *issued = false;
        return absl::OkStatus();
      }
      ++current_.budget_overshoots;
    }
    Charge(unit, 0, extra);
    unit.backward_gather = true;
    return PrepareGradAhead(unit);
  }
  return absl::OkStatus();
}

absl::Status Scheduler::PrepareGradAhead(Unit& unit) {
  // The unsharded gradient is zero-filled on the grad stream while the gather is in flight, off
  // the compute stream; PreBackward makes the compute stream wait for the fill. With gradient
  // sync off the gradient of the earlier micro-batches is kept (PrepareGrad does nothing then).
  return unit.param->PrepareGrad(*grad_stream_);
}

absl::Status Scheduler::AdvanceBackwardCursor(size_t target, int prefetch_depth) {
  while (backward_cursor_ <= target && backward_cursor_ < backward_sequence_.size()) {
    bool issued = false;
    SL_RETURN_IF_ERROR(HandleBackwardPosition(backward_cursor_, /*demanded=*/true, &issued));
    ++backward_cursor_;
  }
  if (deviated_) return absl::OkStatus();
  const size_t limit = target + 1 + prefetch_depth;
  while (backward_cursor_ < backward_sequence_.size() && backward_cursor_ < limit) {
    bool issued = false;
    SL_RETURN_IF_ERROR(HandleBackwardPosition(backward_cursor_, /*demanded=*/false, &issued));
    if (!issued) {
      if (deferred_backward_ != backward_cursor_) ++current_.deferred_prefetches;
      deferred_backward_ = backward_cursor_;
      return absl::OkStatus();
    }
    ++backward_cursor_;
  }
  return absl::OkStatus();
}

bool Scheduler::PrefetchedAgain(int u) const {
  // A later use of `u` that the cursor already passed (it found the unit gathered and issued
  // nothing for it): resharding now would leave that use without a gather.
  if (phase_ == Phase::kForward) {
    for (size_t q = step_sequence_.size(); q < forward_cursor_ && q < order_.size(); ++q) {
      if (order_[q] == u) return true;
    }
    return false;
  }
  for (size_t q = backward_pos_; q < backward_cursor_ && q < backward_sequence_.size(); ++q) {
    if (backward_sequence_[q] == u) return true;
  }
  return false;
}

absl::Status Scheduler::AcquireForCompute(int u) {
  Unit& unit = units_[u];
  // A gather that already completed holds the compute stream up for nothing: no wait to time
  // (two events fewer; the unit's exposed wait gains zero).
  if (!options_.time_communication || unit.param->GatherCompleted()) {
    return unit.param->Acquire(compute_);
  }
  // Fresh events (RecordEvent), not shared ones: the pair times the wait by completion times, and
  // a shared event recorded earlier on a drained stream reports that earlier time.
  SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> before, RecordEvent(compute_));
  SL_RETURN_IF_ERROR(unit.param->Acquire(compute_));
  SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> after, RecordEvent(compute_));
  unit.waits.emplace_back(std::move(before), std::move(after));
  return absl::OkStatus();
}

absl::Status Scheduler::ReshardUnit(int u, std::shared_ptr<Event> last_use) {
  Unit& unit = units_[u];
  SL_RETURN_IF_ERROR(unit.param->Reshard(std::move(last_use)));
  unit.gathered = false;
  unit.backward_gather = false;
  // A gradient charged by this step's backward stays charged until its reduction; with gradient
  // sync off it is accumulated outside the budget from here on. A gradient kept from earlier
  // micro-batches was never charged.
  Discharge(unit, /*params=*/true, /*grad=*/!sync_grads_);
  return absl::OkStatus();
}

void Scheduler::KeepAfterBackward(Unit& unit) {
  unit.backward_gather = false;
  Discharge(unit, /*params=*/false, /*grad=*/true);
}

// --- Steps ----------------------------------------------------------------------------------

absl::Status Scheduler::BeginStep() {
  SL_RETURN_IF_ERROR(CheckOrderResult());
  if (step_ == 0 && order_known_) {
    for (int u : order_) {
      if (u < 0 || u >= num_units()) {
        return absl::InvalidArgumentError(absl::StrCat("scheduler '", options_.name,
                                                       "': forward_order names unit ", u, " but ",
                                                       num_units(), " units are registered"));
      }
    }
  }
  phase_ = Phase::kForward;
  current_ = StepMetrics{};
  current_.step = step_;
  current_.budget_bytes = options_.budget_bytes;
  current_.budget_units = options_.budget_units;
  current_.peak_inflight_bytes = inflight_bytes_;
  current_.peak_inflight_units = inflight_units_;
  for (Unit& unit : units_) {
    unit.forward_uses = 0;
    unit.backward_left = 0;
    unit.grad_ready = false;
    unit.reduced = false;
    unit.grad_ready_event = nullptr;
    unit.final_event = nullptr;
    // Without the name: LastStepMetrics fills it in, so steps copy no strings.
    unit.metrics = UnitStepMetrics{};
    unit.waits.clear();
    unit.comm.clear();
  }
  step_sequence_.clear();
  deviated_ = false;
  forward_cursor_ = 0;
  deferred_forward_ = deferred_backward_ = SIZE_MAX;
  backward_sequence_.clear();
  backward_cursor_ = 0;
  backward_pos_ = 0;
  reduction_order_.clear();
  reduction_cursor_ = 0;
  gather_pool_->ResetPeak();
  if (reduce_pool_ != gather_pool_) reduce_pool_->ResetPeak();

  SL_ASSIGN_OR_RETURN(step_start_, RecordEvent(compute_));
  // The optimizer wrote the master shards and read the sharded gradients: the gathers and the
  // reductions of this step come after it.
  std::shared_ptr<Event> optimizer_done =
      post_optimizer_ != nullptr ? std::move(post_optimizer_) : step_start_;
  post_optimizer_ = nullptr;
  for (Stream* s : {gather_stream_.get(), reduce_stream_.get(), all_reduce_stream_.get()}) {
    SL_RETURN_IF_ERROR(WaitUnlessSameStream(*s, optimizer_done));
  }
  return absl::OkStatus();
}

absl::Status Scheduler::BeginBackward() {
  phase_ = Phase::kBackward;
  const bool recording = !order_known_;
  if (recording) {
    order_ = step_sequence_;
    order_known_ = true;
    record_pending_check_ = true;
  } else if (!deviated_ && step_sequence_.size() != order_.size()) {
    deviated_ = true;
    deviation_step_ = step_;
    deviation_ = absl::StrCat("it ran ", step_sequence_.size(),
                              " forward uses where the order has ", order_.size());
    ++current_.order_deviations;
    SL_LOG(WARN, SCHED) << "scheduler '" << options_.name << "': step " << step_ << " ran "
                        << step_sequence_.size() << " forward uses but the recorded "
                        << "order has " << order_.size() << "; backward prefetch is off for "
                        << "this step";
  }
  backward_sequence_.assign(step_sequence_.rbegin(), step_sequence_.rend());
  // Reductions follow each unit's last backward use: the reverse of its first forward use.
  std::vector<bool> seen(units_.size(), false);
  for (auto it = step_sequence_.begin(); it != step_sequence_.end(); ++it) {
    if (!seen[*it]) {
      seen[*it] = true;
      reduction_order_.push_back(*it);
    }
  }
  std::reverse(reduction_order_.begin(), reduction_order_.end());
  // A prefetched unit that the forward never used (the forward deviated) is not needed.
  for (int u = 0; u < num_units(); ++u) {
    if (units_[u].gathered && units_[u].forward_uses == 0 && units_[u].active == 0) {
      SL_RETURN_IF_ERROR(ReshardUnit(u, nullptr));
    }
  }
  return absl::OkStatus();
}

absl::Status Scheduler::PreForward(int u) {
  HookTimer timer(this);
  SL_ASSIGN_OR_RETURN(Unit * unit, Lookup(u, "PreForward"));
  if (phase_ == Phase::kBackward) {
    // Activation recomputation: the unit's forward re-runs inside the backward, served by the
    // gather of its coming backward use.
    size_t pos = backward_pos_;
    while (pos < backward_sequence_.size() && backward_sequence_[pos] != u) ++pos;
    if (pos == backward_sequence_.size()) {
      return HookError("PreForward", u,
                       absl::FailedPreconditionError(
                           "a recomputation in backward of a unit with no backward use left"));
    }
    SL_RETURN_IF_ERROR(HookError("PreForward", u, AdvanceBackwardCursor(pos, 0)));
    SL_RETURN_IF_ERROR(HookError("PreForward", u, AcquireForCompute(u)));
    ++unit->active;
    ++unit->recomputing;
    return absl::OkStatus();
  }
  if (phase_ == Phase::kForward && order_known_ && !deviated_ &&
      step_sequence_.size() == order_.size() && !order_.empty()) {
    // The known forward is complete: this is a recomputation inside the backward.
    SL_RETURN_IF_ERROR(HookError("PreForward", u, BeginBackward()));
    return PreForward(u);
  }
  if (phase_ == Phase::kIdle) SL_RETURN_IF_ERROR(HookError("PreForward", u, BeginStep()));
  const size_t pos = step_sequence_.size();
  step_sequence_.push_back(u);
  if (order_known_ && !deviated_ && (pos >= order_.size() || order_[pos] != u)) {
    deviated_ = true;
    deviation_step_ = step_;
    deviation_ = absl::StrCat(
        "at position ", pos, " it ran '", unit->name, "' where the order has ",
        pos < order_.size() ? absl::StrCat("'", units_[order_[pos]].name, "'") : "its end");
    ++current_.order_deviations;
    SL_LOG(WARN, SCHED) << "scheduler '" << options_.name << "': step " << step_
                        << " deviates from the recorded forward order at position " << pos
                        << ": expected "
                        << (pos < order_.size() ? "'" + units_[order_[pos]].name + "'"
                                                : std::string("the end of the forward"))
                        << ", got '" << unit->name
                        << "'; gathering on demand for the rest of this step";
  }
  ++unit->forward_uses;
  ++unit->backward_left;
  if (!unit->gathered) {
    SL_RETURN_IF_ERROR(HookError("PreForward", u, IssueGather(u, false, /*demanded=*/true)));
  }
  if (order_known_ && !deviated_) forward_cursor_ = std::max(forward_cursor_, pos + 1);
  // Prefetch before the compute waits: on a caller stream the wait blocks this thread.
  SL_RETURN_IF_ERROR(HookError("PreForward", u, PrefetchForward()));
  SL_RETURN_IF_ERROR(HookError("PreForward", u, AcquireForCompute(u)));
  ++unit->active;
  return absl::OkStatus();
}

absl::Status Scheduler::PostForward(int u) {
  HookTimer timer(this);
  SL_ASSIGN_OR_RETURN(Unit * unit, Lookup(u, "PostForward"));
  if (unit->active == 0) {
    return HookError("PostForward", u,
                     absl::FailedPreconditionError("PostForward without a matching PreForward"));
  }
  if (phase_ == Phase::kBackward) {
    // The end of a recomputation: the backward use comes next and keeps the parameters.
    --unit->active;
    --unit->recomputing;
    return absl::OkStatus();
  }
  // The compute stream acquired the unit in PreForward: the reshard records its last use there
  // (FlatParameter records on every acquiring stream), so no event of its own is needed here.
  SL_RETURN_IF_ERROR(StreamError("PostForward", u, compute_.status()));
  --unit->active;
  if (unit->active == 0 && unit->reshard_after_forward && !PrefetchedAgain(u)) {
    SL_RETURN_IF_ERROR(HookError("PostForward", u, ReshardUnit(u, nullptr)));
  }
  return HookError("PostForward", u, PrefetchForward());
}

absl::Status Scheduler::EndForward() {
  HookTimer timer(this);
  if (!failed_.ok()) return failed_;
  if (phase_ != Phase::kForward) {
    return absl::FailedPreconditionError(absl::StrCat(
        "scheduler '", options_.name, "': EndForward() outside a forward (step ", step_, ")"));
  }
  return BeginBackward();
}

absl::Status Scheduler::PreBackward(int u) {
  HookTimer timer(this);
  SL_ASSIGN_OR_RETURN(Unit * unit, Lookup(u, "PreBackward"));
  if (phase_ == Phase::kIdle) {
    return HookError(
        "PreBackward", u,
        absl::FailedPreconditionError("PreBackward before any PreForward in the step"));
  }
  if (phase_ == Phase::kForward) SL_RETURN_IF_ERROR(HookError("PreBackward", u, BeginBackward()));
  size_t pos = backward_pos_;
  while (pos < backward_sequence_.size() && backward_sequence_[pos] != u) ++pos;
  if (pos == backward_sequence_.size()) {
    return HookError("PreBackward", u,
                     absl::FailedPreconditionError(
                         absl::StrCat("the unit has no backward use left in this step (",
                                      unit->forward_uses, " forward uses, all matched)")));
  }
  backward_pos_ = pos + 1;
  const int depth = options_.backward_prefetch == BackwardPrefetch::kBeforeGrad
                        ? options_.backward_prefetch_depth
                        : 0;
  SL_RETURN_IF_ERROR(HookError("PreBackward", u, AdvanceBackwardCursor(pos, depth)));
  if (!unit->gathered) {
    // Resharded after an earlier backward use although the cursor had passed this one.
    SL_RETURN_IF_ERROR(HookError("PreBackward", u, IssueGather(u, true, /*demanded=*/true)));
  }
  if (unit->recomputing == 0 || unit->active == 0) {
    SL_RETURN_IF_ERROR(HookError("PreBackward", u, AcquireForCompute(u)));
  }
  SL_RETURN_IF_ERROR(HookError("PreBackward", u, unit->param->PrepareGrad(compute_)));
  ++unit->active;
  return absl::OkStatus();
}

absl::Status Scheduler::PostBackward(int u) {
  HookTimer timer(this);
  SL_ASSIGN_OR_RETURN(Unit * unit, Lookup(u, "PostBackward"));
  if (phase_ != Phase::kBackward || unit->active == 0 || unit->backward_left == 0) {
    return HookError("PostBackward", u,
                     absl::FailedPreconditionError("PostBackward without a matching PreBackward"));
  }
  // Shared with the reduction's and the reshard's records of the same compute stream point.
  SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> ready, RecordSharedEvent(compute_));
  --unit->active;
  --unit->backward_left;
  if (options_.backward_prefetch == BackwardPrefetch::kAfterGrad && backward_pos_ > 0) {
    SL_RETURN_IF_ERROR(
        HookError("PostBackward", u,
                  AdvanceBackwardCursor(backward_pos_ - 1, options_.backward_prefetch_depth)));
  }
  if (unit->backward_left > 0 || unit->active > 0) {
    // More backward uses to come (a unit used twice in forward): the gradient stays; the
    // parameters follow the reshard policy.
    if (unit->active == 0 && unit->reshard_after_forward && !PrefetchedAgain(u)) {
      SL_RETURN_IF_ERROR(HookError("PostBackward", u, ReshardUnit(u, std::move(ready))));
    }
    return absl::OkStatus();
  }
  if (!sync_grads_) {
    // No reduction this micro-batch: the unsharded gradient accumulates.
    if (!unit->reshard_after_backward) {
      KeepAfterBackward(*unit);
      return absl::OkStatus();
    }
    return HookError("PostBackward", u, ReshardUnit(u, std::move(ready)));
  }
  unit->grad_ready = true;
  unit->grad_ready_event = std::move(ready);
  return HookError("PostBackward", u, IssueReadyReductions());
}

absl::Status Scheduler::IssueReadyReductions() {
  while (reduction_cursor_ < reduction_order_.size()) {
    const int w = reduction_order_[reduction_cursor_];
    if (!units_[w].grad_ready) break;
    SL_RETURN_IF_ERROR(IssueReduction(w));
    ++reduction_cursor_;
  }
  return absl::OkStatus();
}

absl::Status Scheduler::IssueReduction(int u) {
  Unit& unit = units_[u];
  const MixedPrecisionPolicy& mp = unit.param->policy();
  // The flight recorder tags every collective of the unit with its name.
  const ReduceGradOptions ro{.op = unit.reduce_op,
                             .collective = {.tag = unit.name, .key = UnitKey(u)}};
  const bool timed = options_.time_communication;
  std::shared_ptr<Event> start;
  ReduceGradOptions rs = ro;
  rs.collective_start = timed ? &start : nullptr;
  SL_ASSIGN_OR_RETURN(
      std::shared_ptr<Event> scattered,
      unit.param->ReduceScatter(*reduce_comm_, *reduce_stream_, unit.grad_ready_event, rs));
  issue_log_.push_back({Issued::kReduceScatter, u});
  if (timed) unit.comm.emplace_back(std::move(start), scattered);
  const uint64_t reduced_bytes = unit.param->layout().total_elements() * DTypeSize(mp.reduce_dtype);
  unit.metrics.bytes_reduced += reduced_bytes;
  current_.bytes_reduced += reduced_bytes;
  ++unit.metrics.reductions;
  unit.gathered = false;
  unit.backward_gather = false;
  unit.grad_ready = false;
  unit.reduced = true;

  Stream* accumulate = reduce_stream_.get();
  const bool hybrid = replicate_comm_ != nullptr;
  bool all_reduce_accumulated = false;
  if (hybrid && !all_reduce_) {
    unit.all_reduce_deferred = true;
  } else if (hybrid && unit.all_reduce_deferred) {
    all_reduce_accumulated = true;  // after the accumulation, over the whole sharded gradient
  } else if (hybrid) {
    SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> reduced,
                        unit.param->AllReduce(replicate_comm_.get(), *all_reduce_stream_, ro));
    issue_log_.push_back({Issued::kAllReduce, u});
    if (timed) unit.comm.emplace_back(scattered, reduced);
    accumulate = all_reduce_stream_.get();
  }
  SL_ASSIGN_OR_RETURN(unit.final_event, unit.param->Accumulate(*accumulate));
  if (all_reduce_accumulated) {
    SL_RETURN_IF_ERROR(unit.param->WaitReduced(*all_reduce_stream_));
    SL_ASSIGN_OR_RETURN(FlatShardView grad, unit.param->ShardGrad());
    ReduceOptions ar{};
    ar.op = unit.reduce_op;
    ar.tag = unit.name;
    ar.key = UnitKey(u);
    std::shared_ptr<Event> before;
    if (timed) {
      SL_ASSIGN_OR_RETURN(before, RecordEvent(*all_reduce_stream_));
    }
    SL_ASSIGN_OR_RETURN(Work work, replicate_comm_->AllReduce(grad.data, grad.data, grad.elements,
                                                              grad.dtype, *all_reduce_stream_, ar));
    issue_log_.push_back({Issued::kAllReduceAccumulated, u});
    if (timed) unit.comm.emplace_back(std::move(before), work.event());
    unit.final_event = work.event();
    unit.all_reduce_deferred = false;
  }
  // The buffers went back to their pools, stream-ordered after the reduction's events.
  Discharge(unit, /*params=*/true, /*grad=*/true);
  return absl::OkStatus();
}

absl::Status Scheduler::FinishBackward() {
  HookTimer timer(this);
  // Formatted only for an error.
  auto hook = [this] {
    return absl::StrCat("scheduler '", options_.name, "': FinishBackward() in step ", step_);
  };
  if (!failed_.ok()) return failed_;
  if (phase_ == Phase::kIdle) {
    return absl::FailedPreconditionError(absl::StrCat(hook(), ": no forward in this step"));
  }
  if (phase_ == Phase::kForward) {
    if (absl::Status status = BeginBackward(); !status.ok()) return Annotate(status, hook());
  }
  for (const Unit& unit : units_) {
    if (unit.active > 0) {
      return absl::FailedPreconditionError(absl::StrCat(hook(), ": unit '", unit.name,
                                                        "' is still in use (", unit.active,
                                                        " Pre hooks without their Post)"));
    }
  }
  auto fail = [&](absl::Status status) { return Fail(WithOrderNote(Annotate(status, hook()))); };
  // Every remaining backward gather, in order: a unit whose backward did not run here may have
  // run on another rank, which gathered it at this position.
  if (!backward_sequence_.empty()) {
    absl::Status status = AdvanceBackwardCursor(backward_sequence_.size() - 1, 0);
    if (!status.ok()) return fail(status);
  }
  if (sync_grads_) {
    for (size_t i = reduction_cursor_; i < reduction_order_.size(); ++i) {
      const int w = reduction_order_[i];
      Unit& unit = units_[w];
      if (unit.grad_ready || unit.reduced) continue;
      // Its backward did not (fully) run: it takes part with the gradient it has (zero if none).
      SL_LOG(INFO, SCHED) << "scheduler '" << options_.name << "': unit '" << unit.name << "' had "
                          << unit.backward_left << " backward use(s) left in step " << step_
                          << "; reducing the gradient it has (zero-filled if none)";
      absl::Status status = AcquireForCompute(w);
      if (status.ok()) status = unit.param->PrepareGrad(compute_);
      if (!status.ok()) return fail(status);
      absl::StatusOr<std::shared_ptr<Event>> ready = RecordSharedEvent(compute_);
      if (!ready.ok()) return fail(ready.status());
      unit.backward_left = 0;
      unit.grad_ready = true;
      unit.grad_ready_event = *std::move(ready);
    }
    if (absl::Status status = IssueReadyReductions(); !status.ok()) return fail(status);
  }
  // Whatever is still unsharded (kept units without a reduction, skipped units without sync),
  // except the units kept after their backward (SetReshardAfterBackward).
  for (int w = 0; w < num_units(); ++w) {
    Unit& unit = units_[w];
    if (unit.gathered && !sync_grads_ && !unit.reshard_after_backward && unit.forward_uses > 0 &&
        unit.backward_left == 0) {
      if (unit.backward_gather) KeepAfterBackward(unit);
      continue;
    }
    if (unit.gathered) {
      if (absl::Status status = ReshardUnit(w, nullptr); !status.ok()) return fail(status);
    }
  }
  // The optimizer (on the compute stream) reads the sharded gradients after this.
  for (Unit& unit : units_) {
    if (unit.param->state() == FlatParameterState::kReducing) {
      if (absl::Status status = unit.param->WaitReduced(compute_); !status.ok())
        return fail(status);
    }
    if (unit.final_event != nullptr && unit.final_event->recorded_stream_id() != compute_.id()) {
      if (absl::Status status = WaitUnlessSameStream(compute_, unit.final_event); !status.ok()) {
        return fail(status);
      }
    }
  }
  // Fresh: its completion time is the step's end (a shared event may report an earlier one).
  absl::StatusOr<std::shared_ptr<Event>> end = RecordEvent(compute_);
  if (!end.ok()) return fail(end.status());

  // The step's raw metrics: read once their events completed (LastStepMetrics).
  current_.accumulated_grad_bytes = 0;
  for (const Unit& unit : units_) {
    if (unit.param->has_unsharded_grad()) {
      current_.accumulated_grad_bytes += unit.backward_bytes - unit.param_bytes;
    }
  }
  current_.gather_pool_peak_bytes = gather_pool_->stats().peak_bytes;
  current_.reduce_pool_peak_bytes = reduce_pool_->stats().peak_bytes;
  // The finished step replaces the one before in place: its vectors keep their capacity, and
  // the units' event-pair vectors trade places with the previous step's (emptied here).
  if (!finished_.has_value()) finished_.emplace();
  FinishedStep& finished = *finished_;
  std::vector<UnitStepMetrics> unit_metrics = std::move(finished.metrics.units);
  finished.metrics = current_;  // current_.units is always empty
  finished.metrics.units = std::move(unit_metrics);
  finished.metrics.units.resize(units_.size());
  finished.start = step_start_;
  finished.end = *std::move(end);
  finished.computed = false;
  finished.waits.resize(units_.size());
  finished.comm.resize(units_.size());
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    finished.metrics.units[u] = unit.metrics;
    finished.waits[u].swap(unit.waits);
    finished.comm[u].swap(unit.comm);
    unit.waits.clear();
    unit.comm.clear();
  }
  if (record_pending_check_) {
    // The recorded order may show units used twice, whose gradients live through the backward.
    if ((options_.budget_bytes > 0 && MinimumBudgetBytes() > options_.budget_bytes) ||
        (options_.budget_units > 0 && MinimumBudgetUnits() > options_.budget_units)) {
      SL_LOG(WARN, SCHED) << "scheduler '" << options_.name << "': with the recorded order the "
                          << "units need a budget of " << MinimumBudgetBytes() << " bytes and "
                          << MinimumBudgetUnits() << " units (set: " << options_.budget_bytes
                          << " bytes, " << options_.budget_units
                          << " units); gathers the compute needs will overshoot it";
    }
    record_pending_check_ = false;
    if (absl::Status status = StartOrderCheck(); !status.ok()) return fail(status);
  }
  phase_ = Phase::kIdle;
  ++step_;
  const absl::Duration elapsed = timer.elapsed();
  finished_->metrics.host_hook_time = hook_time_ + elapsed;
  finished_->metrics.hook_calls = hook_calls_ + 1;
  // This call belongs to the finished step: the timer's addition when it returns is offset.
  hook_time_ = -elapsed;
  hook_calls_ = -1;
  return absl::OkStatus();
}

std::vector<std::string> Scheduler::issue_log() const {
  std::vector<std::string> log;
  log.reserve(issue_log_.size());
  for (const IssueEntry& entry : issue_log_) {
    const std::string& name = units_[entry.unit].name;
    switch (entry.what) {
      case Issued::kGather:
        log.push_back(absl::StrCat("AG ", name));
        break;
      case Issued::kReduceScatter:
        log.push_back(absl::StrCat("RS ", name));
        break;
      case Issued::kAllReduce:
        log.push_back(absl::StrCat("AR ", name));
        break;
      case Issued::kAllReduceAccumulated:
        log.push_back(absl::StrCat("AR ", name, " (accumulated)"));
        break;
    }
  }
  return log;
}

// --- Cross-rank order check -----------------------------------------------------------------

absl::Status Scheduler::StartOrderCheck() {
  // A fixed-size record per rank, so one all-gather suffices and it never blocks the host here:
  // [length, hash of the order, hash of the layouts, the first `capacity` entries (-1 padded)].
  // A device world's all-gather takes device memory: the records go through order_device_ and
  // come back to pinned memory on the control stream.
  const Communicator& world = *mesh_.world();
  const bool staged = !world.device().is_host();
  const std::string what =
      absl::StrCat("scheduler '", options_.name, "': the cross-rank order check");
  order_capacity_ = 2 * static_cast<size_t>(num_units()) + 8;
  const size_t record = kOrderHeader + order_capacity_;
  const size_t total = record * (world.size() + 1);
  int64_t* mine = nullptr;
  if (staged) {
    SL_RETURN_IF_ERROR(EnsureStaging(what));
    const size_t bytes = total * sizeof(int64_t);
    if (order_pinned_.size() < bytes) {
      order_pinned_ = Buffer();
      order_device_ = Buffer();
      SL_ASSIGN_OR_RETURN(order_pinned_, staging_pinned_->Allocate(bytes));
      SL_ASSIGN_OR_RETURN(order_device_, staging_device_->Allocate(bytes));
    }
    mine = static_cast<int64_t*>(order_pinned_.data());
    std::fill(mine, mine + total, int64_t{-1});
  } else {
    order_check_.assign(total, -1);
    mine = order_check_.data();
  }
  uint64_t order_hash = 0;
  for (int u : order_) order_hash = Mix(order_hash, static_cast<uint64_t>(u));
  uint64_t layout_hash = 0;
  for (const Unit& unit : units_)
    layout_hash = Mix(layout_hash, unit.param->layout().Fingerprint());
  mine[0] = static_cast<int64_t>(order_.size());
  mine[1] = static_cast<int64_t>(order_hash);
  mine[2] = static_cast<int64_t>(layout_hash);
  for (size_t i = 0; i < std::min(order_.size(), order_capacity_); ++i)
    mine[kOrderHeader + i] = order_[i];
  int64_t* gathered = mine;
  if (staged) {
    gathered = static_cast<int64_t*>(order_device_.data());
    SL_RETURN_IF_ERROR(
        Annotate(EnqueueCopy(*control_stream_, gathered, mine, record * sizeof(int64_t)), what));
  }
  absl::StatusOr<Work> work =
      mesh_.world()->AllGather(gathered, gathered + record, record, DType::kI64, *control_stream_);
  if (!work.ok()) return work.status();
  order_check_work_ = *std::move(work);
  order_check_copied_ = nullptr;
  order_check_pending_ = true;
  if (staged) {
    SL_RETURN_IF_ERROR(Annotate(EnqueueCopy(*control_stream_, mine + record, gathered + record,
                                            world.size() * record * sizeof(int64_t)),
                                what));
    SL_ASSIGN_OR_RETURN(order_check_copied_, RecordEvent(*control_stream_));
  }
  return absl::OkStatus();
}

absl::Status Scheduler::CheckOrderResult() {
  if (!order_check_pending_) return absl::OkStatus();
  order_check_pending_ = false;
  const std::string what = absl::StrCat("scheduler '", options_.name,
                                        "': the forward orders recorded in the first step");
  const absl::Time deadline = control_stream_->clock().Now() + mesh_.world()->timeout();
  absl::Status status = order_check_work_.Wait(deadline);
  if (status.ok() && order_check_copied_ != nullptr) {
    status = order_check_copied_->Synchronize(deadline);
  }
  if (!status.ok()) {
    failed_ = Annotate(status, absl::StrCat(what, ": comparing across ranks"));
    return failed_;
  }
  const size_t record = kOrderHeader + order_capacity_;
  const int n = mesh_.world()->size();
  const int64_t* all =
      (order_check_copied_ != nullptr ? static_cast<const int64_t*>(order_pinned_.data())
                                      : order_check_.data()) +
      record;
  auto name = [&](int64_t u) -> std::string {
    if (u < 0) return "(the end of the forward)";
    if (u >= num_units()) return absl::StrCat("unit #", u);
    return absl::StrCat("'", units_[u].name, "'");
  };
  for (int r = 1; r < n; ++r) {
    const int64_t* a = all;
    const int64_t* b = all + r * record;
    if (a[2] != b[2]) {
      failed_ = absl::FailedPreconditionError(
          absl::StrCat(what, ": rank 0 and rank ", r,
                       " registered different units (names, shapes or dtypes "
                       "differ); every rank must register the same units in the same order"));
      return failed_;
    }
    if (a[0] == b[0] && a[1] == b[1]) continue;
    const size_t shown = std::min<size_t>(std::max(a[0], b[0]), order_capacity_);
    size_t pos = 0;
    while (pos < shown && a[kOrderHeader + pos] == b[kOrderHeader + pos]) ++pos;
    const std::string where =
        pos < shown ? absl::StrCat("at position ", pos, " rank 0 ran ", name(a[kOrderHeader + pos]),
                                   " but rank ", r, " ran ", name(b[kOrderHeader + pos]))
                    : absl::StrCat("beyond position ", shown, " (rank 0 ran ", a[0],
                                   " forward uses, rank ", r, " ran ", b[0], ")");
    failed_ = absl::FailedPreconditionError(
        absl::StrCat(what, " differ across ranks: ", where,
                     "; every rank must run the same units in the same order"));
    return failed_;
  }
  return absl::OkStatus();
}

// --- Between steps --------------------------------------------------------------------------

void Scheduler::SetPostOptimizerEvent(std::shared_ptr<Event> event) {
  post_optimizer_ = std::move(event);
}

void Scheduler::SetRequiresGradientSync(bool sync) { sync_grads_ = sync; }

void Scheduler::SetRequiresAllReduce(bool all_reduce) { all_reduce_ = all_reduce; }

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

absl::Status Scheduler::ZeroGrad() {
  if (phase_ != Phase::kIdle) {
    return absl::FailedPreconditionError(
        absl::StrCat("scheduler '", options_.name, "': ZeroGrad() during a step"));
  }
  for (Unit& unit : units_) SL_RETURN_IF_ERROR(unit.param->ZeroShardGrad(compute_));
  return absl::OkStatus();
}

absl::StatusOr<double> Scheduler::ClipGradNorm(double max_norm, absl::Time deadline) {
  const std::string what = absl::StrCat("scheduler '", options_.name, "': ClipGradNorm()");
  if (phase_ != Phase::kIdle) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": during a step"));
  }
  if (!(max_norm > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": max_norm ", max_norm, " is not > 0"));
  }
  if (!compute_.device().is_host()) return ClipGradNormOnDevice(max_norm, deadline, what);
  // Each shard group holds every parameter once; its replicas hold copies: sum over the shard
  // group only.
  SL_ASSIGN_OR_RETURN(clip_scratch_, HostShardSquares(deadline, what));
  ReduceOptions sum{};
  sum.op = ReduceOp::kSum;
  SL_ASSIGN_OR_RETURN(Work work, reduce_comm_->AllReduce(&clip_scratch_, &clip_scratch_, 1,
                                                         DType::kF64, *reduce_stream_, sum));
  SL_RETURN_IF_ERROR(Annotate(work.Wait(deadline), what));
  const double norm = std::sqrt(clip_scratch_);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (const Unit& unit : units_) {
      if (!unit.param->has_shard_grad()) continue;
      SL_ASSIGN_OR_RETURN(FlatShardView grad, unit.param->ShardGrad());
      SL_RETURN_IF_ERROR(Annotate(Scale(grad.data, grad.elements, grad.dtype, coef), what));
    }
  }
  return norm;
}

absl::StatusOr<double> Scheduler::HostShardSquares(absl::Time deadline, const std::string& what) {
  SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> reduced, RecordEvent(compute_));
  SL_RETURN_IF_ERROR(Annotate(reduced->Synchronize(deadline), what));
  double partial = 0;
  for (const Unit& unit : units_) {
    if (!unit.param->has_shard_grad()) continue;
    SL_ASSIGN_OR_RETURN(FlatShardView grad, unit.param->ShardGrad());
    SL_ASSIGN_OR_RETURN(double squares,
                        ShardSquaredNorm(unit.param->layout(), grad.shard, grad.data, grad.dtype));
    partial += squares;
  }
  return partial;
}

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

absl::StatusOr<double> Scheduler::ClipGradNormOnDevice(double max_norm, absl::Time deadline,
                                                       const std::string& what) {
  SL_RETURN_IF_ERROR(EnsureStaging(what));
  if (clip_device_.data() == nullptr) {
    SL_ASSIGN_OR_RETURN(clip_device_,
                        staging_device_->Allocate(kSumSquaresDoubles * sizeof(double)));
    SL_ASSIGN_OR_RETURN(clip_pinned_, staging_pinned_->Allocate(sizeof(double)));
  }
  auto* sums = static_cast<double*>(clip_device_.data());
  auto* result = static_cast<double*>(clip_pinned_.data());
  const bool offloaded = offload_allocator_ != nullptr;
  if (!offloaded) {
    // The squares, summed by kernels on the compute stream after the backward's last write
    // (FinishBackward made the compute stream wait for the reductions). Padding is skipped.
    SL_RETURN_IF_ERROR(Annotate(EnqueueFill(compute_, sums, sizeof(double)), what));
    for (const Unit& unit : units_) {
      if (!unit.param->has_shard_grad()) continue;
      SL_ASSIGN_OR_RETURN(FlatShardView grad, unit.param->ShardGrad());
      const size_t esize = DTypeSize(grad.dtype);
      for (const ShardSlice& slice : unit.param->layout().ShardSlices(grad.shard)) {
        SL_RETURN_IF_ERROR(Annotate(
            EnqueueSumSquares(compute_,
                              static_cast<const char*>(grad.data) + slice.shard_offset * esize,
                              slice.length, grad.dtype, sums),
            absl::StrCat(what, ": unit '", unit.name, "'")));
      }
    }
  } else {
    // CPU offload: the sharded gradients are in host memory, summed here once the compute stream
    // is done; the partial sum crosses to the device for the all-reduce.
    SL_ASSIGN_OR_RETURN(*result, HostShardSquares(deadline, what));
    SL_RETURN_IF_ERROR(Annotate(EnqueueCopy(compute_, sums, result, sizeof(double)), what));
  }
  SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> summed, RecordEvent(compute_));
  SL_RETURN_IF_ERROR(Annotate(reduce_stream_->WaitEvent(*summed), what));
  ReduceOptions sum{};
  sum.op = ReduceOp::kSum;
  SL_ASSIGN_OR_RETURN(Work work,
                      reduce_comm_->AllReduce(sums, sums, 1, DType::kF64, *reduce_stream_, sum));
  SL_RETURN_IF_ERROR(Annotate(EnqueueCopy(*reduce_stream_, result, sums, sizeof(double)), what));
  SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> copied, RecordEvent(*reduce_stream_));
  SL_RETURN_IF_ERROR(Annotate(work.Wait(deadline), what));
  SL_RETURN_IF_ERROR(Annotate(copied->Synchronize(deadline), what));
  const double norm = std::sqrt(*result);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (const Unit& unit : units_) {
      if (!unit.param->has_shard_grad()) continue;
      SL_ASSIGN_OR_RETURN(FlatShardView grad, unit.param->ShardGrad());
      SL_RETURN_IF_ERROR(
          Annotate(offloaded ? Scale(grad.data, grad.elements, grad.dtype, coef)
                             : EnqueueScale(compute_, grad.data, grad.elements, grad.dtype, coef),
                   what));
    }
  }
  return norm;
}

absl::StatusOr<StepMetrics> Scheduler::LastStepMetrics(absl::Time deadline) {
  if (!finished_.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("scheduler '", options_.name, "': LastStepMetrics() before any step ended"));
  }
  FinishedStep& f = *finished_;
  if (f.computed) return f.metrics;
  SL_RETURN_IF_ERROR(f.end->Synchronize(deadline));
  for (const auto& unit_comm : f.comm) {
    for (const auto& [start, done] : unit_comm) {
      if (done != nullptr) SL_RETURN_IF_ERROR(done->Synchronize(deadline));
    }
  }
  StepMetrics& m = f.metrics;
  m.step_time = Between(f.start, f.end);
  bool timed = m.step_time.has_value() && options_.time_communication;
  absl::Duration exposed, communication;
  for (size_t u = 0; u < f.waits.size(); ++u) {
    absl::Duration unit_exposed;
    for (const auto& [before, after] : f.waits[u]) {
      std::optional<absl::Duration> d = Between(before, after);
      if (!d.has_value()) timed = false;
      unit_exposed += d.value_or(absl::ZeroDuration());
    }
    if (timed) m.units[u].exposed_wait = unit_exposed;
    exposed += unit_exposed;
    for (const auto& [start, done] : f.comm[u]) {
      communication += Between(start, done).value_or(absl::ZeroDuration());
    }
  }
  if (timed) {
    m.exposed_communication = exposed;
    m.communication_time = communication;
    if (communication > absl::ZeroDuration()) {
      m.overlap_fraction = std::clamp(1.0 - absl::FDivDuration(exposed, communication), 0.0, 1.0);
    }
  }
  for (size_t u = 0; u < m.units.size(); ++u) m.units[u].name = units_[u].name;
  f.computed = true;
  // The events are no longer needed; the vectors' storage is, by the next step.
  for (std::vector<Unit::EventPair>& pairs : f.waits) pairs.clear();
  for (std::vector<Unit::EventPair>& pairs : f.comm) pairs.clear();
  return m;
}

}  // namespace shardline
