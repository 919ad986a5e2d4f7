#include "bench/perf/flags.h"

#include <optional>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "runtime/status.h"

namespace shardline::perf {
namespace {

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

bool ByteType(DType dtype) { return dtype == DType::kI8 || dtype == DType::kU8; }

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
    // Products of the check values would leave the dtypes' exact range at a few ranks.
    return absl::InvalidArgumentError(absl::StrCat(
        "op '", text, "' is not supported by shardline's perf tools (sum, avg, min, max)"));
  }
  absl::StatusOr<ReduceOp> op = ParseReduceOp(lower);
  if (!op.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid op '", text, "' for -o (sum, avg, min, max, all)"));
  }
  return std::vector<ReduceOp>{*op};
}

}  // namespace

const char* NcclTypeName(DType dtype) {
  for (const TypeName& t : kTypeNames) {
    if (t.dtype == dtype) return t.name;
  }
  return "?";
}

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

}  // namespace shardline::perf
