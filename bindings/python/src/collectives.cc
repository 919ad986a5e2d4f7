// File: bindings/python/src/collectives.cc
// -----------------------------------------------------------------------------
// shardline._core: errors, tensors through DLPack, communicators and their collectives, Work,
// registered memory (empty/zeros), meshes and traces. The scheduler is in scheduler.cc. The
// package's __init__.py re-exports what users call.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bindings/python/src/common.h"
#include "collectives/bootstrap.h"
#include "collectives/local/local_communicator.h"
#include "collectives/process_mesh.h"
#include "runtime/allocator.h"
#include "runtime/config.h"
#include "runtime/trace.h"

namespace shardline::python {
namespace {

// ---- Errors --------------------------------------------------------------------------------

struct ErrorTypes {
  PyObject* base = nullptr;               // shardline.Error(Exception)
  PyObject* invalid_argument = nullptr;   // (Error, ValueError)
  PyObject* deadline_exceeded = nullptr;  // (Error, TimeoutError)
  PyObject* remote = nullptr;             // RemoteError(Error)
  PyObject* failed_precondition = nullptr;
  PyObject* not_found = nullptr;           // (Error, LookupError)
  PyObject* resource_exhausted = nullptr;  // (Error, MemoryError)
  PyObject* unimplemented = nullptr;       // (Error, NotImplementedError)
  PyObject* data_loss = nullptr;           // DataLossError(Error)
  PyObject* already_exists = nullptr;      // (Error, FileExistsError)
};
ErrorTypes errors;

PyObject* NewError(nb::module_& m, const char* name, PyObject* base, PyObject* builtin,
                   const char* doc) {
  std::string qualified = absl::StrCat("shardline.", name);
  PyObject* bases = builtin != nullptr ? PyTuple_Pack(2, base, builtin) : PyTuple_Pack(1, base);
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  Py_DECREF(bases);
  if (type == nullptr) throw nb::python_error();
  m.attr(name) = nb::handle(type);
  return type;
}

PyObject* ErrorTypeFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return IsPeerError(status) ? errors.remote : errors.invalid_argument;
    case absl::StatusCode::kDeadlineExceeded:
      return errors.deadline_exceeded;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted:
      return errors.remote;
    case absl::StatusCode::kFailedPrecondition:
      return IsPeerError(status) ? errors.remote : errors.failed_precondition;
    case absl::StatusCode::kNotFound:
      return errors.not_found;
    case absl::StatusCode::kResourceExhausted:
      return errors.resource_exhausted;
    case absl::StatusCode::kUnimplemented:
      return errors.unimplemented;
    case absl::StatusCode::kDataLoss:
      return IsPeerError(status) ? errors.remote : errors.data_loss;
    case absl::StatusCode::kAlreadyExists:
      return IsPeerError(status) ? errors.remote : errors.already_exists;
    default:
      return IsPeerError(status) ? errors.remote : errors.base;
  }
}

// A new exception object for `status` (its class per ErrorTypeFor, .code, .peer_error), or null
// with the Python error set if even that failed. `text` need not be UTF-8 (a manifest's bytes, a
// Latin-1 name): invalid bytes become U+FFFD, so the message and the class survive.
PyObject* MakeException(const absl::Status& status, const std::string& text) {
  PyObject* type = ErrorTypeFor(status);
  PyObject* message =
      PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace");
  PyObject* value = message != nullptr ? PyObject_CallOneArg(type, message) : nullptr;
  Py_XDECREF(message);
  if (value == nullptr) return nullptr;
  std::string code(absl::StatusCodeToString(status.code()));
  PyObject* code_text = PyUnicode_FromString(code.c_str());
  if (code_text == nullptr || PyObject_SetAttrString(value, "code", code_text) != 0 ||
      PyObject_SetAttrString(value, "peer_error", IsPeerError(status) ? Py_True : Py_False) != 0) {
    Py_XDECREF(code_text);
    Py_DECREF(value);
    return nullptr;
  }
  Py_DECREF(code_text);
  return value;
}

void RaiseStatus(const absl::Status& status, const std::string& text) {
  PyObject* value = MakeException(status, text);
  if (value == nullptr) return;  // the failure to build the exception is the error now
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(value)), value);
  Py_DECREF(value);
}

// ---- Tensors -------------------------------------------------------------------------------

std::optional<DType> FromDlpack(nb::dlpack::dtype t) {
  using Code = nb::dlpack::dtype_code;
  if (t.lanes != 1) return std::nullopt;
  const auto code = static_cast<Code>(t.code);
  if (code == Code::Float && t.bits == 32) return DType::kF32;
  if (code == Code::Float && t.bits == 64) return DType::kF64;
  if (code == Code::Float && t.bits == 16) return DType::kF16;
  if (code == Code::Bfloat && t.bits == 16) return DType::kBF16;
  if (code == Code::Int && t.bits == 8) return DType::kI8;
  if (code == Code::UInt && t.bits == 8) return DType::kU8;
  if (code == Code::Int && t.bits == 32) return DType::kI32;
  if (code == Code::Int && t.bits == 64) return DType::kI64;
  return std::nullopt;
}

