// File: bindings/python/src/scheduler.cc
// -----------------------------------------------------------------------------
// shardline._core.Scheduler: the FSDP scheduler for a Python framework.
//   * device="cpu": the compute stream is a caller stream (the thread that calls the hooks), so a
//     hook that needs data blocks that thread, with the GIL released, until the data is there;
//     the scheduler's own streams (gather, reduce, ...) run on their workers.
//   * device="cuda:N": the compute stream is the framework's CUDA stream (compute_stream, a
//     cudaStream_t as an int: torch's Stream.cuda_stream), wrapped without a copy or a take-over;
//     a hook enqueues waits on it and returns without blocking the host, and the scheduler's own
//     streams are CUDA streams of cuda:N. The world must move cuda:N memory (backend nccl).
// Views of unsharded parameters and gradients are numpy arrays or torch tensors over the
// scheduler's memory (zero-copy; torch CUDA tensors on a CUDA device); they stay valid memory
// while the scheduler lives, and hold the unit's values in the windows scheduler.h gives.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bindings/python/src/common.h"
#include "scheduler/scheduler.h"

#ifdef SHARDLINE_WITH_CUDA
#include "runtime/cuda/cuda_stream.h"
#endif

namespace shardline::python {
namespace {

struct PyScheduler {
  nb::object world;      // the PyComm, kept alive
  nb::object replicate;  // the replicate group's PyComm (a mesh of groups made elsewhere) or None
  nb::object trace;      // the TraceWriter or None, kept alive
  std::string framework;
  MixedPrecisionPolicy precision;  // of every unit it registers
  Device device;                   // the compute stream's
  nb::object post_optimizer;       // the framework's event behind SetPostOptimizerEvent, kept alive
  // Destroyed after the scheduler (declared before it).
  std::unique_ptr<Stream> compute;
  std::unique_ptr<Scheduler> scheduler;
};

// One byte every zero-element view points at (DLPack consumers dislike null data).
alignas(64) unsigned char empty_storage[64];

void CheckUnit(const PyScheduler& s, int unit, const char* fn) {
  if (unit < 0 || unit >= s.scheduler->num_units()) {
    ThrowInvalid(
        absl::StrCat(fn, ": no unit ", unit, " (", s.scheduler->num_units(), " registered)"));
  }
}

ShardingStrategy ParseStrategy(const std::string& text) {
  for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                             ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
    if (ShardingStrategyName(s) == text) return s;
  }
  ThrowInvalid(absl::StrCat("strategy '", text,
                            "' is not full_shard, shard_grad_op, no_shard or hybrid_shard"));
}

BackwardPrefetch ParseBackwardPrefetch(const std::string& text) {
  for (BackwardPrefetch b :
       {BackwardPrefetch::kOff, BackwardPrefetch::kBeforeGrad, BackwardPrefetch::kAfterGrad}) {
    if (BackwardPrefetchName(b) == text) return b;
  }
  ThrowInvalid(
      absl::StrCat("backward_prefetch '", text, "' is not off, before_grad or after_grad"));
}

nb::dlpack::dtype DlpackOf(DType dtype) {
  using Code = nb::dlpack::dtype_code;
  nb::dlpack::dtype t;
  t.lanes = 1;
  t.bits = static_cast<uint8_t>(DTypeSize(dtype) * 8);
  switch (dtype) {
    case DType::kF32:
    case DType::kF64:
    case DType::kF16:
      t.code = static_cast<uint8_t>(Code::Float);
      break;
    case DType::kBF16:
      t.code = static_cast<uint8_t>(Code::Bfloat);
      break;
    case DType::kI8:
    case DType::kI32:
    case DType::kI64:
      t.code = static_cast<uint8_t>(Code::Int);
      break;
    case DType::kU8:
      t.code = static_cast<uint8_t>(Code::UInt);
      break;
  }
  return t;
}

// A view of `numel` elements at `data` (memory of `device`) with `shape`, owned by the
// scheduler's Python object.
nb::object MakeView(PyScheduler& s, void* data, DType dtype, const std::vector<size_t>& shape,
                    size_t numel, Device device) {
  if (s.framework == "numpy" && dtype == DType::kBF16) {
    ThrowInvalid(
        "a bfloat16 view cannot be a numpy array; create the Scheduler with "
        "framework='torch'");
  }
  // (Of any device: a consumer reads no element of a zero-element view.)
  if (data == nullptr || numel == 0) data = empty_storage;
  nb::handle owner = nb::find(&s);
  const int32_t kind = device.is_cuda() ? nb::device::cuda::value : nb::device::cpu::value;
  const int32_t index = device.is_cuda() ? device.index() : 0;
  if (s.framework == "torch") {
    return nb::ndarray<nb::pytorch>(data, shape.size(), shape.data(), owner, nullptr,
                                    DlpackOf(dtype), kind, index)
        .cast();
  }
  if (device.is_cuda()) {
    ThrowInvalid(
        "a view of CUDA memory cannot be a numpy array; create the Scheduler with "
        "framework='torch'");
  }
  return nb::ndarray<nb::numpy>(data, shape.size(), shape.data(), owner, nullptr, DlpackOf(dtype),
                                nb::device::cpu::value, 0)
      .cast();
}

// Unsharded parameters and gradients: memory of the compute stream's device.
nb::object FromTensorView(PyScheduler& s, const TensorView& v) {
  std::vector<size_t> shape(v.shape.begin(), v.shape.end());
  return MakeView(s, v.data, v.dtype, shape, v.numel, s.device);
}

// Master shards and sharded gradients: the compute device's, or host memory with cpu_offload.
nb::object FromShardView(PyScheduler& s, const FlatShardView& v, Device device) {
  return MakeView(s, v.data, v.dtype, {v.elements}, v.elements, device);
}

// The compute stream of `device`: a caller stream on the CPU, the framework's CUDA stream
// (`cuda_stream`, a cudaStream_t as an integer; 0 is the device's legacy default stream) wrapped.
std::unique_ptr<Stream> MakeComputeStream(const Device& device, uintptr_t cuda_stream,
                                          const std::string& name, TraceWriter* trace) {
  if (device.is_host()) {
    if (cuda_stream != 0) ThrowInvalid("Scheduler: compute_stream is for device='cuda:N' only");
    return Unwrap(CreateCallerStream(
        {.name = absl::StrCat(name, ".compute"), .trace = trace, .track = "compute"}));
  }
#ifdef SHARDLINE_WITH_CUDA
  return Unwrap(
      WrapCudaStream(reinterpret_cast<cudaStream_t>(cuda_stream), device.index(),
                     {.name = absl::StrCat(name, ".compute"), .trace = trace, .track = "compute"}));
#else
  throw StatusError(absl::UnimplementedError(absl::StrCat(
      "Scheduler: device='", device.ToString(), "': this shardline was built without CUDA")));
#endif
}

void Create(PyScheduler* self, nb::object world, const std::string& strategy, int shard_size,
            int forward_prefetch, const std::string& backward_prefetch, int backward_prefetch_depth,
            std::vector<int> forward_order, size_t budget_bytes, int budget_units, int root_unit,
            bool cpu_offload, const std::string& param_dtype, const std::string& reduce_dtype,
            bool keep_low_precision_grads, const std::string& name, nb::object trace,
            const std::string& framework, std::optional<double> timeout_s, bool time_communication,
            nb::object replicate, const std::string& device_name, uintptr_t cuda_stream) {
  PyComm& comm = nb::cast<PyComm&>(world);
  const Device device = Unwrap(Device::Parse(device_name));
  // The communicators move the compute device's memory: host memory for the CPU, cuda:N memory
  // (backend nccl) for cuda:N.
  auto check_comm = [&](const PyComm& c) {
    if (c.comm->device() == device) return;
    if (device.is_host()) {
      ThrowInvalid(absl::StrCat("Scheduler(device='cpu'): communicator '", c.comm->name(),
                                "' moves ", c.comm->device().ToString(), " memory; pass device='",
                                c.comm->device().ToString(), "'"));
    }
    ThrowInvalid(absl::StrCat("Scheduler(device='", device.ToString(), "'): communicator '",
                              c.comm->name(), "' moves ", c.comm->device().ToString(),
                              " memory, not ", device.ToString(),
                              " memory (a CUDA scheduler "
                              "needs a communicator of its device: backend 'nccl')"));
  };
  PyComm* replicate_comm = nullptr;
  if (!replicate.is_none()) {
    if (!nb::isinstance<PyComm>(replicate)) {
      throw nb::type_error("Scheduler: replicate must be a shardline.Communicator or None");
    }
    replicate_comm = &nb::cast<PyComm&>(replicate);
    if (strategy != "hybrid_shard") {
      ThrowInvalid(absl::StrCat("Scheduler: replicate= makes a hybrid_shard mesh, not ", strategy));
    }
    check_comm(*replicate_comm);
  }
  if (framework != "numpy" && framework != "torch") {
    ThrowInvalid(absl::StrCat("framework '", framework, "' is not 'numpy' or 'torch'"));
  }
  if (device.is_cuda() && framework != "torch") {
    ThrowInvalid(
        absl::StrCat("Scheduler(device='", device.ToString(),
                     "'): views of CUDA memory are torch tensors; pass framework='torch'"));
  }
  check_comm(comm);
  SchedulerOptions options;
  options.name = name;
  options.strategy = ParseStrategy(strategy);
  options.shard_size = shard_size;
  options.forward_prefetch = forward_prefetch;
  options.backward_prefetch = ParseBackwardPrefetch(backward_prefetch);
  options.backward_prefetch_depth = backward_prefetch_depth;
  options.forward_order = std::move(forward_order);
  options.budget_bytes = budget_bytes;
  options.budget_units = budget_units;
  options.root_unit = root_unit;
  options.cpu_offload = cpu_offload;
  options.time_communication = time_communication;
  if (!trace.is_none()) options.trace = &nb::cast<TraceWriter&>(trace);
  MixedPrecisionPolicy precision;
  precision.param_dtype = Unwrap(ParseDType(param_dtype));
  precision.reduce_dtype = Unwrap(ParseDType(reduce_dtype));
  precision.keep_low_precision_grads = keep_low_precision_grads;
  ThrowIfError(precision.Validate());

  std::unique_ptr<Stream> compute = MakeComputeStream(device, cuda_stream, name, options.trace);
  const absl::Time deadline = DeadlineIn(timeout_s);
  absl::StatusOr<std::unique_ptr<Scheduler>> scheduler;
  {
    nb::gil_scoped_release release;
    if (replicate_comm != nullptr) {
      // `world` is the shard group and `replicate` the replicate group (an elastic round's).
      absl::StatusOr<ProcessMesh> mesh = ProcessMesh::FromGroups(comm.comm, replicate_comm->comm);
      scheduler = mesh.ok() ? Scheduler::Create(*std::move(mesh), *compute, options, deadline)
                            : absl::StatusOr<std::unique_ptr<Scheduler>>(mesh.status());
    } else {
      scheduler = Scheduler::Create(comm.comm, *compute, options, deadline);
    }
  }
  std::unique_ptr<Scheduler> made = Unwrap(std::move(scheduler));
  new (self) PyScheduler{
      std::move(world), std::move(replicate), std::move(trace),   framework,      precision,
      device,           nb::none(),           std::move(compute), std::move(made)};
}

int RegisterUnit(PyScheduler& s, const std::string& name, nb::list tensors,
                 std::optional<bool> reshard_after_forward, const std::string& reduce_op) {
  UnitSpec spec;
  spec.name = name;
  for (nb::handle item : tensors) {
    nb::tuple t;
    if (!nb::try_cast(item, t) || t.size() < 2 || t.size() > 3) {
      ThrowInvalid(absl::StrCat("register_unit('", name,
                                "'): each tensor is (name, shape) or (name, shape, tied_to)"));
    }
    TensorSpec ts;
    ts.name = nb::cast<std::string>(t[0]);
    ts.shape = nb::cast<std::vector<int64_t>>(t[1]);
    if (t.size() == 3 && !t[2].is_none()) ts.tied_to = nb::cast<std::string>(t[2]);
    spec.tensors.push_back(std::move(ts));
  }
  spec.policy.precision = s.precision;
  spec.policy.reshard_after_forward = reshard_after_forward;
  spec.policy.reduce_op = Unwrap(ParseReduceOp(reduce_op));
  return Unwrap(s.scheduler->RegisterUnit(std::move(spec)));
}

void SetValues(PyScheduler& s, int unit, nb::list values) {
  CheckUnit(s, unit, "set_values");
  FlatParameter& p = s.scheduler->unit(unit);
  const std::vector<TensorSpec> specs = p.layout().specs();
  if (values.size() != specs.size()) {
    ThrowInvalid(absl::StrCat("set_values: unit '", p.name(), "' has ", specs.size(),
                              " tensors; got ", values.size(), " values"));
  }
  std::vector<Tensor> tensors;
  std::vector<const void*> pointers;
  for (size_t i = 0; i < specs.size(); ++i) {
    std::string what = absl::StrCat("set_values: value of '", specs[i].name, "'");
    Tensor t = ToTensor(values[i], what.c_str(), false, Device::Host());
    size_t numel = 1;
    for (int64_t d : specs[i].shape) numel *= static_cast<size_t>(d);
    if (t.dtype != specs[i].dtype || t.numel != numel) {
      ThrowInvalid(absl::StrCat(what, " is ", DTypeName(t.dtype), " with ", t.numel,
                                " elements; the unit wants ", DTypeName(specs[i].dtype), " with ",
                                numel));
    }
    pointers.push_back(t.data);
    tensors.push_back(std::move(t));
  }
  absl::Status status;
  {
    nb::gil_scoped_release release;
    status = p.SetShardFromTensors(pointers);
  }
  ThrowIfError(status);
}

template <absl::Status (Scheduler::*Hook)(int)>
void UnitHook(PyScheduler& s, int unit) {
  absl::Status status;
  {
    nb::gil_scoped_release release;
    status = (s.scheduler.get()->*Hook)(unit);
  }
  ThrowIfError(status);
}

template <absl::Status (Scheduler::*Hook)()>
void StepHook(PyScheduler& s) {
  absl::Status status;
  {
    nb::gil_scoped_release release;
    status = (s.scheduler.get()->*Hook)();
  }
  ThrowIfError(status);
}

std::optional<double> Seconds(const std::optional<absl::Duration>& d) {
  if (!d.has_value()) return std::nullopt;
  return absl::ToDoubleSeconds(*d);
}

// A unit of a scheduler, as an object: its id and name, and the per-unit calls. Converts to its
// id (__index__), so it can be passed wherever the scheduler takes a unit.
struct PyUnit {
  nb::object scheduler;  // the PyScheduler
  int id = 0;
};

}  // namespace

