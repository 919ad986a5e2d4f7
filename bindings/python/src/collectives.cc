// File: bindings/python/src/collectives.cc
// -----------------------------------------------------------------------------
// Communicators as Python sees them: joining a world (init, init_local), the collectives (each
// returns a Work at once and runs on a shardline stream), split/dup/shrink/abort, the streams
// and the 2-D meshes (replicate x shard).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "bindings/python/src/common.h"
#include "collectives/bootstrap.h"
#include "collectives/local/local_communicator.h"
#include "collectives/process_mesh.h"

#ifdef SHARDLINE_WITH_CUDA
#include "runtime/cuda/cuda_stream.h"
#endif

namespace shardline::python {
namespace {

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

// Send (`send`) or Recv: `timeout_s` bounds the operation from its start (None: the
// communicator's timeout); a negative one is InvalidArgument from the C++ API.
PyWork PointToPoint(PyComm& c, nb::handle tensor, int peer, uint64_t tag, Stream* stream,
                    std::optional<double> timeout_s, bool send) {
  Tensor t =
      ToTensor(tensor, send ? "send tensor" : "recv tensor", /*writable=*/!send, c.comm->device());
  PointToPointOptions options{.match_tag = tag};
  if (timeout_s.has_value()) options.timeout = absl::Seconds(*timeout_s);
  absl::StatusOr<Work> work;
  {
    nb::gil_scoped_release release;
    work = send ? c.comm->Send(t.data, t.numel, t.dtype, peer, StreamFor(c, stream), options)
                : c.comm->Recv(t.data, t.numel, t.dtype, peer, StreamFor(c, stream), options);
  }
  return MakeWork(std::move(work), {t.owner});
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
            const std::string& name, std::optional<std::string> device) {
  InitOptions options;
  options.backend = backend;
  options.name = name;
  if (device.has_value()) options.device = Unwrap(Device::Parse(*device));
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

}  // namespace

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
  m.def(
      "wrap_cuda_stream",
      [](uintptr_t handle, int device, const std::string& name) -> Stream* {
#ifdef SHARDLINE_WITH_CUDA
        return Unwrap(
                   WrapCudaStream(reinterpret_cast<cudaStream_t>(handle), device, {.name = name}))
            .release();
#else
        (void)handle;
        (void)device;
        (void)name;
        throw StatusError(
            absl::UnimplementedError("wrap_cuda_stream: this shardline was built without CUDA"));
#endif
      },
      nb::arg("handle"), nb::arg("device"), nb::arg("name") = "python",
      nb::rv_policy::take_ownership,
      "A framework's CUDA stream of cuda:device (a cudaStream_t as an int, such as torch's "
      "Stream.cuda_stream; 0 is the legacy default stream), wrapped without taking it over: "
      "collectives of an nccl communicator issued on it run in its order, after the work "
      "enqueued on it before them, and the framework's later work on it comes after them. "
      "Keep the framework's stream alive while this object lives.");

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
           "min, max, product.")
      .def("all_reduce", &AllReduce, nb::arg("tensor"), nb::arg("op") = "sum",
           nb::arg("output") = nb::none(), nb::arg("stream") = nb::none(),
           "Reduces tensor over every rank (op: sum, avg, min, max, product): in place, or into "
           "output when given.")
      .def("broadcast", &Broadcast, nb::arg("tensor"), nb::arg("root") = 0,
           nb::arg("stream") = nb::none(), "tensor := root's tensor on every rank.")
      .def("all_to_all", &AllToAll, nb::arg("output"), nb::arg("input"),
           nb::arg("stream") = nb::none(),
           "Block j of input goes to rank j; block i of output comes from rank i.")
      .def("barrier", &Barrier, nb::arg("stream") = nb::none())
      .def(
          "send",
          [](PyComm& c, nb::handle tensor, int peer, uint64_t tag, Stream* stream,
             std::optional<double> timeout) {
            return PointToPoint(c, tensor, peer, tag, stream, timeout, /*send=*/true);
          },
          nb::arg("tensor"), nb::arg("peer"), nb::arg("tag") = 0, nb::arg("stream") = nb::none(),
          nb::arg("timeout") = nb::none(),
          "Sends tensor to rank peer, matched by tag (collectives/communicator.h's rules: "
          "outside the collectives' order; it never waits for its receive). The local, ucx and "
          "sim backends. timeout: seconds from its start (None: the communicator's).")
      .def(
          "recv",
          [](PyComm& c, nb::handle tensor, int peer, uint64_t tag, Stream* stream,
             std::optional<double> timeout) {
            return PointToPoint(c, tensor, peer, tag, stream, timeout, /*send=*/false);
          },
          nb::arg("tensor"), nb::arg("peer") = kAnySource, nb::arg("tag") = 0,
          nb::arg("stream") = nb::none(), nb::arg("timeout") = nb::none(),
          "Receives into tensor from rank peer (ANY_SOURCE, the default: from any rank; "
          "Work.source tells which), matched by tag. timeout: seconds from its start (None: the "
          "communicator's); past it, DeadlineExceededError naming the rank(s) it waited for.")
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
          "flight_record_json",
          [](const PyComm& c, const std::string& reason) {
            return c.comm->FlightRecordJson(reason);
          },
          nb::arg("reason") = "python",
          "The flight recorder's rings as JSON (collectives/flight_recorder.h): the last "
          "collectives under \"entries\" and sends and receives under \"point_to_point\", "
          "each with its kind, count, dtype, root (a send's or receive's peer), state and times.")
      .def(
          "abort", [](PyComm& c) { c.comm->Abort(); },
          "Fails every collective in flight or issued later, here and on the peers it reaches.")
      .def("__repr__", [](const PyComm& c) {
        return absl::StrCat("<shardline.Communicator ", c.comm->name(), " rank ", c.comm->rank(),
                            " of ", c.comm->size(), " (", c.comm->backend(), ")>");
      });

  m.def("init", &Init, nb::arg("backend") = "ucx", nb::arg("rank") = nb::none(),
        nb::arg("world_size") = nb::none(), nb::arg("address") = nb::none(),
        nb::arg("timeout") = nb::none(), nb::arg("name") = "world", nb::arg("device") = nb::none());
  m.def("init_local", &InitLocal, nb::arg("size"), nb::arg("timeout") = nb::none());

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
}

}  // namespace shardline::python
