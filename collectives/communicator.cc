#include "collectives/communicator.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "collectives/internal/flight_dump.h"
#include "runtime/clock.h"
#include "runtime/config.h"
#include "runtime/logging.h"
#include "runtime/recycling.h"
#include "runtime/status.h"

namespace shardline {
namespace {

// Byte-moving collectives (and send, recv) accept every dtype; reductions need arithmetic ones.
bool DTypeAllowed(CollectiveKind kind, DType dtype) {
  if (dtype == DType::kU8 || dtype == DType::kI8) {
    return !IsReduction(kind);
  }
  return true;
}

}  // namespace

bool IsPeerError(const absl::Status& status) {
  return status.GetPayload(kPeerErrorPayload).has_value();
}

absl::Status MarkPeerError(absl::Status status, absl::string_view peers) {
  if (!status.ok()) status.SetPayload(kPeerErrorPayload, absl::Cord(peers));
  return status;
}

absl::Status Work::status() const {
  if (done_ == nullptr) return absl::OkStatus();
  return done_->Query().status();
}

bool Work::IsCompleted() const {
  if (done_ == nullptr) return true;
  absl::StatusOr<bool> done = done_->Query();
  return !done.ok() || *done;
}

absl::Status Work::Wait(absl::Time deadline) const {
  if (done_ == nullptr) return absl::OkStatus();
  const absl::Time start = absl::Now();
  absl::Status status = done_->Synchronize(deadline);
  // The event's own message names only its stream; say which collective is late and why.
  if (absl::IsDeadlineExceeded(status) && !IsCompleted()) {
    if (std::shared_ptr<Communicator> comm = comm_.lock()) {
      return comm->WaitTimedOut(kind_, seq_, absl::Now() - start);
    }
  }
  return status;
}

absl::Status Work::Synchronize(Stream& stream) const {
  if (done_ == nullptr) return absl::OkStatus();
  return stream.WaitEvent(*done_);
}

int Work::source() const {
  if (source_ == nullptr || !IsCompleted() || !status().ok()) return -1;
  return source_->load(std::memory_order_acquire);
}

void Work::Abort(absl::Status reason) const {
  if (std::shared_ptr<Communicator> comm = comm_.lock()) {
    comm->Abort(reason.ok() ? absl::AbortedError("aborted through a Work handle")
                            : std::move(reason));
  }
}

Communicator::Communicator(int rank, int size, Device device, std::string name,
                           absl::Duration timeout)
    : rank_(rank),
      size_(size),
      device_(device),
      name_(std::move(name)),
      timeout_(timeout),
      flight_(std::make_unique<FlightRecorder>(flight_internal::Capacity())),
      p2p_flight_(std::make_unique<FlightRecorder>(flight_->capacity())) {}

void Communicator::DisableFlightRecorder() {
  flight_ = std::make_unique<FlightRecorder>(0);
  p2p_flight_ = std::make_unique<FlightRecorder>(0);
}

void Communicator::NoteWaitingOn(const Op& op, const std::vector<int>& peers) const {
  FlightOf(op.fingerprint.kind).SetWaitingOn(op.fingerprint.seq, peers);
}

absl::string_view TransferPathName(TransferPath path) {
  switch (path) {
    case TransferPath::kAny:
      return "any";
    case TransferPath::kMapped:
      return "mapped";
    case TransferPath::kProcessRead:
      return "process_read";
    case TransferPath::kTransport:
      return "transport";
  }
  return "invalid";
}

Registration::Registration(Registration&& other) noexcept
    : comm_(std::move(other.comm_)),
      id_(std::exchange(other.id_, 0)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      path_(other.path_) {}

Registration& Registration::operator=(Registration&& other) noexcept {
  if (this != &other) {
    Reset();
    comm_ = std::move(other.comm_);
    id_ = std::exchange(other.id_, 0);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    path_ = other.path_;
  }
  return *this;
}

void Registration::Reset() {
  if (id_ != 0) {
    if (std::shared_ptr<Communicator> comm = comm_.lock()) {
      comm->UnregisterMemory(id_);
      comm->live_registrations_.fetch_sub(1);
    }
  }
  comm_.reset();
  id_ = 0;
  data_ = nullptr;
  size_ = 0;
  path_ = TransferPath::kAny;
}

absl::StatusOr<Registration> Communicator::RegisterMemory(const void* data, size_t bytes) {
  const std::string where =
      absl::StrCat("register_memory on ", name_, " (rank ", rank_, " of ", size_, ")");
  if (data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": data is null"));
  }
  if (bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": bytes is 0"));
  }
  if (bytes - 1 > std::numeric_limits<uintptr_t>::max() - reinterpret_cast<uintptr_t>(data)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", bytes, " bytes from ",
                                                   absl::Hex(reinterpret_cast<uintptr_t>(data)),
                                                   " wrap around the address space"));
  }
  const uint64_t id = next_registration_.fetch_add(1) + 1;
  absl::StatusOr<TransferPath> path = RegisterMemoryImpl(data, bytes, id);
  if (!path.ok()) return Annotate(path.status(), where);
  Registration registration;
  registration.comm_ = weak_from_this();
  registration.id_ = id;
  registration.data_ = data;
  registration.size_ = bytes;
  registration.path_ = *path;
  live_registrations_.fetch_add(1);
  return registration;
}

