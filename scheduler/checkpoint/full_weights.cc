// Full-weight export and import as safetensors (scheduler/checkpoint/full_weights.h).
//
// Both run in two phases, each ended by one exchange of outcomes over a Dup of the world
// (AgreeOnOutcome): checks (and, for an export, the temporary file with its header), then the
// data. So every rank issues the same collectives whatever failed where.

#include "scheduler/checkpoint/full_weights.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runtime/allocator.h"
#include "runtime/host_kernels.h"
#include "runtime/status.h"
#include "runtime/stream_ops.h"
#include "scheduler/checkpoint/agree.h"
#include "scheduler/checkpoint/internal/checkpoint_internal.h"
#include "scheduler/checkpoint/internal/device_staging.h"

namespace shardline {
namespace {

using checkpoint_internal::Fnv1a;

uint64_t Fnv1a(uint64_t h, uint64_t v) {
  char buf[8];
  for (int i = 0; i < 8; ++i) buf[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return Fnv1a(h, absl::string_view(buf, 8));
}

// The units as every rank must see them: names, layouts and master dtypes.
uint64_t UnitsFingerprint(const Scheduler& scheduler) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (int u = 0; u < scheduler.num_units(); ++u) {
    const FlatParameter& unit = scheduler.unit(u);
    h = Fnv1a(h, unit.name());
    h = Fnv1a(h, unit.layout().Fingerprint());
    h = Fnv1a(h, static_cast<uint64_t>(unit.policy().master_dtype));
  }
  return h;
}

constexpr absl::string_view kUnitsMismatch =
    "has other units than rank 0 (every rank registers the same units in the same order)";

std::string ShapeText(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Every unit sharded; the compute stream's writes of the shards (the optimizer's) done, and for
// an import the gather stream's reads too.
absl::Status PrepareUnits(Scheduler& scheduler, bool for_import, absl::Time deadline) {
  for (int u = 0; u < scheduler.num_units(); ++u) {
    const FlatParameter& unit = scheduler.unit(u);
    if (unit.state() != FlatParameterState::kSharded) {
      return absl::FailedPreconditionError(
          absl::StrCat("unit '", unit.name(), "' is ", FlatParameterStateName(unit.state()),
                       " (export and import between steps, when every unit is sharded)"));
    }
  }
  SL_RETURN_IF_ERROR(scheduler.compute_stream().Synchronize(deadline));
  if (for_import) SL_RETURN_IF_ERROR(scheduler.gather_stream().Synchronize(deadline));
  return absl::OkStatus();
}

// The communicators of one call: a Dup of the world (the exchanges) and of the shard group (the
// export's gathers), and a caller stream.
struct Comms {
  std::shared_ptr<Communicator> world;
  std::shared_ptr<Communicator> shard;
  std::unique_ptr<Stream> stream;
  // A world of device memory (a scheduler on a GPU): the export's gathers run on a stream of the
  // device into its memory, and are copied to host memory from there.
  std::unique_ptr<Stream> device_stream;
  std::unique_ptr<Allocator> device_memory;
};

absl::StatusOr<Comms> MakeComms(Scheduler& scheduler, bool with_shard, absl::Time deadline) {
  Comms c;
  SL_ASSIGN_OR_RETURN(c.world, scheduler.mesh().world()->Dup(deadline));
  if (with_shard) {
    SL_ASSIGN_OR_RETURN(c.shard, scheduler.mesh().shard()->Dup(deadline));
  }
  SL_ASSIGN_OR_RETURN(c.stream, CreateCallerStream({.name = "full_weights"}));
  const Device device = c.world->device();
  if (with_shard && !device.is_host()) {
    SL_ASSIGN_OR_RETURN(c.device_stream, CreateStream(device, {.name = "full_weights"}));
    SL_ASSIGN_OR_RETURN(c.device_memory,
                        CreateCudaAllocator(device.index(), "full_weights gathers"));
  }
  return c;
}

std::string NamesList(const std::vector<std::string>& names) {
  constexpr size_t kShown = 20;
  std::vector<std::string> quoted;
  for (size_t i = 0; i < names.size() && i < kShown; ++i) {
    quoted.push_back(absl::StrCat("'", names[i], "'"));
  }
  std::string out = absl::StrJoin(quoted, ", ");
  if (names.size() > kShown) absl::StrAppend(&out, " and ", names.size() - kShown, " more");
  return out;
}

bool CastAllowed(DType from, DType to) {
  return from == to || (IsFloatingPoint(from) && IsFloatingPoint(to));
}

}  // namespace

absl::StatusOr<FullWeightFilePlan> PlanFullWeightFile(
    const std::vector<FullWeightUnit>& units,
    const std::vector<std::pair<std::string, std::string>>& extra) {
  std::vector<SafetensorsTensorInfo> tensors;
  std::vector<std::pair<std::string, std::string>> metadata = {{"format", "pt"}};
  absl::flat_hash_map<std::string, size_t> owner;  // tensor name -> unit index
  for (size_t u = 0; u < units.size(); ++u) {
    const FlatLayout& layout = *units[u].layout;
    for (const FlatTensor& t : layout.tensors()) {
      auto [it, inserted] = owner.emplace(t.spec.name, u);
      if (!inserted) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor name '", t.spec.name, "' is used by unit '",
                         units[it->second].name, "' and by unit '", units[u].name,
                         "' (a full-weight file names tensors as registered: they must be unique "
                         "across units)"));
      }
      if (t.is_tie()) {
        metadata.emplace_back(absl::StrCat(kSafetensorsTiePrefix, t.spec.name),
                              layout.tensor(t.storage).spec.name);
        continue;
      }
      tensors.push_back({.name = t.spec.name,
                         .dtype = ToSafetensorsDType(units[u].dtype),
                         .shape = t.spec.shape});
    }
  }
  for (const auto& [key, value] : extra) {
    for (const auto& [ours, unused] : metadata) {
      if (key == ours) {
        return absl::InvalidArgumentError(
            absl::StrCat("metadata key '", key, "' is one shardline writes itself"));
      }
    }
  }
  metadata.insert(metadata.end(), extra.begin(), extra.end());
  return FullWeightFilePlan{.tensors = std::move(tensors), .metadata = std::move(metadata)};
}

