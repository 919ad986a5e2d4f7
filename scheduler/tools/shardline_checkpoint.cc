// shardline-checkpoint: sharded checkpoints (scheduler/checkpoint/) from the command line, without
// a job or a scheduler.
//
//   shardline-checkpoint inspect DIR
//   shardline-checkpoint verify DIR
//   shardline-checkpoint export DIR OUT.safetensors [--state NAME] [--dtype DTYPE]
//
// inspect prints the manifest: the saving mesh, the data files, every unit's layout, tensors and
// states. verify reads everything a load reads: every piece of every data file, checking every
// block's CRC-32C against the manifest, and every replicated state in replicated.bin, checking
// its CRC-32C; it reports each missing, truncated or extended file and each corrupt block,
// naming the file, the unit, the state and the tensor (or the replicated state). export writes one
// state (default "master") of every unit as one safetensors file, tensor by tensor, reading and
// verifying the pieces in bounded chunks and casting to DTYPE (a floating dtype; default: the
// state's own) on the way; the file is the one ExportSafetensors
// (scheduler/checkpoint/full_weights.h) writes for the same weights. Exit status: 0; 1 if the
// checkpoint is unreadable or damaged, or the export failed; 2 for a usage error.

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "runtime/crc32c.h"
#include "runtime/dtype.h"
#include "runtime/status.h"
#include "scheduler/checkpoint/file_system.h"
#include "scheduler/checkpoint/full_weights.h"
#include "scheduler/checkpoint/manifest.h"
#include "scheduler/checkpoint/safetensors.h"

