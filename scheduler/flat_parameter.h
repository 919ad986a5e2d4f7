// File: scheduler/flat_parameter.h
// -----------------------------------------------------------------------------
// FlatParameter: the memory of one unit (a layer, a block) on one rank, and the four operations
// FSDP performs on it — gather, reshard, reduce the gradient, zero the gradient — each enqueued
// on a Stream, ordered by Events, never by blocking the host.
//
// Buffers (S = layout.num_shards() = the shard group's size, r = this rank's shard index):
//   master shard     layout.shard_elements() elements of master_dtype, from shard_allocator; lives
//                    as long as the FlatParameter. Its padding is zero.
//   unsharded        layout.total_elements() elements of param_dtype, from unsharded_pool; exists
//                    only from Gather() to Reshard()/ReduceGrad() (then returned to the pool after
//                    its last reader's event). Slice r is the all-gather's in-place input: Gather
//                    casts the master shard straight into it (no extra copy, no extra buffer).
//   unsharded grad   layout.total_elements() elements of param_dtype, from unsharded_pool,
//                    zero-filled by PrepareGrad(); the framework writes (or adds) the gradient
//                    into it through GradView(). It survives Reshard(), so several backward passes
//                    can accumulate into it before one reduction (FSDP's no_sync); ReduceGrad()
//                    consumes it.
//   sharded grad     layout.shard_elements() elements of policy.sharded_grad_dtype(), from
//                    shard_allocator; created by the first ReduceGrad(), which writes it; later
//                    reductions ADD into it (gradient accumulation across micro-batches or steps)
//                    until ZeroShardGrad() or ReleaseShardGrad().
// Element offsets are the layout's: element i of every buffer is element i of the flat buffer,
// whatever the buffer's dtype. Tensor t of the unsharded buffers starts at element
// layout.tensor(t).offset.
//
// State machine (state()):
//
//   sharded --Gather()--> gathering --WaitGathered() / Acquire()--> unsharded
//   unsharded --Acquire()--> unsharded (one more user)  --Release()--> unsharded (one fewer)
//   unsharded --Reshard(last_use) / the last Release()--> sharded
//   unsharded --ReduceScatter()--> reducing --AllReduce()--> reducing --Accumulate()--> reducing
//   reducing --WaitReduced()--> sharded
//
// ReduceGrad() is ReduceScatter + AllReduce + Accumulate on one stream. Split, the hybrid
// all-reduce can run on a stream (and a communicator) of its own, and it is optional: a
// reduction that skips it adds a contribution that is not reduced across replicas.
//
// Users of the unsharded parameters. Every Acquire() (WaitGathered() is the first) counts a
// user and remembers its stream; Release(last_use) ends one use. When the count reaches zero the
// unit reshards. Reshard() ends all uses at once. The unsharded buffer goes back to the pool
// after the gather, every `last_use` given, and an event recorded on every stream that acquired
// the unit (so work already enqueued there that reads the views is covered even when no
// last_use is given). The streams given to Acquire/WaitGathered/PrepareGrad must therefore
// outlive the unit's unsharded state (until it reshards or is destroyed).
//
// Any other call order is FailedPrecondition naming the unit, the call and the current state
// ("flat parameter 'block3': View() called in state sharded (allowed: unsharded)"); the object
// is unchanged then. Nothing is undefined behaviour: every buffer is returned to its allocator
// guarded by the events of the streams that may still use it, including when the FlatParameter
// is destroyed in any state (the caller must not use views it obtained after that).
//
// Streams (each must be on the device of the allocators' memory; a host pool needs host or
// caller streams):
//   gather stream    Gather(): the cast into place and the all-gather.
//   compute stream   the framework's. WaitGathered(compute) makes it wait for the gather (the host
//                    is not blocked, except on a caller stream); the views are valid for work
//                    enqueued on it afterwards. PrepareGrad(compute) zero-fills the gradient on it.
//   reduce stream    ReduceScatter(): waits for `grad_ready`, then any cast and the
//                    reduce-scatter; AllReduce() and Accumulate() on the same or other streams
//                    (each waits for the step before it); the host is never blocked.
//
// Memory is allocated stream-ordered (Allocator::Allocate(bytes, stream)) on the stream that
// first writes it: a pool may hand out a block still read by earlier work after making that
// stream wait.
//
// Precision (MixedPrecisionPolicy): the gather casts master → param dtype; the reduction casts
// the param-dtype gradient to reduce_dtype (into a temporary from the pool when they differ;
// otherwise the reduce-scatter runs in place in the unsharded grad), reduces in reduce_dtype, and
// accumulates into the sharded grad (cast to its dtype first when it differs, through a
// shard-sized temporary). With ReduceOp::kAvg the result is the average over ALL data-parallel
// ranks: the reduce-scatter averages over the shard group, the all-reduce over the replicate
// group, and since all replicate groups have the same size, the average of averages is the
// global average. kSum gives the plain sum.
//
// Thread safety: one thread at a time may call the methods of one FlatParameter (as for a
// Communicator). The streams may run anywhere.
//
//   SL_ASSIGN_OR_RETURN(auto unit, FlatParameter::Create(layout, mesh.shard_rank(), policy,
//                                                        {.unsharded_pool = &pool,
//                                                         .shard_allocator = &host,
//                                                         .name = "block3"}));
//   SL_RETURN_IF_ERROR(unit->SetShardFromTensors(full_tensors));   // once, at init
//   // forward
//   SL_RETURN_IF_ERROR(unit->Gather(*mesh.shard(), gather).status());
//   SL_RETURN_IF_ERROR(unit->WaitGathered(compute));
//   SL_ASSIGN_OR_RETURN(TensorView w, unit->View("weight"));      // compute with w.data
//   SL_ASSIGN_OR_RETURN(auto used, RecordEvent(compute));
//   SL_RETURN_IF_ERROR(unit->Reshard(used));
//   // backward
//   ... Gather, WaitGathered as above ...
//   SL_RETURN_IF_ERROR(unit->PrepareGrad(compute));
//   SL_ASSIGN_OR_RETURN(TensorView g, unit->GradView("weight"));  // backward writes g.data
//   SL_ASSIGN_OR_RETURN(auto ready, RecordEvent(compute));
//   SL_RETURN_IF_ERROR(unit->ReduceGrad(*mesh.shard(), mesh.replicate().get(), reduce, ready)
//                          .status());
//   // end of backward
//   SL_RETURN_IF_ERROR(unit->WaitReduced(optimizer_stream));
//   SL_ASSIGN_OR_RETURN(FlatShardView grad, unit->ShardGrad());   // optimizer steps on shards

