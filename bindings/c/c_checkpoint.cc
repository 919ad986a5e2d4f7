// File: bindings/c/c_checkpoint.cc
// -----------------------------------------------------------------------------
// The C API's checkpoints and full weights: the Checkpointer (sharded save and load at any world
// size, in the background too), safetensors export and import of the full model, and
// sync_module_states (a root's values to every rank).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bindings/c/c_internal.h"
#include "bindings/c/shardline.h"
#include "runtime/dtype.h"
#include "scheduler/checkpoint/checkpoint.h"
#include "scheduler/checkpoint/full_weights.h"
#include "scheduler/scheduler.h"
#include "scheduler/sync_states.h"

// The first release's shardlineCheckpointConfig_t ended with read_chunk_bytes (see the scheduler
// config's static_assert for the rule).
static_assert(offsetof(shardlineCheckpointConfig_t, max_snapshot_bytes) >=
                  ((offsetof(shardlineCheckpointConfig_t, read_chunk_bytes) + sizeof(size_t) +
                    alignof(shardlineCheckpointConfig_t) - 1) /
                   alignof(shardlineCheckpointConfig_t) * alignof(shardlineCheckpointConfig_t)),
              "a field added to shardlineCheckpointConfig_t overlaps the first layout's padding");
// Each entry point checks its handles and arguments, then forwards to the C++ Checkpointer with
// the timeout turned into a deadline; a new collective (an asynchronous save, an export) follows
// the same shape: Guard, SL_C_REQUIRE on the arguments, FromStatus of the C++ call.

struct shardlineCheckpointer_s {
  shardlineScheduler_t scheduler;  // not owned: outlives the checkpointer
  std::unique_ptr<shardline::Checkpointer> checkpointer;
};

using shardline::DType;
using shardline::c_api::CheckUnit;
using shardline::c_api::FromStatus;
using shardline::c_api::Guard;
using shardline::c_api::ReadConfig;
using shardline::c_api::Timeout;
using shardline::c_api::ToDType;

extern "C" {

shardlineResult_t shardline_checkpointer_create(shardlineScheduler_t scheduler,
                                                const shardlineCheckpointConfig_t* config,
                                                double timeout_s,
                                                shardlineCheckpointer_t* checkpointer) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(scheduler != nullptr && checkpointer != nullptr,
                 "shardline_checkpointer_create: scheduler and checkpointer must not be NULL");
    shardlineCheckpointConfig_t c;
    const shardlineCheckpointConfig_t defaults = SHARDLINE_CHECKPOINT_CONFIG_INIT;
    if (shardlineResult_t r = ReadConfig(config, defaults, &c, "shardlineCheckpointConfig_t");
        r != shardlineSuccess) {
      return r;
    }
    shardline::CheckpointOptions o;
    o.checksum_block_bytes = c.checksum_block_bytes;
    o.read_chunk_bytes = c.read_chunk_bytes;
    o.max_snapshot_bytes = c.max_snapshot_bytes;
    absl::StatusOr<std::unique_ptr<shardline::Checkpointer>> created =
        shardline::Checkpointer::Create(*scheduler->scheduler, o, absl::Now() + Timeout(timeout_s));
    if (!created.ok()) return FromStatus(created.status());
    *checkpointer = new shardlineCheckpointer_s{scheduler, *std::move(created)};
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_checkpointer_add_state(shardlineCheckpointer_t checkpointer, int unit,
                                                   const char* name, void* data, size_t bytes,
                                                   shardlineDataType_t dtype) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr && name != nullptr,
                 "shardline_checkpointer_add_state: checkpointer and name must not be NULL");
    if (absl::Status s =
            CheckUnit(checkpointer->scheduler, unit, "shardline_checkpointer_add_state");
        !s.ok()) {
      return FromStatus(s);
    }
    DType d;
    SL_C_REQUIRE(ToDType(dtype, &d), absl::StrCat("shardline_checkpointer_add_state: state '", name,
                                                  "': unknown dtype ", static_cast<int>(dtype)));
    const shardline::FlatParameter& p = checkpointer->scheduler->scheduler->unit(unit);
    const size_t want = p.layout().shard_elements() * shardline::DTypeSize(d);
    SL_C_REQUIRE(
        bytes == want,
        absl::StrCat("shardline_checkpointer_add_state: state '", name, "' of unit '", p.name(),
                     "' is ", bytes, " bytes; the unit's shard of ", p.layout().shard_elements(),
                     " elements of ", shardline::DTypeName(d), " is ", want, " bytes"));
    return FromStatus(checkpointer->checkpointer->AddState(
        {.unit = unit, .name = name, .data = data, .dtype = d}));
  });
}

shardlineResult_t shardline_checkpointer_save(shardlineCheckpointer_t checkpointer, const char* dir,
                                              double timeout_s) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr && dir != nullptr,
                 "shardline_checkpointer_save: checkpointer and dir must not be NULL");
    return FromStatus(checkpointer->checkpointer->Save(dir, absl::Now() + Timeout(timeout_s)));
  });
}

