// handoff_bench: how long a host stream takes to pass work to another thread on this machine,
// now (runtime/stream.h's host streams, the ones the scheduler's gather, reduce and grad
// streams are on the host backend).
//
//   build/bench/handoff_bench [--rounds N] [--json FILE]
//
// One round: the host submits an empty op to stream A and records an event there; stream B
// waits for that event, runs an empty op and records its own event; the host waits for B's
// event. That is three wake-ups of a sleeping thread (host -> A, A -> B, B -> host), so a round
// over 3 is one hand-off. Prints (and writes as JSON) the median, 10th and 90th percentiles
// over --rounds rounds (default 300) after 20 untimed ones, and the load average. It is the
// host backend's per-op cost that scripts/validate-sim gives the simulator (a topology's
// memory_ops.op_overhead_us), measured apart from the benchmark it predicts.

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "runtime/status.h"
#include "runtime/stream.h"

namespace shardline {
namespace {

absl::Status EmptyOp(Stream& stream) {
  StreamOp op;
  op.name = "empty";
  op.run = [] { return absl::OkStatus(); };
  return stream.Submit(std::move(op));
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return absl::StrCat(a, " ", b, " ", c);
}

absl::Status Run(int rounds, const std::string& json) {
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> a, CreateHostStream({.name = "handoff a"}));
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> b, CreateHostStream({.name = "handoff b"}));
  const std::string load_before = LoadAverage();
  std::vector<double> per_handoff_us;
  for (int i = 0; i < rounds + 20; ++i) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    const absl::Time t0 = absl::Now();
    SL_RETURN_IF_ERROR(EmptyOp(*a));
    SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> on_a, RecordEvent(*a));
    SL_RETURN_IF_ERROR(b->WaitEvent(*on_a));
    SL_RETURN_IF_ERROR(EmptyOp(*b));
    SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> on_b, RecordEvent(*b));
    SL_RETURN_IF_ERROR(on_b->Synchronize(deadline));
    const double us = absl::ToDoubleMicroseconds(absl::Now() - t0);
    if (i >= 20) per_handoff_us.push_back(us / 3);
  }
  const std::string load_after = LoadAverage();
  const double median = Percentile(per_handoff_us, 0.5);
  const double p10 = Percentile(per_handoff_us, 0.1);
  const double p90 = Percentile(per_handoff_us, 0.9);
  std::printf(
      "# handoff_bench: %d rounds, load %s -> %s\n# per hand-off: median %.1f us, p10 %.1f us, "
      "p90 %.1f us\n",
      rounds, load_before.c_str(), load_after.c_str(), median, p10, p90);
  if (!json.empty()) {
    std::ofstream out(json);
    out << absl::StrFormat(
        "{\"benchmark\": \"handoff_bench\", \"rounds\": %d, \"load_before\": \"%s\", "
        "\"load_after\": \"%s\", \"handoff_median_us\": %.3f, \"handoff_p10_us\": %.3f, "
        "\"handoff_p90_us\": %.3f}\n",
        rounds, load_before, load_after, median, p10, p90);
    if (!out.good()) return absl::UnavailableError(absl::StrCat("cannot write ", json));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace shardline

int main(int argc, char** argv) {
  int rounds = 300;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--rounds" || arg == "--json") && i + 1 < argc) {
      const std::string value = argv[++i];
      if (arg == "--json") {
        json = value;
      } else if (!absl::SimpleAtoi(value, &rounds) || rounds < 1) {
        std::fprintf(stderr, "handoff_bench: --rounds: '%s' is not a positive integer\n",
                     value.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr, "usage: handoff_bench [--rounds N] [--json FILE]\n");
      return arg == "-h" || arg == "--help" ? 0 : 2;
    }
  }
  const absl::Status status = shardline::Run(rounds, json);
  if (!status.ok()) {
    std::fprintf(stderr, "handoff_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
