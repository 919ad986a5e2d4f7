// The shared driver of the *_perf binaries (see common.h). Structure follows nccl-tests'
// common.cu: parse flags, join, warm up at the largest and the smallest size, then for every size
// time the out-of-place and the in-place call (data initialised, one synchronising call, a
// barrier, `iters` calls issued back to back, wait for the last) and check `check` further calls
// against the reference.

#include "bench/perf/common.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "collectives/bootstrap.h"
#include "collectives/local/local_communicator.h"
#include "runtime/allocator.h"
#include "runtime/status.h"
#include "tests/common/typed_values.h"

#if SHARDLINE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace shardline::perf {
namespace {

// ---- flags -----------------------------------------------------------------------------------

struct Options {
  size_t min_bytes = size_t{32} << 20;
  size_t max_bytes = size_t{32} << 20;
  size_t step_bytes = size_t{1} << 20;
  size_t step_factor = 1;
  int iters = 20;
  int warmup = 5;
  int check = 1;
  std::vector<DType> dtypes = {DType::kF32};
  std::vector<ReduceOp> ops = {ReduceOp::kSum};
  int root = 0;
  int average = 1;
  int threads = 1;
  int timeout_s = 0;
  std::string json_path;
  std::string backend = "ucx";
  std::string stream_kind = "host";
};

// nccl-tests' type names, in its order.
struct TypeName {
  const char* name;
  DType dtype;
};
constexpr TypeName kTypeNames[] = {
    {"int8", DType::kI8},    {"uint8", DType::kU8},      {"int32", DType::kI32},
    {"int64", DType::kI64},  {"half", DType::kF16},      {"float", DType::kF32},
    {"double", DType::kF64}, {"bfloat16", DType::kBF16},
};

const char* NcclTypeName(DType dtype) {
  for (const TypeName& t : kTypeNames) {
    if (t.dtype == dtype) return t.name;
  }
  return "?";
}

bool ByteType(DType dtype) { return dtype == DType::kI8 || dtype == DType::kU8; }

void PrintUsage(const char* binary, FILE* out) {
  std::fprintf(out,
               "USAGE: %s\n"
               "\t[-t,--nthreads <num threads>] ranks as threads (--backend local)\n"
               "\t[-g,--ngpus <devices per thread>] (1)\n"
               "\t[-b,--minbytes <min size in bytes>] (K/M/G suffixes)\n"
               "\t[-e,--maxbytes <max size in bytes>]\n"
               "\t[-i,--stepbytes <increment size>]\n"
               "\t[-f,--stepfactor <increment factor>]\n"
               "\t[-n,--iters <iteration count>]\n"
               "\t[-w,--warmup_iters <warmup iteration count>]\n"
               "\t[-c,--check <check iteration count>]\n"
               "\t[-o,--op <sum/avg/min/max/all>]\n"
               "\t[-d,--datatype <float/half/bfloat16/double/int8/uint8/int32/int64/all>]\n"
               "\t[-r,--root <root>]\n"
               "\t[-a,--average <0/1/2/3> report average iteration time "
               "<0=RANK0/1=AVG/2=MIN/3=MAX>]\n"
               "\t[-T,--timeout <time in seconds>]\n"
               "\t[-J,--output_file <JSON file>] write the results as JSON (rank 0)\n"
               "\t[--backend <ucx/local/nccl>] (ucx)\n"
               "\t[--stream <host/caller>] (host)\n"
               "\t[-h,--help]\n",
               binary);
}

absl::StatusOr<size_t> ParseSize(absl::string_view flag, absl::string_view text) {
  absl::string_view number = text;
  double unit = 1;
  if (!number.empty()) {
    switch (absl::ascii_tolower(number.back())) {
      case 'k':
        unit = 1024.0;
        break;
      case 'm':
        unit = 1024.0 * 1024;
        break;
      case 'g':
        unit = 1024.0 * 1024 * 1024;
        break;
      default:
        break;
    }
    if (unit != 1) number.remove_suffix(1);
  }
  double value = 0;
  if (number.empty() || !absl::ascii_isdigit(number.front()) || !absl::SimpleAtod(number, &value) ||
      !(value >= 0) || value * unit > 1e15) {
    return absl::InvalidArgumentError(absl::StrCat("invalid size '", text, "' for ", flag,
                                                   " (a byte count with an optional K, M or G)"));
  }
  return static_cast<size_t>(value * unit);
}

absl::StatusOr<int> ParseInt(absl::string_view flag, absl::string_view text, int min, int max) {
  int value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < min || value > max) {
    return absl::InvalidArgumentError(absl::StrCat("invalid value '", text, "' for ", flag,
                                                   " (an integer in [", min, ", ", max, "])"));
  }
  return value;
}

