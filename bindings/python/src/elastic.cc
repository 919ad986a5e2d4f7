// File: bindings/python/src/elastic.cc
// -----------------------------------------------------------------------------
// shardline.ElasticGroup: one rank of an elastic hybrid-sharded job (collectives/elastic/
// elastic_group.h) for Python. The rounds' shard and replicate communicators come out as
// shardline.Communicator objects, the same object for as long as the group keeps a round's
// communicators (a new one when the round says `rebuilt`), so that a Scheduler built over them
// (Scheduler(shard, replicate=replicate)) is rebuilt exactly when it must be. Every call that
// waits releases the GIL and is bounded by its timeout (None: SHARDLINE_TIMEOUT_S).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "bindings/python/src/common.h"
#include "collectives/elastic/elastic_group.h"
#include "runtime/dtype.h"

namespace shardline::python {
namespace {

struct PyRound {
  int64_t round = 0;
  int64_t step = 0;
  std::vector<int> replicas;
  std::vector<int> joiners;
  bool joining = false;
  bool rebuilt = false;
  nb::object shard;      // PyComm
  nb::object replicate;  // PyComm
};

struct PyElasticGroup {
  std::unique_ptr<ElasticGroup> group;
  // The Python communicators of the group's current communicators (each wraps one C++
  // communicator and a stream of its own), remade when the group builds new ones.
  std::shared_ptr<Communicator> shard_comm;
  std::shared_ptr<Communicator> replicate_comm;
  nb::object shard;
  nb::object replicate;
};

// The Python object for `comm`: the cached one while the group keeps the same communicator.
nb::object Wrap(const std::shared_ptr<Communicator>& comm, std::shared_ptr<Communicator>* cached,
                nb::object* wrapped, const std::shared_ptr<Store>& store) {
  if (comm == nullptr) {
    cached->reset();
    *wrapped = nb::none();
    return nb::none();
  }
  if (comm != *cached || !wrapped->is_valid() || wrapped->is_none()) {
    *cached = comm;
    *wrapped = nb::cast(PyComm(comm, store));
  }
  return *wrapped;
}

void FromEnvironment(PyElasticGroup* self, std::optional<double> timeout_s,
                     std::optional<double> round_timeout_s, const std::string& backend,
                     const std::string& name, int max_consecutive_aborts) {
  if (max_consecutive_aborts < 1) {
    ThrowInvalid(
        absl::StrCat("ElasticGroup: max_consecutive_aborts ", max_consecutive_aborts, " < 1"));
  }
  absl::Duration round_timeout = absl::ZeroDuration();
  if (round_timeout_s.has_value()) {
    if (!(*round_timeout_s > 0)) {
      ThrowInvalid(absl::StrCat("ElasticGroup: round_timeout ", *round_timeout_s, " s is not > 0"));
    }
    round_timeout = absl::Seconds(*round_timeout_s);
  }
  const absl::Time deadline = DeadlineIn(timeout_s);
  absl::StatusOr<std::unique_ptr<ElasticGroup>> joined;
  {
    nb::gil_scoped_release release;
    absl::StatusOr<ElasticOptions> options = ElasticOptionsFromEnvironment(deadline);
    if (options.ok()) {
      options->backend = backend;
      options->name = name;
      options->timeout = round_timeout;
      options->max_consecutive_aborts = max_consecutive_aborts;
      joined = ElasticGroup::Join(*std::move(options), deadline);
    } else {
      joined = options.status();
    }
  }
  new (self) PyElasticGroup{Unwrap(std::move(joined)), nullptr, nullptr, nb::none(), nb::none()};
}

PyRound BeginRound(PyElasticGroup& g, std::optional<double> timeout_s) {
  const absl::Time deadline = DeadlineIn(timeout_s);
  absl::StatusOr<ElasticGroup::Round> begun;
  {
    nb::gil_scoped_release release;
    begun = g.group->BeginRound(deadline);
  }
  ElasticGroup::Round round = Unwrap(std::move(begun));
  const std::shared_ptr<Store>& store = g.group->options().store;
  if (round.rebuilt) {
    // New communicators even where a pointer would repeat: a Scheduler must be built anew.
    g.shard_comm.reset();
    g.replicate_comm.reset();
  }
  PyRound out;
  out.round = round.round;
  out.step = round.step;
  out.replicas = round.replicas;
  out.joiners = round.joiners;
  out.joining = round.joining;
  out.rebuilt = round.rebuilt;
  out.shard = Wrap(round.shard, &g.shard_comm, &g.shard, store);
  out.replicate = Wrap(round.replicate, &g.replicate_comm, &g.replicate, store);
  return out;
}

bool EndRound(PyElasticGroup& g, nb::handle error, std::optional<double> timeout_s) {
  absl::Status step;
  if (!error.is_none()) {
    // An exception: its type and text travel in the vote (the recovery's what_failed).
    std::string text = nb::cast<std::string>(nb::str(error));
    if (!nb::isinstance<nb::str>(error)) {
      const nb::object type_name = error.type().attr("__name__");
      text = absl::StrCat(nb::cast<std::string>(nb::str(type_name)), ": ", text);
    }
    step = absl::AbortedError(text.empty() ? "the step failed" : text);
  }
  const absl::Time deadline = DeadlineIn(timeout_s);
  absl::StatusOr<bool> committed;
  {
    nb::gil_scoped_release release;
    committed = g.group->EndRound(step, deadline);
  }
  bool out = Unwrap(std::move(committed));
  if (!out) {
    // The group dropped the round's communicators.
    g.shard_comm.reset();
    g.replicate_comm.reset();
    g.shard = nb::none();
    g.replicate = nb::none();
  }
  return out;
}

void TransferState(PyElasticGroup& g, nb::sequence pieces, std::optional<double> timeout_s) {
  std::vector<Tensor> tensors;
  std::vector<StatePiece> spans;
  const size_t n = nb::len(pieces);
  tensors.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string what = absl::StrCat("transfer_state: piece ", i);
    // Writable: a joiner receives into it in place.
    Tensor t = ToTensor(pieces[i], what.c_str(), /*writable=*/true, Device::Host());
    spans.push_back({t.data, t.numel * DTypeSize(t.dtype)});
    tensors.push_back(std::move(t));
  }
  const absl::Time deadline = DeadlineIn(timeout_s);
  absl::Status status;
  {
    nb::gil_scoped_release release;
    status = g.group->TransferState(spans, deadline);
  }
  ThrowIfError(status);
}

}  // namespace

