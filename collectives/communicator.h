// File: collectives/communicator.h
// -----------------------------------------------------------------------------
// The Communicator API: the collectives FSDP needs, over a group of ranks, enqueued on a Stream
// and returning a Work handle. Backends (collectives/<name>/) implement the data movement; this
// class owns everything they have in common, so that every backend validates, numbers and
// fails the same way:
//
//   * Argument validation. Sizes, dtypes, ops, roots, aliasing and the stream's device are
//     checked before anything is enqueued; a violation is InvalidArgument naming the collective,
//     the argument and the value. Nothing is enqueued then.
//   * Sequence numbers and fingerprints. Every collective gets the communicator's next sequence
//     number and a fingerprint (kind, count, dtype, op, root; collective_fingerprint.h).
//     Backends compare fingerprints across ranks before moving data: if ranks disagree, every
//     rank fails with an error that names the collective and the two differing ranks, e.g.
//       "all_gather #12 on world (rank 0 of 4): rank 0 called all_gather(count=7, f32) but
//        rank 2 called all_gather(count=8, f32)"
//     and no memory is written.
//   * Deadlines and abort. Every collective gives up at its deadline (its start on the stream
//     plus the timeout, default SHARDLINE_TIMEOUT_S) with DeadlineExceeded naming the ranks it
//     was waiting for. A dead peer, a failed collective or Abort() aborts the communicator: the
//     in-flight and every later collective fail with the first error (Aborted/Unavailable/...),
//     on every rank the backend can reach.
//
// Counts follow NCCL: `count` is the number of elements each rank contributes (AllGather,
// AllToAll: per peer) or receives (ReduceScatter); for AllReduce and Broadcast it is the size of
// the whole buffer. A count of 0 is legal and still synchronises nothing but the sequence.
//
// In-place forms, as NCCL defines them (element size e, rank r, size n):
//   AllGather      input == output + r * count * e
//   ReduceScatter  output == input + r * count * e
//   AllReduce      input == output
//   Broadcast      one buffer (input == output)
// Any other overlap of input and output is InvalidArgument. AllToAll has no in-place form.
//
// Dtypes: f32, f64, f16, bf16, i32, i64 everywhere; u8 and i8 for AllGather, Broadcast and
// AllToAll (byte movement only). Reductions: sum, avg, min, max, product (avg of integers
// truncates; integer sums and products wrap modulo 2^bits).
//
// Ordering across streams (the rule every scheduler must follow). A communicator runs its
// collectives in issue order, whichever streams they were issued on: a collective issued on
// stream B after one issued on stream A starts only once A's has finished (the base class makes
// B wait for A's completion event; every backend inherits it). So a stream must never wait, even
// indirectly, for a collective issued LATER on the same communicator. Example: the all-gather
// AG(i-1) on the gather stream waits for memory that the reduce-scatter RS(i), issued after it
// on the reduce stream, frees: AG(i-1) is queued first, RS(i) waits for AG(i-1), and both wait
// until the deadline. Where such a dependency is needed, issue the two on different
// communicators (Dup()).
//
// A collective that its stream drops without running (the stream was poisoned after the
// collective was enqueued), or whose completion event cannot be recorded, aborts the communicator
// at once, with an error naming the collective, its sequence number and the stream; the peers
// learn it from the abort (every backend tells the peers it can reach), not at their deadlines.
//
// Errors caused by peers (ranks that disagree on a collective, ranks that did not show up, a
// peer's abort) carry the payload kPeerErrorPayload (IsPeerError()), so that callers can tell
// them from their own bad arguments (both may be InvalidArgument).
//
// Flight recorder (flight_recorder.h): every communicator keeps its last SHARDLINE_FLIGHT_RECORDER
// collectives (default 2048, 0: off) with their state, and, where SHARDLINE_FLIGHT_RECORDER_DIR
// is set, writes them as JSON into that directory when it is aborted (a collective error, a
// deadline, a peer's abort, Abort()) — and again once the collective running then has ended, so
// the file shows it failed — and, for every communicator of the process, on SIGUSR1. The sim
// backend records nothing (a thousand simulated ranks share one process).
//
// Point-to-point (Send, Recv). A send to rank d with message tag t matches a receive posted by
// d from this rank (or from kAnySource) with tag t; between two ranks, sends and receives of one
// tag match in the order each rank issued them (MPI's non-overtaking rule); a receive from
// kAnySource takes the earliest arrived match from any rank. They are not collectives:
//   * Only the two ranks take part, and they are outside the issue order: a send or receive
//     neither waits for the collective issued before it on another stream nor holds back the
//     collectives issued after it. On its own stream it is ordered like any other work: it
//     starts after what was enqueued before it and work enqueued after it waits for it (a
//     receive's data is there; a send's buffer may be reused).
//   * A send completes once its data is out of its buffer, copied into the backend's buffers:
//     it never waits for its receive, so two ranks that both send first do not deadlock. A
//     receive completes once the data is in its buffer. The two sides must agree on the count
//     and dtype: a receive that matches a send of another size or dtype fails naming both
//     (InvalidArgument, a peer error), and so aborts the communicator; it writes nothing.
//   * Each has its own sequence number ("send #3"), counted over this rank's sends and receives
//     only (ranks need not issue the same ones), a fingerprint (kind, count, dtype, peer in
//     `root`, tag in `key`), and a flight record in a ring of their own.
//   * Deadlines and aborts as for collectives: a receive with no matching send by its deadline
//     fails with DeadlineExceeded naming the rank(s) it waited for, and a failed send or
//     receive aborts the communicator like a failed collective.
//   * The backends that have them: local, ucx and sim (kAnySource on all three; ucx carries
//     message tags up to 2^36 - 1), and nccl with NCCL's limits (nccl_communicator.h): tag 0
//     only, no kAnySource, and a send that waits for its receive. A communicator without them
//     returns Unimplemented naming why; nothing is enqueued.
//
// Thread safety: collectives may be issued from several threads at once (PyTorch runs backward
// hooks on its own threads); Issue is serialized, and the order in which the calls take the
// communicator's lock is the issue order. All ranks must issue the same collectives in the same
// order. Abort() and status() may be called from any thread.

