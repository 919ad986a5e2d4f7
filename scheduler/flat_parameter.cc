#include "scheduler/flat_parameter.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/host_kernels.h"
#include "runtime/status.h"

#if SHARDLINE_WITH_CUDA
#include <cuda_runtime.h>

#include "runtime/cuda/cuda_kernels.h"
#endif

namespace shardline {
namespace {

// Element `index` of a buffer of `esize`-byte elements; null for a buffer of no bytes (pointer
// arithmetic on null is undefined).
void* ElementAt(void* base, size_t index, size_t esize) {
  return base == nullptr ? nullptr : static_cast<char*>(base) + index * esize;
}

// The device-generic kernels the unit needs, enqueued on a stream: host work on host and caller
// streams, CUDA kernels on CUDA streams. An error means nothing was enqueued.
absl::Status EnqueueCast(Stream& stream, const void* src, DType src_dtype, void* dst,
                         DType dst_dtype, size_t count) {
  if (count == 0) return absl::OkStatus();
#if SHARDLINE_WITH_CUDA
  if (stream.device().is_cuda()) {
    return CudaCast(src, src_dtype, dst, dst_dtype, count, stream.native_handle());
  }
#endif
  return stream.Enqueue([=]() { return Cast(src, src_dtype, dst, dst_dtype, count); });
}

absl::Status EnqueueAccumulate(Stream& stream, void* inout, const void* in, size_t count,
                               DType dtype) {
  if (count == 0) return absl::OkStatus();
#if SHARDLINE_WITH_CUDA
  if (stream.device().is_cuda()) {
    return CudaReduce(inout, in, count, dtype, ReduceOp::kSum, stream.native_handle());
  }
#endif
  return stream.Enqueue([=]() { return Reduce(inout, in, count, dtype, ReduceOp::kSum); });
}

absl::Status EnqueueZero(Stream& stream, void* data, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
#if SHARDLINE_WITH_CUDA
  if (stream.device().is_cuda()) {
    const cudaError_t err =
        cudaMemsetAsync(data, 0, bytes, static_cast<cudaStream_t>(stream.native_handle()));
    if (err != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat("cudaMemsetAsync of ", bytes, " bytes failed: ", cudaGetErrorString(err)));
    }
    return absl::OkStatus();
  }
#endif
  return stream.Enqueue([=]() {
    std::memset(data, 0, bytes);
    return absl::OkStatus();
  });
}

// Copies `bytes` of host memory into a buffer of `device` (host: memcpy; CUDA: a synchronous
// cudaMemcpy, which is how initialisation is allowed to block).
absl::Status CopyFromHost(void* dst, Device device, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (device.is_host()) {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
#if SHARDLINE_WITH_CUDA
  const cudaError_t err = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cudaMemcpy of ", bytes, " bytes failed: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
#else
  return absl::UnimplementedError(
      absl::StrCat("memory on ", device.ToString(), " needs a CUDA build of shardline"));
#endif
}

}  // namespace

absl::string_view FlatParameterStateName(FlatParameterState state) {
  switch (state) {
    case FlatParameterState::kSharded:
      return "sharded";
    case FlatParameterState::kGathering:
      return "gathering";
    case FlatParameterState::kUnsharded:
      return "unsharded";
    case FlatParameterState::kReducing:
      return "reducing";
  }
  return "invalid";
}

// ---- Creation ------------------------------------------------------------------------------

FlatParameter::FlatParameter(FlatLayout layout, int shard_rank, const MixedPrecisionPolicy& policy,
                             FlatParameterOptions options)
    : layout_(std::move(layout)),
      shard_rank_(shard_rank),
      policy_(policy),
      pool_(options.unsharded_pool),
      shard_allocator_(options.shard_allocator),
      name_(std::move(options.name)) {}

absl::StatusOr<std::unique_ptr<FlatParameter>> FlatParameter::Create(
    FlatLayout layout, int shard_rank, const MixedPrecisionPolicy& policy,
    FlatParameterOptions options) {
  const std::string what = absl::StrCat("flat parameter '", options.name, "'");
  SL_RETURN_IF_ERROR(Annotate(policy.Validate(), what));
  if (layout.element_dtype() != policy.master_dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the layout's element dtype is ", DTypeName(layout.element_dtype()),
                     " but the policy's master_dtype is ", DTypeName(policy.master_dtype),
                     " (the layout describes the master shard)"));
  }
  for (int t = 0; t < layout.num_tensors(); ++t) {
    const TensorSpec& spec = layout.tensor(t).spec;
    if (!IsFloatingPoint(spec.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": tensor ", t, " '", spec.name, "' has dtype ", DTypeName(spec.dtype),
                       "; a flat parameter holds floating tensors only (f32, f64, f16, bf16)"));
    }
  }
  if (shard_rank < 0 || shard_rank >= layout.num_shards()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": shard_rank ", shard_rank,
                                                   " is outside [0, ", layout.num_shards(),
                                                   ") (the layout's shards)"));
  }
  if (options.unsharded_pool == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": unsharded_pool is null"));
  }
  if (options.shard_allocator == nullptr) options.shard_allocator = options.unsharded_pool;
  if (options.shard_allocator->device() != options.unsharded_pool->device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": shard_allocator '", options.shard_allocator->name(), "' is on ",
        options.shard_allocator->device().ToString(), " but unsharded_pool '",
        options.unsharded_pool->name(), "' is on ", options.unsharded_pool->device().ToString()));
  }

  std::unique_ptr<FlatParameter> unit(
      new FlatParameter(std::move(layout), shard_rank, policy, std::move(options)));
  const size_t bytes = unit->layout_.shard_elements() * DTypeSize(policy.master_dtype);
  absl::StatusOr<Buffer> master = unit->shard_allocator_->Allocate(bytes);
  if (!master.ok()) return Annotate(master.status(), absl::StrCat(what, ": master shard"));
  unit->master_ = *std::move(master);
  const std::vector<uint8_t> zeros(bytes);
  SL_RETURN_IF_ERROR(Annotate(
      CopyFromHost(unit->master_.data(), unit->shard_allocator_->device(), zeros.data(), bytes),
      absl::StrCat(what, ": zero-filling the master shard")));
  return unit;
}