#ifndef SHARDLINE_SCHEDULER_FLAT_PARAMETER_H_
#define SHARDLINE_SCHEDULER_FLAT_PARAMETER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"
#include "runtime/allocator.h"
#include "runtime/dtype.h"
#include "runtime/flat_layout.h"
#include "runtime/stream.h"
#include "scheduler/mixed_precision.h"

namespace shardline {

enum class FlatParameterState : uint8_t { kSharded, kGathering, kUnsharded, kReducing };

// "sharded", "gathering", "unsharded", "reducing".
absl::string_view FlatParameterStateName(FlatParameterState state);

struct FlatParameterOptions {
  // The unsharded parameters, the unsharded gradient and the reduction's temporaries come from
  // here (usually a CachingPool). Required; must outlive the FlatParameter.
  Allocator* unsharded_pool = nullptr;
  // The unsharded gradient and the reduction's temporaries. Null: unsharded_pool. Same device.
  // (A scheduler keeps them apart so that a gather never reuses memory a reduction frees.)
  Allocator* grad_pool = nullptr;
  // PrepareGrad takes the unsharded gradient stream-ordered on the compute stream: it may reuse a
  // block that an earlier reduction still uses, after making the compute stream wait for it.
  // false: only blocks nothing uses any more. A scheduler that may hold a reduction back (see
  // scheduler/scheduler.h) sets false: its compute stream must never wait for a reduction, which
  // could wait for a peer whose compute waits for this rank.
  bool stream_ordered_grad = true;
  // The master shard and the sharded gradient. Null: unsharded_pool. Must be on the same device
  // as unsharded_pool and outlive the FlatParameter.
  Allocator* shard_allocator = nullptr;
  // CPU offload: the master shard and the sharded gradient live here (host memory; pinned on a
  // GPU machine, so that copies are asynchronous and device kernels can reach it), replacing
  // shard_allocator; the unsharded buffers stay in the pools (the device). Gather copies the
  // master shard into a shard-sized staging buffer from unsharded_pool on the gather stream and
  // casts into place from there; Accumulate copies the reduced shard back into a host buffer on
  // its stream and adds it into the sharded gradient there. Must be on the host and outlive the
  // FlatParameter. (On a GPU-less machine the pools are host memory too, and the copies are
  // memcpys: they still run.)
  Allocator* offload_allocator = nullptr;
  // Shown in errors and logs ("block3").
  std::string name = "unit";
  // The framework's own memory for the master shard (Buffer::Adopt or Buffer::View):
  // layout.shard_elements() elements of master_dtype, laid out as the layout's shard, on the
  // pool's device, holding the parameters' values (not zeroed). Empty: allocated from
  // shard_allocator and zero-filled.
  Buffer master_shard;
  // The stream that zero-fills a master shard from shard_allocator (nothing else runs on it);
  // the first Gather waits for it. Null: a temporary stream of the device, synchronized before
  // Create returns.
  Stream* init_stream = nullptr;
};

// One tensor of an unsharded buffer, for the host framework. `data` is null for a tensor of no
// elements or a buffer of none. Ties (TensorSpec::tied_to) alias their target's elements.
struct TensorView {
  void* data = nullptr;
  absl::string_view name;           // the layout's spec name (lives as long as the FlatParameter)
  absl::Span<const int64_t> shape;  // the layout's spec shape
  DType dtype = DType::kF32;        // the buffer's dtype (param dtype), not the spec's dtype
  size_t numel = 0;
};

// A shard-sized buffer (master shard, sharded gradient): layout.shard_elements() elements of
// `dtype`, laid out as the layout's shard `shard` (use layout.ShardSlices(shard) for per-tensor
// access). `data` is null when the shard has no elements.
struct FlatShardView {
  void* data = nullptr;
  size_t elements = 0;
  DType dtype = DType::kF32;
  int shard = 0;
};

struct GatherOptions {
  // If set, the gather stream waits for it before reading the master shard (e.g. the event after
  // the optimizer step that updated it on another stream).
  std::shared_ptr<Event> shard_ready;
  CollectiveOptions collective;
  // If set, receives an event recorded on the gather stream right before the all-gather (after
  // the waits and any cast into place): with the Work's event, the collective's own duration.
  std::shared_ptr<Event>* collective_start = nullptr;
};

struct ReduceGradOptions {
  // kAvg: the average over every data-parallel rank (shard group x replicate group); kSum: the
  // sum. Anything else is InvalidArgument.
  ReduceOp op = ReduceOp::kAvg;
  CollectiveOptions collective;
  // ReduceScatter only. If set, receives an event recorded on the stream right before the
  // reduce-scatter (after the wait for the gradient and the cast).
  std::shared_ptr<Event>* collective_start = nullptr;
};

class FlatParameter {
 public:
  // Creates the unit in state `sharded` with a zero master shard. InvalidArgument if the policy
  // is invalid (MixedPrecisionPolicy::Validate), layout.element_dtype() != policy.master_dtype,
  // a tensor's spec dtype is not floating (its values are cast), shard_rank is outside
  // [0, layout.num_shards()), unsharded_pool is null, or the allocators are on different devices.
  // ResourceExhausted (from the allocator) if the master shard cannot be allocated.
  static absl::StatusOr<std::unique_ptr<FlatParameter>> Create(FlatLayout layout, int shard_rank,
                                                               const MixedPrecisionPolicy& policy,
                                                               FlatParameterOptions options);

