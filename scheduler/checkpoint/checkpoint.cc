// Checkpointer: sharded save and resharding load (scheduler/checkpoint/checkpoint.h).
//
// Every phase of a save or a load ends with one all-gather of the ranks' outcomes (Agree), so
// every rank issues the same collectives whatever failed where, nobody waits for a rank that
// gave up, and all ranks return the same outcome.

#include "scheduler/checkpoint/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <random>
#include <system_error>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "runtime/config.h"
#include "runtime/logging.h"
#include "runtime/reshard_plan.h"
#include "runtime/status.h"
#include "scheduler/checkpoint/agree.h"
#include "scheduler/checkpoint/crc32c.h"

#ifndef SHARDLINE_LIBRARY_VERSION
#define SHARDLINE_LIBRARY_VERSION "unknown"
#endif

namespace shardline {
namespace {

constexpr size_t kNonceBytes = 16;

uint64_t Fnv1a(uint64_t h, absl::string_view bytes) {
  for (const char c : bytes) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return h;
}

// `dir` without trailing slashes ("ckpt/" -> "ckpt"); "" for "" or "/".
std::string NormalizeDir(absl::string_view dir) {
  while (!dir.empty() && dir.back() == '/') dir.remove_suffix(1);
  return std::string(dir);
}

std::string ParentDir(const std::string& dir) {
  const size_t slash = dir.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return dir.substr(0, slash);
}

std::string MakeNonce() {
  std::random_device device;
  uint64_t v = (static_cast<uint64_t>(device()) << 32) ^ device();
  v ^= static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  return absl::StrFormat("%016x", v);
}

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

// SHARDLINE_CHECKPOINT_KILL_AT: "" (none), "<k>" (every rank) or "<rank>:<k>".
struct KillPoint {
  int rank = -1;  // -1: every rank
  int64_t op = -1;
};

absl::StatusOr<KillPoint> ParseKillPoint(absl::string_view text) {
  KillPoint point;
  if (text.empty()) return point;
  std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  const auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is neither <operation index> nor <rank>:<operation index> (integers >= 0)"));
  };
  if (parts.size() > 2) return bad();
  if (parts.size() == 2 && (!absl::SimpleAtoi(parts[0], &point.rank) || point.rank < 0)) {
    return bad();
  }
  if (!absl::SimpleAtoi(parts.back(), &point.op) || point.op < 0) return bad();
  return point;
}

SL_PARAM(std::string, CheckpointKillAt, "CHECKPOINT_KILL_AT", "",
         "Test hook for crash tests: \"<k>\" or \"<rank>:<k>\" makes every Checkpointer of this "
         "process (of world rank <rank> only, if given) raise SIGKILL right before its k-th "
         "(0-based) mutating file operation (create_dir, create_file, append, sync, close, "
         "rename, sync_dir, counted as RecordingFileSystem counts them from the Checkpointer's "
         "creation), in Save and in SaveAsync's background writer alike.",
         [](const std::string& v) { return ParseKillPoint(v).status(); });

// Calls fn(unit index, state index, piece, dtype size) for every piece of shard `shard`, in file
// order.
template <typename Fn>
void ForEachPieceOfShard(const CheckpointManifest& manifest, int shard, Fn fn) {
  for (size_t u = 0; u < manifest.units.size(); ++u) {
    const CheckpointUnitRecord& unit = manifest.units[u];
    // The pieces of a shard are contiguous: they follow the layout's slices.
    const absl::Span<const ShardSlice> mine = unit.layout.ShardSlices(shard);
    const size_t first = static_cast<size_t>(mine.data() - unit.layout.slices().data());
    for (size_t k = 0; k < unit.states.size(); ++k) {
      const CheckpointStateRecord& state = unit.states[k];
      const size_t size = DTypeSize(state.dtype);
      for (size_t i = first; i < first + mine.size(); ++i) fn(u, k, state.pieces[i], size);
    }
  }
}

}  // namespace

// ---- Save job ------------------------------------------------------------------------------