std::unique_ptr<Allocator> Communicator::CreateHostAllocatorForTransfers(size_t alignment,
                                                                         std::string name) const {
  return CreateHostAllocator(alignment, std::move(name));
}

void Communicator::RecordStarted(const Op& op) const {
  FlightRecorder& flight = FlightOf(op.fingerprint.kind);
  if (flight.enabled()) flight.Started(op.fingerprint.seq, WallNowNanos());
}

void Communicator::RecordEnded(const Op& op, const absl::Status& status) const {
  FlightRecorder& flight = FlightOf(op.fingerprint.kind);
  if (flight.enabled()) flight.Ended(op.fingerprint.seq, status, WallNowNanos());
}

std::vector<FlightRecord> Communicator::FlightRecords() const {
  std::vector<FlightRecord> records = flight_->Snapshot();
  bool running = false;
  for (const FlightRecord& r : records) running = running || r.state == FlightState::kRunning;
  if (running) {
    if (std::optional<std::vector<int>> peers = WaitingOn()) {
      for (FlightRecord& r : records) {
        if (r.state != FlightState::kRunning) continue;
        r.waiting_known = true;
        r.waiting_on = *peers;
      }
    }
  }
  return records;
}

std::vector<FlightRecord> Communicator::PointToPointFlightRecords() const {
  return p2p_flight_->Snapshot();
}

std::string Communicator::FlightRecordJson(absl::string_view reason) const {
  FlightDumpHeader header;
  header.communicator = name_;
  header.backend = std::string(backend());
  header.rank = rank_;
  header.size = size_;
  header.reason = std::string(reason);
  header.capacity = flight_->capacity();
  header.recorded = flight_->recorded();
  header.next_seq = issued_.load(std::memory_order_relaxed);
  return FlightRecordsToJson(header, FlightRecords(), PointToPointFlightRecords());
}

absl::StatusOr<std::string> Communicator::DumpFlightRecord(absl::string_view dir,
                                                           absl::string_view reason) const {
  if (!flight_->enabled()) {
    return absl::FailedPreconditionError(
        absl::StrCat("communicator ", name_, " (rank ", rank_,
                     ") records no flights (SHARDLINE_FLIGHT_RECORDER=0 or the sim backend)"));
  }
  if (dir.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("flight record of ", name_, " (rank ", rank_, "): no directory given"));
  }
  std::string path = FlightDumpPath(dir, name_, rank_);
  std::lock_guard<std::mutex> lock(dump_mu_);
  SL_RETURN_IF_ERROR(WriteFlightDump(path, FlightRecordJson(reason)));
  return path;
}

