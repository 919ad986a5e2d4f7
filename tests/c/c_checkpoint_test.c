/* Checkpoints through the C API (compiled as C11), ranks as threads over the in-process backend:
 *   1. world 4 (full shard): three units of odd-sized tensors get hashed master values (written
 *      through the shard slices, not set_values) and two registered states (an f32 moment and an
 *      i64 counter, each element a hash of its tensor element); the job saves them;
 *   2. worlds 1, 2 and 3 (full shard) and 4 (hybrid 2 x 2) start from other values and garbage
 *      states, load the checkpoint, and check every element of every rank's master shard and
 *      states against the hash of the tensor element it holds, and the padding (zero);
 *      Two replicated states (an i64 scalar step and a 3 x 5 f64 table, rank 0's values hashed,
 *      the other ranks' garbage) come back on every rank as rank 0's;
 *   2b. a background save (save_async) at world 4: right after the call every shard, state and
 *      replicated state is overwritten (training goes on); the checkpoint loaded at 1, 2, 3 and
 *      2 x 2 holds the values at the call, every element; the save's stats (snapshot bytes equal
 *      to this rank's pieces, times) are checked;
 *   2c. full weights: world 4 exports a safetensors file (as saved, and as bf16); worlds 3 and
 *      2 x 2 import them, every master element checked (bf16: against a plain-loop
 *      round-to-nearest-even of the f32 value), the padding zero;
 *   3. errors, each with the code and a message naming what was wrong: a save into an existing
 *      directory, a load of a missing one, a registered state the checkpoint lacks, a state of
 *      the wrong size or dtype, a config from a newer header, and a flipped byte in a data file;
 *      a save_async over max_snapshot_bytes, an export onto an existing file, an import of a
 *      missing one;
 *   4. sync_module_states at world 3, root 1, buckets of 40 bytes: four tensors of odd sizes and
 *      dtypes, each rank's own hashed values, end as the root's on every rank; a rank with other
 *      sizes fails every rank.
 * Exit status 0 on success; every failure prints what differed. */
#define _XOPEN_SOURCE 700 /* nftw, mkdtemp */
#include <ftw.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "c_test_util.h"
#include "shardline.h"

#define UNITS 3
#define MAX_TENSORS 3
#define MAX_WORLD 4

struct UnitDef {
  const char* name;
  int num_tensors;
  const char* tensors[MAX_TENSORS];
  int ndim[MAX_TENSORS];
  int64_t shape[MAX_TENSORS][2];
};
static const struct UnitDef kUnits[UNITS] = {
    {"embed", 2, {"w", "b", NULL}, {2, 1, 0}, {{13, 7}, {5, 0}, {0, 0}}},
    {"block", 3, {"q", "scale", "k"}, {2, 0, 2}, {{11, 3}, {0, 0}, {3, 17}}},
    {"head", 1, {"x", NULL, NULL}, {1, 0, 0}, {{29, 0}, {0, 0}, {0, 0}}},
};

/* The saved values of element i of tensor t of unit u: master, the moment, the counter. */
static float Master(int u, int t, size_t i) { return Hash(11 + u, t, i); }
static float Moment(int u, int t, size_t i) { return Hash(23 + u, t, i); }
static int64_t Counter(int u, int t, size_t i) { return (int64_t)Mix(37 + u, t, i); }

/* The replicated states: a step counter and a 3 x 5 table; rank 0's values. */
#define TABLE 15
static int64_t Step(void) { return (int64_t)Mix(5, 6, 7); }
static double Table(int i) { return (double)Hash(41, 0, i) * 1e3; }

/* f32 rounded to bf16 (nearest, ties to even) and back: the plain-loop reference. */
static float RoundBf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  const uint32_t lsb = (bits >> 16) & 1u;
  bits = (bits + 0x7fffu + lsb) & 0xffff0000u;
  memcpy(&f, &bits, 4);
  return f;
}