// One save between its agreement (BeginSave) and its end (FinishSave): everything FinishSave
// needs, so that a background thread reads nothing the caller's thread may change.
struct Checkpointer::SaveJob {
  std::string dir;
  std::string what;  // "checkpoint save '<dir>'"
  std::string tmp;
  CheckpointManifest manifest;
  uint64_t fingerprint = 0;
  bool writer = false;             // this rank writes a data file (replicate rank 0)
  const char* snapshot = nullptr;  // background: the data file's bytes; null: the shards
  uint64_t snapshot_bytes = 0;
  absl::Duration snapshot_time = absl::ZeroDuration();
  // Rank 0: the replicated states' bytes, back to back (copied at the call, so a background
  // save writes the values of that moment).
  std::string replicated;
  absl::Time deadline;
};

// ---- Load plan ---------------------------------------------------------------------------

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

Checkpointer::Checkpointer(Scheduler& scheduler, CheckpointOptions options,
                           std::shared_ptr<Communicator> world, std::unique_ptr<Stream> stream)
    : scheduler_(scheduler),
      options_(options),
      fs_(options.file_system != nullptr ? options.file_system : &PosixFileSystem()),
      world_(std::move(world)),
      stream_(std::move(stream)) {}

Checkpointer::~Checkpointer() {
  if (!background_.joinable()) return;
  const std::string dir = pending_->dir;
  // The background part's waits are bounded by its own deadline: this join is too.
  const absl::Status outcome = WaitForSave(absl::InfiniteFuture());
  if (!outcome.ok()) {
    SL_LOG(WARN, SCHED) << "Checkpointer destroyed with the outcome of the background save '" << dir
                        << "' not collected (WaitForSave): " << outcome;
  }
}

absl::StatusOr<std::unique_ptr<Checkpointer>> Checkpointer::Create(Scheduler& scheduler,
                                                                   CheckpointOptions options,
                                                                   absl::Time deadline) {
  if (options.checksum_block_bytes == 0) {
    return absl::InvalidArgumentError("Checkpointer: checksum_block_bytes is 0");
  }
  if (options.read_chunk_bytes == 0) {
    return absl::InvalidArgumentError("Checkpointer: read_chunk_bytes is 0");
  }
  SL_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> world, scheduler.mesh().world()->Dup(deadline));
  SL_ASSIGN_OR_RETURN(const std::string kill_text, ParamCheckpointKillAt().Get());
  SL_ASSIGN_OR_RETURN(const KillPoint kill, ParseKillPoint(kill_text));
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, CreateCallerStream({.name = "checkpoint"}));
  const int rank = world->rank();
  std::unique_ptr<Checkpointer> ckpt(
      new Checkpointer(scheduler, options, std::move(world), std::move(stream)));
  if (kill.op >= 0 && (kill.rank < 0 || kill.rank == rank)) {
    ckpt->killer_ = std::make_unique<RecordingFileSystem>(*ckpt->fs_);
    ckpt->killer_->KillAt(kill.op);
    ckpt->fs_ = ckpt->killer_.get();
  }
  return ckpt;
}

absl::Status Checkpointer::AddState(CheckpointState state) {
  const std::string what = absl::StrCat("Checkpointer::AddState('", state.name, "')");
  if (state.unit < 0 || state.unit >= scheduler_.num_units()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": unit ", state.unit, " is not one of the ", scheduler_.num_units(), " units"));
  }
  const FlatParameter& unit = scheduler_.unit(state.unit);
  if (!IsValidCheckpointStateName(state.name)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a state name is 1-128 characters of [A-Za-z0-9._-]"));
  }
  if (state.name == kMasterStateName) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": '", kMasterStateName, "' is the master shard's name"));
  }
  for (const CheckpointState& s : states_) {
    if (s.unit == state.unit && s.name == state.name) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": unit '", unit.name(), "' has a state of that name"));
    }
  }
  if (static_cast<size_t>(state.dtype) >= kAllDTypes.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": invalid dtype"));
  }
  if (state.data == nullptr && unit.layout().shard_elements() > 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": data is null for unit '", unit.name(),
                                                   "', whose shard has ",
                                                   unit.layout().shard_elements(), " elements"));
  }
  states_.push_back(std::move(state));
  return absl::OkStatus();
}

