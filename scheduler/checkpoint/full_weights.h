// File: scheduler/checkpoint/full_weights.h
// -----------------------------------------------------------------------------
// Full weights as one safetensors file (scheduler/checkpoint/safetensors.h), the form inference
// stacks and unsharded frameworks load: an export that gathers a Scheduler's master shards one
// unit at a time to one writer rank, and an import that has every rank take only its own shard's
// ranges out of a memory-mapped file.
//
//   SL_RETURN_IF_ERROR(ExportSafetensors(*sched, "model.safetensors",
//                                        {.dtype = DType::kBF16}, deadline));
//   ... in any job whose units have the same tensors (any world size, any mesh):
//   SL_RETURN_IF_ERROR(ImportSafetensors(*sched, "model.safetensors", {}, deadline));
//
// Both are collective over scheduler.mesh().world() (every rank calls them, with the same path and
// options, between steps: every unit sharded; master shards on a device are gathered in its
// memory and copied to host memory unit by unit for an export, and written through one host copy
// each way for an import); they block the calling thread, every wait for streams and peers bounded
// by `deadline`, and return the same outcome on every rank (scheduler/checkpoint/agree.h): a rank
// whose own part failed returns its error, the others the lowest failing rank's, prefixed
// "failed on rank N: " and marked as a peer error. Messages begin with
// "safetensors export '<path>': " / "safetensors import '<path>': ".
//
// The file. Tensors are named as the framework registered them (TensorSpec::name, without the
// unit's name), so names must be unique across units (InvalidArgument naming both units). Units
// in registration order, each unit's tensors in registration order, back to back. A tied tensor
// (TensorSpec::tied_to) is written once, under the name of the tensor it is tied to, as the
// safetensors libraries require (they refuse tensors that share memory); the header's
// "__metadata__" records the tie as "shardline.tied_to.<name>": "<target>". Padding is never
// written. "__metadata__" also holds "format": "pt" (what Hugging Face loaders check) and the
// caller's entries.
//
// Export: the ranks of the writer's replicate group all-gather one unit's master shard at a time
// (over a Dup of the shard group), the next unit's gather running while the writer casts (if
// asked) and appends this unit's tensors; a unit's buffer is freed once written. Memory beyond
// the shards, per rank of that group: the unsharded master buffers of two consecutive units,
// plus cast_chunk_bytes on the writer when casting. The
// file is written through SafetensorsWriter: "<path>.tmp-<16 hex digits>", fsynced, renamed to
// `path` (AlreadyExists if `path` exists: an export never replaces a file), parent directory
// fsynced. A failed or killed export leaves no `path`, perhaps the temporary file.
//
// Import: every rank maps the file (SafetensorsFile: no copy of it; only the pages of its own
// ranges are read), checks the header against its units and then, for every tensor, copies the
// elements its shard owns into its master shard, casting where the file's dtype differs, and
// zeroes the shard's padding. Checks (all before anything is written; errors name the file and
// the tensor):
//   NotFound          the file does not exist; tensors of the units absent from the file (named)
//   InvalidArgument   a shape that differs; a dtype that cannot be cast (floating masters accept
//                     F64, F32, F16, BF16 and round to nearest even when narrowing; integer
//                     masters need their own dtype); tensors in the file that belong to no unit
//                     (named; ignore_unknown_tensors skips them); a tie's name present in the
//                     file with other values than its target's (each rank compares its range)
//   DataLoss          a truncated or extended file; the reader's other checks (safetensors.h)

#ifndef SHARDLINE_SCHEDULER_CHECKPOINT_FULL_WEIGHTS_H_
#define SHARDLINE_SCHEDULER_CHECKPOINT_FULL_WEIGHTS_H_

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "runtime/dtype.h"
#include "runtime/flat_layout.h"
#include "scheduler/checkpoint/file_system.h"
#include "scheduler/checkpoint/safetensors.h"
#include "scheduler/scheduler.h"

namespace shardline {

// The metadata key prefix of a tie: "shardline.tied_to.<tie name>": "<target name>".
inline constexpr absl::string_view kSafetensorsTiePrefix = "shardline.tied_to.";

struct SafetensorsExportOptions {
  // The file's writes go through it. Null: PosixFileSystem().
  FileSystem* file_system = nullptr;
  // The world rank that writes the file.
  int writer_rank = 0;
  // The file's dtype for every tensor. Unset: each unit's master dtype (the bits as they are).
  // A dtype other than the master's must be floating, as the master's must (rounding to nearest
  // even when narrowing).
  std::optional<DType> dtype;
  // Added to "__metadata__" after "format" and the ties; keys must not repeat those.
  std::vector<std::pair<std::string, std::string>> metadata;
  // The writer's staging buffer when casting (bytes, >= 1).
  size_t cast_chunk_bytes = size_t{8} << 20;
};

// Writes every unit's master weights into the new file `path` (see the header comment).
absl::Status ExportSafetensors(Scheduler& scheduler, absl::string_view path,
                               const SafetensorsExportOptions& options, absl::Time deadline);

struct SafetensorsImportOptions {
  // Tensors in the file that belong to no unit: false, an error naming them; true, skipped.
  bool ignore_unknown_tensors = false;
};

// Loads every unit's master shard from the safetensors file `path` (see the header comment).
absl::Status ImportSafetensors(Scheduler& scheduler, absl::string_view path,
                               const SafetensorsImportOptions& options, absl::Time deadline);

// The pieces the export and shardline-checkpoint's offline export share.
// One unit as a full-weight file sees it.
struct FullWeightUnit {
  std::string name;
  const FlatLayout* layout = nullptr;
  DType dtype = DType::kF32;  // the file's dtype for the unit's tensors
};
// The header of a full-weight file of `units`: every storage-owning tensor (units and tensors in
// order) and the metadata ("format": "pt", the ties, then `extra`).
struct FullWeightFilePlan {
  std::vector<SafetensorsTensorInfo> tensors;
  std::vector<std::pair<std::string, std::string>> metadata;
};
// InvalidArgument for a tensor name used twice across units (ties included), naming both units,
// or an `extra` key that repeats one of ours.
absl::StatusOr<FullWeightFilePlan> PlanFullWeightFile(
    const std::vector<FullWeightUnit>& units,
    const std::vector<std::pair<std::string, std::string>>& extra);

// Appends `count` elements at `src` (of `src_dtype`) to `writer` as `dst_dtype`: directly if the
// dtypes are the same, else cast through `staging` (resized to at most chunk_bytes).
absl::Status AppendCast(SafetensorsWriter& writer, const void* src, DType src_dtype,
                        DType dst_dtype, size_t count, size_t chunk_bytes,
                        std::vector<char>* staging);

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_CHECKPOINT_FULL_WEIGHTS_H_
