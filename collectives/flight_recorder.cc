#include "collectives/flight_recorder.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "runtime/json.h"

namespace shardline {
namespace {

void AppendJsonString(std::string* out, absl::string_view s) { out->append(JsonQuote(s)); }

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
}

}  // namespace

absl::string_view FlightStateName(FlightState state) {
  switch (state) {
    case FlightState::kQueued:
      return "queued";
    case FlightState::kRunning:
      return "running";
    case FlightState::kDone:
      return "done";
    case FlightState::kFailed:
      return "failed";
  }
  return "invalid";
}

CollectiveFingerprint FlightRecord::fingerprint() const {
  return CollectiveFingerprint{kind, seq, count, dtype, op, root, key};
}

namespace {
// The slots reserved at the first record (the default capacity is 2048).
constexpr size_t kReserveSlots = 4096;
}  // namespace

FlightRecorder::FlightRecorder(size_t capacity) : capacity_(capacity) {}

uint64_t FlightRecorder::recorded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return recorded_;
}

FlightRecord* FlightRecorder::Slot(uint64_t seq) {
  if (recorded_ == 0 || seq < first_seq_ || seq - first_seq_ >= recorded_) return nullptr;
  const uint64_t index = seq - first_seq_;
  if (recorded_ - index > capacity_) return nullptr;  // overwritten
  return &slots_[index % capacity_];
}

const FlightRecord* FlightRecorder::Slot(uint64_t seq) const {
  return const_cast<FlightRecorder*>(this)->Slot(seq);
}