absl::Status Checkpointer::AddReplicatedState(CheckpointReplicatedState state) {
  const std::string what = absl::StrCat("Checkpointer::AddReplicatedState('", state.name, "')");
  if (!IsValidCheckpointStateName(state.name)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a state name is 1-128 characters of [A-Za-z0-9._-]"));
  }
  for (const CheckpointReplicatedState& s : replicated_) {
    if (s.name == state.name) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": a replicated state of that name exists"));
    }
  }
  if (static_cast<size_t>(state.dtype) >= kAllDTypes.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": invalid dtype"));
  }
  CheckpointManifest probe;
  SL_RETURN_IF_ERROR(
      Annotate(SetCheckpointReplicatedStates(
                   &probe, {{.name = state.name, .shape = state.shape, .dtype = state.dtype}}),
               what));
  if (state.data == nullptr && probe.replicated_bytes > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": data is null for ", probe.replicated_bytes, " bytes"));
  }
  replicated_.push_back(std::move(state));
  return absl::OkStatus();
}

std::vector<CheckpointUnitContents> Checkpointer::Contents() const {
  std::vector<CheckpointUnitContents> out;
  for (int u = 0; u < scheduler_.num_units(); ++u) {
    const FlatParameter& unit = scheduler_.unit(u);
    CheckpointUnitContents c{.name = unit.name(), .layout = unit.layout()};
    c.states.push_back({std::string(kMasterStateName), unit.policy().master_dtype});
    for (const CheckpointState& s : states_) {
      if (s.unit == u) c.states.push_back({s.name, s.dtype});
    }
    out.push_back(std::move(c));
  }
  return out;
}

void* Checkpointer::StateData(int unit, size_t k) const {
  if (k == 0) return scheduler_.unit(unit).master_shard().data;
  for (const CheckpointState& s : states_) {
    if (s.unit == unit && --k == 0) return s.data;
  }
  return nullptr;
}

uint64_t Checkpointer::RegistrationFingerprint() const {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const CheckpointUnitContents& unit : Contents()) {
    h = Fnv1a(h, unit.name);
    char buf[8];
    PutLittleEndian(buf, unit.layout.Fingerprint(), 8);
    h = Fnv1a(h, absl::string_view(buf, 8));
    for (const CheckpointUnitContents::State& s : unit.states) {
      h = Fnv1a(h, s.name);
      h = Fnv1a(h, DTypeName(s.dtype));
    }
  }
  for (const CheckpointReplicatedState& r : replicated_) {
    h = Fnv1a(h, "replicated");
    h = Fnv1a(h, r.name);
    h = Fnv1a(h, DTypeName(r.dtype));
    h = Fnv1a(h, absl::StrJoin(r.shape, ","));
  }
  return h;
}

absl::Status Checkpointer::PrepareUnits(absl::string_view what, bool for_load,
                                        absl::Time deadline) {
  for (int u = 0; u < scheduler_.num_units(); ++u) {
    const FlatParameter& unit = scheduler_.unit(u);
    if (unit.state() != FlatParameterState::kSharded) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": unit '", unit.name(), "' is ", FlatParameterStateName(unit.state()),
                       " (save and load between steps, when every unit is sharded)"));
    }
    if (!unit.master_device().is_host()) {
      return absl::UnimplementedError(absl::StrCat(
          what, ": unit '", unit.name(), "' has its master shard on ",
          unit.master_device().ToString(), " (checkpoints read and write host memory)"));
    }
  }
  // The optimizer's writes to the shards are ordered on the compute stream; a load also must not
  // overwrite a master shard that a gather still reads.
  SL_RETURN_IF_ERROR(Annotate(scheduler_.compute_stream().Synchronize(deadline), what));
  if (for_load)
    SL_RETURN_IF_ERROR(Annotate(scheduler_.gather_stream().Synchronize(deadline), what));
  return absl::OkStatus();
}