#ifndef SHARDLINE_COLLECTIVES_COMMUNICATOR_H_
#define SHARDLINE_COLLECTIVES_COMMUNICATOR_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "collectives/collective_fingerprint.h"
#include "collectives/flight_recorder.h"
#include "runtime/allocator.h"
#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/stream.h"

namespace shardline {

// The payload type URL of errors caused by peers; its value names the peer rank(s).
inline constexpr absl::string_view kPeerErrorPayload = "type.shardline/peer_error";

// True if `status` carries kPeerErrorPayload.
bool IsPeerError(const absl::Status& status);
// `status` with kPeerErrorPayload set to `peers` ("2", "1, 3").
absl::Status MarkPeerError(absl::Status status, absl::string_view peers);

struct CollectiveOptions {
  // How long the collective may take once it starts on its stream. Unset (zero): the
  // communicator's timeout, which defaults to SHARDLINE_TIMEOUT_S.
  absl::Duration timeout = absl::ZeroDuration();
  // A label for the flight recorder ("block.17": the scheduler puts the unit's name here). Not
  // part of the fingerprint: ranks may tag the same collective differently.
  std::string tag;
  // What the collective moves, as a number every rank must pass the same (the scheduler: its
  // unit's id + 1); 0: unsaid. Part of the fingerprint: ranks that pass different keys fail the
  // collective on every rank before any data moves (InvalidArgument, a peer error), as for a
  // different count or dtype. The message names each key by the tag this rank last issued it
  // with ("for 'block3'"), else by its number.
  uint64_t key = 0;
};

struct ReduceOptions : CollectiveOptions {
  ReduceOp op = ReduceOp::kSum;
};

struct BroadcastOptions : CollectiveOptions {
  int root = 0;
};

// Send and Recv.
struct PointToPointOptions {
  // As CollectiveOptions::timeout: from the operation's start on its stream.
  absl::Duration timeout = absl::ZeroDuration();
  // A label for the flight recorder (CollectiveOptions::tag).
  std::string label;
  // The message tag a send and a receive match on (MPI's and torch's `tag`).
  uint64_t match_tag = 0;
};

class Communicator;

// The handle of one enqueued collective (c10d's Work). Copyable; all copies refer to the same
// collective. A default-constructed Work is complete.
class Work {
 public:
  Work() = default;

