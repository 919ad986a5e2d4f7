#include "runtime/trace.h"

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "runtime/json.h"

namespace shardline {
namespace {

double MicrosSinceEpoch(absl::Time t) { return absl::ToDoubleMicroseconds(t - absl::UnixEpoch()); }

void AppendQuoted(absl::string_view text, std::string* out) { out->append(JsonQuote(text)); }

// Numbers in JSON: finite only (NaN and Inf are not JSON); 3 decimals of a microsecond.
void AppendNumber(double value, std::string* out) {
  if (!std::isfinite(value)) value = 0;
  absl::StrAppendFormat(out, "%.3f", value);
}

void AppendMetadata(int pid, int tid, absl::string_view kind, absl::string_view name,
                    std::string* out) {
  absl::StrAppend(out, "{\"ph\":\"M\",\"pid\":", pid, ",\"tid\":", tid, ",\"name\":\"", kind,
                  "\",\"args\":{\"name\":");
  AppendQuoted(name, out);
  out->append("}}");
}

// The markers that delimit the events array in files we write; MergeTraceFiles relies on them.
constexpr absl::string_view kHeader = "{\"traceEvents\":[\n";
constexpr absl::string_view kFooter = "\n],\"displayTimeUnit\":\"ms\"}\n";

// Writes to a temp file renamed into place, so a reader never sees half a trace.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
    if (!file)
      return absl::InvalidArgumentError(absl::StrCat("cannot write trace file '", tmp, "'"));
    file.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    if (!file) return absl::InternalError(absl::StrCat("short write to trace file '", tmp, "'"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename '", tmp, "' to '", path, "'"));
  }
  return absl::OkStatus();
}

}  // namespace

TraceWriter::TraceWriter(int rank, std::string process_name, size_t max_events)
    : rank_(rank),
      process_name_(process_name.empty() ? absl::StrCat("rank ", rank) : std::move(process_name)),
      max_events_(max_events) {}

int TraceWriter::Track(absl::string_view name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = tracks_.try_emplace(name, static_cast<int>(track_names_.size()) + 1);
  if (inserted) track_names_.emplace_back(name);
  return it->second;
}

bool TraceWriter::Admit() {
  if (events_.size() < max_events_) return true;
  ++dropped_;
  return false;
}

void TraceWriter::AddComplete(int tid, absl::string_view name, absl::string_view category,
                              absl::Time start, absl::Duration duration, TraceArgs args) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!Admit()) return;
  events_.push_back(Event{'X',
                          tid,
                          std::string(name),
                          std::string(category),
                          MicrosSinceEpoch(start),
                          absl::ToDoubleMicroseconds(duration),
                          std::move(args),
                          {}});
}

void TraceWriter::AddCounter(absl::string_view name, absl::Time when,
                             std::vector<std::pair<std::string, double>> series) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!Admit()) return;
  events_.push_back(Event{
      'C', 0, std::string(name), "counter", MicrosSinceEpoch(when), 0, {}, std::move(series)});
}

size_t TraceWriter::num_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.size();
}

size_t TraceWriter::num_dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

std::string TraceWriter::ToJson() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out(kHeader.data(), kHeader.size());
  AppendMetadata(rank_, 0, "process_name", process_name_, &out);
  for (size_t i = 0; i < track_names_.size(); ++i) {
    out.append(",\n");
    AppendMetadata(rank_, static_cast<int>(i) + 1, "thread_name", track_names_[i], &out);
  }
  if (dropped_ > 0) {
    out.append(",\n");
    AppendMetadata(rank_, 0, "process_labels",
                   absl::StrCat(dropped_, " events dropped (max_events reached)"), &out);
  }
  for (const Event& e : events_) {
    absl::StrAppend(&out, ",\n{\"ph\":\"", absl::string_view(&e.phase, 1), "\",\"pid\":", rank_,
                    ",\"tid\":", e.tid, ",\"name\":");
    AppendQuoted(e.name, &out);
    out.append(",\"cat\":");
    AppendQuoted(e.category, &out);
    out.append(",\"ts\":");
    AppendNumber(e.ts_us, &out);
    if (e.phase == 'X') {
      out.append(",\"dur\":");
      AppendNumber(e.dur_us, &out);
    }
    out.append(",\"args\":{");
    bool first = true;
    auto key = [&](absl::string_view k) {
      if (!first) out.push_back(',');
      first = false;
      AppendQuoted(k, &out);
      out.push_back(':');
    };
    for (const auto& [k, v] : e.args.ints) {
      key(k);
      absl::StrAppend(&out, v);
    }
    for (const auto& [k, v] : e.args.strings) {
      key(k);
      AppendQuoted(v, &out);
    }
    for (const auto& [k, v] : e.series) {
      key(k);
      AppendNumber(v, &out);
    }
    out.append("}}");
  }
  out.append(kFooter.data(), kFooter.size());
  return out;
}

absl::Status TraceWriter::WriteFile(const std::string& path) const {
  return WriteFileAtomically(path, ToJson());
}

TraceSpan::TraceSpan(TraceWriter* writer, int tid, absl::string_view name,
                     absl::string_view category)
    : writer_(writer), tid_(tid) {
  if (writer_ == nullptr) return;
  name_ = std::string(name);
  category_ = std::string(category);
  start_ = absl::Now();
}

void TraceSpan::End() {
  if (writer_ == nullptr) return;
  writer_->AddComplete(tid_, name_, category_, start_, absl::Now() - start_, std::move(args_));
  writer_ = nullptr;
}

absl::Status MergeTraceFiles(const std::vector<std::string>& inputs, const std::string& output) {
  std::string merged(kHeader.data(), kHeader.size());
  bool first = true;
  for (const std::string& input : inputs) {
    std::ifstream file(input, std::ios::binary);
    if (!file)
      return absl::InvalidArgumentError(absl::StrCat("cannot read trace file '", input, "'"));
    std::stringstream buffer;
    buffer << file.rdbuf();
    const std::string text = buffer.str();
    if (text.size() < kHeader.size() + kFooter.size() ||
        absl::string_view(text).substr(0, kHeader.size()) != kHeader ||
        absl::string_view(text).substr(text.size() - kFooter.size()) != kFooter) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", input, "' is not a trace written by shardline's TraceWriter"));
    }
    absl::string_view body = absl::string_view(text).substr(
        kHeader.size(), text.size() - kHeader.size() - kFooter.size());
    if (body.empty()) continue;
    if (!first) merged.append(",\n");
    first = false;
    merged.append(body.data(), body.size());
  }
  merged.append(kFooter.data(), kFooter.size());
  return WriteFileAtomically(output, merged);
}

}  // namespace shardline