absl::Status Checkpointer::Agree(absl::Status mine, absl::string_view what, uint64_t fingerprint,
                                 const std::string& extra, size_t extra_bytes,
                                 std::vector<std::string>* all, absl::Time deadline) {
  return AgreeOnOutcome(*world_, *stream_, std::move(mine), what, fingerprint,
                        "has other units or checkpoint states than rank 0 (every rank registers "
                        "the same units and states in the same order)",
                        extra, extra_bytes, all, deadline);
}

absl::Status Checkpointer::AgreeOnDir(absl::Status mine, absl::string_view what,
                                      const std::string& dir, absl::Time deadline) {
  // Per rank: the path's hash (the comparison), then its length and up to kDirText bytes of it
  // (the message).
  constexpr size_t kDirText = 240;
  const size_t shown = std::min(dir.size(), kDirText);
  std::string extra(10 + kDirText, '\0');
  PutLittleEndian(&extra[0], Fnv1a(0xcbf29ce484222325ULL, dir), 8);
  PutLittleEndian(&extra[8], shown, 2);
  std::memcpy(&extra[10], dir.data(), shown);
  std::vector<std::string> all;
  SL_RETURN_IF_ERROR(Agree(std::move(mine), what, 0, extra, extra.size(), &all, deadline));
  auto path_of = [&](int r) {
    const std::string& e = all[r];
    const size_t length = std::min<size_t>(GetLittleEndian(&e[8], 2), kDirText);
    return absl::StrCat("'", e.substr(10, length), length == kDirText ? "...'" : "'");
  };
  for (int r = 1; r < static_cast<int>(all.size()); ++r) {
    if (GetLittleEndian(&all[r][0], 8) != GetLittleEndian(&all[0][0], 8)) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": the ranks passed different directories: rank 0 ", path_of(0),
                       ", rank ", r, " ", path_of(r), " (every rank must pass the same path)"));
    }
  }
  return absl::OkStatus();
}

// ---- Save --------------------------------------------------------------------------------

absl::Status Checkpointer::WriteShardFile(const std::string& tmp,
                                          const CheckpointManifest& manifest, const char* snapshot,
                                          std::vector<uint32_t>* crcs) {
  const int shard = scheduler_.mesh().shard_rank();
  const std::string path = absl::StrCat(tmp, "/", manifest.files[shard].name);
  SL_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, fs_->CreateFile(path));
  const uint64_t block = manifest.checksum_block_bytes;
  absl::Status status;
  // One append per piece, from the shards or the snapshot alike: the same file operations.
  ForEachPieceOfShard(
      manifest, shard, [&](size_t u, size_t k, const CheckpointPiece& piece, size_t size) {
        if (!status.ok()) return;
        const char* data = snapshot != nullptr
                               ? snapshot + piece.file_offset
                               : static_cast<const char*>(StateData(static_cast<int>(u), k)) +
                                     piece.shard_offset * size;
        for (uint64_t b = 0; b < piece.bytes; b += block) {
          crcs->push_back(Crc32c(data + b, std::min(block, piece.bytes - b)));
        }
        status = file->Append(data, piece.bytes);
      });
  SL_RETURN_IF_ERROR(status);
  SL_RETURN_IF_ERROR(file->Sync());
  return file->Close();
}

absl::Status Checkpointer::WriteReplicatedFile(const std::string& tmp, const std::string& bytes,
                                               CheckpointManifest* manifest) {
  const std::string path = absl::StrCat(tmp, "/", kCheckpointReplicatedFileName);
  SL_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, fs_->CreateFile(path));
  for (CheckpointReplicatedRecord& r : manifest->replicated) {
    r.crc32c = Crc32c(bytes.data() + r.file_offset, r.bytes);
  }
  SL_RETURN_IF_ERROR(file->Append(bytes.data(), bytes.size()));
  SL_RETURN_IF_ERROR(file->Sync());
  return file->Close();
}