nb::dlpack::dtype ToDlpack(DType dtype) {
  using Code = nb::dlpack::dtype_code;
  auto make = [](Code code, int bits) {
    nb::dlpack::dtype t;
    t.code = static_cast<uint8_t>(code);
    t.bits = static_cast<uint8_t>(bits);
    t.lanes = 1;
    return t;
  };
  switch (dtype) {
    case DType::kF32:
      return make(Code::Float, 32);
    case DType::kF64:
      return make(Code::Float, 64);
    case DType::kF16:
      return make(Code::Float, 16);
    case DType::kBF16:
      return make(Code::Bfloat, 16);
    case DType::kI8:
      return make(Code::Int, 8);
    case DType::kU8:
      return make(Code::UInt, 8);
    case DType::kI32:
      return make(Code::Int, 32);
    case DType::kI64:
      return make(Code::Int, 64);
  }
  return make(Code::Float, 32);
}

std::string DescribeDlpack(nb::dlpack::dtype t) {
  using Code = nb::dlpack::dtype_code;
  const char* kind = "code?";
  switch (static_cast<Code>(t.code)) {
    case Code::Int:
      kind = "int";
      break;
    case Code::UInt:
      kind = "uint";
      break;
    case Code::Float:
      kind = "float";
      break;
    case Code::Bfloat:
      kind = "bfloat";
      break;
    case Code::Complex:
      kind = "complex";
      break;
    case Code::Bool:
      kind = "bool";
      break;
    default:
      break;
  }
  return absl::StrCat(kind, static_cast<int>(t.bits),
                      t.lanes != 1 ? absl::StrCat("x", static_cast<int>(t.lanes)) : "");
}

Device DeviceOf(const nb::ndarray<nb::ro>& array) {
  if (array.device_type() == nb::device::cuda::value) return Device::Cuda(array.device_id());
  return Device::Host();
}

// ---- Works ---------------------------------------------------------------------------------

// A collective from Python: the C++ Work and the tensors it reads and writes. When the Python
// object goes away before the collective is done, the tensors move to `pending` and stay
// alive until a later call finds the collective done (or the interpreter exits: _drain).
struct PyWork {
  PyWork(Work w, std::vector<nb::object> k) : work(std::move(w)), keep(std::move(k)) {}
  // Movable only: nanobind moves the returned PyWork into its Python object, and the moved-from
  // one (no tensors left) must not park the collective in PendingWorks. (With the destructor
  // declared there would be no implicit move, and a copy would park a second entry.)
  PyWork(PyWork&& other) noexcept : work(std::move(other.work)), keep(std::move(other.keep)) {
    other.keep.clear();
  }
  PyWork& operator=(PyWork&&) = delete;
  PyWork(const PyWork&) = delete;
  PyWork& operator=(const PyWork&) = delete;
  ~PyWork();

  Work work;
  std::vector<nb::object> keep;
};

struct Pending {
  Work work;
  std::vector<nb::object> keep;
};

// The dropped Works not yet seen done, oldest first. Touched only with the GIL held.
struct PendingWorks {
  std::deque<Pending> works;
  // A full sweep runs when `works` reaches this size (twice what the last sweep left, at least
  // kMinSweep).
  size_t sweep_at = kMinSweep;
  static constexpr size_t kMinSweep = 64;
};
PendingWorks& Pendings() {
  static auto* pending = new PendingWorks();
  return *pending;
}

// Releases the tensors of dropped Works that are done. Every issue calls it, so it must not cost
// a pass over all of them: a loop issuing collectives back to back drops each Work while it is
// still queued, and checking a Work takes two locks its stream's worker also takes. It drops the
// done ones from the front (collectives on one stream finish in issue order) and sweeps the whole
// list only when it has doubled since the last sweep: amortised O(1) per call. A done Work behind
// one still running (another stream) keeps its tensors until then — longer, never shorter.
void CollectPending(bool full = false) {
  PendingWorks& p = Pendings();
  while (!p.works.empty() && p.works.front().work.IsCompleted()) p.works.pop_front();
  if (full || p.works.size() >= p.sweep_at) {
    std::erase_if(p.works, [](const Pending& w) { return w.work.IsCompleted(); });
    p.sweep_at = std::max(PendingWorks::kMinSweep, 2 * p.works.size());
  }
}

PyWork::~PyWork() {
  if (!keep.empty() && !work.IsCompleted()) {
    Pendings().works.push_back({std::move(work), std::move(keep)});
  }
}

// Waits (GIL released) for every collective whose Work was dropped; the interpreter's exit calls
// it before the tensors go. Returns how many did not finish by the deadline.
int DrainPending(std::optional<double> timeout_s) {
  const absl::Time deadline = DeadlineIn(timeout_s);
  std::deque<Pending> pending = std::move(Pendings().works);
  Pendings().works.clear();
  Pendings().sweep_at = PendingWorks::kMinSweep;
  int unfinished = 0;
  {
    nb::gil_scoped_release release;
    for (Pending& p : pending) {
      if (!p.work.Wait(deadline).ok() && !p.work.IsCompleted()) ++unfinished;
    }
  }
  for (Pending& p : pending) {
    // A collective still running keeps its tensors for good (never freed under a writer).
    if (!p.work.IsCompleted()) {
      for (nb::object& o : p.keep) o.release();
    }
  }
  return unfinished;
}

