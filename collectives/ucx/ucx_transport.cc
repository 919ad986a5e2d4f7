#include "collectives/ucx/internal/ucx_transport.h"

#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace shardline::ucx_internal {

namespace {

absl::Status AtLeast(int64_t v, int64_t min, absl::string_view what) {
  if (v < min) return absl::InvalidArgumentError(absl::StrCat(what, " must be >= ", min));
  return absl::OkStatus();
}

}  // namespace

SL_PARAM(int64_t, UcxChunkBytes, "UCX_CHUNK_BYTES", 512 * 1024,
         "Pipeline chunk of the large reduce-scatter/all-reduce of the ucx backend (bytes).",
         [](const int64_t& v) { return AtLeast(v, 4096, "chunk bytes"); });
SL_PARAM(int64_t, UcxSmallBytes, "UCX_SMALL_BYTES", 32 * 1024,
         "Per-peer payload up to which a ucx collective sends its data along with the "
         "fingerprints in one round (staged, then copied); above it data moves zero-copy.",
         [](const int64_t& v) { return AtLeast(v, 0, "small bytes"); });
SL_PARAM(int64_t, UcxWindow, "UCX_WINDOW", 3,
         "Chunks in flight per peer in the pipelined ucx reductions.",
         [](const int64_t& v) { return AtLeast(v, 1, "window"); });
SL_PARAM(int64_t, UcxSpinUs, "UCX_SPIN_US", 2000,
         "Microseconds a waiting ucx collective polls (yielding its core between polls where "
         "this host runs more ranks than the process has CPUs) before it sleeps on the "
         "worker's event fd.",
         [](const int64_t& v) { return AtLeast(v, 0, "spin"); });
SL_PARAM(bool, UcxCma, "UCX_CMA", true,
         "Within a host, copy large messages once, straight out of the sender's memory "
         "(process_vm_readv; a peer that dies meanwhile is an error, not a crash). Off: UCX's "
         "shared-memory transports (two copies per byte).");
SL_PARAM(bool, UcxMap, "UCX_MAP", true,
         "Within a host, copy large messages out of the sender's shareable memory through a "
         "mapping of it (memcpy, no system call per message); off, or for private memory: "
         "process_vm_readv.");
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
  t.window = static_cast<int>(std::min<int64_t>(window, 64));
  t.spin = absl::Microseconds(spin);
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

namespace {

std::string ReadFirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Ranks with equal host identities share memory: same host name, same boot, same pid
// namespace (so that their pids mean something to each other).
std::string HostIdentity() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  char ns[128] = {};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  if (n > 0) ns[n] = 0;
  return absl::StrCat(host, "|", ReadFirstLine("/proc/sys/kernel/random/boot_id"), "|", ns);
}

// Without a pidfd (kernels before 5.3, or no descriptor to spare): the pid, which another
// process may have taken over since the peer exited.
bool ProcessAlive(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM) return false;
  // A zombie has exited; it only waits for its parent.
  std::string stat = ReadFirstLine(absl::StrCat("/proc/", pid, "/stat").c_str());
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return !stat.empty();
  const char state = stat[paren + 2];
  return state != 'Z' && state != 'X';
}

// `prefix` is "<name>/ucx/<epoch>" (see Init).
std::string AddressKey(absl::string_view prefix, int rank) {
  return absl::StrCat(prefix, "/addr/", rank);
}

std::string CmaKey(absl::string_view prefix, int rank) {
  return absl::StrCat(prefix, "/cma/", rank);
}

// Under Yama's ptrace_scope 1 only ancestors may read a process's memory; let any process of
// the same user do it, as UCX and Open MPI do for CMA (the probe finds out whether it worked).
void AllowPeerReads() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (ReadFirstLine("/proc/sys/kernel/yama/ptrace_scope") == "1") {
      prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
    }
  });
}

// One process_vm_readv loop (short reads continue where they stopped).
int ReadRemote(int64_t pid, void* dst, uint64_t remote, size_t bytes) {
  size_t done = 0;
  while (done < bytes) {
    iovec local{static_cast<uint8_t*>(dst) + done, bytes - done};
    iovec far{reinterpret_cast<void*>(static_cast<uintptr_t>(remote + done)), bytes - done};
    const ssize_t n = process_vm_readv(static_cast<pid_t>(pid), &local, 1, &far, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EFAULT;
    done += static_cast<size_t>(n);
  }
  return 0;
}

void SendCallback(void* /*request*/, ucs_status_t status, void* user) {
  auto* c = static_cast<Completion*>(user);
  c->status = status;
  c->done.store(true, std::memory_order_release);
}

void RecvCallback(void* /*request*/, ucs_status_t status, const ucp_tag_recv_info_t* info,
                  void* user) {
  auto* c = static_cast<Completion*>(user);
  c->status = status;
  if (status == UCS_OK && info != nullptr) {
    c->info = *info;
    c->length = info->length;
  }
  c->done.store(true, std::memory_order_release);
}

// Records what a ucp_*_nbx call returned: done at once (OK or an error), or a request whose
// callback completes `c` later.
void Track(ucs_status_ptr_t r, Completion* c) {
  if (r == nullptr || UCS_PTR_IS_ERR(r)) {
    c->status = r == nullptr ? UCS_OK : UCS_PTR_STATUS(r);
    c->done.store(true, std::memory_order_release);
  } else {
    c->request = r;
  }
}

enum ControlType : uint8_t { kAbortNotice = 1, kGoodbye = 2 };
constexpr size_t kControlBytes = 4096;

}  // namespace

