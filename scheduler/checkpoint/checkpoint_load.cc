// Checkpointer's load (scheduler/checkpoint/checkpoint.h): PlanLoad checks the manifest against
// the units and plans every rank's reads with PlanReshard (runtime/reshard_plan.h); RunLoad
// reads, verifies each checksum block and copies into the shards and states.

#include "scheduler/checkpoint/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "runtime/crc32c.h"
#include "runtime/reshard_plan.h"
#include "runtime/status.h"
#include "scheduler/checkpoint/internal/checkpoint_internal.h"

namespace shardline {
namespace {

std::string ShapeString(const TensorSpec& spec) {
  return absl::StrCat("[", absl::StrJoin(spec.shape, ", "), "] ", DTypeName(spec.dtype),
                      spec.tied_to.empty() ? "" : absl::StrCat(" tied to '", spec.tied_to, "'"));
}

// OK if the checkpoint's tensors of a unit are the current unit's; else InvalidArgument naming
// the first tensor that differs and both descriptions.
absl::Status CompareTensors(absl::string_view unit, const std::vector<TensorSpec>& saved,
                            const std::vector<TensorSpec>& current) {
  const size_t n = std::min(saved.size(), current.size());
  for (size_t t = 0; t < n; ++t) {
    const TensorSpec& a = saved[t];
    const TensorSpec& b = current[t];
    if (a.name != b.name) {
      return absl::InvalidArgumentError(absl::StrCat("unit '", unit, "' tensor ", t,
                                                     ": the checkpoint has '", a.name,
                                                     "', the current unit '", b.name, "'"));
    }
    if (a.shape != b.shape || a.dtype != b.dtype || a.tied_to != b.tied_to) {
      return absl::InvalidArgumentError(absl::StrCat("unit '", unit, "' tensor '", a.name,
                                                     "': the checkpoint has shape ", ShapeString(a),
                                                     ", the current unit ", ShapeString(b)));
    }
  }
  if (saved.size() != current.size()) {
    const bool more = saved.size() > current.size();
    return absl::InvalidArgumentError(absl::StrCat(
        "unit '", unit, "': the checkpoint has ", saved.size(), " tensors, the current unit ",
        current.size(), "; tensor '", (more ? saved : current)[n].name, "' is only in ",
        more ? "the checkpoint" : "the current unit"));
  }
  return absl::OkStatus();
}

}  // namespace

using checkpoint_internal::NormalizeDir;

struct Checkpointer::LoadPlan {
  // One contiguous byte range [begin, end) of one piece, copied to `dst`.
  struct Task {
    const CheckpointUnitRecord* unit;
    const CheckpointStateRecord* state;
    const CheckpointPiece* piece;
    uint64_t begin = 0;
    uint64_t end = 0;
    char* dst = nullptr;
  };
  // A destination shard whose padding a load zeroes.
  struct Padding {
    char* base;
    const FlatLayout* layout;
    size_t element_size;
  };
  CheckpointManifest manifest;
  std::vector<std::unique_ptr<ReadableFile>> files;  // by saved shard; null if not needed
  std::vector<Task> tasks;
  std::vector<Padding> padding;
  // Registered replicated states, read and verified by PlanLoad, copied by RunLoad.
  struct Replicated {
    void* dst;
    std::string bytes;
  };
  std::vector<Replicated> replicated;
};

absl::Status Checkpointer::PlanLoad(const std::string& dir, LoadPlan* plan) {
  // Errors from here on are prefixed with "checkpoint load '<dir>': " by Load.
  SL_ASSIGN_OR_RETURN(std::string text, ReadCheckpointManifestText(*fs_, dir));
  absl::StatusOr<CheckpointManifest> parsed = ParseCheckpointManifest(text);
  if (!parsed.ok()) return Annotate(parsed.status(), kCheckpointManifestName);
  CheckpointManifest& m = plan->manifest;
  m = *std::move(parsed);

  // The units, by name, against the scheduler's, before anything else: a model that changed is
  // the likeliest mismatch and deserves the clearest message.
  const int num_units = scheduler_.num_units();
  std::vector<int> record_of(num_units, -1);
  for (int u = 0; u < num_units; ++u) {
    const FlatParameter& unit = scheduler_.unit(u);
    for (size_t r = 0; r < m.units.size(); ++r) {
      if (m.units[r].name == unit.name()) record_of[u] = static_cast<int>(r);
    }
    if (record_of[u] < 0) {
      std::vector<std::string> names;
      for (const CheckpointUnitRecord& r : m.units) names.push_back(r.name);
      return absl::InvalidArgumentError(absl::StrCat("the checkpoint has no unit '", unit.name(),
                                                     "' (it has: ", absl::StrJoin(names, ", "),
                                                     ")"));
    }
    const CheckpointUnitRecord& record = m.units[record_of[u]];
    SL_RETURN_IF_ERROR(CompareTensors(unit.name(), record.tensors, unit.layout().specs()));
    if (record.options.element_dtype != unit.layout().element_dtype()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unit '", unit.name(), "': the checkpoint's master dtype is ",
          DTypeName(record.options.element_dtype), ", the unit's ",
          DTypeName(unit.layout().element_dtype()), " (a load copies bits, it does not cast)"));
    }
  }
  for (const CheckpointUnitRecord& record : m.units) {
    if (!scheduler_.FindUnit(record.name).has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the checkpoint's unit '", record.name, "' is not a unit of the scheduler"));
    }
  }
  SL_RETURN_IF_ERROR(Annotate(ValidateCheckpointManifest(m), kCheckpointManifestName));

  const int shard = scheduler_.mesh().shard_rank();
  plan->files.resize(m.files.size());
  for (int u = 0; u < num_units; ++u) {
    const FlatParameter& unit = scheduler_.unit(u);
    const FlatLayout& current = unit.layout();
    const CheckpointUnitRecord& record = m.units[record_of[u]];
    absl::StatusOr<ReshardPlan> reshard = PlanReshard(record.layout, current);
    if (!reshard.ok()) {
      return Annotate(reshard.status(),
                      absl::StrCat("unit '", unit.name(), "': incompatible layout"));
    }
    const absl::Span<const ReshardCopy> copies = reshard->ForDestination(shard);
    std::vector<std::pair<std::string, DType>> wanted = {
        {std::string(kMasterStateName), unit.policy().master_dtype}};
    for (const CheckpointState& s : states_) {
      if (s.unit == u) wanted.emplace_back(s.name, s.dtype);
    }
    for (size_t k = 0; k < wanted.size(); ++k) {
      const auto& [name, dtype] = wanted[k];
      const CheckpointStateRecord* state = nullptr;
      for (const CheckpointStateRecord& s : record.states) {
        if (s.name == name) state = &s;
      }
      if (state == nullptr) {
        std::vector<std::string> names;
        for (const CheckpointStateRecord& s : record.states) names.push_back(s.name);
        return absl::NotFoundError(
            absl::StrCat("unit '", unit.name(), "' has no state '", name,
                         "' in the checkpoint (it has: ", absl::StrJoin(names, ", "), ")"));
      }
      if (state->dtype != dtype) {
        return absl::InvalidArgumentError(
            absl::StrCat("unit '", unit.name(), "' state '", name, "': the checkpoint's dtype is ",
                         DTypeName(state->dtype), ", the registered one ", DTypeName(dtype),
                         " (a load copies bits, it does not cast)"));
      }
      const size_t size = DTypeSize(dtype);
      char* base = static_cast<char*>(StateData(u, k));
      plan->padding.push_back({base, &current, size});
      const absl::Span<const ShardSlice> all_slices = record.layout.slices();
      for (const ReshardCopy& copy : copies) {
        // The saved slices of the copy's source shard that intersect its range.
        const absl::Span<const ShardSlice> slices = record.layout.ShardSlices(copy.src_shard);
        const size_t first = static_cast<size_t>(slices.data() - all_slices.data());
        const size_t src_end = copy.src_offset + copy.length;
        auto it = std::upper_bound(
            slices.begin(), slices.end(), copy.src_offset,
            [](size_t offset, const ShardSlice& s) { return offset < s.shard_offset + s.length; });
        size_t covered = 0;
        for (; it != slices.end() && it->shard_offset < src_end; ++it) {
          const size_t lo = std::max<size_t>(copy.src_offset, it->shard_offset);
          const size_t hi = std::min<size_t>(src_end, it->shard_offset + it->length);
          const CheckpointPiece& piece = state->pieces[first + (it - slices.begin())];
          plan->tasks.push_back({.unit = &record,
                                 .state = state,
                                 .piece = &piece,
                                 .begin = (lo - it->shard_offset) * size,
                                 .end = (hi - it->shard_offset) * size,
                                 .dst = base + (copy.dst_offset + (lo - copy.src_offset)) * size});
          covered += hi - lo;
        }
        if (covered != copy.length) {
          return absl::InternalError(absl::StrCat(
              "unit '", unit.name(), "': reshard copy ", copy.length, " elements from shard ",
              copy.src_shard, " covers ", covered, " elements of saved pieces (a bug)"));
        }
      }
    }
  }

  // Open every data file this rank reads, checking its size against the manifest.
  for (const LoadPlan::Task& task : plan->tasks) {
    const int f = task.piece->file;
    if (plan->files[f] != nullptr) continue;
    const CheckpointFileRecord& record = m.files[f];
    const std::string needed =
        absl::StrCat("unit '", task.unit->name, "' state '", task.state->name, "' tensor '",
                     task.unit->tensors[task.piece->tensor].name, "'");
    absl::StatusOr<std::unique_ptr<ReadableFile>> file =
        fs_->OpenFile(absl::StrCat(dir, "/", record.name));
    if (!file.ok()) {
      if (absl::IsNotFound(file.status())) {
        return absl::NotFoundError(
            absl::StrCat("data file '", record.name, "' is missing (", needed, " is in it)"));
      }
      return Annotate(file.status(),
                      absl::StrCat("data file '", record.name, "' (", needed, " is in it)"));
    }
    const uint64_t size = (*file)->size();
    if (size != record.bytes) {
      // Name the first piece the actual size cuts (none when the file is longer).
      std::string victim;
      for (const CheckpointUnitRecord& unit : m.units) {
        for (const CheckpointStateRecord& state : unit.states) {
          for (const CheckpointPiece& piece : state.pieces) {
            if (piece.file != f || !victim.empty()) continue;
            if (size < record.bytes && piece.file_offset + piece.bytes > size) {
              victim =
                  absl::StrCat("; unit '", unit.name, "' state '", state.name, "' tensor '",
                               unit.tensors[piece.tensor].name, "' (bytes [", piece.file_offset,
                               ", ", piece.file_offset + piece.bytes, ")) lies beyond its end");
            }
          }
        }
      }
      return absl::DataLossError(absl::StrCat(
          "data file '", record.name, "' is ", size, " bytes, the manifest says ", record.bytes,
          size < record.bytes ? " (truncated)" : " (altered: bytes were added)", victim));
    }
    plan->files[f] = *std::move(file);
  }
  return PlanReplicatedLoad(dir, plan);
}