  FlatParameter(const FlatParameter&) = delete;
  FlatParameter& operator=(const FlatParameter&) = delete;
  // Returns every buffer to its allocator, guarded by the last events of the streams that used
  // it (the allocator frees it once they completed). Does not block.
  ~FlatParameter();

  const std::string& name() const { return name_; }
  const FlatLayout& layout() const { return layout_; }
  const MixedPrecisionPolicy& policy() const { return policy_; }
  int shard_rank() const { return shard_rank_; }
  FlatParameterState state() const { return state_; }

  // --- Initialisation -----------------------------------------------------------------------
  // Fills the master shard from the full tensors: tensors[t] points at layout.tensor(t).numel
  // elements of the spec's dtype (row-major); this rank's intersection of every tensor is cast
  // into the shard, padding is zeroed. Entries of ties and of empty tensors are ignored (may be
  // null). Blocks until earlier gathers have finished reading the shard (at most until
  // `deadline`), then copies on the calling thread (through a host staging copy for device
  // memory, copied by a stream of the device that this call synchronizes). State sharded;
  // InvalidArgument if tensors.size() != layout.num_tensors() or a needed pointer is null.
  absl::Status SetShardFromTensors(absl::Span<const void* const> tensors, absl::Time deadline);
  // The same, bounded by SHARDLINE_TIMEOUT_S.
  absl::Status SetShardFromTensors(absl::Span<const void* const> tensors);

