/* File: bindings/c/shardline.h
 * -----------------------------------------------------------------------------
 * shardline's C API: a stable C11 ABI for frameworks that embed shardline from C or any language
 * with a C FFI. It wraps the C++ layers (communicators, streams, the FSDP scheduler) behind opaque
 * handles; no C++ type crosses it.
 *
 * Conventions
 *   - Every call returns a shardlineResult_t. On anything but shardlineSuccess,
 *     shardline_last_error() returns this thread's message for it: the full Status text, e.g.
 *     "INVALID_ARGUMENT: all_gather #3 on world (rank 0 of 2): count ...". Outputs are written
 *     only on success.
 *   - Handles are created by shardline_*_create / *_init (and *_wrap_cuda, *_from_callbacks,
 *     shardline_event_record) and released by the matching *_destroy (NULL is accepted and
 *     ignored). A handle must outlive the handles made from it (a scheduler its communicator
 *     and compute stream, a work item nothing: it holds what it needs).
 *   - Option structs begin with their size (`struct_size`) and the header's version, and are
 *     initialised with their *_INIT macro, which sets every default. A library newer than the
 *     caller's header reads only the first struct_size bytes and defaults the rest, so a program
 *     built against an older header keeps working; an unknown size larger than the library's is
 *     InvalidArgument. Fields are only ever appended, each at an offset at or past the sizeof of
 *     every older layout of its struct (the library checks this at compile time), so no older
 *     struct_size covers a newer field, not even through an older struct's trailing padding.
 *   - Timeouts are seconds (double); <= 0 means SHARDLINE_TIMEOUT_S (default 600).
 *
 * Thread safety: as the C++ API's (communicator.h, scheduler.h): collectives may be issued from
 * several threads; one thread at a time calls one scheduler's hooks; the error text is
 * per thread.
 */
#ifndef SHARDLINE_BINDINGS_C_SHARDLINE_H_
#define SHARDLINE_BINDINGS_C_SHARDLINE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define SHARDLINE_API __attribute__((visibility("default")))
#else
#define SHARDLINE_API
#endif

/* The version this header describes: major * 10000 + minor * 100 + patch. */
#define SHARDLINE_VERSION_MAJOR 0
#define SHARDLINE_VERSION_MINOR 1
#define SHARDLINE_VERSION_PATCH 0
#define SHARDLINE_VERSION_CODE \
  (SHARDLINE_VERSION_MAJOR * 10000 + SHARDLINE_VERSION_MINOR * 100 + SHARDLINE_VERSION_PATCH)

typedef enum {
  shardlineSuccess = 0,
  shardlineInvalidArgument = 1,    /* bad input: nothing was done */
  shardlineTimeout = 2,            /* a deadline passed */
  shardlineRemoteError = 3,        /* a peer died, disagreed or aborted */
  shardlineFailedPrecondition = 4, /* a call in the wrong state */
  shardlineNotFound = 5,
  shardlineResourceExhausted = 6, /* out of memory */
  shardlineUnimplemented = 7,     /* not supported here (e.g. CUDA calls in a build without CUDA) */
  shardlineInternalError = 8,
  shardlineDeviceUnavailable = 9, /* the device cannot be used: no GPU, no driver, a bad index */
  shardlineDataLoss = 10,      /* stored data is damaged: a truncated file, a checksum mismatch */
  shardlineAlreadyExists = 11, /* what a call would create exists (a checkpoint directory) */
  shardlineResultEnumMax = 0x7fffffff /* keeps the enum int-sized; not a result */
} shardlineResult_t;

typedef enum {
  shardlineFloat32 = 0,
  shardlineFloat64 = 1,
  shardlineFloat16 = 2,
  shardlineBfloat16 = 3,
  shardlineInt32 = 4,
  shardlineInt64 = 5,
  shardlineUint8 = 6,
  shardlineInt8 = 7,
  /* Makes every int a valid value of the type, so an unknown value from a newer or buggy caller
   * is an InvalidArgument, not undefined behaviour in the library. Not a dtype. */
  shardlineDataTypeEnumMax = 0x7fffffff
} shardlineDataType_t;

typedef enum {
  shardlineSum = 0,
  shardlineAvg = 1,
  shardlineMin = 2,
  shardlineMax = 3,
  shardlineProduct = 4,
  /* Makes every int a valid value of the type: an unknown op is an InvalidArgument, not
   * undefined behaviour in the library. Not an op. */
  shardlineRedOpEnumMax = 0x7fffffff
} shardlineRedOp_t;

typedef struct shardlineComm_s* shardlineComm_t;
typedef struct shardlineStream_s* shardlineStream_t;
typedef struct shardlineWork_s* shardlineWork_t;
typedef struct shardlineScheduler_s* shardlineScheduler_t;
typedef struct shardlineEvent_s* shardlineEvent_t;
typedef struct shardlineTrace_s* shardlineTrace_t;
typedef struct shardlineCheckpointer_s* shardlineCheckpointer_t;