UcxTransport::UcxTransport(int rank, int size, std::string name)
    : rank_(rank), size_(size), name_(std::move(name)), peers_(size) {}

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(int rank, int size, Store& store,
                                                                   absl::string_view name,
                                                                   const Tuning& tuning,
                                                                   absl::Time deadline) {
  if (size > kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("ucx communicator ", name, ": size ", size, " exceeds ", kMaxRanks));
  }
  std::unique_ptr<UcxTransport> transport(new UcxTransport(rank, size, std::string(name)));
  SL_RETURN_IF_ERROR(transport->Init(store, tuning, deadline));
  return transport;
}

absl::Status UcxTransport::Init(Store& store, const Tuning& tuning, absl::Time deadline) {
  const std::string where =
      absl::StrCat("creating ucx communicator ", name_, " (rank ", rank_, " of ", size_, ")");
  SL_ASSIGN_OR_RETURN(const bool shm, ParamUcxShm().Get());
  SL_ASSIGN_OR_RETURN(const bool cma, ParamUcxCma().Get());
  SL_ASSIGN_OR_RETURN(map_, ParamUcxMap().Get());
  SL_ASSIGN_OR_RETURN(context_, UcxContext::Acquire(shm));

  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_MULTI;
  ucs_status_t status = ucp_worker_create(context_->get(), &wparams, &worker_);
  if (status != UCS_OK) {
    worker_ = nullptr;
    return absl::InternalError(absl::StrCat(where, ": ucp_worker_create: ", UcxError(status)));
  }
  ucp_worker_attr_t wattr{};
  wattr.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
  if (ucp_worker_query(worker_, &wattr) == UCS_OK && wattr.thread_mode != UCS_THREAD_MODE_MULTI) {
    return absl::InternalError(
        absl::StrCat(where, ": this UCX build does not support multi-threaded workers"));
  }
  status = ucp_worker_get_efd(worker_, &efd_);
  if (status != UCS_OK) {
    return absl::InternalError(absl::StrCat(where, ": ucp_worker_get_efd: ", UcxError(status)));
  }

  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  status = ucp_worker_get_address(worker_, &address, &address_length);
  if (status != UCS_OK) {
    return absl::InternalError(absl::StrCat(where, ": ucp_worker_get_address: ", UcxError(status)));
  }
  std::random_device random;
  probe_ = (uint64_t{random()} << 32) ^ random();
  std::string host = HostIdentity();
  if (!shm) absl::StrAppend(&host, "|rank", rank_);  // everyone is remote
  // host \n pid \n probe-address probe-value \n ucx-address
  std::string value = absl::StrCat(host, "\n", getpid(), "\n", reinterpret_cast<uintptr_t>(&probe_),
                                   " ", probe_, "\n");
  value.append(reinterpret_cast<const char*>(address), address_length);
  ucp_worker_release_address(worker_, address);
  // The keys of a communicator that existed under this name before (destroyed, aborted, or a
  // creation that failed) must never be read again: they name dead workers and freed probes.
  // Every creation gets its own key prefix, numbered per rank: rank r's k-th creation under a
  // name meets every peer's k-th, so all ranks agree on the number without talking first.
  absl::StatusOr<int64_t> epoch = store.Add(absl::StrCat(name_, "/ucx/epoch/", rank_), 1);
  if (!epoch.ok()) return Annotate(epoch.status(), where);
  key_prefix_ = absl::StrCat(name_, "/ucx/", *epoch);
  SL_RETURN_IF_ERROR(Annotate(store.Set(AddressKey(key_prefix_, rank_), value), where));

  std::vector<std::string> keys;
  for (int p = 0; p < size_; ++p) keys.push_back(AddressKey(key_prefix_, p));
  absl::Status waited = store.Wait(keys, deadline);
  if (!waited.ok()) {
    if (waited.code() != absl::StatusCode::kDeadlineExceeded) return Annotate(waited, where);
    std::vector<int> missing;
    for (int p = 0; p < size_; ++p) {
      absl::StatusOr<bool> there = store.Check({keys[p]});
      if (there.ok() && !*there) missing.push_back(p);
    }
    return absl::DeadlineExceededError(absl::StrCat(where, ": timed out waiting for rank(s) ",
                                                    absl::StrJoin(missing, ", "),
                                                    " to publish their UCX addresses"));
  }

  std::vector<std::string> values(size_);  // the peers' "probe-address probe-value" lines
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    SL_ASSIGN_OR_RETURN(std::string peer_value, store.Get(keys[p], deadline));
    std::vector<size_t> nl;
    for (size_t at = peer_value.find('\n'); at != std::string::npos && nl.size() < 3;
         at = peer_value.find('\n', at + 1)) {
      nl.push_back(at);
    }
    int64_t pid = 0;
    if (nl.size() < 3 || nl[2] + 1 >= peer_value.size() ||
        !absl::SimpleAtoi(absl::string_view(peer_value).substr(nl[0] + 1, nl[1] - nl[0] - 1),
                          &pid)) {
      return absl::InternalError(absl::StrCat(where, ": malformed address of rank ", p,
                                              " in the store (key '", keys[p], "')"));
    }
    values[p] = peer_value.substr(nl[1] + 1, nl[2] - nl[1] - 1);
    Peer& peer = peers_[p];
    peer.local = peer_value.compare(0, nl[0], host) == 0;
    peer.pid = pid;
    if (peer.local) OpenPidfd(p);
    error_args_.push_back(std::make_unique<ErrorArg>(ErrorArg{this, p}));
    ucp_ep_params_t ep_params{};
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                           UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(peer_value.data() + nl[2] + 1);
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep_params.err_handler.cb = &UcxTransport::OnEndpointError;
    ep_params.err_handler.arg = error_args_.back().get();
    status = ucp_ep_create(worker_, &ep_params, &peer.ep);
    if (status != UCS_OK) {
      peer.ep = nullptr;
      return absl::UnavailableError(
          absl::StrCat(where, ": connecting to rank ", p, " failed (ucx: ", UcxError(status), ")"));
    }
  }
  SL_RETURN_IF_ERROR(Annotate(AgreeOnCma(store, values, cma, deadline), where));
  int on_host = 1;
  for (int p = 0; p < size_; ++p) on_host += p != rank_ && peers_[p].local;
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0) oversubscribed_ = on_host > CPU_COUNT(&cpus);
  {
    std::lock_guard<std::mutex> lock(control_mu_);
    control_buffer_.reset(new uint8_t[kControlBytes]);
    PostControlRecv();
  }
  std::vector<Tuning> tunings;
  SL_RETURN_IF_ERROR(CompleteWireup(tuning, deadline, where, &tunings));
  // From here on the worker is served between collectives, also while this rank waits for its
  // peers in AgreeOnTuning: a peer still flushing its endpoint to this rank (over TCP) needs
  // this rank's worker to answer.
  progress_thread_ = std::thread([this] { ProgressThread(); });
  SL_RETURN_IF_ERROR(AgreeOnTuning(store, tunings, deadline, where));
  // Every peer's wire-up message arrived, and a peer sends it only after its last read of the
  // store: nobody reads this rank's keys any more.
  store.Delete(AddressKey(key_prefix_, rank_)).IgnoreError();
  store.Delete(CmaKey(key_prefix_, rank_)).IgnoreError();
  return absl::OkStatus();
}