  // The master shard. Written by the optimizer in state sharded, ordered before the next
  // Gather (GatherOptions::shard_ready when it runs on another stream). Any state.
  FlatShardView master_shard() const;
  // Where the master shard lives (the host under CPU offload).
  Device master_device() const { return master_.device(); }

  // --- Parameters ---------------------------------------------------------------------------
  // sharded → gathering. Takes the unsharded buffer from the pool and enqueues on
  // `gather_stream`: (wait for options.shard_ready,) the cast of the master shard into slice r,
  // and the in-place all-gather over `shard_comm`. Returns the all-gather's Work. InvalidArgument
  // if shard_comm's size is not layout.num_shards() or its rank is not shard_rank(), or the
  // stream is on another device than the pool. On any error the unit stays sharded.
  absl::StatusOr<Work> Gather(Communicator& shard_comm, Stream& gather_stream,
                              const GatherOptions& options = {});
  // gathering → unsharded: the first Acquire(compute). Makes `compute` wait for the gather (on a
  // caller stream: blocks until it finished). If the gather failed, returns its error and the
  // unit goes back to sharded.
  absl::Status WaitGathered(Stream& compute);
  // One more user of the unsharded parameters, whose work is enqueued on `compute` (e.g. a unit
  // whose weights are used twice in one forward). State gathering (then as WaitGathered) or
  // unsharded (then `compute` waits for the gather, unless it already did).
  absl::Status Acquire(Stream& compute);
  // true if the latest gather has completed successfully (its event reports done and OK), so an
  // Acquire() now makes the stream wait for nothing; false while it runs, if it failed, or if no
  // gather was issued. Never blocks.
  bool GatherCompleted() const;
  // Ends one use: `last_use` (may be null) is the event after the last work of that use that
  // reads the views. Reshards when it was the last use. State unsharded.
  absl::Status Release(std::shared_ptr<Event> last_use);
  // The number of uses not yet released (0 unless unsharded).
  int users() const { return users_; }

  // The unsharded parameters (state unsharded). By index or by name (NotFound for an unknown
  // name); InvalidArgument for an index out of range.
  absl::StatusOr<TensorView> View(int tensor) const;
  absl::StatusOr<TensorView> View(absl::string_view tensor_name) const;

  // unsharded → sharded, ending every use. The unsharded buffer goes back to the pool once
  // `last_use` (may be null), the gather, and everything enqueued so far on the streams that
  // acquired the unit completed. Never blocks. The unsharded gradient, if any, is kept
  // (gradient accumulation).
  absl::Status Reshard(std::shared_ptr<Event> last_use);

  // --- Gradients ----------------------------------------------------------------------------
  // State gathering or unsharded. If this step has no unsharded gradient yet, takes one from the
  // pool and enqueues its zero-fill on `compute`; otherwise makes `compute` wait for that
  // zero-fill (once per stream; the framework adds into the gradient). So a scheduler can
  // zero-fill ahead, on a side stream, while the gather is in flight, and call it again with the
  // compute stream when the backward starts.
  absl::Status PrepareGrad(Stream& compute);
  bool has_unsharded_grad() const { return unsharded_grad_live_; }
  // A tensor of the unsharded gradient (param dtype), for work on the compute stream after
  // PrepareGrad. State unsharded and PrepareGrad called, else FailedPrecondition.
  absl::StatusOr<TensorView> GradView(int tensor) const;
  absl::StatusOr<TensorView> GradView(absl::string_view tensor_name) const;