static size_t Numel(int u, int t) {
  size_t n = 1;
  for (int d = 0; d < kUnits[u].ndim[t]; ++d) n *= (size_t)kUnits[u].shape[t][d];
  return n;
}

/* One rank's scheduler with the units registered and its states' memory. */
struct Rank {
  shardlineStream_t compute;
  shardlineScheduler_t scheduler;
  int unit[UNITS];
  size_t elements[UNITS];
  float* master[UNITS];
  float* moment[UNITS];
  int64_t* counter[UNITS];
  int64_t step;
  double table[TABLE];
  shardlineCheckpointer_t checkpointer;
};

static int Setup(shardlineComm_t comm, int shard_size, struct Rank* r) {
  memset(r, 0, sizeof(*r));
  CALL(shardline_stream_create_caller("compute", &r->compute));
  shardlineSchedulerConfig_t config = SHARDLINE_SCHEDULER_CONFIG_INIT;
  if (shard_size > 0) {
    config.strategy = shardlineHybridShard;
    config.shard_size = shard_size;
  }
  CALL(shardline_scheduler_create(comm, r->compute, &config, 30, &r->scheduler));
  for (int u = 0; u < UNITS; ++u) {
    shardlineTensorSpec_t specs[MAX_TENSORS];
    for (int t = 0; t < kUnits[u].num_tensors; ++t) {
      specs[t].name = kUnits[u].tensors[t];
      specs[t].shape = kUnits[u].shape[t];
      specs[t].ndim = kUnits[u].ndim[t];
    }
    CALL(shardline_scheduler_register_unit(r->scheduler, kUnits[u].name, specs,
                                           kUnits[u].num_tensors, &r->unit[u]));
    void* data = NULL;
    CALL(shardline_unit_master_shard(r->scheduler, r->unit[u], &data, &r->elements[u]));
    r->master[u] = data;
    const size_t n = r->elements[u] > 0 ? r->elements[u] : 1;
    r->moment[u] = calloc(n, sizeof(float));
    r->counter[u] = calloc(n, sizeof(int64_t));
    CHECK(r->moment[u] != NULL && r->counter[u] != NULL, "out of memory");
  }
  shardlineCheckpointConfig_t ckpt = SHARDLINE_CHECKPOINT_CONFIG_INIT;
  ckpt.checksum_block_bytes = 24; /* several blocks per piece, pieces not block-aligned */
  ckpt.read_chunk_bytes = 72;
  CALL(shardline_checkpointer_create(r->scheduler, &ckpt, 30, &r->checkpointer));
  const int64_t table_shape[2] = {3, 5};
  CALL(shardline_checkpointer_add_replicated_state(r->checkpointer, "step", &r->step, NULL, 0,
                                                   shardlineInt64));
  CALL(shardline_checkpointer_add_replicated_state(r->checkpointer, "table", r->table, table_shape,
                                                   2, shardlineFloat64));
  for (int u = 0; u < UNITS; ++u) {
    CALL(shardline_checkpointer_add_state(r->checkpointer, r->unit[u], "adam.m", r->moment[u],
                                          r->elements[u] * sizeof(float), shardlineFloat32));
    CALL(shardline_checkpointer_add_state(r->checkpointer, r->unit[u], "count", r->counter[u],
                                          r->elements[u] * sizeof(int64_t), shardlineInt64));
  }
  return 0;
}

static void Teardown(struct Rank* r) {
  shardline_checkpointer_destroy(r->checkpointer);
  shardline_scheduler_destroy(r->scheduler);
  shardline_stream_destroy(r->compute);
  for (int u = 0; u < UNITS; ++u) {
    free(r->moment[u]);
    free(r->counter[u]);
  }
}

/* Fills (fill = 1) or checks (fill = 0) every element of this rank's shards and replicated
 * states: the elements of each tensor through the shard slices, the padding zero. fill = 2
 * checks the master shards only, fill = 3 the master shards against their bf16 rounding, fill = 4
 * as 0 with the replicated states as fill = 1 left them (rank 0's differ from the others'). */
