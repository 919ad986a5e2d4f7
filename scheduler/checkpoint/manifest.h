// File: scheduler/checkpoint/manifest.h
// -----------------------------------------------------------------------------
// The manifest of a sharded checkpoint: which units, tensors and states it holds, where every
// piece of every state lies in which data file, and each piece's checksums. It is the
// checkpoint's `manifest.json` (format below and in docs/checkpoints.md); rank 0 writes it
// last, in a temporary directory renamed into place afterwards, so a directory without it, or
// one still named as a temporary directory, is an incomplete save.
//
// Pieces. A state of a unit (its master shard, "master", or a registered state such as
// "adam.m") is stored as the ShardSlices of the layout it was saved under: one piece per
// (tensor, shard) intersection, in layout order, holding `elements` elements of the state's
// dtype — tensor elements only, never padding. Data file `shard-SSSSS-of-NNNNN.bin` holds the
// pieces of shard SSSSS back to back, in the order units → states → slices, with no header.
// Each piece is checksummed in blocks of `checksum_block_bytes` counted from the piece's first
// byte (the last block may be shorter): CRC-32C (runtime/crc32c.h), written as 8
// lower-case hex digits. A reader that needs part of a piece reads and verifies the blocks
// covering that part, never the whole piece.
//
// Everything but the checksums is derived from the layouts and the state dtypes; validation
// recomputes it and rejects any difference, so an edited or corrupted manifest is an error, not
// a misread. No path in the manifest is absolute: file names are bare names inside the
// checkpoint directory.
//
// manifest.json, format_version 1 (integers are JSON integers, byte and element counts in
// decimal):
//   { "format": "shardline.checkpoint", "format_version": 1, "library_version": "0.1.0",
//     "world_size": 4, "mesh": {"replicate": 1, "shard": 4},
//     "checksum": "crc32c", "checksum_block_bytes": 1048576,
//     "files": [ {"name": "shard-00000-of-00004.bin", "shard": 0, "bytes": 1234}, ... ],
//     "units": [
//       { "name": "block0",
//         "layout": { "element_dtype": "f32", "num_shards": 4, "alignment_bytes": 16,
//                     "block_elements": 1, "shard_elements": 40,
//                     "tensors": [ {"name": "w", "shape": [13, 7], "dtype": "f32",
//                                   "tied_to": "", "offset": 0}, ... ] },
//         "states": [
//           { "name": "master", "dtype": "f32",
//             "pieces": [ {"tensor": "w", "shard": 0, "tensor_offset": 0, "elements": 40,
//                          "shard_offset": 0, "file": "shard-00000-of-00004.bin",
//                          "file_offset": 0, "bytes": 160, "crc32c": ["1a2b3c4d"]}, ... ] },
//           ... ] },
//       ... ],
//     "replicated": { "file": "replicated.bin", "bytes": 12,       (only with replicated states)
//                     "states": [ {"name": "step", "shape": [], "dtype": "i64", "file_offset": 0,
//                                  "bytes": 8, "crc32c": "1a2b3c4d"}, ... ] } }
//
// Replicated states (not shard-shaped, the same on every rank: a step counter) are stored whole,
// back to back, in replicated.bin, which rank 0 writes; each has one CRC-32C over its bytes. The
// member is optional and absent when there are none, so the format without them is unchanged;
// readers of format_version 1 that predate it ignore it (they cannot register such states).

#ifndef SHARDLINE_SCHEDULER_CHECKPOINT_MANIFEST_H_
#define SHARDLINE_SCHEDULER_CHECKPOINT_MANIFEST_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "runtime/dtype.h"
#include "runtime/flat_layout.h"
#include "scheduler/checkpoint/file_system.h"

