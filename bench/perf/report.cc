#include "bench/perf/report.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardline::perf {
namespace {

std::string TimeString(double us) {
  if (us >= 10000.0) return absl::StrFormat("%7.0f", us);
  if (us >= 100.0) return absl::StrFormat("%7.1f", us);
  return absl::StrFormat("%7.2f", us);
}

std::string JsonCell(const Cell& c) {
  if (!c.present) return "null";
  return absl::StrFormat(R"({"time_us": %.3f, "algbw": %.4f, "busbw": %.4f, "wrong": %s})",
                         c.time_us, c.algbw, c.busbw,
                         c.wrong < 0 ? std::string("null") : absl::StrCat(c.wrong));
}

std::string JsonEscape(absl::string_view s) {
  std::string out;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      out += absl::StrFormat("\\u%04x", ch);
    } else {
      out += ch;
    }
  }
  return out;
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "model name")) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
      }
    }
  }
  return "unknown CPU";
}

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown";
  std::string host(name);
  return host.substr(0, host.find('.'));
}

}  // namespace

std::string RankLine(int rank, Device device, absl::string_view backend) {
  return absl::StrFormat("#  Rank %2d Group %2d Pid %6d on %10s device %4s [%s] %s", rank, 0,
                         static_cast<int>(getpid()), HostName(), device.is_host() ? "host" : "cuda",
                         backend, device.is_host() ? CpuModel() : device.ToString());
}

void PrintRunHeader(const RunInfo& run, const std::vector<std::string>& rank_lines) {
  const Options& o = run.options;
  std::printf("# Collective test starting: %s\n", run.binary);
  std::printf(
      "# nThread %d nGpus %d minBytes %zu maxBytes %zu step: %zu(%s) warmup iters: %d iters: %d "
      "agg iters: %d validation: %d graph: %d\n",
      o.threads, 1, o.min_bytes, o.max_bytes, o.step_factor > 1 ? o.step_factor : o.step_bytes,
      o.step_factor > 1 ? "factor" : "bytes", o.warmup, o.iters, 1, o.check, 0);
  std::printf("#\n");
  std::printf(
      "# shardline backend %s, %d ranks (%d processes x %d threads), %s stream, "
      "time reported: %s\n",
      run.backend.c_str(), run.nranks, run.processes, o.threads, o.stream_kind.c_str(),
      o.average == 0   ? "rank 0"
      : o.average == 1 ? "average over ranks"
      : o.average == 2 ? "minimum over ranks"
                       : "maximum over ranks");
  std::printf("#\n# Using devices\n");
  for (const std::string& l : rank_lines) std::printf("%s\n", l.c_str());
  std::fflush(stdout);
}

void PrintColumnHeader() {
  const char* time_name = "time";
  std::printf("#\n");
  std::printf(
      "# %10s  %12s  %8s  %6s  %6s           out-of-place                       "
      "in-place          \n",
      "", "", "", "", "");
  std::printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s\n", "size",
              "count", "type", "redop", "root", time_name, "algbw", "busbw", "#wrong", time_name,
              "algbw", "busbw", "#wrong");
  std::printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s\n", "(B)",
              "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)",
              "");
  std::fflush(stdout);
}

std::string RowPrefix(const Row& row) {
  return absl::StrFormat("%12d  %12d  %8s  %6s  %6d", row.bytes, row.count, NcclTypeName(row.dtype),
                         row.redop, row.root);
}

std::string CellText(const Cell& c) {
  if (!c.present) return absl::StrFormat("  %7s  %6s  %6s  %5s", "N/A", "N/A", "N/A", "N/A");
  const std::string wrong = c.wrong < 0 ? std::string("N/A") : absl::StrCat(c.wrong);
  return absl::StrFormat("  %7s  %6.2f  %6.2f  %5s", TimeString(c.time_us), c.algbw, c.busbw,
                         wrong);
}

void PrintFooter(const RunInfo& run, int64_t errors, double avg_busbw) {
  std::printf("# Out of bounds values : %lld %s\n", static_cast<long long>(errors),
              errors ? "FAILED" : "OK");
  std::printf("# Avg bus bandwidth    : %g \n", avg_busbw);
  std::printf("#\n");
  std::printf("# Collective test concluded: %s\n", run.binary);
  std::fflush(stdout);
}

absl::Status WriteJson(const RunInfo& run, const std::vector<Row>& rows, int64_t errors,
                       double avg_busbw) {
  const Options& o = run.options;
  std::string json = absl::StrFormat(
      "{\n  \"test\": \"%s\",\n  \"backend\": \"%s\",\n  \"nranks\": %d,\n  \"nprocs\": %d,\n"
      "  \"nthreads\": %d,\n  \"stream\": \"%s\",\n  \"minbytes\": %zu,\n  \"maxbytes\": %zu,\n"
      "  \"stepfactor\": %zu,\n  \"stepbytes\": %zu,\n  \"iters\": %d,\n  \"warmup_iters\": %d,\n"
      "  \"validation\": %d,\n  \"average\": %d,\n  \"host\": \"%s\",\n  \"cpu\": \"%s\",\n"
      "  \"results\": [\n",
      run.binary, run.backend, run.nranks, run.processes, o.threads, o.stream_kind, o.min_bytes,
      o.max_bytes, o.step_factor, o.step_bytes, o.iters, o.warmup, o.check, o.average,
      JsonEscape(HostName()), JsonEscape(CpuModel()));
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    absl::StrAppendFormat(&json,
                          "    {\"size\": %zu, \"count\": %zu, \"type\": \"%s\", \"redop\": "
                          "\"%s\", \"root\": %d, \"out_of_place\": %s, \"in_place\": %s}%s\n",
                          r.bytes, r.count, NcclTypeName(r.dtype), r.redop, r.root,
                          JsonCell(r.out_of_place), JsonCell(r.in_place),
                          i + 1 < rows.size() ? "," : "");
  }
  absl::StrAppendFormat(&json, "  ],\n  \"out_of_bounds\": %lld,\n  \"avg_busbw\": %.6g\n}\n",
                        static_cast<long long>(errors), avg_busbw);
  std::ofstream out(o.json_path, std::ios::trunc);
  out << json;
  out.close();
  if (!out) {
    return absl::UnavailableError(absl::StrCat("cannot write -J file '", o.json_path, "'"));
  }
  return absl::OkStatus();
}

}  // namespace shardline::perf