namespace {

// The wire-up message: the sender's rank and its wire-protocol tuning, as SHARDLINE_UCX_* knobs.
enum WireupWord : size_t {
  kWireupRank,
  kWireupChunkBytes,
  kWireupSmallBytes,
  kWireupWindow,
  kWireupWords
};
constexpr size_t kWireupBytes = kWireupWords * sizeof(uint64_t);

}  // namespace

absl::Status UcxTransport::CompleteWireup(const Tuning& tuning, absl::Time deadline,
                                          absl::string_view where, std::vector<Tuning>* tunings) {
  auto batch = std::make_unique<Batch>();
  // One message each way per peer: this rank's receives, then its sends.
  std::vector<Completion*> recvs(size_, nullptr), sends(size_, nullptr), flushes(size_, nullptr);
  auto* in = reinterpret_cast<uint64_t*>(batch->Buffer(size_ * kWireupBytes));
  auto* out = in + rank_ * kWireupWords;
  out[kWireupRank] = static_cast<uint64_t>(rank_);
  out[kWireupChunkBytes] = tuning.chunk_bytes;
  out[kWireupSmallBytes] = tuning.small_bytes;
  out[kWireupWindow] = static_cast<uint64_t>(tuning.window);
  // Posting errors are kept, not returned: the batch must go through Release either way.
  absl::Status status;
  for (int p = 0; p < size_ && status.ok(); ++p) {
    if (p == rank_) continue;
    recvs[p] = batch->Add(p, /*is_send=*/false);
    status.Update(
        Recv(p, in + p * kWireupWords, kWireupBytes, MakeTag(Phase::kWireup, p, 0, 0), recvs[p]));
  }
  for (int p = 0; p < size_ && status.ok(); ++p) {
    if (p == rank_) continue;
    sends[p] = batch->Add(p, /*is_send=*/true);
    status.Update(Send(p, out, kWireupBytes, MakeTag(Phase::kWireup, rank_, 0, 0), sends[p]));
  }
  // Waits until every completion of `cs` is done; an error names the first failed peer, or
  // every pending one at the deadline.
  auto wait = [&](const std::vector<Completion*>& cs, absl::string_view what) -> absl::Status {
    while (true) {
      std::vector<int> pending;
      for (int p = 0; p < size_; ++p) {
        const Completion* c = cs[p];
        if (c == nullptr) continue;
        if (c->done.load(std::memory_order_acquire)) {
          if (c->status != UCS_OK) {
            return absl::UnavailableError(absl::StrCat(where, ": ", what, " rank ", p,
                                                       " failed (ucx: ", UcxError(c->status), ")"));
          }
          continue;
        }
        pending.push_back(p);
      }
      if (pending.empty()) return absl::OkStatus();
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (int p : pending) {
          if (peers_[p].failed) {
            return absl::UnavailableError(
                absl::StrCat(where, ": ", what, " rank ", p, ": peer unreachable"));
          }
        }
      }
      absl::Status alive = CheckPeers();
      if (!alive.ok()) return Annotate(alive, absl::StrCat(where, ": ", what));
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat(where, ": timed out ", what, " rank(s) ", absl::StrJoin(pending, ", ")));
      }
      if (!Progress()) Sleep(deadline);
    }
  };
  if (status.ok()) status = wait(recvs, "waiting for the wire-up message of");
  if (status.ok()) status = wait(sends, "sending the wire-up message to");
  if (status.ok()) {
    // The messages went through; a flush also completes what UCX still queued on every lane.
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      Completion* c = flushes[p] = batch->Add(p, /*is_send=*/true);
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.send = &SendCallback;
      param.user_data = c;
      Track(ucp_ep_flush_nbx(peers_[p].ep, &param), c);
    }
    status = wait(flushes, "flushing the endpoint to");
  }
  for (int p = 0; p < size_ && status.ok(); ++p) {
    if (p != rank_ && recvs[p]->length != kWireupBytes) {
      status = absl::InternalError(absl::StrCat(where, ": the wire-up message of rank ", p, " has ",
                                                recvs[p]->length, " bytes, not ", kWireupBytes,
                                                " (a different shardline version?)"));
    }
  }
  if (status.ok()) {
    tunings->assign(size_, tuning);
    for (int p = 0; p < size_; ++p) {
      const uint64_t* words = in + p * kWireupWords;
      (*tunings)[p].chunk_bytes = words[kWireupChunkBytes];
      (*tunings)[p].small_bytes = words[kWireupSmallBytes];
      (*tunings)[p].window = static_cast<int>(words[kWireupWindow]);
    }
  }
  Release(std::move(batch));
  return status;
}