static int Visit(struct Rank* r, int rank, int fill) {
  if (fill == 1) {
    r->step = rank == 0 ? Step() : -5 - rank;
    for (int i = 0; i < TABLE; ++i) r->table[i] = rank == 0 ? Table(i) : 0.5 * rank;
  } else if (fill == 4) { /* the replicated states as fill = 1 set them; then as fill = 0 */
    CHECK(r->step == (rank == 0 ? Step() : -5 - rank), "rank %d: step %lld", rank,
          (long long)r->step);
    for (int i = 0; i < TABLE; ++i) {
      CHECK(r->table[i] == (rank == 0 ? Table(i) : 0.5 * rank), "rank %d: table[%d] %.17g", rank, i,
            r->table[i]);
    }
    fill = 0;
  } else if (fill == 0) {
    CHECK(r->step == Step(), "rank %d: step %lld, saved %lld", rank, (long long)r->step,
          (long long)Step());
    for (int i = 0; i < TABLE; ++i) {
      CHECK(r->table[i] == Table(i), "rank %d: table[%d] %.17g, saved %.17g", rank, i, r->table[i],
            Table(i));
    }
  }
  for (int u = 0; u < UNITS; ++u) {
    const size_t n = r->elements[u];
    char* covered = calloc(n > 0 ? n : 1, 1);
    CHECK(covered != NULL, "out of memory");
    for (int t = 0; t < kUnits[u].num_tensors; ++t) {
      size_t first = 0, count = 0, tensor_offset = 0;
      CALL(shardline_unit_shard_slice(r->scheduler, r->unit[u], t, &first, &count, &tensor_offset));
      CHECK(tensor_offset + count <= Numel(u, t) && first + count <= n,
            "unit %d tensor %d: slice [%zu, +%zu) at tensor element %zu", u, t, first, count,
            tensor_offset);
      for (size_t k = 0; k < count; ++k) {
        const size_t s = first + k, e = tensor_offset + k;
        covered[s] = 1;
        if (fill >= 2) {
          const float want = fill == 3 ? RoundBf16(Master(u, t, e)) : Master(u, t, e);
          CHECK(r->master[u][s] == want,
                "rank %d unit %s tensor %s element %zu (shard element %zu): master %.9g, the "
                "file's %.9g",
                rank, kUnits[u].name, kUnits[u].tensors[t], e, s, r->master[u][s], want);
          continue;
        }
        if (fill == 1) {
          r->master[u][s] = Master(u, t, e);
          r->moment[u][s] = Moment(u, t, e);
          r->counter[u][s] = Counter(u, t, e);
          continue;
        }
        CHECK(r->master[u][s] == Master(u, t, e) && r->moment[u][s] == Moment(u, t, e) &&
                  r->counter[u][s] == Counter(u, t, e),
              "rank %d unit %s tensor %s element %zu (shard element %zu): master %.9g moment "
              "%.9g counter %lld; saved %.9g %.9g %lld",
              rank, kUnits[u].name, kUnits[u].tensors[t], e, s, r->master[u][s], r->moment[u][s],
              (long long)r->counter[u][s], Master(u, t, e), Moment(u, t, e),
              (long long)Counter(u, t, e));
      }
    }
    for (size_t s = 0; s < n && fill != 1; ++s) {
      if (covered[s]) continue;
      CHECK(r->master[u][s] == 0 && (fill >= 2 || (r->moment[u][s] == 0 && r->counter[u][s] == 0)),
            "rank %d unit %s: padding element %zu is %g / %g / %lld, not zero", rank,
            kUnits[u].name, s, r->master[u][s], r->moment[u][s], (long long)r->counter[u][s]);
    }
    free(covered);
  }
  return 0;
}

