#include "collectives/ucx/internal/ucx_transport.h"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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
SL_PARAM(int64_t, UcxSpinUs, "UCX_SPIN_US", 200,
         "Microseconds a waiting ucx collective polls before it sleeps on the worker's event fd.",
         [](const int64_t& v) { return AtLeast(v, 0, "spin"); });
SL_PARAM(bool, UcxCma, "UCX_CMA", true,
         "Within a host, let UCX copy large messages with one CMA read (fast). UCX 1.13 cannot "
         "report errors on such endpoints: a peer killed during a read aborts the reader. Off: "
         "shared-memory endpoints with UCX error handling (two copies per byte, survivors of a "
         "killed peer always get an error).");
SL_PARAM(bool, UcxShm, "UCX_SHM", true,
         "Use shared memory between ranks on the same host (off: every peer is treated as "
         "remote, which exercises the network path on one machine).");

std::string UcxError(ucs_status_t status) { return ucs_status_string(status); }

namespace {

absl::StatusOr<std::shared_ptr<void>> AcquireContext(bool cma) {
  static std::mutex mu;
  static std::weak_ptr<void>* cached = new std::weak_ptr<void>();
  std::lock_guard<std::mutex> lock(mu);
  if (std::shared_ptr<void> context = cached->lock()) return context;

  // Shared-memory transports only offer peer-failure handling when asked to.
  if (!cma) setenv("UCX_MM_ERROR_HANDLING", "y", /*overwrite=*/0);
  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) {
    return absl::InternalError(
        absl::StrCat("ucx: reading the configuration failed: ", UcxError(status)));
  }
  // Notice dead peers across machines within seconds, not the default tens of seconds.
  if (std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) {
    ucp_config_modify(config, "KEEPALIVE_INTERVAL", "1s");
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
  std::shared_ptr<void> owned(context, [](void* c) { ucp_cleanup(static_cast<ucp_context_h>(c)); });
  *cached = owned;
  return owned;
}

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

bool ProcessAlive(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM) return false;
  // A zombie has exited; it only waits for its parent.
  std::string stat = ReadFirstLine(absl::StrCat("/proc/", pid, "/stat").c_str());
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return !stat.empty();
  const char state = stat[paren + 2];
  return state != 'Z' && state != 'X';
}

std::string AddressKey(absl::string_view name, int rank) {
  return absl::StrCat(name, "/ucx/addr/", rank);
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

enum ControlType : uint8_t { kAbortNotice = 1, kGoodbye = 2 };
constexpr size_t kControlBytes = 4096;

}  // namespace

UcxTransport::UcxTransport(int rank, int size, std::string name)
    : rank_(rank), size_(size), name_(std::move(name)), peers_(size) {}

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(int rank, int size, Store& store,
                                                                   absl::string_view name,
                                                                   absl::Time deadline) {
  if (size > kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("ucx communicator ", name, ": size ", size, " exceeds ", kMaxRanks));
  }
  std::unique_ptr<UcxTransport> transport(new UcxTransport(rank, size, std::string(name)));
  SL_RETURN_IF_ERROR(transport->Init(store, deadline));
  return transport;
}

absl::Status UcxTransport::Init(Store& store, absl::Time deadline) {
  const std::string where =
      absl::StrCat("creating ucx communicator ", name_, " (rank ", rank_, " of ", size_, ")");
  SL_ASSIGN_OR_RETURN(const bool shm, ParamUcxShm().Get());
  SL_ASSIGN_OR_RETURN(const bool cma, ParamUcxCma().Get());
  SL_ASSIGN_OR_RETURN(context_, AcquireContext(cma));

  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_MULTI;
  ucs_status_t status =
      ucp_worker_create(static_cast<ucp_context_h>(context_.get()), &wparams, &worker_);
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
  std::string host = HostIdentity();
  if (!shm) absl::StrAppend(&host, "|rank", rank_);  // everyone is remote
  std::string value = absl::StrCat(host, "\n", getpid(), "\n");
  value.append(reinterpret_cast<const char*>(address), address_length);
  ucp_worker_release_address(worker_, address);
  SL_RETURN_IF_ERROR(Annotate(store.Set(AddressKey(name_, rank_), value), where));

  std::vector<std::string> keys;
  for (int p = 0; p < size_; ++p) keys.push_back(AddressKey(name_, p));
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

  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    SL_ASSIGN_OR_RETURN(std::string peer_value, store.Get(keys[p], deadline));
    const size_t nl1 = peer_value.find('\n');
    const size_t nl2 = nl1 == std::string::npos ? nl1 : peer_value.find('\n', nl1 + 1);
    int64_t pid = 0;
    if (nl2 == std::string::npos ||
        !absl::SimpleAtoi(absl::string_view(peer_value).substr(nl1 + 1, nl2 - nl1 - 1), &pid) ||
        nl2 + 1 >= peer_value.size()) {
      return absl::InternalError(absl::StrCat(where, ": malformed address of rank ", p,
                                              " in the store (key '", keys[p], "')"));
    }
    Peer& peer = peers_[p];
    peer.local = peer_value.compare(0, nl1, host) == 0;
    peer.pid = pid;
    error_args_.push_back(std::make_unique<ErrorArg>(ErrorArg{this, p}));
    ucp_ep_params_t ep_params{};
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(peer_value.data() + nl2 + 1);
    if (peer.local && cma) {
      ep_params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    } else {
      ep_params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep_params.err_handler.cb = &UcxTransport::OnEndpointError;
      ep_params.err_handler.arg = error_args_.back().get();
      peer.peer_mode = true;
    }
    status = ucp_ep_create(worker_, &ep_params, &peer.ep);
    if (status != UCS_OK) {
      peer.ep = nullptr;
      return absl::UnavailableError(
          absl::StrCat(where, ": connecting to rank ", p, " failed (ucx: ", UcxError(status), ")"));
    }
  }
  {
    std::lock_guard<std::mutex> lock(control_mu_);
    control_buffer_.reset(new uint8_t[kControlBytes]);
    PostControlRecv();
  }
  progress_thread_ = std::thread([this] { ProgressThread(); });
  return absl::OkStatus();
}