namespace shardline {

inline constexpr int kCheckpointFormatVersion = 1;
inline constexpr absl::string_view kCheckpointFormat = "shardline.checkpoint";
inline constexpr absl::string_view kCheckpointManifestName = "manifest.json";
// The state name of a unit's master shard; registered states may not use it.
inline constexpr absl::string_view kMasterStateName = "master";
// The file of the replicated states (CheckpointManifest::replicated), written by rank 0.
inline constexpr absl::string_view kCheckpointReplicatedFileName = "replicated.bin";
// Largest manifest Read/ParseCheckpointManifest accept (bytes).
inline constexpr uint64_t kMaxCheckpointManifestBytes = uint64_t{1} << 30;

// One (tensor, shard) intersection of one state, stored contiguously in one data file.
struct CheckpointPiece {
  int tensor = 0;              // index into the unit's tensors (a storage-owning tensor)
  int shard = 0;               // the shard of the saved layout
  uint64_t tensor_offset = 0;  // first element, in the tensor's row-major index space
  uint64_t elements = 0;
  uint64_t shard_offset = 0;     // first element within the shard
  int file = 0;                  // index into CheckpointManifest::files
  uint64_t file_offset = 0;      // first byte within the file
  uint64_t bytes = 0;            // elements * the state's dtype size
  std::vector<uint32_t> crc32c;  // per checksum block of the piece

  friend bool operator==(const CheckpointPiece&, const CheckpointPiece&) = default;
};

struct CheckpointStateRecord {
  std::string name;  // kMasterStateName or a registered name
  DType dtype = DType::kF32;
  std::vector<CheckpointPiece> pieces;  // in layout.slices() order

  friend bool operator==(const CheckpointStateRecord&, const CheckpointStateRecord&) = default;
};

struct CheckpointUnitRecord {
  std::string name;
  // The saved layout as the manifest states it; `layout` is built from specs and options by
  // ValidateCheckpointManifest (and by MakeCheckpointManifest), which also checks the stated
  // derived values (offsets, shard_elements) against it.
  std::vector<TensorSpec> tensors;
  FlatLayoutOptions options;
  std::vector<uint64_t> tensor_offsets;
  uint64_t shard_elements = 0;
  FlatLayout layout;
  std::vector<CheckpointStateRecord> states;
};

struct CheckpointFileRecord {
  std::string name;  // a bare file name in the checkpoint directory
  int shard = 0;
  uint64_t bytes = 0;

  friend bool operator==(const CheckpointFileRecord&, const CheckpointFileRecord&) = default;
};

// A replicated state: not shard-shaped, the same on every rank (a step counter, a learning-rate
// schedule's position), stored once, whole, in kCheckpointReplicatedFileName.
struct CheckpointReplicatedRecord {
  std::string name;            // 1-128 characters of [A-Za-z0-9._-], unique among them
  std::vector<int64_t> shape;  // row-major; {} is a scalar
  DType dtype = DType::kF32;
  uint64_t file_offset = 0;  // first byte within the file: the states lie back to back, in order
  uint64_t bytes = 0;        // numel(shape) * the dtype's size
  uint32_t crc32c = 0;       // of the state's bytes