/* Garbage in everything a load must overwrite (padding included). */
static void Scribble(struct Rank* r, int rank) {
  for (int u = 0; u < UNITS; ++u) {
    for (size_t s = 0; s < r->elements[u]; ++s) {
      r->master[u][s] = Hash(99, rank, s);
      r->moment[u][s] = -1.0f - (float)s;
      r->counter[u][s] = -7;
    }
  }
  r->step = -1;
  for (int i = 0; i < TABLE; ++i) r->table[i] = -2.0 - i;
}

/* This rank's pieces: the bytes of the tensor elements its shards hold, of every state. */
static int PieceBytes(struct Rank* r, uint64_t* bytes) {
  *bytes = 0;
  for (int u = 0; u < UNITS; ++u) {
    for (int t = 0; t < kUnits[u].num_tensors; ++t) {
      size_t first = 0, count = 0, tensor_offset = 0;
      CALL(shardline_unit_shard_slice(r->scheduler, r->unit[u], t, &first, &count, &tensor_offset));
      *bytes += count * (sizeof(float) + sizeof(float) + sizeof(int64_t));
    }
  }
  return 0;
}

static char dir[4096];       /* the saved checkpoint */
static char scratch[4096];   /* a second save, corrupted by the error test */
static char async_dir[4096]; /* the background save */
static char weights[4096];   /* the safetensors export */
static char weights_bf16[4096];

struct Job {
  shardlineComm_t comm;
  int rank, size, shard_size;
  int phase; /* 0: save; 1: load; 2: errors; 3: sync_module_states */
};

static int Save(const struct Job* j) {
  struct Rank r;
  if (Setup(j->comm, j->shard_size, &r) != 0) return 1;
  if (Visit(&r, j->rank, 1) != 0) return 1;
  CALL(shardline_checkpointer_save(r.checkpointer, dir, 60));
  CALL(shardline_checkpointer_save(r.checkpointer, scratch, 60));
  /* Saving leaves the shards as they were. */
  if (Visit(&r, j->rank, 4) != 0) return 1;
  shardlineCheckpointSaveStats_t stats = SHARDLINE_CHECKPOINT_SAVE_STATS_INIT;
  CALL(shardline_checkpointer_last_save_stats(r.checkpointer, &stats));
  CHECK(stats.background == 0 && stats.finished == 1 && stats.snapshot_bytes == 0 &&
            stats.blocked_s > 0 && stats.write_s == 0,
        "rank %d: a save's stats: background %d finished %d snapshot %llu blocked %g write %g",
        j->rank, stats.background, stats.finished, (unsigned long long)stats.snapshot_bytes,
        stats.blocked_s, stats.write_s);
  CALL(shardline_export_safetensors(r.scheduler, weights, NULL, 60));
  shardlineSafetensorsExportConfig_t bf16 = SHARDLINE_SAFETENSORS_EXPORT_CONFIG_INIT;
  const char* keys[1] = {"step"};
  const char* values[1] = {"7"};
  bf16.writer_rank = 3;
  bf16.cast = 1;
  bf16.dtype = shardlineBfloat16;
  bf16.metadata_keys = keys;
  bf16.metadata_values = values;
  bf16.num_metadata = 1;
  bf16.cast_chunk_bytes = 10; /* several chunks per tensor */
  CALL(shardline_export_safetensors(r.scheduler, weights_bf16, &bf16, 60));
  /* A background save: its snapshot holds the values at the call, whatever happens after. */
  int pending = 7;
  CALL(shardline_checkpointer_save_pending(r.checkpointer, &pending));
  CHECK(pending == 0, "rank %d: pending %d before save_async", j->rank, pending);
  CALL(shardline_checkpointer_save_async(r.checkpointer, async_dir, 60));
  Scribble(&r, j->rank); /* the next step */
  CALL(shardline_checkpointer_wait_for_save(r.checkpointer, 60));
  CALL(shardline_checkpointer_save_pending(r.checkpointer, &pending));
  CHECK(pending == 0, "rank %d: pending %d after wait_for_save", j->rank, pending);
  CALL(shardline_checkpointer_wait_for_save(r.checkpointer, 1)); /* nothing pending: success */
  uint64_t pieces = 0;
  if (PieceBytes(&r, &pieces) != 0) return 1;
  CALL(shardline_checkpointer_last_save_stats(r.checkpointer, &stats));
  CHECK(stats.background == 1 && stats.finished == 1 && stats.snapshot_bytes == pieces &&
            stats.snapshot_capacity_bytes >= pieces && stats.blocked_s > 0 &&
            stats.snapshot_s <= stats.blocked_s && stats.write_s > 0,
        "rank %d: save_async's stats: background %d finished %d snapshot %llu (pieces %llu, "
        "capacity %llu) blocked %g snapshot %g write %g",
        j->rank, stats.background, stats.finished, (unsigned long long)stats.snapshot_bytes,
        (unsigned long long)pieces, (unsigned long long)stats.snapshot_capacity_bytes,
        stats.blocked_s, stats.snapshot_s, stats.write_s);
  /* A struct from an older header (only the fields up to `finished`) gets only those. */
  struct {
    shardlineCheckpointSaveStats_t s;
    char tail[8];
  } older;
  memset(&older, 0x5a, sizeof(older));
  older.s.struct_size = offsetof(shardlineCheckpointSaveStats_t, snapshot_bytes);
  CALL(shardline_checkpointer_last_save_stats(r.checkpointer, &older.s));
  CHECK(older.s.background == 1 && older.s.finished == 1 &&
            older.s.struct_size == offsetof(shardlineCheckpointSaveStats_t, snapshot_bytes) &&
            ((unsigned char*)&older.s.snapshot_bytes)[0] == 0x5a,
        "rank %d: an older stats struct was written beyond its size", j->rank);
  Teardown(&r);
  return 0;
}