absl::StatusOr<std::vector<DType>> ParseTypes(const CollectiveSpec& spec, absl::string_view text) {
  const std::string lower = absl::AsciiStrToLower(text);
  std::vector<DType> out;
  if (lower == "all") {
    for (const TypeName& t : kTypeNames) {
      if (!(spec.reduces && ByteType(t.dtype))) out.push_back(t.dtype);
    }
    return out;
  }
  std::optional<DType> dtype;
  for (const TypeName& t : kTypeNames) {
    if (lower == t.name) dtype = t.dtype;
  }
  if (!dtype.has_value()) {
    if (lower == "uint32" || lower == "uint64") {
      return absl::InvalidArgumentError(
          absl::StrCat("datatype '", text, "' is not supported by shardline"));
    }
    absl::StatusOr<DType> parsed = ParseDType(text);  // also f32, bf16, ...
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid datatype '", text,
                       "' for -d (float, half, bfloat16, double, int8, uint8, int32, int64, all)"));
    }
    dtype = *parsed;
  }
  if (spec.reduces && ByteType(*dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("datatype ", NcclTypeName(*dtype), " cannot be reduced: ", spec.binary,
                     " takes float, half, bfloat16, double, int32 or int64"));
  }
  return std::vector<DType>{*dtype};
}

absl::StatusOr<std::vector<ReduceOp>> ParseOps(absl::string_view text) {
  const std::string lower = absl::AsciiStrToLower(text);
  if (lower == "all") {
    return std::vector<ReduceOp>{ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kAvg};
  }
  if (lower == "prod" || lower == "mulsum") {
    return absl::InvalidArgumentError(
        absl::StrCat("op '", text, "' is not supported by shardline (sum, avg, min, max)"));
  }
  absl::StatusOr<ReduceOp> op = ParseReduceOp(lower);
  if (!op.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid op '", text, "' for -o (sum, avg, min, max, all)"));
  }
  return std::vector<ReduceOp>{*op};
}

struct ParseResult {
  Options options;
  bool help = false;
};

absl::StatusOr<ParseResult> ParseFlags(const CollectiveSpec& spec, int argc, char** argv) {
  struct Flag {
    char short_name;
    const char* long_name;
  };
  static constexpr Flag kFlags[] = {
      {'t', "nthreads"},  {'g', "ngpus"},      {'b', "minbytes"},    {'e', "maxbytes"},
      {'i', "stepbytes"}, {'f', "stepfactor"}, {'n', "iters"},       {'w', "warmup_iters"},
      {'c', "check"},     {'o', "op"},         {'d', "datatype"},    {'r', "root"},
      {'a', "average"},   {'T', "timeout"},    {'J', "output_file"}, {'B', "backend"},
      {'S', "stream"},
  };
  ParseResult result;
  Options& o = result.options;
  bool stepbytes_given = false;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      result.help = true;
      return result;
    }
    const Flag* flag = nullptr;
    std::optional<std::string> value;
    if (absl::StartsWith(arg, "--")) {
      absl::string_view name = arg.substr(2);
      if (const size_t eq = name.find('='); eq != absl::string_view::npos) {
        value = std::string(name.substr(eq + 1));
        name = name.substr(0, eq);
      }
      for (const Flag& f : kFlags) {
        if (name == f.long_name) flag = &f;
      }
    } else if (arg.size() >= 2 && arg[0] == '-' && arg[1] != 'B' && arg[1] != 'S') {
      for (const Flag& f : kFlags) {
        if (arg[1] == f.short_name) flag = &f;
      }
      if (arg.size() > 2) value = std::string(arg.substr(2));
    }
    if (flag == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("invalid option '", arg, "'"));
    }
    const std::string shown = flag->short_name == 'B' || flag->short_name == 'S'
                                  ? absl::StrCat("--", flag->long_name)
                                  : absl::StrCat("-", std::string(1, flag->short_name));
    if (!value.has_value()) {
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(shown, " needs a value"));
      value = argv[++i];
    }
    const std::string& v = *value;
    switch (flag->short_name) {
      case 't': {
        SL_ASSIGN_OR_RETURN(o.threads, ParseInt(shown, v, 1, 1024));
        break;
      }
      case 'g': {
        SL_ASSIGN_OR_RETURN(int gpus, ParseInt(shown, v, 1, 1024));
        if (gpus != 1) {
          return absl::InvalidArgumentError(
              "-g must be 1: every shardline rank drives one device (use more ranks instead)");
        }
        break;
      }
      case 'b': {
        SL_ASSIGN_OR_RETURN(o.min_bytes, ParseSize(shown, v));
        break;
      }
      case 'e': {
        SL_ASSIGN_OR_RETURN(o.max_bytes, ParseSize(shown, v));
        break;
      }
      case 'i': {
        SL_ASSIGN_OR_RETURN(o.step_bytes, ParseSize(shown, v));
        stepbytes_given = true;
        break;
      }
      case 'f': {
        SL_ASSIGN_OR_RETURN(int factor, ParseInt(shown, v, 1, 1 << 20));
        o.step_factor = static_cast<size_t>(factor);
        break;
      }
      case 'n': {
        SL_ASSIGN_OR_RETURN(o.iters, ParseInt(shown, v, 1, 1 << 24));
        break;
      }
      case 'w': {
        SL_ASSIGN_OR_RETURN(o.warmup, ParseInt(shown, v, 0, 1 << 24));
        break;
      }
      case 'c': {
        SL_ASSIGN_OR_RETURN(o.check, ParseInt(shown, v, 0, 1 << 20));
        break;
      }
      case 'o': {
        SL_ASSIGN_OR_RETURN(o.ops, ParseOps(v));
        break;
      }
      case 'd': {
        SL_ASSIGN_OR_RETURN(o.dtypes, ParseTypes(spec, v));
        break;
      }
      case 'r': {
        SL_ASSIGN_OR_RETURN(o.root, ParseInt(shown, v, 0, 1 << 24));
        break;
      }
      case 'a': {
        SL_ASSIGN_OR_RETURN(o.average, ParseInt(shown, v, 0, 3));
        break;
      }
      case 'T': {
        SL_ASSIGN_OR_RETURN(o.timeout_s, ParseInt(shown, v, 1, 1 << 24));
        break;
      }
      case 'J': {
        if (v.empty()) return absl::InvalidArgumentError("-J needs a file name");
        o.json_path = v;
        break;
      }
      case 'B': {
        if (v != "ucx" && v != "local" && v != "nccl") {
          return absl::InvalidArgumentError(
              absl::StrCat("invalid backend '", v, "' (ucx, local or nccl)"));
        }
        o.backend = v;
        break;
      }
      case 'S': {
        if (v != "host" && v != "caller") {
          return absl::InvalidArgumentError(
              absl::StrCat("invalid stream '", v, "' (host or caller)"));
        }
        o.stream_kind = v;
        break;
      }
    }
  }
  if (o.min_bytes > o.max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid sizes for 'minbytes' and 'maxbytes': ", o.min_bytes, " > ", o.max_bytes));
  }
  if (o.step_factor <= 1 && o.step_bytes == 0 && o.max_bytes > o.min_bytes) {
    return absl::InvalidArgumentError(stepbytes_given ? "-i must be positive"
                                                      : "give -f > 1 or -i > 0 to step the sizes");
  }
  if (o.step_factor > 1 && o.min_bytes == 0 && o.max_bytes > 0) {
    return absl::InvalidArgumentError("-b must be positive with -f (0 * factor stays 0)");
  }
  if (o.threads > 1 && o.backend != "local") {
    return absl::InvalidArgumentError(
        absl::StrCat("-t ", o.threads, " runs ranks as threads: only with --backend local (the ",
                     o.backend, " backend runs one rank per process)"));
  }
  if (o.stream_kind == "caller" && o.backend == "nccl") {
    return absl::InvalidArgumentError("--stream caller needs a host backend (ucx or local)");
  }
  return result;
}