/* ---- Version and errors ------------------------------------------------------------------- */
SHARDLINE_API shardlineResult_t shardline_get_version(int* version);
/* This thread's message for its last failed call ("" if none). Valid until its next call. */
SHARDLINE_API const char* shardline_last_error(void);
/* "shardlineSuccess", "shardlineInvalidArgument", ... */
SHARDLINE_API const char* shardline_result_string(shardlineResult_t result);

/* ---- Communicators ------------------------------------------------------------------------ */
typedef struct {
  size_t struct_size;
  int version;
  const char* backend; /* "ucx" (default, host memory, processes) or "nccl" (CUDA builds) */
  double timeout_s;    /* <= 0: SHARDLINE_TIMEOUT_S */
} shardlineInitConfig_t;
#define SHARDLINE_INIT_CONFIG_INIT \
  { sizeof(shardlineInitConfig_t), SHARDLINE_VERSION_CODE, "ucx", 0.0 }

/* Joins the job the launcher started (torchrun / shardline-launch, mpirun, srun environments). */
SHARDLINE_API shardlineResult_t shardline_comm_init(const shardlineInitConfig_t* config,
                                                    shardlineComm_t* world);
/* `size` communicators of one in-process group (ranks as threads; tests, experiments):
 * comms[r] is rank r. */
SHARDLINE_API shardlineResult_t shardline_comm_init_local(int size, double timeout_s,
                                                          shardlineComm_t* comms);
SHARDLINE_API shardlineResult_t shardline_comm_rank(shardlineComm_t comm, int* rank);
SHARDLINE_API shardlineResult_t shardline_comm_size(shardlineComm_t comm, int* size);
SHARDLINE_API shardlineResult_t shardline_comm_destroy(shardlineComm_t comm);

/* ---- Streams ------------------------------------------------------------------------------ */
/* A stream with its own worker thread (asynchronous), or one whose work runs on the calling
 * thread (the compute stream of a CPU framework). */
SHARDLINE_API shardlineResult_t shardline_stream_create_host(const char* name,
                                                             shardlineStream_t* stream);
SHARDLINE_API shardlineResult_t shardline_stream_create_caller(const char* name,
                                                               shardlineStream_t* stream);
/* A framework's own stream of host work (a CPU framework's in-order executor queue), through
 * callbacks, so that shardline orders its work on it:
 *   enqueue  appends `fn(ctx)` to the framework's stream and returns 0 (non-zero: it cannot;
 *            the shardline call fails with shardlineInternalError and the stream stays failed).
 *            The framework must call every fn it accepted exactly once, in the order enqueued,
 *            one at a time, after the work enqueued on its stream before it, on any thread
 *            (also inside enqueue itself: the stream then behaves as a caller stream). A fn
 *            runs shardline's host work (casts, copies, fills of host memory), completes
 *            events, or blocks the thread until an event of another stream completes (at most
 *            SHARDLINE_TIMEOUT_S; then the stream fails with shardlineTimeout).
 *   release  (optional) called by shardline_stream_destroy, which first waits until every
 *            accepted fn has run (at most SHARDLINE_TIMEOUT_S; fns still pending then are
 *            logged, and may still run later). Not called if this call fails.
 * Its device is the host, as for host and caller streams. Events recorded on it are shardline's
 * (shardline_event_record); other streams wait for them without polling. Work that fails fails
 * the stream: later fns skip their work, and events recorded after it report the error. As a
 * scheduler's compute stream, the hooks return without waiting for it: the framework enqueues
 * its compute on its stream after each hook, and the views stay valid for that work. */
typedef struct {
  size_t struct_size;
  int version;
  void* user;
  int (*enqueue)(void* user, void (*fn)(void* ctx), void* ctx);
  void (*release)(void* user);
} shardlineStreamCallbacks_t;
#define SHARDLINE_STREAM_CALLBACKS_INIT \
  { sizeof(shardlineStreamCallbacks_t), SHARDLINE_VERSION_CODE, NULL, NULL, NULL }
SHARDLINE_API shardlineResult_t shardline_stream_from_callbacks(
    const char* name, const shardlineStreamCallbacks_t* callbacks, shardlineStream_t* stream);
SHARDLINE_API shardlineResult_t shardline_stream_synchronize(shardlineStream_t stream,
                                                             double timeout_s);
SHARDLINE_API shardlineResult_t shardline_stream_destroy(shardlineStream_t stream);

/* ---- Collectives (counts as in NCCL; in-place forms as in communicator.h) ------------------ */
SHARDLINE_API shardlineResult_t shardline_all_gather(shardlineComm_t comm, const void* input,
                                                     void* output, size_t count,
                                                     shardlineDataType_t dtype,
                                                     shardlineStream_t stream,
                                                     shardlineWork_t* work);
SHARDLINE_API shardlineResult_t shardline_reduce_scatter(
    shardlineComm_t comm, const void* input, void* output, size_t count, shardlineDataType_t dtype,
    shardlineRedOp_t op, shardlineStream_t stream, shardlineWork_t* work);