// The collectives whose wait() gave up while they kept running, with that error; unfinished
// ones are aborted at exit (ExitCleanup). Touched only with the GIL held; finished entries go
// whenever one is added.
struct TimedOut {
  Work work;
  std::string error;
};
std::vector<TimedOut>& TimedOutWorks() {
  static auto* works = new std::vector<TimedOut>();
  return *works;
}

void NoteTimedOut(const Work& work, const absl::Status& error) {
  std::vector<TimedOut>& works = TimedOutWorks();
  std::erase_if(works, [](const TimedOut& t) { return t.work.IsCompleted(); });
  for (TimedOut& t : works) {
    if (t.work.event() == work.event()) {
      t.error = std::string(error.message());  // the latest wait's view of it
      return;
    }
  }
  works.push_back({work, std::string(error.message())});
  // The package's exit handler was registered when it was imported, so it runs after those of
  // adapters imported later (atexit runs the latest first), which may wait on these collectives
  // (the torch adapter's futures): the aborts get a handler of their own, registered now.
  static bool registered = false;
  if (!registered) {
    registered = true;
    try {
      nb::module_::import_("atexit").attr("register")(
          nb::module_::import_("shardline").attr("_abort_timed_out"));
    } catch (const nb::python_error&) {
      // No package (the module imported alone): its exit handler, if any, still aborts them.
    }
  }
}

// Step 1 of ExitCleanup: aborts the communicator of every collective whose wait() timed out and
// that is still unfinished. Returns a line per abort.
std::vector<std::string> AbortTimedOut() {
  std::vector<std::string> report;
  std::vector<TimedOut> timed_out = std::move(TimedOutWorks());
  TimedOutWorks().clear();
  for (const TimedOut& t : timed_out) {
    if (t.work.IsCompleted()) continue;
    absl::Status reason = absl::AbortedError(
        absl::StrCat("aborted at interpreter exit after a wait() gave up on it: ", t.error));
    report.push_back(absl::StrCat("shardline: ", reason.message()));
    nb::gil_scoped_release release;  // the abort tells the peers
    t.work.Abort(std::move(reason));
  }
  return report;
}

// What the interpreter's exit does (the package's atexit handler), in this order:
//   1. aborts the communicator of every collective whose wait() timed out and that is still
//      unfinished: nobody here waits for it any more, and its peers are late or gone; the abort
//      fails what is queued behind it at once and tells the peers;
//   2. finishes every background checkpoint save (each bounded by its own deadline);
//   3. drains the collectives whose Work was dropped (a peer may still wait on them), until
//      `drain_timeout_s`; communicators already aborted (a dead peer, step 1) fail theirs at once.
// Returns a line for each abort, failed save and undrained collective, for stderr.
std::vector<std::string> ExitCleanup(std::optional<double> drain_timeout_s) {
  std::vector<std::string> report = AbortTimedOut();
  for (std::string& line : FinishBackgroundSaves()) report.push_back(std::move(line));
  const int unfinished = DrainPending(drain_timeout_s);
  if (unfinished > 0) {
    report.push_back(absl::StrCat("shardline: ", unfinished,
                                  " collective(s) whose Work was dropped were still running at "
                                  "exit; their tensors are left allocated"));
  }
  return report;
}

PyWork MakeWork(absl::StatusOr<Work> work, std::vector<nb::object> keep) {
  CollectPending();
  return PyWork{Unwrap(std::move(work)), std::move(keep)};
}

void WaitWork(const PyWork& w, std::optional<double> timeout_s) {
  absl::Status status;
  {
    nb::gil_scoped_release release;
    status = w.work.Wait(DeadlineIn(timeout_s));
  }
  if (absl::IsDeadlineExceeded(status) && !w.work.IsCompleted()) NoteTimedOut(w.work, status);
  ThrowIfError(status);
}

// ---- Collectives ---------------------------------------------------------------------------

ReduceOp ParseOp(const std::string& op) { return Unwrap(ParseReduceOp(op)); }

void SameDType(const Tensor& a, const Tensor& b, const char* fn) {
  if (a.dtype != b.dtype) {
    ThrowInvalid(
        absl::StrCat(fn, ": output is ", DTypeName(b.dtype), " but input is ", DTypeName(a.dtype)));
  }
}

Stream& StreamFor(PyComm& c, Stream* stream) { return stream != nullptr ? *stream : *c.stream; }

PyWork AllGather(PyComm& c, nb::handle output, nb::handle input, Stream* stream) {
  Tensor in = ToTensor(input, "all_gather input", false, c.comm->device());
  Tensor out = ToTensor(output, "all_gather output", true, c.comm->device());
  SameDType(in, out, "all_gather");
  if (out.numel != in.numel * static_cast<size_t>(c.comm->size())) {
    ThrowInvalid(absl::StrCat("all_gather: output has ", out.numel, " elements; it needs input's ",
                              in.numel, " x ", c.comm->size(),
                              " ranks = ", in.numel * c.comm->size()));
  }
  absl::StatusOr<Work> work;
  {
    nb::gil_scoped_release release;
    work = c.comm->AllGather(in.data, out.data, in.numel, in.dtype, StreamFor(c, stream));
  }
  return MakeWork(std::move(work), {in.owner, out.owner});
}