FlatParameter::~FlatParameter() {
  // Readers we know of: the last gather reads the master shard and writes the unsharded buffer
  // (every gather waits for the one before), PrepareGrad's zero-fill writes the gradient, the
  // last reduction and zero-fill write the sharded gradient. Buffers release themselves after.
  const std::shared_ptr<Event>& gathered = gather_work_.event();
  master_.ReleaseAfter(gathered);
  unsharded_.ReleaseAfter(gathered);
  unsharded_grad_.ReleaseAfter(grad_zeroed_);
  shard_grad_.ReleaseAfter(reduce_done_);
  shard_grad_.ReleaseAfter(shard_grad_last_use_);
}

// ---- Checks --------------------------------------------------------------------------------

absl::Status FlatParameter::WrongState(absl::string_view call, absl::string_view allowed) const {
  return absl::FailedPreconditionError(
      absl::StrCat("flat parameter '", name_, "': ", call, " called in state ",
                   FlatParameterStateName(state_), " (allowed: ", allowed, ")"));
}

absl::Status FlatParameter::CheckShardComm(absl::string_view call, const Communicator& comm) const {
  auto invalid = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("flat parameter '", name_, "': ", call,
                                                   ": shard communicator '", comm.name(), "' ",
                                                   parts...));
  };
  if (comm.size() != layout_.num_shards()) {
    return invalid("has ", comm.size(), " ranks but the layout has ", layout_.num_shards(),
                   " shards");
  }
  if (comm.rank() != shard_rank_) {
    return invalid("gives this process rank ", comm.rank(), " but the unit holds shard ",
                   shard_rank_);
  }
  if (comm.device() != pool_->device()) {
    return invalid("moves memory on ", comm.device().ToString(), " but the unit's buffers are on ",
                   pool_->device().ToString());
  }
  return absl::OkStatus();
}

absl::Status FlatParameter::CheckStreamDevice(absl::string_view call, const Stream& stream) const {
  if (stream.device() == pool_->device()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "flat parameter '", name_, "': ", call, ": stream '", stream.name(), "' is on ",
      stream.device().ToString(), " but the unit's buffers are on ", pool_->device().ToString()));
}

