/* Checkpoints through the C API (compiled as C11), ranks as threads over the in-process backend:
 *   1. world 4 (full shard): three units of odd-sized tensors get hashed master values (written
 *      through the shard slices, not set_values) and two registered states (an f32 moment and an
 *      i64 counter, each element a hash of its tensor element); the job saves them;
 *   2. worlds 1, 2 and 3 (full shard) and 4 (hybrid 2 x 2) start from other values and garbage
 *      states, load the checkpoint, and check every element of every rank's master shard and
 *      states against the hash of the tensor element it holds, and the padding (zero);
 *   3. errors, each with the code and a message naming what was wrong: a save into an existing
 *      directory, a load of a missing one, a registered state the checkpoint lacks, a state of
 *      the wrong size or dtype, a config from a newer header, and a flipped byte in a data file.
 * Exit status 0 on success; every failure prints what differed. */
#define _XOPEN_SOURCE 700 /* nftw, mkdtemp */
#include <ftw.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

static int failures = 0;
static pthread_mutex_t failures_mu = PTHREAD_MUTEX_INITIALIZER;

#define CHECK(cond, ...)                              \
  do {                                                \
    if (!(cond)) {                                    \
      pthread_mutex_lock(&failures_mu);               \
      ++failures;                                     \
      fprintf(stderr, "%s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                   \
      fprintf(stderr, "\n");                          \
      pthread_mutex_unlock(&failures_mu);             \
      return 1;                                       \
    }                                                 \
  } while (0)
#define CALL(expr)                                                                  \
  do {                                                                              \
    shardlineResult_t r_ = (expr);                                                  \
    CHECK(r_ == shardlineSuccess, "%s: %s: %s", #expr, shardline_result_string(r_), \
          shardline_last_error());                                                  \
  } while (0)
/* `expr` fails with `code` and a message containing `text`. */
#define EXPECT_FAIL(expr, code, text)                                                           \
  do {                                                                                          \
    shardlineResult_t r_ = (expr);                                                              \
    CHECK(r_ == (code), "%s: %s (wanted %s): %s", #expr, shardline_result_string(r_),           \
          shardline_result_string(code), shardline_last_error());                               \
    CHECK(strstr(shardline_last_error(), (text)) != NULL, "%s: '%s' does not name '%s'", #expr, \
          shardline_last_error(), (text));                                                      \
  } while (0)

static uint64_t Mix(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t x = a * 0x9e3779b97f4a7c15ULL ^ (b + 0x632be59bd9b4e019ULL) * 0xbf58476d1ce4e5b9ULL ^ c;
  x ^= x >> 31;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 29;
  return x;
}
static float Hash(uint64_t a, uint64_t b, uint64_t c) {
  return (float)((double)(Mix(a, b, c) >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}
/* The saved values of element i of tensor t of unit u: master, the moment, the counter. */
static float Master(int u, int t, size_t i) { return Hash(11 + u, t, i); }
static float Moment(int u, int t, size_t i) { return Hash(23 + u, t, i); }
static int64_t Counter(int u, int t, size_t i) { return (int64_t)Mix(37 + u, t, i); }

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

/* Fills (fill = 1) or checks (fill = 0) every element of this rank's shards: the elements of each
 * tensor through the shard slices, the padding zero. */
static int Visit(struct Rank* r, int rank, int fill) {
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
        if (fill) {
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
    for (size_t s = 0; s < n && !fill; ++s) {
      if (covered[s]) continue;
      CHECK(r->master[u][s] == 0 && r->moment[u][s] == 0 && r->counter[u][s] == 0,
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
}

static char dir[4096];     /* the saved checkpoint */
static char scratch[4096]; /* a second save, corrupted by the error test */

struct Job {
  shardlineComm_t comm;
  int rank, size, shard_size;
  int phase; /* 0: save; 1: load; 2: errors */
};

static int Save(const struct Job* j) {
  struct Rank r;
  if (Setup(j->comm, j->shard_size, &r) != 0) return 1;
  if (Visit(&r, j->rank, 1) != 0) return 1;
  CALL(shardline_checkpointer_save(r.checkpointer, dir, 60));
  CALL(shardline_checkpointer_save(r.checkpointer, scratch, 60));
  /* Saving leaves the shards as they were. */
  if (Visit(&r, j->rank, 0) != 0) return 1;
  Teardown(&r);
  return 0;
}

static int Load(const struct Job* j) {
  struct Rank r;
  if (Setup(j->comm, j->shard_size, &r) != 0) return 1;
  Scribble(&r, j->rank);
  CALL(shardline_checkpointer_load(r.checkpointer, dir, 60));
  if (Visit(&r, j->rank, 0) != 0) return 1;
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
  Teardown(&r);
  return 0;
}

static void* RunRank(void* arg) {
  const struct Job* j = arg;
  if (j->phase == 0) Save(j);
  if (j->phase == 1) Load(j);
  if (j->phase == 2) Errors(j);
  return NULL;
}

static int RunWorld(int size, int shard_size, int phase) {
  shardlineComm_t comms[MAX_WORLD];
  if (shardline_comm_init_local(size, 30, comms) != shardlineSuccess) {
    fprintf(stderr, "shardline_comm_init_local: %s\n", shardline_last_error());
    return 1;
  }
  pthread_t threads[MAX_WORLD];
  struct Job jobs[MAX_WORLD];
  for (int r = 0; r < size; ++r) {
    jobs[r] = (struct Job){comms[r], r, size, shard_size, phase};
    pthread_create(&threads[r], NULL, RunRank, &jobs[r]);
  }
  for (int r = 0; r < size; ++r) pthread_join(threads[r], NULL);
  for (int r = 0; r < size; ++r) shardline_comm_destroy(comms[r]);
  return 0;
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
  RunWorld(4, 0, 0);
  if (failures == 0) {
    RunWorld(1, 0, 1);
    RunWorld(2, 0, 1);
    RunWorld(3, 0, 1);
    RunWorld(4, 2, 1);
    RunWorld(4, 0, 2);
  }
  nftw(base, RemoveEntry, 16, FTW_DEPTH | FTW_PHYS);
  if (failures != 0) {
    fprintf(stderr, "c_checkpoint_test: %d failure(s)\n", failures);
    return 1;
  }
  printf(
      "c_checkpoint_test: saved at world 4, loaded at 1, 2, 3 and hybrid 2 x 2: every element of "
      "%d units' master shards and 2 states matches; 7 errors named\n",
      UNITS);
  return 0;
}