void Communicator::NameKey(uint64_t key, absl::string_view tag) {
  if (key == 0 || tag.empty()) return;
  std::lock_guard<std::mutex> lock(key_mu_);
  if (key_tags_.size() < kMaxKeyTags) key_tags_.try_emplace(key, tag);
}

std::string Communicator::KeyName(uint64_t key) const {
  if (key == 0) return "no key";
  std::lock_guard<std::mutex> lock(key_mu_);
  auto it = key_tags_.find(key);
  if (it == key_tags_.end() || it->second.empty()) return absl::StrCat("key ", key);
  return absl::StrCat("'", it->second, "'");
}

void Communicator::DumpAfterAbort() const {
  if (!aborted_.load(std::memory_order_acquire) || !flight_->enabled() ||
      (flight_->recorded() == 0 && p2p_flight_->recorded() == 0)) {
    return;
  }
  const std::string dir = flight_internal::Dir();
  if (dir.empty()) return;
  absl::StatusOr<std::string> path =
      DumpFlightRecord(dir, absl::StrCat("aborted: ", status().ToString()));
  if (path.ok()) {
    SL_LOG(WARN, COLL) << "flight recorder: communicator " << name_ << " rank " << rank_
                       << " aborted; wrote " << *path;
  } else {
    SL_LOG(WARN, COLL) << "flight recorder: " << path.status();
  }
}

std::string Communicator::Describe(const Op& op) const {
  const CollectiveFingerprint& fp = op.fingerprint;
  if (fp.kind == CollectiveKind::kSend) {
    return absl::StrCat("send #", fp.seq, " to rank ", fp.root, " on ", name_, " (rank ", rank_,
                        " of ", size_, ", ", backend(), ")");
  }
  if (fp.kind == CollectiveKind::kRecv) {
    return absl::StrCat(
        "recv #", fp.seq, " from ",
        fp.root == kAnySource ? std::string("any rank") : absl::StrCat("rank ", fp.root), " on ",
        name_, " (rank ", rank_, " of ", size_, ", ", backend(), ")");
  }
  return Describe(fp.kind, fp.seq);
}

std::string Communicator::Describe(CollectiveKind kind, uint64_t seq) const {
  return absl::StrCat(CollectiveName(kind), " #", seq, " on ", name_, " (rank ", rank_, " of ",
                      size_, ", ", backend(), ")");
}

absl::Status Communicator::WaitTimedOut(CollectiveKind kind, uint64_t seq,
                                        absl::Duration waited) const {
  std::string state = "still running";  // what is known without a flight record
  const FlightRecorder& flight = FlightOf(kind);
  FlightRecord record;
  if (flight.Find(seq, &record)) {
    const absl::Time now = absl::Now();
    switch (record.state) {
      case FlightState::kQueued: {
        state = absl::StrCat("still queued on stream '", record.stream, "'");
        FlightRecord before;
        if (seq > 0 && flight.Find(seq - 1, &before) &&
            (before.state == FlightState::kQueued || before.state == FlightState::kRunning)) {
          absl::StrAppend(&state, ", behind ", CollectiveName(before.kind), " #", seq - 1, " (",
                          FlightStateName(before.state), ")");
        }
        break;
      }
      case FlightState::kRunning: {
        state =
            absl::StrCat("running for ",
                         absl::FormatDuration(absl::Trunc(
                             now - absl::FromUnixNanos(record.started_ns), absl::Milliseconds(1))));
        std::optional<std::vector<int>> peers;
        if (!IsPointToPoint(kind)) peers = WaitingOn();  // the running collective's
        if (!peers.has_value() && record.waiting_known) peers = record.waiting_on;
        if (peers.has_value() && !peers->empty()) {
          absl::StrAppend(&state, ", waiting for rank(s) ", absl::StrJoin(*peers, ", "));
        }
        break;
      }
      case FlightState::kDone:
      case FlightState::kFailed:
        state = "it finished just as the wait gave up";
        break;
    }
  }
  return absl::DeadlineExceededError(
      absl::StrCat(Describe(kind, seq), ": not finished after waiting ",
                   absl::FormatDuration(absl::Trunc(waited, absl::Milliseconds(1))), ": ", state));
}