absl::StatusOr<int> FlatParameter::ResolveTensor(absl::string_view call, int tensor) const {
  if (tensor < 0 || tensor >= layout_.num_tensors()) {
    return absl::InvalidArgumentError(absl::StrCat("flat parameter '", name_, "': ", call,
                                                   ": tensor index ", tensor, " is outside [0, ",
                                                   layout_.num_tensors(), ")"));
  }
  return tensor;
}

absl::StatusOr<int> FlatParameter::ResolveTensor(absl::string_view call,
                                                 absl::string_view name) const {
  std::optional<int> index = layout_.FindTensor(name);
  if (!index.has_value()) {
    return absl::NotFoundError(
        absl::StrCat("flat parameter '", name_, "': ", call, ": no tensor named '", name, "'"));
  }
  return *index;
}

TensorView FlatParameter::MakeView(const Buffer& buffer, int tensor) const {
  const FlatTensor& t = layout_.tensor(tensor);
  TensorView view;
  view.data =
      t.numel == 0 ? nullptr : ElementAt(buffer.data(), t.offset, DTypeSize(policy_.param_dtype));
  view.name = t.spec.name;
  view.shape = t.spec.shape;
  view.dtype = policy_.param_dtype;
  view.numel = t.numel;
  return view;
}

// ---- Initialisation --------------------------------------------------------------------------

absl::Status FlatParameter::SetShardFromTensors(absl::Span<const void* const> tensors,
                                                absl::Time deadline) {
  constexpr absl::string_view kCall = "SetShardFromTensors()";
  if (state_ != FlatParameterState::kSharded) return WrongState(kCall, "sharded");
  if (tensors.size() != static_cast<size_t>(layout_.num_tensors())) {
    return absl::InvalidArgumentError(
        absl::StrCat("flat parameter '", name_, "': ", kCall, ": got ", tensors.size(),
                     " tensor pointers for a layout of ", layout_.num_tensors(), " tensors"));
  }
  const absl::Span<const ShardSlice> slices = layout_.ShardSlices(shard_rank_);
  for (const ShardSlice& slice : slices) {
    if (tensors[slice.tensor] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("flat parameter '", name_, "': ", kCall, ": tensor ", slice.tensor, " '",
                       layout_.tensor(slice.tensor).spec.name, "' has elements in shard ",
                       shard_rank_, " but its pointer is null"));
    }
  }
  // The last gather may still be casting the shard (a failed one reads nothing any more).
  if (const std::shared_ptr<Event>& gathered = gather_work_.event(); gathered != nullptr) {
    absl::Status done = gathered->Synchronize(deadline);
    if (absl::IsDeadlineExceeded(done)) {
      return Annotate(done, absl::StrCat("flat parameter '", name_, "': ", kCall,
                                         ": waiting for the last gather to finish"));
    }
  }

  const DType master = policy_.master_dtype;
  const size_t msize = DTypeSize(master);
  const size_t bytes = master_.size();
  std::vector<uint8_t> staging;
  uint8_t* shard = static_cast<uint8_t*>(master_.data());
  if (!shard_allocator_->device().is_host()) {
    staging.resize(bytes);
    shard = staging.data();
  }
  if (bytes > 0) std::memset(shard, 0, bytes);
  for (const ShardSlice& slice : slices) {
    const TensorSpec& spec = layout_.tensor(slice.tensor).spec;
    const auto* src = static_cast<const uint8_t*>(tensors[slice.tensor]) +
                      slice.tensor_offset * DTypeSize(spec.dtype);
    SL_RETURN_IF_ERROR(Annotate(
        Cast(src, spec.dtype, shard + slice.shard_offset * msize, master, slice.length),
        absl::StrCat("flat parameter '", name_, "': ", kCall, ": tensor '", spec.name, "'")));
  }
  if (!staging.empty()) {
    SL_RETURN_IF_ERROR(
        Annotate(CopyFromHost(master_.data(), shard_allocator_->device(), staging.data(), bytes),
                 absl::StrCat("flat parameter '", name_, "': ", kCall)));
  }
  return absl::OkStatus();
}

FlatShardView FlatParameter::master_shard() const {
  return FlatShardView{master_.data(), layout_.shard_elements(), policy_.master_dtype, shard_rank_};
}

// ---- Parameters ------------------------------------------------------------------------------

