// shardline-tune: the tuner's command line.
//
//   shardline-tune sweep --model llama3-8b --topology h100-128-nodes --world 1024 [options]
//   shardline-tune calibrate [options] -o topology.json perf.json...   (shardline-tune-calibrate)
//   shardline-tune failures --model llama3-8b --topology h100-128-nodes [options]
//
// sweep simulates every configuration of a grid (scheduler/tune/sweep.h) of the real scheduler
// on a simulated cluster (a topology: a shipped name or a JSON file), prints the best ones and
// the recommendation, and writes the whole table as JSON and CSV, and the chosen
// configuration's simulated timeline as a Chrome trace (runtime/trace.h, the form the scheduler
// writes). `shardline-tune sweep --help` lists the options; docs/tuning.md walks through a run.
// Exit status: 0, or 2 with a message naming what was wrong. The subcommands are in
// shardline_tune_{flags,sweep,validate,failures}.cc (internal/shardline_tune.h); this file holds
// the entry point and the file helpers they share.

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"
#include "scheduler/tools/internal/shardline_tune.h"

namespace shardline {

// collectives/tools/tune_calibrate.cc, compiled into this binary too.
absl::Status TuneCalibrateMain(int argc, char** argv, const char* program);

namespace {

constexpr char kUsage[] =
    "usage: shardline-tune sweep (--model PRESET | --model-json FILE) --topology NAME|FILE\n"
    "                            [options]\n"
    "       shardline-tune calibrate [options] -o topology.json perf.json...\n"
    "                            (shardline-tune calibrate --help)\n"
    "       shardline-tune validate --topology NAME|FILE [options] overlap.json...\n"
    "                            (shardline-tune validate --help)\n"
    "       shardline-tune failures (--model PRESET | --model-json FILE) --topology NAME|FILE\n"
    "                            [options]   (shardline-tune failures --help)\n";

}  // namespace

namespace tune_cli {

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", what, " '", path, "'"));
  return std::string(std::istreambuf_iterator<char>(in), {});
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write '", path, "'"));
  return absl::OkStatus();
}

absl::StatusOr<ModelDescription> ModelFromJson(const std::string& path) {
  SL_ASSIGN_OR_RETURN(std::string text, ReadFile(path, "model"));
  absl::StatusOr<ModelDescription> m = ParseModelJson(text);
  if (!m.ok()) return Annotate(m.status(), path);
  return m;
}

absl::StatusOr<TransformerConfig> PresetConfig(const std::string& model, int64_t seq_len,
                                               int micro_batch) {
  PresetShape shape;
  if (model == "gpt3-175b") shape.seq_len = 2048;
  if (seq_len > 0) shape.seq_len = seq_len;
  if (micro_batch > 0) shape.micro_batch = micro_batch;
  absl::StatusOr<TransformerConfig> config = PresetByName(model, shape);
  if (!config.ok()) return Annotate(config.status(), "--model");
  return config;
}

// A file path, or a shipped name looked up in the source tree's and the installation's
// topology folders.
absl::StatusOr<Topology> FindTopology(const std::string& name, const char* argv0) {
  if (name.find('/') != std::string::npos || name.find(".json") != std::string::npos) {
    return LoadTopology(name);
  }
  std::vector<std::string> dirs;
#ifdef SHARDLINE_TOPOLOGIES_DIR
  dirs.push_back(SHARDLINE_TOPOLOGIES_DIR);
#endif
  std::string exe = argv0;
  if (const size_t slash = exe.rfind('/'); slash != std::string::npos) {
    dirs.push_back(exe.substr(0, slash) + "/../share/shardline/topologies");
  }
  for (const std::string& dir : dirs) {
    const std::string path = absl::StrCat(dir, "/", name, ".json");
    if (std::ifstream(path).good()) return LoadTopology(path);
  }
  return absl::NotFoundError(absl::StrCat("--topology: '", name,
                                          "' is neither a file nor a shipped topology (dgx-h100, "
                                          "h100-128-nodes, dgx-a100, dgx-a100-cluster, "
                                          "this-machine)"));
}

}  // namespace tune_cli
}  // namespace shardline

int main(int argc, char** argv) {
  // The scheduler's warnings (a budget below what the units need, say) would flood the terminal
  // over a sweep; the table carries them (budget_overshoots, errors). SHARDLINE_DEBUG_FILE, if
  // set, still receives them.
  setenv("SHARDLINE_DEBUG_FILE", "/dev/null", /*overwrite=*/0);
  const std::string command = argc > 1 ? argv[1] : "";
  absl::Status status;
  if (command == "sweep") {
    status = shardline::tune_cli::Sweep(argc, argv);
  } else if (command == "validate") {
    status = shardline::tune_cli::Validate(argc, argv);
  } else if (command == "failures") {
    status = shardline::tune_cli::Failures(argc, argv);
  } else if (command == "calibrate") {
    status = shardline::TuneCalibrateMain(argc - 1, argv + 1, "shardline-tune calibrate");
  } else if (command == "-h" || command == "--help") {
    std::fputs(shardline::kUsage, stdout);
    return 0;
  } else {
    std::fprintf(stderr, "shardline-tune: %s\n%s",
                 command.empty() ? "no subcommand (sweep, calibrate, validate or failures)"
                                 : absl::StrCat("unknown subcommand '", command, "'").c_str(),
                 shardline::kUsage);
    return 2;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "shardline-tune %s: %s\n", command.c_str(),
                 std::string(status.message()).c_str());
    return 2;
  }
  return 0;
}
