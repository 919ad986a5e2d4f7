// File: scheduler/scheduler.h
// -----------------------------------------------------------------------------
// The FSDP scheduler: a host framework registers its units (layers, blocks) and calls four hooks
// around its own compute; the scheduler gathers each unit's parameters just in time (prefetching
// the next ones in the recorded order), reshards them after use, reduces gradients back into
// shards on its own streams, and keeps the memory of everything in flight under one budget.
// Everything it does is enqueued on streams and ordered by events: the host blocks only where
// the compute stream is the calling thread (a CPU framework) and the data is really needed.
//
//   SL_ASSIGN_OR_RETURN(auto sched, Scheduler::Create(world, compute, {.budget_bytes = 64 << 20},
//                                                     deadline));
//   SL_ASSIGN_OR_RETURN(int block, sched->RegisterUnit({.name = "block0", .tensors = specs}));
//   SL_RETURN_IF_ERROR(sched->unit(block).SetShardFromTensors(initial_values));
//   for each step:
//     for each use of a unit u in forward:   PreForward(u); compute with unit(u).View(...);
//                                            PostForward(u)
//     for each use in reverse (backward):    PreBackward(u); write gradients into
//                                            unit(u).GradView(...) (add, never overwrite);
//                                            PostBackward(u)
//     FinishBackward();   // the compute stream now waits for every reduction
//     optimizer on unit(u).master_shard() and unit(u).ShardGrad(); ZeroGrad();
//
// Streams. The framework's compute stream (a wrapped cudaStream_t on GPUs; a caller stream for a
// CPU framework, whose waits block the calling thread; any Stream in tests) is given to Create.
// The scheduler creates, through SchedulerOptions::stream_factory, a gather stream (all-gathers),
// a reduce stream (reduce-scatters and accumulation into the sharded gradient), an all-reduce
// stream (the hybrid replicate all-reduce), a grad stream (zero-fills each unsharded gradient
// when its backward gather is issued, off the compute stream) and a control stream (the
// cross-rank order check). The gather, reduce and all-reduce streams ask for priority 1
// (StreamOptions::priority: on CUDA one level above the default, as FSDP2's communication
// streams). Every hand-over is an event; buffers go back to their pool after their last reader's
// event (stream-ordered reuse).
//
// Communicators. Create splits the world into a ProcessMesh per the sharding strategy and Dups
// the shard group once more: all-gathers run on one communicator, reduce-scatters on the other,
// so each carries its collectives in one canonical order on every rank (see "Orders") and the
// gather stream never waits for a reduction (communicator.h's ordering rule). The replicate
// group carries the hybrid all-reduces.
//
// Orders. A step's forward order is the sequence of PreForward calls (a unit used twice appears
// twice). The first step records it (unless SchedulerOptions::forward_order gives it); at the end
// of that step every rank compares its recorded order with the others' (an all-gather on the
// world communicator, blocking the host once): a difference is FailedPrecondition on every rank,
// naming the first differing position and both units. Later steps prefetch along the recorded
// order. A step whose forward deviates from it logs a warning naming the expected and the actual
// unit and falls back to on-demand gathering for the rest of that step (never a wrong buffer,
// never a hang). Every collective the scheduler issues carries its unit in the fingerprint
// (CollectiveOptions::key): ranks whose forwards differ fail the first collective that differs
// on every rank, before any data moves, with InvalidArgument (a peer error) naming both ranks and
// both units, and each rank adds whether its own forward kept to the known order. The backward
// order is the reverse of the step's actual forward order; backward gathers are issued along it by
// a cursor that never skips a unit (a unit whose backward does not run on this rank is still
// gathered at its turn), and reductions are issued in the order of each unit's last backward use, a
// unit that is not ready holding back the ones after it until it is ready or FinishBackward
// supplies it. So every rank issues the same gathers and the same reductions in the same order even
// if some rank skips a unit's backward.
//
// The budget (InflightBudget, scheduler/budget.h). Memory "in flight" is charged on the host,
// at issue, deterministically (the issue decisions depend only on the sequence of hook calls,
// never on clocks or completions):
//   forward gather   the unit's unsharded parameters (param_dtype), from the gather's issue until
//                    the unit reshards;
//   (with CPU offload, also the shard-sized staging buffer the master shard is copied into)
//   backward gather  the parameters plus the unsharded gradient (and its reduce_dtype copy if
//                    reduce_dtype differs), from the gather's issue until the reduction is issued
//                    (the buffers then go back stream-ordered, after the reduction's events).
// Units kept unsharded after forward (reshard_after_forward off, shard-grad-op, no-shard) stay
// charged, and so do parameters kept after a backward that does not reduce
// (SetReshardAfterBackward(false)). A prefetch is issued only if it fits (bytes and count), in
// every accumulation mode; otherwise it is deferred and retried at every later hook, in order. A
// gather the compute needs now is always issued; if it does not fit, that is counted as an
// overshoot in the metrics (it happens only when the forward deviates from the known order, a
// unit's backward is skipped, or the budget is below the minimum). RegisterUnit refuses
// (InvalidArgument) a budget below the minimum it can know then (MinimumBudgetBytes/Units: the
// units kept after forward or after backward plus the largest backward footprint; with an
// explicit order also the gradients of units used twice), and so do SetBudget and
// SetReshardAfterBackward(u, false); when the first step records an order with units used twice
// and the budget is below the new minimum, a warning names it. Unsharded gradients accumulated
// across micro-batches without reduction (SetRequiresGradientSync(false)) persist between steps:
// they are outside the budget and reported separately (accumulated_grad_bytes); a later backward
// gather of such a unit charges only its parameters.
//
// Errors. Misuse of a hook on this rank (an unknown unit, a call out of order) returns
// InvalidArgument or FailedPrecondition and changes nothing. A failed stream or collective, or a
// peer's disagreement (an error with the peer payload, IsPeerError), leaves the step
// inconsistent across ranks: the hook that sees it returns it and every later hook returns that
// same error, and the scheduler aborts its gather, reduce and replicate communicators with it,
// so that peers blocked in their collectives fail at once (and the world communicator too until
// this rank has read the order check, an all-gather on it at the end of the step that recorded
// the forward order). Destroying the scheduler is safe in any
// state, mid-step included: buffers go back to their pools after their readers' events; what is
// still read after one SHARDLINE_TIMEOUT_S is leaked (warned, counted in the pools'
// MemoryStats::leaked_*), never freed under a reader; on virtual time the drain drives the
// timeline.
//
// Thread safety: one thread at a time calls the hooks (as PyTorch's autograd engine does, one
// backward at a time); the streams run anywhere.

