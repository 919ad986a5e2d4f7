// File: scheduler/flat_parameter.cc
// -----------------------------------------------------------------------------
// FlatParameter's creation, initialisation and parameter half: the gather into the unsharded
// buffer, its users and the reshard. The gradient half (PrepareGrad, the reduce-scatter, the
// replicate all-reduce, the accumulation into the sharded gradient) is in flat_parameter_grad.cc.

#include "scheduler/flat_parameter.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/config.h"
#include "runtime/host_kernels.h"
#include "runtime/status.h"
#include "runtime/stream_ops.h"
#include "scheduler/internal/flat_parameter_internal.h"

namespace shardline {

using flat_parameter_internal::CallContext;
using flat_parameter_internal::ElementAt;

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
      grad_pool_(options.grad_pool != nullptr ? options.grad_pool : options.unsharded_pool),
      stream_ordered_grad_(options.stream_ordered_grad),
      offload_(options.offload_allocator != nullptr),
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
  if (options.offload_allocator != nullptr) {
    if (!options.offload_allocator->device().is_host()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": offload_allocator '", options.offload_allocator->name(), "' is on ",
          options.offload_allocator->device().ToString(), "; CPU offload needs host memory"));
    }
    options.shard_allocator = options.offload_allocator;
  }
  if (options.shard_allocator == nullptr) options.shard_allocator = options.unsharded_pool;
  if (options.grad_pool != nullptr &&
      options.grad_pool->device() != options.unsharded_pool->device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": grad_pool '", options.grad_pool->name(), "' is on ",
        options.grad_pool->device().ToString(), " but unsharded_pool '",
        options.unsharded_pool->name(), "' is on ", options.unsharded_pool->device().ToString()));
  }
  if (options.offload_allocator == nullptr &&
      options.shard_allocator->device() != options.unsharded_pool->device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": shard_allocator '", options.shard_allocator->name(), "' is on ",
        options.shard_allocator->device().ToString(), " but unsharded_pool '",
        options.unsharded_pool->name(), "' is on ", options.unsharded_pool->device().ToString()));
  }

  const size_t bytes = layout.shard_elements() * DTypeSize(policy.master_dtype);
  Buffer external = std::move(options.master_shard);
  if (!external.empty() || external.data() != nullptr) {
    if (external.size() != bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": master_shard has ", external.size(), " bytes but the layout's shard needs ",
          bytes, " (", layout.shard_elements(), " x ", DTypeName(policy.master_dtype), ")"));
    }
    const Device master_device = options.offload_allocator != nullptr
                                     ? options.offload_allocator->device()
                                     : options.unsharded_pool->device();
    if (external.device() != master_device) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": master_shard is on ", external.device().ToString(), " but the master shard ",
          "belongs on ", master_device.ToString(),
          options.offload_allocator != nullptr ? " (CPU offload)"
                                               : " (for a host master shard with a device pool, "
                                                 "set offload_allocator: CPU offload)"));
    }
  }
  if (options.init_stream != nullptr &&
      options.init_stream->device() != options.unsharded_pool->device()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": init_stream '", options.init_stream->name(), "' is on ",
                     options.init_stream->device().ToString(), " but the unit's buffers are on ",
                     options.unsharded_pool->device().ToString()));
  }
  Stream* const init_stream = options.init_stream;
  std::unique_ptr<FlatParameter> unit(
      new FlatParameter(std::move(layout), shard_rank, policy, std::move(options)));
  if (external.data() != nullptr || bytes == 0) {
    // The framework's memory holds the parameters' values already.
    unit->master_ = std::move(external);
    return unit;
  }
  absl::StatusOr<Buffer> master = unit->shard_allocator_->Allocate(bytes);
  if (!master.ok()) return Annotate(master.status(), absl::StrCat(what, ": master shard"));
  unit->master_ = *std::move(master);
  // The zero-fill is a stream op like every other touch of the unit's memory (a simulated
  // stream accounts for it without running it).
  const std::string filling = absl::StrCat(what, ": zero-filling the master shard");
  if (init_stream != nullptr) {
    SL_RETURN_IF_ERROR(Annotate(EnqueueFill(*init_stream, unit->master_.data(), bytes), filling));
    SL_ASSIGN_OR_RETURN(unit->master_ready_, RecordEvent(*init_stream));
    return unit;
  }
  const Device device = unit->shard_allocator_->device();
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream,
                      device.is_host() ? CreateCallerStream({.name = "flat parameter init"})
                                       : CreateStream(device, {.name = "flat parameter init"}));
  SL_RETURN_IF_ERROR(Annotate(EnqueueFill(*stream, unit->master_.data(), bytes), filling));
  SL_RETURN_IF_ERROR(Annotate(stream->Synchronize(DefaultDeadline()), filling));
  return unit;
}

