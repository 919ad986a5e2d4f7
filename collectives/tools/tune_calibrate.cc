// shardline-tune-calibrate: fits a topology's link level (latency, bandwidth, size-efficiency
// curve) to collective benchmark JSON (the perf binaries' -J output, or nccl-tests' -J), prints
// the fit error per size and writes the calibrated topology. The library behind it is
// collectives/sim/calibration.h; docs/tuning.md (Calibration) explains the model and the fit.
//
//   shardline-tune-calibrate [options] -o topology.json perf1.json [perf2.json ...]
//   shardline-tune calibrate [options] ...   (the same, as shardline-tune's subcommand: this
//                                            file is compiled into both binaries)
//     --base FILE            start from this topology (else a one-node topology from --name,
//                            --devices-per-node, --memory-GiB, --compute-TFLOPs)
//     --name NAME  --description TEXT  --devices-per-node D (default: the largest rank count)
//     --memory-GiB G  --compute-TFLOPs C
//     --level intra|inter    the link level the runs measured (intra)
//     --ranks-per-node K     with --level inter: ranks of the runs on each node (1)
//     --nranks N  --collective NAME   override what the files say (every file)
//     --cell min|out|in      which time of each row (min of out-of-place and in-place)
//     --min-transfer-share X a sample counts towards the peak bandwidth if its time beyond
//                            the latency is at least this share of it (0.5)
//     --repeats min|median|keep  how repeats of one collective on one rank count merge: the
//                            smallest time per size (default), the median (the typical time
//                            under the machine's load), or not at all (= --keep-repeats)
//     --keep-repeats         fit every run as it is (default: repeats of one collective on one
//                            rank count merge into their minimum time per size, MinOverRepeats)
//     --check FILE           (repeatable) also print the fitted model's error on this run,
//                            which the fit does not use
//     -o FILE                write the topology JSON there ("-": standard output)

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "collectives/sim/calibration.h"
#include "collectives/sim/topology.h"
#include "runtime/status.h"

namespace shardline {

// The whole tool: argv[0] is the program (or subcommand) name, `program` is how usage names it.
absl::Status TuneCalibrateMain(int argc, char** argv, const char* program);

namespace {

constexpr char kUsage[] =
    "usage: %s [--base FILE | --name NAME [--description TEXT]\n"
    "         [--devices-per-node D] --memory-GiB G --compute-TFLOPs C]\n"
    "         [--level intra|inter] [--ranks-per-node K] [--nranks N] [--collective NAME]\n"
    "         [--cell min|out|in] [--min-transfer-share X] [--keep-repeats]\n"
    "         [--repeats min|median|keep]\n"
    "         [--check FILE]... [-o FILE] perf.json...\n";

struct Flags {
  std::string base, name, description, level = "intra", collective, cell = "min", output;
  int devices_per_node = 0, ranks_per_node = 1, nranks = 0;
  bool keep_repeats = false;
  std::string repeats = "min";
  double memory_gib = 0, compute_tflops = 0, min_transfer_share = 0.5;
  std::vector<std::string> inputs, checks;
};

absl::StatusOr<Flags> ParseFlags(int argc, char** argv, const char* program) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::printf(kUsage, program);
      std::exit(0);
    }
    if (arg == "--keep-repeats") {
      f.keep_repeats = true;
      continue;
    }
    if (arg.empty() || arg[0] != '-') {
      f.inputs.push_back(arg);
      continue;
    }
    if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(arg, " needs a value"));
    const std::string value = argv[++i];
    auto number = [&](double* out) -> absl::Status {
      if (!absl::SimpleAtod(value, out)) {
        return absl::InvalidArgumentError(absl::StrCat(arg, ": '", value, "' is not a number"));
      }
      return absl::OkStatus();
    };
    auto integer = [&](int* out) -> absl::Status {
      if (!absl::SimpleAtoi(value, out) || *out < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(arg, ": '", value, "' is not a non-negative integer"));
      }
      return absl::OkStatus();
    };
    if (arg == "--base") {
      f.base = value;
    } else if (arg == "--check") {
      f.checks.push_back(value);
    } else if (arg == "--name") {
      f.name = value;
    } else if (arg == "--description") {
      f.description = value;
    } else if (arg == "--level") {
      f.level = value;
    } else if (arg == "--collective") {
      f.collective = value;
    } else if (arg == "--cell") {
      f.cell = value;
    } else if (arg == "--repeats") {
      if (value != "min" && value != "median" && value != "keep") {
        return absl::InvalidArgumentError(
            absl::StrCat("--repeats: '", value, "' is not min, median or keep"));
      }
      f.repeats = value;
    } else if (arg == "-o") {
      f.output = value;
    } else if (arg == "--devices-per-node") {
      SL_RETURN_IF_ERROR(integer(&f.devices_per_node));
    } else if (arg == "--ranks-per-node") {
      SL_RETURN_IF_ERROR(integer(&f.ranks_per_node));
    } else if (arg == "--nranks") {
      SL_RETURN_IF_ERROR(integer(&f.nranks));
    } else if (arg == "--memory-GiB") {
      SL_RETURN_IF_ERROR(number(&f.memory_gib));
    } else if (arg == "--compute-TFLOPs") {
      SL_RETURN_IF_ERROR(number(&f.compute_tflops));
    } else if (arg == "--min-transfer-share") {
      SL_RETURN_IF_ERROR(number(&f.min_transfer_share));
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag ", arg, " (", program, " --help lists them)"));
    }
  }
  if (f.inputs.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("no perf JSON given (", program, " --help)"));
  }
  if (f.level != "intra" && f.level != "inter") {
    return absl::InvalidArgumentError(
        absl::StrCat("--level must be intra or inter, got '", f.level, "'"));
  }
  if (f.cell != "min" && f.cell != "out" && f.cell != "in") {
    return absl::InvalidArgumentError(
        absl::StrCat("--cell must be min, out or in, got '", f.cell, "'"));
  }
  if (!(f.min_transfer_share > 0 && f.min_transfer_share < 1)) {
    return absl::InvalidArgumentError("--min-transfer-share must be in (0, 1)");
  }
  return f;
}

}  // namespace