shardlineResult_t shardline_checkpointer_load(shardlineCheckpointer_t checkpointer, const char* dir,
                                              double timeout_s) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr && dir != nullptr,
                 "shardline_checkpointer_load: checkpointer and dir must not be NULL");
    return FromStatus(checkpointer->checkpointer->Load(dir, absl::Now() + Timeout(timeout_s)));
  });
}

shardlineResult_t shardline_checkpointer_destroy(shardlineCheckpointer_t checkpointer) {
  return Guard([&] {
    delete checkpointer;
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_checkpointer_add_replicated_state(shardlineCheckpointer_t checkpointer,
                                                              const char* name, void* data,
                                                              const int64_t* shape, int ndim,
                                                              shardlineDataType_t dtype) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr && name != nullptr,
                 "shardline_checkpointer_add_replicated_state: checkpointer and name must not be "
                 "NULL");
    SL_C_REQUIRE(ndim >= 0 && (ndim == 0 || shape != nullptr),
                 absl::StrCat("shardline_checkpointer_add_replicated_state: state '", name,
                              "': ndim ", ndim, " with shape ", shape == nullptr ? "NULL" : "set",
                              " (ndim >= 0; shape may be NULL only for a scalar)"));
    DType d;
    SL_C_REQUIRE(ToDType(dtype, &d),
                 absl::StrCat("shardline_checkpointer_add_replicated_state: state '", name,
                              "': unknown dtype ", static_cast<int>(dtype)));
    std::vector<int64_t> dims(shape, shape + ndim);
    return FromStatus(checkpointer->checkpointer->AddReplicatedState(
        {.name = name, .shape = std::move(dims), .dtype = d, .data = data}));
  });
}

shardlineResult_t shardline_checkpointer_save_async(shardlineCheckpointer_t checkpointer,
                                                    const char* dir, double timeout_s) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr && dir != nullptr,
                 "shardline_checkpointer_save_async: checkpointer and dir must not be NULL");
    return FromStatus(checkpointer->checkpointer->SaveAsync(dir, absl::Now() + Timeout(timeout_s)));
  });
}

shardlineResult_t shardline_checkpointer_wait_for_save(shardlineCheckpointer_t checkpointer,
                                                       double timeout_s) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr,
                 "shardline_checkpointer_wait_for_save: checkpointer must not be NULL");
    return FromStatus(checkpointer->checkpointer->WaitForSave(absl::Now() + Timeout(timeout_s)));
  });
}

shardlineResult_t shardline_checkpointer_save_pending(shardlineCheckpointer_t checkpointer,
                                                      int* pending) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr && pending != nullptr,
                 "shardline_checkpointer_save_pending: checkpointer and pending must not be NULL");
    *pending = checkpointer->checkpointer->save_pending() ? 1 : 0;
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_checkpointer_last_save_stats(shardlineCheckpointer_t checkpointer,
                                                         shardlineCheckpointSaveStats_t* stats) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(checkpointer != nullptr && stats != nullptr,
                 "shardline_checkpointer_last_save_stats: checkpointer and stats must not be NULL");
    SL_C_REQUIRE(
        stats->struct_size >= offsetof(shardlineCheckpointSaveStats_t, version) + sizeof(int) &&
            stats->struct_size <= sizeof(shardlineCheckpointSaveStats_t),
        absl::StrCat("shardline_checkpointer_last_save_stats: "
                     "shardlineCheckpointSaveStats_t.struct_size is ",
                     stats->struct_size, "; this library knows sizes up to ",
                     sizeof(shardlineCheckpointSaveStats_t),
                     " (initialise it with SHARDLINE_CHECKPOINT_SAVE_STATS_INIT)"));
    const shardline::CheckpointSaveStats st = checkpointer->checkpointer->last_save_stats();
    shardlineCheckpointSaveStats_t out = SHARDLINE_CHECKPOINT_SAVE_STATS_INIT;
    out.background = st.background ? 1 : 0;
    out.finished = st.finished ? 1 : 0;
    out.snapshot_bytes = st.snapshot_bytes;
    out.snapshot_capacity_bytes = st.snapshot_capacity_bytes;
    out.blocked_s = absl::ToDoubleSeconds(st.blocked);
    out.waited_s = absl::ToDoubleSeconds(st.waited);
    out.snapshot_s = absl::ToDoubleSeconds(st.snapshot);
    out.write_s = absl::ToDoubleSeconds(st.write);
    const size_t size = stats->struct_size;
    std::memcpy(static_cast<void*>(stats), &out, size);
    stats->struct_size = size;
    return shardlineSuccess;
  });
}

// ---- Full weights and sync_module_states ------------------------------------------------------