SHARDLINE_API shardlineResult_t shardline_all_reduce(shardlineComm_t comm, const void* input,
                                                     void* output, size_t count,
                                                     shardlineDataType_t dtype, shardlineRedOp_t op,
                                                     shardlineStream_t stream,
                                                     shardlineWork_t* work);
SHARDLINE_API shardlineResult_t shardline_broadcast(shardlineComm_t comm, void* buffer,
                                                    size_t count, shardlineDataType_t dtype,
                                                    int root, shardlineStream_t stream,
                                                    shardlineWork_t* work);

/* ---- Point-to-point (the rules in collectives/communicator.h) ----------------------------- */
/* `count` elements to rank `peer`, or from rank `peer` (shardline_recv: SHARDLINE_ANY_SOURCE
 * receives from any rank; shardline_work_source tells which), matched by `tag`. Outside the
 * collectives' issue order. Local and ucx communicators (a tag above 2^36 - 1 is
 * shardlineInvalidArgument on ucx); elsewhere shardlineUnimplemented, naming the backend. */
#define SHARDLINE_ANY_SOURCE (-1)
SHARDLINE_API shardlineResult_t shardline_send(shardlineComm_t comm, const void* data, size_t count,
                                               shardlineDataType_t dtype, int peer, uint64_t tag,
                                               shardlineStream_t stream, shardlineWork_t* work);
SHARDLINE_API shardlineResult_t shardline_recv(shardlineComm_t comm, void* data, size_t count,
                                               shardlineDataType_t dtype, int peer, uint64_t tag,
                                               shardlineStream_t stream, shardlineWork_t* work);
/* A completed receive: the rank its data came from (-1 before it completed, if it failed, and
 * for every other operation). */
SHARDLINE_API shardlineResult_t shardline_work_source(shardlineWork_t work, int* source);

/* Blocks until the collective finished (its error if it failed) or the timeout passed. */
SHARDLINE_API shardlineResult_t shardline_work_wait(shardlineWork_t work, double timeout_s);
SHARDLINE_API shardlineResult_t shardline_work_is_completed(shardlineWork_t work, int* completed);
SHARDLINE_API shardlineResult_t shardline_work_destroy(shardlineWork_t work);

/* A framework's CUDA stream (a cudaStream_t, passed as void*) of cuda:`device`, wrapped without
 * taking it over: shardline enqueues on it and waits with cudaStreamWaitEvent; the framework keeps
 * it alive until the wrapping stream is destroyed. NULL is the device's legacy default stream.
 * CUDA builds only: elsewhere shardlineUnimplemented. shardlineDeviceUnavailable if cuda:`device`
 * cannot be used (no GPU or driver, an index out of range); InvalidArgument for
 * cudaStreamPerThread or a stream of another device. */
SHARDLINE_API shardlineResult_t shardline_stream_wrap_cuda(void* cuda_stream, int device,
                                                           const char* name,
                                                           shardlineStream_t* stream);

/* Events: a point in a stream's work. Recorded on a shardline stream, or a framework's cudaEvent_t
 * (void*) wrapped without taking it over (CUDA builds only: elsewhere shardlineUnimplemented;
 * shardlineDeviceUnavailable and InvalidArgument as for shardline_stream_wrap_cuda, and
 * InvalidArgument for a NULL or unusable event). */
SHARDLINE_API shardlineResult_t shardline_event_record(shardlineStream_t stream,
                                                       shardlineEvent_t* event);
SHARDLINE_API shardlineResult_t shardline_event_wrap_cuda(void* cuda_event, int device,
                                                          shardlineEvent_t* event);
/* Work enqueued on `stream` from now on waits for `event` (the host does not block, except on a
 * caller stream, whose waits block the calling thread, and on a callback stream whose enqueue
 * runs its fn at once). */
SHARDLINE_API shardlineResult_t shardline_stream_wait_event(shardlineStream_t stream,
                                                            shardlineEvent_t event);
/* Blocks until the event's work is done: success, its stream's error, or shardlineTimeout. */
SHARDLINE_API shardlineResult_t shardline_event_synchronize(shardlineEvent_t event,
                                                            double timeout_s);
/* *done = 1 once the event's work finished (successfully or not; the result says which). */
SHARDLINE_API shardlineResult_t shardline_event_query(shardlineEvent_t event, int* done);
SHARDLINE_API shardlineResult_t shardline_event_destroy(shardlineEvent_t event);
/* A framework's own event (of any device), through callbacks, so that shardline streams can wait
 * for the framework's work: `query(user)` returns 1 once the event's work is done, 0 while it
 * runs, and a negative value if it failed; `notify(user, done, ctx)` must arrange for
 * `done(ctx, failed)` to be called exactly once when the work completes (at once if it already
 * has), from any thread, without blocking; `release(user)` (optional) is called when shardline
 * no longer needs the event. Such an event cannot be recorded on a shardline stream. */
typedef struct {
  size_t struct_size;
  int version;
  void* user;
  int (*query)(void* user);
  void (*notify)(void* user, void (*done)(void* ctx, int failed), void* ctx);
  void (*release)(void* user);
} shardlineEventCallbacks_t;
#define SHARDLINE_EVENT_CALLBACKS_INIT \
  { sizeof(shardlineEventCallbacks_t), SHARDLINE_VERSION_CODE, NULL, NULL, NULL, NULL }