// ---- elements --------------------------------------------------------------------------------

// Elements are read and written as doubles with the tests' helpers (tests/common/typed_values.h).
using ::shardline::testing::GetElement;
using ::shardline::testing::SetElement;

// Averaged floats are scaled by a rounded 1/n: allow a few units in the last place.
double Tolerance(DType dtype, ReduceOp op, double want) {
  if (op != ReduceOp::kAvg || !IsFloatingPoint(dtype)) return 0;
  const double ulp = dtype == DType::kF64   ? 0x1p-52
                     : dtype == DType::kF32 ? 0x1p-23
                     : dtype == DType::kF16 ? 0x1p-10
                                            : 0x1p-7;
  return 4 * ulp * std::max(1.0, std::abs(want));
}

// ---- memory (host, or CUDA through a host staging copy) ---------------------------------------

class Memory {
 public:
  static absl::StatusOr<std::unique_ptr<Memory>> Create(Device device) {
    auto memory = std::unique_ptr<Memory>(new Memory(device));
    if (device.is_host()) {
      memory->allocator_ = CreateHostAllocator(4096, "perf");
    } else {
      SL_ASSIGN_OR_RETURN(memory->allocator_, CreateCudaAllocator(device.index(), "perf"));
    }
    return memory;
  }

  absl::StatusOr<Buffer> Allocate(size_t bytes) {
    return allocator_->Allocate(std::max<size_t>(bytes, 64));
  }

  // Runs `fill` on host memory of `bytes` that then lands at `dst`.
  absl::Status Write(void* dst, size_t bytes, const std::function<void(void*)>& fill) {
    if (device_.is_host()) {
      fill(dst);
      return absl::OkStatus();
    }
    staging_.resize(bytes);
    fill(staging_.data());
    return CopyToDevice(dst, staging_.data(), bytes);
  }

  // Runs `use` on a host view of `bytes` at `src`.
  absl::Status Read(const void* src, size_t bytes, const std::function<void(const void*)>& use) {
    if (device_.is_host()) {
      use(src);
      return absl::OkStatus();
    }
    staging_.resize(bytes);
    SL_RETURN_IF_ERROR(CopyToHost(staging_.data(), src, bytes));
    use(staging_.data());
    return absl::OkStatus();
  }