absl::Status UcxTransport::AgreeOnTuning(Store& store, const std::vector<Tuning>& tunings,
                                         absl::Time deadline, absl::string_view where) {
  struct Knob {
    const ParamBase* param;
    uint64_t (*value)(const Tuning&);
  };
  const Knob knobs[] = {
      {&ParamUcxChunkBytes(), [](const Tuning& t) -> uint64_t { return t.chunk_bytes; }},
      {&ParamUcxSmallBytes(), [](const Tuning& t) -> uint64_t { return t.small_bytes; }},
      {&ParamUcxWindow(), [](const Tuning& t) -> uint64_t { return t.window; }}};
  // Every rank holds every rank's tuning, so all find the same first difference.
  absl::Status mismatch;
  for (const Knob& knob : knobs) {
    for (int p = 1; p < size_ && mismatch.ok(); ++p) {
      const uint64_t theirs = knob.value(tunings[p]), first = knob.value(tunings[0]);
      if (theirs == first) continue;
      const std::string& name = knob.param->env_name();
      mismatch = absl::InvalidArgumentError(
          absl::StrCat(where, ": rank ", p, " has ", name, "=", theirs, " but rank 0 has ", name,
                       "=", first, " (the ucx wire protocol needs the same on every rank)"));
    }
  }
  if (mismatch.ok()) return absl::OkStatus();
  // A rank finds the difference once its own handshake is complete, but a peer may still be
  // flushing its endpoint to it; closing that endpoint now would fail the peer's creation with
  // an unrelated error. So the ranks leave together (bounded by the deadline).
  std::vector<std::string> keys;
  for (int p = 0; p < size_; ++p) keys.push_back(absl::StrCat(key_prefix_, "/tuning_differs/", p));
  store.Set(keys[rank_], "").IgnoreError();
  store.Wait(keys, deadline).IgnoreError();
  return mismatch;
}

absl::Status UcxTransport::AgreeOnCma(Store& store, const std::vector<std::string>& values,
                                      bool cma, absl::Time deadline) {
  std::vector<int> local;
  for (int p = 0; p < size_; ++p) {
    if (p != rank_ && peers_[p].local) local.push_back(p);
  }
  if (local.empty()) return absl::OkStatus();
  if (cma) AllowPeerReads();
  // '1' at position p: this rank read p's probe and found the value p published.
  std::string readable(size_, '0');
  for (int p : local) {
    if (!cma) continue;
    std::vector<absl::string_view> parts = absl::StrSplit(values[p], ' ');
    uint64_t probe_address = 0, probe_value = 0, seen = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &probe_address) ||
        !absl::SimpleAtoi(parts[1], &probe_value)) {
      return absl::InternalError(absl::StrCat("malformed probe of rank ", p, " in the store"));
    }
    const int error = ReadRemote(peers_[p].pid, &seen, probe_address, sizeof(seen));
    if (error == 0 && seen == probe_value) {
      readable[p] = '1';
    } else {
      SL_LOG(INFO, COLL) << "ucx communicator " << name_ << " rank " << rank_
                         << ": cannot read the memory of rank " << p << " (pid " << peers_[p].pid
                         << "; " << (error != 0 ? std::strerror(error) : "wrong value")
                         << "): its large messages go through UCX's shared memory";
    }
  }
  SL_RETURN_IF_ERROR(store.Set(CmaKey(key_prefix_, rank_), readable));
  std::vector<std::string> keys;
  for (int p : local) keys.push_back(CmaKey(key_prefix_, p));
  absl::Status waited = store.Wait(keys, deadline);
  if (absl::IsDeadlineExceeded(waited)) {
    return absl::DeadlineExceededError(
        absl::StrCat("timed out waiting for the ranks on this host to probe each other"));
  }
  SL_RETURN_IF_ERROR(waited);
  for (int p : local) {
    SL_ASSIGN_OR_RETURN(std::string theirs, store.Get(CmaKey(key_prefix_, p), deadline));
    peers_[p].pulls_from = readable[p] == '1';
    peers_[p].pulled_by = theirs.size() == static_cast<size_t>(size_) && theirs[rank_] == '1';
  }
  return absl::OkStatus();
}

