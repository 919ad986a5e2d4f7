// Checkpointer: creation, registration and the agreements (scheduler/checkpoint/checkpoint.h).
// The save is in checkpoint_save.cc, the load in checkpoint_load.cc.
//
// Every phase of a save or a load ends with one all-gather of the ranks' outcomes (Agree), so
// every rank issues the same collectives whatever failed where, nobody waits for a rank that
// gave up, and all ranks return the same outcome.

#include "scheduler/checkpoint/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runtime/logging.h"
#include "runtime/status.h"
#include "runtime/stream_ops.h"
#include "scheduler/checkpoint/agree.h"
#include "scheduler/checkpoint/internal/checkpoint_internal.h"
#include "scheduler/checkpoint/internal/kill_points.h"

namespace shardline {
namespace checkpoint_internal {

uint64_t Fnv1a(uint64_t h, absl::string_view bytes) {
  for (const char c : bytes) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return h;
}

std::string NormalizeDir(absl::string_view dir) {
  while (!dir.empty() && dir.back() == '/') dir.remove_suffix(1);
  return std::string(dir);
}

}  // namespace checkpoint_internal

using checkpoint_internal::Fnv1a;
using checkpoint_internal::KillPoint;
using checkpoint_internal::ParamCheckpointKillAt;
using checkpoint_internal::ParseKillPoint;

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
  const auto copy = host_copies_.find({unit, k});
  if (copy != host_copies_.end()) return const_cast<uint8_t*>(copy->second.data());
  return StateMemory(unit, k);
}

void* Checkpointer::StateMemory(int unit, size_t k) const {
  if (k == 0) return scheduler_.unit(unit).master_shard().data;
  for (const CheckpointState& s : states_) {
    if (s.unit == unit && --k == 0) return s.data;
  }
  return nullptr;
}

Device Checkpointer::StateDevice(int unit, size_t k) const {
  if (k == 0) return scheduler_.unit(unit).master_device();
  for (const CheckpointState& s : states_) {
    if (s.unit == unit && --k == 0) return s.device;
  }
  return Device::Host();
}

absl::Status Checkpointer::StageDeviceStates(bool copy_out, absl::Time deadline) {
  host_copies_.clear();
  std::map<std::string, std::unique_ptr<Stream>> streams;  // one per device, for the copies
  const std::vector<CheckpointUnitContents> contents = Contents();
  for (size_t u = 0; u < contents.size(); ++u) {
    const size_t elements = contents[u].layout.shard_elements();
    for (size_t k = 0; k < contents[u].states.size(); ++k) {
      const int unit = static_cast<int>(u);
      const Device device = StateDevice(unit, k);
      if (device.is_host()) continue;
      const size_t bytes = elements * DTypeSize(contents[u].states[k].dtype);
      std::vector<uint8_t>& copy = host_copies_[{unit, k}];
      copy.resize(bytes);
      if (!copy_out || bytes == 0) continue;
      std::unique_ptr<Stream>& stream = streams[device.ToString()];
      if (stream == nullptr) {
        SL_ASSIGN_OR_RETURN(stream, CreateStream(device, {.name = "checkpoint staging"}));
      }
      SL_RETURN_IF_ERROR(Annotate(
          EnqueueCopy(*stream, copy.data(), StateMemory(unit, k), bytes),
          absl::StrCat("copying state '", contents[u].states[k].name, "' of unit '",
                       contents[u].name, "' from ", device.ToString(), " to host memory")));
    }
  }
  for (auto& [device, stream] : streams) SL_RETURN_IF_ERROR(stream->Synchronize(deadline));
  return absl::OkStatus();
}

absl::Status Checkpointer::UnstageDeviceStates(absl::Time deadline) {
  std::map<std::string, std::unique_ptr<Stream>> streams;
  for (const auto& [key, copy] : host_copies_) {
    if (copy.empty()) continue;
    const Device device = StateDevice(key.first, key.second);
    std::unique_ptr<Stream>& stream = streams[device.ToString()];
    if (stream == nullptr) {
      SL_ASSIGN_OR_RETURN(stream, CreateStream(device, {.name = "checkpoint staging"}));
    }
    SL_RETURN_IF_ERROR(
        EnqueueCopy(*stream, StateMemory(key.first, key.second), copy.data(), copy.size()));
  }
  for (auto& [device, stream] : streams) SL_RETURN_IF_ERROR(stream->Synchronize(deadline));
  host_copies_.clear();
  return absl::OkStatus();
}

bool Checkpointer::StateStable(int unit, size_t k) const {
  if (k == 0) return false;  // the master shard changes with the next step
  for (const CheckpointState& s : states_) {
    if (s.unit == unit && --k == 0) return s.stable;
  }
  return false;
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
  }
  // The optimizer's writes to the shards are ordered on the compute stream; a load also must not
  // overwrite a master shard that a gather still reads.
  SL_RETURN_IF_ERROR(Annotate(scheduler_.compute_stream().Synchronize(deadline), what));
  if (for_load)
    SL_RETURN_IF_ERROR(Annotate(scheduler_.gather_stream().Synchronize(deadline), what));
  return Annotate(StageDeviceStates(/*copy_out=*/!for_load, deadline), what);
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

}  // namespace shardline