absl::Status Checkpointer::PlanReplicatedLoad(const std::string& dir, LoadPlan* plan) {
  if (replicated_.empty()) return absl::OkStatus();
  const CheckpointManifest& m = plan->manifest;
  const std::string file_name(kCheckpointReplicatedFileName);
  std::unique_ptr<ReadableFile> file;
  for (const CheckpointReplicatedState& state : replicated_) {
    const CheckpointReplicatedRecord* record = nullptr;
    for (const CheckpointReplicatedRecord& r : m.replicated) {
      if (r.name == state.name) record = &r;
    }
    if (record == nullptr) {
      std::vector<std::string> names;
      for (const CheckpointReplicatedRecord& r : m.replicated) names.push_back(r.name);
      return absl::NotFoundError(
          absl::StrCat("the checkpoint has no replicated state '", state.name,
                       "' (it has: ", names.empty() ? "none" : absl::StrJoin(names, ", "), ")"));
    }
    if (record->shape != state.shape || record->dtype != state.dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat("replicated state '", state.name, "': the checkpoint has [",
                       absl::StrJoin(record->shape, ", "), "] ", DTypeName(record->dtype),
                       ", the registered one [", absl::StrJoin(state.shape, ", "), "] ",
                       DTypeName(state.dtype), " (a load copies bits, it does not cast)"));
    }
    if (file == nullptr) {
      absl::StatusOr<std::unique_ptr<ReadableFile>> opened =
          fs_->OpenFile(absl::StrCat(dir, "/", file_name));
      if (!opened.ok()) {
        if (absl::IsNotFound(opened.status())) {
          return absl::NotFoundError(absl::StrCat("data file '", file_name,
                                                  "' is missing (replicated state '", state.name,
                                                  "' is in it)"));
        }
        return Annotate(opened.status(), absl::StrCat("data file '", file_name, "'"));
      }
      file = *std::move(opened);
      if (file->size() != m.replicated_bytes) {
        return absl::DataLossError(absl::StrCat(
            "data file '", file_name, "' is ", file->size(), " bytes, the manifest says ",
            m.replicated_bytes, file->size() < m.replicated_bytes ? " (truncated)" : " (altered)",
            "; replicated state '", state.name, "' is in it"));
      }
    }
    std::string bytes(record->bytes, '\0');
    SL_RETURN_IF_ERROR(file->ReadAt(record->file_offset, bytes.size(), bytes.data()));
    const uint32_t crc = Crc32c(bytes.data(), bytes.size());
    if (crc != record->crc32c) {
      return absl::DataLossError(absl::StrFormat(
          "data file '%s' bytes [%d, %d) have CRC-32C %08x, the manifest says %08x: replicated "
          "state '%s' is corrupt",
          file_name, record->file_offset, record->file_offset + record->bytes, crc, record->crc32c,
          state.name));
    }
    plan->replicated.push_back({state.data, std::move(bytes)});
  }
  return absl::OkStatus();
}