#ifndef SHARDLINE_SCHEDULER_SCHEDULER_H_
#define SHARDLINE_SCHEDULER_SCHEDULER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/process_mesh.h"
#include "runtime/allocator.h"
#include "runtime/flat_layout.h"
#include "runtime/stream.h"
#include "runtime/trace.h"
#include "scheduler/budget.h"
#include "scheduler/flat_parameter.h"
#include "scheduler/mixed_precision.h"

namespace shardline {

enum class ShardingStrategy : uint8_t {
  kFullShard,    // mesh 1 x N; reshard after forward (except the root)
  kShardGradOp,  // mesh 1 x N; keep the parameters unsharded from forward to backward
  kNoShard,      // mesh N x 1 (DDP): every rank holds everything; all-reduce of gradients
  kHybridShard,  // mesh R x S: shard within S ranks, all-reduce across the R replicas
};
// "full_shard", "shard_grad_op", "no_shard", "hybrid_shard".
absl::string_view ShardingStrategyName(ShardingStrategy strategy);

enum class BackwardPrefetch : uint8_t {
  kOff,         // gather each unit at its PreBackward
  kBeforeGrad,  // at PreBackward(u), prefetch the next unit(s) before u's gradient computation
  kAfterGrad,   // at PostBackward(u), after u's gradient computation, before its reduction
};
absl::string_view BackwardPrefetchName(BackwardPrefetch prefetch);

// Per-unit settings. Unset fields follow SchedulerOptions.
struct UnitPolicy {
  // Unset: the strategy's default (full/hybrid shard: true; shard-grad-op, no-shard: false),
  // except the root unit (SchedulerOptions::root_unit), which defaults to false as in FSDP2.
  std::optional<bool> reshard_after_forward;
  MixedPrecisionPolicy precision;
  // kAvg (default): the gradient averaged over every data-parallel rank; kSum: summed.
  ReduceOp reduce_op = ReduceOp::kAvg;
};

struct UnitSpec {
  std::string name;                 // unique among the units ("block3")
  std::vector<TensorSpec> tensors;  // the unit's parameters, in the framework's order
  UnitPolicy policy;
  // The framework's own memory for the master shard (FlatParameterOptions::master_shard).
  Buffer master_shard;
};

struct SchedulerOptions {
  std::string name = "fsdp";
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  // kHybridShard: the shard group's size (must divide the world size). 0: the ranks per host.
  int shard_size = 0;