UcxTransport::~UcxTransport() {
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
  for (int p = 0; p < size_; ++p) {
    if (peers_[p].ep != nullptr && !peers_[p].failed) SendControl(p, kGoodbye, absl::OkStatus());
  }
  std::vector<void*> closing = std::move(force_closing_);
  for (int p = 0; p < size_; ++p) {
    Peer& peer = peers_[p];
    if (peer.ep == nullptr) continue;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // Forcing is only defined for MODE_PEER endpoints; the others flush (bounded below).
    // After a failed collective, requests to live peers may never finish (their receives were
    // cancelled): flushing would wait for them and UCX asserts on destroying such endpoints.
    param.flags =
        (peer.peer_mode && (peer.failed || unclean_.load())) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t r = ucp_ep_close_nbx(peer.ep, &param);
    if (UCS_PTR_IS_PTR(r)) closing.push_back(r);
    peer.ep = nullptr;
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Outgoing& o : outgoing_) {
      if (o.completion.request != nullptr && o.completion.done.load(std::memory_order_acquire)) {
        ucp_request_free(o.completion.request);
        o.completion.request = nullptr;
      }
    }
  }
  DrainUnexpected();
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
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

void UcxTransport::SetAbortHandler(AbortHandler handler) { abort_handler_ = std::move(handler); }

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
  ucs_status_ptr_t r =
      ucp_tag_send_nbx(peers_[peer].ep, bytes == 0 ? &kEmpty : buffer, bytes, tag, &param);
  if (r == nullptr) {
    c->status = UCS_OK;
    c->done.store(true, std::memory_order_release);
  } else if (UCS_PTR_IS_ERR(r)) {
    c->status = UCS_PTR_STATUS(r);
    c->done.store(true, std::memory_order_release);
  } else {
    c->request = r;
  }
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
  if (r == nullptr) {
    c->length = c->info.length;
    c->status = UCS_OK;
    c->done.store(true, std::memory_order_release);
  } else if (UCS_PTR_IS_ERR(r)) {
    c->status = UCS_PTR_STATUS(r);
    c->done.store(true, std::memory_order_release);
  } else {
    c->request = r;
  }
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
  if (abort_handler_) abort_handler_(status, forward);
}

void UcxTransport::SendControl(int peer, uint8_t type, const absl::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (peers_[peer].ep == nullptr || peers_[peer].failed) return;
  Outgoing& o = outgoing_.emplace_back();
  o.bytes.push_back(static_cast<char>(type));
  o.bytes.push_back(static_cast<char>(status.code()));
  o.bytes.append(status.message().data(),
                 std::min<size_t>(status.message().size(), kControlBytes - 2));
  Send(peer, o.bytes.data(), o.bytes.size(), MakeTag(Phase::kControl, rank_, 0, 0), &o.completion)
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

void UcxTransport::Wake() {
  if (worker_ != nullptr) ucp_worker_signal(worker_);
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
    if (!ProcessAlive(peer.pid)) {
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
  {
    std::lock_guard<std::mutex> lock(idle_mu_);
    ++active_;
  }
  Wake();
}

void UcxTransport::EndCollective() {
  {
    std::lock_guard<std::mutex> lock(idle_mu_);
    --active_;
  }
  idle_cv_.notify_all();
}

void UcxTransport::ProgressThread() {
  std::unique_lock<std::mutex> lock(idle_mu_);
  while (!stop_) {
    if (active_ > 0) {
      idle_cv_.wait(lock);
      continue;
    }
    lock.unlock();
    Progress();
    Sleep(absl::Now() + absl::Seconds(1));
    lock.lock();
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
  auto pending = [&] {
    for (Completion& c : batch->slots()) {
      if (!c.done.load(std::memory_order_acquire)) return true;
    }
    return false;
  };
  if (pending()) {
    for (Completion& c : batch->slots()) {
      if (!c.done.load(std::memory_order_acquire) && c.request != nullptr) {
        ucp_request_cancel(worker_, c.request);
      }
    }
    // Sends cannot be cancelled: closing a dead peer's endpoint by force completes them.
    std::vector<bool> close(size_, false);
    for (Completion& c : batch->slots()) {
      if (!c.done.load(std::memory_order_acquire) && c.peer >= 0) close[c.peer] = true;
    }
    for (int p = 0; p < size_; ++p) {
      std::lock_guard<std::mutex> lock(mu_);
      Peer& peer = peers_[p];
      if (!close[p] || !peer.failed || !peer.peer_mode || peer.ep == nullptr) continue;
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t r = ucp_ep_close_nbx(peer.ep, &param);
      if (UCS_PTR_IS_PTR(r)) force_closing_.push_back(r);
      peer.ep = nullptr;
    }
    unclean_ = true;
    const absl::Time deadline = absl::Now() + absl::Seconds(1);
    while (pending() && absl::Now() < deadline) {
      if (!Progress()) Sleep(absl::Now() + absl::Milliseconds(5));
    }
  }
  FreeRequests(*batch);
  if (pending()) {
    SL_LOG(WARN, COLL) << "ucx communicator " << name_ << " rank " << rank_
                       << ": requests still pending 1 s after cancellation; keeping their "
                          "buffers until the communicator is destroyed";
    std::lock_guard<std::mutex> lock(mu_);
    graveyard_.push_back(std::move(batch));
  }
}

}  // namespace shardline::ucx_internal