absl::Status Checkpointer::Publish(const std::string& dir, const std::string& tmp,
                                   const CheckpointManifest& manifest) {
  const std::string json = CheckpointManifestToJson(manifest);
  const std::string path = absl::StrCat(tmp, "/", kCheckpointManifestName);
  SL_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, fs_->CreateFile(path));
  SL_RETURN_IF_ERROR(file->Append(json.data(), json.size()));
  SL_RETURN_IF_ERROR(file->Sync());
  SL_RETURN_IF_ERROR(file->Close());
  SL_RETURN_IF_ERROR(fs_->SyncDir(tmp));
  SL_RETURN_IF_ERROR(fs_->Rename(tmp, dir));
  return fs_->SyncDir(ParentDir(dir));
}

absl::Status Checkpointer::BeginSave(absl::string_view dir_arg, bool background,
                                     absl::Time deadline, SaveJob* job) {
  job->dir = NormalizeDir(dir_arg);
  job->what = absl::StrCat("checkpoint save '", job->dir, "'");
  job->deadline = deadline;
  const std::string& what = job->what;
  // Before anything else, and with the bad-directory check in it: a rank that returned here
  // alone would leave the others waiting in their first exchange until the deadline.
  SL_RETURN_IF_ERROR(AgreeOnDir(job->dir.empty()
                                    ? absl::InvalidArgumentError(absl::StrCat(
                                          "checkpoint save: bad directory '", dir_arg, "'"))
                                    : absl::OkStatus(),
                                what, job->dir, deadline));
  const ProcessMesh& mesh = scheduler_.mesh();
  const int rank = world_->rank();
  const int shard = mesh.shard_rank();
  job->writer = mesh.replicate_rank() == 0;

  // Every rank checks its units and computes the manifest (the same on every rank).
  absl::Status local = PrepareUnits(what, /*for_load=*/false, deadline);
  CheckpointManifest& manifest = job->manifest;
  if (local.ok()) {
    absl::StatusOr<CheckpointManifest> m =
        MakeCheckpointManifest(Contents(), mesh.replicate_size(), mesh.shard_size(),
                               options_.checksum_block_bytes, SHARDLINE_LIBRARY_VERSION);
    if (m.ok()) {
      manifest = *std::move(m);
    } else {
      local = Annotate(m.status(), what);
    }
  }
  if (local.ok()) {
    std::vector<CheckpointReplicatedRecord> records;
    for (const CheckpointReplicatedState& r : replicated_) {
      records.push_back({.name = r.name, .shape = r.shape, .dtype = r.dtype});
    }
    local = Annotate(SetCheckpointReplicatedStates(&manifest, std::move(records)), what);
  }
  if (local.ok() && rank == 0) {
    job->replicated.resize(manifest.replicated_bytes);
    for (size_t i = 0; i < replicated_.size(); ++i) {
      const CheckpointReplicatedRecord& r = manifest.replicated[i];
      if (r.bytes > 0) std::memcpy(&job->replicated[r.file_offset], replicated_[i].data, r.bytes);
    }
  }
  // A background save copies each writer's data file into host memory. Every rank checks every
  // shard's size against the cap, so that all fail alike before rank 0 creates anything.
  if (local.ok() && background && options_.max_snapshot_bytes > 0) {
    for (const CheckpointFileRecord& f : manifest.files) {
      if (f.bytes > options_.max_snapshot_bytes) {
        local = absl::ResourceExhaustedError(absl::StrCat(
            what, ": the snapshot of shard ", f.shard, " would take ", f.bytes,
            " bytes of host memory, more than max_snapshot_bytes (", options_.max_snapshot_bytes,
            "); raise the cap or use Save, which writes from the shards without a snapshot"));
        break;
      }
    }
  }
  if (local.ok() && background && job->writer) {
    const uint64_t bytes = manifest.files[shard].bytes;
    if (bytes > snapshot_capacity_) {
      snapshot_.reset();
      snapshot_capacity_ = 0;
      snapshot_.reset(new (std::nothrow) char[bytes]);
      if (snapshot_ == nullptr) {
        local = absl::ResourceExhaustedError(absl::StrCat(what, ": cannot allocate the snapshot's ",
                                                          bytes, " bytes of host memory"));
      } else {
        snapshot_capacity_ = bytes;
      }
    }
    if (local.ok()) {
      const absl::Time start = absl::Now();
      char* out = snapshot_.get();
      ForEachPieceOfShard(
          manifest, shard, [&](size_t u, size_t k, const CheckpointPiece& piece, size_t size) {
            std::memcpy(out + piece.file_offset,
                        static_cast<const char*>(StateData(static_cast<int>(u), k)) +
                            piece.shard_offset * size,
                        piece.bytes);
          });
      job->snapshot = out;
      job->snapshot_bytes = bytes;
      job->snapshot_time = absl::Now() - start;
    }
  }
  // Rank 0 creates the temporary directory and draws its name.
  std::string nonce;
  if (rank == 0 && local.ok()) {
    nonce = MakeNonce();
    absl::StatusOr<bool> exists = fs_->Exists(job->dir);
    if (!exists.ok()) {
      local = Annotate(exists.status(), what);
    } else if (*exists) {
      local = absl::AlreadyExistsError(
          absl::StrCat(what, ": '", job->dir,
                       "' exists (a save never replaces anything; choose a new directory)"));
    } else {
      local = Annotate(fs_->CreateDir(absl::StrCat(job->dir, ".tmp-", nonce)), what);
    }
  }
  std::vector<std::string> all;
  job->fingerprint = RegistrationFingerprint();
  // The fingerprint check comes first: the next exchange's size depends on the registrations.
  SL_RETURN_IF_ERROR(Agree(local, what, job->fingerprint, nonce, kNonceBytes, &all, deadline));
  job->tmp = absl::StrCat(job->dir, ".tmp-", all[0]);
  return absl::OkStatus();
}

