/* The C API from C (compiled as C11): two ranks as threads over the in-process backend.
 *   1. an all-gather of hashed floats (odd count) checked element by element;
 *   2. three training steps of a two-unit model under the FSDP scheduler (prefetch on, a budget):
 *      the forward reads every gathered parameter, the backward adds gradients that depend on
 *      them, SGD runs on the shards between steps; the final shards are compared with the same
 *      training run unsharded in plain C loops;
 *   3. errors: a bad dtype is shardlineInvalidArgument with a message naming it, an option struct
 *      from a newer header is refused;
 *   4. the same training with the framework's memory, without and with CPU offload: unsharded
 *      buffers and sharded gradients from its allocator callbacks (counted: every allocation
 *      freed by destroy, no stream handle for host streams; a misaligned block refused and given
 *      back), master shards in its own arrays (adopted: the optimizer steps on them; a wrong
 *      size names both sizes; a refused registration does not release the array), the
 *      post-optimizer event, and a trace (its gather track and collectives' spans) written and
 *      read back;
 *   5. the training on the framework's own executor as the compute stream (stream callbacks):
 *      the compute and the optimizer run there asynchronously; a refused enqueue fails the
 *      stream;
 *   6. a framework's own event through callbacks: a host stream waits for it (notified, not
 *      polled), a failed one fails the stream, and the framework hears of shardline's events;
 *   7. ABI: the scheduler is created from configs as older headers laid them out (the first
 *      release's, which ended with reduce_op, and one that ends before param_dtype), each placed
 *      so that its last byte is the last byte before a PROT_NONE page: a library that read past
 *      struct_size would fault. The missing fields take their defaults;
 *   8. a framework's CUDA stream and event: unsupported without CUDA, the device's error with
 *      CUDA and no GPU, never a crash.
 * Exit status 0 on success; every failure prints what differed. */
#define _DEFAULT_SOURCE /* mmap's MAP_ANONYMOUS */
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "c_test_util.h"
#include "shardline.h"

#define RANKS 2
#define UNITS 2
#define STEPS 3
static const int64_t kSizes[UNITS][2] = {{37, 5}, {53, 7}}; /* tensor "w" and "b" per unit */
static const float kLr = 0.05f;

static float Initial(int u, int t, size_t i) { return Hash(1 + u, t, i); }
static float Input(int rank, int step, int u, int t, size_t i) {
  return Hash(100 + rank, step * 16 + u, t * 100000 + i);
}

/* forward: act = sum w * x; backward: g += w * (0.5 + 0.01 act) + x. */
static void ForwardBackward(int rank, int step, int u, float* const w[2], float* const g[2]) {
  double act = 0;
  for (int t = 0; t < 2; ++t) {
    const size_t n = (size_t)kSizes[u][t];
    for (size_t i = 0; i < n; ++i) act += w[t][i] * Input(rank, step, u, t, i);
  }
  const float c = 0.5f + 0.01f * (float)act;
  for (int t = 0; t < 2; ++t) {
    const size_t n = (size_t)kSizes[u][t];
    for (size_t i = 0; i < n; ++i) g[t][i] += w[t][i] * c + Input(rank, step, u, t, i);
  }
}

static float reference[UNITS][2][64];

static void Reference(void) {
  for (int u = 0; u < UNITS; ++u)
    for (int t = 0; t < 2; ++t)
      for (int64_t i = 0; i < kSizes[u][t]; ++i) reference[u][t][i] = Initial(u, t, (size_t)i);
  for (int s = 0; s < STEPS; ++s) {
    float sum[UNITS][2][64];
    memset(sum, 0, sizeof(sum));
    for (int r = 0; r < RANKS; ++r) {
      float grad[UNITS][2][64];
      memset(grad, 0, sizeof(grad));
      for (int u = 0; u < UNITS; ++u) {
        float* w[2] = {reference[u][0], reference[u][1]};
        float* g[2] = {grad[u][0], grad[u][1]};
        ForwardBackward(r, s, u, w, g);
      }
      for (int u = 0; u < UNITS; ++u)
        for (int t = 0; t < 2; ++t)
          for (int64_t i = 0; i < kSizes[u][t]; ++i) sum[u][t][i] += grad[u][t][i];
    }
    for (int u = 0; u < UNITS; ++u)
      for (int t = 0; t < 2; ++t)
        for (int64_t i = 0; i < kSizes[u][t]; ++i)
          reference[u][t][i] -= kLr * (sum[u][t][i] / RANKS);
  }
}

