// File: bindings/python/src/checkpoint.cc
// -----------------------------------------------------------------------------
// shardline._core.Checkpointer: scheduler/checkpoint/checkpoint.h for Python. The states are
// numpy arrays or torch tensors (anything DLPack exports from host memory) that the Checkpointer
// keeps alive; save and load release the GIL while they run.
//
// Each collective method is one Run() call: the C++ call on the unwrapped arguments, with the GIL
// released and the Status raised as the matching exception. A new collective of the Checkpointer
// (an asynchronous save, an export) is bound the same way.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bindings/python/src/common.h"
#include "scheduler/checkpoint/checkpoint.h"

namespace shardline::python {
namespace {

struct PyCheckpointer {
  nb::object scheduler;            // the shardline.Scheduler, kept alive
  std::vector<nb::object> owners;  // the registered arrays, kept alive
  std::unique_ptr<Checkpointer> checkpointer;
};

// A path argument: str or os.PathLike.
std::string PathOf(nb::handle path) {
  nb::object fspath = nb::module_::import_("os").attr("fspath");
  nb::object text = fspath(path);
  if (!nb::isinstance<nb::str>(text)) {
    ThrowInvalid("a checkpoint directory must be a str or os.PathLike of str, not bytes");
  }
  return nb::cast<std::string>(text);
}

// Runs `call` (returning a Status) with the GIL released; raises its error.
template <typename Call>
void Run(Call&& call) {
  absl::Status status;
  {
    nb::gil_scoped_release release;
    status = call();
  }
  ThrowIfError(status);
}

void Create(PyCheckpointer* self, nb::object scheduler, uint64_t checksum_block_bytes,
            size_t read_chunk_bytes, std::optional<double> timeout_s) {
  nb::object scheduler_type = nb::module_::import_("shardline._core").attr("Scheduler");
  if (!nb::isinstance(scheduler, scheduler_type)) {
    throw nb::type_error(absl::StrCat("Checkpointer: scheduler must be a shardline.Scheduler, not ",
                                      nb::type_name(scheduler.type()).c_str())
                             .c_str());
  }
  CheckpointOptions options;
  options.checksum_block_bytes = checksum_block_bytes;
  options.read_chunk_bytes = read_chunk_bytes;
  const absl::Time deadline = DeadlineIn(timeout_s);
  Scheduler& s = SchedulerOf(scheduler);
  absl::StatusOr<std::unique_ptr<Checkpointer>> made;
  {
    nb::gil_scoped_release release;
    made = Checkpointer::Create(s, options, deadline);
  }
  new (self) PyCheckpointer{std::move(scheduler), {}, Unwrap(std::move(made))};
}

void AddState(PyCheckpointer& c, nb::handle unit_id, const std::string& name, nb::handle array) {
  Scheduler& s = SchedulerOf(c.scheduler);
  // An int or anything with __index__ (a shardline.Unit).
  nb::object index = nb::steal(PyNumber_Index(unit_id.ptr()));
  if (!index.is_valid()) {
    PyErr_Clear();
    throw nb::type_error(absl::StrCat("Checkpointer.add_state('", name,
                                      "'): unit must be a unit id or a shardline.Unit, not ",
                                      nb::type_name(unit_id.type()).c_str())
                             .c_str());
  }
  const long long unit_ll = nb::cast<long long>(index);
  if (unit_ll < 0 || unit_ll >= s.num_units()) {
    ThrowInvalid(absl::StrCat("Checkpointer.add_state('", name, "'): no unit ", unit_ll, " (",
                              s.num_units(), " registered)"));
  }
  const int unit = static_cast<int>(unit_ll);
  const FlatParameter& p = s.unit(unit);
  std::string what =
      absl::StrCat("Checkpointer.add_state: state '", name, "' of unit '", p.name(), "'");
  Tensor t = ToTensor(array, what.c_str(), /*writable=*/true, Device::Host());
  const size_t want = p.layout().shard_elements();
  if (t.numel != want) {
    ThrowInvalid(absl::StrCat(what, " has ", t.numel, " elements; the unit's shard has ", want,
                              " (unit.shard_elements, padding included)"));
  }
  ThrowIfError(
      c.checkpointer->AddState({.unit = unit, .name = name, .data = t.data, .dtype = t.dtype}));
  c.owners.push_back(std::move(t.owner));
}

}  // namespace

void RegisterCheckpoint(nb::module_& m) {
  nb::class_<PyCheckpointer>(
      m, "Checkpointer",
      "Sharded checkpoints of a Scheduler's units (docs/checkpoints.md): every rank saves its "
      "shard of every unit's master shard and of the registered states; a load at any world "
      "size or mesh gives back the saved bits.")
      .def("__init__", &Create, nb::arg("scheduler"), nb::kw_only(),
           nb::arg("checksum_block_bytes") = uint64_t{1} << 20,
           nb::arg("read_chunk_bytes") = size_t{8} << 20, nb::arg("timeout") = nb::none(),
           "Collective over the scheduler's world, after its units are registered.")
      .def("add_state", &AddState, nb::arg("unit"), nb::arg("name"), nb::arg("array"),
           "Registers a shard-shaped state of `unit` (an id or a Unit): a writable, contiguous "
           "host array of unit.shard_elements elements laid out like its master shard (element "
           "i belongs to the tensor element of master element i), of any dtype shardline moves. "
           "The Checkpointer keeps it alive; a load writes into it. name: 1-128 characters of "
           "[A-Za-z0-9._-], not 'master', unique per unit. Same states in the same order on "
           "every rank.")
      .def(
          "save",
          [](PyCheckpointer& c, nb::handle dir, std::optional<double> timeout_s) {
            const std::string path = PathOf(dir);
            const absl::Time deadline = DeadlineIn(timeout_s);
            Run([&] { return c.checkpointer->Save(path, deadline); });
          },
          nb::arg("dir"), nb::kw_only(), nb::arg("timeout") = nb::none(),
          "Saves every unit and registered state into the new directory `dir` "
          "(AlreadyExistsError if it exists), atomically. Collective, between steps, the same "
          "`dir` on every rank.")
      .def(
          "load",
          [](PyCheckpointer& c, nb::handle dir, std::optional<double> timeout_s) {
            const std::string path = PathOf(dir);
            const absl::Time deadline = DeadlineIn(timeout_s);
            Run([&] { return c.checkpointer->Load(path, deadline); });
          },
          nb::arg("dir"), nb::kw_only(), nb::arg("timeout") = nb::none(),
          "Loads the checkpoint in `dir` into every unit's master shard and registered state. "
          "Collective. NotFoundError (no directory, file or state), FailedPreconditionError "
          "(incomplete), InvalidArgumentError (other units, shapes or dtypes), DataLossError "
          "(a damaged file), each naming the file, unit, state and tensor.")
      .def_prop_ro(
          "states",
          [](const PyCheckpointer& c) {
            std::vector<std::tuple<int, std::string, std::string>> out;
            for (const CheckpointState& s : c.checkpointer->states()) {
              out.emplace_back(s.unit, s.name, std::string(DTypeName(s.dtype)));
            }
            return out;
          },
          "[(unit, name, dtype)] of the registered states, in order.")
      .def_prop_ro("scheduler", [](const PyCheckpointer& c) { return c.scheduler; });
}

}  // namespace shardline::python