absl::Status Checkpointer::FinishSave(SaveJob& job) {
  const std::string& what = job.what;
  CheckpointManifest& manifest = job.manifest;
  // Phase 2: the first replica group writes one file per shard.
  std::vector<uint32_t> crcs;
  absl::Status written;
  if (job.writer) {
    written = Annotate(WriteShardFile(job.tmp, manifest, job.snapshot, &crcs), what);
  }
  if (written.ok() && world_->rank() == 0 && !manifest.replicated.empty()) {
    written = Annotate(WriteReplicatedFile(job.tmp, job.replicated, &manifest), what);
  }
  std::vector<uint64_t> blocks(manifest.files.size(), 0);
  for (const CheckpointUnitRecord& unit : manifest.units) {
    for (const CheckpointStateRecord& state : unit.states) {
      for (const CheckpointPiece& piece : state.pieces) blocks[piece.shard] += piece.crc32c.size();
    }
  }
  const uint64_t max_blocks = *std::max_element(blocks.begin(), blocks.end());
  std::string extra(max_blocks * 4, '\0');
  for (size_t i = 0; i < crcs.size() && i < max_blocks; ++i)
    PutLittleEndian(&extra[4 * i], crcs[i], 4);
  std::vector<std::string> all;
  SL_RETURN_IF_ERROR(
      Agree(written, what, job.fingerprint, extra, extra.size(), &all, job.deadline));

  // Phase 3: rank 0 completes the manifest with every writer's checksums (shard s's writer is
  // world rank s: row 0, column s of the mesh) and publishes the checkpoint.
  absl::Status published;
  if (world_->rank() == 0) {
    // One pass in manifest order: each writer appended its checksums in that order.
    std::vector<size_t> next(manifest.files.size(), 0);
    for (CheckpointUnitRecord& unit : manifest.units) {
      for (CheckpointStateRecord& state : unit.states) {
        for (CheckpointPiece& piece : state.pieces) {
          const std::string& from = all[piece.shard];
          for (uint32_t& crc : piece.crc32c) {
            crc = static_cast<uint32_t>(GetLittleEndian(&from[4 * next[piece.shard]++], 4));
          }
        }
      }
    }
    published = Annotate(Publish(job.dir, job.tmp, manifest), what);
  }
  return Agree(published, what, 0, "", 0, nullptr, job.deadline);
}

