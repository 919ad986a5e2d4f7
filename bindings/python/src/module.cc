// File: bindings/python/src/module.cc
// -----------------------------------------------------------------------------
// shardline._core, nanobind's module: the order its parts register in (each in the file named
// after it), and DeadlineIn, which every blocking call shares. The package's __init__.py
// re-exports what users call.

#include <nanobind/nanobind.h>

#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bindings/python/src/common.h"
#include "collectives/collective_fingerprint.h"
#include "runtime/config.h"

namespace shardline::python {

absl::Time DeadlineIn(std::optional<double> timeout_s) {
  if (timeout_s.has_value()) {
    if (std::isnan(*timeout_s)) ThrowInvalid("timeout is NaN, not a number of seconds");
    if (*timeout_s < 0) ThrowInvalid(absl::StrCat("timeout ", *timeout_s, " s is negative"));
    return absl::Now() + absl::Seconds(*timeout_s);
  }
  return DefaultDeadline();
}

}  // namespace shardline::python

NB_MODULE(_core, m) {
  namespace sp = shardline::python;
  m.doc() = "shardline's native module; import shardline instead.";
  m.attr("__version__") = SHARDLINE_VERSION_STRING;
  m.attr("ANY_SOURCE") = shardline::kAnySource;  // Communicator.recv's peer: any rank
  sp::RegisterErrors(m);
  sp::RegisterWork(m);
  sp::RegisterTensors(m);
  sp::RegisterCollectives(m);
  sp::RegisterTrace(m);
  sp::RegisterScheduler(m);
  sp::RegisterStore(m);
  sp::RegisterCheckpoint(m);
  sp::RegisterElastic(m);
}