const uint8_t* UcxTransport::MapPeerRegion(int peer, uint64_t region_id, int fd, size_t bytes) {
  Peer& p = peers_[peer];
  if (!map_ || !p.pulls_from || p.unmappable || bytes == 0) return nullptr;
  ++map_clock_;
  for (Mapping& m : mappings_) {
    if (m.peer == peer && m.region_id == region_id) {
      m.last_use = map_clock_;
      return m.bytes == bytes ? m.base : nullptr;
    }
  }
  // Out of descriptors (or memory) is transient: copy this message with process_vm_readv and try
  // again with the next. Anything else means this peer's memory cannot be mapped at all.
  auto fail = [&](const char* what) -> const uint8_t* {
    const int error = errno;
    const bool transient = error == EMFILE || error == ENFILE || error == ENOMEM;
    if (!transient) {
      p.unmappable = true;
    } else if (p.warned_transient) {
      return nullptr;
    } else {
      p.warned_transient = true;
    }
    SL_LOG(WARN, COLL) << "ucx communicator " << name_ << " rank " << rank_ << ": " << what
                       << " for peer rank " << peer << " failed (" << std::strerror(error)
                       << "); reading its memory with process_vm_readv"
                       << (transient ? " until this succeeds (not logged again)" : "");
    return nullptr;
  };
  // Opened at creation; again here if that failed for want of a descriptor.
  if (p.pidfd < 0 && !OpenPidfd(peer)) return fail("pidfd_open");
  const int local_fd = static_cast<int>(syscall(SYS_pidfd_getfd, p.pidfd, fd, 0));
  if (local_fd < 0) return fail("pidfd_getfd");
  struct stat st {};
  void* base = MAP_FAILED;
  if (fstat(local_fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes) {
    base = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, local_fd, 0);
  }
  const int map_error = base == MAP_FAILED && errno != 0 ? errno : EINVAL;
  close(local_fd);
  if (base == MAP_FAILED) {
    errno = map_error;
    return fail("mapping a shared region");
  }
  // A bounded cache per peer: a region the peer freed stays alive while mapped here. Per peer,
  // not overall, so that a collective never unmaps a region it still reads (borrowed chunks):
  // one collective uses at most two regions of a peer (its input and its output), however
  // many peers there are.
  constexpr size_t kMaxMappingsPerPeer = 64;
  auto lru = mappings_.end();
  size_t of_peer = 0;
  for (auto it = mappings_.begin(); it != mappings_.end(); ++it) {
    if (it->peer != peer) continue;
    ++of_peer;
    if (lru == mappings_.end() || it->last_use < lru->last_use) lru = it;
  }
  if (of_peer >= kMaxMappingsPerPeer) {
    munmap(const_cast<uint8_t*>(lru->base), lru->bytes);
    mappings_.erase(lru);
  }
  if (!p.mapped_before) {
    p.mapped_before = true;
    SL_LOG(INFO, COLL) << "ucx communicator " << name_ << " rank " << rank_
                       << ": maps the shareable memory of peer rank " << peer;
  }
  mappings_.push_back({peer, region_id, static_cast<const uint8_t*>(base), bytes, map_clock_});
  return mappings_.back().base;
}

absl::Status UcxTransport::CmaRead(int peer, void* dst, uint64_t remote, size_t bytes) {
  const int error = ReadRemote(peers_[peer].pid, dst, remote, bytes);
  if (error == 0) return absl::OkStatus();
  if (error == ESRCH) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      peers_[peer].failed = true;
    }
    return absl::UnavailableError(absl::StrCat("peer rank ", peer, " (pid ", peers_[peer].pid,
                                               " on this host) exited during a read of ", bytes,
                                               " bytes from it"));
  }
  return absl::InternalError(absl::StrCat("reading ", bytes, " bytes at ", absl::Hex(remote),
                                          " from peer rank ", peer, " (pid ", peers_[peer].pid,
                                          ") failed: ", std::strerror(error)));
}

UcxTransport::~UcxTransport() {
  for (const Mapping& m : mappings_) munmap(const_cast<uint8_t*>(m.base), m.bytes);
  for (Peer& peer : peers_) {
    if (peer.pidfd >= 0) close(peer.pidfd);
  }
  if (progress_thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(idle_mu_);
      stop_ = true;
    }
    idle_cv_.notify_all();
    Wake();
    progress_thread_.join();
  }
  if (worker_ == nullptr) return;

  // Goodbyes first: a peer that sees our endpoint close afterwards knows we left on purpose.
  const bool unclean = unclean_.load();
  for (int p = 0; p < size_; ++p) SendControl(p, kGoodbye, absl::OkStatus());
  std::vector<void*> closing;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing = std::move(force_closing_);
  }
  for (int p = 0; p < size_; ++p) {
    std::lock_guard<std::mutex> ep_lock(ep_mu_);
    bool failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      failed = peers_[p].failed;
    }
    // After a failure, requests to live peers may never finish (their receives were
    // cancelled): a flushing close would wait for them. Forcing completes them with an error.
    if (void* request = CloseEndpoint(peers_[p], failed || unclean)) closing.push_back(request);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  while (!closing.empty() && absl::Now() < deadline) {
    while (ucp_worker_progress(worker_) != 0) {
    }
    closing.erase(std::remove_if(closing.begin(), closing.end(),
                                 [](void* r) {
                                   if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
                                   ucp_request_free(r);
                                   return true;
                                 }),
                  closing.end());
    if (!closing.empty()) Sleep(absl::Now() + absl::Milliseconds(10));
  }
  if (!closing.empty()) {
    SL_LOG(WARN, COLL) << "ucx communicator " << name_ << " rank " << rank_ << ": "
                       << closing.size() << " endpoint(s) did not close within 2 s";
  }
  {
    std::lock_guard<std::mutex> lock(control_mu_);
    if (control_posted_ && !control_.done.load(std::memory_order_acquire) &&
        control_.request != nullptr) {
      ucp_request_cancel(worker_, control_.request);
      const absl::Time cancel_deadline = absl::Now() + absl::Milliseconds(500);
      while (!control_.done.load(std::memory_order_acquire) && absl::Now() < cancel_deadline) {
        ucp_worker_progress(worker_);
      }
    }
    if (control_.request != nullptr && control_.done.load(std::memory_order_acquire)) {
      ucp_request_free(control_.request);
    }
    control_.request = nullptr;
  }
  // Requests that the forced closes completed.
  std::deque<Outgoing> outgoing;
  std::vector<std::unique_ptr<Batch>> graveyard;
  {
    std::lock_guard<std::mutex> lock(mu_);
    outgoing.swap(outgoing_);
    graveyard.swap(graveyard_);
  }
  for (Outgoing& o : outgoing) {
    if (o.completion.request != nullptr && o.completion.done.load(std::memory_order_acquire)) {
      ucp_request_free(o.completion.request);
      o.completion.request = nullptr;
    }
  }
  for (std::unique_ptr<Batch>& batch : graveyard) FreeRequests(*batch);
  DrainUnexpected();
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
}