void FlightRecorder::Enqueued(const CollectiveFingerprint& fp, absl::string_view stream,
                              absl::string_view tag, int64_t now_ns) {
  if (capacity_ == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (recorded_ == 0) first_seq_ = fp.seq;
  const uint64_t index = recorded_++;
  if (slots_.size() < capacity_ && index >= slots_.size()) {
    // Room for the whole ring (the default's, at least) at the first record: growing by
    // doubling moved every record and returned the old block to the system each time, in the
    // middle of a hook. Untouched pages cost nothing.
    if (slots_.empty()) slots_.reserve(std::min<size_t>(capacity_, kReserveSlots));
    slots_.emplace_back();
  }
  FlightRecord& r = slots_[index % capacity_];
  r.kind = fp.kind;
  r.seq = fp.seq;
  r.count = fp.count;
  r.dtype = fp.dtype;
  r.op = fp.op;
  r.root = fp.root;
  r.key = fp.key;
  // assign() keeps the slot's capacity: once the ring has wrapped, recording allocates nothing.
  r.stream.assign(stream.data(), stream.size());
  r.tag.assign(tag.data(), tag.size());
  r.state = FlightState::kQueued;
  r.enqueued_ns = now_ns;
  r.started_ns = 0;
  r.ended_ns = 0;
  r.waiting_known = false;
  r.waiting_on.clear();
  r.error.clear();
}

void FlightRecorder::Started(uint64_t seq, int64_t now_ns) {
  if (capacity_ == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  FlightRecord* r = Slot(seq);
  if (r == nullptr || r->state != FlightState::kQueued) return;
  r->state = FlightState::kRunning;
  r->started_ns = now_ns;
}

void FlightRecorder::Ended(uint64_t seq, const absl::Status& status, int64_t now_ns) {
  if (capacity_ == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  FlightRecord* r = Slot(seq);
  // A collective ends once: a late report (an abort after it finished) changes nothing.
  if (r == nullptr || r->state == FlightState::kFailed || r->state == FlightState::kDone) return;
  r->ended_ns = now_ns;
  if (status.ok()) {
    r->state = FlightState::kDone;
    r->waiting_known = false;
    r->waiting_on.clear();
  } else {
    r->state = FlightState::kFailed;
    r->error.assign(status.ToString());
  }
}

void FlightRecorder::SetWaitingOn(uint64_t seq, const std::vector<int>& peers) {
  if (capacity_ == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  FlightRecord* r = Slot(seq);
  if (r == nullptr || r->state == FlightState::kDone) return;
  r->waiting_known = true;
  r->waiting_on.assign(peers.begin(), peers.end());
}

bool FlightRecorder::Find(uint64_t seq, FlightRecord* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  const FlightRecord* r = Slot(seq);
  if (r == nullptr) return false;
  *out = *r;
  return true;
}

std::vector<FlightRecord> FlightRecorder::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<FlightRecord> out;
  const uint64_t kept = std::min<uint64_t>(recorded_, capacity_);
  out.reserve(kept);
  for (uint64_t i = recorded_ - kept; i < recorded_; ++i) out.push_back(slots_[i % capacity_]);
  return out;
}

namespace {

// One record as a JSON object.
void AppendRecordJson(std::string* out, const FlightRecord& r) {
  const CollectiveFingerprint fp = r.fingerprint();
  absl::StrAppend(out, "{\"seq\": ", r.seq, ", \"call\": ");
  AppendJsonString(out, fp.CallString());
  *out += ", \"kind\": ";
  AppendJsonString(out, CollectiveName(r.kind));
  absl::StrAppend(out, ", \"count\": ", r.count, ", \"dtype\": ");
  AppendJsonString(out, DTypeName(r.dtype));
  *out += ", \"op\": ";
  AppendJsonString(out, ReduceOpName(r.op));
  absl::StrAppend(out, ", \"root\": ", r.root);
  if (IsPointToPoint(r.kind)) absl::StrAppend(out, ", \"key\": ", r.key);
  *out += ", \"stream\": ";
  AppendJsonString(out, r.stream);
  *out += ", \"tag\": ";
  AppendJsonString(out, r.tag);
  *out += ", \"state\": ";
  AppendJsonString(out, FlightStateName(r.state));
  absl::StrAppend(out, ", \"enqueued_ns\": ", r.enqueued_ns, ", \"started_ns\": ", r.started_ns,
                  ", \"ended_ns\": ", r.ended_ns);
  if (r.waiting_known) {
    *out += ", \"waiting_on\": [";
    for (size_t i = 0; i < r.waiting_on.size(); ++i) {
      absl::StrAppend(out, i == 0 ? "" : ", ", r.waiting_on[i]);
    }
    *out += "]";
  }
  *out += ", \"error\": ";
  AppendJsonString(out, r.error);
  *out += "}";
}

void AppendRecordsJson(std::string* out, const std::vector<FlightRecord>& records) {
  *out += "[";
  bool first = true;
  for (const FlightRecord& r : records) {
    *out += first ? "\n" : ",\n";
    first = false;
    AppendRecordJson(out, r);
  }
  *out += "\n]";
}

}  // namespace

std::string FlightRecordsToJson(const FlightDumpHeader& header,
                                const std::vector<FlightRecord>& records,
                                const std::vector<FlightRecord>& point_to_point) {
  std::string out =
      "{\"format\": \"shardline-flight-recorder\", \"version\": 1, \"communicator\": ";
  AppendJsonString(&out, header.communicator);
  out += ", \"backend\": ";
  AppendJsonString(&out, header.backend);
  absl::StrAppend(&out, ", \"rank\": ", header.rank, ", \"size\": ", header.size,
                  ", \"pid\": ", getpid(), ", \"host\": ");
  AppendJsonString(&out, HostName());
  out += ", \"reason\": ";
  AppendJsonString(&out, header.reason);
  absl::StrAppend(&out, ", \"dumped_at_ns\": ", absl::GetCurrentTimeNanos(),
                  ", \"capacity\": ", header.capacity, ", \"recorded\": ", header.recorded,
                  ", \"next_seq\": ", header.next_seq, ",\n\"entries\": ");
  AppendRecordsJson(&out, records);
  out += ",\n\"point_to_point\": ";
  AppendRecordsJson(&out, point_to_point);
  out += "}\n";
  return out;
}

std::string FlightDumpPath(absl::string_view dir, absl::string_view communicator, int rank) {
  std::string name(communicator);
  for (char& c : name) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '.' || c == '_' || c == '-';
    if (!keep) c = '_';
  }
  std::string path(dir);
  if (!path.empty() && path.back() != '/') path.push_back('/');
  absl::StrAppend(&path, "flight.", name, ".rank", rank, ".json");
  return path;
}

absl::Status WriteFlightDump(const std::string& path, absl::string_view json) {
  const std::string tmp = absl::StrCat(path, ".tmp", getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("flight recorder: cannot create ", tmp, ": ", std::strerror(errno)));
  }
  size_t done = 0;
  while (done < json.size()) {
    const ssize_t n = ::write(fd, json.data() + done, json.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return absl::UnavailableError(
          absl::StrCat("flight recorder: writing ", tmp, ": ", std::strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0 || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::UnavailableError(
        absl::StrCat("flight recorder: writing ", path, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

}  // namespace shardline
