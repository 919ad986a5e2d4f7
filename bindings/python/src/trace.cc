// File: bindings/python/src/trace.cc
// -----------------------------------------------------------------------------
// shardline.Trace: a Chrome trace of one rank (runtime/trace.h) that a Scheduler writes its
// spans into and Python code adds its own to.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "bindings/python/src/common.h"
#include "runtime/trace.h"

namespace shardline::python {

void RegisterTrace(nb::module_& m) {
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