// Requires ep_mu_.
void* UcxTransport::CloseEndpoint(Peer& peer, bool force) {
  if (peer.ep == nullptr) return nullptr;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t r = ucp_ep_close_nbx(peer.ep, &param);
  peer.ep = nullptr;
  return UCS_PTR_IS_PTR(r) ? r : nullptr;
}

// Messages nobody will receive any more (a peer's goodbye or abort notice, the payload of a
// collective that failed) would make UCX warn at worker destruction: receive the small ones.
void UcxTransport::DrainUnexpected() {
  const absl::Time deadline = absl::Now() + absl::Milliseconds(100);
  std::vector<uint8_t> sink;
  while (absl::Now() < deadline) {
    ucp_tag_recv_info_t info{};
    if (ucp_tag_probe_nb(worker_, 0, 0, /*remove=*/0, &info) == nullptr) return;
    if (info.length > 64 * 1024) return;  // a rendezvous: leave it, its sender may be gone
    ucp_tag_message_h message = ucp_tag_probe_nb(worker_, 0, 0, /*remove=*/1, &info);
    if (message == nullptr) return;
    sink.resize(std::max<size_t>(info.length, 1));
    auto c = std::make_unique<Completion>();
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.recv = &RecvCallback;
    param.user_data = c.get();
    ucs_status_ptr_t r = ucp_tag_msg_recv_nbx(worker_, sink.data(), info.length, message, &param);
    if (UCS_PTR_IS_ERR(r)) return;
    if (r == nullptr) continue;
    while (!c->done.load(std::memory_order_acquire) && absl::Now() < deadline) {
      ucp_worker_progress(worker_);
    }
    if (!c->done.load(std::memory_order_acquire)) {
      // Leaves the request (and its slot) to the worker's destruction; bounded and rare.
      ucp_request_cancel(worker_, r);
      c.release();
      return;
    }
    ucp_request_free(r);
  }
}

void UcxTransport::SetAbortHandler(AbortHandler handler) {
  std::vector<std::pair<absl::Status, bool>> early;
  {
    std::lock_guard<std::mutex> lock(handler_mu_);
    abort_handler_ = handler;
    early.swap(early_reports_);
  }
  // Failures the progress thread saw before the communicator was attached.
  for (const auto& [status, forward] : early) handler(status, forward);
}

void UcxTransport::OnEndpointError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* error = static_cast<ErrorArg*>(arg);
  std::lock_guard<std::mutex> lock(error->transport->mu_);
  error->transport->failures_.push_back({error->peer, status});
}

absl::Status UcxTransport::Send(int peer, const void* buffer, size_t bytes, uint64_t tag,
                                Completion* c) {
  c->expected = bytes;
  c->peer = peer;
  c->is_send = true;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &SendCallback;
  param.user_data = c;
  static const uint8_t kEmpty = 0;
  Track(ucp_tag_send_nbx(peers_[peer].ep, bytes == 0 ? &kEmpty : buffer, bytes, tag, &param), c);
  return absl::OkStatus();
}

absl::Status UcxTransport::Recv(int peer, void* buffer, size_t bytes, uint64_t tag, Completion* c) {
  c->expected = bytes;
  c->peer = peer;
  c->is_send = false;
  ucp_request_param_t param{};
  // No immediate completion: UCX 1.13 does not always fill recv_info when a receive matches
  // an unexpected message at once, and the length is what truncation checks rely on.
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_RECV_INFO | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = &RecvCallback;
  param.user_data = c;
  param.recv_info.tag_info = &c->info;
  static uint8_t sink = 0;
  ucs_status_ptr_t r =
      ucp_tag_recv_nbx(worker_, bytes == 0 ? &sink : buffer, bytes, tag, kFullMask, &param);
  if (r == nullptr) c->length = c->info.length;
  Track(r, c);
  return absl::OkStatus();
}

// Requires control_mu_.
void UcxTransport::PostControlRecv() {
  if (control_.request != nullptr) ucp_request_free(control_.request);
  control_.request = nullptr;
  control_.done.store(false, std::memory_order_relaxed);
  control_.status = UCS_OK;
  control_.length = 0;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_RECV_INFO | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = &RecvCallback;
  param.user_data = &control_;
  param.recv_info.tag_info = &control_.info;
  ucs_status_ptr_t r = ucp_tag_recv_nbx(worker_, control_buffer_.get(), kControlBytes,
                                        MakeTag(Phase::kControl, 0, 0, 0), kPhaseMask, &param);
  control_posted_ = true;
  if (r == nullptr) {
    control_.length = control_.info.length;
    control_.done.store(true, std::memory_order_release);
  } else if (UCS_PTR_IS_ERR(r)) {
    control_.status = UCS_PTR_STATUS(r);
    control_posted_ = false;  // the worker is unusable; nothing more will arrive
    SL_LOG(WARN, COLL) << "ucx communicator " << name_ << " rank " << rank_
                       << ": cannot post the control receive: " << UcxError(control_.status);
  } else {
    control_.request = r;
  }
}