  // True once the collective finished, successfully or not (Wait() tells which).
  bool IsCompleted() const;
  // Never blocks: OK while the collective runs or once it succeeded; its error once it failed.
  absl::Status status() const;
  // Blocks the calling thread until the collective finished: OK, its error, or DeadlineExceeded
  // if `deadline` passes first (the collective itself keeps running then). That DeadlineExceeded
  // names the collective and its sequence number, says whether it is still queued or running,
  // and names the ranks it still waits for where the flight recorder knows them, e.g.
  //   "all_reduce #3 on world (rank 0 of 2, ucx): not finished after waiting 1s: running for
  //    1.02s, waiting for rank(s) 1"
  // It carries no peer-error payload: the wait gave up, the collective did not fail.
  absl::Status Wait(absl::Time deadline) const;
  // Makes work enqueued on `stream` afterwards wait for the collective, without blocking the
  // host (for host streams: the stream's worker waits).
  absl::Status Synchronize(Stream& stream) const;
  // Aborts the communicator that issued the collective: it and every collective in flight or
  // issued later fail with `reason` (Aborted "aborted through a Work handle" if OK).
  void Abort(absl::Status reason = absl::OkStatus()) const;

  // The event recorded after the collective on its stream (null for a default Work).
  const std::shared_ptr<Event>& event() const { return done_; }

  // A completed Recv: the rank the data came from (for kAnySource, the one it matched). -1
  // before it completed, if it failed, and for every other operation.
  int source() const;

 private:
  friend class Communicator;
  Work(std::shared_ptr<Event> done, std::weak_ptr<Communicator> comm, CollectiveKind kind,
       uint64_t seq, std::shared_ptr<std::atomic<int>> source = nullptr)
      : done_(std::move(done)),
        comm_(std::move(comm)),
        kind_(kind),
        seq_(seq),
        source_(std::move(source)) {}

  std::shared_ptr<Event> done_;
  std::weak_ptr<Communicator> comm_;
  CollectiveKind kind_ = CollectiveKind::kBarrier;
  uint64_t seq_ = 0;
  std::shared_ptr<std::atomic<int>> source_;  // Recv: set by the operation before it completes
};

// How a backend's peers read memory registered with Communicator::RegisterMemory.
enum class TransferPath : uint8_t {
  // The backend moves any memory alike; registering changes nothing (local, sim, nccl).
  kAny,
  // Peers on this host read it out of their own mapping of it (shareable memory,
  // runtime/shared_memory.h): one copy with plain loads, reductions straight out of it.
  kMapped,
  // Peers on this host read it with process_vm_readv: one copy, one system call per transfer
  // (private memory, which no peer can map; or SHARDLINE_UCX_MAP=0).
  kProcessRead,
  // Through the backend's transports (UCX's shared-memory FIFOs: two copies per byte; the
  // network across hosts): peers that may not read this process's memory, or none on this host.
  kTransport,
};
// "any", "mapped", "process_read", "transport".
absl::string_view TransferPathName(TransferPath path);

// A range of memory registered with a communicator (Communicator::RegisterMemory), the
// ncclCommRegister / ucp_mem_map pattern. Move-only; unregisters when destroyed or Reset(), which
// must happen before the memory is freed and may outlive the communicator (it then does
// nothing). path() tells how the peers will read the range, so that a caller learns whether its
// buffers take the single-copy mapped path or fall back.
class Registration {
 public:
  Registration() = default;
  Registration(Registration&& other) noexcept;
  Registration& operator=(Registration&& other) noexcept;
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;
  ~Registration() { Reset(); }

  const void* data() const { return data_; }
  size_t size() const { return size_; }
  TransferPath path() const { return path_; }
  // False for a default-constructed or reset registration.
  bool registered() const { return id_ != 0; }
  // Unregisters now.
  void Reset();