FlatParameter::~FlatParameter() {
  // Readers we know of: the last gather reads the master shard and writes the unsharded buffer
  // (every gather waits for the one before); the acquiring streams read the unsharded buffer;
  // PrepareGrad's streams write the gradient; a reduction in flight reads the gradient and
  // writes the sharded gradient, as does the last zero-fill. Buffers release themselves after.
  const std::shared_ptr<Event>& gathered = gather_work_.event();
  master_.ReleaseAfter(gathered);
  master_.ReleaseAfter(master_ready_);
  if (state_ == FlatParameterState::kGathering || state_ == FlatParameterState::kUnsharded) {
    ReleaseUnsharded(nullptr);
  }
  unsharded_grad_.ReleaseAfter(grad_zeroed_);
  unsharded_grad_.ReleaseAfter(grad_ready_);
  unsharded_grad_.ReleaseAfter(reduce_step_);
  reduce_input_.ReleaseAfter(reduce_step_);
  if (unsharded_grad_live_) {
    for (std::shared_ptr<Event>& event : RecordOnConsumers(grad_consumers_)) {
      unsharded_grad_.ReleaseAfter(std::move(event));
    }
  }
  shard_grad_.ReleaseAfter(reduce_done_);
  shard_grad_.ReleaseAfter(reduce_step_);
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
  // The zero-fill may still be queued, the last gather may still be casting the shard (a failed
  // one reads nothing any more).
  if (master_ready_ != nullptr) {
    absl::Status done = master_ready_->Synchronize(deadline);
    if (absl::IsDeadlineExceeded(done)) {
      return Annotate(done, absl::StrCat("flat parameter '", name_, "': ", kCall,
                                         ": waiting for the master shard's zero-fill"));
    }
  }
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
    SL_RETURN_IF_ERROR(Annotate(
        CopyBlocking(shard_allocator_->device(), master_.data(), staging.data(), bytes, deadline),
        absl::StrCat("flat parameter '", name_, "': ", kCall)));
  }
  return absl::OkStatus();
}

