// File: runtime/trace.h
// -----------------------------------------------------------------------------
// Chrome-trace (Perfetto / chrome://tracing) timelines. One TraceWriter per rank: its events
// carry pid = rank, and every track (a stream: "gather", "reduce", "compute") gets its own tid,
// so the viewer shows communication overlapping compute as parallel lanes.
//
// Events are "complete" events (ph "X": a name, a start and a duration, in microseconds) and
// counters (ph "C", e.g. bytes in use per pool). Process and track names are emitted as metadata
// events (ph "M"). Timestamps are wall-clock microseconds since the Unix epoch, so traces of
// ranks on one machine line up when merged; streams traced on a virtual clock
// (StreamOptions::trace with a ManualClock) write that clock's times instead.
//
//   TraceWriter trace(/*rank=*/0);
//   int gather = trace.Track("gather");
//   { TraceSpan span(&trace, gather, "all_gather unit 3", "coll"); ... }
//   SL_RETURN_IF_ERROR(trace.WriteFile("/tmp/rank0.json"));
//   // several ranks' files -> one: MergeTraceFiles({...}, "/tmp/all.json")
//
// Thread safety: all methods may be called from any thread. Memory is bounded: after
// `max_events` events further ones are counted and dropped (the count is written as metadata).

#ifndef SHARDLINE_RUNTIME_TRACE_H_
#define SHARDLINE_RUNTIME_TRACE_H_

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace shardline {

// Named arguments shown in the viewer's detail pane.
struct TraceArgs {
  std::vector<std::pair<std::string, int64_t>> ints;
  std::vector<std::pair<std::string, std::string>> strings;
};

class TraceWriter {
 public:
  explicit TraceWriter(int rank, std::string process_name = "", size_t max_events = 1 << 22);

  int rank() const { return rank_; }

  // The tid of the track called `name`, created on first use (tids count from 1 in creation
  // order, so traces are deterministic).
  int Track(absl::string_view name);

  // A complete event on track `tid`.
  void AddComplete(int tid, absl::string_view name, absl::string_view category, absl::Time start,
                   absl::Duration duration, TraceArgs args = {});
  // A counter sample: the viewer draws `series` of counter `name` as a step graph.
  void AddCounter(absl::string_view name, absl::Time when,
                  std::vector<std::pair<std::string, double>> series);

  size_t num_events() const;
  size_t num_dropped() const;

  // {"traceEvents":[...],"displayTimeUnit":"ms"}
  std::string ToJson() const;
  // Writes ToJson() to `path` (atomically: a temp file renamed into place).
  absl::Status WriteFile(const std::string& path) const;

 private:
  struct Event {
    char phase;  // 'X' or 'C'
    int tid;
    std::string name;
    std::string category;
    double ts_us;
    double dur_us;
    TraceArgs args;
    std::vector<std::pair<std::string, double>> series;
  };
  bool Admit();  // requires mu_

  const int rank_;
  const std::string process_name_;
  const size_t max_events_;
  mutable std::mutex mu_;
  std::vector<Event> events_;
  size_t dropped_ = 0;
  absl::flat_hash_map<std::string, int> tracks_;
  std::vector<std::string> track_names_;  // index = tid - 1
};

// Records one complete event from construction to destruction (or End()).
class TraceSpan {
 public:
  // A null writer makes the span a no-op, so call sites need no "is tracing on" branches.
  TraceSpan(TraceWriter* writer, int tid, absl::string_view name, absl::string_view category);
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;
  ~TraceSpan() { End(); }

  TraceArgs& args() { return args_; }
  void End();

 private:
  TraceWriter* writer_;
  int tid_;
  std::string name_;
  std::string category_;
  absl::Time start_;
  TraceArgs args_;
};

// Concatenates the traceEvents of several files written by TraceWriter::WriteFile into one
// file (one pid per rank is preserved). InvalidArgument naming the file that is not one of ours.
absl::Status MergeTraceFiles(const std::vector<std::string>& inputs, const std::string& output);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_TRACE_H_