static int Load(const struct Job* j) {
  struct Rank r;
  if (Setup(j->comm, j->shard_size, &r) != 0) return 1;
  Scribble(&r, j->rank);
  CALL(shardline_checkpointer_load(r.checkpointer, dir, 60));
  if (Visit(&r, j->rank, 0) != 0) return 1;
  Scribble(&r, j->rank);
  CALL(shardline_checkpointer_load(r.checkpointer, async_dir, 60));
  if (Visit(&r, j->rank, 0) != 0) return 1;
  if (j->size != 1 && j->size != 2) {
    Scribble(&r, j->rank);
    CALL(shardline_import_safetensors(r.scheduler, weights, NULL, 60));
    if (Visit(&r, j->rank, 2) != 0) return 1;
    Scribble(&r, j->rank);
    CALL(shardline_import_safetensors(r.scheduler, weights_bf16, NULL, 60));
    if (Visit(&r, j->rank, 3) != 0) return 1;
  }
  Teardown(&r);
  return 0;
}

static int Errors(const struct Job* j) {
  struct Rank r;
  if (Setup(j->comm, j->shard_size, &r) != 0) return 1;
  /* Collective errors: the rank that found it has its code, the others shardlineRemoteError
   * with its message. */
  EXPECT_FAIL(shardline_checkpointer_save(r.checkpointer, dir, 60),
              j->rank == 0 ? shardlineAlreadyExists : shardlineRemoteError, dir);
  CHECK(strstr(shardline_last_error(), "ALREADY_EXISTS") != NULL, "%s", shardline_last_error());
  char missing[4200];
  snprintf(missing, sizeof(missing), "%s-missing", dir);
  const shardlineResult_t gone = shardline_checkpointer_load(r.checkpointer, missing, 60);
  CHECK(gone == shardlineNotFound || gone == shardlineRemoteError, "%s: %s",
        shardline_result_string(gone), shardline_last_error());
  CHECK(strstr(shardline_last_error(), "NOT_FOUND") != NULL &&
            strstr(shardline_last_error(), "-missing") != NULL,
        "'%s' does not name the missing directory", shardline_last_error());
  /* Wrong sizes and dtypes are refused before anything is registered. */
  EXPECT_FAIL(shardline_checkpointer_add_state(r.checkpointer, r.unit[0], "adam.v", r.moment[0],
                                               r.elements[0] * 2, shardlineFloat32),
              shardlineInvalidArgument, "'adam.v'");
  EXPECT_FAIL(shardline_checkpointer_add_state(r.checkpointer, r.unit[0], "adam.v", r.moment[0],
                                               r.elements[0] * 4, (shardlineDataType_t)42),
              shardlineInvalidArgument, "dtype 42");
  EXPECT_FAIL(shardline_checkpointer_add_state(r.checkpointer, UNITS + 5, "adam.v", r.moment[0],
                                               r.elements[0] * 4, shardlineFloat32),
              shardlineInvalidArgument, "no unit 8");
  EXPECT_FAIL(shardline_checkpointer_add_state(r.checkpointer, r.unit[0], "adam.m", r.moment[0],
                                               r.elements[0] * 4, shardlineFloat32),
              shardlineInvalidArgument, "adam.m");
  shardlineCheckpointConfig_t newer = SHARDLINE_CHECKPOINT_CONFIG_INIT;
  newer.struct_size += 8;
  shardlineCheckpointer_t never = NULL;
  EXPECT_FAIL(shardline_checkpointer_create(r.scheduler, &newer, 30, &never),
              shardlineInvalidArgument, "shardlineCheckpointConfig_t.struct_size");
  /* A registered state the checkpoint lacks: a second checkpointer with one more state. */
  shardlineCheckpointer_t more = NULL;
  CALL(shardline_checkpointer_create(r.scheduler, NULL, 30, &more));
  float* extra = malloc((r.elements[1] > 0 ? r.elements[1] : 1) * sizeof(float));
  CHECK(extra != NULL, "out of memory");
  CALL(shardline_checkpointer_add_state(more, r.unit[1], "adam.v", extra,
                                        r.elements[1] * sizeof(float), shardlineFloat32));
  EXPECT_FAIL(shardline_checkpointer_load(more, dir, 60), shardlineNotFound, "no state 'adam.v'");
  CALL(shardline_checkpointer_destroy(more));
  free(extra);
  /* A flipped byte: rank 0 damages the scratch copy's first data file; DataLoss on every rank
   * (the others hear it as a peer's error unless their own read hit it too). */
  if (j->rank == 0) {
    char file[4300];
    snprintf(file, sizeof(file), "%s/shard-00000-of-00004.bin", scratch);
    FILE* f = fopen(file, "r+b");
    CHECK(f != NULL, "cannot open %s", file);
    CHECK(fseek(f, 5, SEEK_SET) == 0, "seek");
    const int c = fgetc(f);
    CHECK(fseek(f, 5, SEEK_SET) == 0 && fputc(c ^ 0x10, f) != EOF && fclose(f) == 0, "write");
  }
  /* Everyone waits for the damage before loading: an all-gather is the barrier. */
  shardlineStream_t host;
  shardlineWork_t work;
  float mine = 1, all[MAX_WORLD];
  CALL(shardline_stream_create_host("barrier", &host));
  CALL(shardline_all_gather(j->comm, &mine, all, 1, shardlineFloat32, host, &work));
  CALL(shardline_work_wait(work, 30));
  CALL(shardline_work_destroy(work));
  CALL(shardline_stream_destroy(host));
  const shardlineResult_t loaded = shardline_checkpointer_load(r.checkpointer, scratch, 60);
  CHECK(loaded == shardlineDataLoss || loaded == shardlineRemoteError,
        "rank %d: loading a flipped byte gave %s: %s", j->rank, shardline_result_string(loaded),
        shardline_last_error());
  CHECK(strstr(shardline_last_error(), "shard-00000-of-00004.bin") != NULL,
        "rank %d: '%s' does not name the damaged file", j->rank, shardline_last_error());
  if (j->rank == 0) CHECK(loaded == shardlineDataLoss, "rank 0: %s", shardline_last_error());
  /* A background save over max_snapshot_bytes fails on every rank before anything is written. */
  shardlineCheckpointConfig_t capped = SHARDLINE_CHECKPOINT_CONFIG_INIT;
  capped.max_snapshot_bytes = 16;
  shardlineCheckpointer_t small = NULL;
  CALL(shardline_checkpointer_create(r.scheduler, &capped, 30, &small));
  char never_dir[4200];
  snprintf(never_dir, sizeof(never_dir), "%s-capped", dir);
  const shardlineResult_t over = shardline_checkpointer_save_async(small, never_dir, 60);
  CHECK(over == shardlineResourceExhausted || over == shardlineRemoteError, "rank %d: %s: %s",
        j->rank, shardline_result_string(over), shardline_last_error());
  CHECK(strstr(shardline_last_error(), "max_snapshot_bytes (16)") != NULL, "rank %d: '%s'", j->rank,
        shardline_last_error());
  CHECK(access(never_dir, F_OK) != 0, "rank %d: %s exists", j->rank, never_dir);
  int pending = 1;
  CALL(shardline_checkpointer_save_pending(small, &pending));
  CHECK(pending == 0, "rank %d: a failed save_async left a pending save", j->rank);
  CALL(shardline_checkpointer_destroy(small));
  /* Full weights: an export never replaces a file; an import of a missing file. */
  const shardlineResult_t exists = shardline_export_safetensors(r.scheduler, weights, NULL, 60);
  CHECK(exists == shardlineAlreadyExists || exists == shardlineRemoteError, "rank %d: %s: %s",
        j->rank, shardline_result_string(exists), shardline_last_error());
  CHECK(strstr(shardline_last_error(), "safetensors export") != NULL, "'%s'",
        shardline_last_error());
  char no_file[4200];
  snprintf(no_file, sizeof(no_file), "%s-missing.safetensors", weights);
  EXPECT_FAIL(shardline_import_safetensors(r.scheduler, no_file, NULL, 60), shardlineNotFound,
              "-missing.safetensors");
  shardlineSafetensorsExportConfig_t odd = SHARDLINE_SAFETENSORS_EXPORT_CONFIG_INIT;
  odd.cast = 1;
  odd.dtype = (shardlineDataType_t)42;
  EXPECT_FAIL(shardline_export_safetensors(r.scheduler, no_file, &odd, 60),
              shardlineInvalidArgument, "dtype 42");
  Teardown(&r);
  return 0;
}