absl::Status FlatParameter::SetShardFromTensors(absl::Span<const void* const> tensors) {
  return SetShardFromTensors(tensors, DefaultDeadline());
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
  const CallContext context(name_, kCall);

  const DType param = policy_.param_dtype;
  const size_t psize = DTypeSize(param);
  const size_t count = layout_.shard_elements();
  // The gather stream is the buffer's first user: it may wait for the block's previous users.
  absl::StatusOr<Buffer> buffer = pool_->Allocate(layout_.total_elements() * psize, gather_stream);
  if (!buffer.ok()) return Annotate(buffer.status(), context);
  // CPU offload: the master shard is in host memory; it is copied to the device first (a
  // shard-sized staging buffer from the pool), and cast into place from there.
  Buffer staging;
  if (offload_) {
    absl::StatusOr<Buffer> copy =
        pool_->Allocate(count * DTypeSize(policy_.master_dtype), gather_stream);
    if (!copy.ok())
      return Annotate(copy.status(), absl::StrCat(context.str(), ": offload staging"));
    staging = *std::move(copy);
  }
  void* slice = ElementAt(buffer->data(), layout_.ShardBegin(shard_rank_), psize);

  // Waits enqueue no reader of the new buffer: on failure it goes back unguarded.
  if (options.shard_ready != nullptr) {
    SL_RETURN_IF_ERROR(Annotate(gather_stream.WaitEvent(*options.shard_ready), context));
  }
  // Gathers of one unit run one after the other, so the last one's event covers every earlier
  // reader of the master shard and writer of an unsharded buffer; the first one waits for the
  // master shard's zero-fill on the init stream.
  const std::shared_ptr<Event>& previous =
      gather_work_.event() != nullptr ? gather_work_.event() : master_ready_;
  SL_RETURN_IF_ERROR(Annotate(WaitUnlessSameStream(gather_stream, previous), context));
  const void* master = master_.data();
  if (offload_) {
    SL_RETURN_IF_ERROR(
        Annotate(EnqueueCopy(gather_stream, staging.data(), master_.data(), staging.size()),
                 CallContext(name_, kCall, ": copying the offloaded master shard to the device")));
    master = staging.data();
  }
  // The shard is cast (or copied) into its slot first and gathered in place, also where the
  // dtypes match: an out-of-place all-gather from the master shard does the same copy inside
  // the collective, after the peers arrived, where it lengthens the collective instead of
  // overlapping a late peer's arrival (tried: docs/benchmarks.md, "session 11").
  absl::Status cast = EnqueueCast(gather_stream, master, policy_.master_dtype, slice, param, count);
  if (offload_) {
    absl::StatusOr<std::shared_ptr<Event>> cast_done = RecordEvent(gather_stream);
    if (cast_done.ok()) staging.ReleaseAfter(*cast_done);
  }
  SL_RETURN_IF_ERROR(Annotate(cast, context));
  if (options.collective_start != nullptr) {
    absl::StatusOr<std::shared_ptr<Event>> start = RecordEvent(gather_stream);
    *options.collective_start = start.ok() ? *std::move(start) : nullptr;
  }
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

absl::Status FlatParameter::AddConsumer(Stream& stream, absl::string_view call) {
  if (std::find(consumers_.begin(), consumers_.end(), &stream) != consumers_.end()) {
    return absl::OkStatus();
  }
  SL_RETURN_IF_ERROR(CheckStreamDevice(call, stream));
  SL_RETURN_IF_ERROR(gather_work_.Synchronize(stream));
  consumers_.push_back(&stream);
  return absl::OkStatus();
}

FlatParameter::EventList FlatParameter::RecordOnConsumers(const std::vector<Stream*>& streams) {
  EventList events;
  for (Stream* stream : streams) {
    // A stream that cannot record is poisoned: it runs nothing more that could read the buffer.
    // Shared: several consumers' records (and the scheduler's) often mark the same point.
    absl::StatusOr<std::shared_ptr<Event>> event = RecordSharedEvent(*stream);
    if (event.ok()) events.push_back(*std::move(event));
  }
  return events;
}

absl::Status FlatParameter::WaitGathered(Stream& compute) {
  if (state_ != FlatParameterState::kGathering) return WrongState("WaitGathered()", "gathering");
  return Acquire(compute);
}

absl::Status FlatParameter::Acquire(Stream& compute) {
  constexpr absl::string_view kCall = "Acquire()";
  if (state_ != FlatParameterState::kGathering && state_ != FlatParameterState::kUnsharded) {
    return WrongState(kCall, "gathering, unsharded");
  }
  absl::Status status = AddConsumer(compute, kCall);
  if (!status.ok()) {
    if (users_ == 0) {
      // The first user could not wait for the gather (it failed, or the stream is poisoned):
      // nothing reads the buffer.
      ReleaseUnsharded(nullptr);
      state_ = FlatParameterState::kSharded;
    }
    return Annotate(status, CallContext(name_, kCall));
  }
  ++users_;
  state_ = FlatParameterState::kUnsharded;
  return absl::OkStatus();
}

bool FlatParameter::GatherCompleted() const {
  const std::shared_ptr<Event>& event = gather_work_.event();
  if (event == nullptr) return false;
  absl::StatusOr<bool> done = event->Query();
  return done.ok() && *done;
}

absl::Status FlatParameter::Release(std::shared_ptr<Event> last_use) {
  if (state_ != FlatParameterState::kUnsharded) return WrongState("Release()", "unsharded");
  if (last_use != nullptr) released_.push_back(std::move(last_use));
  if (--users_ > 0) return absl::OkStatus();
  ReleaseUnsharded(nullptr);
  state_ = FlatParameterState::kSharded;
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
  for (std::shared_ptr<Event>& event : released_) unsharded_.ReleaseAfter(std::move(event));
  for (std::shared_ptr<Event>& event : RecordOnConsumers(consumers_)) {
    unsharded_.ReleaseAfter(std::move(event));
  }
  unsharded_.Reset();
  released_.clear();
  consumers_.clear();
  users_ = 0;
}

absl::Status FlatParameter::Reshard(std::shared_ptr<Event> last_use) {
  if (state_ != FlatParameterState::kUnsharded) return WrongState("Reshard()", "unsharded");
  ReleaseUnsharded(std::move(last_use));
  state_ = FlatParameterState::kSharded;
  return absl::OkStatus();
}

}  // namespace shardline