static int AllGather(shardlineComm_t comm, int rank) {
  enum { kCount = 1001 };
  shardlineStream_t stream;
  CALL(shardline_stream_create_host("gather", &stream));
  float* in = malloc(kCount * sizeof(float));
  float* out = malloc(RANKS * kCount * sizeof(float));
  for (size_t i = 0; i < kCount; ++i) in[i] = Hash(7, rank, i);
  shardlineWork_t work;
  CALL(shardline_all_gather(comm, in, out, kCount, shardlineFloat32, stream, &work));
  CALL(shardline_work_wait(work, 30));
  int completed = 0;
  CALL(shardline_work_is_completed(work, &completed));
  CHECK(completed == 1, "the all-gather is not completed after its wait");
  for (int r = 0; r < RANKS; ++r)
    for (size_t i = 0; i < kCount; ++i)
      CHECK(out[r * kCount + i] == Hash(7, r, i), "all_gather: rank %d element %zu", r, i);
  shardline_work_destroy(work);
  /* Bad input: an unknown dtype, named in the message; nothing is issued. */
  shardlineResult_t bad =
      shardline_all_gather(comm, in, out, kCount, (shardlineDataType_t)99, stream, &work);
  CHECK(bad == shardlineInvalidArgument, "bad dtype gave %s", shardline_result_string(bad));
  CHECK(strstr(shardline_last_error(), "dtype") != NULL, "message: %s", shardline_last_error());
  /* An all-reduce with shardlineProduct, against a plain loop over the ranks' inputs. */
  double product[kCount];
  for (size_t i = 0; i < kCount; ++i) product[i] = 1.0 + Hash(8, rank, i);
  CALL(shardline_all_reduce(comm, product, product, kCount, shardlineFloat64, shardlineProduct,
                            stream, &work));
  CALL(shardline_work_wait(work, 30));
  shardline_work_destroy(work);
  for (size_t i = 0; i < kCount; ++i) {
    double want = 1.0;
    for (int r = 0; r < RANKS; ++r) want *= 1.0 + Hash(8, r, i);
    CHECK(fabs(product[i] - want) <= 1e-12 * fabs(want), "product: element %zu is %g, want %g", i,
          product[i], want);
  }
  /* A ring of sends and receives (rank r sends to r + 1), tag 5, the receive from any rank on
   * one stream and the send on another: every element, and the sender named. */
  const int to = (rank + 1) % RANKS, from = (rank + RANKS - 1) % RANKS;
  shardlineWork_t sent, received;
  for (size_t i = 0; i < kCount; ++i) in[i] = Hash(9, rank, i);
  CALL(shardline_recv(comm, out, kCount, shardlineFloat32, SHARDLINE_ANY_SOURCE, 5, stream,
                      &received));
  shardlineStream_t send_stream;
  CALL(shardline_stream_create_host("send", &send_stream));
  CALL(shardline_send(comm, in, kCount, shardlineFloat32, to, 5, send_stream, &sent));
  CALL(shardline_work_wait(sent, 30));
  CALL(shardline_work_wait(received, 30));
  int source = -2;
  CALL(shardline_work_source(received, &source));
  CHECK(source == from, "recv from any rank: source %d, want %d", source, from);
  for (size_t i = 0; i < kCount; ++i)
    CHECK(out[i] == Hash(9, from, i), "recv: element %zu from rank %d", i, from);
  shardline_work_destroy(sent);
  shardline_work_destroy(received);
  CALL(shardline_stream_destroy(send_stream));
  bad = shardline_send(comm, in, kCount, shardlineFloat32, rank, 0, stream, &work);
  CHECK(bad == shardlineInvalidArgument, "send to itself gave %s", shardline_result_string(bad));
  CHECK(strstr(shardline_last_error(), "itself") != NULL, "message: %s", shardline_last_error());
  bad = shardline_all_reduce(comm, product, product, kCount, shardlineFloat64, (shardlineRedOp_t)99,
                             stream, &work);
  CHECK(bad == shardlineInvalidArgument, "bad op gave %s", shardline_result_string(bad));
  CHECK(strstr(shardline_last_error(), "op") != NULL, "message: %s", shardline_last_error());
  free(in);
  free(out);
  CALL(shardline_stream_destroy(stream));
  return 0;
}

/* A framework's in-order executor: one thread runs the queued (fn, ctx) in order. Its enqueue is
 * the callback of shardline_stream_from_callbacks, and the framework queues its own compute on
 * it too. */
struct Task {
  void (*fn)(void*);
  void* ctx;
  struct Task* next;
};
struct Executor {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  struct Task *head, *tail;
  int stop, refuse, released;
  long ran;
  pthread_t thread;
};
static int ExecutorEnqueue(void* user, void (*fn)(void* ctx), void* ctx) {
  struct Executor* e = user;
  if (e->refuse) return 7;
  struct Task* task = malloc(sizeof(*task));
  if (task == NULL) return 1;
  task->fn = fn;
  task->ctx = ctx;
  task->next = NULL;
  pthread_mutex_lock(&e->mu);
  if (e->tail != NULL) {
    e->tail->next = task;
  } else {
    e->head = task;
  }
  e->tail = task;
  pthread_cond_signal(&e->cv);
  pthread_mutex_unlock(&e->mu);
  return 0;
}
static void* ExecutorLoop(void* arg) {
  struct Executor* e = arg;
  pthread_mutex_lock(&e->mu);
  for (;;) {
    while (e->head == NULL && !e->stop) pthread_cond_wait(&e->cv, &e->mu);
    struct Task* task = e->head;
    if (task == NULL) break;
    e->head = task->next;
    if (e->head == NULL) e->tail = NULL;
    pthread_mutex_unlock(&e->mu);
    task->fn(task->ctx);
    free(task);
    pthread_mutex_lock(&e->mu);
    ++e->ran;
  }
  pthread_mutex_unlock(&e->mu);
  return NULL;
}
static void ExecutorRelease(void* user) { ++((struct Executor*)user)->released; }
static void ExecutorStart(struct Executor* e) {
  memset(e, 0, sizeof(*e));
  pthread_mutex_init(&e->mu, NULL);
  pthread_cond_init(&e->cv, NULL);
  pthread_create(&e->thread, NULL, ExecutorLoop, e);
}
static void ExecutorStop(struct Executor* e) {
  pthread_mutex_lock(&e->mu);
  e->stop = 1;
  pthread_cond_signal(&e->cv);
  pthread_mutex_unlock(&e->mu);
  pthread_join(e->thread, NULL);
  pthread_cond_destroy(&e->cv);
  pthread_mutex_destroy(&e->mu);
}