SHARDLINE_API shardlineResult_t
shardline_event_from_callbacks(const shardlineEventCallbacks_t* callbacks, shardlineEvent_t* event);
/* The other direction: `callback(user, result)` runs once the work captured by `event` completes
 * (result shardlineSuccess or the failure's code; shardline_last_error is not set for it), at
 * once on this thread if it already has, else on the thread that completes it: it must be short
 * and must not block (enqueue the framework's own signal). */
SHARDLINE_API shardlineResult_t shardline_event_on_complete(
    shardlineEvent_t event, void (*callback)(void* user, shardlineResult_t result), void* user);

/* ---- Traces ---------------------------------------------------------------------------------
 * A Chrome trace (Perfetto, chrome://tracing) of one rank: give it to a scheduler through
 * shardlineSchedulerConfig_t.trace (it then records the spans of its streams and the memory in
 * flight) and write it after the steps. A trace must outlive the schedulers that record into it. */
SHARDLINE_API shardlineResult_t shardline_trace_create(int rank, const char* process_name,
                                                       shardlineTrace_t* trace);
/* Writes the trace as JSON to `path` (atomically: a temporary file renamed into place). */
SHARDLINE_API shardlineResult_t shardline_trace_write(shardlineTrace_t trace, const char* path);
/* The number of events recorded so far. */
SHARDLINE_API shardlineResult_t shardline_trace_num_events(shardlineTrace_t trace, size_t* events);
SHARDLINE_API shardlineResult_t shardline_trace_destroy(shardlineTrace_t trace);

/* ---- Memory from the framework ---------------------------------------------------------------
 * A framework's allocator, so that the scheduler's buffers live in the framework's own pool
 * (shardlineSchedulerConfig_t.unsharded_allocator and .shard_allocator). The memory is of the
 * compute stream's device: host memory for host, caller and callback streams, memory of cuda:N
 * for a (wrapped) CUDA stream; with cpu_offload the shards are host memory (see the config).
 *   alloc   returns 0 and sets *ptr, aligned to at least 64 bytes (a misaligned pointer is
 *           given back to `free` and the call fails with InvalidArgument), or returns non-zero
 *           when it has no memory (the scheduler call then fails with
 *           shardlineResourceExhausted). `stream` is the cudaStream_t of the CUDA stream that
 *           will first use the memory (for the unsharded buffers, one of the scheduler's own
 *           gather and reduce streams), or NULL: on the host, and for the shards and sharded
 *           gradients, which are allocated with no stream.
 *   free    receives memory only once every stream that used it is done with it, so its
 *           `stream` is always NULL and the memory may be reused at once.
 * shardline keeps no cache on top: every gather allocates and every reshard frees, so the
 * framework's allocator should cache, as PyTorch's caching allocator does (a second cache on
 * top would hold memory the framework can neither see nor release). alloc and free run only
 * during calls on the scheduler (registering units, the hooks, destroy, ...), on the calling
 * thread, so for one scheduler never concurrently with each other; a `user` shared by several
 * schedulers (ranks as threads) needs its own lock. Every block is back at `free` when
 * shardline_scheduler_destroy returns (unless work on a stream never finished: its blocks are
 * then leaked, and logged, after SHARDLINE_TIMEOUT_S rather than freed under a reader). */
typedef struct {
  size_t struct_size;
  int version;
  void* user;
  int (*alloc)(void* user, size_t bytes, void* stream, void** ptr);
  void (*free)(void* user, void* ptr, size_t bytes, void* stream);
} shardlineAllocator_t;
#define SHARDLINE_ALLOCATOR_INIT \
  { sizeof(shardlineAllocator_t), SHARDLINE_VERSION_CODE, NULL, NULL, NULL }

/* ---- The FSDP scheduler (scheduler/scheduler.h, docs/scheduler.md) ------------------------- */
typedef enum {
  shardlineFullShard = 0,
  shardlineShardGradOp = 1,
  shardlineNoShard = 2,
  shardlineHybridShard = 3,
  shardlineShardingStrategyEnumMax = 0x7fffffff /* not a strategy */
} shardlineShardingStrategy_t;

typedef enum {
  shardlineBackwardPrefetchOff = 0,
  shardlineBackwardPrefetchBeforeGrad = 1,
  shardlineBackwardPrefetchAfterGrad = 2,
  shardlineBackwardPrefetchEnumMax = 0x7fffffff /* not a mode */
} shardlineBackwardPrefetch_t;