  // Forward prefetch depth along the recorded order (0: off; FSDP's forward_prefetch = 1).
  int forward_prefetch = 1;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBeforeGrad;
  int backward_prefetch_depth = 1;
  // An explicit forward order (unit ids, a unit used twice listed twice). Empty: record the
  // first step's. Checked like a recorded one (a deviation is warned about and falls back).
  std::vector<int> forward_order;

  // The budget of memory in flight (see the header comment): bytes and unsharded units.
  // 0: unlimited.
  size_t budget_bytes = 0;
  int budget_units = 0;

  // The unit whose reshard_after_forward defaults to false (FSDP2's root); -1: none.
  int root_unit = 0;

  // Streams: how the scheduler makes its gather, reduce and all-reduce streams. Null: a stream of
  // the compute stream's device (CreateStream), for host devices a host stream. The options
  // carry the name ("fsdp.gather"), the trace writer and the track.
  std::function<absl::StatusOr<std::unique_ptr<Stream>>(StreamOptions)> stream_factory;
  // Unsharded parameters, unsharded gradients and reduction temporaries. Null: the scheduler
  // makes two CachingPools ("<name>.gather pool", "<name>.reduce pool") over an allocator of the
  // compute stream's device. Given pools must outlive the scheduler; they may be the same pool
  // only if no rank ever skips a unit's backward (the gather stream could then wait, through a
  // reused block, for a reduction that another rank holds back).
  Allocator* gather_pool = nullptr;
  Allocator* reduce_pool = nullptr;
  // Master shards and sharded gradients. Null: an allocator of the compute stream's device.
  Allocator* shard_allocator = nullptr;
  // CPU offload (FSDP's CPUOffload(offload_params=True)): master shards and sharded gradients in
  // host memory (offload_allocator; null: pinned memory on a GPU, a separate host allocator
  // otherwise), the unsharded buffers in the pools; each gather copies the shard to the device
  // on the gather stream, each reduction copies the reduced shard back on its stream
  // (FlatParameterOptions::offload_allocator). The optimizer then steps on host memory.
  bool cpu_offload = false;
  Allocator* offload_allocator = nullptr;