/* The framework's compute as executor tasks: a unit's forward-backward, an SGD step. */
struct ComputeTask {
  int rank, step, unit;
  float* w[2];
  float* g[2];
  float* p;
  const float* grad;
  size_t n;
};
static void ForwardBackwardTask(void* ctx) {
  struct ComputeTask* t = ctx;
  ForwardBackward(t->rank, t->step, t->unit, t->w, t->g);
  free(t);
}
static void SgdTask(void* ctx) {
  struct ComputeTask* t = ctx;
  for (size_t i = 0; i < t->n; ++i) t->p[i] -= kLr * t->grad[i];
  free(t);
}

/* The initial values of unit u's tensors. */
static void InitialValues(int u, float values[2][64]) {
  for (int t = 0; t < 2; ++t)
    for (int64_t i = 0; i < kSizes[u][t]; ++i) values[t][i] = Initial(u, t, (size_t)i);
}

/* Registers the model's units (ids 0, 1, ...) with their initial values. */
static int RegisterUnits(shardlineScheduler_t sched) {
  for (int u = 0; u < UNITS; ++u) {
    int64_t w_shape[1] = {kSizes[u][0]}, b_shape[1] = {kSizes[u][1]};
    shardlineTensorSpec_t specs[2] = {{"w", w_shape, 1}, {"b", b_shape, 1}};
    char name[16];
    snprintf(name, sizeof(name), "unit%d", u);
    int id = -1;
    CALL(shardline_scheduler_register_unit(sched, name, specs, 2, &id));
    CHECK(id == u, "unit id %d, expected %d", id, u);
    float values[2][64];
    InitialValues(u, values);
    const void* pointers[2] = {values[0], values[1]};
    CALL(shardline_unit_set_values(sched, u, pointers, 2));
  }
  return 0;
}

/* STEPS training steps (SGD on the master shards between steps; given `compute`, the next
 * step's gathers wait for an event recorded after the optimizer), then every element this rank
 * owns is compared with the unsharded run. Given `executor` (the framework's stream behind
 * `compute`), the compute and the optimizer run there, asynchronously, as the framework's tasks
 * ordered with shardline's. */
/* `timed`: whether the scheduler times its communication (the metrics' exposed time and overlap
 * are known, >= 0, or unknown, < 0). */
static int TrainAndCheck(shardlineScheduler_t sched, int rank, size_t budget_bytes,
                         shardlineStream_t compute, struct Executor* executor, int timed) {
  for (int s = 0; s < STEPS; ++s) {
    for (int u = 0; u < UNITS; ++u) {
      CALL(shardline_pre_forward(sched, u));
      CALL(shardline_post_forward(sched, u));
    }
    for (int u = UNITS - 1; u >= 0; --u) {
      CALL(shardline_pre_backward(sched, u));
      float* w[2];
      float* g[2];
      for (int t = 0; t < 2; ++t) {
        void* data;
        size_t numel;
        CALL(shardline_unit_param(sched, u, t, &data, &numel));
        CHECK(numel == (size_t)kSizes[u][t], "numel %zu", numel);
        w[t] = data;
        CALL(shardline_unit_grad(sched, u, t, &data, &numel));
        g[t] = data;
      }
      if (executor != NULL) {
        struct ComputeTask* task = calloc(1, sizeof(*task));
        CHECK(task != NULL, "calloc");
        *task = (struct ComputeTask){rank, s, u, {w[0], w[1]}, {g[0], g[1]}, NULL, NULL, 0};
        CHECK(ExecutorEnqueue(executor, ForwardBackwardTask, task) == 0, "enqueue");
      } else {
        ForwardBackward(rank, s, u, w, g);
      }
      CALL(shardline_post_backward(sched, u));
    }
    CALL(shardline_finish_backward(sched));
    for (int u = 0; u < UNITS; ++u) {
      void* p;
      void* g;
      size_t n, m;
      CALL(shardline_unit_master_shard(sched, u, &p, &n));
      CALL(shardline_unit_shard_grad(sched, u, &g, &m));
      CHECK(n == m, "shard %zu vs grad %zu", n, m);
      if (executor != NULL) {
        struct ComputeTask* task = calloc(1, sizeof(*task));
        CHECK(task != NULL, "calloc");
        task->p = p;
        task->grad = g;
        task->n = n;
        CHECK(ExecutorEnqueue(executor, SgdTask, task) == 0, "enqueue");
      } else {
        for (size_t i = 0; i < n; ++i) ((float*)p)[i] -= kLr * ((const float*)g)[i];
      }
    }
    if (compute != NULL) { /* the next gathers wait for the optimizer through an event */
      shardlineEvent_t after_optimizer;
      CALL(shardline_event_record(compute, &after_optimizer));
      int done = 0;
      CALL(shardline_event_query(after_optimizer, &done));
      CHECK(executor != NULL || done == 1, "an event on a caller stream is complete once recorded");
      CALL(shardline_scheduler_set_post_optimizer_event(sched, after_optimizer));
      CALL(shardline_event_destroy(after_optimizer)); /* the scheduler keeps its own reference */
    }
    CALL(shardline_zero_grad(sched));
    shardlineStepMetrics_t metrics = SHARDLINE_STEP_METRICS_INIT;
    CALL(shardline_scheduler_metrics(sched, 30, &metrics));
    CHECK(metrics.step == s, "metrics of step %lld", (long long)metrics.step);
    CHECK(budget_bytes == 0 || metrics.peak_inflight_bytes <= budget_bytes,
          "peak %llu over the budget", (unsigned long long)metrics.peak_inflight_bytes);
    CHECK(metrics.bytes_gathered > 0 && metrics.bytes_reduced > 0, "no traffic in the metrics");
    CHECK(metrics.step_time_s >= 0 && metrics.host_hook_time_s > 0, "step %g s, hooks %g s",
          metrics.step_time_s, metrics.host_hook_time_s);
    CHECK(timed ? metrics.exposed_communication_s >= 0 && metrics.overlap_fraction >= 0
                : metrics.exposed_communication_s < 0 && metrics.overlap_fraction < 0,
          "%s scheduler: exposed %g s, overlap %g", timed ? "a timed" : "an untimed",
          metrics.exposed_communication_s, metrics.overlap_fraction);
  }
  if (compute != NULL) CALL(shardline_stream_synchronize(compute, 30));
  /* Every element this rank owns equals the unsharded run. */
  for (int u = 0; u < UNITS; ++u) {
    void* p;
    size_t n;
    CALL(shardline_unit_master_shard(sched, u, &p, &n));
    for (int t = 0; t < 2; ++t) {
      size_t first, count, offset;
      CALL(shardline_unit_shard_slice(sched, u, t, &first, &count, &offset));
      for (size_t i = 0; i < count; ++i) {
        const float got = ((const float*)p)[first + i];
        const float want = reference[u][t][offset + i];
        CHECK(fabsf(got - want) <= 1e-5f * (1.0f + fabsf(want)),
              "rank %d unit %d tensor %d element %zu: %g, unsharded %g", rank, u, t, offset + i,
              got, want);
      }
    }
  }
  return 0;
}