absl::Status TuneCalibrateMain(int argc, char** argv, const char* program) {
  SL_ASSIGN_OR_RETURN(const Flags f, ParseFlags(argc, argv, program));
  std::vector<PerfRun> runs;
  int most_ranks = 0;
  for (const std::string& path : f.inputs) {
    SL_ASSIGN_OR_RETURN(PerfRun run,
                        LoadPerfJson(path, {.nranks = f.nranks, .collective = f.collective}));
    most_ranks = std::max(most_ranks, run.nranks);
    runs.push_back(std::move(run));
  }
  CalibrationOptions options;
  options.min_transfer_share = f.min_transfer_share;
  options.cell = f.cell == "out"  ? CalibrationOptions::Cell::kOutOfPlace
                 : f.cell == "in" ? CalibrationOptions::Cell::kInPlace
                                  : CalibrationOptions::Cell::kMin;
  auto merge = [&f](const std::vector<PerfRun>& r) {
    if (f.keep_repeats || f.repeats == "keep") return r;
    return f.repeats == "median" ? MedianOverRepeats(r) : MinOverRepeats(r);
  };
  runs = merge(runs);
  SL_ASSIGN_OR_RETURN(const CalibrationResult result, FitLink(runs, options));
  std::fputs(FormatCalibration(result).c_str(), stdout);
  if (!f.checks.empty()) {
    std::vector<PerfRun> checks;
    for (const std::string& path : f.checks) {
      SL_ASSIGN_OR_RETURN(PerfRun run,
                          LoadPerfJson(path, {.nranks = f.nranks, .collective = f.collective}));
      checks.push_back(std::move(run));
    }
    checks = merge(checks);
    std::printf("# check (not fitted):\n%s",
                FormatSamples(EvaluateLink(result.link, checks, options)).c_str());
  }

  Topology base;
  if (!f.base.empty()) {
    SL_ASSIGN_OR_RETURN(base, LoadTopology(f.base));
    if (!f.name.empty()) base.name = f.name;
    if (!f.description.empty()) base.description = f.description;
  } else {
    if (f.name.empty() || !(f.memory_gib > 0) || !(f.compute_tflops > 0)) {
      return absl::InvalidArgumentError(
          "without --base, --name, --memory-GiB and --compute-TFLOPs are required");
    }
    base.name = f.name;
    base.description = f.description;
    base.nodes = 1;
    base.devices_per_node = f.devices_per_node > 0 ? f.devices_per_node : most_ranks;
    base.device_memory_bytes = static_cast<uint64_t>(f.memory_gib * 1073741824.0);
    base.compute_flops_per_s = f.compute_tflops * 1e12;
    base.collectives = DefaultCollectiveAlgorithms();
    base.intra_node = result.link;  // replaced below; valid placeholder for inter calibrations
  }
  SL_ASSIGN_OR_RETURN(
      const Topology calibrated,
      ApplyCalibration(base, result,
                       f.level == "intra" ? LinkLevel::kIntraNode : LinkLevel::kInterNode,
                       f.ranks_per_node));
  const std::string json = TopologyToJson(calibrated);
  if (f.output == "-") {
    std::fputs(json.c_str(), stdout);
  } else if (!f.output.empty()) {
    std::ofstream out(f.output, std::ios::trunc);
    out << json;
    out.close();
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write '", f.output, "'"));
    std::printf("# wrote %s\n", f.output.c_str());
  }
  return absl::OkStatus();
}

}  // namespace shardline

#ifndef SHARDLINE_TUNE_CALIBRATE_NO_MAIN
int main(int argc, char** argv) {
  const absl::Status status = shardline::TuneCalibrateMain(argc, argv, "shardline-tune-calibrate");
  if (!status.ok()) {
    std::fprintf(stderr, "shardline-tune-calibrate: %s\n", std::string(status.message()).c_str());
    return 2;
  }
  return 0;
}
#endif  // SHARDLINE_TUNE_CALIBRATE_NO_MAIN