absl::Status Checkpointer::SettlePending(absl::Time deadline) {
  if (!background_.joinable()) return absl::OkStatus();
  const std::string dir = pending_->dir;
  absl::Status outcome = WaitForSave(deadline);
  if (outcome.ok() || save_pending()) return outcome;  // still running: DeadlineExceeded
  return Annotate(outcome, absl::StrCat("the previous background save '", dir, "' failed"));
}

absl::Status Checkpointer::Save(absl::string_view dir, absl::Time deadline) {
  const absl::Time start = absl::Now();
  SL_RETURN_IF_ERROR(SettlePending(deadline));
  const absl::Duration waited = absl::Now() - start;
  SaveJob job;
  absl::Status status = BeginSave(dir, /*background=*/false, deadline, &job);
  if (status.ok()) status = FinishSave(job);
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = CheckpointSaveStats{.dir = job.dir,
                               .background = false,
                               .finished = true,
                               .snapshot_capacity_bytes = snapshot_capacity_,
                               .blocked = absl::Now() - start,
                               .waited = waited};
  return status;
}

absl::Status Checkpointer::SaveAsync(absl::string_view dir, absl::Time deadline) {
  const absl::Time start = absl::Now();
  SL_RETURN_IF_ERROR(SettlePending(deadline));
  const absl::Duration waited = absl::Now() - start;
  auto job = std::make_unique<SaveJob>();
  const absl::Status status = BeginSave(dir, /*background=*/true, deadline, job.get());
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_ = CheckpointSaveStats{.dir = job->dir,
                                 .background = true,
                                 .finished = !status.ok(),
                                 .snapshot_bytes = job->snapshot_bytes,
                                 .snapshot_capacity_bytes = snapshot_capacity_,
                                 .blocked = absl::Now() - start,
                                 .waited = waited,
                                 .snapshot = job->snapshot_time};
    done_ = false;
    outcome_ = absl::OkStatus();
  }
  SL_RETURN_IF_ERROR(status);
  pending_ = std::move(job);
  const auto finish = [this]() -> absl::Status {
    const absl::Time begin = absl::Now();
    absl::Status outcome = FinishSave(*pending_);
    std::lock_guard<std::mutex> lock(mu_);
    stats_.write = absl::Now() - begin;
    stats_.finished = true;
    return outcome;
  };
  try {
    background_ = std::thread([this, finish] {
      absl::Status outcome = finish();
      std::lock_guard<std::mutex> lock(mu_);
      outcome_ = std::move(outcome);
      done_ = true;
      done_cv_.notify_all();
    });
  } catch (const std::system_error&) {
    // No thread to be had: the save still completes (the other ranks' writers expect this
    // rank's exchanges), on this thread, and its outcome is returned now.
    absl::Status outcome = finish();
    pending_.reset();
    return outcome;
  }
  return absl::OkStatus();
}

absl::Status Checkpointer::WaitForSave(absl::Time deadline) {
  if (!background_.joinable()) return absl::OkStatus();
  {
    std::unique_lock<std::mutex> lock(mu_);
    // A finite horizon: the chrono conversion of an infinite deadline overflows.
    const absl::Time until = std::min(deadline, absl::Now() + absl::Hours(24 * 365));
    while (!done_) {
      if (done_cv_.wait_until(lock, absl::ToChronoTime(until)) == std::cv_status::timeout &&
          !done_ && absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat(pending_->what, ": the background save is still running at the deadline"));
      }
    }
  }
  background_.join();
  pending_.reset();
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(outcome_, absl::OkStatus());
}

bool Checkpointer::save_pending() const { return background_.joinable(); }

CheckpointSaveStats Checkpointer::last_save_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

// ---- Load --------------------------------------------------------------------------------

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
  return Agree(local, what, 0, "", 0, nullptr, deadline);
}

}  // namespace shardline