  // Chrome-trace spans of the scheduler's streams (tracks "gather", "reduce", "all_reduce") and
  // counters of the bytes in flight. Null: none. Must outlive the scheduler.
  TraceWriter* trace = nullptr;
  // Whether StepMetrics time the communication: an event pair around each wait of the compute
  // stream for a gather and an event before each collective, read back by LastStepMetrics
  // (exposed_communication, communication_time, overlap_fraction, the units' exposed_wait).
  // Off: those stay nullopt, and the hooks record up to seven events fewer per unit per step
  // (scheduler_hooks_bench). Counts, bytes, budget figures, step_time and host_hook_time stay.
  bool time_communication = true;
};

struct UnitStepMetrics {
  std::string name;
  int gathers = 0;              // all-gathers issued for the unit this step
  int prefetched = 0;           // of which issued ahead of the unit's use
  int reductions = 0;           // reduce-scatters issued
  uint64_t bytes_gathered = 0;  // param bytes per rank moved into the unsharded buffer
  uint64_t bytes_reduced = 0;   // gradient bytes per rank entering the reduce-scatter
  // How long the compute stream waited for this unit's gathers (exposed communication); nullopt
  // where the streams' events have no timestamps (CUDA).
  std::optional<absl::Duration> exposed_wait;
};

struct StepMetrics {
  int64_t step = 0;
  uint64_t bytes_gathered = 0;
  uint64_t bytes_reduced = 0;
  // The budget and what the step used of it (host accounting, see the header comment).
  size_t budget_bytes = 0;  // 0: unlimited
  int budget_units = 0;
  uint64_t peak_inflight_bytes = 0;
  int peak_inflight_units = 0;
  int budget_overshoots = 0;    // demanded gathers issued although they did not fit
  int deferred_prefetches = 0;  // prefetches that did not fit when first due (each counted once)
  // Unsharded gradients kept across micro-batches (outside the budget), at the end of the step.
  uint64_t accumulated_grad_bytes = 0;
  // Physical peaks of the pools this step (includes size-class rounding).
  int64_t gather_pool_peak_bytes = 0;
  int64_t reduce_pool_peak_bytes = 0;
  // Order: deviations from the recorded order (0 or 1 per step).
  int order_deviations = 0;
  // Times on the compute stream's clock (nullopt without event timestamps): from the step's first
  // PreForward to the end of FinishBackward's waits; the compute stream's total wait for
  // gathers; the busy time of the communication streams' collectives; 1 - exposed/communication.
  std::optional<absl::Duration> step_time;
  std::optional<absl::Duration> exposed_communication;
  std::optional<absl::Duration> communication_time;
  std::optional<double> overlap_fraction;
  // Wall time spent inside the hooks (PreForward ... FinishBackward), and the number of calls.
  absl::Duration host_hook_time;
  int hook_calls = 0;
  std::vector<UnitStepMetrics> units;

  // A one-line summary: "step 3: gathered 12.0 MiB, reduced 12.0 MiB, peak in flight 3.0 MiB
  // / 4.0 MiB (2 units), exposed 1.2 ms of 9.8 ms, overlap 88%".
  std::string ToString() const;
};

class Scheduler {
 public:
  // Builds the mesh for options.strategy over `world` (collective over `world`: every rank calls
  // Create with the same options; blocks until `deadline`), the streams and the pools.
  // `compute` must outlive the scheduler. InvalidArgument for bad options (a negative depth, a
  // shard size that does not divide the world, an explicit order naming unknown units is checked
  // at the first step).
  static absl::StatusOr<std::unique_ptr<Scheduler>> Create(std::shared_ptr<Communicator> world,
                                                           Stream& compute,
                                                           SchedulerOptions options,
                                                           absl::Time deadline);
  // As above over a mesh made elsewhere (ProcessMesh::FromGroups; the rounds of an elastic job,
  // collectives/elastic/elastic_group.h): collective over its shard group. The mesh's world
  // carries the order check. options.shard_size is ignored; InvalidArgument if the mesh does not
  // fit options.strategy (hybrid shard fits any mesh, full shard and shard-grad-op one replica,
  // no-shard a shard group of one).
  static absl::StatusOr<std::unique_ptr<Scheduler>> Create(ProcessMesh mesh, Stream& compute,
                                                           SchedulerOptions options,
                                                           absl::Time deadline);
  // Returns every buffer to its pool after the events that guard it; waits (bounded by the
  // streams' timeouts) for the scheduler's streams to drain. Safe mid-step (see "Errors").
  ~Scheduler();

  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Registers a unit; returns its id (0, 1, ... in registration order). Every rank registers
  // the same units in the same order (checked at the end of the first step). Only before the
  // first step. InvalidArgument for an empty or duplicate name, bad tensors, or a budget below
  // the units' minimum (naming it); ResourceExhausted if the master shard cannot be allocated.
  // Returns once the master shard is initialised (zero-filled, or the framework's memory as it
  // is), so the framework may write it at once.
  absl::StatusOr<int> RegisterUnit(UnitSpec spec);
  int num_units() const { return static_cast<int>(units_.size()); }
  // The unit's FlatParameter: views during the hooks' windows, the master shard and sharded
  // gradient between steps, initial values (SetShardFromTensors) before the first step.
  FlatParameter& unit(int id) { return *units_[id].param; }
  const FlatParameter& unit(int id) const { return *units_[id].param; }
  std::optional<int> FindUnit(absl::string_view name) const;