  friend bool operator==(const CheckpointReplicatedRecord&,
                         const CheckpointReplicatedRecord&) = default;
};

struct CheckpointManifest {
  int format_version = kCheckpointFormatVersion;
  std::string library_version;
  int world_size = 1;
  int replicate_size = 1;
  int shard_size = 1;
  uint64_t checksum_block_bytes = 1 << 20;
  std::vector<CheckpointFileRecord> files;  // files[s] holds shard s
  std::vector<CheckpointUnitRecord> units;
  // The replicated states, in kCheckpointReplicatedFileName of replicated_bytes bytes; none: no
  // such file, and no "replicated" member in manifest.json.
  std::vector<CheckpointReplicatedRecord> replicated;
  uint64_t replicated_bytes = 0;
};

// What a save stores of one unit: its layout and its states (name and dtype, master first).
struct CheckpointUnitContents {
  std::string name;
  FlatLayout layout;
  struct State {
    std::string name;
    DType dtype = DType::kF32;
  };
  std::vector<State> states;
};

// "shard-00001-of-00004.bin".
std::string CheckpointShardFileName(int shard, int num_shards);

// The number of checksum blocks of a piece of `bytes` bytes.
inline uint64_t CheckpointBlockCount(uint64_t bytes, uint64_t block_bytes) {
  return (bytes + block_bytes - 1) / block_bytes;
}

// The manifest of a save of `units` (every layout with num_shards == shard_size) from a mesh
// replicate_size x shard_size: files, pieces and offsets, with every checksum 0 (the writers
// fill them in). Deterministic: every rank computes the same one. InvalidArgument for a layout
// of another shard count, block_bytes 0 or a sum that overflows.
absl::StatusOr<CheckpointManifest> MakeCheckpointManifest(
    const std::vector<CheckpointUnitContents>& units, int replicate_size, int shard_size,
    uint64_t block_bytes, std::string library_version);

// Sets manifest->replicated to `states` (name, shape, dtype) with their offsets and sizes
// computed, checksums 0, and replicated_bytes. InvalidArgument for a bad or duplicate name, a
// negative dimension or a size that overflows.
absl::Status SetCheckpointReplicatedStates(CheckpointManifest* manifest,
                                           std::vector<CheckpointReplicatedRecord> states);

// The manifest as manifest.json text.
std::string CheckpointManifestToJson(const CheckpointManifest& manifest);

// Reads manifest.json text into a manifest, checking the syntax, the fields' presence and types,
// the format and its version, dtype names and that names (tensors, files) resolve; does NOT
// check that the derived values agree (layouts are not built): see ValidateCheckpointManifest.
// InvalidArgument naming the field ("units[1].states[0].pieces[3].crc32c") on any error.
absl::StatusOr<CheckpointManifest> ParseCheckpointManifest(absl::string_view json);

// Builds every unit's layout and checks everything derived: the stated tensor offsets and
// shard_elements, each layout's shard count against the mesh, the file list (one file per
// shard, named as CheckpointShardFileName), that each state's pieces are exactly the
// layout's slices with the offsets, sizes and checksum counts a save computes, and the replicated
// states' names, offsets and sizes. InvalidArgument
// naming the unit, state, tensor and field that differ.
absl::Status ValidateCheckpointManifest(CheckpointManifest& manifest);

// Whether `dir` is named as a save's temporary directory: "<target>.tmp-" followed by 16
// lower-case hex digits. Such a directory is an unfinished save even when it holds a manifest
// (the save stopped between writing the manifest and renaming the directory into place).
bool IsCheckpointTemporaryDir(absl::string_view dir);

// The rule for the names of registered and replicated states: 1-128 characters of
// [A-Za-z0-9._-].
bool IsValidCheckpointStateName(absl::string_view name);

// The text of the directory's manifest.json. NotFound if `dir` does not exist;
// FailedPrecondition "is a file, not a checkpoint directory" if `dir` is not a directory;
// FailedPrecondition "incomplete checkpoint" if it is a save's temporary directory
// (IsCheckpointTemporaryDir) or has no manifest; FailedPrecondition "not a regular file" if the
// manifest is not one (a FIFO: never waited on); InvalidArgument if the manifest exceeds
// kMaxCheckpointManifestBytes.
absl::StatusOr<std::string> ReadCheckpointManifestText(FileSystem& fs, absl::string_view dir);

// The directory's manifest, parsed and validated. NotFound if `dir` does not exist;
// FailedPrecondition "incomplete checkpoint" for a save's temporary directory or one without a
// manifest (a save that did not finish: its data files may be partial); InvalidArgument (prefixed
// with the manifest's path) for a malformed or inconsistent one.
absl::StatusOr<CheckpointManifest> ReadCheckpointManifest(FileSystem& fs, absl::string_view dir);

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_CHECKPOINT_MANIFEST_H_
