// File: collectives/flight_recorder.h
// -----------------------------------------------------------------------------
// The flight recorder: every Communicator keeps its last N collectives (SHARDLINE_FLIGHT_RECORDER,
// default 2048; 0 turns recording off) in a ring, so that when a job hangs or fails each rank can
// say what it was doing: which collective (sequence number and fingerprint), on which stream,
// with which tag (the scheduler puts the unit's name there), when it was enqueued, started and
// ended, its state (queued, running, done, failed) and, for a running one, which peers it still
// waits on where the backend can tell.
//
// The Communicator records into it (communicator.h); this header holds the ring, the records and
// the JSON form of a dump. A dump is one JSON object per communicator and rank:
//
//   {"format": "shardline-flight-recorder", "version": 1, "communicator": "world",
//    "backend": "ucx", "rank": 0, "size": 4, "pid": 1234, "host": "node1",
//    "reason": "...", "dumped_at_ns": ..., "capacity": 2048, "recorded": 4122, "next_seq": 4122,
//    "entries": [{"seq": 4121, "call": "reduce_scatter(count=7, f32, sum)",
//                 "kind": "reduce_scatter", "count": 7, "dtype": "f32", "op": "sum", "root": 0,
//                 "stream": "reduce", "tag": "block.17", "state": "running",
//                 "enqueued_ns": ..., "started_ns": ..., "ended_ns": 0,
//                 "waiting_on": [3], "error": ""}, ...],
//    "point_to_point": [{"seq": 0, "call": "send(count=7, f32, to=1, tag=3)", "kind": "send",
//                        ..., "root": 1, "key": 3, ...}, ...]}
//
// "point_to_point" holds the communicator's sends and receives (communicator.h), numbered apart
// from the collectives, with the peer in "root" and the message tag in "key"; a dump of a
// communicator that issued none has an empty list.
//
// Entries are oldest first; times are Unix nanoseconds (0: not yet); "waiting_on" is present only
// where the backend told (see WaitingOn in communicator.h). `shardline-flight` merges the ranks'
// dumps (collectives/tools/shardline-flight).
//
// Cost: recording takes one uncontended mutex and one clock read per event (enqueue, start,
// end); strings are copied into slots that keep their capacity, so a ring that has wrapped once
// allocates nothing (docs/benchmarks.md has the measurement).

#ifndef SHARDLINE_COLLECTIVES_FLIGHT_RECORDER_H_
#define SHARDLINE_COLLECTIVES_FLIGHT_RECORDER_H_

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "collectives/collective_fingerprint.h"
#include "runtime/dtype.h"

namespace shardline {

enum class FlightState : uint8_t { kQueued, kRunning, kDone, kFailed };

// "queued", "running", "done", "failed".
absl::string_view FlightStateName(FlightState state);

// One collective as the recorder saw it.
struct FlightRecord {
  // Kind, sequence number, count, dtype, op, root, key (as in CollectiveFingerprint).
  CollectiveKind kind{};
  uint64_t seq = 0;
  uint64_t count = 0;
  DType dtype = DType::kU8;
  ReduceOp op = ReduceOp::kSum;
  int32_t root = 0;
  uint64_t key = 0;
  std::string stream;
  std::string tag;
  FlightState state = FlightState::kQueued;
  // Unix time in nanoseconds; 0 while it has not happened.
  int64_t enqueued_ns = 0;
  int64_t started_ns = 0;
  int64_t ended_ns = 0;
  // The peers a running (or timed-out) collective still waits on, if the backend told.
  bool waiting_known = false;
  std::vector<int> waiting_on;
  // Failed: the error.
  std::string error;

  CollectiveFingerprint fingerprint() const;
};

// The ring of one communicator. Thread-safe: the communicator records from the issuing thread
// and from its streams' threads; dumps read from any thread.
class FlightRecorder {
 public:
  // `capacity` 0: records nothing.
  explicit FlightRecorder(size_t capacity);
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  size_t capacity() const { return capacity_; }
  bool enabled() const { return capacity_ > 0; }
  // How many collectives were ever recorded (the ring holds the last capacity() of them).
  uint64_t recorded() const;

  // A collective was enqueued (state queued). Sequence numbers must grow by one per call.
  void Enqueued(const CollectiveFingerprint& fp, absl::string_view stream, absl::string_view tag,
                int64_t now_ns);
  // It started running (state running).
  void Started(uint64_t seq, int64_t now_ns);
  // It ended: done if `status` is OK, failed (with the message) otherwise. A collective that
  // already failed stays failed.
  void Ended(uint64_t seq, const absl::Status& status, int64_t now_ns);
  // The peers it waits on, as the backend knows them now.
  void SetWaitingOn(uint64_t seq, const std::vector<int>& peers);
  // The state of `seq` if it is still in the ring.
  bool Find(uint64_t seq, FlightRecord* out) const;

  // The records in the ring, oldest first.
  std::vector<FlightRecord> Snapshot() const;

 private:
  // The slot of `seq`, or null if the ring no longer (or not yet) holds it. Needs mu_.
  FlightRecord* Slot(uint64_t seq);
  const FlightRecord* Slot(uint64_t seq) const;

  const size_t capacity_;
  mutable std::mutex mu_;
  std::vector<FlightRecord> slots_;  // reserved at the first record, grows to capacity_, wraps
  uint64_t recorded_ = 0;
  uint64_t first_seq_ = 0;  // the sequence number of the first record ever
};

// What a dump says about the communicator besides its records.
struct FlightDumpHeader {
  std::string communicator;
  std::string backend;
  int rank = 0;
  int size = 1;
  std::string reason;
  size_t capacity = 0;
  uint64_t recorded = 0;
  uint64_t next_seq = 0;
};

// The JSON of a dump (the format in the file comment): the collectives' records and the
// point-to-point operations'.
std::string FlightRecordsToJson(const FlightDumpHeader& header,
                                const std::vector<FlightRecord>& records,
                                const std::vector<FlightRecord>& point_to_point = {});

// "<dir>/flight.<communicator>.rank<r>.json", the communicator's name with every character other
// than [A-Za-z0-9._-] replaced by '_'.
std::string FlightDumpPath(absl::string_view dir, absl::string_view communicator, int rank);

// Writes `json` to `path` atomically (a temporary file renamed over it). Errors name the path.
absl::Status WriteFlightDump(const std::string& path, absl::string_view json);

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_FLIGHT_RECORDER_H_