 private:
  friend class Communicator;
  std::weak_ptr<Communicator> comm_;
  uint64_t id_ = 0;
  const void* data_ = nullptr;
  size_t size_ = 0;
  TransferPath path_ = TransferPath::kAny;
};

class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  virtual ~Communicator() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The device whose memory the collectives move (host for local/ucx, cuda:N for nccl).
  Device device() const { return device_; }
  // "local", "ucx", "nccl", "sim".
  virtual absl::string_view backend() const = 0;
  // A name for messages: "world", "world/split(color=1)", "mesh.shard"...
  const std::string& name() const { return name_; }
  absl::Duration timeout() const { return timeout_; }

  absl::StatusOr<Work> AllGather(const void* input, void* output, size_t count, DType dtype,
                                 Stream& stream, const CollectiveOptions& options = {});
  absl::StatusOr<Work> ReduceScatter(const void* input, void* output, size_t count, DType dtype,
                                     Stream& stream, const ReduceOptions& options = {});
  absl::StatusOr<Work> AllReduce(const void* input, void* output, size_t count, DType dtype,
                                 Stream& stream, const ReduceOptions& options = {});
  absl::StatusOr<Work> Broadcast(void* buffer, size_t count, DType dtype, Stream& stream,
                                 const BroadcastOptions& options = {});
  absl::StatusOr<Work> AllToAll(const void* input, void* output, size_t count, DType dtype,
                                Stream& stream, const CollectiveOptions& options = {});
  absl::StatusOr<Work> Barrier(Stream& stream, const CollectiveOptions& options = {});

  // Point-to-point (the rules above; defined in point_to_point.cc). Send: `count` elements of
  // `data` to rank `peer`. Recv: `count` elements into `data` from rank `peer`, or from any rank
  // (kAnySource; Work::source() tells which). Any dtype. InvalidArgument for a peer out of
  // range or this rank itself, a null buffer with a non-zero count, a negative timeout;
  // Unimplemented where the backend has no point-to-point (or no kAnySource).
  absl::StatusOr<Work> Send(const void* data, size_t count, DType dtype, int peer, Stream& stream,
                            const PointToPointOptions& options = {});
  absl::StatusOr<Work> Recv(void* data, size_t count, DType dtype, int peer, Stream& stream,
                            const PointToPointOptions& options = {});

  // Splits the group as MPI_Comm_split does: ranks with the same `color` form a new
  // communicator, ordered by (`key`, rank). A negative color takes part in the split but joins
  // no group (the result is nullptr). Collective over this communicator: every rank must call
  // it, in the same position of its sequence of collectives. Blocks the calling thread until
  // the new communicator is ready or `deadline` passes.
  absl::StatusOr<std::shared_ptr<Communicator>> Split(int color, int key, absl::Time deadline);

  // A new communicator over the same ranks, in the same order, with its own sequence of
  // collectives (its own issue order: see the ordering rule above). Collective, like Split.
  absl::StatusOr<std::shared_ptr<Communicator>> Dup(absl::Time deadline);

  // A new communicator over this one's ranks minus `excluded` (typically peers that died), in
  // the same order, as ncclCommShrink does. It sends nothing over this communicator, so it
  // works after a dead peer aborted it: the survivors meet through the backend's store (ucx:
  // the store this communicator was created with, which must still be up — rank 0's when rank
  // 0 hosts it). Every survivor calls it with the same set; survivors with different sets form
  // different groups and fail at `deadline` naming the ranks they waited for. InvalidArgument
  // for a rank out of range, listed twice, or this rank itself; Unimplemented for nccl.
  // Defined in shrink.cc.
  absl::StatusOr<std::shared_ptr<Communicator>> Shrink(absl::Span<const int> excluded,
                                                       absl::Time deadline);

  // Registers [data, data + bytes) of this communicator's device memory for its collectives: the
  // returned Registration says how peers will read it (path()) and unregisters when destroyed.
  // Registering is never required for correctness; for the ucx backend memory takes the
  // single-copy mapped path only if it is shareable (from CreateHostAllocatorForTransfers, or
  // AllocateShareable) — registration cannot make private memory mappable, and copying it
  // elsewhere would defeat its purpose, so private memory registers as kProcessRead (peers read
  // it with process_vm_readv) and the caller may move its buffers to shareable memory. Ranges
  // may overlap and be registered several times. InvalidArgument for a null `data`, zero
  // `bytes` or a range that wraps around. Not collective: each rank registers its own memory.
  absl::StatusOr<Registration> RegisterMemory(const void* data, size_t bytes);
  // Registrations alive now.
  int64_t live_registrations() const { return live_registrations_.load(); }