 private:
  explicit Memory(Device device) : device_(device) {}

  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) {
#if SHARDLINE_WITH_CUDA
    const cudaError_t err = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
    if (err != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaMemcpy to device: ", cudaGetErrorString(err)));
    }
    return absl::OkStatus();
#else
    return absl::UnimplementedError("device memory needs a CUDA build");
#endif
  }

  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) {
#if SHARDLINE_WITH_CUDA
    const cudaError_t err = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
    if (err != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaMemcpy to host: ", cudaGetErrorString(err)));
    }
    return absl::OkStatus();
#else
    return absl::UnimplementedError("device memory needs a CUDA build");
#endif
  }

  Device device_;
  std::unique_ptr<Allocator> allocator_;
  std::vector<uint8_t> staging_;
};

// ---- one rank --------------------------------------------------------------------------------

std::string TimeString(double us) {
  if (us >= 10000.0) return absl::StrFormat("%7.0f", us);
  if (us >= 100.0) return absl::StrFormat("%7.1f", us);
  return absl::StrFormat("%7.2f", us);
}

struct Cell {
  bool present = false;
  double time_us = 0;
  double algbw = 0;
  double busbw = 0;
  int64_t wrong = -1;  // -1: not checked
};

struct Row {
  size_t bytes = 0;
  size_t count = 0;
  DType dtype = DType::kF32;
  std::string redop;
  int root = -1;
  Cell out_of_place;
  Cell in_place;
};