absl::StatusOr<Work> FlatParameter::Gather(Communicator& shard_comm, Stream& gather_stream,
                                           const GatherOptions& options) {
  constexpr absl::string_view kCall = "Gather()";
  if (state_ != FlatParameterState::kSharded) return WrongState(kCall, "sharded");
  SL_RETURN_IF_ERROR(CheckShardComm(kCall, shard_comm));
  SL_RETURN_IF_ERROR(CheckStreamDevice(kCall, gather_stream));
  const std::string context = absl::StrCat("flat parameter '", name_, "': ", kCall);

  const DType param = policy_.param_dtype;
  const size_t psize = DTypeSize(param);
  const size_t count = layout_.shard_elements();
  absl::StatusOr<Buffer> buffer = pool_->Allocate(layout_.total_elements() * psize);
  if (!buffer.ok()) return Annotate(buffer.status(), context);
  void* slice = ElementAt(buffer->data(), layout_.ShardBegin(shard_rank_), psize);

  // Waits enqueue no reader of the new buffer: on failure it goes back unguarded.
  if (options.shard_ready != nullptr) {
    SL_RETURN_IF_ERROR(Annotate(gather_stream.WaitEvent(*options.shard_ready), context));
  }
  // Gathers of one unit run one after the other, so the last one's event covers every earlier
  // reader of the master shard and writer of an unsharded buffer.
  if (gather_work_.event() != nullptr) {
    SL_RETURN_IF_ERROR(Annotate(gather_stream.WaitEvent(*gather_work_.event()), context));
  }
  SL_RETURN_IF_ERROR(Annotate(
      EnqueueCast(gather_stream, master_.data(), policy_.master_dtype, slice, param, count),
      context));
  absl::StatusOr<Work> work =
      shard_comm.AllGather(slice, buffer->data(), count, param, gather_stream, options.collective);
  if (!work.ok()) {
    // The cast may still be queued: the buffer goes back after it. If no event can be recorded,
    // the stream is poisoned and runs nothing more, so nothing reads the buffer.
    absl::StatusOr<std::shared_ptr<Event>> cast_done = RecordEvent(gather_stream);
    if (cast_done.ok()) buffer->ReleaseAfter(*cast_done);
    return Annotate(work.status(), context);
  }
  unsharded_ = *std::move(buffer);
  gather_work_ = *work;
  state_ = FlatParameterState::kGathering;
  return *work;
}

absl::Status FlatParameter::WaitGathered(Stream& compute) {
  if (state_ != FlatParameterState::kGathering) return WrongState("WaitGathered()", "gathering");
  absl::Status status = gather_work_.Synchronize(compute);
  if (!status.ok()) {
    ReleaseUnsharded(nullptr);
    state_ = FlatParameterState::kSharded;
    return Annotate(status, absl::StrCat("flat parameter '", name_, "': WaitGathered()"));
  }
  state_ = FlatParameterState::kUnsharded;
  return absl::OkStatus();
}

absl::StatusOr<TensorView> FlatParameter::View(int tensor) const {
  if (state_ != FlatParameterState::kUnsharded) return WrongState("View()", "unsharded");
  SL_ASSIGN_OR_RETURN(int t, ResolveTensor("View()", tensor));
  return MakeView(unsharded_, t);
}

absl::StatusOr<TensorView> FlatParameter::View(absl::string_view tensor_name) const {
  if (state_ != FlatParameterState::kUnsharded) return WrongState("View()", "unsharded");
  SL_ASSIGN_OR_RETURN(int t, ResolveTensor("View()", tensor_name));
  return MakeView(unsharded_, t);
}

void FlatParameter::ReleaseUnsharded(std::shared_ptr<Event> last_use) {
  unsharded_.ReleaseAfter(std::move(last_use));
  unsharded_.ReleaseAfter(gather_work_.event());
  unsharded_.Reset();
}

absl::Status FlatParameter::Reshard(std::shared_ptr<Event> last_use) {
  if (state_ != FlatParameterState::kUnsharded) return WrongState("Reshard()", "unsharded");
  ReleaseUnsharded(std::move(last_use));
  state_ = FlatParameterState::kSharded;
  return absl::OkStatus();
}

// ---- Gradients -------------------------------------------------------------------------------