absl::Status Checkpointer::RunLoad(LoadPlan& plan) {
  for (const LoadPlan::Replicated& r : plan.replicated) {
    if (!r.bytes.empty()) std::memcpy(r.dst, r.bytes.data(), r.bytes.size());
  }
  const int shard = scheduler_.mesh().shard_rank();
  for (const LoadPlan::Padding& p : plan.padding) {
    const size_t begin = p.layout->ShardBegin(shard);
    for (const PaddingRange& r : p.layout->ShardPadding(shard)) {
      std::memset(p.base + (r.begin - begin) * p.element_size, 0,
                  (r.end - r.begin) * p.element_size);
    }
  }
  const uint64_t block = plan.manifest.checksum_block_bytes;
  const uint64_t chunk_blocks = std::max<uint64_t>(1, options_.read_chunk_bytes / block);
  std::vector<char> staging;
  for (const LoadPlan::Task& task : plan.tasks) {
    const CheckpointPiece& piece = *task.piece;
    const std::string& file_name = plan.manifest.files[piece.file].name;
    ReadableFile& file = *plan.files[piece.file];
    const uint64_t last = (task.end - 1) / block;
    char* dst = task.dst;
    for (uint64_t b = task.begin / block; b <= last;) {
      const uint64_t n = std::min(chunk_blocks, last - b + 1);
      const uint64_t lo = b * block;
      const uint64_t hi = std::min((b + n) * block, piece.bytes);
      staging.resize(hi - lo);
      SL_RETURN_IF_ERROR(file.ReadAt(piece.file_offset + lo, hi - lo, staging.data()));
      for (uint64_t i = 0; i < n; ++i) {
        const uint64_t bl = (b + i) * block;
        const uint64_t bh = std::min(bl + block, piece.bytes);
        const uint32_t crc = Crc32c(staging.data() + (bl - lo), bh - bl);
        if (crc != piece.crc32c[b + i]) {
          const uint64_t size = DTypeSize(task.state->dtype);
          return absl::DataLossError(absl::StrFormat(
              "data file '%s' bytes [%d, %d) have CRC-32C %08x, the manifest says %08x: unit "
              "'%s' state '%s' tensor '%s' elements [%d, %d) are corrupt (the shards are now "
              "partly loaded; load a good checkpoint)",
              file_name, piece.file_offset + bl, piece.file_offset + bh, crc, piece.crc32c[b + i],
              task.unit->name, task.state->name, task.unit->tensors[piece.tensor].name,
              piece.tensor_offset + bl / size, piece.tensor_offset + (bh + size - 1) / size));
        }
      }
      const uint64_t from = std::max(task.begin, lo);
      const uint64_t to = std::min(task.end, hi);
      std::memcpy(dst, staging.data() + (from - lo), to - from);
      dst += to - from;
      b += n;
    }
  }
  return absl::OkStatus();
}

absl::Status Checkpointer::Load(absl::string_view dir_arg, absl::Time deadline) {
  const std::string dir = NormalizeDir(dir_arg);
  const std::string what = absl::StrCat("checkpoint load '", dir, "'");
  SL_RETURN_IF_ERROR(SettlePending(deadline));
  SL_RETURN_IF_ERROR(AgreeOnDir(dir.empty() ? absl::InvalidArgumentError(absl::StrCat(
                                                  "checkpoint load: bad directory '", dir_arg, "'"))
                                            : absl::OkStatus(),
                                what, dir, deadline));
  LoadPlan plan;
  absl::Status local = PrepareUnits(what, /*for_load=*/true, deadline);
  if (local.ok()) local = Annotate(PlanLoad(dir, &plan), what);
  SL_RETURN_IF_ERROR(Agree(local, what, RegistrationFingerprint(), "", 0, nullptr, deadline));
  local = Annotate(RunLoad(plan), what);
  // States on devices were loaded into their host copies: one copy back each.
  if (local.ok()) local = Annotate(UnstageDeviceStates(deadline), what);
  return Agree(local, what, 0, "", 0, nullptr, deadline);
}

}  // namespace shardline