  const ProcessMesh& mesh() const { return mesh_; }
  Stream& compute_stream() { return compute_; }
  Stream& gather_stream() { return *gather_stream_; }
  Stream& reduce_stream() { return *reduce_stream_; }
  Stream& all_reduce_stream() { return *all_reduce_stream_; }

  // --- Hooks (unit ids from RegisterUnit; InvalidArgument for an unknown id, FailedPrecondition
  // for a call out of order, e.g. PostForward without PreForward) -------------------------------
  // The unit's parameters are gathered (or were prefetched) and the compute stream waits for
  // them; afterwards unit(u).View() is valid for work enqueued on the compute stream until
  // PostForward(u). The first PreForward of a step begins the step: the gather stream waits for
  // the post-optimizer event (SetPostOptimizerEvent) or, if none was given, for the compute
  // stream's work so far. A PreForward after the forward ended (EndForward, a PreBackward, or
  // the known order complete) is an activation recomputation: it is served from the unit's
  // backward gather and is not part of the recorded order.
  absl::Status PreForward(int unit);
  // Ends the use; reshards unless the unit is kept (its reshard_after_forward is false).
  absl::Status PostForward(int unit);
  // Marks the end of the forward (the root's post-forward; FSDP2 learns it from the root
  // module). Optional: the first PreBackward ends the forward too, and so does a PreForward
  // beyond the end of a known order. Needed in the first step when the backward recomputes
  // activations (a PreForward before the first PreBackward would otherwise be recorded as a
  // forward use).
  absl::Status EndForward();
  // Gathers again if the unit was resharded; prepares the unsharded gradient (zero-filled on the
  // compute stream, or the one accumulated from earlier micro-batches); prefetches.
  absl::Status PreBackward(int unit);
  // Ends the use. After the unit's last backward use in this step (a unit used twice in forward
  // gets two), issues its reduction (in the canonical order, see "Orders") or, when gradient
  // sync is off, keeps the unsharded gradient for the next micro-batch.
  absl::Status PostBackward(int unit);
  // Ends the backward: units whose backward did not run take part with a zero gradient, the
  // remaining reductions are issued, and the compute stream waits for all of them (on a caller
  // stream: the host blocks until they are done). At the end of the first step, compares the
  // recorded orders across ranks.
  absl::Status FinishBackward();

