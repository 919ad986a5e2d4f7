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

namespace shardline {
namespace {

// Element `index` of a buffer of `esize`-byte elements; null for a buffer of no bytes (pointer
// arithmetic on null is undefined).
void* ElementAt(void* base, size_t index, size_t esize) {
  return base == nullptr ? nullptr : static_cast<char*>(base) + index * esize;
}

// Copies `bytes` of host memory into memory of `device`, blocking until done (initialisation is
// allowed to block): memcpy for the host, a copy on a stream of the device otherwise.
absl::Status CopyFromHost(void* dst, Device device, const void* src, size_t bytes,
                          absl::Time deadline) {
  if (bytes == 0) return absl::OkStatus();
  if (device.is_host()) {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream,
                      CreateStream(device, {.name = "flat parameter init"}));
  SL_RETURN_IF_ERROR(EnqueueCopy(*stream, dst, src, bytes));
  return stream->Synchronize(deadline);
}

// "flat parameter '<name>': <call><suffix>", formatted only when an error needs it: the hooks'
// successful calls build no strings.
class CallContext {
 public:
  CallContext(const std::string& name, absl::string_view call, absl::string_view suffix = "")
      : name_(name), call_(call), suffix_(suffix) {}
  std::string str() const { return absl::StrCat("flat parameter '", name_, "': ", call_, suffix_); }