PyWork ReduceScatter(PyComm& c, nb::handle output, nb::handle input, const std::string& op,
                     Stream* stream) {
  Tensor in = ToTensor(input, "reduce_scatter input", false, c.comm->device());
  Tensor out = ToTensor(output, "reduce_scatter output", true, c.comm->device());
  SameDType(in, out, "reduce_scatter");
  if (in.numel != out.numel * static_cast<size_t>(c.comm->size())) {
    ThrowInvalid(absl::StrCat("reduce_scatter: input has ", in.numel,
                              " elements; it needs output's ", out.numel, " x ", c.comm->size(),
                              " ranks = ", out.numel * c.comm->size()));
  }
  ReduceOptions options;
  options.op = ParseOp(op);
  absl::StatusOr<Work> work;
  {
    nb::gil_scoped_release release;
    work = c.comm->ReduceScatter(in.data, out.data, out.numel, in.dtype, StreamFor(c, stream),
                                 options);
  }
  return MakeWork(std::move(work), {in.owner, out.owner});
}

PyWork AllReduce(PyComm& c, nb::handle tensor, const std::string& op, nb::handle output,
                 Stream* stream) {
  const bool in_place = output.is_none();
  Tensor in = ToTensor(tensor, "all_reduce tensor", in_place, c.comm->device());
  Tensor out = in_place ? in : ToTensor(output, "all_reduce output", true, c.comm->device());
  if (!in_place) {
    SameDType(in, out, "all_reduce");
    if (in.numel != out.numel) {
      ThrowInvalid(absl::StrCat("all_reduce: output has ", out.numel, " elements but tensor has ",
                                in.numel));
    }
  }
  ReduceOptions options;
  options.op = ParseOp(op);
  absl::StatusOr<Work> work;
  {
    nb::gil_scoped_release release;
    work = c.comm->AllReduce(in.data, out.data, in.numel, in.dtype, StreamFor(c, stream), options);
  }
  return MakeWork(std::move(work), {in.owner, out.owner});
}

PyWork Broadcast(PyComm& c, nb::handle tensor, int root, Stream* stream) {
  Tensor t = ToTensor(tensor, "broadcast tensor", true, c.comm->device());
  BroadcastOptions options;
  options.root = root;
  absl::StatusOr<Work> work;
  {
    nb::gil_scoped_release release;
    work = c.comm->Broadcast(t.data, t.numel, t.dtype, StreamFor(c, stream), options);
  }
  return MakeWork(std::move(work), {t.owner});
}

PyWork AllToAll(PyComm& c, nb::handle output, nb::handle input, Stream* stream) {
  Tensor in = ToTensor(input, "all_to_all input", false, c.comm->device());
  Tensor out = ToTensor(output, "all_to_all output", true, c.comm->device());
  SameDType(in, out, "all_to_all");
  const size_t size = static_cast<size_t>(c.comm->size());
  if (in.numel != out.numel || in.numel % size != 0) {
    ThrowInvalid(
        absl::StrCat("all_to_all: input and output need the same number of elements, a "
                     "multiple of the ",
                     size, " ranks; they have ", in.numel, " and ", out.numel));
  }
  absl::StatusOr<Work> work;
  {
    nb::gil_scoped_release release;
    work = c.comm->AllToAll(in.data, out.data, in.numel / size, in.dtype, StreamFor(c, stream));
  }
  return MakeWork(std::move(work), {in.owner, out.owner});
}

PyWork Barrier(PyComm& c, Stream* stream) {
  absl::StatusOr<Work> work;
  {
    nb::gil_scoped_release release;
    work = c.comm->Barrier(StreamFor(c, stream));
  }
  return MakeWork(std::move(work), {});
}

// ---- Meshes --------------------------------------------------------------------------------

struct PyMesh {
  ProcessMesh mesh;
  nb::object shard;      // PyComm
  nb::object replicate;  // PyComm
};

// ---- Joining -------------------------------------------------------------------------------

// A communicator's timeout argument: seconds > 0 (InvalidArgument naming `fn` otherwise).
absl::Duration PositiveTimeout(double seconds, const char* fn) {
  if (std::isnan(seconds))
    ThrowInvalid(absl::StrCat(fn, ": timeout is NaN, not a number of seconds"));
  if (!(seconds > 0)) ThrowInvalid(absl::StrCat(fn, ": timeout ", seconds, " s is not > 0"));
  return absl::Seconds(seconds);
}

PyComm Init(const std::string& backend, std::optional<int> rank, std::optional<int> world_size,
            std::optional<std::string> address, std::optional<double> timeout_s,
            const std::string& name) {
  InitOptions options;
  options.backend = backend;
  options.name = name;
  if (timeout_s.has_value()) options.timeout = PositiveTimeout(*timeout_s, "init");
  if (rank.has_value() || world_size.has_value() || address.has_value()) {
    if (!rank.has_value() || !world_size.has_value()) {
      ThrowInvalid(
          "init: give rank and world_size together (or neither, to read the launcher's "
          "environment)");
    }
    LaunchInfo launch;
    absl::StatusOr<LaunchInfo> env = ReadLaunchEnvironment();
    if (env.ok()) launch = *env;  // keeps the address and the local ranks when set
    launch.rank = *rank;
    launch.world_size = *world_size;
    launch.launcher = "explicit";
    if (!env.ok()) {
      launch.local_rank = *rank;
      launch.local_world_size = *world_size;
    }
    if (address.has_value()) {
      const size_t colon = address->rfind(':');
      int port = 0;
      if (colon == std::string::npos || colon == 0 ||
          !absl::SimpleAtoi(address->substr(colon + 1), &port) || port <= 0 || port > 65535) {
        ThrowInvalid(absl::StrCat("init: address '", *address, "' is not host:port"));
      }
      launch.master_addr = address->substr(0, colon);
      launch.master_port = port;
    }
    options.launch = launch;
  }
  absl::StatusOr<ProcessGroup> group;
  {
    nb::gil_scoped_release release;
    group = InitProcessGroup(options);
  }
  ProcessGroup joined = Unwrap(std::move(group));
  return PyComm(joined.world, joined.store);
}