  // --- Between steps --------------------------------------------------------------------------
  // The event after the optimizer's last write of the master shards (FSDP2's
  // set_post_optim_event): the next step's gathers wait for it instead of the compute stream.
  void SetPostOptimizerEvent(std::shared_ptr<Event> event);
  // FSDP2's set_requires_gradient_sync: false skips the reductions (the unsharded gradients
  // accumulate across micro-batches, outside the budget) until a step with true reduces them.
  void SetRequiresGradientSync(bool sync);
  // FSDP2's set_requires_all_reduce (hybrid): false reduce-scatters every micro-batch but defers
  // the replicate all-reduce; the next step with true all-reduces the accumulated sharded
  // gradient once.
  void SetRequiresAllReduce(bool all_reduce);
  // FSDP2's set_reshard_after_backward, per unit (default true). False: after the unit's last
  // backward use in a step that does not reduce (gradient sync off), its parameters stay
  // gathered (charged like a unit kept after forward) into the next step, whose forward then
  // uses them without a gather. The optimizer must not change the master shard in between (the
  // kept parameters would be stale), as in FSDP2. A step that reduces reshards as usual: the
  // reduction takes the unit back to sharded. Kept parameters are charged to the budget and
  // counted in MinimumBudgetBytes/Units while the unit's setting is false. InvalidArgument for an
  // unknown unit or, for false, a budget below the minimum with the unit kept (naming it: set the
  // budget first); FailedPrecondition during a step.
  absl::Status SetReshardAfterBackward(int unit, bool reshard);
  // Changes the budget (SchedulerOptions::budget_bytes/budget_units; 0: unlimited) between steps.
  // InvalidArgument below MinimumBudgetBytes()/MinimumBudgetUnits(), FailedPrecondition during a
  // step.
  absl::Status SetBudget(size_t bytes, int units);
  // zero_grad(): zero-fills every sharded gradient on the compute stream.
  absl::Status ZeroGrad();
  // Clips the sharded gradients by their global L2 norm (over every parameter of every unit,
  // each replica counted once): one all-reduce of the partial squares over the shard group,
  // then a scale by min(1, max_norm / (norm + 1e-6)). Returns the norm before clipping. Blocks
  // until the reductions are done (at most until `deadline`); every floating dtype. On a CUDA
  // compute stream the squares are summed by kernels on the compute stream, the all-reduce runs
  // in device memory and only the norm is copied back; the scaling is enqueued on the compute
  // stream (not waited for). With CPU offload the sharded gradients are summed and scaled on the
  // host.
  absl::StatusOr<double> ClipGradNorm(double max_norm, absl::Time deadline);

  // The metrics of the last finished step; waits (until `deadline`) for the events they are read
  // from. FailedPrecondition before the first FinishBackward.
  absl::StatusOr<StepMetrics> LastStepMetrics(absl::Time deadline);
  // Steps finished so far.
  int64_t steps() const { return step_; }
  // The recorded (or explicit) forward order; empty before the first step ends.
  const std::vector<int>& forward_order() const { return order_; }
  // The minimum budget_bytes and budget_units the registered units need so that no gather ever
  // overshoots on the known order: the units kept unsharded after forward or after backward
  // (SetReshardAfterBackward(false)), the gradients of units used more than once (they live from
  // the first backward use to the last), and the largest backward footprint. Before the order is
  // known (recorded in the first step, or explicit) units used twice are not counted.
  uint64_t MinimumBudgetBytes() const;
  int MinimumBudgetUnits() const;

  // Every gather and reduction issued so far, in issue order ("AG block3", "RS block3",
  // "AR block3"): for tests of the scheduling decisions.
  std::vector<std::string> issue_log() const;
  void ClearIssueLog() { issue_log_.clear(); }

 private:
  enum class Phase : uint8_t { kIdle, kForward, kBackward };

  struct Unit {
    std::string name;
    std::unique_ptr<FlatParameter> param;
    bool reshard_after_forward = true;
    bool reshard_after_backward = true;  // SetReshardAfterBackward
    ReduceOp reduce_op = ReduceOp::kAvg;
    uint64_t param_bytes = 0;     // unsharded parameters
    uint64_t backward_bytes = 0;  // parameters + gradient (+ its reduce_dtype copies)

    // This step.
    bool gathered = false;             // a gather issued and not resharded
    bool backward_gather = false;      // charged for its backward (parameters + gradient)
    int active = 0;                    // hook uses in progress (Pre called, Post not yet)
    int recomputing = 0;               // of which recomputations inside the backward
    BudgetCharge charge;               // what the unit holds of the budget
    int forward_uses = 0;              // PreForward calls in this step's forward
    int backward_left = 0;             // forward uses whose backward has not finished
    bool grad_ready = false;           // last backward use finished; reduction not yet issued
    bool reduced = false;              // reduction issued this step
    bool all_reduce_deferred = false;  // a micro-batch skipped the replicate all-reduce
    std::shared_ptr<Event> grad_ready_event;
    std::shared_ptr<Event> final_event;  // after the unit's last reduction step this step
    UnitStepMetrics metrics;
    using EventPair = std::pair<std::shared_ptr<Event>, std::shared_ptr<Event>>;
    std::vector<EventPair> waits;  // compute stream: before and after each wait for a gather
    std::vector<EventPair> comm;   // communication streams: around each collective
  };