typedef struct {
  size_t struct_size;
  int version;
  const char* name;                     /* "fsdp" */
  shardlineShardingStrategy_t strategy; /* full shard */
  int shard_size;                       /* hybrid: the shard group's size (0: ranks per host) */
  int forward_prefetch;                 /* 1 */
  shardlineBackwardPrefetch_t backward_prefetch; /* before the gradient */
  int backward_prefetch_depth;                   /* 1 */
  size_t budget_bytes;                           /* 0: unlimited */
  int budget_units;                              /* 0: unlimited */
  int root_unit;                                 /* 0; -1: none */
  int cpu_offload;                               /* 0 */
  shardlineDataType_t param_dtype;               /* f32: every unit's mixed-precision policy */
  shardlineDataType_t reduce_dtype;              /* f32 */
  shardlineRedOp_t reduce_op;                    /* avg (or sum) */
  /* Added after the first release (whose struct ended here, sizeof 80 on LP64); read only
   * when struct_size covers them. */
  /* Unsharded parameters, gradients and reduction temporaries from the framework (the struct is
   * copied at create; the callbacks' `user` must outlive the scheduler): memory of the compute
   * stream's device. NULL: shardline's own caching pools. */
  const shardlineAllocator_t* unsharded_allocator;
  /* Master shards and sharded gradients (of units not registered with adopted memory) from the
   * framework: memory of the compute stream's device, or host memory with cpu_offload (it then
   * replaces the pinned or host memory shardline would take for the offloaded shards). NULL:
   * shardline's own memory. */
  const shardlineAllocator_t* shard_allocator;
  /* The trace the scheduler's streams record into (see Traces); NULL: none. */
  shardlineTrace_t trace;
  /* Added after trace (the struct then ended at trace, sizeof 104 on LP64). Whether the step
   * metrics time the communication (SchedulerOptions::time_communication): 0 records no timing
   * events in the hooks, and the metrics' exposed_communication_s and overlap_fraction are then
   * < 0 (unknown); counts, bytes, budget figures, step_time_s and host_hook_time_s stay. */
  int time_communication; /* 1 */
} shardlineSchedulerConfig_t;
#define SHARDLINE_SCHEDULER_CONFIG_INIT                                                           \
  {                                                                                               \
    sizeof(shardlineSchedulerConfig_t), SHARDLINE_VERSION_CODE, "fsdp", shardlineFullShard, 0, 1, \
        shardlineBackwardPrefetchBeforeGrad, 1, 0, 0, 0, 0, shardlineFloat32, shardlineFloat32,   \
        shardlineAvg, NULL, NULL, NULL, 1                                                         \
  }

typedef struct {
  const char* name;
  const int64_t* shape; /* ndim dims */
  int ndim;
} shardlineTensorSpec_t;

/* Collective over the communicator's group; the compute stream must outlive the scheduler. */
SHARDLINE_API shardlineResult_t shardline_scheduler_create(shardlineComm_t world,
                                                           shardlineStream_t compute,
                                                           const shardlineSchedulerConfig_t* config,
                                                           double timeout_s,
                                                           shardlineScheduler_t* scheduler);
SHARDLINE_API shardlineResult_t shardline_scheduler_destroy(shardlineScheduler_t scheduler);
/* Registers a unit of f32 tensors (master dtype f32) before the first step; *unit = its id. */
SHARDLINE_API shardlineResult_t
shardline_scheduler_register_unit(shardlineScheduler_t scheduler, const char* name,
                                  const shardlineTensorSpec_t* tensors, int num_tensors, int* unit);
/* The number of f32 elements (padding included) of this rank's master shard for a unit of
 * `tensors`: the size a framework-owned master shard must have. */
SHARDLINE_API shardlineResult_t shardline_scheduler_shard_elements(
    shardlineScheduler_t scheduler, const shardlineTensorSpec_t* tensors, int num_tensors,
    size_t* elements);
/* Registers a unit whose master shard is the framework's memory, so the framework's optimizer
 * steps on its own tensors: `bytes` at `master_shard`, exactly shard_elements * 4 bytes (else
 * InvalidArgument naming both sizes; NULL only when that is 0), of the compute stream's device
 * (host memory for host and caller streams and with cpu_offload, else memory of cuda:N). Its
 * contents are taken as this rank's shard of the initial values; shardline_unit_set_values writes
 * them into it (and zeroes the padding), shardline_unit_shard_slice tells where each tensor's
 * elements lie. The scheduler never frees it. On success it calls `release(user, master_shard)`
 * (if `release` is given) once it no longer uses the memory: during shardline_scheduler_destroy,
 * or after it, once device work still reading the shard has finished; `release` may run on any
 * thread (a stream's worker, a CUDA callback thread) and must be short, must not block and must
 * not call CUDA. On failure `release` is not called: the memory stays the caller's. */
SHARDLINE_API shardlineResult_t shardline_scheduler_register_unit_adopted(
    shardlineScheduler_t scheduler, const char* name, const shardlineTensorSpec_t* tensors,
    int num_tensors, void* master_shard, size_t bytes, void (*release)(void* user, void* data),
    void* user, int* unit);
/* The event after the optimizer's last write of the master shards: the next step's gathers wait
 * for it instead of the compute stream (FSDP2's set_post_optim_event). */
SHARDLINE_API shardlineResult_t shardline_scheduler_set_post_optimizer_event(
    shardlineScheduler_t scheduler, shardlineEvent_t event);