  // A host allocator (alignment as CreateHostAllocator's) for buffers this communicator moves:
  // the memory its backend moves fastest.
  // ucx, with peers on this host that map memory: a shareable host allocator
  // (CreateShareableHostAllocator: its large blocks take the mapped single-copy path); every
  // other backend: a private one (CreateHostAllocator). The allocator must outlive its buffers,
  // not the communicator.
  virtual std::unique_ptr<Allocator> CreateHostAllocatorForTransfers(size_t alignment,
                                                                     std::string name) const;

  // Aborts: every collective in flight or issued later fails with `reason` (as Aborted if
  // `reason` is OK). Backends also tell the peers they can reach. Idempotent; the first reason
  // wins.
  void Abort(absl::Status reason = absl::OkStatus());
  // OK, or the error that aborted the communicator.
  absl::Status status() const;

  // Names a CollectiveOptions::key in this rank's errors before any collective with it is
  // issued here, as a collective's tag names its key once issued: a disagreement with a peer's
  // collective for that key then reads "for 'block3'" instead of "for key 4" on whichever rank
  // sees it first. A key keeps its first name; an empty tag or key 0 names nothing.
  void NameKey(uint64_t key, absl::string_view tag);

  // The sequence number the next collective will get (starts at 0).
  uint64_t next_seq() const;

  // The flight recorder's records, oldest first; running ones carry the peers they wait on where
  // the backend can tell (local, ucx). Empty if recording is off.
  std::vector<FlightRecord> FlightRecords() const;
  // The flight records of this rank's sends and receives, oldest first (a ring of their own).
  std::vector<FlightRecord> PointToPointFlightRecords() const;
  // The JSON dump of FlightRecords() and PointToPointFlightRecords() (format in
  // flight_recorder.h), `reason` saying why.
  std::string FlightRecordJson(absl::string_view reason) const;
  // Writes FlightRecordJson(reason) to FlightDumpPath(dir, name(), rank()); returns the path.
  // FailedPrecondition if recording is off; the write's error otherwise.
  absl::StatusOr<std::string> DumpFlightRecord(absl::string_view dir,
                                               absl::string_view reason) const;

 protected:
  Communicator(int rank, int size, Device device, std::string name, absl::Duration timeout);

  // One validated collective, as a backend receives it.
  struct Op {
    CollectiveFingerprint fingerprint;
    const void* input = nullptr;
    void* output = nullptr;
    // How long the op may run once started; Launch() sets `deadline` = start + timeout, on the
    // clock of the op's stream (`clock`), before calling Run().
    absl::Duration timeout;
    absl::Time deadline = absl::InfiniteFuture();
    const Clock* clock = &WallClock();
    // Bytes per element and elements of input and output, for convenience.
    size_t element_size = 0;
    size_t input_count = 0;
    size_t output_count = 0;
    // Recv: where Run() stores the rank the data came from (shared with the Work).
    std::shared_ptr<std::atomic<int>> source;
  };

  // Host backends: moves the data of `op`, blocking the calling thread (a stream's worker) until
  // done, op.deadline passes, or the communicator is aborted. Must check fingerprints first.
  virtual absl::Status Run(const Op& op) = 0;

  // Enqueues `op` on `stream`. The default submits a StreamOp that sets the deadline (on the
  // stream's clock) and calls Run(), aborts the communicator if Run() fails, and aborts it if
  // the stream drops the op. Device backends (NCCL) override it to launch on the device stream.
  // Called with the issue lock held, after the stream was made to wait for the previous
  // collective.
  virtual absl::Status Launch(Op op, Stream& stream);