/* sync_module_states: every rank's own values before, the root's after. */
#define SYNC_TENSORS 4
static const size_t kSyncCounts[SYNC_TENSORS] = {1001, 37, 13, 5};
static const shardlineDataType_t kSyncTypes[SYNC_TENSORS] = {shardlineFloat32, shardlineInt64,
                                                             shardlineUint8, shardlineBfloat16};
static const size_t kSyncSizes[SYNC_TENSORS] = {4, 8, 1, 2};

static int Sync(const struct Job* j) {
  const int root = 1;
  unsigned char* data[SYNC_TENSORS];
  for (int t = 0; t < SYNC_TENSORS; ++t) {
    data[t] = malloc(kSyncCounts[t] * kSyncSizes[t]);
    CHECK(data[t] != NULL, "out of memory");
    for (size_t b = 0; b < kSyncCounts[t] * kSyncSizes[t]; ++b) {
      data[t][b] = (unsigned char)Mix(j->rank, t, b);
    }
  }
  shardlineSyncConfig_t config = SHARDLINE_SYNC_CONFIG_INIT;
  config.root = root;
  config.bucket_bytes = 40; /* buckets inside one tensor and across several */
  CALL(shardline_sync_module_states(j->comm, (void* const*)data, kSyncCounts, kSyncTypes,
                                    SYNC_TENSORS, &config, 60));
  for (int t = 0; t < SYNC_TENSORS; ++t) {
    for (size_t b = 0; b < kSyncCounts[t] * kSyncSizes[t]; ++b) {
      CHECK(data[t][b] == (unsigned char)Mix(root, t, b),
            "rank %d tensor %d byte %zu: %u, the root's %u", j->rank, t, b, data[t][b],
            (unsigned char)Mix(root, t, b));
    }
  }
  /* Rank 2 passes one element fewer: every rank fails, naming it. */
  size_t counts[SYNC_TENSORS];
  memcpy(counts, kSyncCounts, sizeof(counts));
  if (j->rank == 2) counts[1] -= 1;
  const shardlineResult_t r = shardline_sync_module_states(j->comm, (void* const*)data, counts,
                                                           kSyncTypes, SYNC_TENSORS, &config, 60);
  CHECK(r == shardlineInvalidArgument || r == shardlineRemoteError, "rank %d: %s: %s", j->rank,
        shardline_result_string(r), shardline_last_error());
  CHECK(strstr(shardline_last_error(), "rank 2") != NULL, "rank %d: '%s' does not name rank 2",
        j->rank, shardline_last_error());
  for (int t = 0; t < SYNC_TENSORS; ++t) free(data[t]);
  return 0;
}