/* Creates a scheduler from the first `size` bytes of `config`, copied so that they end at a
 * PROT_NONE page: a library that read past struct_size would fault. */
static int CreateFromOlder(shardlineComm_t comm, shardlineStream_t compute,
                           const shardlineSchedulerConfig_t* config, size_t size,
                           shardlineScheduler_t* sched) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  unsigned char* pages =
      mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(pages != MAP_FAILED, "mmap failed");
  CHECK(mprotect(pages + page, page, PROT_NONE) == 0, "mprotect failed");
  shardlineSchedulerConfig_t* older = (shardlineSchedulerConfig_t*)(pages + page - size);
  memcpy(older, config, size);
  older->struct_size = size;
  const shardlineResult_t r = shardline_scheduler_create(comm, compute, older, 30, sched);
  munmap(pages, 2 * page);
  CHECK(r == shardlineSuccess, "a config of %zu bytes: %s: %s", size, shardline_result_string(r),
        shardline_last_error());
  return 0;
}

static int Train(shardlineComm_t comm, int rank) {
  shardlineStream_t compute;
  CALL(shardline_stream_create_caller("compute", &compute));
  shardlineSchedulerConfig_t config = SHARDLINE_SCHEDULER_CONFIG_INIT;
  config.forward_prefetch = 1;
  config.root_unit = -1;
  config.budget_bytes = 4096;
  /* A struct from a newer header (larger than this library knows) is refused. */
  shardlineSchedulerConfig_t newer = config;
  newer.struct_size = sizeof(config) + 8;
  shardlineScheduler_t sched;
  CHECK(shardline_scheduler_create(comm, compute, &newer, 30, &sched) == shardlineInvalidArgument,
        "a config of an unknown size was accepted");
  /* Older callers' structs, each ending at a guard page: the first release's (it ended with
   * reduce_op) is created and destroyed; one that ends before param_dtype trains below. Each
   * size is the end of its last field rounded up to the struct's alignment, as a compiler lays it
   * out (8: it holds size_t and pointers). */
  const size_t first_release =
      (offsetof(shardlineSchedulerConfig_t, reduce_op) + sizeof(shardlineRedOp_t) + 7) & ~(size_t)7;
  CHECK(first_release <= offsetof(shardlineSchedulerConfig_t, unsharded_allocator),
        "a field added after the first release lies in its padding");
  if (CreateFromOlder(comm, compute, &config, first_release, &sched) != 0) return 1;
  CALL(shardline_scheduler_destroy(sched));
  const size_t old_size = (offsetof(shardlineSchedulerConfig_t, param_dtype) + 7) & ~(size_t)7;
  if (CreateFromOlder(comm, compute, &config, old_size, &sched) != 0) return 1;
  if (RegisterUnits(sched) != 0) return 1;
  if (TrainAndCheck(sched, rank, config.budget_bytes, NULL, NULL, 1) != 0) return 1;
  /* A hook on an unknown unit is an error naming it. */
  CHECK(shardline_pre_forward(sched, 9) == shardlineInvalidArgument, "unit 9 accepted");
  CHECK(strstr(shardline_last_error(), "9") != NULL, "message: %s", shardline_last_error());
  CALL(shardline_scheduler_destroy(sched));
  /* The layout that ended with trace (before time_communication) trains timed; the whole struct
   * with time_communication = 0 trains the same, untimed. */
  const size_t second_release =
      (offsetof(shardlineSchedulerConfig_t, trace) + sizeof(shardlineTrace_t) + 7) & ~(size_t)7;
  CHECK(second_release <= offsetof(shardlineSchedulerConfig_t, time_communication),
        "time_communication lies in the padding of the layout before it");
  if (CreateFromOlder(comm, compute, &config, second_release, &sched) != 0) return 1;
  if (RegisterUnits(sched) != 0) return 1;
  if (TrainAndCheck(sched, rank, config.budget_bytes, NULL, NULL, 1) != 0) return 1;
  CALL(shardline_scheduler_destroy(sched));
  config.time_communication = 0;
  CALL(shardline_scheduler_create(comm, compute, &config, 30, &sched));
  if (RegisterUnits(sched) != 0) return 1;
  if (TrainAndCheck(sched, rank, config.budget_bytes, NULL, NULL, 0) != 0) return 1;
  CALL(shardline_scheduler_destroy(sched));
  CALL(shardline_stream_destroy(compute));
  return 0;
}

