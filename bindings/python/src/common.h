// File: bindings/python/src/common.h
// -----------------------------------------------------------------------------
// What the Python module's translation units share: Status → exception, tensors received through
// DLPack (numpy, torch, jax — anything nanobind's ndarray accepts), the communicator wrapper the
// collectives and the scheduler both take, the Work a collective returns, and each part's
// Register function (module.cc calls them in order).

#ifndef SHARDLINE_BINDINGS_PYTHON_SRC_COMMON_H_
#define SHARDLINE_BINDINGS_PYTHON_SRC_COMMON_H_

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/store/store.h"
#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/stream.h"
#include "scheduler/scheduler.h"

namespace shardline::python {

namespace nb = nanobind;

// A failed Status on its way to Python: the module's exception translator raises the exception
// class that follows its code (see RegisterErrors) with the Status text as the message.
class StatusError : public std::exception {
 public:
  explicit StatusError(absl::Status status)
      : status_(std::move(status)),
        text_(status_.ToString(absl::StatusToStringMode::kWithNoExtraData)) {}
  const absl::Status& status() const { return status_; }
  // The message; any bytes (a file's contents, a name from a manifest), not necessarily UTF-8.
  const std::string& text() const { return text_; }
  const char* what() const noexcept override { return text_.c_str(); }

 private:
  absl::Status status_;
  std::string text_;
};

inline void ThrowIfError(const absl::Status& status) {
  if (!status.ok()) throw StatusError(status);
}
template <typename T>
T Unwrap(absl::StatusOr<T> value) {
  if (!value.ok()) throw StatusError(value.status());
  return *std::move(value);
}
// InvalidArgument with `message` (raised as ValueError).
[[noreturn]] void ThrowInvalid(std::string message);

// Creates shardline.Error and its subclasses in `m` and installs the translator (errors.cc).
void RegisterErrors(nb::module_& m);
// A new exception object for `status` (its class per the Status code, .code, .peer_error), or
// null with the Python error set if even that failed. `text` need not be UTF-8.
PyObject* MakeException(const absl::Status& status, const std::string& text);

// A bound on a blocking wait: `timeout_s` seconds from now, or SHARDLINE_TIMEOUT_S when unset.
// InvalidArgument for a negative timeout or NaN; infinity waits without bound.
absl::Time DeadlineIn(std::optional<double> timeout_s);

// One tensor argument: its memory, element count and dtype, and the Python object that owns the
// memory (kept alive by the Work until the collective is done).
struct Tensor {
  void* data = nullptr;
  size_t numel = 0;
  DType dtype = DType::kF32;
  Device device = Device::Host();
  nb::object owner;
};

// Reads `obj` through DLPack (zero-copy). ValueError (naming `what`) if it is not a tensor, not
// C-contiguous, of a dtype shardline does not move, read-only while `writable`, or not on
// `device`.
Tensor ToTensor(nb::handle obj, const char* what, bool writable, Device device);
// The device of a tensor's memory (host for anything DLPack does not import: ToTensor then
// says what is wrong with it).
Device TensorDevice(nb::handle obj);

// A communicator as Python sees it: the C++ communicator, the shardline stream its collectives
// run on (a host stream for host memory: the calls return at once and the collective runs on
// the stream's worker), and whatever the communicator needs kept alive (the store of a joined
// process group).
struct PyComm {
  PyComm(std::shared_ptr<Communicator> comm, std::shared_ptr<Store> store);
  // Declared in this order so that the stream (whose destructor drains it) goes before the
  // communicator.
  std::shared_ptr<Store> store;
  std::shared_ptr<Communicator> comm;
  std::unique_ptr<Stream> stream;
};

// A collective from Python (work.cc): the C++ Work and the tensors it reads and writes. When the
// Python object goes away before the collective is done, the tensors stay alive (in a list of
// pending Works) until a later call finds the collective done (or the interpreter exits).
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

// The PyWork of an issued collective (raises its issue error), keeping `keep` alive until it is
// done. Releases the tensors of dropped Works found done since.
PyWork MakeWork(absl::StatusOr<Work> work, std::vector<nb::object> keep);

// shardline.Work, and the module's exit cleanup of collectives still running (work.cc).
void RegisterWork(nb::module_& m);
// _empty and _host_memory_stats: tensors in shardline's shareable host memory (tensors.cc).
void RegisterTensors(nb::module_& m);
// Stream, Communicator, init, init_local and Mesh (collectives.cc).
void RegisterCollectives(nb::module_& m);
// shardline.Trace (trace.cc).
void RegisterTrace(nb::module_& m);
void RegisterScheduler(nb::module_& m);
// The C++ Scheduler of a shardline.Scheduler object (TypeError if `scheduler` is not one).
Scheduler& SchedulerOf(nb::handle scheduler);
// shardline.Checkpointer: sharded checkpoints of a Scheduler's units (checkpoint.cc).
void RegisterCheckpoint(nb::module_& m);
// init_with_store: communicators whose rendezvous goes through a Python (torch) store.
void RegisterStore(nb::module_& m);
// shardline.ElasticGroup and its rounds (elastic.cc).
void RegisterElastic(nb::module_& m);

// At interpreter exit (checkpoint.cc): waits (GIL released) for every live Checkpointer's
// background save, each bounded by its own deadline; returns a line for each that failed.
std::vector<std::string> FinishBackgroundSaves();

}  // namespace shardline::python

#endif  // SHARDLINE_BINDINGS_PYTHON_SRC_COMMON_H_
