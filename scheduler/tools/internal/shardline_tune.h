// File: scheduler/tools/internal/shardline_tune.h
// -----------------------------------------------------------------------------
// Private to shardline-tune (scheduler/tools/shardline_tune*.cc): its subcommands and what they
// share. shardline_tune.cc is the entry point and the file helpers, shardline_tune_flags.cc
// parses sweep's flags, shardline_tune_sweep.cc runs a sweep, shardline_tune_validate.cc
// validates the simulator against overlap_bench runs, shardline_tune_failures.cc runs the failure
// model.

#ifndef SHARDLINE_SCHEDULER_TOOLS_INTERNAL_SHARDLINE_TUNE_H_
#define SHARDLINE_SCHEDULER_TOOLS_INTERNAL_SHARDLINE_TUNE_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "collectives/sim/topology.h"
#include "scheduler/tune/model.h"
#include "scheduler/tune/sweep.h"

namespace shardline::tune_cli {

// sweep's command line (ParseSweepFlags).
struct SweepFlags {
  std::string model, model_json, topology, json, csv, trace;
  int64_t seq_len = 0, hidden = 0, ffn = 0, vocab = 0;
  int micro_batch = 0, layers = 0, heads = 0, kv_heads = 0;
  int world = 0, jobs = 0, top = 10;
  double peak_tflops = 0;
  std::optional<bool> progress;
  SweepSpace space;
  bool shard_sizes_given = false;
};

// Parses argv[2...] (argv[1] is "sweep"); --help prints the usage and exits 0.
absl::StatusOr<SweepFlags> ParseSweepFlags(int argc, char** argv);

// The subcommands: argv[1] is "sweep", "validate" or "failures", the flags follow.
absl::Status Sweep(int argc, char** argv);
absl::Status Validate(int argc, char** argv);
absl::Status Failures(int argc, char** argv);

// The whole file; NotFound naming `what` and the path if it cannot be read.
absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what);
// Replaces the file's contents with `text`; Unavailable naming the path on failure.
absl::Status WriteFile(const std::string& path, const std::string& text);
// The model of a --model-json file (parse errors name the path).
absl::StatusOr<ModelDescription> ModelFromJson(const std::string& path);
// The --model preset at the given shape (seq_len, micro_batch: 0 keeps the preset's; gpt3-175b's
// sequence is 2048 unless given), for the subcommand to modify before TransformerModel. Errors
// name --model.
absl::StatusOr<TransformerConfig> PresetConfig(const std::string& model, int64_t seq_len,
                                               int micro_batch);
// A file path, or a shipped name looked up in the source tree's and the installation's
// topology folders.
absl::StatusOr<Topology> FindTopology(const std::string& name, const char* argv0);

}  // namespace shardline::tune_cli

#endif  // SHARDLINE_SCHEDULER_TOOLS_INTERNAL_SHARDLINE_TUNE_H_