bool UcxTransport::Progress() {
  bool activity = false;
  for (int i = 0; i < 64 && ucp_worker_progress(worker_) != 0; ++i) activity = true;

  std::vector<absl::Status> notices;
  std::vector<absl::Status> reports;
  {
    std::lock_guard<std::mutex> lock(control_mu_);
    while (control_posted_ && control_.done.load(std::memory_order_acquire)) {
      activity = true;
      HandleControl(control_, &notices);
      PostControlRecv();
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Failure& f : failures_) {
      Peer& peer = peers_[f.peer];
      if (peer.failed) continue;
      peer.failed = true;
      if (peer.departed) {
        SL_LOG(INFO, COLL) << "ucx communicator " << name_ << " rank " << rank_ << ": peer rank "
                           << f.peer << " closed its endpoint";
        continue;
      }
      reports.push_back(absl::UnavailableError(
          absl::StrCat("peer rank ", f.peer, " unreachable (ucx: ", UcxError(f.status), ")")));
    }
    failures_.clear();
  }
  for (const absl::Status& s : notices) Report(s, /*forward=*/false);
  for (const absl::Status& s : reports) Report(s, /*forward=*/true);
  return activity || !reports.empty() || !notices.empty();
}

// Requires control_mu_; abort notices are reported by the caller once the lock is released.
void UcxTransport::HandleControl(const Completion& c, std::vector<absl::Status>* notices) {
  const int src = TagSource(c.info.sender_tag);
  if (c.status != UCS_OK || c.length < 2 || src < 0 || src >= size_) {
    SL_LOG(WARN, COLL) << "ucx communicator " << name_ << " rank " << rank_
                       << ": ignoring a malformed control message (" << UcxError(c.status) << ", "
                       << c.length << " bytes)";
    return;
  }
  const uint8_t type = control_buffer_[0];
  if (type == kGoodbye) {
    std::lock_guard<std::mutex> lock(mu_);
    peers_[src].departed = true;
    return;
  }
  if (type == kAbortNotice) {
    const auto code = static_cast<absl::StatusCode>(control_buffer_[1]);
    std::string text(reinterpret_cast<const char*>(control_buffer_.get()) + 2, c.length - 2);
    absl::Status status(code == absl::StatusCode::kOk ? absl::StatusCode::kAborted : code,
                        absl::StrCat("peer rank ", src, " aborted: ", text));
    notices->push_back(std::move(status));
    return;
  }
  SL_LOG(WARN, COLL) << "ucx communicator " << name_ << " rank " << rank_
                     << ": ignoring a control message of unknown type " << int{type};
}

void UcxTransport::Report(const absl::Status& status, bool forward) {
  unclean_ = true;
  AbortHandler handler;
  {
    std::lock_guard<std::mutex> lock(handler_mu_);
    if (!abort_handler_) {
      early_reports_.emplace_back(status, forward);
      return;
    }
    handler = abort_handler_;
  }
  handler(status, forward);
}

void UcxTransport::SendControl(int peer, uint8_t type, const absl::Status& status) {
  // ep_mu_ keeps the endpoint open during the send; mu_ must not be held across it, since the
  // endpoint error callback takes mu_ (UCX may call it from inside ucp_tag_send_nbx).
  std::lock_guard<std::mutex> ep_lock(ep_mu_);
  Outgoing* o;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (peers_[peer].ep == nullptr || peers_[peer].failed) return;
    o = &outgoing_.emplace_back();  // a deque: elements never move
    o->bytes.push_back(static_cast<char>(type));
    o->bytes.push_back(static_cast<char>(status.code()));
    o->bytes.append(status.message().data(),
                    std::min<size_t>(status.message().size(), kControlBytes - 2));
  }
  Send(peer, o->bytes.data(), o->bytes.size(), MakeTag(Phase::kControl, rank_, 0, 0),
       &o->completion)
      .IgnoreError();
}

void UcxTransport::BroadcastAbort(const absl::Status& reason) {
  for (int p = 0; p < size_; ++p) {
    bool skip;
    {
      std::lock_guard<std::mutex> lock(mu_);
      skip = p == rank_ || peers_[p].departed;
    }
    if (!skip) SendControl(p, kAbortNotice, reason);
  }
  Wake();
}

void UcxTransport::Sleep(absl::Time until) {
  if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) return;
  const int64_t ms = std::clamp<int64_t>(
      absl::ToInt64Milliseconds(until - absl::Now() + absl::Microseconds(999)), 0, 200);
  pollfd fd{efd_, POLLIN, 0};
  poll(&fd, 1, static_cast<int>(ms));
}

void UcxTransport::YieldIfOversubscribed() const {
  if (oversubscribed_) sched_yield();
}

void UcxTransport::Wake() {
  if (worker_ != nullptr) ucp_worker_signal(worker_);
}

bool UcxTransport::OpenPidfd(int p) {
  Peer& peer = peers_[p];
  peer.pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(peer.pid), 0));
  if (peer.pidfd >= 0) return true;
  const int error = errno;  // for the caller, whatever logging does to it
  if (!peer.warned_pidfd) {
    peer.warned_pidfd = true;
    SL_LOG(WARN, COLL) << "ucx communicator " << name_ << " rank " << rank_
                       << ": pidfd_open for peer rank " << p << " (pid " << peer.pid << ") failed ("
                       << std::strerror(error)
                       << "); watching its pid instead, which a new process may reuse";
  }
  errno = error;
  return false;
}