absl::Status FlatParameter::PrepareGrad(Stream& compute) {
  constexpr absl::string_view kCall = "PrepareGrad()";
  if (state_ != FlatParameterState::kUnsharded) return WrongState(kCall, "unsharded");
  if (unsharded_grad_live_) return absl::OkStatus();
  SL_RETURN_IF_ERROR(CheckStreamDevice(kCall, compute));
  const std::string context = absl::StrCat("flat parameter '", name_, "': ", kCall);
  const size_t bytes = layout_.total_elements() * DTypeSize(policy_.param_dtype);
  absl::StatusOr<Buffer> grad = pool_->Allocate(bytes);
  if (!grad.ok()) return Annotate(grad.status(), context);
  SL_RETURN_IF_ERROR(Annotate(EnqueueZero(compute, grad->data(), bytes), context));
  // If no event can be recorded the stream is poisoned: the zero-fill will not run.
  absl::StatusOr<std::shared_ptr<Event>> zeroed = RecordEvent(compute);
  if (!zeroed.ok()) return Annotate(zeroed.status(), context);
  grad_zeroed_ = *std::move(zeroed);
  unsharded_grad_ = *std::move(grad);
  unsharded_grad_live_ = true;
  return absl::OkStatus();
}

absl::StatusOr<TensorView> FlatParameter::GradView(int tensor) const {
  if (state_ != FlatParameterState::kUnsharded) return WrongState("GradView()", "unsharded");
  if (!unsharded_grad_live_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "flat parameter '", name_, "': GradView() before PrepareGrad(): no unsharded gradient"));
  }
  SL_ASSIGN_OR_RETURN(int t, ResolveTensor("GradView()", tensor));
  return MakeView(unsharded_grad_, t);
}

absl::StatusOr<TensorView> FlatParameter::GradView(absl::string_view tensor_name) const {
  if (state_ != FlatParameterState::kUnsharded) return WrongState("GradView()", "unsharded");
  SL_ASSIGN_OR_RETURN(int t, ResolveTensor("GradView()", tensor_name));
  return GradView(t);
}