absl::Status Communicator::MismatchError(const Op& op, int rank_a,
                                         const CollectiveFingerprint& fp_a, int rank_b,
                                         const CollectiveFingerprint& fp_b) const {
  // Keys are named only where they differ (the same key says nothing new).
  const bool keyed = fp_a.key != fp_b.key;
  auto call = [&](const CollectiveFingerprint& fp) {
    return keyed ? absl::StrCat(fp.CallString(), " for ", KeyName(fp.key)) : fp.CallString();
  };
  std::string detail = absl::StrCat("rank ", rank_a, " called ", call(fp_a), " but rank ", rank_b,
                                    " called ", call(fp_b));
  if (fp_a.seq != fp_b.seq) {
    detail = absl::StrCat("rank ", rank_a, " is at collective #", fp_a.seq, " (", call(fp_a),
                          ") but rank ", rank_b, " at #", fp_b.seq, " (", call(fp_b), ")");
  }
  const int peer = rank_a == rank_ ? rank_b : rank_a;
  return MarkPeerError(absl::InvalidArgumentError(absl::StrCat(
                           Describe(op), ": ranks disagree on the collective: ", detail)),
                       absl::StrCat(peer));
}

absl::Status Communicator::DeadlineError(const Op& op, const std::vector<int>& missing) const {
  if (!missing.empty()) NoteWaitingOn(op, missing);
  absl::Status status = absl::DeadlineExceededError(absl::StrCat(
      Describe(op), ": timeout after ", absl::FormatDuration(op.timeout),
      missing.empty() ? std::string()
                      : absl::StrCat(" waiting for rank(s) ", absl::StrJoin(missing, ", "))));
  return missing.empty() ? status : MarkPeerError(std::move(status), absl::StrJoin(missing, ", "));
}

void Communicator::Abort(absl::Status reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.load(std::memory_order_relaxed)) return;
    abort_status_ = reason.ok() ? absl::AbortedError(absl::StrCat("communicator ", name_, " (rank ",
                                                                  rank_, ") was aborted"))
                                : reason;
    aborted_.store(true, std::memory_order_release);
  }
  SL_LOG(INFO, COLL) << "communicator " << name_ << " rank " << rank_
                     << " aborted: " << abort_status_;
  OnAbort(abort_status_);
  // After the peers were told: the dump must not delay their failure.
  DumpAfterAbort();
}

absl::Status Communicator::status() const {
  if (!aborted_.load(std::memory_order_acquire)) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  return abort_status_;
}

absl::Status Communicator::CheckStream(const Stream& stream) const {
  if (!stream.device().is_host()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "communicator ", name_, " (", backend(), ") moves host memory and runs on ",
        "host streams, but stream '", stream.name(), "' is on ", stream.device().ToString()));
  }
  return absl::OkStatus();
}

uint64_t Communicator::next_seq() const {
  std::lock_guard<std::mutex> lock(issue_mu_);
  return next_seq_;
}

absl::Status Communicator::SkippedError(const Op& op, absl::string_view stream_name,
                                        absl::string_view what) const {
  return absl::AbortedError(
      absl::StrCat(Describe(op), ": never ran: stream '", stream_name, "' ", what));
}

absl::Status Communicator::SkippedError(const Op& op, absl::string_view stream_name,
                                        absl::string_view what, const absl::Status& cause) const {
  absl::Status skipped = SkippedError(op, stream_name, absl::StrCat(what, ": ", cause.message()));
  // A stream poisoned by a peer's error (a mismatch, a dead peer) dropped it: that peer's doing,
  // reported as the peer error it is (its code, so a disagreement stays InvalidArgument).
  if (absl::optional<absl::Cord> peers = cause.GetPayload(kPeerErrorPayload)) {
    skipped = absl::Status(cause.code(), skipped.message());
    skipped.SetPayload(kPeerErrorPayload, *std::move(peers));
  }
  return skipped;
}