Scheduler& SchedulerOf(nb::handle scheduler) {
  return *nb::cast<PyScheduler&>(scheduler).scheduler;
}

void RegisterScheduler(nb::module_& m) {
  nb::class_<UnitStepMetrics>(m, "UnitStepMetrics")
      .def_ro("name", &UnitStepMetrics::name)
      .def_ro("gathers", &UnitStepMetrics::gathers)
      .def_ro("prefetched", &UnitStepMetrics::prefetched)
      .def_ro("reductions", &UnitStepMetrics::reductions)
      .def_ro("bytes_gathered", &UnitStepMetrics::bytes_gathered)
      .def_ro("bytes_reduced", &UnitStepMetrics::bytes_reduced)
      .def_prop_ro(
          "exposed_wait", [](const UnitStepMetrics& u) { return Seconds(u.exposed_wait); },
          "Seconds the compute waited for this unit's gathers.");

  nb::class_<StepMetrics>(m, "StepMetrics", "What the last finished step did (scheduler.h).")
      .def_ro("step", &StepMetrics::step)
      .def_ro("bytes_gathered", &StepMetrics::bytes_gathered)
      .def_ro("bytes_reduced", &StepMetrics::bytes_reduced)
      .def_ro("budget_bytes", &StepMetrics::budget_bytes)
      .def_ro("budget_units", &StepMetrics::budget_units)
      .def_ro("peak_inflight_bytes", &StepMetrics::peak_inflight_bytes)
      .def_ro("peak_inflight_units", &StepMetrics::peak_inflight_units)
      .def_ro("budget_overshoots", &StepMetrics::budget_overshoots)
      .def_ro("deferred_prefetches", &StepMetrics::deferred_prefetches)
      .def_ro("accumulated_grad_bytes", &StepMetrics::accumulated_grad_bytes)
      .def_ro("gather_pool_peak_bytes", &StepMetrics::gather_pool_peak_bytes)
      .def_ro("reduce_pool_peak_bytes", &StepMetrics::reduce_pool_peak_bytes)
      .def_ro("order_deviations", &StepMetrics::order_deviations)
      .def_prop_ro("step_time", [](const StepMetrics& s) { return Seconds(s.step_time); })
      .def_prop_ro("exposed_communication",
                   [](const StepMetrics& s) { return Seconds(s.exposed_communication); })
      .def_prop_ro("communication_time",
                   [](const StepMetrics& s) { return Seconds(s.communication_time); })
      .def_ro("overlap_fraction", &StepMetrics::overlap_fraction)
      .def_prop_ro("host_hook_time",
                   [](const StepMetrics& s) { return absl::ToDoubleSeconds(s.host_hook_time); })
      .def_ro("hook_calls", &StepMetrics::hook_calls)
      .def_ro("units", &StepMetrics::units)
      .def("__str__", &StepMetrics::ToString);

  nb::class_<PyScheduler>(
      m, "Scheduler",
      "The FSDP scheduler over a world communicator, computing on the calling thread.")
      .def("__init__", &Create, nb::arg("world"), nb::kw_only(), nb::arg("strategy") = "full_shard",
           nb::arg("shard_size") = 0, nb::arg("forward_prefetch") = 1,
           nb::arg("backward_prefetch") = "before_grad", nb::arg("backward_prefetch_depth") = 1,
           nb::arg("forward_order") = std::vector<int>(), nb::arg("budget_bytes") = 0,
           nb::arg("budget_units") = 0, nb::arg("root_unit") = 0, nb::arg("cpu_offload") = false,
           nb::arg("param_dtype") = "float32", nb::arg("reduce_dtype") = "float32",
           nb::arg("keep_low_precision_grads") = false, nb::arg("name") = "fsdp",
           nb::arg("trace") = nb::none(), nb::arg("framework") = "numpy",
           nb::arg("timeout") = nb::none(), nb::arg("time_communication") = true,
           nb::arg("replicate") = nb::none(), nb::arg("device") = "cpu",
           nb::arg("compute_stream") = 0,
           "world: the communicator the strategy splits into a mesh; with replicate (a "
           "Communicator over this rank's peers of the other replica groups, as an "
           "ElasticRound's), world is the shard group and the mesh is (shard, replicate), "
           "strategy hybrid_shard (shard_size is then the shard group's). device: 'cpu' (the "
           "calling thread computes) or 'cuda:N' (compute_stream, a cudaStream_t as an int such "
           "as torch's Stream.cuda_stream, 0 for the legacy default stream, is wrapped: hooks "
           "enqueue waits on it and return; world and replicate must move cuda:N memory).")
      .def("register_unit", &RegisterUnit, nb::arg("name"), nb::arg("tensors"),
           nb::arg("reshard_after_forward") = nb::none(), nb::arg("reduce_op") = "avg",
           "Registers a unit of float32 tensors [(name, shape) or (name, shape, tied_to)]; "
           "returns its id. Same units in the same order on every rank.")
      .def("set_values", &SetValues, nb::arg("unit"), nb::arg("values"),
           "Initial values: this rank keeps its shard of them (one array per tensor).")
      .def("pre_forward", &UnitHook<&Scheduler::PreForward>, nb::arg("unit"))
      .def("post_forward", &UnitHook<&Scheduler::PostForward>, nb::arg("unit"))
      .def("end_forward", &StepHook<&Scheduler::EndForward>)
      .def("pre_backward", &UnitHook<&Scheduler::PreBackward>, nb::arg("unit"))
      .def("post_backward", &UnitHook<&Scheduler::PostBackward>, nb::arg("unit"))
      .def("finish_backward", &StepHook<&Scheduler::FinishBackward>)
      .def("zero_grad", &StepHook<&Scheduler::ZeroGrad>)
      .def(
          "set_post_optimizer_event",
          [](PyScheduler& s, uintptr_t cuda_event, nb::object keep_alive) {
            if (!s.device.is_cuda()) {
              ThrowInvalid(
                  "set_post_optimizer_event: a CPU scheduler's optimizer has finished when it "
                  "returns; the event is for device='cuda:N'");
            }
            if (cuda_event == 0) ThrowInvalid("set_post_optimizer_event: the event is null");
#ifdef SHARDLINE_WITH_CUDA
            std::shared_ptr<Event> event =
                Unwrap(WrapCudaEvent(reinterpret_cast<cudaEvent_t>(cuda_event), s.device.index()));
            s.post_optimizer = std::move(keep_alive);
            s.scheduler->SetPostOptimizerEvent(std::move(event));
#else
            (void)keep_alive;
            throw StatusError(absl::UnimplementedError(
                "set_post_optimizer_event: this shardline was built without CUDA"));
#endif
          },
          nb::arg("cuda_event"), nb::arg("keep_alive") = nb::none(),
          "The next step's gathers and reductions wait for this CUDA event (a cudaEvent_t as an "
          "int, recorded after the optimizer's last write of the master shards) instead of the "
          "compute stream (FSDP2's set_post_optim_event); once, for the next step. keep_alive "
          "(the framework's event object) is held until a later call replaces it.")
      .def(
          "clip_grad_norm",
          [](PyScheduler& s, double max_norm, std::optional<double> timeout_s) {
            absl::Time deadline = DeadlineIn(timeout_s);
            absl::StatusOr<double> norm;
            {
              nb::gil_scoped_release release;
              norm = s.scheduler->ClipGradNorm(max_norm, deadline);
            }
            return Unwrap(std::move(norm));
          },
          nb::arg("max_norm"), nb::arg("timeout") = nb::none(),
          "Clips the sharded gradients by their global L2 norm; returns the norm before.")
      .def(
          "set_budget",
          [](PyScheduler& s, size_t bytes, int units) {
            ThrowIfError(s.scheduler->SetBudget(bytes, units));
          },
          nb::arg("bytes"), nb::arg("units") = 0)
      .def(
          "set_requires_gradient_sync",
          [](PyScheduler& s, bool sync) { s.scheduler->SetRequiresGradientSync(sync); },
          nb::arg("sync"))
      .def(
          "set_requires_all_reduce",
          [](PyScheduler& s, bool all_reduce) { s.scheduler->SetRequiresAllReduce(all_reduce); },
          nb::arg("all_reduce"))
      .def(
          "set_reshard_after_backward",
          [](PyScheduler& s, int unit, bool reshard) {
            ThrowIfError(s.scheduler->SetReshardAfterBackward(unit, reshard));
          },
          nb::arg("unit"), nb::arg("reshard"),
          "False: after a backward that does not reduce, the unit stays gathered into the next "
          "forward (scheduler.h).")
      .def(
          "params",
          [](PyScheduler& s, int unit) {
            CheckUnit(s, unit, "params");
            FlatParameter& p = s.scheduler->unit(unit);
            nb::list out;
            for (int t = 0; t < p.layout().num_tensors(); ++t) {
              out.append(FromTensorView(s, Unwrap(p.View(t))));
            }
            return out;
          },
          nb::arg("unit"),
          "The unit's unsharded parameters, one view per tensor (between pre_forward and "
          "post_forward, or pre_backward and post_backward).")
      .def(
          "grads",
          [](PyScheduler& s, int unit) {
            CheckUnit(s, unit, "grads");
            FlatParameter& p = s.scheduler->unit(unit);
            nb::list out;
            for (int t = 0; t < p.layout().num_tensors(); ++t) {
              out.append(FromTensorView(s, Unwrap(p.GradView(t))));
            }
            return out;
          },
          nb::arg("unit"),
          "The unit's unsharded gradients (between pre_backward and post_backward): add into "
          "them, never overwrite.")
      .def(
          "master_shard",
          [](PyScheduler& s, int unit) {
            CheckUnit(s, unit, "master_shard");
            FlatParameter& p = s.scheduler->unit(unit);
            return FromShardView(s, p.master_shard(), p.master_device());
          },
          nb::arg("unit"), "This rank's master shard (1-D): the optimizer steps on it.")
      .def(
          "shard_grad",
          [](PyScheduler& s, int unit) {
            CheckUnit(s, unit, "shard_grad");
            FlatParameter& p = s.scheduler->unit(unit);
            return FromShardView(s, Unwrap(p.ShardGrad()), p.master_device());
          },
          nb::arg("unit"), "This rank's sharded gradient (1-D), after finish_backward.")
      .def(
          "shard_slices",
          [](PyScheduler& s, int unit) {
            CheckUnit(s, unit, "shard_slices");
            FlatParameter& p = s.scheduler->unit(unit);
            std::vector<std::tuple<std::string, size_t, size_t, size_t>> out;
            for (const ShardSlice& slice : p.layout().ShardSlices(p.shard_rank())) {
              out.emplace_back(p.layout().specs()[slice.tensor].name, slice.tensor_offset,
                               slice.shard_offset, slice.length);
            }
            return out;
          },
          nb::arg("unit"),
          "[(tensor, tensor_offset, shard_offset, length)]: which elements of which tensor this "
          "rank's shard holds.")
      .def(
          "metrics",
          [](PyScheduler& s, std::optional<double> timeout_s) {
            absl::Time deadline = DeadlineIn(timeout_s);
            absl::StatusOr<StepMetrics> metrics;
            {
              nb::gil_scoped_release release;
              metrics = s.scheduler->LastStepMetrics(deadline);
            }
            return Unwrap(std::move(metrics));
          },
          nb::arg("timeout") = nb::none(), "The last finished step's StepMetrics.")
      .def("unit_id",
           [](const PyScheduler& s, const std::string& name) {
             std::optional<int> id = s.scheduler->FindUnit(name);
             if (!id.has_value()) {
               throw StatusError(absl::NotFoundError(absl::StrCat("no unit named '", name, "'")));
             }
             return *id;
           })
      .def_prop_ro("num_units", [](const PyScheduler& s) { return s.scheduler->num_units(); })
      .def_prop_ro(
          "device", [](const PyScheduler& s) { return s.device.ToString(); },
          "The compute stream's device: 'host' or 'cuda:N'.")
      .def_prop_ro("steps", [](const PyScheduler& s) { return s.scheduler->steps(); })
      .def_prop_ro("forward_order",
                   [](const PyScheduler& s) { return s.scheduler->forward_order(); })
      .def_prop_ro("minimum_budget_bytes",
                   [](const PyScheduler& s) { return s.scheduler->MinimumBudgetBytes(); })
      .def_prop_ro("minimum_budget_units",
                   [](const PyScheduler& s) { return s.scheduler->MinimumBudgetUnits(); })
      .def_prop_ro("mesh", [](const PyScheduler& s) { return s.scheduler->mesh().ToString(); })
      .def_prop_ro("shard_rank",
                   [](const PyScheduler& s) { return s.scheduler->mesh().shard_rank(); })
      .def_prop_ro("shard_size",
                   [](const PyScheduler& s) { return s.scheduler->mesh().shard_size(); })
      .def_prop_ro("issue_log", [](const PyScheduler& s) { return s.scheduler->issue_log(); })
      .def(
          "unit",
          [](nb::handle self, nb::handle unit) {
            PyScheduler& s = nb::cast<PyScheduler&>(self);
            int id = 0;
            if (nb::isinstance<nb::str>(unit)) {
              std::string name = nb::cast<std::string>(unit);
              std::optional<int> found = s.scheduler->FindUnit(name);
              if (!found.has_value()) {
                throw StatusError(absl::NotFoundError(absl::StrCat("no unit named '", name, "'")));
              }
              id = *found;
            } else {
              id = nb::cast<int>(unit);
              CheckUnit(s, id, "unit");
            }
            return PyUnit{nb::borrow(self), id};
          },
          nb::arg("unit"), "The Unit object of a unit id or name.");

  // Per-unit calls on a Unit forward to the scheduler's.
  auto forward = [](const char* method) {
    return [method](const PyUnit& u) { return u.scheduler.attr(method)(u.id); };
  };
  nb::class_<PyUnit>(m, "Unit", "One registered unit of a Scheduler (Scheduler.unit(id or name)).")
      .def_ro("id", &PyUnit::id)
      .def_prop_ro("name",
                   [](const PyUnit& u) {
                     return nb::cast<PyScheduler&>(u.scheduler).scheduler->unit(u.id).name();
                   })
      .def_prop_ro("shard_elements",
                   [](const PyUnit& u) {
                     return nb::cast<PyScheduler&>(u.scheduler)
                         .scheduler->unit(u.id)
                         .layout()
                         .shard_elements();
                   })
      .def("__index__", [](const PyUnit& u) { return u.id; })
      .def("params", forward("params"))
      .def("grads", forward("grads"))
      .def("master_shard", forward("master_shard"))
      .def("shard_grad", forward("shard_grad"))
      .def("shard_slices", forward("shard_slices"))
      .def("pre_forward", forward("pre_forward"))
      .def("post_forward", forward("post_forward"))
      .def("pre_backward", forward("pre_backward"))
      .def("post_backward", forward("post_backward"))
      .def("__repr__", [](const PyUnit& u) {
        return absl::StrCat("<shardline.Unit ", u.id, " '",
                            nb::cast<PyScheduler&>(u.scheduler).scheduler->unit(u.id).name(), "'>");
      });
}

}  // namespace shardline::python