  // A finished step's metrics and the events they are read from.
  struct FinishedStep {
    StepMetrics metrics;
    std::shared_ptr<Event> start;
    std::shared_ptr<Event> end;
    std::vector<std::vector<Unit::EventPair>> waits;
    std::vector<std::vector<Unit::EventPair>> comm;
    bool computed = false;
  };

  // Times a hook call for StepMetrics::host_hook_time (scheduler/internal/scheduler_internal.h).
  class HookTimer;

  Scheduler(ProcessMesh mesh, Stream& compute, SchedulerOptions options);

  absl::StatusOr<Unit*> Lookup(int unit, absl::string_view hook);
  // Annotates a hook's error with the hook, the unit and the step; an error that leaves the step
  // inconsistent across ranks (a failed stream or collective, a peer's disagreement) is kept:
  // every later hook returns it.
  absl::Status HookError(absl::string_view hook, int unit, absl::Status status);
  // A failed compute stream: kept like HookError's, whatever its code.
  absl::Status StreamError(absl::string_view hook, int unit, absl::Status status);
  // Keeps `status` (every later hook returns it) and aborts the scheduler's communicators with
  // it, so that peers blocked in their collectives fail at once. Returns it.
  absl::Status Fail(absl::Status status);
  // A failure on one of the scheduler's streams that no hook has seen yet (the framework found
  // it on its compute stream, or in a unit's view), kept like Fail's; OK when every stream is.
  absl::Status FailFromStreams();
  // Until this rank has read the order check of the step that records the forward order (an
  // all-gather on the world communicator), a peer may be blocked in it or about to issue it.
  // false when the order was given in the options (never checked).
  bool OrderCheckUnread() const {
    return !order_known_ || record_pending_check_ || order_check_pending_;
  }
  // A peer's error during a step, with whether this rank kept to the known forward order.
  absl::Status WithOrderNote(absl::Status status) const;
  absl::Status BeginStep();
  absl::Status BeginBackward();
  // Issues the gather of unit `u`, charging its forward or backward footprint. `demanded`: the
  // compute needs it now (issued even if it does not fit: an overshoot); otherwise a prefetch
  // that does not fit is not issued.
  absl::Status IssueGather(int u, bool backward, bool demanded);
  // Issues forward prefetches along the order while they fit (in order; the first that does not
  // fit stops the rest until a later hook).
  absl::Status PrefetchForward();
  // The backward gather cursor: positions <= target are demanded; up to `prefetch_depth` more
  // are prefetched while they fit.
  absl::Status AdvanceBackwardCursor(size_t target, int prefetch_depth);
  absl::Status HandleBackwardPosition(size_t pos, bool demanded, bool* issued);
  absl::Status PrepareGradAhead(Unit& unit);
  absl::Status AcquireForCompute(int u);
  bool PrefetchedAgain(int u) const;
  absl::Status ReshardUnit(int u, std::shared_ptr<Event> last_use);
  // Ends a backward without resharding (SetReshardAfterBackward(u, false), no reduction): the
  // parameters stay charged, the gradient goes outside the budget as when resharded.
  void KeepAfterBackward(Unit& unit);
  absl::Status IssueReadyReductions();
  absl::Status IssueReduction(int u);
  absl::Status StartOrderCheck();
  absl::Status CheckOrderResult();
  // Whether the unit's parameters may stay gathered outside a use: kept after forward, or after a
  // backward that does not reduce (SetReshardAfterBackward).
  static bool Kept(const Unit& unit);
  // At the end of FinishBackward: the step's metrics (read from their events by LastStepMetrics)
  // up to the step's last compute event `end`, then the hooks' host time, `timer` being
  // FinishBackward's own.
  void RecordFinishedStep(std::shared_ptr<Event> end);
  void EndStepHookTime(const HookTimer& timer);