absl::Status Communicator::Launch(Op op, Stream& stream) {
  // One block per collective, recycled: run and cancel share it (each closure then holds only a
  // shared pointer, which fits in its inline storage).
  struct Task {
    std::shared_ptr<Communicator> comm;
    Op op;
    Stream* stream;
  };
  op.clock = &stream.clock();
  auto task =
      std::allocate_shared<Task>(RecyclingAllocator<Task>(), Task{shared_from_this(), op, &stream});
  StreamOp run;
  run.name = std::string(CollectiveName(op.fingerprint.kind));  // short: no allocation
  run.kind = StreamOpKind::kCollective;
  run.bytes = std::max(op.input_count, op.output_count) * op.element_size;
  // The sequence number is spent: without this the peers would wait for this rank until their
  // deadlines. Only the stream calls it, while it is alive.
  run.cancel = [task](const absl::Status& poison) {
    absl::Status skipped = task->comm->SkippedError(task->op, task->stream->name(),
                                                    "was poisoned before it ran", poison);
    task->comm->RecordEnded(task->op, skipped);
    task->comm->Abort(std::move(skipped));
  };
  run.run = [task = std::move(task)]() -> absl::Status {
    Communicator& comm = *task->comm;
    comm.RecordStarted(task->op);
    absl::Status status = comm.status();
    const bool ran = status.ok();
    if (ran) {
      task->op.deadline = task->op.clock->Now() + task->op.timeout;
      status = comm.Run(task->op);
    }
    comm.RecordEnded(task->op, status);
    if (!status.ok()) {
      // An abort raised while it ran (inside Run, a peer's notice, Abort() on another thread)
      // dumped it as running: write the dump again now that it shows the failure. Otherwise
      // the Abort below is the first and dumps it failed.
      const bool dumped_running = ran && comm.aborted_.load(std::memory_order_acquire);
      comm.Abort(status);
      if (dumped_running) comm.DumpAfterAbort();
    }
    return status;
  };
  return stream.Submit(std::move(run));
}