 private:
  const std::string& name_;
  absl::string_view call_;
  absl::string_view suffix_;
};

absl::Status Annotate(const absl::Status& status, const CallContext& context) {
  if (status.ok()) return status;
  return shardline::Annotate(status, context.str());
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
        CopyFromHost(master_.data(), shard_allocator_->device(), staging.data(), bytes, deadline),
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

// ---- Gradients -------------------------------------------------------------------------------

absl::Status FlatParameter::PrepareGrad(Stream& compute) {
  constexpr absl::string_view kCall = "PrepareGrad()";
  if (state_ != FlatParameterState::kUnsharded && state_ != FlatParameterState::kGathering) {
    return WrongState(kCall, "gathering, unsharded");
  }
  if (unsharded_grad_live_) {
    if (std::find(grad_consumers_.begin(), grad_consumers_.end(), &compute) ==
        grad_consumers_.end()) {
      SL_RETURN_IF_ERROR(CheckStreamDevice(kCall, compute));
      SL_RETURN_IF_ERROR(
          Annotate(WaitUnlessSameStream(compute, grad_zeroed_), CallContext(name_, kCall)));
      grad_consumers_.push_back(&compute);
    }
    return absl::OkStatus();
  }
  SL_RETURN_IF_ERROR(CheckStreamDevice(kCall, compute));
  const CallContext context(name_, kCall);
  const size_t bytes = layout_.total_elements() * DTypeSize(policy_.param_dtype);
  absl::StatusOr<Buffer> grad =
      stream_ordered_grad_ ? grad_pool_->Allocate(bytes, compute) : grad_pool_->Allocate(bytes);
  if (!grad.ok()) return Annotate(grad.status(), context);
  SL_RETURN_IF_ERROR(Annotate(EnqueueFill(compute, grad->data(), bytes), context));
  // If no event can be recorded the stream is poisoned: the zero-fill will not run. Shared: the
  // reduction's record on this stream (RecordOnConsumers) reuses it if nothing followed the fill.
  absl::StatusOr<std::shared_ptr<Event>> zeroed = RecordSharedEvent(compute);
  if (!zeroed.ok()) return Annotate(zeroed.status(), context);
  grad_zeroed_ = *std::move(zeroed);
  unsharded_grad_ = *std::move(grad);
  unsharded_grad_live_ = true;
  grad_consumers_ = {&compute};
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

absl::StatusOr<std::shared_ptr<Event>> FlatParameter::ReduceScatter(
    Communicator& shard_comm, Stream& stream, std::shared_ptr<Event> grad_ready,
    const ReduceGradOptions& options) {
  constexpr absl::string_view kCall = "ReduceScatter()";
  if (state_ != FlatParameterState::kUnsharded) return WrongState(kCall, "unsharded");
  const CallContext context(name_, kCall);
  if (!unsharded_grad_live_) {
    return absl::FailedPreconditionError(
        absl::StrCat(context.str(),
                     ": no unsharded gradient (call PrepareGrad() and write the gradient first)"));
  }
  if (options.op != ReduceOp::kSum && options.op != ReduceOp::kAvg) {
    return absl::InvalidArgumentError(
        absl::StrCat(context.str(), ": op ", ReduceOpName(options.op), " is not sum or avg"));
  }
  SL_RETURN_IF_ERROR(CheckShardComm(kCall, shard_comm));
  SL_RETURN_IF_ERROR(CheckStreamDevice(kCall, stream));

  const DType param = policy_.param_dtype;
  const DType reduce = policy_.reduce_dtype;
  const size_t count = layout_.shard_elements();
  const size_t total = layout_.total_elements();
  Buffer reduce_input;  // the gradient in reduce_dtype, when that is not param_dtype
  if (reduce != param) {
    absl::StatusOr<Buffer> buffer = grad_pool_->Allocate(total * DTypeSize(reduce), stream);
    if (!buffer.ok()) {
      return Annotate(buffer.status(), absl::StrCat(context.str(), ": gradient in reduce dtype"));
    }
    reduce_input = *std::move(buffer);
  }
  // The reduction reads the gradient after the backward, the zero-fill and every stream that
  // prepared it. Waits read no buffer: on failure the new buffer goes back unguarded.
  EventList grad_users = RecordOnConsumers(grad_consumers_);
  const size_t fresh = grad_users.size();
  for (const std::shared_ptr<Event>* event : {&grad_ready, &grad_zeroed_}) {
    // An event last recorded on a consumer stream is covered by the record just made there.
    const uint64_t on = *event != nullptr ? (*event)->recorded_stream_id() : 0;
    if (on != 0 && std::any_of(grad_users.begin(), grad_users.begin() + fresh,
                               [on](const auto& e) { return e->recorded_stream_id() == on; })) {
      continue;
    }
    grad_users.push_back(*event);
  }
  // Where the sharded gradient holds nothing to add to (zeroed since its last reduction), is in
  // the reduce dtype and on this device, the reduce-scatter writes the reduced shard straight
  // into it (out of place) after its last users, and Accumulate() has nothing left to copy.
  // Otherwise the reduced shard lands in its own slice of the input (in place).
  const bool into_shard_grad = !offload_ && shard_grad_live_ && !shard_grad_written_ &&
                               policy_.sharded_grad_dtype() == reduce;
  if (into_shard_grad) {
    grad_users.push_back(reduce_done_);
    grad_users.push_back(shard_grad_last_use_);
  }
  for (const std::shared_ptr<Event>& event : grad_users) {
    SL_RETURN_IF_ERROR(Annotate(WaitUnlessSameStream(stream, event), context));
  }

  void* grad = unsharded_grad_.data();
  void* input = reduce != param ? reduce_input.data() : grad;
  void* slice = into_shard_grad
                    ? shard_grad_.data()
                    : ElementAt(input, layout_.ShardBegin(shard_rank_), DTypeSize(reduce));
  ReduceOptions collective;
  static_cast<CollectiveOptions&>(collective) = options.collective;
  collective.op = options.op;
  absl::Status status = EnqueueCast(stream, grad, param, input, reduce, total);
  const bool cast_enqueued = status.ok() && reduce != param;
  if (status.ok() && options.collective_start != nullptr) {
    absl::StatusOr<std::shared_ptr<Event>> start = RecordEvent(stream);
    *options.collective_start = start.ok() ? *std::move(start) : nullptr;
  }
  std::shared_ptr<Event> scattered;
  if (status.ok()) {
    absl::StatusOr<Work> work =
        shard_comm.ReduceScatter(input, slice, count, reduce, stream, collective);
    status = work.status();
    if (work.ok()) scattered = work->event();
  }
  if (!status.ok() && !cast_enqueued) return Annotate(status, context);

  // From here on, work that uses the buffers may be queued.
  reduce_input_ = std::move(reduce_input);
  reduced_slice_ = slice;
  reduce_options_ = options;
  grad_ready_ = grad_ready;
  // The backward that produced the gradient was the parameters' last reader.
  ReleaseUnsharded(grad_ready);
  grad_consumers_.clear();
  state_ = FlatParameterState::kReducing;
  reduce_phase_ = ReducePhase::kScattered;
  // The collective's own event marks this point of `stream` (nothing was enqueued on it since:
  // the records above are on other streams and enqueue no work); a new one only without it.
  absl::StatusOr<std::shared_ptr<Event>> done =
      scattered != nullptr ? absl::StatusOr<std::shared_ptr<Event>>(std::move(scattered))
                           : RecordEvent(stream);
  if (done.ok()) reduce_step_ = *done;
  if (!status.ok()) return AbortReduction(Annotate(status, context));
  if (!done.ok()) return AbortReduction(Annotate(done.status(), context));
  return reduce_step_;
}

absl::StatusOr<std::shared_ptr<Event>> FlatParameter::AllReduce(Communicator* replicate_comm,
                                                                Stream& stream,
                                                                const ReduceGradOptions& options) {
  constexpr absl::string_view kCall = "AllReduce()";
  if (state_ != FlatParameterState::kReducing || reduce_phase_ != ReducePhase::kScattered) {
    return absl::FailedPreconditionError(
        absl::StrCat("flat parameter '", name_, "': ", kCall,
                     " is allowed only after ReduceScatter() and before Accumulate()"));
  }
  if (replicate_comm == nullptr || replicate_comm->size() == 1) {
    reduce_phase_ = ReducePhase::kAllReduced;
    return reduce_step_;
  }
  const CallContext context(name_, kCall);
  if (replicate_comm->device() != pool_->device()) {
    return absl::InvalidArgumentError(
        absl::StrCat(context.str(), ": replicate communicator '", replicate_comm->name(),
                     "' moves memory on ", replicate_comm->device().ToString(),
                     " but the unit's buffers are on ", pool_->device().ToString()));
  }
  if (options.op != reduce_options_.op) {
    return absl::InvalidArgumentError(absl::StrCat(context.str(), ": op ", ReduceOpName(options.op),
                                                   " differs from the reduce-scatter's ",
                                                   ReduceOpName(reduce_options_.op)));
  }
  SL_RETURN_IF_ERROR(CheckStreamDevice(kCall, stream));
  SL_RETURN_IF_ERROR(Annotate(WaitUnlessSameStream(stream, reduce_step_), context));
  ReduceOptions collective;
  static_cast<CollectiveOptions&>(collective) = options.collective;
  // kAvg again: the average of the replicas' shard averages is the global average, because
  // every shard group has the same size.
  collective.op = options.op;
  const size_t count = layout_.shard_elements();
  absl::Status status = replicate_comm
                            ->AllReduce(reduced_slice_, reduced_slice_, count, policy_.reduce_dtype,
                                        stream, collective)
                            .status();
  absl::StatusOr<std::shared_ptr<Event>> done = RecordEvent(stream);
  if (done.ok()) reduce_step_ = *done;
  if (!status.ok()) return AbortReduction(Annotate(status, context));
  if (!done.ok()) return AbortReduction(Annotate(done.status(), context));
  reduce_phase_ = ReducePhase::kAllReduced;
  return reduce_step_;
}

absl::StatusOr<std::shared_ptr<Event>> FlatParameter::Accumulate(Stream& stream) {
  constexpr absl::string_view kCall = "Accumulate()";
  if (state_ != FlatParameterState::kReducing || reduce_phase_ == ReducePhase::kAccumulated) {
    return absl::FailedPreconditionError(absl::StrCat("flat parameter '", name_, "': ", kCall,
                                                      " is allowed only after ReduceScatter()"));
  }
  SL_RETURN_IF_ERROR(CheckStreamDevice(kCall, stream));
  const CallContext context(name_, kCall);
  const DType reduce = policy_.reduce_dtype;
  const DType grad_dtype = policy_.sharded_grad_dtype();
  if (shard_grad_live_ && reduced_slice_ == shard_grad_.data()) {
    // The reduce-scatter (and the all-reduce, in place) already wrote the sharded gradient.
    shard_grad_written_ = true;
    reduce_done_ = reduce_step_;
    reduce_phase_ = ReducePhase::kAccumulated;
    ReleaseReductionInputs();
    return reduce_done_;
  }
  const size_t count = layout_.shard_elements();
  const bool fresh = !shard_grad_live_;
  const bool accumulate = !fresh && shard_grad_written_;

  // Everything is allocated before anything is enqueued, so that running out of memory leaves
  // the reduction where it was (it can be retried).
  Buffer new_shard_grad;   // the sharded gradient, on the first reduction
  Buffer shard_grad_temp;  // the reduced shard in the sharded gradient's dtype, to add
  if (fresh) {
    absl::StatusOr<Buffer> buffer = shard_allocator_->Allocate(count * DTypeSize(grad_dtype));
    if (!buffer.ok())
      return Annotate(buffer.status(), absl::StrCat(context.str(), ": sharded gradient"));
    new_shard_grad = *std::move(buffer);
  }
  // CPU offload: the reduced shard comes back to host memory, where the sharded gradient is.
  Buffer host_slice;
  if (offload_) {
    absl::StatusOr<Buffer> buffer = shard_allocator_->Allocate(count * DTypeSize(reduce));
    if (!buffer.ok()) {
      return Annotate(buffer.status(),
                      absl::StrCat(context.str(), ": reduced shard in host memory"));
    }
    host_slice = *std::move(buffer);
  }
  if (accumulate && grad_dtype != reduce) {
    absl::StatusOr<Buffer> buffer =
        offload_ ? shard_allocator_->Allocate(count * DTypeSize(grad_dtype))
                 : grad_pool_->Allocate(count * DTypeSize(grad_dtype), stream);
    if (!buffer.ok()) {
      return Annotate(
          buffer.status(),
          absl::StrCat(context.str(), ": reduced shard in the sharded gradient's dtype"));
    }
    shard_grad_temp = *std::move(buffer);
  }
  // The sharded gradient is written after the previous reduction and zero-fill.
  for (const std::shared_ptr<Event>* event :
       {&reduce_step_, &reduce_done_, &shard_grad_last_use_}) {
    SL_RETURN_IF_ERROR(Annotate(WaitUnlessSameStream(stream, *event), context));
  }
  void* shard_grad = fresh ? new_shard_grad.data() : shard_grad_.data();
  const void* slice = reduced_slice_;
  absl::Status status = [&]() -> absl::Status {
    if (offload_) {
      SL_RETURN_IF_ERROR(EnqueueCopy(stream, host_slice.data(), slice, host_slice.size()));
      slice = host_slice.data();
    }
    if (!accumulate) return EnqueueCast(stream, slice, reduce, shard_grad, grad_dtype, count);
    if (grad_dtype == reduce) return EnqueueReduce(stream, shard_grad, slice, count, grad_dtype);
    SL_RETURN_IF_ERROR(
        EnqueueCast(stream, slice, reduce, shard_grad_temp.data(), grad_dtype, count));
    return EnqueueReduce(stream, shard_grad, shard_grad_temp.data(), count, grad_dtype);
  }();
  // Work that writes the new buffers may be queued even on error (a cast before a failed add).
  absl::StatusOr<std::shared_ptr<Event>> done = RecordEvent(stream);
  if (done.ok()) shard_grad_temp.ReleaseAfter(*done);
  if (done.ok()) host_slice.ReleaseAfter(*done);
  if (fresh) {
    if (done.ok()) new_shard_grad.ReleaseAfter(*done);
    shard_grad_ = std::move(new_shard_grad);
    shard_grad_live_ = true;
  }
  if (done.ok()) reduce_step_ = *done;
  if (!status.ok()) return AbortReduction(Annotate(status, context));
  if (!done.ok()) return AbortReduction(Annotate(done.status(), context));
  shard_grad_written_ = true;
  reduce_done_ = reduce_step_;
  reduce_phase_ = ReducePhase::kAccumulated;
  // The gradient and the reduce-dtype copy were read by the steps before this one.
  ReleaseReductionInputs();
  return reduce_done_;
}

void FlatParameter::ReleaseReductionInputs() {
  // Work that uses the buffers may be queued: each goes back after the events that cover it. If
  // no event could be recorded, the stream is poisoned and runs nothing more.
  for (Buffer* buffer : {&unsharded_grad_, &reduce_input_}) {
    buffer->ReleaseAfter(reduce_step_);
    buffer->ReleaseAfter(grad_ready_);
    buffer->ReleaseAfter(grad_zeroed_);
    buffer->Reset();
  }
  unsharded_grad_live_ = false;
  grad_zeroed_ = nullptr;
  grad_ready_ = nullptr;
  reduced_slice_ = nullptr;
}

absl::Status FlatParameter::AbortReduction(absl::Status error) {
  ReleaseReductionInputs();
  // The sharded gradient may have been half written: its contents are undefined now.
  reduce_done_ = reduce_step_;
  reduce_phase_ = ReducePhase::kAccumulated;
  state_ = FlatParameterState::kSharded;
  return error;
}

absl::StatusOr<std::shared_ptr<Event>> FlatParameter::ReduceGrad(Communicator& shard_comm,
                                                                 Communicator* replicate_comm,
                                                                 Stream& reduce_stream,
                                                                 std::shared_ptr<Event> grad_ready,
                                                                 const ReduceGradOptions& options) {
  constexpr absl::string_view kCall = "ReduceGrad()";
  if (state_ != FlatParameterState::kUnsharded) return WrongState(kCall, "unsharded");
  if (replicate_comm != nullptr && replicate_comm->device() != pool_->device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "flat parameter '", name_, "': ", kCall, ": replicate communicator '",
        replicate_comm->name(), "' moves memory on ", replicate_comm->device().ToString(),
        " but the unit's buffers are on ", pool_->device().ToString()));
  }
  SL_RETURN_IF_ERROR(
      ReduceScatter(shard_comm, reduce_stream, std::move(grad_ready), options).status());
  if (absl::Status status = AllReduce(replicate_comm, reduce_stream, options).status();
      !status.ok()) {
    // Argument errors leave the reduction pending; end it, so the unit is usable again.
    if (state_ == FlatParameterState::kReducing) return AbortReduction(status);
    return status;
  }
  absl::StatusOr<std::shared_ptr<Event>> done = Accumulate(reduce_stream);
  if (!done.ok() && state_ == FlatParameterState::kReducing) return AbortReduction(done.status());
  return done;
}

absl::Status FlatParameter::WaitReduced(Stream& stream) {
  if (state_ != FlatParameterState::kReducing || reduce_phase_ != ReducePhase::kAccumulated) {
    return WrongState("WaitReduced()", "reducing, after Accumulate()");
  }
  absl::Status status =
      reduce_done_ != nullptr ? stream.WaitEvent(*reduce_done_) : absl::OkStatus();
  state_ = FlatParameterState::kSharded;
  return Annotate(status, CallContext(name_, "WaitReduced()"));
}

absl::Status FlatParameter::WaitReduced(absl::Time deadline) {
  if (state_ != FlatParameterState::kReducing || reduce_phase_ != ReducePhase::kAccumulated) {
    return WrongState("WaitReduced()", "reducing, after Accumulate()");
  }
  absl::Status status =
      reduce_done_ != nullptr ? reduce_done_->Synchronize(deadline) : absl::OkStatus();
  if (!status.ok()) {
    // Still running (as opposed to failed, possibly with a deadline of its own): stay reducing.
    absl::StatusOr<bool> done = reduce_done_->Query();
    if (done.ok() && !*done) {
      return Annotate(status, CallContext(name_, "WaitReduced()"));
    }
  }
  state_ = FlatParameterState::kSharded;
  return Annotate(status, CallContext(name_, "WaitReduced()"));
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
  const CallContext context(name_, kCall);
  for (const std::shared_ptr<Event>* event : {&reduce_done_, &shard_grad_last_use_}) {
    if (*event != nullptr) SL_RETURN_IF_ERROR(Annotate(stream.WaitEvent(**event), context));
  }
  SL_RETURN_IF_ERROR(
      Annotate(EnqueueFill(stream, shard_grad_.data(), shard_grad_.size()), context));
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