/* The framework's allocator: counts what it hands out and gets back, and the streams it is
 * given (NULL for host and caller streams). */
struct CountingAllocator {
  pthread_mutex_t mu;
  long allocs, frees, with_stream;
  long long live_bytes;
};
static int CountingAlloc(void* user, size_t bytes, void* stream, void** ptr) {
  struct CountingAllocator* a = user;
  *ptr = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
  if (*ptr == NULL) return 1;
  pthread_mutex_lock(&a->mu);
  ++a->allocs;
  a->with_stream += stream != NULL;
  a->live_bytes += (long long)bytes;
  pthread_mutex_unlock(&a->mu);
  return 0;
}
static void CountingFree(void* user, void* ptr, size_t bytes, void* stream) {
  struct CountingAllocator* a = user;
  free(ptr);
  pthread_mutex_lock(&a->mu);
  ++a->frees;
  a->with_stream += stream != NULL;
  a->live_bytes -= (long long)bytes;
  pthread_mutex_unlock(&a->mu);
}
/* A broken allocator: its pointers are 8 bytes past a 64-byte boundary. */
static int MisalignedAlloc(void* user, size_t bytes, void* stream, void** ptr) {
  struct CountingAllocator* a = user;
  (void)stream;
  unsigned char* base = aligned_alloc(64, (bytes + 8 + 63) & ~(size_t)63);
  if (base == NULL) return 1;
  *ptr = base + 8;
  pthread_mutex_lock(&a->mu);
  ++a->allocs;
  pthread_mutex_unlock(&a->mu);
  return 0;
}
static void MisalignedFree(void* user, void* ptr, size_t bytes, void* stream) {
  struct CountingAllocator* a = user;
  (void)bytes;
  (void)stream;
  free((unsigned char*)ptr - 8);
  pthread_mutex_lock(&a->mu);
  ++a->frees;
  pthread_mutex_unlock(&a->mu);
}
static int released[RANKS];
static void ReleaseShard(void* user, void* data) {
  ++released[*(int*)user];
  free(data);
}

/* Checks a written trace: Chrome-trace JSON holding the scheduler's gather track and the spans
 * of the units' all-gathers and reduce-scatters. */
static int CheckTrace(shardlineTrace_t trace, int rank) {
  size_t events = 0;
  CALL(shardline_trace_num_events(trace, &events));
  CHECK(events > 0, "empty trace");
  char path[128];
  snprintf(path, sizeof(path), "/tmp/shardline_c_api_test_%ld_%d.json", (long)getpid(), rank);
  CALL(shardline_trace_write(trace, path));
  FILE* file = fopen(path, "r");
  CHECK(file != NULL, "%s was not written", path);
  static char text[RANKS][1 << 20];
  const size_t length = fread(text[rank], 1, sizeof(text[rank]) - 1, file);
  fclose(file);
  remove(path);
  text[rank][length] = '\0';
  CHECK(text[rank][0] == '{' || text[rank][0] == '[', "not JSON: %.80s", text[rank]);
  CHECK(strstr(text[rank], "\"gather\"") != NULL, "no gather track: %.80s", text[rank]);
  CHECK(strstr(text[rank], "\"all_gather\"") != NULL &&
            strstr(text[rank], "\"reduce_scatter\"") != NULL,
        "the trace has no all_gather and reduce_scatter spans: %.80s", text[rank]);
  return 0;
}

/* The same training with everything the framework owns: the unsharded buffers and sharded
 * gradients from its allocators (with cpu_offload, the shards' allocator replaces the offload
 * memory), master shards in its own arrays (adopted), the post-optimizer event, a trace. */