void RegisterElastic(nb::module_& m) {
  nb::class_<ElasticRecovery>(m, "ElasticRecovery",
                              "What one recovery cost, as a surviving rank saw it.")
      .def_ro("failed_round", &ElasticRecovery::failed_round)
      .def_ro("step", &ElasticRecovery::step, "The step that was redone.")
      .def_ro("what_failed", &ElasticRecovery::what_failed)
      .def_prop_ro(
          "detect", [](const ElasticRecovery& r) { return absl::ToDoubleSeconds(r.detect); },
          "Seconds from the failed step's start to reading the abort.")
      .def_prop_ro(
          "resume", [](const ElasticRecovery& r) { return absl::ToDoubleSeconds(r.resume); },
          "Seconds from reading the abort to the next round's communicators.")
      .def_ro("replicas_after", &ElasticRecovery::replicas_after)
      .def("__repr__", [](const ElasticRecovery& r) {
        return absl::StrCat("<shardline.ElasticRecovery round ", r.failed_round, " step ", r.step,
                            ": ", r.what_failed, ">");
      });

  nb::class_<PyRound>(m, "ElasticRound", "One round of an ElasticGroup (ElasticGroup.begin_round).")
      .def_ro("round", &PyRound::round)
      .def_ro("step", &PyRound::step, "The step to train: the rounds committed so far.")
      .def_ro("replicas", &PyRound::replicas, "The member replica groups, ascending.")
      .def_ro("joiners", &PyRound::joiners,
              "Replica groups that join now: call transfer_state before training.")
      .def_ro("joining", &PyRound::joining, "This rank's replica group is one of the joiners.")
      .def_ro("rebuilt", &PyRound::rebuilt,
              "New communicators: build the Scheduler anew (new streams).")
      .def_ro("shard", &PyRound::shard, "This replica group's Communicator (the shard group).")
      .def_ro("replicate", &PyRound::replicate,
              "The Communicator over shard index `shard` of every member replica.")
      .def("__repr__", [](const PyRound& r) {
        return absl::StrCat("<shardline.ElasticRound ", r.round, " step ", r.step, " replicas [",
                            absl::StrJoin(r.replicas, ","), "]", r.rebuilt ? " rebuilt" : "", ">");
      });

  nb::class_<PyElasticGroup>(
      m, "ElasticGroup",
      "One rank of an elastic hybrid-sharded job, joined from the launcher's environment "
      "(shardline-launch --max-restarts N --shard-size S): rank r is shard r % S of replica "
      "group r / S; the store at MASTER_ADDR:MASTER_PORT must be hosted outside the ranks. "
      "timeout bounds the join; round_timeout (None: SHARDLINE_TIMEOUT_S) bounds the rounds' "
      "communicators and how long a round waits for a silent rank.")
      .def("__init__", &FromEnvironment, nb::kw_only(), nb::arg("timeout") = nb::none(),
           nb::arg("round_timeout") = nb::none(), nb::arg("backend") = "ucx",
           nb::arg("name") = "elastic", nb::arg("max_consecutive_aborts") = 8)
      .def("begin_round", &BeginRound, nb::kw_only(), nb::arg("timeout") = nb::none(),
           "Arrives at the next round and waits for its quorum. RemoteError (code ABORTED) if "
           "this rank's replica group was left out (one of its ranks was lost: exit, or be "
           "restarted); DataLossError if no replica holds the state.")
      .def("end_round", &EndRound, nb::arg("error") = nb::none(), nb::kw_only(),
           nb::arg("timeout") = nb::none(),
           "Votes for the round's commit (error None) or against it (an exception or a message) "
           "and returns the outcome: True if every member voted ok (step the optimizer), False "
           "if the round aborted (the next round redoes the step).")
      .def(
          "await_joiner",
          [](PyElasticGroup& g, std::optional<double> timeout_s) {
            const absl::Time deadline = DeadlineIn(timeout_s);
            absl::Status status;
            {
              nb::gil_scoped_release release;
              status = g.group->AwaitJoiner(deadline);
            }
            ThrowIfError(status);
          },
          nb::kw_only(), nb::arg("timeout") = nb::none(),
          "Between rounds: returns at once if the last round had every replica group; else blocks "
          "until a replica group that was not in it (a restarted one) has arrived at the next "
          "round, which it then joins.")
      .def("transfer_state", &TransferState, nb::arg("pieces"), nb::kw_only(),
           nb::arg("timeout") = nb::none(),
           "In a round with joiners: the donor replica sends each piece (a contiguous host "
           "tensor) to the joiners of its shard index, which receive in place. Every rank of "
           "the round calls it with pieces of the same sizes.")
      .def_prop_ro("committed_steps",
                   [](const PyElasticGroup& g) { return g.group->committed_steps(); })
      .def_prop_ro("recoveries", [](const PyElasticGroup& g) { return g.group->recoveries(); })
      .def_prop_ro("replicas", [](const PyElasticGroup& g) { return g.group->options().replicas; })
      .def_prop_ro("shard_size",
                   [](const PyElasticGroup& g) { return g.group->options().shard_size; })
      .def_prop_ro("replica", [](const PyElasticGroup& g) { return g.group->options().replica; })
      .def_prop_ro("shard", [](const PyElasticGroup& g) { return g.group->options().shard; })
      .def_prop_ro(
          "round_timeout",
          [](const PyElasticGroup& g) { return absl::ToDoubleSeconds(g.group->options().timeout); },
          "Seconds of silence in the log after which a waiting rank decides the round.")
      .def_prop_ro("incarnation",
                   [](const PyElasticGroup& g) { return g.group->options().incarnation; })
      .def("__repr__", [](const PyElasticGroup& g) {
        const ElasticOptions& o = g.group->options();
        return absl::StrCat("<shardline.ElasticGroup '", o.name, "' rank (", o.replica, ", ",
                            o.shard, ") of ", o.replicas, " x ", o.shard_size, ", incarnation ",
                            o.incarnation, ", ", g.group->committed_steps(), " steps committed>");
      });
}

}  // namespace shardline::python