  // unsharded → reducing: the post-backward of FSDP, step 1. Requires an unsharded gradient.
  // Enqueues on `stream`: a wait for `grad_ready` (the event after the backward that wrote the
  // gradient; null if it is complete already), the cast to reduce_dtype (if it differs from
  // param_dtype) and the reduce-scatter over `shard_comm`: in place, or, where the sharded
  // gradient was zeroed (ZeroShardGrad) since its last reduction and is in the reduce dtype on
  // this device, straight into the sharded gradient (after its last users; Accumulate then
  // copies nothing; an error after that leaves it undefined, as below). Also reshards the
  // parameters: the unsharded buffer goes back to the pool after `grad_ready` (the backward is
  // its last reader) and the acquiring streams' work so far. Returns the event after the
  // reduce-scatter. InvalidArgument for a mismatched communicator, another device or an op other
  // than sum/avg; on any error before the collective the unit stays unsharded.
  absl::StatusOr<std::shared_ptr<Event>> ReduceScatter(Communicator& shard_comm, Stream& stream,
                                                       std::shared_ptr<Event> grad_ready,
                                                       const ReduceGradOptions& options = {});
  // Step 2 (optional; hybrid sharding): the all-reduce of the reduced shard over
  // `replicate_comm` (null or size 1: nothing to do, returns the previous step's event),
  // enqueued on `stream` after the reduce-scatter. State reducing, after ReduceScatter and
  // before Accumulate. Returns the event after the all-reduce.
  absl::StatusOr<std::shared_ptr<Event>> AllReduce(Communicator* replicate_comm, Stream& stream,
                                                   const ReduceGradOptions& options = {});
  // Step 3: adds (or, on the first reduction after creation, ZeroShardGrad or
  // ReleaseShardGrad: writes) the reduced shard into the sharded gradient, on `stream` after the
  // previous step and the previous reduction. The unsharded gradient and the temporaries go back
  // to the pool after it. Returns the event after it; WaitReduced() waits for it. The
  // optimizer's last use of the sharded gradient must be ordered before `grad_ready` (it is when
  // the optimizer runs on the compute stream).
  absl::StatusOr<std::shared_ptr<Event>> Accumulate(Stream& stream);
  // The three steps on one stream. Returns the event after the accumulation. On an error after
  // the reduce-scatter was issued the unit goes back to sharded (the error is returned).
  absl::StatusOr<std::shared_ptr<Event>> ReduceGrad(Communicator& shard_comm,
                                                    Communicator* replicate_comm,
                                                    Stream& reduce_stream,
                                                    std::shared_ptr<Event> grad_ready,
                                                    const ReduceGradOptions& options = {});
  // reducing → sharded. The first makes `stream` wait for the reduction (host not blocked, except
  // on a caller stream); the second blocks the calling thread until it finished or `deadline`
  // (DeadlineExceeded: the unit stays reducing). If the reduction failed, returns its error; the
  // unit goes back to sharded and its sharded gradient is undefined.
  absl::Status WaitReduced(Stream& stream);
  absl::Status WaitReduced(absl::Time deadline);

  // The sharded gradient (policy.sharded_grad_dtype()). State sharded, or unsharded/gathering
  // (the gradient of the previous reduction); FailedPrecondition in state reducing or if there is
  // none (no reduction since creation or ReleaseShardGrad).
  absl::StatusOr<FlatShardView> ShardGrad() const;
  bool has_shard_grad() const { return shard_grad_live_; }
  // Zero-fills the sharded gradient on `stream` (after the last reduction): the optimizer's
  // zero_grad(). No-op if there is none. FailedPrecondition in state reducing.
  absl::Status ZeroShardGrad(Stream& stream);
  // Returns the sharded gradient to its allocator after `last_use` (zero_grad(set_to_none)); the
  // next reduction creates a new one. FailedPrecondition in state reducing.
  absl::Status ReleaseShardGrad(std::shared_ptr<Event> last_use);