static int TrainWithFrameworkMemory(shardlineComm_t comm, int rank, int cpu_offload) {
  static int ranks[RANKS] = {0, 1};
  released[rank] = 0;
  shardlineStream_t compute;
  CALL(shardline_stream_create_caller("compute", &compute));
  struct CountingAllocator unsharded = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0};
  struct CountingAllocator shard = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0};
  shardlineAllocator_t unsharded_allocator = SHARDLINE_ALLOCATOR_INIT;
  unsharded_allocator.user = &unsharded;
  unsharded_allocator.alloc = CountingAlloc;
  unsharded_allocator.free = CountingFree;
  shardlineAllocator_t shard_allocator = unsharded_allocator;
  shard_allocator.user = &shard;
  shardlineTrace_t trace;
  CALL(shardline_trace_create(rank, "c_api_test", &trace));
  shardlineSchedulerConfig_t config = SHARDLINE_SCHEDULER_CONFIG_INIT;
  config.root_unit = -1;
  config.budget_bytes = 4096;
  config.cpu_offload = cpu_offload;
  config.shard_allocator = &shard_allocator;
  config.trace = trace;
  shardlineAllocator_t incomplete = unsharded_allocator;
  incomplete.free = NULL;
  config.unsharded_allocator = &incomplete;
  shardlineScheduler_t sched;
  CHECK(shardline_scheduler_create(comm, compute, &config, 30, &sched) == shardlineInvalidArgument,
        "an allocator without free was accepted");
  CHECK(strstr(shardline_last_error(), "unsharded_allocator") != NULL, "message: %s",
        shardline_last_error());
  config.unsharded_allocator = &unsharded_allocator;
  CALL(shardline_scheduler_create(comm, compute, &config, 30, &sched));
  for (int u = 0; u < UNITS; ++u) {
    int64_t w_shape[1] = {kSizes[u][0]}, b_shape[1] = {kSizes[u][1]};
    shardlineTensorSpec_t specs[2] = {{"w", w_shape, 1}, {"b", b_shape, 1}};
    size_t elements = 0;
    CALL(shardline_scheduler_shard_elements(sched, specs, 2, &elements));
    CHECK(elements * RANKS >= (size_t)(kSizes[u][0] + kSizes[u][1]), "shard of %zu elements",
          elements);
    float* array = malloc(elements * sizeof(float));
    CHECK(array != NULL, "malloc");
    char name[16];
    snprintf(name, sizeof(name), "unit%d", u);
    int id = -1;
    /* The wrong size is refused, naming both sizes. */
    CHECK(shardline_scheduler_register_unit_adopted(sched, name, specs, 2, array,
                                                    elements * sizeof(float) - 4, ReleaseShard,
                                                    &ranks[rank], &id) == shardlineInvalidArgument,
          "a master shard of the wrong size was accepted");
    char sizes[64];
    snprintf(sizes, sizeof(sizes), "%zu bytes but this rank's shard needs %zu",
             elements * sizeof(float) - 4, elements * sizeof(float));
    CHECK(strstr(shardline_last_error(), sizes) != NULL, "message: %s", shardline_last_error());
    CALL(shardline_scheduler_register_unit_adopted(
        sched, name, specs, 2, array, elements * sizeof(float), ReleaseShard, &ranks[rank], &id));
    CHECK(id == u, "unit id %d, expected %d", id, u);
    /* A registration the scheduler refuses (the name is taken) leaves the array the caller's:
     * no release (ReleaseShard would free it, and this free would be a double free). */
    float* refused = malloc(elements * sizeof(float));
    CHECK(refused != NULL, "malloc");
    CHECK(shardline_scheduler_register_unit_adopted(sched, name, specs, 2, refused,
                                                    elements * sizeof(float), ReleaseShard,
                                                    &ranks[rank], &id) == shardlineInvalidArgument,
          "a second unit named %s was accepted", name);
    CHECK(strstr(shardline_last_error(), name) != NULL, "message: %s", shardline_last_error());
    CHECK(released[rank] == 0, "a refused master shard was released");
    free(refused);
    /* The initial values, written into the framework's array. */
    float values[2][64];
    InitialValues(u, values);
    const void* pointers[2] = {values[0], values[1]};
    CALL(shardline_unit_set_values(sched, u, pointers, 2));
    void* master;
    size_t n;
    CALL(shardline_unit_master_shard(sched, u, &master, &n));
    CHECK(master == array && n == elements, "the master shard is not the framework's array");
    for (int t = 0; t < 2; ++t) {
      size_t first, count, offset;
      CALL(shardline_unit_shard_slice(sched, u, t, &first, &count, &offset));
      for (size_t i = 0; i < count; ++i)
        CHECK(array[first + i] == values[t][offset + i], "unit %d tensor %d element %zu", u, t,
              offset + i);
    }
  }
  /* The optimizer steps on the arrays (they are the master shards); compared with the reference. */
  if (TrainAndCheck(sched, rank, config.budget_bytes, compute, NULL, 1) != 0) return 1;
  CHECK(unsharded.allocs > 0 && shard.allocs > 0, "the framework's allocators were not called");
  CALL(shardline_scheduler_destroy(sched));
  CHECK(unsharded.allocs == unsharded.frees && unsharded.live_bytes == 0,
        "unsharded allocator: %ld allocations, %ld frees, %lld bytes live after destroy",
        unsharded.allocs, unsharded.frees, unsharded.live_bytes);
  CHECK(shard.allocs == shard.frees && shard.live_bytes == 0,
        "shard allocator: %ld allocations, %ld frees, %lld bytes live after destroy", shard.allocs,
        shard.frees, shard.live_bytes);
  CHECK(unsharded.with_stream == 0 && shard.with_stream == 0,
        "a host stream's memory came with a stream handle");
  CHECK(released[rank] == UNITS, "%d adopted shards released, expected %d", released[rank], UNITS);
  if (CheckTrace(trace, rank) != 0) return 1;
  CALL(shardline_trace_destroy(trace));

  /* An allocator whose memory is misaligned: refused (InvalidArgument), the block given back. */
  struct CountingAllocator broken = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0};
  shardlineAllocator_t misaligned = SHARDLINE_ALLOCATOR_INIT;
  misaligned.user = &broken;
  misaligned.alloc = MisalignedAlloc;
  misaligned.free = MisalignedFree;
  config.shard_allocator = &misaligned;
  config.trace = NULL;
  CALL(shardline_scheduler_create(comm, compute, &config, 30, &sched));
  int64_t shape[1] = {kSizes[0][0]};
  shardlineTensorSpec_t spec = {"w", shape, 1};
  int id = -1;
  const shardlineResult_t r = shardline_scheduler_register_unit(sched, "w", &spec, 1, &id);
  CHECK(r == shardlineInvalidArgument && strstr(shardline_last_error(), "aligned") != NULL,
        "a misaligned master shard gave %s: %s", shardline_result_string(r),
        shardline_last_error());
  CALL(shardline_scheduler_destroy(sched));
  CHECK(broken.allocs == 1 && broken.frees == 1, "misaligned: %ld allocations, %ld frees",
        broken.allocs, broken.frees);
  CALL(shardline_stream_destroy(compute));
  return 0;
}