absl::StatusOr<Work> Communicator::Issue(CollectiveKind kind, const void* input, void* output,
                                         size_t input_count, size_t output_count, size_t count,
                                         DType dtype, ReduceOp reduce_op, int root, Stream& stream,
                                         const CollectiveOptions& options) {
  std::lock_guard<std::mutex> issue_lock(issue_mu_);
  SL_RETURN_IF_ERROR(status());
  const absl::string_view what = CollectiveName(kind);
  std::string& call_site = call_sites_[static_cast<size_t>(kind)];
  if (call_site.empty()) {
    call_site = absl::StrCat(what, " on ", name_, " (rank ", rank_, " of ", size_, ")");
  }
  auto invalid = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(call_site, ": ", parts...));
  };
  if (!DTypeAllowed(kind, dtype)) {
    return invalid("dtype ", DTypeName(dtype), " is not supported (reductions take f32, f64, ",
                   "f16, bf16, i32 or i64)");
  }
  if (options.timeout < absl::ZeroDuration()) {
    return invalid("negative timeout ", absl::FormatDuration(options.timeout));
  }
  if (kind == CollectiveKind::kBroadcast && (root < 0 || root >= size_)) {
    return invalid("root ", root, " is not a rank of this communicator (size ", size_, ")");
  }
  const size_t esize = DTypeSize(dtype);
  const size_t kMax = std::numeric_limits<size_t>::max() / 16;
  if (count > kMax / esize / static_cast<size_t>(size_)) {
    return invalid("count ", count, " of ", DTypeName(dtype), " overflows the address space");
  }
  const size_t in_bytes = input_count * esize;
  const size_t out_bytes = output_count * esize;
  if (in_bytes > 0 && input == nullptr) return invalid("input is null but count is ", count);
  if (out_bytes > 0 && output == nullptr) return invalid("output is null but count is ", count);

  // Aliasing: only NCCL's in-place forms may overlap.
  const auto in_begin = reinterpret_cast<uintptr_t>(input);
  const auto out_begin = reinterpret_cast<uintptr_t>(output);
  const bool overlap = in_bytes > 0 && out_bytes > 0 && in_begin < out_begin + out_bytes &&
                       out_begin < in_begin + in_bytes;
  if (overlap) {
    const size_t slice = count * esize * static_cast<size_t>(rank_);
    bool in_place = false;
    switch (kind) {
      case CollectiveKind::kAllGather:
        in_place = in_begin == out_begin + slice;
        break;
      case CollectiveKind::kReduceScatter:
        in_place = out_begin == in_begin + slice;
        break;
      case CollectiveKind::kAllReduce:
      case CollectiveKind::kBroadcast:
        in_place = in_begin == out_begin;
        break;
      case CollectiveKind::kAllToAll:
      case CollectiveKind::kBarrier:
      case CollectiveKind::kSend:
      case CollectiveKind::kRecv:
        break;
    }
    if (!in_place) {
      return invalid("input [", absl::Hex(in_begin), ", +", in_bytes, ") and output [",
                     absl::Hex(out_begin), ", +", out_bytes,
                     ") overlap but are not the in-place form of ", what,
                     kind == CollectiveKind::kAllToAll ? " (all_to_all has none)" : "");
    }
  }
  SL_RETURN_IF_ERROR(CheckStream(stream));
  SL_RETURN_IF_ERROR(CheckBuffers(call_site, input, in_bytes, output, out_bytes));
  if (&stream.clock() != &WallClock() && !AcceptsAnyClock()) {
    return invalid("stream '", stream.name(), "' runs on a ", stream.clock().name(),
                   " clock, but the ", backend(), " backend moves data in wall-clock time");
  }
  // Issue order across streams: this collective starts after the previous one finished. Nothing
  // is spent if the wait cannot be enqueued (the stream is poisoned, say).
  if (absl::Status waited = WaitUnlessSameStream(stream, last_done_); !waited.ok()) {
    return Annotate(waited, absl::StrCat(call_site, ": waiting for collective #", next_seq_ - 1,
                                         ", issued earlier on another stream"));
  }

  Op op;
  op.fingerprint = CollectiveFingerprint{kind,
                                         next_seq_++,
                                         count,
                                         dtype,
                                         IsReduction(kind) ? reduce_op : ReduceOp::kSum,
                                         kind == CollectiveKind::kBroadcast ? root : 0,
                                         options.key};
  if (options.key != 0 && !options.tag.empty() &&
      (issued_keys_.size() >= kMaxKeyTags || issued_keys_.insert(options.key).second)) {
    NameKey(options.key, options.tag);
  }
  op.input = input;
  op.output = output;
  op.element_size = esize;
  op.input_count = input_count;
  op.output_count = output_count;
  op.timeout = options.timeout == absl::ZeroDuration() ? timeout_ : options.timeout;
  issued_.store(next_seq_, std::memory_order_relaxed);
  SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> done, EnqueueAndRecord(op, stream, options.tag));
  last_done_ = done;
  return Work(std::move(done), weak_from_this(), kind, op.fingerprint.seq);
}

absl::StatusOr<std::shared_ptr<Event>> Communicator::EnqueueAndRecord(const Op& op, Stream& stream,
                                                                      absl::string_view label) {
  FlightRecorder& flight = FlightOf(op.fingerprint.kind);
  if (flight.enabled()) {
    if (!flight_registered_) {
      flight_registered_ = true;
      flight_internal::Register(weak_from_this());
    }
    flight.Enqueued(op.fingerprint, stream.name(), label, WallNowNanos());
  }
  absl::Status launched = Launch(op, stream);
  if (!launched.ok()) {
    // The sequence number is spent, so the peers would wait for this rank in vain: tell them.
    launched = SkippedError(op, stream.name(), "did not accept it", launched);
    RecordEnded(op, launched);
    Abort(launched);
    return launched;
  }
  absl::StatusOr<std::shared_ptr<Event>> done = RecordEvent(stream);
  if (!done.ok()) {
    // The stream is poisoned: by the collective itself (which has aborted the communicator with
    // its error already), or before it ran (its cancel aborts). Either way nobody can order work
    // after it; make sure the peers hear of it, and report what poisoned the stream.
    absl::Status skipped =
        SkippedError(op, stream.name(), "could not record its completion event", done.status());
    RecordEnded(op, skipped);
    Abort(std::move(skipped));
    return done.status();
  }
  return done;
}