std::vector<PyComm> InitLocal(int size, std::optional<double> timeout_s) {
  if (size < 1) ThrowInvalid(absl::StrCat("init_local: size ", size, " < 1"));
  LocalOptions options;
  if (timeout_s.has_value()) options.timeout = PositiveTimeout(*timeout_s, "init_local");
  std::vector<std::shared_ptr<Communicator>> comms =
      Unwrap(CreateLocalCommunicators(size, options));
  std::vector<PyComm> out;
  out.reserve(comms.size());
  for (auto& comm : comms) out.emplace_back(comm, nullptr);
  return out;
}

// ---- Registered memory ---------------------------------------------------------------------

// shardline's shareable host allocator: allocations of at least SHARDLINE_HOST_SHAREABLE_BYTES
// are blocks of the shareable arenas, which peers on the host map once and copy from directly.
// Never destroyed (its buffers may outlive any module teardown order).
Allocator& HostMemory() {
  static Allocator* allocator = CreateShareableHostAllocator(64, "python").release();
  return *allocator;
}

nb::object Empty(const std::vector<int64_t>& shape, const std::string& dtype_name,
                 const std::string& framework, bool zero) {
  const DType dtype = Unwrap(ParseDType(dtype_name));
  size_t numel = 1;
  std::vector<size_t> dims;
  for (int64_t d : shape) {
    if (d < 0) ThrowInvalid(absl::StrCat("empty: negative dimension ", d));
    numel *= static_cast<size_t>(d);
    dims.push_back(static_cast<size_t>(d));
  }
  if (framework != "numpy" && framework != "torch") {
    ThrowInvalid(absl::StrCat("empty: framework '", framework, "' is not 'numpy' or 'torch'"));
  }
  if (framework == "numpy" && dtype == DType::kBF16) {
    ThrowInvalid("empty: numpy has no bfloat16; use framework='torch'");
  }
  const size_t bytes = std::max<size_t>(numel * DTypeSize(dtype), 1);
  Buffer buffer = Unwrap(HostMemory().Allocate(bytes));
  if (zero) std::memset(buffer.data(), 0, bytes);
  void* data = buffer.data();
  auto* owned = new Buffer(std::move(buffer));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<Buffer*>(p); });
  if (framework == "torch") {
    return nb::ndarray<nb::pytorch>(data, dims.size(), dims.data(), owner, nullptr, ToDlpack(dtype),
                                    nb::device::cpu::value, 0)
        .cast();
  }
  return nb::ndarray<nb::numpy>(data, dims.size(), dims.data(), owner, nullptr, ToDlpack(dtype),
                                nb::device::cpu::value, 0)
      .cast();
}

}  // namespace

// ---- Shared helpers --------------------------------------------------------------------------

void ThrowInvalid(std::string message) {
  throw StatusError(absl::InvalidArgumentError(std::move(message)));
}

absl::Time DeadlineIn(std::optional<double> timeout_s) {
  if (timeout_s.has_value()) {
    if (std::isnan(*timeout_s)) ThrowInvalid("timeout is NaN, not a number of seconds");
    if (*timeout_s < 0) ThrowInvalid(absl::StrCat("timeout ", *timeout_s, " s is negative"));
    return absl::Now() + absl::Seconds(*timeout_s);
  }
  return DefaultDeadline();
}

void RegisterErrors(nb::module_& m) {
  errors.base = NewError(m, "Error", PyExc_Exception, nullptr,
                         "Base of shardline's errors: the message is the Status text; .code is "
                         "the Status code's name, .peer_error whether a peer caused it.");
  errors.invalid_argument = NewError(m, "InvalidArgumentError", errors.base, PyExc_ValueError,
                                     "A bad argument (Status InvalidArgument or OutOfRange).");
  errors.deadline_exceeded = NewError(m, "DeadlineExceededError", errors.base, PyExc_TimeoutError,
                                      "A wait passed its deadline (Status DeadlineExceeded).");
  errors.remote = NewError(m, "RemoteError", errors.base, nullptr,
                           "A dead, aborted or disagreeing peer (Unavailable, Aborted, or an error "
                           "a peer caused).");
  errors.failed_precondition =
      NewError(m, "FailedPreconditionError", errors.base, PyExc_RuntimeError,
               "A call out of order (Status FailedPrecondition).");
  errors.not_found = NewError(m, "NotFoundError", errors.base, PyExc_LookupError,
                              "Something named was not found (Status NotFound).");
  errors.resource_exhausted =
      NewError(m, "ResourceExhaustedError", errors.base, PyExc_MemoryError,
               "Memory or another resource ran out (Status ResourceExhausted).");
  errors.unimplemented = NewError(m, "UnimplementedError", errors.base, PyExc_NotImplementedError,
                                  "Not supported here (Status Unimplemented).");
  errors.data_loss = NewError(m, "DataLossError", errors.base, nullptr,
                              "Stored data is damaged: a truncated file, a checksum mismatch "
                              "(Status DataLoss).");
  errors.already_exists = NewError(m, "AlreadyExistsError", errors.base, PyExc_FileExistsError,
                                   "What the call would create exists (Status AlreadyExists).");
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      RaiseStatus(e.status(), e.text());
    }
  });
}