std::string CellText(const Cell& c) {
  if (!c.present) return absl::StrFormat("  %7s  %6s  %6s  %5s", "N/A", "N/A", "N/A", "N/A");
  const std::string wrong = c.wrong < 0 ? std::string("N/A") : absl::StrCat(c.wrong);
  return absl::StrFormat("  %7s  %6.2f  %6.2f  %5s", TimeString(c.time_us), c.algbw, c.busbw,
                         wrong);
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

class RankRunner {
 public:
  RankRunner(const CollectiveSpec& spec, const Options& options, Communicator& comm, Stream& stream,
             Memory& memory, int processes)
      : spec_(spec),
        o_(options),
        comm_(comm),
        stream_(stream),
        memory_(memory),
        rank_(comm.rank()),
        n_(comm.size()),
        processes_(processes),
        printer_(comm.rank() == 0) {}

  // Runs the whole test; returns the exit code.
  int Run() {
    absl::Status status = RunAll();
    if (!status.ok()) {
      std::fprintf(stderr, "%s: rank %d: %s\n", spec_.binary, rank_, status.ToString().c_str());
      std::fflush(stderr);
      comm_.Abort(status);
      return 1;
    }
    return errors_ > 0 ? 1 : 0;
  }

 private:
  absl::Time WaitDeadline(int calls) const {
    return absl::Now() + comm_.timeout() * (calls + 1) + absl::Seconds(10);
  }

  absl::Status Wait(const absl::StatusOr<Work>& work, int calls = 1) {
    SL_RETURN_IF_ERROR(work.status());
    return work->Wait(WaitDeadline(calls));
  }

  // A scalar reduced over the ranks (op), or rank 0's value (broadcast) if `from_rank0`.
  absl::StatusOr<double> AllReduceScalar(double value, ReduceOp op, bool from_rank0 = false) {
    SL_RETURN_IF_ERROR(
        memory_.Write(scratch_.data(), 8, [&](void* p) { std::memcpy(p, &value, 8); }));
    if (from_rank0) {
      SL_RETURN_IF_ERROR(Wait(comm_.Broadcast(scratch_.data(), 1, DType::kF64, stream_)));
    } else {
      SL_RETURN_IF_ERROR(Wait(
          comm_.AllReduce(scratch_.data(), scratch_.data(), 1, DType::kF64, stream_, {.op = op})));
    }
    double out = 0;
    SL_RETURN_IF_ERROR(
        memory_.Read(scratch_.data(), 8, [&](const void* p) { std::memcpy(&out, p, 8); }));
    return out;
  }

  // A barrier. Built from a one-element all-reduce rather than Communicator::Barrier: the local
  // backend's barrier lets a fast rank post its next collective before a slow one has compared
  // the barrier's fingerprints, which then reports a spurious mismatch.
  absl::Status Sync() { return AllReduceScalar(0, ReduceOp::kSum).status(); }

  absl::Status RunAll() {
    if (o_.root >= n_) {
      return absl::InvalidArgumentError(
          absl::StrCat("root ", o_.root, " is not a rank of a world of ", n_));
    }
    SL_ASSIGN_OR_RETURN(scratch_, memory_.Allocate(kInfoBytes * (n_ + 1)));
    SL_ASSIGN_OR_RETURN(send_, memory_.Allocate(o_.max_bytes));
    SL_ASSIGN_OR_RETURN(recv_, memory_.Allocate(o_.max_bytes));
    SL_RETURN_IF_ERROR(PrintHeader());
    if (printer_) {
      const char* time_name = "time";
      std::printf("#\n");
      std::printf(
          "# %10s  %12s  %8s  %6s  %6s           out-of-place                       "
          "in-place          \n",
          "", "", "", "", "");
      std::printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s\n", "size",
                  "count", "type", "redop", "root", time_name, "algbw", "busbw", "#wrong",
                  time_name, "algbw", "busbw", "#wrong");
      std::printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s\n", "(B)",
                  "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)",
                  "(GB/s)", "");
      std::fflush(stdout);
    }
    const std::vector<ReduceOp> ops =
        spec_.reduces ? o_.ops : std::vector<ReduceOp>{ReduceOp::kSum};
    for (DType dtype : o_.dtypes) {
      for (ReduceOp op : ops) SL_RETURN_IF_ERROR(TimeTest(dtype, op));
    }
    const double avg_busbw = busbw_cells_ > 0 ? busbw_sum_ / busbw_cells_ : 0;
    if (printer_) {
      std::printf("# Out of bounds values : %lld %s\n", static_cast<long long>(errors_),
                  errors_ ? "FAILED" : "OK");
      std::printf("# Avg bus bandwidth    : %g \n", avg_busbw);
      std::printf("#\n");
      std::printf("# Collective test concluded: %s\n", spec_.binary);
      std::fflush(stdout);
      if (!o_.json_path.empty()) SL_RETURN_IF_ERROR(WriteJson(avg_busbw));
    }
    // Nobody leaves while a peer may still need it for the last reductions.
    return Sync();
  }

  static constexpr size_t kInfoBytes = 256;

  absl::Status PrintHeader() {
    // Every rank's line, gathered to all (rank 0 prints): as nccl-tests' "Using devices".
    const std::string mine = absl::StrFormat(
        "#  Rank %2d Group %2d Pid %6d on %10s device %4s [%s] %s", rank_, 0,
        static_cast<int>(getpid()), HostName(), comm_.device().is_host() ? "host" : "cuda",
        comm_.backend(), comm_.device().is_host() ? CpuModel() : comm_.device().ToString());
    std::vector<char> line(kInfoBytes, '\0');
    std::memcpy(line.data(), mine.data(), std::min(mine.size(), kInfoBytes - 1));
    uint8_t* base = scratch_.as<uint8_t>();
    SL_RETURN_IF_ERROR(memory_.Write(base + kInfoBytes * n_, kInfoBytes,
                                     [&](void* p) { std::memcpy(p, line.data(), kInfoBytes); }));
    SL_RETURN_IF_ERROR(
        Wait(comm_.AllGather(base + kInfoBytes * n_, base, kInfoBytes, DType::kU8, stream_)));
    std::vector<std::string> lines;
    SL_RETURN_IF_ERROR(memory_.Read(base, kInfoBytes * n_, [&](const void* p) {
      const char* text = static_cast<const char*>(p);
      for (int r = 0; r < n_; ++r) lines.emplace_back(text + r * kInfoBytes);
    }));
    if (!printer_) return absl::OkStatus();
    std::printf("# Collective test starting: %s\n", spec_.binary);
    std::printf(
        "# nThread %d nGpus %d minBytes %zu maxBytes %zu step: %zu(%s) warmup iters: %d iters: %d "
        "agg iters: %d validation: %d graph: %d\n",
        o_.threads, 1, o_.min_bytes, o_.max_bytes,
        o_.step_factor > 1 ? o_.step_factor : o_.step_bytes,
        o_.step_factor > 1 ? "factor" : "bytes", o_.warmup, o_.iters, 1, o_.check, 0);
    std::printf("#\n");
    std::printf(
        "# shardline backend %s, %d ranks (%d processes x %d threads), %s stream, "
        "time reported: %s\n",
        std::string(comm_.backend()).c_str(), n_, processes_, o_.threads, o_.stream_kind.c_str(),
        o_.average == 0   ? "rank 0"
        : o_.average == 1 ? "average over ranks"
        : o_.average == 2 ? "minimum over ranks"
                          : "maximum over ranks");
    std::printf("#\n# Using devices\n");
    for (const std::string& l : lines) std::printf("%s\n", l.c_str());
    std::fflush(stdout);
    return absl::OkStatus();
  }

  struct Pointers {
    const void* send;
    void* recv;
  };

  Pointers PointersFor(const CollCounts& c, size_t e, bool in_place) {
    uint8_t* recv = recv_.as<uint8_t>();
    if (!in_place) return {send_.data(), recv};
    return {recv + rank_ * c.send_inplace_offset * e, recv + rank_ * c.recv_inplace_offset * e};
  }

  // Sentinel (all bits set: NaN or -1) over the output and every byte in-place inputs share with
  // it, then this rank's input pattern.
  absl::Status InitData(const CollCounts& c, DType dtype, bool in_place, uint64_t seed) {
    const size_t e = DTypeSize(dtype);
    const Pointers p = PointersFor(c, e, in_place);
    size_t extent = c.recv;
    if (in_place) {
      extent =
          std::max(rank_ * c.send_inplace_offset + c.send, rank_ * c.recv_inplace_offset + c.recv);
    }
    SL_RETURN_IF_ERROR(memory_.Write(recv_.data(), extent * e, [&](void* dst) {
      std::memset(dst, 0xFF, extent * e);
      if (in_place) {
        FillInput(static_cast<uint8_t*>(dst) + rank_ * c.send_inplace_offset * e, c.send, dtype,
                  seed);
      }
    }));
    if (!in_place) {
      SL_RETURN_IF_ERROR(memory_.Write(const_cast<void*>(p.send), c.send * e,
                                       [&](void* dst) { FillInput(dst, c.send, dtype, seed); }));
    }
    return absl::OkStatus();
  }

  void FillInput(void* dst, size_t count, DType dtype, uint64_t seed) {
    for (size_t i = 0; i < count; ++i) {
      SetElement(dtype, dst, i, InputValue(dtype, spec_.reduces, rank_, i, seed));
    }
  }

  absl::StatusOr<int64_t> CheckData(const CollCounts& c, DType dtype, ReduceOp op, int root,
                                    bool in_place, uint64_t seed) {
    const Pointers p = PointersFor(c, DTypeSize(dtype), in_place);
    const CheckArgs args{rank_, n_, c.param, dtype, op, root, seed};
    int64_t wrong = 0;
    SL_RETURN_IF_ERROR(memory_.Read(p.recv, c.recv * DTypeSize(dtype), [&](const void* out) {
      for (size_t j = 0; j < c.recv; ++j) {
        const double want = spec_.expected(args, j);
        const double got = GetElement(dtype, out, j);
        if (!(std::abs(got - want) <= Tolerance(dtype, op, want))) ++wrong;
      }
    }));
    return wrong;
  }

  absl::StatusOr<Work> Issue(const CollCounts& c, DType dtype, ReduceOp op, int root,
                             bool in_place) {
    const Pointers p = PointersFor(c, DTypeSize(dtype), in_place);
    return spec_.issue({comm_, stream_, p.send, p.recv, c.param, dtype, op, root});
  }

  // `iters` calls back to back, then a wait for the last one (they run in order on the stream).
  absl::Status RunBurst(const CollCounts& c, DType dtype, ReduceOp op, int root, bool in_place,
                        int iters) {
    absl::StatusOr<Work> last = Work();
    for (int i = 0; i < iters; ++i) {
      last = Issue(c, dtype, op, root, in_place);
      SL_RETURN_IF_ERROR(last.status());
    }
    return Wait(last, iters);
  }

  absl::Status BenchTime(size_t size, DType dtype, ReduceOp op, int root, bool in_place,
                         Cell& cell) {
    const size_t e = DTypeSize(dtype);
    const CollCounts c = spec_.counts(size / e, n_);
    // Initialised even without checking, as nccl-tests does: a never-written buffer reads as
    // the kernel's shared zero page, which would flatter every copy out of it.
    SL_RETURN_IF_ERROR(InitData(c, dtype, in_place, 99));
    SL_RETURN_IF_ERROR(RunBurst(c, dtype, op, root, in_place, 1));
    SL_RETURN_IF_ERROR(Sync());

    const absl::Time start = absl::Now();
    SL_RETURN_IF_ERROR(RunBurst(c, dtype, op, root, in_place, o_.iters));
    double seconds = absl::ToDoubleSeconds(absl::Now() - start) / o_.iters;
    // -a: rank 0's time (a broadcast), or the average, minimum or maximum over the ranks.
    const ReduceOp combine = o_.average == 2   ? ReduceOp::kMin
                             : o_.average == 3 ? ReduceOp::kMax
                                               : ReduceOp::kAvg;
    SL_ASSIGN_OR_RETURN(seconds, AllReduceScalar(seconds, combine, o_.average == 0));
    cell.present = true;
    cell.time_us = seconds * 1e6;
    cell.algbw = seconds > 0 ? spec_.alg_bytes(c.param, e, n_) / 1e9 / seconds : 0;
    cell.busbw = cell.algbw * spec_.bus_factor(n_);

    int64_t wrong = 0;
    for (int k = 0; k < o_.check; ++k) {
      const uint64_t seed = ++check_seed_;
      SL_RETURN_IF_ERROR(InitData(c, dtype, in_place, seed));
      SL_RETURN_IF_ERROR(RunBurst(c, dtype, op, root, in_place, 1));
      SL_ASSIGN_OR_RETURN(int64_t mine, CheckData(c, dtype, op, root, in_place, seed));
      SL_ASSIGN_OR_RETURN(double total, AllReduceScalar(static_cast<double>(mine), ReduceOp::kSum));
      wrong = static_cast<int64_t>(total);
      if (wrong != 0) break;
    }
    if (o_.check > 0) {
      cell.wrong = wrong;
      if (wrong != 0) ++errors_;
    }
    busbw_sum_ += cell.busbw;
    ++busbw_cells_;
    return absl::OkStatus();
  }

  absl::Status TimeTest(DType dtype, ReduceOp op) {
    const int root = spec_.rooted ? o_.root : -1;
    const std::string redop = spec_.reduces ? std::string(ReduceOpName(op)) : "none";
    const size_t e = DTypeSize(dtype);
    SL_RETURN_IF_ERROR(Sync());
    // Warm-up at the largest, then at the smallest size (nccl-tests' order), out of place when
    // the collective has that form.
    const bool warm_in_place = !spec_.has_out_of_place;
    for (size_t size : {o_.max_bytes, o_.min_bytes}) {
      if (o_.warmup > 0) {
        SL_RETURN_IF_ERROR(
            RunBurst(spec_.counts(size / e, n_), dtype, op, root, warm_in_place, o_.warmup));
      }
    }
    for (size_t size = o_.min_bytes; size <= o_.max_bytes;
         size = o_.step_factor > 1 ? size * o_.step_factor : size + o_.step_bytes) {
      const CollCounts c = spec_.counts(size / e, n_);
      Row row;
      row.bytes = std::max(c.send, c.recv) * e;
      row.count = c.param;
      row.dtype = dtype;
      row.redop = redop;
      row.root = root;
      if (printer_) {
        // Not flushed until the row is complete: a write to the launcher's pipe in the middle of
        // a row wakes the process reading it while the next cell is being timed (on the 2-core
        // VM that made every out-of-place 8 KiB cell 2-3x slower than the in-place one).
        std::printf("%12zu  %12zu  %8s  %6s  %6i", row.bytes, row.count, NcclTypeName(dtype),
                    redop.c_str(), root);
      }
      if (spec_.has_out_of_place) {
        SL_RETURN_IF_ERROR(BenchTime(size, dtype, op, root, false, row.out_of_place));
      }
      if (printer_) std::printf("%s", CellText(row.out_of_place).c_str());
      if (spec_.has_in_place) {
        SL_RETURN_IF_ERROR(BenchTime(size, dtype, op, root, true, row.in_place));
      }
      if (printer_) {
        std::printf("%s\n", CellText(row.in_place).c_str());
        std::fflush(stdout);
      }
      rows_.push_back(std::move(row));
      if (o_.step_factor <= 1 && o_.step_bytes == 0) break;  // -b == -e
      if (size > o_.max_bytes / std::max<size_t>(o_.step_factor, 1) && o_.step_factor > 1) break;
    }
    return absl::OkStatus();
  }

  absl::Status WriteJson(double avg_busbw) {
    std::string json = absl::StrFormat(
        "{\n  \"test\": \"%s\",\n  \"backend\": \"%s\",\n  \"nranks\": %d,\n  \"nprocs\": %d,\n"
        "  \"nthreads\": %d,\n  \"stream\": \"%s\",\n  \"minbytes\": %zu,\n  \"maxbytes\": %zu,\n"
        "  \"stepfactor\": %zu,\n  \"stepbytes\": %zu,\n  \"iters\": %d,\n  \"warmup_iters\": %d,\n"
        "  \"validation\": %d,\n  \"average\": %d,\n  \"host\": \"%s\",\n  \"cpu\": \"%s\",\n"
        "  \"results\": [\n",
        spec_.binary, std::string(comm_.backend()), n_, processes_, o_.threads, o_.stream_kind,
        o_.min_bytes, o_.max_bytes, o_.step_factor, o_.step_bytes, o_.iters, o_.warmup, o_.check,
        o_.average, JsonEscape(HostName()), JsonEscape(CpuModel()));
    for (size_t i = 0; i < rows_.size(); ++i) {
      const Row& r = rows_[i];
      absl::StrAppendFormat(&json,
                            "    {\"size\": %zu, \"count\": %zu, \"type\": \"%s\", \"redop\": "
                            "\"%s\", \"root\": %d, \"out_of_place\": %s, \"in_place\": %s}%s\n",
                            r.bytes, r.count, NcclTypeName(r.dtype), r.redop, r.root,
                            JsonCell(r.out_of_place), JsonCell(r.in_place),
                            i + 1 < rows_.size() ? "," : "");
    }
    absl::StrAppendFormat(&json, "  ],\n  \"out_of_bounds\": %lld,\n  \"avg_busbw\": %.6g\n}\n",
                          static_cast<long long>(errors_), avg_busbw);
    std::ofstream out(o_.json_path, std::ios::trunc);
    out << json;
    out.close();
    if (!out) {
      return absl::UnavailableError(absl::StrCat("cannot write -J file '", o_.json_path, "'"));
    }
    return absl::OkStatus();
  }

  const CollectiveSpec& spec_;
  const Options& o_;
  Communicator& comm_;
  Stream& stream_;
  Memory& memory_;
  const int rank_;
  const int n_;
  const int processes_;
  const bool printer_;
  Buffer scratch_;
  Buffer send_;
  Buffer recv_;
  std::vector<Row> rows_;
  int64_t errors_ = 0;
  double busbw_sum_ = 0;
  int busbw_cells_ = 0;
  uint64_t check_seed_ = 0;
};