bool UcxTransport::PeerAlive(const Peer& peer) const {
  if (peer.pidfd < 0) return ProcessAlive(peer.pid);
  // A pidfd names one process for good: it turns readable once that process has exited, even
  // if its pid now belongs to another.
  pollfd fd{peer.pidfd, POLLIN, 0};
  int ready;
  do {
    ready = poll(&fd, 1, 0);
  } while (ready < 0 && errno == EINTR);
  return ready <= 0;
}

absl::Status UcxTransport::CheckPeers() {
  const absl::Time now = absl::Now();
  if (now < next_peer_check_) return peers_status_;
  next_peer_check_ = now + absl::Milliseconds(200);
  if (!peers_status_.ok()) return peers_status_;
  const int64_t self = getpid();
  for (int p = 0; p < size_; ++p) {
    const Peer& peer = peers_[p];
    if (p == rank_ || !peer.local || peer.pid == self) continue;
    if (!PeerAlive(peer)) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        peers_[p].failed = true;
      }
      peers_status_ = absl::UnavailableError(
          absl::StrCat("peer rank ", p, " (pid ", peer.pid, " on this host) exited"));
      Report(peers_status_, /*forward=*/true);
      return peers_status_;
    }
  }
  return absl::OkStatus();
}

void UcxTransport::BeginCollective() {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(idle_mu_);
    ++active_;
    wake = polling_;
  }
  // Only a progress thread asleep on the event fd must be told; one waiting out the grace
  // period (the usual case between back-to-back collectives) sees active_ when it next looks.
  if (wake) Wake();
}

void UcxTransport::EndCollective() {
  // No notify: waking the progress thread after every collective (and again at the next one)
  // costs two context switches per collective, which dominates small-message latency on a
  // loaded host. It takes over once no collective ran for kIdleGrace.
  std::lock_guard<std::mutex> lock(idle_mu_);
  if (--active_ == 0) last_end_ = absl::Now();
}

void UcxTransport::ProgressThread() {
  // How long after the last collective the progress thread takes over polling the worker.
  constexpr absl::Duration kIdleGrace = absl::Milliseconds(20);
  std::unique_lock<std::mutex> lock(idle_mu_);
  while (!stop_) {
    const absl::Time now = absl::Now();
    if (active_ > 0 || now < last_end_ + kIdleGrace) {
      const absl::Time until = active_ > 0 ? now + kIdleGrace : last_end_ + kIdleGrace;
      idle_cv_.wait_until(lock, absl::ToChronoTime(until));
      continue;
    }
    polling_ = true;
    lock.unlock();
    Progress();
    Sleep(absl::Now() + absl::Seconds(1));
    lock.lock();
    polling_ = false;
  }
}

void UcxTransport::FreeRequests(Batch& batch) {
  for (Completion& c : batch.slots()) {
    if (c.request != nullptr && c.done.load(std::memory_order_acquire)) {
      ucp_request_free(c.request);
      c.request = nullptr;
    }
  }
}

void UcxTransport::Release(std::unique_ptr<Batch> batch) {
  if (batch == nullptr) return;
  auto pending = [&](bool receives_only) {
    for (Completion& c : batch->slots()) {
      if (!c.done.load(std::memory_order_acquire) && !(receives_only && c.is_send)) return true;
    }
    return false;
  };
  if (pending(false)) {
    unclean_ = true;
    for (Completion& c : batch->slots()) {
      if (!c.done.load(std::memory_order_acquire) && !c.is_send && c.request != nullptr) {
        ucp_request_cancel(worker_, c.request);
      }
    }
    // Sends cannot be cancelled: closing a dead peer's endpoint by force completes them.
    std::vector<bool> close(size_, false);
    for (Completion& c : batch->slots()) {
      if (!c.done.load(std::memory_order_acquire) && c.is_send && c.peer >= 0) close[c.peer] = true;
    }
    for (int p = 0; p < size_; ++p) {
      if (!close[p]) continue;
      // As in SendControl: ep_mu_ across the UCX call, mu_ only around the bookkeeping.
      std::lock_guard<std::mutex> ep_lock(ep_mu_);
      bool failed;
      {
        std::lock_guard<std::mutex> lock(mu_);
        failed = peers_[p].failed;
      }
      if (!failed) continue;
      if (void* request = CloseEndpoint(peers_[p], /*force=*/true)) {
        std::lock_guard<std::mutex> lock(mu_);
        force_closing_.push_back(request);
      }
    }
    // Cancelled receives complete at the next progress; sends to live peers complete only if
    // the peer still receives them, which after a failure it usually does not.
    for (const auto& [receives_only, wait] :
         {std::pair{true, absl::Seconds(1)}, std::pair{false, absl::Milliseconds(100)}}) {
      const absl::Time deadline = absl::Now() + wait;
      while (pending(receives_only) && absl::Now() < deadline) {
        if (!Progress()) Sleep(absl::Now() + absl::Milliseconds(5));
      }
    }
  }
  FreeRequests(*batch);
  if (pending(false)) {
    if (pending(true)) {
      SL_LOG(WARN, COLL) << "ucx communicator " << name_ << " rank " << rank_
                         << ": receives still pending 1 s after cancellation; keeping their "
                            "buffers until the communicator is destroyed";
    }
    std::lock_guard<std::mutex> lock(mu_);
    graveyard_.push_back(std::move(batch));
  }
}

}  // namespace shardline::ucx_internal
