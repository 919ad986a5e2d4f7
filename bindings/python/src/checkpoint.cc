// File: bindings/python/src/checkpoint.cc
// -----------------------------------------------------------------------------
// shardline._core.Checkpointer: scheduler/checkpoint/checkpoint.h for Python. The states are
// numpy arrays or torch tensors (anything DLPack exports from host memory) that the Checkpointer
// keeps alive; save and load release the GIL while they run.
//
// Each collective method is one Run() call: the C++ call on the unwrapped arguments, with the GIL
// released and the Status raised as the matching exception. A new collective of the Checkpointer
// (an asynchronous save, an export) is bound the same way.
//
// Also here: the module functions export_safetensors / import_safetensors (full weights,
// scheduler/checkpoint/full_weights.h) and sync_module_states (scheduler/sync_states.h).

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bindings/python/src/common.h"
#include "scheduler/checkpoint/checkpoint.h"
#include "scheduler/checkpoint/full_weights.h"
#include "scheduler/sync_states.h"

namespace shardline::python {
namespace {

struct PyCheckpointer;
// The live Checkpointers, for FinishBackgroundSaves. Touched only with the GIL held.
std::set<PyCheckpointer*>& LiveCheckpointers() {
  static auto* live = new std::set<PyCheckpointer*>();
  return *live;
}

struct PyCheckpointer {
  PyCheckpointer(nb::object s, std::unique_ptr<Checkpointer> c)
      : scheduler(std::move(s)), checkpointer(std::move(c)) {
    LiveCheckpointers().insert(this);
  }
  PyCheckpointer(const PyCheckpointer&) = delete;
  PyCheckpointer& operator=(const PyCheckpointer&) = delete;
  ~PyCheckpointer() { LiveCheckpointers().erase(this); }