  // The stream kinds this backend can run on (default: host memory on host/caller streams).
  virtual absl::Status CheckStream(const Stream& stream) const;
  // Whether this backend runs Send and Recv (from `peer`, possibly kAnySource, with message tag
  // `match_tag`): OK, or Unimplemented saying what it lacks (the default: no point-to-point at
  // all), or InvalidArgument for a tag out of the backend's range.
  virtual absl::Status CheckPointToPoint(CollectiveKind kind, int peer, uint64_t match_tag) const;
  // The memory this backend can move (default: any). Called before anything is enqueued, so a
  // wrong buffer is InvalidArgument and leaves the communicator intact; `where` names the call
  // ("all_reduce on world (rank 0 of 2)") for the message.
  virtual absl::Status CheckBuffers(absl::string_view where, const void* input, size_t input_bytes,
                                    const void* output, size_t output_bytes) const {
    return absl::OkStatus();
  }
  // Whether this backend's waits follow any stream clock (the local backend: its ranks are
  // threads that wait on one another) or need the wall clock (default: backends that move data
  // over real transports).
  virtual bool AcceptsAnyClock() const { return false; }

  // Split() after validation. The default agrees on the membership with an AllGather of every
  // rank's (color, key) over this communicator (on a caller stream, host memory) and calls
  // CreateSubgroup(); backends with a native split (ncclCommSplit) override it.
  virtual absl::StatusOr<std::shared_ptr<Communicator>> SplitImpl(int color, int key,
                                                                  absl::Time deadline);

  // Creates this rank's communicator for a split group: `ranks` are the members' ranks in this
  // communicator, in their new order; `index` is this rank's position in it; `name` is the same
  // on all members and unique per split group (usable as a store prefix).
  virtual absl::StatusOr<std::shared_ptr<Communicator>> CreateSubgroup(
      const std::vector<int>& ranks, int index, const std::string& name, absl::Time deadline) = 0;

  // RegisterMemory after validation: how peers will read the range (default kAny: nothing to
  // do). `id` (> 0, unique in this communicator) is what UnregisterMemory gets back.
  virtual absl::StatusOr<TransferPath> RegisterMemoryImpl(const void* data, size_t bytes,
                                                          uint64_t id) {
    return TransferPath::kAny;
  }
  virtual void UnregisterMemory(uint64_t id) {}

  // Called once when the communicator is aborted, with the reason (to wake waiters, tell peers).
  virtual void OnAbort(const absl::Status& reason) {}

  // Flight recorder hooks.
  // The peers the running collective still waits on, if the backend can tell at any moment
  // (called from a dump, on any thread). Backends that learn it only while they wait call
  // NoteWaitingOn instead.
  virtual std::optional<std::vector<int>> WaitingOn() const { return std::nullopt; }
  // Records the peers `op` waits on now.
  void NoteWaitingOn(const Op& op, const std::vector<int>& peers) const;
  // For backends that override Launch: `op` started running / ended with `status`. (The default
  // Launch records both.)
  void RecordStarted(const Op& op) const;
  void RecordEnded(const Op& op, const absl::Status& status) const;
  // Once aborted, with SHARDLINE_FLIGHT_RECORDER_DIR set: writes the dump again ("aborted:
  // <reason>"). Abort() dumps at once, while the collective in flight still runs; a backend that
  // records its end later (the NCCL watchdog) calls this then, so that the dump on disk shows it
  // failed. (The default Launch does it for Run().) Nothing if not aborted.
  void DumpAfterAbort() const;
  // Turns recording off; only in a backend's constructor.
  void DisableFlightRecorder();

  // Helpers for backends.
  // The error every rank reports when fingerprints differ; `a` < `b` are the first two
  // differing ranks.
  absl::Status MismatchError(const Op& op, int rank_a, const CollectiveFingerprint& fp_a,
                             int rank_b, const CollectiveFingerprint& fp_b) const;
  // "all_gather #12 on world (rank 0 of 4)": the prefix of every error about `op`.
  std::string Describe(const Op& op) const;
  std::string Describe(CollectiveKind kind, uint64_t seq) const;
  // A CollectiveOptions::key as this rank knows it: "'block3'" (NameKey's tag, or that of the
  // first collective issued here with that key), else "key 4".
  std::string KeyName(uint64_t key) const;
  // DeadlineExceeded for `op`, naming the ranks that did not show up (and recording them as the
  // peers it waits on).
  absl::Status DeadlineError(const Op& op, const std::vector<int>& missing_ranks) const;
  // Aborted for `op`, which will never run on `stream`: "<Describe(op)>: never ran: stream 'x'
  // <what>".
  absl::Status SkippedError(const Op& op, absl::string_view stream_name,
                            absl::string_view what) const;
  // The same, for an op dropped because of `cause` ("<what>: <cause>"): a peer error (its
  // payload) keeps its code and payload, so that it still reads as the peer's doing.
  absl::Status SkippedError(const Op& op, absl::string_view stream_name, absl::string_view what,
                            const absl::Status& cause) const;