absl::StatusOr<std::shared_ptr<Event>> FlatParameter::ReduceGrad(Communicator& shard_comm,
                                                                 Communicator* replicate_comm,
                                                                 Stream& reduce_stream,
                                                                 std::shared_ptr<Event> grad_ready,
                                                                 const ReduceGradOptions& options) {
  constexpr absl::string_view kCall = "ReduceGrad()";
  if (state_ != FlatParameterState::kUnsharded) return WrongState(kCall, "unsharded");
  const std::string context = absl::StrCat("flat parameter '", name_, "': ", kCall);
  if (!unsharded_grad_live_) {
    return absl::FailedPreconditionError(absl::StrCat(
        context, ": no unsharded gradient (call PrepareGrad() and write the gradient first)"));
  }
  if (options.op != ReduceOp::kSum && options.op != ReduceOp::kAvg) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": op ", ReduceOpName(options.op), " is not sum or avg"));
  }
  SL_RETURN_IF_ERROR(CheckShardComm(kCall, shard_comm));
  if (replicate_comm != nullptr && replicate_comm->device() != pool_->device()) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": replicate communicator '", replicate_comm->name(),
                     "' moves memory on ", replicate_comm->device().ToString(),
                     " but the unit's buffers are on ", pool_->device().ToString()));
  }
  SL_RETURN_IF_ERROR(CheckStreamDevice(kCall, reduce_stream));

  const DType param = policy_.param_dtype;
  const DType reduce = policy_.reduce_dtype;
  const DType grad_dtype = policy_.sharded_grad_dtype();
  const size_t count = layout_.shard_elements();
  const size_t total = layout_.total_elements();

  // Everything is allocated before anything is enqueued, so that running out of memory leaves
  // the unit as it was.
  auto allocate = [&](Allocator* allocator, size_t bytes, absl::string_view what,
                      Buffer& out) -> absl::Status {
    absl::StatusOr<Buffer> buffer = allocator->Allocate(bytes);
    if (!buffer.ok()) return Annotate(buffer.status(), absl::StrCat(context, ": ", what));
    out = *std::move(buffer);
    return absl::OkStatus();
  };
  const bool fresh = !shard_grad_live_;
  const bool accumulate = !fresh && shard_grad_written_;
  Buffer reduce_input;     // the gradient in reduce_dtype, when that is not param_dtype
  Buffer new_shard_grad;   // the sharded gradient, on the first reduction
  Buffer shard_grad_temp;  // the reduced shard in the sharded gradient's dtype, to add
  if (reduce != param) {
    SL_RETURN_IF_ERROR(
        allocate(pool_, total * DTypeSize(reduce), "gradient in reduce dtype", reduce_input));
  }
  if (fresh) {
    SL_RETURN_IF_ERROR(allocate(shard_allocator_, count * DTypeSize(grad_dtype), "sharded gradient",
                                new_shard_grad));
  }
  if (accumulate && grad_dtype != reduce) {
    SL_RETURN_IF_ERROR(allocate(pool_, count * DTypeSize(grad_dtype),
                                "reduced shard in the sharded gradient's dtype", shard_grad_temp));
  }

  // The reduction reads the gradient after the backward and the zero-fill, and writes the sharded
  // gradient after the previous reduction and zero-fill. Waits read no buffer: on failure the
  // new buffers go back unguarded.
  for (const std::shared_ptr<Event>* event :
       {&grad_ready, &grad_zeroed_, &reduce_done_, &shard_grad_last_use_}) {
    if (*event != nullptr) SL_RETURN_IF_ERROR(Annotate(reduce_stream.WaitEvent(**event), context));
  }

  void* grad = unsharded_grad_.data();
  void* input = reduce != param ? reduce_input.data() : grad;
  void* slice = ElementAt(input, layout_.ShardBegin(shard_rank_), DTypeSize(reduce));
  void* shard_grad = fresh ? new_shard_grad.data() : shard_grad_.data();
  ReduceOptions reduce_options;
  static_cast<CollectiveOptions&>(reduce_options) = options.collective;
  reduce_options.op = options.op;
  bool enqueued = false;  // whether work that uses the buffers may be on the stream
  absl::Status status = [&]() -> absl::Status {
    if (reduce != param) {
      SL_RETURN_IF_ERROR(EnqueueCast(reduce_stream, grad, param, input, reduce, total));
      enqueued = true;
    }
    // In place: this rank's reduced shard lands in its own slice of the input.
    SL_RETURN_IF_ERROR(
        shard_comm.ReduceScatter(input, slice, count, reduce, reduce_stream, reduce_options)
            .status());
    enqueued = true;
    if (replicate_comm != nullptr && replicate_comm->size() > 1) {
      // kAvg again: the average of the replicas' shard averages is the global average, because
      // every shard group has the same size.
      SL_RETURN_IF_ERROR(
          replicate_comm->AllReduce(slice, slice, count, reduce, reduce_stream, reduce_options)
              .status());
    }
    if (!accumulate)
      return EnqueueCast(reduce_stream, slice, reduce, shard_grad, grad_dtype, count);
    if (grad_dtype == reduce) {
      return EnqueueAccumulate(reduce_stream, shard_grad, slice, count, grad_dtype);
    }
    SL_RETURN_IF_ERROR(
        EnqueueCast(reduce_stream, slice, reduce, shard_grad_temp.data(), grad_dtype, count));
    return EnqueueAccumulate(reduce_stream, shard_grad, shard_grad_temp.data(), count, grad_dtype);
  }();
  if (!status.ok() && !enqueued) return Annotate(status, context);

  // From here on, work that reads or writes the buffers may be queued: each goes back after the
  // events that cover it. If no event can be recorded, the stream is poisoned and runs nothing
  // more, so nothing uses the buffers.
  absl::StatusOr<std::shared_ptr<Event>> recorded = RecordEvent(reduce_stream);
  std::shared_ptr<Event> done = recorded.ok() ? *recorded : nullptr;
  if (status.ok() && !recorded.ok()) status = recorded.status();
  reduce_input.ReleaseAfter(done);
  shard_grad_temp.ReleaseAfter(done);
  unsharded_grad_.ReleaseAfter(done);
  unsharded_grad_.ReleaseAfter(grad_ready);
  unsharded_grad_.ReleaseAfter(grad_zeroed_);
  unsharded_grad_.Reset();
  unsharded_grad_live_ = false;
  grad_zeroed_ = nullptr;
  // The backward that produced the gradient was the parameters' last reader.
  ReleaseUnsharded(grad_ready);
  if (fresh) {
    shard_grad_ = std::move(new_shard_grad);
    shard_grad_live_ = true;
  }
  shard_grad_written_ = true;
  reduce_done_ = done;
  if (!status.ok()) {
    state_ = FlatParameterState::kSharded;
    return Annotate(status, context);
  }
  state_ = FlatParameterState::kReducing;
  return done;
}