/* The initial values: values[t] points at tensor t's elements (f32, row-major). */
SHARDLINE_API shardlineResult_t shardline_unit_set_values(shardlineScheduler_t scheduler, int unit,
                                                          const void* const* values,
                                                          int num_tensors);
SHARDLINE_API shardlineResult_t shardline_pre_forward(shardlineScheduler_t scheduler, int unit);
SHARDLINE_API shardlineResult_t shardline_post_forward(shardlineScheduler_t scheduler, int unit);
SHARDLINE_API shardlineResult_t shardline_end_forward(shardlineScheduler_t scheduler);
SHARDLINE_API shardlineResult_t shardline_pre_backward(shardlineScheduler_t scheduler, int unit);
SHARDLINE_API shardlineResult_t shardline_post_backward(shardlineScheduler_t scheduler, int unit);
SHARDLINE_API shardlineResult_t shardline_finish_backward(shardlineScheduler_t scheduler);
SHARDLINE_API shardlineResult_t shardline_zero_grad(shardlineScheduler_t scheduler);

/* The unsharded parameter / gradient of tensor `tensor` (param dtype), valid between the unit's
 * Pre and Post hooks (gradients: backward only; add into them). */
SHARDLINE_API shardlineResult_t shardline_unit_param(shardlineScheduler_t scheduler, int unit,
                                                     int tensor, void** data, size_t* numel);
SHARDLINE_API shardlineResult_t shardline_unit_grad(shardlineScheduler_t scheduler, int unit,
                                                    int tensor, void** data, size_t* numel);
/* This rank's master shard and sharded gradient (f32, the layout's shard: `elements` including
 * padding), and the element range [*first, *first + *count) of tensor `tensor` within it and
 * the tensor's element where that range starts (*tensor_offset); *count = 0 if the shard holds
 * none of it. For the framework's optimizer, between steps. */
SHARDLINE_API shardlineResult_t shardline_unit_master_shard(shardlineScheduler_t scheduler,
                                                            int unit, void** data,
                                                            size_t* elements);
SHARDLINE_API shardlineResult_t shardline_unit_shard_grad(shardlineScheduler_t scheduler, int unit,
                                                          void** data, size_t* elements);
SHARDLINE_API shardlineResult_t shardline_unit_shard_slice(shardlineScheduler_t scheduler, int unit,
                                                           int tensor, size_t* first, size_t* count,
                                                           size_t* tensor_offset);

typedef struct {
  size_t struct_size;
  int version;
  int64_t step;
  uint64_t bytes_gathered;
  uint64_t bytes_reduced;
  uint64_t budget_bytes;
  uint64_t peak_inflight_bytes;
  int peak_inflight_units;
  int budget_overshoots;
  int deferred_prefetches;
  int order_deviations;
  double step_time_s;             /* < 0: unknown (untimed events) */
  double exposed_communication_s; /* < 0: unknown */
  double overlap_fraction;        /* < 0: unknown */
  double host_hook_time_s;
} shardlineStepMetrics_t;
#define SHARDLINE_STEP_METRICS_INIT                                                              \
  {                                                                                              \
    sizeof(shardlineStepMetrics_t), SHARDLINE_VERSION_CODE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, \
        0.0, 0.0                                                                                 \
  }

/* The last finished step's metrics (waits for their events). */
SHARDLINE_API shardlineResult_t shardline_scheduler_metrics(shardlineScheduler_t scheduler,
                                                            double timeout_s,
                                                            shardlineStepMetrics_t* metrics);

/* ---- Checkpoints (scheduler/checkpoint/checkpoint.h, docs/checkpoints.md) -------------------
 * Sharded checkpoints of a scheduler's units: every rank writes its shard of every unit's master
 * shard and of any number of named shard-shaped states the framework registers (an optimizer's
 * moments), rank 0 writes the manifest; a load at any world size or mesh gives back the saved
 * bits. A file system shared by all ranks is assumed. */
typedef struct {
  size_t struct_size;
  int version;
  /* A save checksums each piece in blocks of this many bytes (>= 1; stored in the manifest, a
   * load uses the manifest's): how much a load may read beyond what it needs. */
  uint64_t checksum_block_bytes; /* 1 MiB */
  size_t read_chunk_bytes;       /* the most a load reads at once (>= 1): 8 MiB */
  /* The most host memory (bytes) a background save (shardline_checkpointer_save_async) may copy
   * this rank's shards and states into; 0: no cap (the default). A save_async whose largest
   * snapshot would exceed it fails on every rank with shardlineResourceExhausted before anything
   * is written. */
  uint64_t max_snapshot_bytes;
} shardlineCheckpointConfig_t;
#define SHARDLINE_CHECKPOINT_CONFIG_INIT                                            \
  {                                                                                 \
    sizeof(shardlineCheckpointConfig_t), SHARDLINE_VERSION_CODE, (uint64_t)1 << 20, \
        (size_t)8 << 20, 0                                                          \
  }

/* What the latest save (save or save_async) cost this rank: shardline_checkpointer_last_save_stats.
 */