shardlineResult_t shardline_export_safetensors(shardlineScheduler_t scheduler, const char* path,
                                               const shardlineSafetensorsExportConfig_t* config,
                                               double timeout_s) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(scheduler != nullptr && path != nullptr,
                 "shardline_export_safetensors: scheduler and path must not be NULL");
    shardlineSafetensorsExportConfig_t c;
    const shardlineSafetensorsExportConfig_t defaults = SHARDLINE_SAFETENSORS_EXPORT_CONFIG_INIT;
    if (shardlineResult_t r =
            ReadConfig(config, defaults, &c, "shardlineSafetensorsExportConfig_t");
        r != shardlineSuccess) {
      return r;
    }
    shardline::SafetensorsExportOptions o;
    o.writer_rank = c.writer_rank;
    o.cast_chunk_bytes = c.cast_chunk_bytes;
    SL_C_REQUIRE(c.cast == 0 || c.cast == 1,
                 absl::StrCat("shardline_export_safetensors: cast is ", c.cast, " (0 or 1)"));
    if (c.cast == 1) {
      DType d;
      SL_C_REQUIRE(ToDType(c.dtype, &d), absl::StrCat("shardline_export_safetensors: unknown "
                                                      "dtype ",
                                                      static_cast<int>(c.dtype)));
      o.dtype = d;
    }
    SL_C_REQUIRE(c.num_metadata >= 0 && (c.num_metadata == 0 || (c.metadata_keys != nullptr &&
                                                                 c.metadata_values != nullptr)),
                 absl::StrCat("shardline_export_safetensors: num_metadata is ", c.num_metadata,
                              " with metadata_keys or metadata_values NULL"));
    for (int i = 0; i < c.num_metadata; ++i) {
      SL_C_REQUIRE(c.metadata_keys[i] != nullptr && c.metadata_values[i] != nullptr,
                   absl::StrCat("shardline_export_safetensors: metadata entry ", i, " is NULL"));
      o.metadata.emplace_back(c.metadata_keys[i], c.metadata_values[i]);
    }
    return FromStatus(shardline::ExportSafetensors(*scheduler->scheduler, path, o,
                                                   absl::Now() + Timeout(timeout_s)));
  });
}

shardlineResult_t shardline_import_safetensors(shardlineScheduler_t scheduler, const char* path,
                                               const shardlineSafetensorsImportConfig_t* config,
                                               double timeout_s) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(scheduler != nullptr && path != nullptr,
                 "shardline_import_safetensors: scheduler and path must not be NULL");
    shardlineSafetensorsImportConfig_t c;
    const shardlineSafetensorsImportConfig_t defaults = SHARDLINE_SAFETENSORS_IMPORT_CONFIG_INIT;
    if (shardlineResult_t r =
            ReadConfig(config, defaults, &c, "shardlineSafetensorsImportConfig_t");
        r != shardlineSuccess) {
      return r;
    }
    shardline::SafetensorsImportOptions o;
    o.ignore_unknown_tensors = c.ignore_unknown_tensors != 0;
    return FromStatus(shardline::ImportSafetensors(*scheduler->scheduler, path, o,
                                                   absl::Now() + Timeout(timeout_s)));
  });
}

shardlineResult_t shardline_sync_module_states(shardlineComm_t comm, void* const* data,
                                               const size_t* counts,
                                               const shardlineDataType_t* dtypes, int num_tensors,
                                               const shardlineSyncConfig_t* config,
                                               double timeout_s) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(comm != nullptr, "shardline_sync_module_states: comm must not be NULL");
    SL_C_REQUIRE(num_tensors >= 0 && (num_tensors == 0 ||
                                      (data != nullptr && counts != nullptr && dtypes != nullptr)),
                 absl::StrCat("shardline_sync_module_states: ", num_tensors,
                              " tensors with data, counts or dtypes NULL"));
    shardlineSyncConfig_t c;
    const shardlineSyncConfig_t defaults = SHARDLINE_SYNC_CONFIG_INIT;
    if (shardlineResult_t r = ReadConfig(config, defaults, &c, "shardlineSyncConfig_t");
        r != shardlineSuccess) {
      return r;
    }
    std::vector<shardline::SyncTensor> tensors(static_cast<size_t>(num_tensors));
    for (int t = 0; t < num_tensors; ++t) {
      SL_C_REQUIRE(ToDType(dtypes[t], &tensors[t].dtype),
                   absl::StrCat("shardline_sync_module_states: tensor ", t, ": unknown dtype ",
                                static_cast<int>(dtypes[t])));
      tensors[t].data = data[t];
      tensors[t].count = counts[t];
    }
    shardline::SyncModuleStatesOptions o;
    o.root = c.root;
    o.bucket_bytes = c.bucket_bytes;
    return FromStatus(
        shardline::SyncModuleStates(*comm->comm, tensors, o, absl::Now() + Timeout(timeout_s)));
  });
}

}  // extern "C"