/* A world's job: its shard size and phase (as in struct Job). */
struct World {
  int shard_size;
  int phase;
};

static void RunRank(const struct TestRank* rank) {
  const struct World* w = rank->arg;
  const struct Job job = {rank->comm, rank->rank, rank->size, w->shard_size, w->phase};
  const struct Job* j = &job;
  if (j->phase == 0) Save(j);
  if (j->phase == 1) Load(j);
  if (j->phase == 2) Errors(j);
  if (j->phase == 3) Sync(j);
}

static int RunWorld(int size, int shard_size, int phase) {
  const struct World world = {shard_size, phase};
  return RunRanks(size, RunRank, &world);
}

static int RemoveEntry(const char* path, const struct stat* st, int flag, struct FTW* ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  return remove(path);
}

int main(void) {
  const char* tmp = getenv("TMPDIR");
  char base[4000];
  snprintf(base, sizeof(base), "%s/c_checkpoint_test.XXXXXX", tmp != NULL ? tmp : "/tmp");
  if (mkdtemp(base) == NULL) {
    perror("mkdtemp");
    return 1;
  }
  snprintf(dir, sizeof(dir), "%s/step7", base);
  snprintf(scratch, sizeof(scratch), "%s/scratch", base);
  snprintf(async_dir, sizeof(async_dir), "%s/step8-async", base);
  snprintf(weights, sizeof(weights), "%s/model.safetensors", base);
  snprintf(weights_bf16, sizeof(weights_bf16), "%s/model-bf16.safetensors", base);
  RunWorld(4, 0, 0);
  if (failures == 0) {
    RunWorld(1, 0, 1);
    RunWorld(2, 0, 1);
    RunWorld(3, 0, 1);
    RunWorld(4, 2, 1);
    RunWorld(4, 0, 2);
  }
  RunWorld(3, 0, 3);
  nftw(base, RemoveEntry, 16, FTW_DEPTH | FTW_PHYS);
  if (ReportFailures("c_checkpoint_test") != 0) return 1;
  printf(
      "c_checkpoint_test: saved (and saved in the background, then overwritten) at world 4, "
      "loaded at 1, 2, 3 and hybrid 2 x 2: every element of %d units' master shards, 2 states "
      "and 2 replicated states matches; safetensors export (f32, bf16) imported at 3 and 2 x 2; "
      "sync_module_states at 3; 12 errors named\n",
      UNITS);
  return 0;
}