typedef struct {
  size_t struct_size;
  int version;
  int background; /* 1: save_async; 0: save */
  int finished;   /* 0 while a background save is pending */
  /* The host copy of this rank's shards save_async made (0 for save and for ranks that write
   * nothing), and the memory held for it (kept for the next background save). */
  uint64_t snapshot_bytes;
  uint64_t snapshot_capacity_bytes;
  double blocked_s;  /* how long the call kept the caller (all of a save) */
  double waited_s;   /* of it: the wait for an earlier pending save */
  double snapshot_s; /* of it: the copy into the snapshot */
  double write_s;    /* save_async: the background thread's time; 0 for save */
} shardlineCheckpointSaveStats_t;
#define SHARDLINE_CHECKPOINT_SAVE_STATS_INIT \
  { sizeof(shardlineCheckpointSaveStats_t), SHARDLINE_VERSION_CODE, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0 }

/* Collective over the scheduler's world, after its units are registered. The scheduler must
 * outlive the checkpointer. config NULL: the defaults. */
SHARDLINE_API shardlineResult_t shardline_checkpointer_create(
    shardlineScheduler_t scheduler, const shardlineCheckpointConfig_t* config, double timeout_s,
    shardlineCheckpointer_t* checkpointer);
/* Registers a shard-shaped state of `unit`, saved and loaded with its master shard: `bytes` at
 * `data`, exactly the unit's shard elements (shardline_unit_master_shard's `elements`, padding
 * included) times the size of `dtype` (else InvalidArgument naming both sizes), laid out like the
 * master shard (element i belongs to the tensor element of master element i), host memory that
 * outlives the checkpointer (the framework keeps it; a load overwrites it). `name`: 1-128
 * characters of [A-Za-z0-9._-], not "master", unique per unit. Every rank registers the same
 * states in the same order. */
SHARDLINE_API shardlineResult_t
shardline_checkpointer_add_state(shardlineCheckpointer_t checkpointer, int unit, const char* name,
                                 void* data, size_t bytes, shardlineDataType_t dtype);
/* Saves every unit and registered state into the new directory `dir` (AlreadyExists if it
 * exists), atomically: written under a temporary name beside it, fsynced, then renamed. Collective
 * over the world, between steps, with the same `dir` on every rank; every rank returns the same
 * result (a peer's failure as shardlineRemoteError, its message prefixed "failed on rank N"). */
SHARDLINE_API shardlineResult_t shardline_checkpointer_save(shardlineCheckpointer_t checkpointer,
                                                            const char* dir, double timeout_s);
/* Loads the checkpoint in `dir` (saved at any world size or mesh) into every unit's master shard
 * and every registered state (states in the checkpoint that are not registered are skipped).
 * Collective as save. NotFound: no such directory, or a data file or a registered state missing;
 * FailedPrecondition: an incomplete checkpoint (a save's temporary directory); InvalidArgument: a
 * manifest that does not match the units (names, tensors, shapes) or the states' dtypes;
 * DataLoss: a file of the wrong size or a checksum mismatch (the shards' contents are then
 * unspecified). Each message names the checkpoint, file, unit, state and tensor concerned. */
SHARDLINE_API shardlineResult_t shardline_checkpointer_load(shardlineCheckpointer_t checkpointer,
                                                            const char* dir, double timeout_s);
/* Registers a replicated state: the same on every rank, any shape (a step counter, a learning
 * rate schedule's position): numel(shape) elements of `dtype`, row-major, at `data` (host memory
 * that outlives the checkpointer; may be NULL only with no elements). ndim 0 is a scalar (shape
 * may then be NULL). A save writes rank 0's copy once; a load gives every rank that copy. `name`:
 * 1-128 characters of [A-Za-z0-9._-], unique among the replicated states. Every rank registers the
 * same ones (names, shapes, dtypes) in the same order. */
SHARDLINE_API shardlineResult_t shardline_checkpointer_add_replicated_state(
    shardlineCheckpointer_t checkpointer, const char* name, void* data, const int64_t* shape,
    int ndim, shardlineDataType_t dtype);
/* shardline_checkpointer_save in the background: the call (collective, between steps, as save)
 * copies this rank's shards and states into host memory (the snapshot; max_snapshot_bytes caps
 * it) and returns; a background thread writes the files, the ranks exchange their outcomes on the
 * checkpointer's own communicator, and rank 0 publishes, as save does. The shards and states may
 * change as soon as it returns (the next step may run). An error returned here (the same on every
 * rank) means nothing runs in the background. A later save, save_async or load waits for the
 * pending one first (and returns its error if it failed and nobody collected it). Every wait of
 * the background part is bounded by timeout_s. */
SHARDLINE_API shardlineResult_t shardline_checkpointer_save_async(
    shardlineCheckpointer_t checkpointer, const char* dir, double timeout_s);
/* Waits for the pending background save and returns its outcome, the same on every rank as
 * save's (shardlineSuccess if none is pending; each outcome is returned once). shardlineTimeout if
 * it is still running after timeout_s (it stays pending: wait again). Not collective. */