  nb::object scheduler;            // the shardline.Scheduler, kept alive
  std::vector<nb::object> owners;  // the registered arrays, kept alive
  std::unique_ptr<Checkpointer> checkpointer;
};

// A scheduler argument, checked to be a shardline.Scheduler.
void CheckScheduler(nb::handle scheduler, const char* what) {
  nb::object scheduler_type = nb::module_::import_("shardline._core").attr("Scheduler");
  if (!nb::isinstance(scheduler, scheduler_type)) {
    throw nb::type_error(absl::StrCat(what, ": scheduler must be a shardline.Scheduler, not ",
                                      nb::type_name(scheduler.type()).c_str())
                             .c_str());
  }
}

// A path argument: str or os.PathLike.
std::string PathOf(nb::handle path, const char* what = "a checkpoint directory") {
  nb::object fspath = nb::module_::import_("os").attr("fspath");
  nb::object text = fspath(path);
  if (!nb::isinstance<nb::str>(text)) {
    ThrowInvalid(absl::StrCat(what, " must be a str or os.PathLike of str, not bytes"));
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
            size_t read_chunk_bytes, uint64_t max_snapshot_bytes, std::optional<double> timeout_s) {
  CheckScheduler(scheduler, "Checkpointer");
  CheckpointOptions options;
  options.checksum_block_bytes = checksum_block_bytes;
  options.read_chunk_bytes = read_chunk_bytes;
  options.max_snapshot_bytes = max_snapshot_bytes;
  const absl::Time deadline = DeadlineIn(timeout_s);
  Scheduler& s = SchedulerOf(scheduler);
  absl::StatusOr<std::unique_ptr<Checkpointer>> made;
  {
    nb::gil_scoped_release release;
    made = Checkpointer::Create(s, options, deadline);
  }
  new (self) PyCheckpointer(std::move(scheduler), Unwrap(std::move(made)));
}

void AddState(PyCheckpointer& c, nb::handle unit_id, const std::string& name, nb::handle array,
              bool stable) {
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
  // Host memory, or the memory of the unit's master shard's device (an optimizer's state on a
  // GPU), which saves and loads copy through host memory.
  const Device where = TensorDevice(array);
  if (!where.is_host() && where != p.master_device()) {
    ThrowInvalid(absl::StrCat(what, " is on ", where.ToString(),
                              ", but the unit's master shard is on ", p.master_device().ToString(),
                              "; a state lives in host memory or "
                              "beside the master shard"));
  }
  Tensor t = ToTensor(array, what.c_str(), /*writable=*/true, where);
  const size_t want = p.layout().shard_elements();
  if (t.numel != want) {
    ThrowInvalid(absl::StrCat(what, " has ", t.numel, " elements; the unit's shard has ", want,
                              " (unit.shard_elements, padding included)"));
  }
  ThrowIfError(c.checkpointer->AddState({.unit = unit,
                                         .name = name,
                                         .data = t.data,
                                         .dtype = t.dtype,
                                         .stable = stable,
                                         .device = where}));
  c.owners.push_back(std::move(t.owner));
}

void AddReplicatedState(PyCheckpointer& c, const std::string& name, nb::handle array) {
  std::string what = absl::StrCat("Checkpointer.add_replicated_state: state '", name, "'");
  Tensor t = ToTensor(array, what.c_str(), /*writable=*/true, Device::Host());
  std::vector<int64_t> shape;
  for (nb::handle d : nb::iter(array.attr("shape"))) shape.push_back(nb::cast<int64_t>(d));
  ThrowIfError(c.checkpointer->AddReplicatedState(
      {.name = name, .shape = std::move(shape), .dtype = t.dtype, .data = t.data}));
  c.owners.push_back(std::move(t.owner));
}

nb::dict StatsDict(const CheckpointSaveStats& st) {
  nb::dict d;
  d["dir"] = st.dir;
  d["background"] = st.background;
  d["finished"] = st.finished;
  d["snapshot_bytes"] = st.snapshot_bytes;
  d["snapshot_capacity_bytes"] = st.snapshot_capacity_bytes;
  d["blocked"] = absl::ToDoubleSeconds(st.blocked);
  d["waited"] = absl::ToDoubleSeconds(st.waited);
  d["snapshot"] = absl::ToDoubleSeconds(st.snapshot);
  d["write"] = absl::ToDoubleSeconds(st.write);
  return d;
}

void Export(nb::handle scheduler, nb::handle path, std::optional<std::string> dtype,
            int writer_rank, std::optional<std::map<std::string, std::string>> metadata,
            size_t cast_chunk_bytes, std::optional<double> timeout_s) {
  CheckScheduler(scheduler, "export_safetensors");
  const std::string file = PathOf(path, "export_safetensors: path");
  SafetensorsExportOptions options;
  options.writer_rank = writer_rank;
  options.cast_chunk_bytes = cast_chunk_bytes;
  if (dtype.has_value()) options.dtype = Unwrap(ParseDType(*dtype));
  if (metadata.has_value()) {
    for (auto& [k, v] : *metadata) options.metadata.emplace_back(k, v);
  }
  const absl::Time deadline = DeadlineIn(timeout_s);
  Scheduler& s = SchedulerOf(scheduler);
  Run([&] { return ExportSafetensors(s, file, options, deadline); });
}

void Import(nb::handle scheduler, nb::handle path, bool ignore_unknown_tensors,
            std::optional<double> timeout_s) {
  CheckScheduler(scheduler, "import_safetensors");
  const std::string file = PathOf(path, "import_safetensors: path");
  SafetensorsImportOptions options;
  options.ignore_unknown_tensors = ignore_unknown_tensors;
  const absl::Time deadline = DeadlineIn(timeout_s);
  Scheduler& s = SchedulerOf(scheduler);
  Run([&] { return ImportSafetensors(s, file, options, deadline); });
}

void Sync(PyComm& comm, nb::handle tensors, int root, size_t bucket_bytes,
          std::optional<double> timeout_s) {
  std::vector<SyncTensor> list;
  std::vector<nb::object> owners;  // alive for the call
  size_t i = 0;
  for (nb::handle obj : nb::iter(tensors)) {
    std::string what = absl::StrCat("sync_module_states: tensor ", i++);
    Tensor t = ToTensor(obj, what.c_str(), /*writable=*/true, Device::Host());
    list.push_back({.data = t.data, .count = t.numel, .dtype = t.dtype});
    owners.push_back(std::move(t.owner));
  }
  SyncModuleStatesOptions options;
  options.root = root;
  options.bucket_bytes = bucket_bytes;
  const absl::Time deadline = DeadlineIn(timeout_s);
  Run([&] { return SyncModuleStates(*comm.comm, list, options, deadline); });
}

}  // namespace

std::vector<std::string> FinishBackgroundSaves() {
  std::vector<std::pair<Checkpointer*, std::string>> pending;
  for (PyCheckpointer* c : LiveCheckpointers()) {
    if (c->checkpointer->save_pending()) {
      pending.emplace_back(c->checkpointer.get(), c->checkpointer->last_save_stats().dir);
    }
  }
  std::vector<std::string> failed;
  for (auto& [checkpointer, dir] : pending) {
    absl::Status outcome;
    {
      nb::gil_scoped_release release;
      // The background part's waits are bounded by the save's own deadline.
      outcome = checkpointer->WaitForSave(absl::InfiniteFuture());
    }
    if (!outcome.ok()) {
      failed.push_back(absl::StrCat("shardline: the background checkpoint save '", dir,
                                    "' failed: ", outcome.message()));
    }
  }
  return failed;
}

void RegisterCheckpoint(nb::module_& m) {
  nb::class_<PyCheckpointer>(
      m, "Checkpointer",
      "Sharded checkpoints of a Scheduler's units (docs/checkpoints.md): every rank saves its "
      "shard of every unit's master shard and of the registered states; a load at any world "
      "size or mesh gives back the saved bits.")
      .def("__init__", &Create, nb::arg("scheduler"), nb::kw_only(),
           nb::arg("checksum_block_bytes") = uint64_t{1} << 20,
           nb::arg("read_chunk_bytes") = size_t{8} << 20,
           nb::arg("max_snapshot_bytes") = uint64_t{0}, nb::arg("timeout") = nb::none(),
           "Collective over the scheduler's world, after its units are registered. "
           "max_snapshot_bytes caps the host memory of save_async's snapshot (0: no cap).")
      .def("add_state", &AddState, nb::arg("unit"), nb::arg("name"), nb::arg("array"),
           nb::arg("stable") = false,
           "Registers a shard-shaped state of `unit` (an id or a Unit): a writable, contiguous "
           "host array of unit.shard_elements elements laid out like its master shard (element "
           "i belongs to the tensor element of master element i), of any dtype shardline moves. "
           "The Checkpointer keeps it alive; a load writes into it. name: 1-128 characters of "
           "[A-Za-z0-9._-], not 'master', unique per unit. Same states in the same order on "
           "every rank. stable=True: the caller leaves the array unchanged until every save "
           "that includes it has finished (a copy made for the save), so save_async writes it "
           "from the array instead of copying it into its snapshot.")
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
      .def("add_replicated_state", &AddReplicatedState, nb::arg("name"), nb::arg("array"),
           "Registers a replicated state: a writable, contiguous host array of any shape (0-d "
           "for a scalar), the same on every rank (a step counter). A save writes rank 0's copy; "
           "a load gives every rank that copy. Kept alive by the Checkpointer. Same names, "
           "shapes and dtypes in the same order on every rank.")
      .def(
          "save_async",
          [](PyCheckpointer& c, nb::handle dir, std::optional<double> timeout_s) {
            const std::string path = PathOf(dir);
            const absl::Time deadline = DeadlineIn(timeout_s);
            Run([&] { return c.checkpointer->SaveAsync(path, deadline); });
          },
          nb::arg("dir"), nb::kw_only(), nb::arg("timeout") = nb::none(),
          "save() in the background: returns once this rank's shards and states are copied "
          "into host memory (the snapshot); the arrays may change from then on. A thread writes "
          "and publishes the checkpoint; wait() returns its outcome. A later save, save_async or "
          "load waits for it first. Collective, between steps. The background part's waits are "
          "bounded by `timeout`.")
      .def(
          "wait",
          [](PyCheckpointer& c, std::optional<double> timeout_s) {
            const absl::Time deadline = DeadlineIn(timeout_s);
            Run([&] { return c.checkpointer->WaitForSave(deadline); });
          },
          nb::kw_only(), nb::arg("timeout") = nb::none(),
          "Waits for the pending background save and raises its error (the same on every "
          "rank); returns at once if none is pending. DeadlineExceededError if it still runs "
          "after `timeout` (it stays pending). Not collective.")
      .def_prop_ro(
          "save_pending", [](const PyCheckpointer& c) { return c.checkpointer->save_pending(); },
          "Whether a background save was started and wait() has not returned its outcome.")
      .def_prop_ro(
          "last_save_stats",
          [](const PyCheckpointer& c) { return StatsDict(c.checkpointer->last_save_stats()); },
          "The latest save's figures as a dict: dir, background, finished, snapshot_bytes, "
          "snapshot_capacity_bytes, and in seconds blocked (how long the call kept the caller), "
          "waited and snapshot (parts of it), write (the background thread's time).")
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
      .def_prop_ro(
          "replicated_states",
          [](const PyCheckpointer& c) {
            std::vector<std::tuple<std::string, std::vector<int64_t>, std::string>> out;
            for (const CheckpointReplicatedState& s : c.checkpointer->replicated_states()) {
              out.emplace_back(s.name, s.shape, std::string(DTypeName(s.dtype)));
            }
            return out;
          },
          "[(name, shape, dtype)] of the registered replicated states, in order.")
      .def_prop_ro("scheduler", [](const PyCheckpointer& c) { return c.scheduler; });

  m.def("export_safetensors", &Export, nb::arg("scheduler"), nb::arg("path"), nb::kw_only(),
        nb::arg("dtype") = nb::none(), nb::arg("writer_rank") = 0, nb::arg("metadata") = nb::none(),
        nb::arg("cast_chunk_bytes") = size_t{8} << 20, nb::arg("timeout") = nb::none(),
        "Writes every unit's master weights as the new safetensors file `path` (never "
        "replacing one: AlreadyExistsError), one unit at a time gathered to `writer_rank`, "
        "tensors under their registered names. dtype: None (each unit's master dtype) or a "
        "floating dtype name ('bf16', 'float16', ...; rounds to nearest even). metadata: extra "
        "str entries of the header's __metadata__. Collective over the world, between steps.");
  m.def("import_safetensors", &Import, nb::arg("scheduler"), nb::arg("path"), nb::kw_only(),
        nb::arg("ignore_unknown_tensors") = false, nb::arg("timeout") = nb::none(),
        "Loads every unit's master shard from the safetensors file `path` (from any writer): "
        "each rank maps the file and copies only its shard's elements, casting floating dtypes. "
        "NotFoundError (no file, a tensor missing), InvalidArgumentError (shape, dtype, tensors "
        "of no unit), DataLossError (truncated). Collective, between steps.");
  m.def("sync_module_states", &Sync, nb::arg("comm"), nb::arg("tensors"), nb::kw_only(),
        nb::arg("root") = 0, nb::arg("bucket_bytes") = size_t{25} << 20,
        nb::arg("timeout") = nb::none(),
        "Overwrites every rank's `tensors` (writable, contiguous host arrays) with rank "
        "`root`'s, in broadcasts of at most bucket_bytes. Collective over `comm`; every rank "
        "passes tensors of the same sizes (else InvalidArgumentError naming the rank).");
}

}  // namespace shardline::python