absl::Status AppendCast(SafetensorsWriter& writer, const void* src, DType src_dtype,
                        DType dst_dtype, size_t count, size_t chunk_bytes,
                        std::vector<char>* staging) {
  if (src_dtype == dst_dtype) return writer.Append(src, count * DTypeSize(src_dtype));
  const size_t per = std::max<size_t>(1, chunk_bytes / DTypeSize(dst_dtype));
  const char* p = static_cast<const char*>(src);
  for (size_t done = 0; done < count;) {
    const size_t n = std::min(per, count - done);
    staging->resize(n * DTypeSize(dst_dtype));
    SL_RETURN_IF_ERROR(
        Cast(p + done * DTypeSize(src_dtype), src_dtype, staging->data(), dst_dtype, n));
    SL_RETURN_IF_ERROR(writer.Append(staging->data(), staging->size()));
    done += n;
  }
  return absl::OkStatus();
}

// ---- Export ----------------------------------------------------------------------------------

absl::Status ExportSafetensors(Scheduler& scheduler, absl::string_view path_arg,
                               const SafetensorsExportOptions& options, absl::Time deadline) {
  const std::string path(path_arg);
  const std::string what = absl::StrCat("safetensors export '", path, "'");
  SL_ASSIGN_OR_RETURN(Comms comms, MakeComms(scheduler, /*with_shard=*/true, deadline));
  const ProcessMesh& mesh = scheduler.mesh();
  const int rank = comms.world->rank();
  FileSystem& fs = options.file_system != nullptr ? *options.file_system : PosixFileSystem();

  // Phase 1: checks on every rank; the writer creates the temporary file and writes the header.
  absl::Status local;
  if (options.writer_rank < 0 || options.writer_rank >= comms.world->size()) {
    local = absl::InvalidArgumentError(absl::StrCat("writer_rank ", options.writer_rank,
                                                    " is not a rank of the world of ",
                                                    comms.world->size()));
  } else if (options.cast_chunk_bytes == 0) {
    local = absl::InvalidArgumentError("cast_chunk_bytes is 0");
  } else if (options.dtype.has_value() &&
             static_cast<size_t>(*options.dtype) >= kAllDTypes.size()) {
    local = absl::InvalidArgumentError("invalid dtype");
  }
  std::vector<FullWeightUnit> units;
  if (local.ok()) {
    for (int u = 0; u < scheduler.num_units() && local.ok(); ++u) {
      const FlatParameter& unit = scheduler.unit(u);
      const DType master = unit.policy().master_dtype;
      const DType dtype = options.dtype.value_or(master);
      if (!CastAllowed(master, dtype)) {
        local = absl::InvalidArgumentError(absl::StrCat(
            "unit '", unit.name(), "': its master dtype ", DTypeName(master),
            " cannot be exported as ", DTypeName(dtype), " (casts are between floating dtypes)"));
      }
      units.push_back({.name = unit.name(), .layout = &unit.layout(), .dtype = dtype});
    }
  }
  if (local.ok()) local = PrepareUnits(scheduler, /*for_import=*/false, deadline);
  std::unique_ptr<SafetensorsWriter> writer;
  if (local.ok()) {
    auto plan = PlanFullWeightFile(units, options.metadata);
    if (!plan.ok()) {
      local = plan.status();
    } else if (rank == options.writer_rank) {
      absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w =
          SafetensorsWriter::Create(fs, path, plan->tensors, plan->metadata);
      if (w.ok()) {
        writer = *std::move(w);
      } else {
        local = w.status();
      }
    }
  }
  uint64_t fingerprint = UnitsFingerprint(scheduler);
  fingerprint = Fnv1a(fingerprint, static_cast<uint64_t>(options.writer_rank));
  fingerprint =
      Fnv1a(fingerprint, options.dtype.has_value() ? 1 + static_cast<int>(*options.dtype) : 0);
  SL_RETURN_IF_ERROR(AgreeOnOutcome(*comms.world, *comms.stream, Annotate(local, what), what,
                                    fingerprint, kUnitsMismatch, "", 0, nullptr, deadline));

  // Phase 2: the writer's replicate group gathers one unit at a time; the writer appends it.
  const int writer_row = options.writer_rank / mesh.shard_size();
  absl::Status written;
  if (mesh.replicate_rank() == writer_row) {
    std::vector<char> staging;
    // Issues unit u's all-gather into a buffer of its own. An error aborts the group's
    // communicator, so that its other members, which wait in this gather, fail now (with this
    // error) and not at the deadline.
    // On a device world the gather lands in device memory and is copied into `full` on the
    // device stream; `copied` is then the event after that copy.
    auto issue = [&](int u, std::unique_ptr<char[]>& full, Work& work,
                     std::shared_ptr<Event>& copied) -> absl::Status {
      const FlatParameter& unit = scheduler.unit(u);
      const size_t bytes = std::max<size_t>(1, unit.layout().total_bytes());
      full.reset(new (std::nothrow) char[bytes]);
      if (full == nullptr) {
        absl::Status status = absl::ResourceExhaustedError(absl::StrCat(
            "cannot allocate the ", bytes, " bytes of unit '", unit.name(), "' gathered whole"));
        comms.shard->Abort(status);
        return status;
      }
      CollectiveOptions gather_options;
      gather_options.timeout = std::max(deadline - absl::Now(), absl::Milliseconds(1));
      gather_options.tag = unit.name();
      const std::string context = absl::StrCat("gathering unit '", unit.name(), "'");
      if (comms.device_stream == nullptr) {
        absl::StatusOr<Work> issued = comms.shard->AllGather(
            unit.master_shard().data, full.get(), unit.layout().shard_bytes(), DType::kU8,
            *comms.stream, gather_options);
        if (!issued.ok()) return Annotate(issued.status(), context);
        work = *std::move(issued);
        return absl::OkStatus();
      }
      Stream& stream = *comms.device_stream;
      absl::StatusOr<Buffer> on_device = comms.device_memory->Allocate(bytes, stream);
      if (!on_device.ok()) {
        comms.shard->Abort(on_device.status());
        return Annotate(on_device.status(), context);
      }
      absl::StatusOr<Work> issued =
          comms.shard->AllGather(unit.master_shard().data, on_device->data(),
                                 unit.layout().shard_bytes(), DType::kU8, stream, gather_options);
      if (!issued.ok()) return Annotate(issued.status(), context);
      work = *std::move(issued);
      absl::Status status =
          EnqueueCopy(stream, full.get(), on_device->data(), unit.layout().total_bytes());
      absl::StatusOr<std::shared_ptr<Event>> done =
          status.ok() ? RecordEvent(stream) : absl::StatusOr<std::shared_ptr<Event>>(status);
      if (!done.ok()) {
        on_device->Leak();  // the gather may still write it
        comms.shard->Abort(done.status());
        return Annotate(done.status(), context);
      }
      on_device->ReleaseAfter(*done);
      copied = *std::move(done);
      return absl::OkStatus();
    };
    // The next unit's gather runs on the communication stream while the writer appends this
    // one: two units' buffers at a time, each freed once written.
    std::unique_ptr<char[]> full, next_full;
    Work work, next_work;
    std::shared_ptr<Event> copied, next_copied;
    absl::Status failed =
        scheduler.num_units() > 0 ? issue(0, full, work, copied) : absl::OkStatus();
    for (int u = 0; u < scheduler.num_units() && failed.ok(); ++u) {
      const FlatParameter& unit = scheduler.unit(u);
      absl::Status gathered = work.Wait(deadline);
      if (gathered.ok() && copied != nullptr) gathered = copied->Synchronize(deadline);
      if (!gathered.ok()) {
        // The communicator is aborted for the whole group: every member stops here. Where a
        // peer aborted it (it could not allocate this unit, say), its reason is the error.
        const absl::Status cause = comms.shard->status();
        failed = Annotate(cause.ok() ? gathered : cause,
                          absl::StrCat("gathering unit '", unit.name(), "'"));
        break;
      }
      if (u + 1 < scheduler.num_units()) {
        failed = issue(u + 1, next_full, next_work, next_copied);
      }
      if (writer != nullptr && written.ok() && failed.ok()) {
        const FlatLayout& layout = unit.layout();
        const DType master = unit.policy().master_dtype;
        const size_t size = DTypeSize(master);
        for (const FlatTensor& t : layout.tensors()) {
          if (t.is_tie() || t.numel == 0) continue;
          written = AppendCast(*writer, full.get() + t.offset * size, master, units[u].dtype,
                               t.numel, options.cast_chunk_bytes, &staging);
          if (!written.ok()) {
            written = Annotate(written,
                               absl::StrCat("unit '", unit.name(), "' tensor '", t.spec.name, "'"));
            break;
          }
        }
      }
      full = std::move(next_full);
      work = std::move(next_work);
      copied = std::move(next_copied);
    }
    // A failed gather stops every member of the group; a failed write only the writer's writes
    // (it keeps gathering with the others).
    if (!failed.ok()) written = failed;
    if (writer != nullptr && written.ok()) written = writer->Finish();
  }
  return AgreeOnOutcome(*comms.world, *comms.stream, Annotate(written, what), what, 0, "", "", 0,
                        nullptr, deadline);
}