SHARDLINE_API shardlineResult_t
shardline_checkpointer_wait_for_save(shardlineCheckpointer_t checkpointer, double timeout_s);
/* *pending = 1 while a background save was started and its outcome not yet returned. */
SHARDLINE_API shardlineResult_t
shardline_checkpointer_save_pending(shardlineCheckpointer_t checkpointer, int* pending);
/* The latest save's figures (of the pending one while it runs); stats initialised with
 * SHARDLINE_CHECKPOINT_SAVE_STATS_INIT (only struct_size bytes are written). */
SHARDLINE_API shardlineResult_t shardline_checkpointer_last_save_stats(
    shardlineCheckpointer_t checkpointer, shardlineCheckpointSaveStats_t* stats);
/* Waits for a pending background save (bounded by its own timeout; a failure nobody collected is
 * logged), then frees the checkpointer. */
SHARDLINE_API shardlineResult_t
shardline_checkpointer_destroy(shardlineCheckpointer_t checkpointer);

/* ---- Full weights as safetensors (scheduler/checkpoint/full_weights.h) ---------------------
 * One safetensors file of every unit's master weights, the form inference stacks load. Tensors are
 * named as registered (shardlineTensorSpec_t.name; names unique across units), units and tensors
 * in registration order; a tied tensor is written once, under its target's name. Both calls are
 * collective over the scheduler's world, between steps, with the same path and options on every
 * rank; every rank returns the same result (a peer's as shardlineRemoteError). */
typedef struct {
  size_t struct_size;
  int version;
  int writer_rank; /* the world rank that writes the file: 0 */
  /* 0: every tensor in its unit's master dtype (the bits as they are); 1: in `dtype`, a floating
   * dtype (narrowing rounds to nearest even). */
  int cast;
  shardlineDataType_t dtype;
  /* Entries added to the header's "__metadata__" (after "format": "pt" and the ties). */
  const char* const* metadata_keys;
  const char* const* metadata_values;
  int num_metadata;
  size_t cast_chunk_bytes; /* the writer's staging buffer when casting (>= 1): 8 MiB */
} shardlineSafetensorsExportConfig_t;
#define SHARDLINE_SAFETENSORS_EXPORT_CONFIG_INIT                                                \
  {                                                                                             \
    sizeof(shardlineSafetensorsExportConfig_t), SHARDLINE_VERSION_CODE, 0, 0, shardlineFloat32, \
        NULL, NULL, 0, (size_t)8 << 20                                                          \
  }
/* Writes the new file `path` (AlreadyExists if it exists: never replaced) atomically: a temporary
 * file beside it, fsynced, renamed. One unit at a time is gathered to the writer. config NULL:
 * the defaults. */
SHARDLINE_API shardlineResult_t
shardline_export_safetensors(shardlineScheduler_t scheduler, const char* path,
                             const shardlineSafetensorsExportConfig_t* config, double timeout_s);
typedef struct {
  size_t struct_size;
  int version;
  /* Tensors in the file that belong to no unit: 0, InvalidArgument naming them; 1, skipped. */
  int ignore_unknown_tensors;
} shardlineSafetensorsImportConfig_t;
#define SHARDLINE_SAFETENSORS_IMPORT_CONFIG_INIT \
  { sizeof(shardlineSafetensorsImportConfig_t), SHARDLINE_VERSION_CODE, 0 }
/* Loads every unit's master shard from the safetensors file `path` (written by any tool): each
 * rank maps the file and copies only its shard's elements, casting floating dtypes. NotFound: no
 * file, or a tensor of the units missing from it; InvalidArgument: another shape, a dtype that
 * cannot be cast, tensors of no unit; DataLoss: a truncated file. Nothing is written on error. */
SHARDLINE_API shardlineResult_t
shardline_import_safetensors(shardlineScheduler_t scheduler, const char* path,
                             const shardlineSafetensorsImportConfig_t* config, double timeout_s);

/* ---- sync_module_states (scheduler/sync_states.h) ------------------------------------------
 * Broadcasts rank `root`'s tensors to every rank of `comm` before they are sharded (a framework
 * that initialises on one rank, or with a seed per rank), in buckets of at most bucket_bytes. */
typedef struct {
  size_t struct_size;
  int version;
  int root;            /* the rank whose values every rank receives: 0 */
  size_t bucket_bytes; /* the most bytes one broadcast moves (>= 1): 25 MiB */
} shardlineSyncConfig_t;
#define SHARDLINE_SYNC_CONFIG_INIT \
  { sizeof(shardlineSyncConfig_t), SHARDLINE_VERSION_CODE, 0, (size_t)25 << 20 }
/* Tensor t is counts[t] elements of dtypes[t] at data[t] (host memory). Collective over `comm`:
 * every rank passes tensors of the same sizes (else InvalidArgument on every rank, naming the rank
 * that differs). config NULL: the defaults. */
SHARDLINE_API shardlineResult_t
shardline_sync_module_states(shardlineComm_t comm, void* const* data, const size_t* counts,
                             const shardlineDataType_t* dtypes, int num_tensors,
                             const shardlineSyncConfig_t* config, double timeout_s);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SHARDLINE_BINDINGS_C_SHARDLINE_H_ */