absl::StatusOr<std::unique_ptr<Stream>> MakeStream(const Options& o, Device device) {
  StreamOptions options{.name = "perf"};
  if (!device.is_host()) return CreateStream(device, options);
  if (o.stream_kind == "caller") return CreateCallerStream(options);
  return CreateHostStream(options);
}

int RunOneRank(const CollectiveSpec& spec, const Options& o, Communicator& comm, int processes) {
  absl::StatusOr<std::unique_ptr<Memory>> memory = Memory::Create(comm.device());
  absl::StatusOr<std::unique_ptr<Stream>> stream =
      memory.ok() ? MakeStream(o, comm.device()) : memory.status();
  if (!memory.ok() || !stream.ok()) {
    const absl::Status s = !memory.ok() ? memory.status() : stream.status();
    std::fprintf(stderr, "%s: rank %d: %s\n", spec.binary, comm.rank(), s.ToString().c_str());
    comm.Abort(s);
    return 1;
  }
  RankRunner runner(spec, o, comm, **stream, **memory, processes);
  return runner.Run();
}

int RunThreads(const CollectiveSpec& spec, const Options& o) {
  if (const char* world = std::getenv("WORLD_SIZE"); world != nullptr && std::atoi(world) > 1) {
    std::fprintf(stderr,
                 "%s: the local backend runs ranks as threads of one process; start one process "
                 "with -t N instead of %s processes\n",
                 spec.binary, world);
    return 2;
  }
  LocalOptions local;
  local.timeout = absl::Seconds(o.timeout_s);
  absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> comms =
      CreateLocalCommunicators(o.threads, local);
  if (!comms.ok()) {
    std::fprintf(stderr, "%s: %s\n", spec.binary, comms.status().ToString().c_str());
    return 1;
  }
  std::vector<int> codes(o.threads, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < o.threads; ++r) {
    threads.emplace_back([&, r] { codes[r] = RunOneRank(spec, o, *(*comms)[r], 1); });
  }
  for (std::thread& t : threads) t.join();
  return *std::max_element(codes.begin(), codes.end());
}