Tensor ToTensor(nb::handle obj, const char* what, bool writable, Device device) {
  // One DLPack import per tensor (each is a __dlpack__ call: about 3 us for a torch tensor): a
  // writable ndarray<> refuses read-only memory by itself; only when it fails does a read-only
  // import tell "read-only" from "not a tensor".
  nb::ndarray<nb::ro> array;
  bool imported = false;
  if (writable) {
    nb::ndarray<> rw;
    imported = nb::try_cast(obj, rw, /*convert=*/false);
    if (imported) array = nb::ndarray<nb::ro>(rw);
  }
  if (!imported && !nb::try_cast(obj, array, /*convert=*/false)) {
    // A tensor whose dtype DLPack cannot describe (numpy's float128, object arrays, ...).
    if (nb::hasattr(obj, "__dlpack__") && nb::hasattr(obj, "dtype")) {
      std::string dtype = "?";
      if (PyObject* dtype_obj = PyObject_GetAttrString(obj.ptr(), "dtype")) {
        if (PyObject* text = PyObject_Str(dtype_obj)) {
          if (const char* utf8 = PyUnicode_AsUTF8(text)) dtype = utf8;
          Py_DECREF(text);
        }
        Py_DECREF(dtype_obj);
      }
      PyErr_Clear();
      ThrowInvalid(absl::StrCat(what, " has dtype ", dtype,
                                ", which DLPack cannot export; shardline moves float32, float64, "
                                "float16, bfloat16, int8, uint8, int32 and int64"));
    }
    ThrowInvalid(absl::StrCat(what, " is a ", nb::type_name(obj.type()).c_str(),
                              ", not a tensor (numpy, torch, jax: anything with __dlpack__)"));
  }
  if (writable && !imported) {
    ThrowInvalid(absl::StrCat(what, " is read-only; the collective writes it"));
  }
  std::optional<DType> dtype = FromDlpack(array.dtype());
  if (!dtype.has_value()) {
    ThrowInvalid(absl::StrCat(what, " has dtype ", DescribeDlpack(array.dtype()),
                              "; shardline moves float32, float64, float16, bfloat16, int8, "
                              "uint8, int32 and int64"));
  }
  // C-contiguous: strides (in elements) are the suffix products of the shape; dimensions of size
  // 1 may have any stride. An empty tensor has no layout to check (numpy exports stride 0 for
  // it); count 0 is a legal collective.
  int64_t expected = 1;
  for (size_t i = array.size() == 0 ? 0 : array.ndim(); i-- > 0;) {
    if (array.shape(i) != 1 && array.stride(i) != expected) {
      ThrowInvalid(absl::StrCat(what, " is not C-contiguous (dimension ", i, " has stride ",
                                array.stride(i), ", expected ", expected,
                                "); pass a contiguous copy"));
    }
    expected *= static_cast<int64_t>(array.shape(i));
  }
  const Device where = DeviceOf(array);
  if (where != device) {
    ThrowInvalid(absl::StrCat(what, " is on ", where.ToString(), " but the communicator moves ",
                              device.ToString(), " memory"));
  }
  Tensor t;
  t.data = const_cast<void*>(array.data());
  t.numel = array.size();
  t.dtype = *dtype;
  t.device = where;
  t.owner = nb::borrow(obj);
  return t;
}

PyComm::PyComm(std::shared_ptr<Communicator> c, std::shared_ptr<Store> s)
    : store(std::move(s)), comm(std::move(c)) {
  stream = Unwrap(CreateStream(comm->device(), {.name = absl::StrCat(comm->name(), ".python")}));
}