 private:
  FlatParameter(FlatLayout layout, int shard_rank, const MixedPrecisionPolicy& policy,
                FlatParameterOptions options);

  // FailedPrecondition naming the unit, `call`, the state and `allowed`.
  absl::Status WrongState(absl::string_view call, absl::string_view allowed) const;
  absl::Status CheckShardComm(absl::string_view call, const Communicator& comm) const;
  absl::Status CheckStreamDevice(absl::string_view call, const Stream& stream) const;
  absl::StatusOr<int> ResolveTensor(absl::string_view call, int tensor) const;
  absl::StatusOr<int> ResolveTensor(absl::string_view call, absl::string_view name) const;
  TensorView MakeView(const Buffer& buffer, int tensor) const;
  // Returns the unsharded buffer to the pool after `last_use`, the uses released so far, the
  // gather and the acquiring streams' work so far; forgets the users.
  void ReleaseUnsharded(std::shared_ptr<Event> last_use);
  // Makes `stream` wait for the gather (once per stream) and remembers it as a consumer.
  absl::Status AddConsumer(Stream& stream, absl::string_view call);
  // Events recorded now on every consumer stream (nothing for a poisoned one: it runs no more).
  // Inline: a unit has one or two consumer streams, and ReduceScatter adds two events.
  using EventList = absl::InlinedVector<std::shared_ptr<Event>, 4>;
  static EventList RecordOnConsumers(const std::vector<Stream*>& streams);
  // Returns the unsharded gradient and its reduce-dtype copy after the events that cover their
  // users (the reduction's last step, the backward, the zero-fill).
  void ReleaseReductionInputs();
  // Ends a failed reduction: the inputs go back, the unit is sharded again.
  absl::Status AbortReduction(absl::Status error);

  FlatLayout layout_;
  int shard_rank_;
  MixedPrecisionPolicy policy_;
  Allocator* pool_;
  Allocator* grad_pool_;
  bool stream_ordered_grad_;
  bool offload_;
  Allocator* shard_allocator_;
  std::string name_;
  FlatParameterState state_ = FlatParameterState::kSharded;

  Buffer master_;                        // shard_elements x master_dtype
  std::shared_ptr<Event> master_ready_;  // after the master shard's zero-fill on init_stream
  Buffer unsharded_;                     // total_elements x param_dtype, gathering/unsharded only
  Buffer unsharded_grad_;  // total_elements x param_dtype, from PrepareGrad to ReduceGrad
  Buffer shard_grad_;      // shard_elements x sharded_grad_dtype
  // A zero-element layout gets empty (zero-byte) buffers; these say whether they "exist".
  bool unsharded_grad_live_ = false;
  bool shard_grad_live_ = false;
  // True once a reduction wrote the sharded gradient (later ones add into it).
  bool shard_grad_written_ = false;

  Work gather_work_;  // the last gather (its event: the last reader of the master shard, last
                      // writer of unsharded_)
  int users_ = 0;     // Acquire()s not yet released
  std::vector<Stream*> consumers_;                // streams that acquired the unit this time
  std::vector<std::shared_ptr<Event>> released_;  // last_use events of released uses
  std::vector<Stream*> grad_consumers_;           // streams that prepared the gradient

  // The reduction in progress (state reducing).
  enum class ReducePhase : uint8_t { kScattered, kAllReduced, kAccumulated };
  ReducePhase reduce_phase_ = ReducePhase::kAccumulated;
  ReduceGradOptions reduce_options_;
  Buffer reduce_input_;  // the gradient in reduce_dtype, if not param_dtype
  // This rank's reduced shard (in reduce_dtype): a slice of the reduction's input, or the sharded
  // gradient itself where the reduce-scatter wrote it directly.
  void* reduced_slice_ = nullptr;
  std::shared_ptr<Event> reduce_step_;          // after the last step enqueued
  std::shared_ptr<Event> grad_ready_;           // the backward's event given to ReduceScatter
  std::shared_ptr<Event> grad_zeroed_;          // after PrepareGrad's zero-fill
  std::shared_ptr<Event> reduce_done_;          // after the last reduction's accumulation
  std::shared_ptr<Event> shard_grad_last_use_;  // after the last ZeroShardGrad
};

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_FLAT_PARAMETER_H_