int RunProcess(const CollectiveSpec& spec, const Options& o) {
  InitOptions init;
  init.backend = o.backend;
  init.timeout = absl::Seconds(o.timeout_s);
  absl::StatusOr<LaunchInfo> launch = ReadLaunchEnvironment();
  if (!launch.ok() && absl::IsNotFound(launch.status())) {
    // Started without a launcher: a world of one, as nccl-tests runs without MPI.
    LaunchInfo alone;
    alone.master_port = 0;
    init.launch = alone;
  } else if (!launch.ok()) {
    std::fprintf(stderr, "%s: %s\n", spec.binary, launch.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<ProcessGroup> group = InitProcessGroup(init);
  if (!group.ok()) {
    std::fprintf(stderr, "%s: %s\n", spec.binary, group.status().ToString().c_str());
    return 1;
  }
  const int code = RunOneRank(spec, o, *group->world, group->launch.world_size);
  return code;
}

}  // namespace

double InputValue(DType dtype, bool reducing, int rank, size_t index, uint64_t seed) {
  const uint64_t mix = static_cast<uint64_t>(rank) * 97 + index * 31 + seed * 17;
  if (reducing) return static_cast<double>(mix % 13);
  return static_cast<double>(mix % (dtype == DType::kI8 ? 127 : 251));
}

double ReducedValue(const CheckArgs& a, size_t index) {
  double acc = InputValue(a.dtype, true, 0, index, a.seed);
  for (int s = 1; s < a.nranks; ++s) {
    acc = ::shardline::testing::ReferenceOp(a.op, acc, InputValue(a.dtype, true, s, index, a.seed));
  }
  if (a.op == ReduceOp::kAvg) {
    acc = IsFloatingPoint(a.dtype) ? acc / a.nranks : std::trunc(acc / a.nranks);
  }
  return acc;
}

int PerfMain(const CollectiveSpec& spec, int argc, char** argv) {
  setlinebuf(stdout);
  absl::StatusOr<ParseResult> parsed = ParseFlags(spec, argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s: %s\n", spec.binary, std::string(parsed.status().message()).c_str());
    PrintUsage(spec.binary, stderr);
    return 2;
  }
  if (parsed->help) {
    PrintUsage(spec.binary, stdout);
    return 0;
  }
  const Options& o = parsed->options;
  if (o.backend == "local") return RunThreads(spec, o);
  return RunProcess(spec, o);
}

}  // namespace shardline::perf