void RegisterCollectives(nb::module_& m) {
  nb::class_<Stream>(m, "Stream",
                     "A shardline stream: work enqueued on it runs in order on its own worker.")
      .def_prop_ro("name", [](const Stream& s) { return s.name(); })
      .def(
          "synchronize",
          [](Stream& s, std::optional<double> timeout_s) {
            absl::Time deadline = DeadlineIn(timeout_s);
            absl::Status status;
            {
              nb::gil_scoped_release release;
              status = s.Synchronize(deadline);
            }
            ThrowIfError(status);
          },
          nb::arg("timeout") = nb::none(),
          "Blocks (GIL released) until everything enqueued so far is done.");
  m.def(
      "host_stream",
      [](const std::string& name) { return Unwrap(CreateHostStream({.name = name})).release(); },
      nb::arg("name") = "python", nb::rv_policy::take_ownership,
      "A new host stream: collectives issued on it run on its worker thread.");

  nb::class_<PyWork>(m, "Work",
                     "One issued collective. Keeps its tensors alive until the collective is "
                     "done, even if this object is dropped first.")
      .def("wait", &WaitWork, nb::arg("timeout") = nb::none(),
           "Blocks (GIL released) until the collective is done; raises its error. timeout: "
           "seconds (default SHARDLINE_TIMEOUT_S); past it, DeadlineExceededError (the "
           "collective keeps running).")
      .def(
          "is_completed", [](const PyWork& w) { return w.work.IsCompleted(); },
          "True once the collective finished, successfully or not.")
      .def(
          "exception",
          [](const PyWork& w) -> nb::object {
            absl::Status status = w.work.status();
            if (status.ok()) return nb::none();
            StatusError error(status);
            PyObject* value = MakeException(status, error.text());
            if (value == nullptr) throw nb::python_error();
            return nb::steal(value);
          },
          "The collective's error as an exception object (not raised), or None.");

  nb::class_<PyComm>(m, "Communicator",
                     "A group of ranks. Collectives take DLPack tensors (numpy, torch, jax), "
                     "return a Work at once and run on the communicator's shardline stream.")
      .def_prop_ro("rank", [](const PyComm& c) { return c.comm->rank(); })
      .def_prop_ro("size", [](const PyComm& c) { return c.comm->size(); })
      .def_prop_ro("backend", [](const PyComm& c) { return std::string(c.comm->backend()); })
      .def_prop_ro("name", [](const PyComm& c) { return c.comm->name(); })
      .def_prop_ro("device", [](const PyComm& c) { return c.comm->device().ToString(); })
      .def_prop_ro("timeout",
                   [](const PyComm& c) { return absl::ToDoubleSeconds(c.comm->timeout()); })
      .def_prop_ro(
          "stream", [](PyComm& c) -> Stream& { return *c.stream; },
          nb::rv_policy::reference_internal)
      .def("all_gather", &AllGather, nb::arg("output"), nb::arg("input"),
           nb::arg("stream") = nb::none(),
           "output (size x input's elements) := every rank's input, in rank order. In place when "
           "input is this rank's slice of output.")
      .def("reduce_scatter", &ReduceScatter, nb::arg("output"), nb::arg("input"),
           nb::arg("op") = "sum", nb::arg("stream") = nb::none(),
           "output := this rank's slice of the reduction of every rank's input; op: sum, avg, "
           "min, max.")
      .def("all_reduce", &AllReduce, nb::arg("tensor"), nb::arg("op") = "sum",
           nb::arg("output") = nb::none(), nb::arg("stream") = nb::none(),
           "Reduces tensor over every rank: in place, or into output when given.")
      .def("broadcast", &Broadcast, nb::arg("tensor"), nb::arg("root") = 0,
           nb::arg("stream") = nb::none(), "tensor := root's tensor on every rank.")
      .def("all_to_all", &AllToAll, nb::arg("output"), nb::arg("input"),
           nb::arg("stream") = nb::none(),
           "Block j of input goes to rank j; block i of output comes from rank i.")
      .def("barrier", &Barrier, nb::arg("stream") = nb::none())
      .def(
          "split",
          [](PyComm& c, int color, int key, std::optional<double> timeout_s) -> nb::object {
            absl::Time deadline = DeadlineIn(timeout_s);
            absl::StatusOr<std::shared_ptr<Communicator>> sub;
            {
              nb::gil_scoped_release release;
              sub = c.comm->Split(color, key, deadline);
            }
            std::shared_ptr<Communicator> out = Unwrap(std::move(sub));
            if (out == nullptr) return nb::none();
            return nb::cast(PyComm(out, c.store));
          },
          nb::arg("color"), nb::arg("key") = 0, nb::arg("timeout") = nb::none(),
          "MPI_Comm_split: ranks of one color form a communicator ordered by (key, rank); a "
          "negative color joins none (None). Collective.")
      .def(
          "dup",
          [](PyComm& c, std::optional<double> timeout_s) {
            absl::Time deadline = DeadlineIn(timeout_s);
            absl::StatusOr<std::shared_ptr<Communicator>> dup;
            {
              nb::gil_scoped_release release;
              dup = c.comm->Dup(deadline);
            }
            return PyComm(Unwrap(std::move(dup)), c.store);
          },
          nb::arg("timeout") = nb::none(),
          "The same ranks with their own order of collectives. Collective.")
      .def(
          "shrink",
          [](PyComm& c, std::vector<int> excluded, std::optional<double> timeout_s) {
            absl::Time deadline = DeadlineIn(timeout_s);
            absl::StatusOr<std::shared_ptr<Communicator>> small;
            {
              nb::gil_scoped_release release;
              small = c.comm->Shrink(excluded, deadline);
            }
            return PyComm(Unwrap(std::move(small)), c.store);
          },
          nb::arg("excluded"), nb::arg("timeout") = nb::none(),
          "ncclCommShrink: a communicator over the ranks not in excluded (e.g. peers that died), "
          "in order, built through the store without using this one, so it works after a dead "
          "peer aborted it. Every survivor passes the same ranks.")
      .def(
          "abort", [](PyComm& c) { c.comm->Abort(); },
          "Fails every collective in flight or issued later, here and on the peers it reaches.")
      .def("__repr__", [](const PyComm& c) {
        return absl::StrCat("<shardline.Communicator ", c.comm->name(), " rank ", c.comm->rank(),
                            " of ", c.comm->size(), " (", c.comm->backend(), ")>");
      });

  m.def("init", &Init, nb::arg("backend") = "ucx", nb::arg("rank") = nb::none(),
        nb::arg("world_size") = nb::none(), nb::arg("address") = nb::none(),
        nb::arg("timeout") = nb::none(), nb::arg("name") = "world");
  m.def("init_local", &InitLocal, nb::arg("size"), nb::arg("timeout") = nb::none());
  m.def("_drain", &DrainPending, nb::arg("timeout") = nb::none());
  m.def("_exit_cleanup", &ExitCleanup, nb::arg("drain_timeout") = nb::none(),
        "What the interpreter's exit runs (shardline/__init__.py): abort, finish, drain.");
  m.def("_abort_timed_out", &AbortTimedOut,
        "ExitCleanup's first step alone (registered at the first wait() that times out).");
  m.def("_pending_works", [] {
    CollectPending(/*full=*/true);
    return Pendings().works.size();
  });
  m.def("_empty", &Empty, nb::arg("shape"), nb::arg("dtype"), nb::arg("framework"),
        nb::arg("zero"));
  m.def("_host_memory_stats", [] {
    MemoryStats s = HostMemory().stats();
    return std::make_tuple(s.current_bytes, s.peak_bytes, s.live_allocations);
  });

  nb::class_<PyMesh>(m, "Mesh",
                     "The ranks as replicate x shard: shard groups of shard_size consecutive "
                     "ranks, replicate groups across them (HSDP). Collective over world.")
      .def(
          "__init__",
          [](PyMesh* self, PyComm& world, int shard_size, std::optional<double> timeout_s) {
            absl::Time deadline = DeadlineIn(timeout_s);
            absl::StatusOr<ProcessMesh> mesh;
            {
              nb::gil_scoped_release release;
              mesh = ProcessMesh::Create(world.comm, shard_size, deadline);
            }
            ProcessMesh made = Unwrap(std::move(mesh));
            nb::object shard = nb::cast(PyComm(made.shard(), world.store));
            nb::object replicate = nb::cast(PyComm(made.replicate(), world.store));
            new (self) PyMesh{std::move(made), std::move(shard), std::move(replicate)};
          },
          nb::arg("world"), nb::arg("shard_size"), nb::arg("timeout") = nb::none())
      .def_prop_ro("shard_size", [](const PyMesh& m) { return m.mesh.shard_size(); })
      .def_prop_ro("replicate_size", [](const PyMesh& m) { return m.mesh.replicate_size(); })
      .def_prop_ro("shard_rank", [](const PyMesh& m) { return m.mesh.shard_rank(); })
      .def_prop_ro("replicate_rank", [](const PyMesh& m) { return m.mesh.replicate_rank(); })
      .def_prop_ro(
          "shard", [](const PyMesh& m) { return m.shard; },
          "The shard group's Communicator (all-gathers, reduce-scatters).")
      .def_prop_ro(
          "replicate", [](const PyMesh& m) { return m.replicate; },
          "The replicate group's Communicator (all-reduces across replicas).")
      .def("__repr__", [](const PyMesh& m) {
        return absl::StrCat("<shardline.Mesh ", m.mesh.ToString(), ">");
      });

  nb::class_<TraceWriter>(m, "Trace",
                          "A Chrome trace (Perfetto, chrome://tracing) of one rank; give it to a "
                          "Scheduler and write it after the steps.")
      .def(nb::init<int, std::string>(), nb::arg("rank"), nb::arg("process_name") = "")
      .def_prop_ro("num_events", &TraceWriter::num_events)
      .def("to_json", &TraceWriter::ToJson)
      .def(
          "add_span",
          [](TraceWriter& t, const std::string& track, const std::string& name,
             const std::string& category, int64_t start_ns, int64_t duration_ns) {
            if (duration_ns < 0) {
              ThrowInvalid(absl::StrCat("Trace.add_span('", name, "'): duration_ns ", duration_ns,
                                        " is negative"));
            }
            t.AddComplete(t.Track(track), name, category, absl::FromUnixNanos(start_ns),
                          absl::Nanoseconds(duration_ns));
          },
          nb::arg("track"), nb::arg("name"), nb::arg("category"), nb::arg("start_ns"),
          nb::arg("duration_ns"),
          "A span on `track` (a lane, e.g. \"compute\"): starting at `start_ns` nanoseconds since "
          "the Unix epoch (time.time_ns(), the clock of the scheduler's spans), lasting "
          "`duration_ns`.")
      .def(
          "write",
          [](const TraceWriter& t, const std::string& path) { ThrowIfError(t.WriteFile(path)); },
          nb::arg("path"), "Writes the trace as JSON (atomically).");
}

}  // namespace shardline::python

NB_MODULE(_core, m) {
  namespace sp = shardline::python;
  m.doc() = "shardline's native module; import shardline instead.";
  m.attr("__version__") = SHARDLINE_VERSION_STRING;
  sp::RegisterErrors(m);
  sp::RegisterCollectives(m);
  sp::RegisterScheduler(m);
  sp::RegisterStore(m);
  sp::RegisterCheckpoint(m);
}