/* The training once more with the framework's own executor as the compute stream
 * (shardline_stream_from_callbacks): the hooks return at once, the compute and the optimizer run
 * on the executor, ordered with the scheduler's waits and events. Also: an executor that refuses
 * work fails the stream with a message. */
static int TrainOnFrameworkStream(shardlineComm_t comm, int rank) {
  struct Executor executor;
  ExecutorStart(&executor);
  shardlineStreamCallbacks_t callbacks = SHARDLINE_STREAM_CALLBACKS_INIT;
  callbacks.user = &executor;
  callbacks.enqueue = ExecutorEnqueue;
  callbacks.release = ExecutorRelease;
  shardlineStream_t compute;
  CALL(shardline_stream_from_callbacks("executor", &callbacks, &compute));
  shardlineSchedulerConfig_t config = SHARDLINE_SCHEDULER_CONFIG_INIT;
  config.root_unit = -1;
  config.budget_bytes = 4096;
  shardlineScheduler_t sched;
  CALL(shardline_scheduler_create(comm, compute, &config, 30, &sched));
  if (RegisterUnits(sched) != 0) return 1;
  if (TrainAndCheck(sched, rank, config.budget_bytes, compute, &executor, 1) != 0) return 1;
  CALL(shardline_scheduler_destroy(sched));
  CALL(shardline_stream_destroy(compute));
  CHECK(executor.released == 1, "the framework's stream was released %d times", executor.released);
  pthread_mutex_lock(&executor.mu);
  const long ran = executor.ran;
  pthread_mutex_unlock(&executor.mu);
  CHECK(ran > 0, "nothing ran on the framework's stream");

  /* An executor that refuses work: the call fails naming the code, the stream stays failed. */
  executor.refuse = 1;
  executor.released = 0;
  CALL(shardline_stream_from_callbacks("refusing", &callbacks, &compute));
  shardlineEvent_t event = NULL;
  shardlineResult_t r = shardline_event_record(compute, &event);
  CHECK(r == shardlineInternalError && strstr(shardline_last_error(), "returned 7") != NULL,
        "a refused enqueue gave %s: %s", shardline_result_string(r), shardline_last_error());
  CHECK(event == NULL, "an event was written on failure");
  executor.refuse = 0;
  r = shardline_stream_synchronize(compute, 30);
  CHECK(r == shardlineInternalError, "the failed stream synchronized with %s",
        shardline_result_string(r));
  CALL(shardline_stream_destroy(compute));
  CHECK(executor.released == 1, "released %d times", executor.released);
  callbacks.enqueue = NULL;
  CHECK(shardline_stream_from_callbacks("none", &callbacks, &compute) == shardlineInvalidArgument,
        "a stream without enqueue was accepted");
  ExecutorStop(&executor);
  return 0;
}

/* A framework's CUDA stream and event: shardlineUnimplemented without CUDA; with CUDA and no GPU
 * shardlineDeviceUnavailable (never a peer's error); a NULL event is InvalidArgument. Never a
 * crash. */
static int WrapCuda(void) {
  shardlineStream_t wrapped = NULL;
  shardlineResult_t r = shardline_stream_wrap_cuda(NULL, 0, "framework", &wrapped);
  CHECK(r == shardlineSuccess || r == shardlineUnimplemented || r == shardlineDeviceUnavailable,
        "shardline_stream_wrap_cuda: %s: %s", shardline_result_string(r), shardline_last_error());
  CHECK(r != shardlineSuccess || wrapped != NULL, "success without a stream");
  CHECK(r == shardlineSuccess || strstr(shardline_last_error(), "CUDA") != NULL, "message: %s",
        shardline_last_error());
  const int cuda_build = r != shardlineUnimplemented;
  if (r == shardlineSuccess) CALL(shardline_stream_destroy(wrapped));
  r = shardline_stream_wrap_cuda(NULL, 1 << 20, "framework", &wrapped);
  CHECK(r == (cuda_build ? shardlineDeviceUnavailable : shardlineUnimplemented),
        "shardline_stream_wrap_cuda on device 2^20: %s: %s", shardline_result_string(r),
        shardline_last_error());
  shardlineEvent_t event = NULL;
  r = shardline_event_wrap_cuda(NULL, 0, &event);
  CHECK(r == (cuda_build ? shardlineInvalidArgument : shardlineUnimplemented),
        "shardline_event_wrap_cuda(NULL): %s: %s", shardline_result_string(r),
        shardline_last_error());
  CHECK(event == NULL, "an event was written on failure");
  return 0;
}

