#include "collectives/ucx/internal/ucx_context.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"

namespace shardline::ucx_internal {

SL_PARAM(int64_t, UcxChunkBytes, "UCX_CHUNK_BYTES", 512 * 1024,
         "Pipeline chunk of the large reduce-scatter/all-reduce of the ucx backend (bytes, 4 KiB "
         "to 256 MiB; each rank stages a window of chunks per peer).",
         InRange<int64_t>(4096, int64_t{256} << 20));
SL_PARAM(int64_t, UcxSmallBytes, "UCX_SMALL_BYTES", 32 * 1024,
         "Per-peer payload up to which a ucx collective sends its data in the fingerprint's "
         "message, in one round (staged, then copied); above it data moves zero-copy. 0 to "
         "16 MiB.",
         InRange<int64_t>(0, int64_t{16} << 20));
SL_PARAM(int64_t, UcxWindow, "UCX_WINDOW", 3,
         "Chunks in flight per peer in the pipelined ucx reductions (1 to 64).",
         InRange<int64_t>(1, 64));
SL_PARAM(int64_t, UcxSpinUs, "UCX_SPIN_US", 2000,
         "Microseconds a waiting ucx collective polls (yielding its core between polls as "
         "SHARDLINE_UCX_YIELD says) before it sleeps on the worker's event fd (in the "
         "mailboxes' fingerprint round: on the awaited peer's sequence word). At most 1 s.",
         InRange<int64_t>(0, 1000000));
SL_PARAM(std::string, UcxYield, "UCX_YIELD", "auto",
         "When a waiting ucx collective hands its core to another runnable thread between polls "
         "(sched_yield): auto, where this host runs more of the communicator's ranks than the "
         "process has CPUs, or where more threads are runnable than that (/proc/loadavg, every "
         "10 ms) while another host-stream worker of the process is awake or the wait has "
         "stalled for 50 us; always; never.",
         [](const std::string& v) -> absl::Status {
           if (v == "auto" || v == "always" || v == "never") return absl::OkStatus();
           return absl::InvalidArgumentError(
               absl::StrCat("must be auto, always or never, got '", v, "'"));
         });
SL_PARAM(bool, UcxCma, "UCX_CMA", true,
         "Within a host, copy large messages once, straight out of the sender's memory "
         "(process_vm_readv; a peer that dies meanwhile is an error, not a crash). Off: UCX's "
         "shared-memory transports (two copies per byte).");
SL_PARAM(bool, UcxMap, "UCX_MAP", true,
         "Within a host, copy large messages out of the sender's shareable memory through a "
         "mapping of it (memcpy, no system call per message); off, or for private memory: "
         "process_vm_readv.");
SL_PARAM(bool, UcxMailbox, "UCX_MAILBOX", true,
         "Where every rank of a communicator runs on one host, exchange each collective's "
         "fingerprint, and a small collective's payload, through shared-memory mailboxes that "
         "the peers map (one copy in, one out, no message). Off on any rank: UCX messages on "
         "all ranks.");
SL_PARAM(bool, UcxShm, "UCX_SHM", true,
         "Use shared memory between ranks on the same host (off: every peer is treated as "
         "remote and UCX's shared-memory transports are left out unless UCX_TLS is set, which "
         "exercises the network path on one machine).");

absl::StatusOr<Tuning> Tuning::FromEnvironment() {
  Tuning t;
  SL_ASSIGN_OR_RETURN(const int64_t chunk, ParamUcxChunkBytes().Get());
  SL_ASSIGN_OR_RETURN(const int64_t small, ParamUcxSmallBytes().Get());
  SL_ASSIGN_OR_RETURN(const int64_t window, ParamUcxWindow().Get());
  SL_ASSIGN_OR_RETURN(const int64_t spin, ParamUcxSpinUs().Get());
  t.chunk_bytes = static_cast<size_t>(chunk);
  t.small_bytes = static_cast<size_t>(small);
  t.window = static_cast<int>(window);
  t.spin = absl::Microseconds(spin);
  SL_ASSIGN_OR_RETURN(t.mailbox, ParamUcxMailbox().Get());
  return t;
}

std::string UcxError(ucs_status_t status) { return ucs_status_string(status); }

// `shm` false: a context without UCX's shared-memory transports, so that peers on this host
// really talk over the network. Leaving them in would not only defeat the point of that mode:
// UCX then still wires every peer up over shared memory, and UCX 1.13 aborts (an assertion in
// ucp_request_send_state_ff) when a peer dies while a wireup message is still queued on such an
// endpoint. The two kinds of context are cached apart.
absl::StatusOr<std::shared_ptr<UcxContext>> UcxContext::Acquire(bool shm) {
  struct Cache {
    std::mutex mu;
    std::weak_ptr<UcxContext> with_shm, without_shm;
  };
  // Never destroyed: a communicator may outlive static destruction.
  static Cache* const cache = new Cache;
  std::lock_guard<std::mutex> lock(cache->mu);
  std::weak_ptr<UcxContext>& slot = shm ? cache->with_shm : cache->without_shm;
  if (std::shared_ptr<UcxContext> context = slot.lock()) return context;

  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) {
    return absl::InternalError(
        absl::StrCat("ucx: reading the configuration failed: ", UcxError(status)));
  }
  // Shared-memory transports only offer peer-failure handling (needed by MODE_PEER endpoints,
  // without which UCX drops them) when asked to. Asked through the configuration object, not
  // the environment: setenv would race every other thread's getenv. (ucp_config_modify keeps
  // names that are not UCP's own and applies them to the transports; it warns when none takes
  // it, hence not for a context without the shared-memory transports.)
  if (shm && std::getenv("UCX_MM_ERROR_HANDLING") == nullptr) {
    status = ucp_config_modify(config, "MM_ERROR_HANDLING", "y");
    if (status != UCS_OK) {
      ucp_config_release(config);
      return absl::InternalError(
          absl::StrCat("ucx: enabling error handling of the shared-memory transports failed: ",
                       UcxError(status)));
    }
  }
  // Notice dead peers across machines within seconds, not the default tens of seconds.
  if (std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) {
    ucp_config_modify(config, "KEEPALIVE_INTERVAL", "1s");
  }
  // No zero-copy active messages. UCX 1.13's TCP transport completes a zero-copy send twice
  // when a send on it fails (the peer died) while the send is still going out: once when it
  // purges the endpoint, once more on return (uct_tcp_ep_sendv, src/uct/tcp/tcp_ep.c:1062-1063
  // in 1.13.1, still so upstream). Debian builds UCX with assertions, so the survivor aborts
  // (uct_iface.h:884 "comp->count > 0") instead of failing the collective. Over TCP every
  // message above about 8 KiB took that path: eager zero-copy, and the rendezvous data, which TCP
  // carries as active messages. Copying them costs the sender one memcpy per byte; other
  // transports keep their zero-copy rendezvous (RMA lanes: not governed by this threshold).
  if (std::getenv("UCX_ZCOPY_THRESH") == nullptr) {
    ucp_config_modify(config, "ZCOPY_THRESH", "inf");
  }
  // Learn each peer's endpoint id when the endpoint is created (later UCX's default), not at
  // the first rendezvous send (tag_rndv.c:97 in 1.13.1). A peer's late request is answered on
  // this rank's plain shared-memory endpoint to it; where that peer's queue is full (this rank
  // streams to it) the reply waits on the endpoint, and when the peer then dies, discarding the
  // endpoint (closed or failed) trips an assertion of Debian's UCX (ucp_request.c:684, "got REP
  // message"; removed upstream by openucx/ucx#8175). At creation nothing fills the queues yet.
  if (std::getenv("UCX_RESOLVE_REMOTE_EP_ID") == nullptr) {
    ucp_config_modify(config, "RESOLVE_REMOTE_EP_ID", "auto");
  }
  if (!shm && std::getenv("UCX_TLS") == nullptr) {
    status = ucp_config_modify(config, "TLS", "^sm");
    if (status != UCS_OK) {
      ucp_config_release(config);
      return absl::InternalError(
          absl::StrCat("ucx: excluding the shared-memory transports failed: ", UcxError(status)));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 1;
  ucp_context_h context = nullptr;
  status = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (status != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucx: ucp_init failed: ", UcxError(status)));
  }
  std::shared_ptr<UcxContext> owned(new UcxContext(context));
  slot = owned;
  return owned;
}

UcxContext::~UcxContext() { ucp_cleanup(context_); }

}  // namespace shardline::ucx_internal