absl::Status FlatParameter::WaitReduced(Stream& stream) {
  if (state_ != FlatParameterState::kReducing) return WrongState("WaitReduced()", "reducing");
  absl::Status status =
      reduce_done_ != nullptr ? stream.WaitEvent(*reduce_done_) : absl::OkStatus();
  state_ = FlatParameterState::kSharded;
  return Annotate(status, absl::StrCat("flat parameter '", name_, "': WaitReduced()"));
}

absl::Status FlatParameter::WaitReduced(absl::Time deadline) {
  if (state_ != FlatParameterState::kReducing) return WrongState("WaitReduced()", "reducing");
  absl::Status status =
      reduce_done_ != nullptr ? reduce_done_->Synchronize(deadline) : absl::OkStatus();
  if (!status.ok()) {
    // Still running (as opposed to failed, possibly with a deadline of its own): stay reducing.
    absl::StatusOr<bool> done = reduce_done_->Query();
    if (done.ok() && !*done) {
      return Annotate(status, absl::StrCat("flat parameter '", name_, "': WaitReduced()"));
    }
  }
  state_ = FlatParameterState::kSharded;
  return Annotate(status, absl::StrCat("flat parameter '", name_, "': WaitReduced()"));
}

absl::StatusOr<FlatShardView> FlatParameter::ShardGrad() const {
  if (state_ == FlatParameterState::kReducing) {
    return WrongState("ShardGrad()", "sharded, gathering, unsharded");
  }
  if (!shard_grad_live_) {
    return absl::FailedPreconditionError(
        absl::StrCat("flat parameter '", name_,
                     "': ShardGrad(): no sharded gradient (no reduction since creation or "
                     "ReleaseShardGrad())"));
  }
  return FlatShardView{shard_grad_.data(), layout_.shard_elements(), policy_.sharded_grad_dtype(),
                       shard_rank_};
}

absl::Status FlatParameter::ZeroShardGrad(Stream& stream) {
  constexpr absl::string_view kCall = "ZeroShardGrad()";
  if (state_ == FlatParameterState::kReducing) {
    return WrongState(kCall, "sharded, gathering, unsharded");
  }
  if (!shard_grad_live_) return absl::OkStatus();
  SL_RETURN_IF_ERROR(CheckStreamDevice(kCall, stream));
  const std::string context = absl::StrCat("flat parameter '", name_, "': ", kCall);
  for (const std::shared_ptr<Event>* event : {&reduce_done_, &shard_grad_last_use_}) {
    if (*event != nullptr) SL_RETURN_IF_ERROR(Annotate(stream.WaitEvent(**event), context));
  }
  SL_RETURN_IF_ERROR(
      Annotate(EnqueueZero(stream, shard_grad_.data(), shard_grad_.size()), context));
  // If no event can be recorded the stream is poisoned: the zero-fill will not run.
  absl::StatusOr<std::shared_ptr<Event>> zeroed = RecordEvent(stream);
  if (!zeroed.ok()) return Annotate(zeroed.status(), context);
  shard_grad_last_use_ = *std::move(zeroed);
  // Zero plus the next reduction is the next reduction: it may write instead of add.
  shard_grad_written_ = false;
  return absl::OkStatus();
}

absl::Status FlatParameter::ReleaseShardGrad(std::shared_ptr<Event> last_use) {
  if (state_ == FlatParameterState::kReducing) {
    return WrongState("ReleaseShardGrad()", "sharded, gathering, unsharded");
  }
  shard_grad_.ReleaseAfter(std::move(last_use));
  shard_grad_.ReleaseAfter(reduce_done_);
  shard_grad_.ReleaseAfter(shard_grad_last_use_);
  shard_grad_.Reset();
  shard_grad_live_ = false;
  shard_grad_written_ = false;
  shard_grad_last_use_ = nullptr;
  return absl::OkStatus();
}

}  // namespace shardline
