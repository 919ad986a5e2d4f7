// File: bindings/python/src/work.cc
// -----------------------------------------------------------------------------
// shardline.Work, one issued collective: its wait and error, the tensors it keeps alive after
// its Python object is dropped, and what the interpreter's exit does with collectives still
// running (ExitCleanup).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "bindings/python/src/common.h"
#include "collectives/communicator.h"

namespace shardline::python {
namespace {

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

void WaitWork(const PyWork& w, std::optional<double> timeout_s) {
  absl::Status status;
  {
    nb::gil_scoped_release release;
    status = w.work.Wait(DeadlineIn(timeout_s));
  }
  if (absl::IsDeadlineExceeded(status) && !w.work.IsCompleted()) NoteTimedOut(w.work, status);
  ThrowIfError(status);
}

}  // namespace

PyWork::~PyWork() {
  if (!keep.empty() && !work.IsCompleted()) {
    Pendings().works.push_back({std::move(work), std::move(keep)});
  }
}

PyWork MakeWork(absl::StatusOr<Work> work, std::vector<nb::object> keep) {
  CollectPending();
  return PyWork{Unwrap(std::move(work)), std::move(keep)};
}

void RegisterWork(nb::module_& m) {
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
      .def_prop_ro(
          "source", [](const PyWork& w) { return w.work.source(); },
          "A completed recv: the rank its data came from; -1 before, if it failed, and for "
          "every other operation.")
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

  m.def("_drain", &DrainPending, nb::arg("timeout") = nb::none());
  m.def("_exit_cleanup", &ExitCleanup, nb::arg("drain_timeout") = nb::none(),
        "What the interpreter's exit runs (shardline/__init__.py): abort, finish, drain.");
  m.def("_abort_timed_out", &AbortTimedOut,
        "ExitCleanup's first step alone (registered at the first wait() that times out).");
  m.def("_pending_works", [] {
    CollectPending(/*full=*/true);
    return Pendings().works.size();
  });
}

}  // namespace shardline::python