  ProcessMesh mesh_;
  Stream& compute_;
  SchedulerOptions options_;
  std::shared_ptr<Communicator> gather_comm_;
  std::shared_ptr<Communicator> reduce_comm_;
  std::shared_ptr<Communicator> replicate_comm_;  // null unless the replicate size is > 1
  std::unique_ptr<Allocator> backing_;
  std::unique_ptr<Allocator> own_gather_pool_;
  std::unique_ptr<Allocator> own_reduce_pool_;
  std::unique_ptr<Allocator> own_offload_;
  Allocator* offload_allocator_ = nullptr;  // null unless cpu_offload
  Allocator* gather_pool_ = nullptr;
  Allocator* reduce_pool_ = nullptr;
  Allocator* shard_allocator_ = nullptr;
  std::unique_ptr<Stream> gather_stream_;
  std::unique_ptr<Stream> reduce_stream_;
  std::unique_ptr<Stream> all_reduce_stream_;
  std::unique_ptr<Stream> control_stream_;  // the cross-rank order check
  std::unique_ptr<Stream> grad_stream_;     // zero-fills of unsharded gradients, ahead of use
  std::vector<Unit> units_;

  Phase phase_ = Phase::kIdle;
  int64_t step_ = 0;
  bool sync_grads_ = true;
  bool all_reduce_ = true;
  std::shared_ptr<Event> post_optimizer_;
  absl::Status failed_;  // an error that left the step inconsistent across ranks

  // The forward order (recorded or explicit) and this step's actual sequence of uses.
  std::vector<int> order_;
  bool order_known_ = false;
  std::vector<int> step_sequence_;
  bool deviated_ = false;
  // The last deviation from the known order, for errors: its step and where ("at position 0 it
  // ran 'u1' where the order has 'u0'").
  int64_t deviation_step_ = -1;
  std::string deviation_;
  size_t forward_cursor_ = 0;  // positions of order_ before it were prefetched or skipped

  // Backward: the reverse of step_sequence_, its gather cursor, the next expected use, and the
  // reduction order.
  std::vector<int> backward_sequence_;
  size_t backward_cursor_ = 0;
  size_t backward_pos_ = 0;
  std::vector<int> reduction_order_;
  size_t reduction_cursor_ = 0;

  // The order check started at the end of the first step, read at the next hook.
  bool record_pending_check_ = false;
  bool order_check_pending_ = false;
  size_t order_capacity_ = 0;
  std::vector<int64_t> order_check_;
  Work order_check_work_;

  // The rate limiter of gathers and reductions in flight; its limits are options_.budget_*.
  InflightBudget budget_;

  StepMetrics current_;
  std::shared_ptr<Event> step_start_;
  std::optional<FinishedStep> finished_;
  absl::Duration hook_time_;
  int hook_calls_ = 0;
  double clip_scratch_ = 0;
  // Device worlds: small staging buffers for the order check's all-gather and ClipGradNorm's
  // all-reduce (collectives there take device memory), and pinned host memory to read results
  // back without a blocking copy. Made on first use; declared before their buffers.
  absl::Status EnsureStaging(const std::string& what);
  // Waits for the compute stream, then sums the squares of this rank's sharded gradients in host
  // memory (ClipGradNorm on host streams, and with CPU offload).
  absl::StatusOr<double> HostShardSquares(absl::Time deadline, const std::string& what);
  absl::StatusOr<double> ClipGradNormOnDevice(double max_norm, absl::Time deadline,
                                              const std::string& what);
  std::unique_ptr<Allocator> staging_device_;
  std::unique_ptr<Allocator> staging_pinned_;
  Buffer clip_device_;   // kSumSquaresDoubles doubles
  Buffer clip_pinned_;   // one double
  Buffer order_device_;  // the order check's records, (world size + 1) of them
  Buffer order_pinned_;
  std::shared_ptr<Event> order_check_copied_;  // the records back in order_pinned_
  // The issue log, kept compact (formatted by issue_log()): what was issued, for which unit.
  enum class Issued : uint8_t { kGather, kReduceScatter, kAllReduce, kAllReduceAccumulated };
  struct IssueEntry {
    Issued what;
    int unit;
  };
  std::vector<IssueEntry> issue_log_;
};

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_SCHEDULER_H_