// ---- Import ----------------------------------------------------------------------------------

namespace {

// One tensor of a unit and the file's entry for it.
struct ImportTask {
  int unit = 0;
  int tensor = 0;  // a storage-owning tensor of the unit
  const SafetensorsTensor* entry = nullptr;
  DType file_dtype = DType::kF32;
};

// Checks the file's header against the units; fills `tasks` (one per storage-owning tensor with
// elements). Ties present in the file are compared over this rank's range.
absl::Status PlanImport(Scheduler& scheduler, const SafetensorsFile& file,
                        const SafetensorsImportOptions& options, std::vector<ImportTask>* tasks) {
  const SafetensorsHeader& header = file.header();
  const int shard = scheduler.mesh().shard_rank();
  std::vector<std::string> missing;
  absl::flat_hash_map<std::string, int> known;  // every tensor name of every unit
  for (int u = 0; u < scheduler.num_units(); ++u) {
    const FlatParameter& unit = scheduler.unit(u);
    const FlatLayout& layout = unit.layout();
    const DType master = unit.policy().master_dtype;
    for (int ti = 0; ti < layout.num_tensors(); ++ti) {
      const FlatTensor& t = layout.tensor(ti);
      const std::string where =
          absl::StrCat("tensor '", t.spec.name, "' (unit '", unit.name(), "')");
      auto [it, inserted] = known.emplace(t.spec.name, u);
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor name '", t.spec.name, "' is used by unit '", scheduler.unit(it->second).name(),
            "' and by unit '", unit.name(), "' (names must be unique across units)"));
      }
      const SafetensorsTensor* entry = header.Find(t.spec.name);
      if (entry == nullptr) {
        if (!t.is_tie()) missing.push_back(t.spec.name);
        continue;
      }
      if (std::vector<int64_t>(entry->shape) != t.spec.shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": the file has shape ", ShapeText(entry->shape), " ",
            SafetensorsDTypeName(entry->dtype), ", the unit ", ShapeText(t.spec.shape)));
      }
      const std::optional<DType> dtype = FromSafetensorsDType(entry->dtype);
      if (!dtype.has_value() || !CastAllowed(*dtype, master)) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": the file's dtype ", SafetensorsDTypeName(entry->dtype),
            " cannot be loaded into the master dtype ", DTypeName(master),
            " (a floating master takes F64, F32, F16 or BF16; an integer one its own dtype)"));
      }
      if (t.is_tie()) continue;  // compared below, once the targets are known
      if (t.numel > 0)
        tasks->push_back({.unit = u, .tensor = ti, .entry = entry, .file_dtype = *dtype});
    }
  }
  if (!missing.empty()) {
    return absl::NotFoundError(absl::StrCat("the file has no tensor ", NamesList(missing), " (",
                                            header.tensors.size(), " tensors in the file)"));
  }
  if (!options.ignore_unknown_tensors) {
    std::vector<std::string> unknown;
    for (const SafetensorsTensor& t : header.tensors) {
      if (!known.contains(t.name)) unknown.push_back(t.name);
    }
    if (!unknown.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the file's tensors ", NamesList(unknown),
                       " belong to no unit (ignore_unknown_tensors skips them)"));
    }
  }
  // A tie present in the file must hold its target's values: compared over this rank's slices of
  // the target, after both are cast to the master dtype.
  std::vector<char> a, b;
  for (int u = 0; u < scheduler.num_units(); ++u) {
    const FlatParameter& unit = scheduler.unit(u);
    const FlatLayout& layout = unit.layout();
    const DType master = unit.policy().master_dtype;
    const size_t size = DTypeSize(master);
    for (const FlatTensor& t : layout.tensors()) {
      if (!t.is_tie()) continue;
      const SafetensorsTensor* tie = file.header().Find(t.spec.name);
      if (tie == nullptr) continue;
      const SafetensorsTensor* target = file.header().Find(layout.tensor(t.storage).spec.name);
      const DType tie_dtype = *FromSafetensorsDType(tie->dtype);
      const DType target_dtype = *FromSafetensorsDType(target->dtype);
      const std::optional<ShardSlice> slice = layout.Intersection(t.storage, shard);
      if (!slice.has_value()) continue;
      a.resize(slice->length * size);
      b.resize(slice->length * size);
      const absl::string_view tie_data = file.Data(*tie);
      const absl::string_view target_data = file.Data(*target);
      if (tie_dtype == master) {
        std::memcpy(a.data(), tie_data.data() + slice->tensor_offset * size, a.size());
      } else {
        SL_RETURN_IF_ERROR(Cast(tie_data.data() + slice->tensor_offset * DTypeSize(tie_dtype),
                                tie_dtype, a.data(), master, slice->length));
      }
      if (target_dtype == master) {
        std::memcpy(b.data(), target_data.data() + slice->tensor_offset * size, b.size());
      } else {
        SL_RETURN_IF_ERROR(Cast(target_data.data() + slice->tensor_offset * DTypeSize(target_dtype),
                                target_dtype, b.data(), master, slice->length));
      }
      for (size_t i = 0; i < slice->length; ++i) {
        if (std::memcmp(&a[i * size], &b[i * size], size) != 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "tensor '", t.spec.name, "' (unit '", unit.name(), "') is tied to '", target->name,
              "', but the file's values differ at element ", slice->tensor_offset + i));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ImportSafetensors(Scheduler& scheduler, absl::string_view path_arg,
                               const SafetensorsImportOptions& options, absl::Time deadline) {
  const std::string path(path_arg);
  const std::string what = absl::StrCat("safetensors import '", path, "'");
  SL_ASSIGN_OR_RETURN(Comms comms, MakeComms(scheduler, /*with_shard=*/false, deadline));
  const int shard = scheduler.mesh().shard_rank();

  // Phase 1: map the file and check it against the units (nothing written yet).
  absl::Status local = PrepareUnits(scheduler, /*for_import=*/true, deadline);
  std::unique_ptr<SafetensorsFile> file;
  std::vector<ImportTask> tasks;
  if (local.ok()) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> opened = SafetensorsFile::Open(path);
    if (opened.ok()) {
      file = *std::move(opened);
    } else {
      local = opened.status();
    }
  }
  if (local.ok()) local = PlanImport(scheduler, *file, options, &tasks);
  uint64_t fingerprint = UnitsFingerprint(scheduler);
  fingerprint = Fnv1a(fingerprint, options.ignore_unknown_tensors ? 1 : 0);
  SL_RETURN_IF_ERROR(AgreeOnOutcome(*comms.world, *comms.stream, Annotate(local, what), what,
                                    fingerprint, kUnitsMismatch, "", 0, nullptr, deadline));

  // Phase 2: every rank copies its ranges and zeroes its padding. A master shard on a device
  // is written through a host copy of it (one copy each way).
  std::vector<std::vector<char>> staged(scheduler.num_units());
  auto shard_data = [&](int u) -> char* {
    return staged[u].empty() ? static_cast<char*>(scheduler.unit(u).master_shard().data)
                             : staged[u].data();
  };
  for (int u = 0; u < scheduler.num_units() && local.ok(); ++u) {
    const FlatParameter& unit = scheduler.unit(u);
    const size_t bytes = unit.layout().shard_bytes();
    if (!unit.master_device().is_host() && bytes > 0) {
      staged[u].resize(bytes);
      local = CopyBlocking(unit.master_device(), staged[u].data(), unit.master_shard().data, bytes,
                           deadline);
    }
    unit.layout().ZeroShardPadding(shard, shard_data(u));
  }
  for (const ImportTask& task : tasks) {
    if (!local.ok()) break;
    const FlatParameter& unit = scheduler.unit(task.unit);
    const FlatLayout& layout = unit.layout();
    const DType master = unit.policy().master_dtype;
    const std::optional<ShardSlice> slice = layout.Intersection(task.tensor, shard);
    if (!slice.has_value()) continue;
    char* dst = shard_data(task.unit) + slice->shard_offset * DTypeSize(master);
    const char* src =
        file->Data(*task.entry).data() + slice->tensor_offset * DTypeSize(task.file_dtype);
    if (task.file_dtype == master) {
      std::memcpy(dst, src, slice->length * DTypeSize(master));
    } else {
      local = Annotate(Cast(src, task.file_dtype, dst, master, slice->length),
                       absl::StrCat(what, ": tensor '", task.entry->name, "'"));
      if (!local.ok()) break;
    }
  }
  for (int u = 0; u < scheduler.num_units() && local.ok(); ++u) {
    if (staged[u].empty()) continue;
    const FlatParameter& unit = scheduler.unit(u);
    local = CopyBlocking(unit.master_device(), unit.master_shard().data, staged[u].data(),
                         staged[u].size(), deadline);
  }
  return AgreeOnOutcome(*comms.world, *comms.stream, local, what, 0, "", "", 0, nullptr, deadline);
}

}  // namespace shardline