/* A framework's own event, in C: pending until FwSignal; waiters are notified, never polled. */
struct FwEvent {
  pthread_mutex_t mu;
  int state; /* 0 pending, 1 done, -1 failed */
  void (*done[8])(void*, int);
  void* ctx[8];
  int waiters, released;
};
static int FwQuery(void* user) {
  struct FwEvent* e = user;
  pthread_mutex_lock(&e->mu);
  const int state = e->state;
  pthread_mutex_unlock(&e->mu);
  return state;
}
static void FwNotify(void* user, void (*done)(void*, int), void* ctx) {
  struct FwEvent* e = user;
  pthread_mutex_lock(&e->mu);
  if (e->state != 0 || e->waiters == 8) {
    const int failed = e->state < 0;
    pthread_mutex_unlock(&e->mu);
    done(ctx, failed); /* (a ninth waiter is told at once: never happens here) */
    return;
  }
  e->done[e->waiters] = done;
  e->ctx[e->waiters++] = ctx;
  pthread_mutex_unlock(&e->mu);
}
static void FwSignal(struct FwEvent* e, int state) {
  pthread_mutex_lock(&e->mu);
  e->state = state;
  const int n = e->waiters;
  e->waiters = 0;
  pthread_mutex_unlock(&e->mu);
  for (int i = 0; i < n; ++i) e->done[i](e->ctx[i], state < 0);
}
static void FwRelease(void* user) { ++((struct FwEvent*)user)->released; }
static void SetResult(void* user, shardlineResult_t result) { *(shardlineResult_t*)user = result; }

/* A host stream waits for a framework event; the framework hears of shardline's event. */
static int FrameworkEvents(void) {
  for (int fail = 0; fail <= 1; ++fail) {
    struct FwEvent fw = {PTHREAD_MUTEX_INITIALIZER, 0, {0}, {0}, 0, 0};
    shardlineEventCallbacks_t callbacks = SHARDLINE_EVENT_CALLBACKS_INIT;
    callbacks.user = &fw;
    callbacks.query = FwQuery;
    callbacks.notify = FwNotify;
    callbacks.release = FwRelease;
    shardlineEvent_t framework, after;
    shardlineStream_t stream;
    CALL(shardline_event_from_callbacks(&callbacks, &framework));
    CALL(shardline_stream_create_host("waits for the framework", &stream));
    CALL(shardline_stream_wait_event(stream, framework));
    CALL(shardline_event_record(stream, &after));
    shardlineResult_t heard = shardlineInternalError;
    CALL(shardline_event_on_complete(after, SetResult, &heard));
    int done = 1;
    CALL(shardline_event_query(after, &done));
    CHECK(done == 0, "the stream did not wait for the framework's event");
    CHECK(shardline_event_synchronize(after, 0.05) == shardlineTimeout,
          "synchronize returned before the framework's event completed");
    FwSignal(&fw, fail ? -1 : 1);
    const shardlineResult_t r = shardline_event_synchronize(after, 30);
    if (fail) {
      CHECK(r != shardlineSuccess, "a failed framework event did not fail the stream");
    } else {
      CHECK(r == shardlineSuccess, "%s", shardline_last_error());
    }
    CHECK(heard == r, "on_complete heard %s, synchronize %s", shardline_result_string(heard),
          shardline_result_string(r));
    CALL(shardline_event_destroy(after));
    CALL(shardline_event_destroy(framework));
    CALL(shardline_stream_destroy(stream));
    CHECK(fw.released == 1, "the framework's event was released %d times", fw.released);
  }
  return 0;
}

static void RunRank(const struct TestRank* a) {
  if (AllGather(a->comm, a->rank) != 0) return;
  if (Train(a->comm, a->rank) != 0) return;
  if (TrainWithFrameworkMemory(a->comm, a->rank, /*cpu_offload=*/0) != 0) return;
  if (TrainWithFrameworkMemory(a->comm, a->rank, /*cpu_offload=*/1) != 0) return;
  TrainOnFrameworkStream(a->comm, a->rank);
}

int main(void) {
  int version = 0;
  if (shardline_get_version(&version) != shardlineSuccess || version != SHARDLINE_VERSION_CODE) {
    fprintf(stderr, "version %d, header %d\n", version, SHARDLINE_VERSION_CODE);
    return 1;
  }
  Reference();
  if (RunRanks(RANKS, RunRank, NULL) != 0) return 1;
  FrameworkEvents();
  WrapCuda();
  if (ReportFailures("c_api_test") != 0) return 1;
  printf(
      "c_api_test: all-gather and 4 x %d scheduled training steps (shardline's memory, the "
      "framework's, the framework's with CPU offload, the framework's stream) on %d ranks "
      "match\n",
      STEPS, RANKS);
  return 0;
}