namespace shardline {
namespace {

constexpr char kUsage[] =
    "usage: shardline-checkpoint inspect DIR\n"
    "       shardline-checkpoint verify DIR\n"
    "       shardline-checkpoint export DIR OUT.safetensors [--state NAME] [--dtype DTYPE]\n"
    "\n"
    "inspect  print the manifest: mesh, data files, units, tensors, states\n"
    "verify   read every piece and replicated state, check every CRC-32C; exit 1 naming each\n"
    "         missing, truncated or corrupt file\n"
    "export   one state (default master) of every unit as one safetensors file, optionally\n"
    "         cast to a floating DTYPE (f32, f64, f16, bf16); OUT must not exist\n";

// The most bytes read at once (whole checksum blocks, at least one).
constexpr uint64_t kReadChunkBytes = uint64_t{8} << 20;

std::string Shape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string PieceName(const CheckpointUnitRecord& unit, const CheckpointStateRecord& state,
                      const CheckpointPiece& piece) {
  return absl::StrCat("unit '", unit.name, "' state '", state.name, "' tensor '",
                      unit.tensors[piece.tensor].name, "'");
}

int Inspect(const std::string& dir) {
  absl::StatusOr<CheckpointManifest> m = ReadCheckpointManifest(PosixFileSystem(), dir);
  if (!m.ok()) {
    absl::FPrintF(stderr, "shardline-checkpoint inspect: %s\n", m.status().ToString());
    return 1;
  }
  absl::PrintF("checkpoint %s\n", dir);
  absl::PrintF("  format %s version %d, written by shardline %s\n", kCheckpointFormat,
               m->format_version, m->library_version);
  absl::PrintF("  world %d, mesh %d x %d (replicate x shard), crc32c per %d-byte block\n",
               m->world_size, m->replicate_size, m->shard_size, m->checksum_block_bytes);
  uint64_t total = 0;
  for (const CheckpointFileRecord& f : m->files) total += f.bytes;
  absl::PrintF("  %d data files, %d bytes:\n", m->files.size(), total);
  for (const CheckpointFileRecord& f : m->files) {
    absl::PrintF("    %s  shard %d  %d bytes\n", f.name, f.shard, f.bytes);
  }
  for (const CheckpointUnitRecord& unit : m->units) {
    absl::PrintF("  unit '%s': master %s, %d shards of %d elements, alignment %d bytes, block %d\n",
                 unit.name, DTypeName(unit.options.element_dtype), unit.options.num_shards,
                 unit.shard_elements, unit.options.alignment_bytes, unit.options.block_elements);
    for (size_t t = 0; t < unit.tensors.size(); ++t) {
      const TensorSpec& spec = unit.tensors[t];
      absl::PrintF("    tensor '%s' %s %s offset %d%s\n", spec.name, Shape(spec.shape),
                   DTypeName(spec.dtype), unit.tensor_offsets[t],
                   spec.tied_to.empty() ? "" : absl::StrCat(" tied to '", spec.tied_to, "'"));
    }
    for (const CheckpointStateRecord& state : unit.states) {
      uint64_t bytes = 0;
      for (const CheckpointPiece& p : state.pieces) bytes += p.bytes;
      absl::PrintF("    state '%s' %s: %d pieces, %d bytes\n", state.name, DTypeName(state.dtype),
                   state.pieces.size(), bytes);
    }
  }
  return 0;
}

// Reads bytes [lo, hi) of `piece` (whole blocks, hi clipped to the piece) and verifies each block.
// DataLoss naming the file, the bytes and the piece on a mismatch.
absl::Status ReadVerified(ReadableFile& file, const std::string& file_name,
                          const CheckpointUnitRecord& unit, const CheckpointStateRecord& state,
                          const CheckpointPiece& piece, uint64_t block, uint64_t lo, uint64_t hi,
                          std::vector<char>* out) {
  out->resize(hi - lo);
  SL_RETURN_IF_ERROR(file.ReadAt(piece.file_offset + lo, hi - lo, out->data()));
  for (uint64_t b = lo; b < hi; b += block) {
    const uint64_t e = std::min(b + block, hi);
    const uint32_t crc = Crc32c(out->data() + (b - lo), e - b);
    const uint32_t want = piece.crc32c[b / block];
    if (crc != want) {
      const uint64_t size = DTypeSize(state.dtype);
      return absl::DataLossError(absl::StrFormat(
          "data file '%s' bytes [%d, %d) have CRC-32C %08x, the manifest says %08x: %s elements "
          "[%d, %d) are corrupt",
          file_name, piece.file_offset + b, piece.file_offset + e, crc, want,
          PieceName(unit, state, piece), piece.tensor_offset + b / size,
          piece.tensor_offset + (e + size - 1) / size));
    }
  }
  return absl::OkStatus();
}

uint64_t ChunkBytes(uint64_t block) {
  return std::max<uint64_t>(1, kReadChunkBytes / block) * block;
}

int Verify(const std::string& dir) {
  FileSystem& fs = PosixFileSystem();
  absl::StatusOr<CheckpointManifest> m = ReadCheckpointManifest(fs, dir);
  if (!m.ok()) {
    absl::FPrintF(stderr, "shardline-checkpoint verify: %s\n", m.status().ToString());
    return 1;
  }
  const uint64_t block = m->checksum_block_bytes;
  int problems = 0;
  uint64_t pieces = 0, bytes = 0;
  auto report = [&](const std::string& line) {
    ++problems;
    absl::PrintF("FAILED %s\n", line);
  };
  for (size_t f = 0; f < m->files.size(); ++f) {
    const CheckpointFileRecord& record = m->files[f];
    // What the file holds, for the messages.
    std::vector<std::string> held;
    for (const CheckpointUnitRecord& unit : m->units) {
      for (const CheckpointStateRecord& state : unit.states) {
        for (const CheckpointPiece& p : state.pieces) {
          if (p.file == static_cast<int>(f) && held.size() < 3) {
            held.push_back(PieceName(unit, state, p));
          }
        }
      }
    }
    absl::StatusOr<std::unique_ptr<ReadableFile>> file =
        fs.OpenFile(absl::StrCat(dir, "/", record.name));
    if (!file.ok()) {
      report(absl::StrCat("data file '", record.name, "' cannot be opened (",
                          file.status().ToString(), "); it holds ",
                          held.empty() ? std::string("nothing") : absl::StrJoin(held, ", "),
                          held.size() == 3 ? ", ..." : ""));
      continue;
    }
    const uint64_t size = (*file)->size();
    if (size != record.bytes) {
      report(absl::StrCat("data file '", record.name, "' is ", size, " bytes, the manifest says ",
                          record.bytes, size < record.bytes ? " (truncated)" : " (extended)"));
    }
    std::vector<char> buffer;
    for (const CheckpointUnitRecord& unit : m->units) {
      for (const CheckpointStateRecord& state : unit.states) {
        for (const CheckpointPiece& piece : state.pieces) {
          if (piece.file != static_cast<int>(f)) continue;
          ++pieces;
          if (piece.file_offset + piece.bytes > size) {
            report(absl::StrCat("data file '", record.name, "': ", PieceName(unit, state, piece),
                                " (bytes [", piece.file_offset, ", ",
                                piece.file_offset + piece.bytes, ")) lies beyond its end"));
            continue;
          }
          for (uint64_t lo = 0; lo < piece.bytes; lo += ChunkBytes(block)) {
            const uint64_t hi = std::min(piece.bytes, lo + ChunkBytes(block));
            absl::Status s =
                ReadVerified(**file, record.name, unit, state, piece, block, lo, hi, &buffer);
            if (!s.ok()) {
              report(std::string(s.message()));
              break;
            }
            bytes += hi - lo;
          }
        }
      }
    }
  }
  // The replicated states: a load reads them too (every registered one, on every rank).
  if (!m->replicated.empty()) {
    const std::string name(kCheckpointReplicatedFileName);
    std::vector<std::string> held;
    for (const CheckpointReplicatedRecord& r : m->replicated) {
      held.push_back(absl::StrCat("'", r.name, "'"));
    }
    const std::string holds =
        absl::StrCat("replicated state", held.size() > 1 ? "s " : " ", absl::StrJoin(held, ", "));
    absl::StatusOr<std::unique_ptr<ReadableFile>> file = fs.OpenFile(absl::StrCat(dir, "/", name));
    if (!file.ok()) {
      report(absl::StrCat("data file '", name, "' cannot be opened (", file.status().ToString(),
                          "); it holds ", holds));
    } else {
      const uint64_t size = (*file)->size();
      if (size != m->replicated_bytes) {
        report(absl::StrCat("data file '", name, "' is ", size, " bytes, the manifest says ",
                            m->replicated_bytes,
                            size < m->replicated_bytes ? " (truncated)" : " (extended)"));
      }
      std::vector<char> buffer;
      for (const CheckpointReplicatedRecord& r : m->replicated) {
        ++pieces;
        if (r.file_offset + r.bytes > size) {
          report(absl::StrCat("data file '", name, "': replicated state '", r.name, "' (bytes [",
                              r.file_offset, ", ", r.file_offset + r.bytes,
                              ")) lies beyond its end"));
          continue;
        }
        buffer.resize(r.bytes);
        absl::Status s = (*file)->ReadAt(r.file_offset, r.bytes, buffer.data());
        if (!s.ok()) {
          report(std::string(s.message()));
          continue;
        }
        const uint32_t crc = Crc32c(buffer.data(), buffer.size());
        if (crc != r.crc32c) {
          report(absl::StrFormat(
              "data file '%s' bytes [%d, %d) have CRC-32C %08x, the manifest says %08x: "
              "replicated state '%s' is corrupt",
              name, r.file_offset, r.file_offset + r.bytes, crc, r.crc32c, r.name));
          continue;
        }
        bytes += r.bytes;
      }
    }
  }
  if (problems > 0) {
    absl::PrintF("%s: %d problems (%d pieces checked)\n", dir, problems, pieces);
    return 1;
  }
  absl::PrintF("%s: OK: %d data files, %d pieces, %d bytes, every CRC-32C matches\n", dir,
               m->files.size() + (m->replicated.empty() ? 0 : 1), pieces, bytes);
  return 0;
}

absl::Status Export(const std::string& dir, const std::string& out, const std::string& state_name,
                    std::optional<DType> dtype) {
  FileSystem& fs = PosixFileSystem();
  SL_ASSIGN_OR_RETURN(CheckpointManifest m, ReadCheckpointManifest(fs, dir));
  const uint64_t block = m.checksum_block_bytes;
  std::vector<const CheckpointStateRecord*> states;
  std::vector<FullWeightUnit> units;
  for (const CheckpointUnitRecord& unit : m.units) {
    const CheckpointStateRecord* state = nullptr;
    std::vector<std::string> names;
    for (const CheckpointStateRecord& s : unit.states) {
      names.push_back(s.name);
      if (s.name == state_name) state = &s;
    }
    if (state == nullptr) {
      return absl::NotFoundError(absl::StrCat("unit '", unit.name, "' has no state '", state_name,
                                              "' (it has: ", absl::StrJoin(names, ", "), ")"));
    }
    const DType to = dtype.value_or(state->dtype);
    if (to != state->dtype && !(IsFloatingPoint(to) && IsFloatingPoint(state->dtype))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unit '", unit.name, "' state '", state_name, "' is ", DTypeName(state->dtype),
          ": it cannot be exported as ", DTypeName(to), " (casts are between floating dtypes)"));
    }
    states.push_back(state);
    units.push_back({.name = unit.name, .layout = &unit.layout, .dtype = to});
  }
  SL_ASSIGN_OR_RETURN(auto plan, PlanFullWeightFile(units, {}));
  SL_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> writer,
                      SafetensorsWriter::Create(fs, out, plan.tensors, plan.metadata));

  std::vector<std::unique_ptr<ReadableFile>> files(m.files.size());
  std::vector<char> buffer, pending, staging;
  for (size_t u = 0; u < m.units.size(); ++u) {
    const CheckpointUnitRecord& unit = m.units[u];
    const CheckpointStateRecord& state = *states[u];
    const size_t size = DTypeSize(state.dtype);
    for (int t = 0; t < static_cast<int>(unit.tensors.size()); ++t) {
      // The tensor's pieces tile it: append them in element order.
      std::vector<const CheckpointPiece*> pieces;
      for (const CheckpointPiece& p : state.pieces) {
        if (p.tensor == t) pieces.push_back(&p);
      }
      std::sort(pieces.begin(), pieces.end(),
                [](const CheckpointPiece* a, const CheckpointPiece* b) {
                  return a->tensor_offset < b->tensor_offset;
                });
      for (const CheckpointPiece* piece : pieces) {
        const CheckpointFileRecord& record = m.files[piece->file];
        if (files[piece->file] == nullptr) {
          absl::StatusOr<std::unique_ptr<ReadableFile>> f =
              fs.OpenFile(absl::StrCat(dir, "/", record.name));
          if (!f.ok()) {
            return Annotate(f.status(), absl::StrCat("data file '", record.name, "' (",
                                                     PieceName(unit, state, *piece), " is in it)"));
          }
          if ((*f)->size() != record.bytes) {
            return absl::DataLossError(absl::StrCat(
                "data file '", record.name, "' is ", (*f)->size(), " bytes, the manifest says ",
                record.bytes, " (", PieceName(unit, state, *piece), " is in it)"));
          }
          files[piece->file] = *std::move(f);
        }
        for (uint64_t lo = 0; lo < piece->bytes; lo += ChunkBytes(block)) {
          const uint64_t hi = std::min(piece->bytes, lo + ChunkBytes(block));
          SL_RETURN_IF_ERROR(ReadVerified(*files[piece->file], record.name, unit, state, *piece,
                                          block, lo, hi, &buffer));
          // Blocks need not be whole elements: carry a partial element to the next chunk.
          pending.insert(pending.end(), buffer.begin(), buffer.end());
          const size_t whole = pending.size() / size;
          SL_RETURN_IF_ERROR(Annotate(AppendCast(*writer, pending.data(), state.dtype,
                                                 units[u].dtype, whole, kReadChunkBytes, &staging),
                                      PieceName(unit, state, *piece)));
          pending.erase(pending.begin(), pending.begin() + whole * size);
        }
      }
    }
  }
  SL_RETURN_IF_ERROR(writer->Finish());
  absl::PrintF("%s: state '%s' of %d units, %d tensors, %d data bytes written to %s\n", dir,
               state_name, m.units.size(), plan.tensors.size(), writer->header().data_bytes, out);
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  if ((command == "inspect" || command == "verify") && args.size() == 2) {
    return command == "inspect" ? Inspect(args[1]) : Verify(args[1]);
  }
  if (command == "export" && args.size() >= 3) {
    std::string state(kMasterStateName);
    std::optional<DType> dtype;
    for (size_t i = 3; i < args.size(); i += 2) {
      if (i + 1 >= args.size()) {
        absl::FPrintF(stderr, "shardline-checkpoint export: %s needs a value\n%s", args[i], kUsage);
        return 2;
      }
      if (args[i] == "--state") {
        state = args[i + 1];
      } else if (args[i] == "--dtype") {
        absl::StatusOr<DType> d = ParseDType(args[i + 1]);
        if (!d.ok()) {
          absl::FPrintF(stderr, "shardline-checkpoint export: --dtype: %s\n", d.status().message());
          return 2;
        }
        dtype = *d;
      } else {
        absl::FPrintF(stderr, "shardline-checkpoint export: unknown option '%s'\n%s", args[i],
                      kUsage);
        return 2;
      }
    }
    absl::Status s = Export(args[1], args[2], state, dtype);
    if (!s.ok()) {
      absl::FPrintF(stderr, "shardline-checkpoint export '%s': %s\n", args[1], s.ToString());
      return 1;
    }
    return 0;
  }
  absl::FPrintF(stderr, "shardline-checkpoint: bad command line\n%s", kUsage);
  return 2;
}

}  // namespace
}  // namespace shardline

int main(int argc, char** argv) { return shardline::Main(argc, argv); }
