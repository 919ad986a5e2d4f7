// checkpoint_fixture: the C++ side of tests/python/test_safetensors.py (the fixture model of
// checkpoint_fixture.h, ranks as threads over the local backend).
//
//   checkpoint_fixture save DIR OUT.safetensors [--world N] [--shard-size S] [--dtype D]
//       saves a sharded checkpoint of the model (master + adam.m) into DIR and exports the
//       master weights with ExportSafetensors into OUT (cast to D if given)
//   checkpoint_fixture import FILE [--world N] [--shard-size S] [--file-dtype f32|bf16]
//       imports FILE with ImportSafetensors into garbage-filled shards and checks every element
//       of every rank against the values as stored in the file's dtype, and every padding
//       element zero
// Exit status: 0; 1 with the error or the mismatch count; 2 for a bad command line.
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "scheduler/checkpoint/full_weights.h"
#include "tests/scheduler/checkpoint/checkpoint_fixture.h"

namespace shardline::fixture {
namespace {

int Main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() < 2 || (args[0] != "save" && args[0] != "import")) {
    std::fputs(
        "usage: checkpoint_fixture save DIR OUT [--world N] [--shard-size S] [--dtype D]\n"
        "       checkpoint_fixture import FILE [--world N] [--shard-size S]"
        " [--file-dtype D]\n",
        stderr);
    return 2;
  }
  const bool save = args[0] == "save";
  const size_t first_option = save ? 3 : 2;
  if (args.size() < first_option) return 2;
  int world = 4, shard_size = 0;
  std::optional<DType> dtype;
  DType file_dtype = DType::kF32;
  for (size_t i = first_option; i + 1 < args.size() + 1; i += 2) {
    if (i + 1 >= args.size()) return 2;
    const std::string& key = args[i];
    const std::string& value = args[i + 1];
    if (key == "--world") {
      if (!absl::SimpleAtoi(value, &world) || world < 1) return 2;
    } else if (key == "--shard-size") {
      if (!absl::SimpleAtoi(value, &shard_size)) return 2;
    } else if (key == "--dtype" || key == "--file-dtype") {
      absl::StatusOr<DType> d = ParseDType(value);
      if (!d.ok()) return 2;
      if (key == "--dtype") {
        dtype = *d;
      } else {
        file_dtype = *d;
      }
    } else {
      return 2;
    }
  }
  std::vector<size_t> wrong(world, 0);
  const std::vector<absl::Status> statuses =
      RunRanks(world, [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
        SL_ASSIGN_OR_RETURN(auto rank, MakeRank(comm, shard_size, /*fill=*/save));
        if (save) {
          SL_RETURN_IF_ERROR(rank->ckpt->Save(args[1], Deadline()));
          return ExportSafetensors(*rank->sched, args[2], {.dtype = dtype}, Deadline());
        }
        SL_RETURN_IF_ERROR(ImportSafetensors(*rank->sched, args[1], {}, Deadline()));
        wrong[r] = CountWrongElements(*rank->sched, file_dtype);
        return absl::OkStatus();
      });
  const absl::Status status = FirstError(statuses);
  if (!status.ok()) {
    absl::FPrintF(stderr, "checkpoint_fixture %s: %s\n", args[0], status.ToString());
    return 1;
  }
  size_t total = 0;
  for (size_t w : wrong) total += w;
  if (total != 0) {
    absl::FPrintF(stderr, "checkpoint_fixture import: %d elements differ\n", total);
    return 1;
  }
  absl::PrintF("checkpoint_fixture %s: ok at world %d\n", args[0], world);
  return 0;
}

}  // namespace
}  // namespace shardline::fixture

int main(int argc, char** argv) { return shardline::fixture::Main(argc, argv); }