absl::StatusOr<Work> Communicator::AllGather(const void* input, void* output, size_t count,
                                             DType dtype, Stream& stream,
                                             const CollectiveOptions& options) {
  return Issue(CollectiveKind::kAllGather, input, output, count, count * size_, count, dtype,
               ReduceOp::kSum, 0, stream, options);
}

absl::StatusOr<Work> Communicator::ReduceScatter(const void* input, void* output, size_t count,
                                                 DType dtype, Stream& stream,
                                                 const ReduceOptions& options) {
  return Issue(CollectiveKind::kReduceScatter, input, output, count * size_, count, count, dtype,
               options.op, 0, stream, options);
}

absl::StatusOr<Work> Communicator::AllReduce(const void* input, void* output, size_t count,
                                             DType dtype, Stream& stream,
                                             const ReduceOptions& options) {
  return Issue(CollectiveKind::kAllReduce, input, output, count, count, count, dtype, options.op, 0,
               stream, options);
}

absl::StatusOr<Work> Communicator::Broadcast(void* buffer, size_t count, DType dtype,
                                             Stream& stream, const BroadcastOptions& options) {
  return Issue(CollectiveKind::kBroadcast, buffer, buffer, count, count, count, dtype,
               ReduceOp::kSum, options.root, stream, options);
}

absl::StatusOr<Work> Communicator::AllToAll(const void* input, void* output, size_t count,
                                            DType dtype, Stream& stream,
                                            const CollectiveOptions& options) {
  return Issue(CollectiveKind::kAllToAll, input, output, count * size_, count * size_, count, dtype,
               ReduceOp::kSum, 0, stream, options);
}

absl::StatusOr<Work> Communicator::Barrier(Stream& stream, const CollectiveOptions& options) {
  return Issue(CollectiveKind::kBarrier, nullptr, nullptr, 0, 0, 0, DType::kU8, ReduceOp::kSum, 0,
               stream, options);
}

absl::StatusOr<std::shared_ptr<Communicator>> Communicator::Split(int color, int key,
                                                                  absl::Time deadline) {
  SL_RETURN_IF_ERROR(status());
  return SplitImpl(color, key, deadline);
}

absl::StatusOr<std::shared_ptr<Communicator>> Communicator::Dup(absl::Time deadline) {
  return Split(0, rank_, deadline);
}

absl::StatusOr<std::shared_ptr<Communicator>> Communicator::SplitImpl(int color, int key,
                                                                      absl::Time deadline) {
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream,
                      CreateCallerStream({.name = absl::StrCat(name_, ".split")}));
  const int32_t mine[2] = {color, key};
  std::vector<int32_t> all(2 * static_cast<size_t>(size_));
  CollectiveOptions options;
  options.timeout = std::max(deadline - absl::Now(), absl::Milliseconds(1));
  SL_ASSIGN_OR_RETURN(Work work, AllGather(mine, all.data(), 2, DType::kI32, *stream, options));
  SL_RETURN_IF_ERROR(work.Wait(deadline));
  const uint64_t split_index = next_split_.fetch_add(1);
  if (color < 0) return std::shared_ptr<Communicator>();

  std::vector<int> members;
  for (int r = 0; r < size_; ++r) {
    if (all[2 * r] == color) members.push_back(r);
  }
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });
  const int index =
      static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
  return CreateSubgroup(members, index, absl::StrCat(name_, "/split", split_index, ".color", color),
                        deadline);
}

}  // namespace shardline