 private:
  friend class Registration;
  friend class Work;
  // Work::Wait's DeadlineExceeded for collective #`seq`, whose wait gave up after `waited`.
  absl::Status WaitTimedOut(CollectiveKind kind, uint64_t seq, absl::Duration waited) const;
  absl::StatusOr<Work> Issue(CollectiveKind kind, const void* input, void* output,
                             size_t input_count, size_t output_count, size_t count, DType dtype,
                             ReduceOp op, int root, Stream& stream,
                             const CollectiveOptions& options);
  // Send and Recv after their arguments are known (point_to_point.cc).
  absl::StatusOr<Work> IssuePointToPoint(CollectiveKind kind, const void* input, void* output,
                                         size_t count, DType dtype, int peer, Stream& stream,
                                         const PointToPointOptions& options);
  // After validation, with issue_mu_ held: records `op` as enqueued (in its flight ring,
  // labelled `label`), launches it on `stream` and records its completion event. If either
  // fails, the communicator is aborted (the peers would wait for this rank in vain).
  absl::StatusOr<std::shared_ptr<Event>> EnqueueAndRecord(const Op& op, Stream& stream,
                                                          absl::string_view label);
  // The flight ring of `kind`: collectives', or point-to-point's.
  FlightRecorder& FlightOf(CollectiveKind kind) const {
    return IsPointToPoint(kind) ? *p2p_flight_ : *flight_;
  }

  const int rank_;
  const int size_;
  const Device device_;
  const std::string name_;
  const absl::Duration timeout_;
  // Serializes Issue; guards the sequence and the previous collective's completion event.
  mutable std::mutex issue_mu_;
  uint64_t next_seq_ = 0;
  std::atomic<uint64_t> issued_{0};  // next_seq_, readable without issue_mu_ (dumps)
  std::shared_ptr<Event> last_done_;
  std::unique_ptr<FlightRecorder> flight_;
  // Point-to-point: this rank's next sequence number (guarded by issue_mu_) and flight ring.
  uint64_t next_p2p_seq_ = 0;
  std::unique_ptr<FlightRecorder> p2p_flight_;
  bool flight_registered_ = false;  // guarded by issue_mu_
  // Serializes the dumps of this communicator (snapshot and write), so that of two dumps racing
  // (an abort's on one thread, the failed collective's on its stream) the later snapshot is the
  // file that stays.
  mutable std::mutex dump_mu_;
  // "all_gather on world (rank 0 of 2)" per kind, for Issue's messages: built at the first call
  // of each kind, so that issuing a collective formats no string. Guarded by issue_mu_.
  std::string call_sites_[static_cast<size_t>(CollectiveKind::kRecv) + 1];
  std::atomic<uint64_t> next_split_{0};
  std::atomic<uint64_t> next_shrink_{0};
  std::atomic<uint64_t> next_registration_{0};
  std::atomic<int64_t> live_registrations_{0};
  // The tag of each key issued here (KeyName), at most kMaxKeyTags of them.
  static constexpr size_t kMaxKeyTags = 1 << 16;
  mutable std::mutex key_mu_;
  absl::flat_hash_map<uint64_t, std::string> key_tags_;
  // The keys Issue has named already (guarded by issue_mu_): issuing a unit's collectives takes
  // key_mu_ only the first time.
  absl::flat_hash_set<uint64_t> issued_keys_;
  mutable std::mutex mu_;
  absl::Status abort_status_;
  std::atomic<bool> aborted_{false};
};

// Writes the flight record of every live communicator of this process that has issued a
// collective into `dir` (what SIGUSR1 does, with SHARDLINE_FLIGHT_RECORDER_DIR); returns the
// paths written. The first write error, if any, after trying them all.
absl::StatusOr<std::vector<std::string>> DumpAllFlightRecords(absl::string_view dir,
                                                              absl::string_view reason);

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_COMMUNICATOR_H_
