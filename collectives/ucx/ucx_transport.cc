#include "collectives/ucx/internal/ucx_transport.h"

#include <poll.h>
#include <sanitizer/asan_interface.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "runtime/check.h"
#include "runtime/logging.h"

namespace shardline::ucx_internal {

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

namespace {

// Under AddressSanitizer a batch's buffers are separated by a poisoned gap and everything not
// handed out is poisoned, so an overrun of one staging buffer into the next is still reported
// (it was, when each buffer was its own allocation).
#if defined(__SANITIZE_ADDRESS__)
#define SL_UCX_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SL_UCX_ASAN 1
#endif
#endif
#ifdef SL_UCX_ASAN
constexpr size_t kRedzone = 64;
#else
constexpr size_t kRedzone = 0;
#endif

}  // namespace

Batch::~Batch() {
  for (Arena& a : arenas_) ASAN_UNPOISON_MEMORY_REGION(a.memory.get(), a.bytes);
}

absl::StatusOr<uint8_t*> Batch::Buffer(size_t bytes) {
  const size_t wanted = bytes;
  if (bytes > std::numeric_limits<size_t>::max() / 2) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ucx staging: cannot allocate a buffer of ", wanted, " bytes"));
  }
  bytes = (std::max<size_t>(bytes, 1) + kRedzone + kAlign - 1) / kAlign * kAlign;
  const size_t arena_before = arena_;
  const size_t offset_before = offset_;
  while (arena_ < arenas_.size() && arenas_[arena_].bytes - offset_ < bytes) {
    ++arena_;
    offset_ = 0;
  }
  if (arena_ == arenas_.size()) {
    // Each new arena at least doubles what the batch holds, so a collective's buffers take
    // O(log) allocations the first time and none once the batch is reused.
    const size_t held = held_bytes();
    const size_t arena_bytes = std::max({bytes, kMinArenaBytes, held});
    std::unique_ptr<uint8_t, Free> memory;
    if (limit_bytes_ == 0 || held + arena_bytes <= limit_bytes_) {
      memory.reset(static_cast<uint8_t*>(std::aligned_alloc(kAlign, arena_bytes)));
    }
    if (memory == nullptr) {
      // As before the call: the space left in the current arena serves later, smaller buffers.
      arena_ = arena_before;
      offset_ = offset_before;
      return absl::ResourceExhaustedError(absl::StrCat(
          "ucx staging: cannot allocate ", arena_bytes, " bytes (for a buffer of ", wanted,
          " bytes; the collective's staging holds ", held, " bytes already",
          limit_bytes_ > 0 ? absl::StrCat(", its limit is ", limit_bytes_) : std::string(), ")"));
    }
    Arena& arena = arenas_.emplace_back();
    arena.memory = std::move(memory);
    arena.bytes = arena_bytes;
    ASAN_POISON_MEMORY_REGION(arena.memory.get(), arena.bytes);
    offset_ = 0;
  }
  uint8_t* buffer = arenas_[arena_].memory.get() + offset_;
  offset_ += bytes;
  ASAN_UNPOISON_MEMORY_REGION(buffer, wanted);
  return buffer;
}

void Batch::Reset() {
  used_ = 0;
  arena_ = 0;
  offset_ = 0;
  if (held_bytes() > kRetainBytes) {
    for (Arena& a : arenas_) ASAN_UNPOISON_MEMORY_REGION(a.memory.get(), a.bytes);
    arenas_.clear();
  }
  for (Arena& a : arenas_) ASAN_POISON_MEMORY_REGION(a.memory.get(), a.bytes);
}

UcxTransport::UcxTransport(int rank, int size, std::string name)
    : rank_(rank),
      size_(size),
      name_(std::move(name)),
      peers_(size),
      peer_memory_(size, absl::StrCat("ucx communicator ", name_, " rank ", rank_)) {}

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
    // A flushing close to a peer that went silent (a cut link) may never complete. Release the
    // requests: UCX frees them when they end, and destroying the worker with a request that
    // was never released fails its assertion (the process aborts).
    for (void* request : closing) ucp_request_free(request);
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

absl::Status UcxTransport::SendIov(int peer, const ucp_dt_iov_t* iov, size_t count, uint64_t tag,
                                   Completion* c) {
  c->expected = 0;
  for (size_t i = 0; i < count; ++i) c->expected += iov[i].length;
  c->peer = peer;
  c->is_send = true;
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.cb.send = &SendCallback;
  param.user_data = c;
  param.datatype = ucp_dt_make_iov();
  Track(ucp_tag_send_nbx(peers_[peer].ep, iov, count, tag, &param), c);
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

ucp_tag_message_h UcxTransport::Probe(uint64_t tag, uint64_t mask, ucp_tag_recv_info_t* info) {
  return ucp_tag_probe_nb(worker_, tag, mask, /*remove=*/1, info);
}

void UcxTransport::RecvProbed(ucp_tag_message_h message, int peer, void* buffer, size_t bytes,
                              Completion* c) {
  c->expected = bytes;
  c->peer = peer;
  c->is_send = false;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.recv = &RecvCallback;
  param.user_data = c;
  static uint8_t sink = 0;
  ucs_status_ptr_t r =
      ucp_tag_msg_recv_nbx(worker_, bytes == 0 ? &sink : buffer, bytes, message, &param);
  if (r == nullptr) c->length = bytes;
  Track(r, c);
}

bool UcxTransport::Reap(Batch& batch) {
  FreeRequests(batch);
  for (Completion& c : batch.slots()) {
    if (!c.done.load(std::memory_order_acquire)) return false;
  }
  return true;
}

void UcxTransport::Abandon(std::unique_ptr<Batch> batch) {
  if (batch == nullptr) return;
  FreeRequests(*batch);
  unclean_ = true;
  std::lock_guard<std::mutex> lock(mu_);
  graveyard_.push_back(std::move(batch));
}

const uint8_t* UcxTransport::MapPeerRegion(int peer, uint64_t region_id, int fd, size_t bytes,
                                           size_t needed) {
  if (!map_ || !peers_[peer].pulls_from) return nullptr;
  return peer_memory_.Map(peer, region_id, fd, bytes, needed);
}

namespace {

// Whether process `pid` has exited or exits within `wait_ms`: a read from a peer that is exiting
// fails with EFAULT (its memory is being torn down) before the peer is gone. The wait is on the
// process's pidfd, which becomes readable when it exits; false if pidfds are unavailable.
bool ExitsWithin(pid_t pid, int wait_ms) {
#ifdef SYS_pidfd_open
  const int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) return errno == ESRCH;
  pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
  int ready = 0;
  do {
    ready = poll(&p, 1, wait_ms);
  } while (ready < 0 && errno == EINTR);
  close(fd);
  return ready > 0;
#else
  (void)pid;
  (void)wait_ms;
  return false;
#endif
}

}  // namespace

absl::Status UcxTransport::CmaRead(int peer, void* dst, uint64_t remote, size_t bytes) {
  const int error = peer_memory_.Read(peer, dst, remote, bytes);
  if (error == 0) return absl::OkStatus();
  // EFAULT from a peer that is exiting is its death, not a bad address: it is an error about
  // that peer (Unavailable) like ESRCH, as long as the peer really goes (within 200 ms).
  if (error == ESRCH || (error == EFAULT && ExitsWithin(peer_memory_.pid(peer), 200))) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      peers_[peer].failed = true;
    }
    return absl::UnavailableError(absl::StrCat("peer rank ", peer, " (pid ", peer_memory_.pid(peer),
                                               " on this host) exited during a read of ", bytes,
                                               " bytes from it"));
  }
  return absl::InternalError(
      absl::StrCat("reading ", bytes, " bytes at ", absl::Hex(remote), " from peer rank ", peer,
                   " (pid ", peer_memory_.pid(peer), ") failed: ", std::strerror(error)));
}

void UcxTransport::FreeRequests(Batch& batch) {
  for (Completion& c : batch.slots()) {
    if (c.request != nullptr && c.done.load(std::memory_order_acquire)) {
      ucp_request_free(c.request);
      c.request = nullptr;
    }
  }
}

std::unique_ptr<Batch> UcxTransport::Release(std::unique_ptr<Batch> batch) {
  if (batch == nullptr) return nullptr;
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
    return nullptr;
  }
  batch->Reset();
  return batch;
}

}  // namespace shardline::ucx_internal

namespace shardline::ucx_internal {

bool UcxTransport::maps_peers() const {
  if (!map_) return false;
  for (int p = 0; p < size_; ++p) {
    if (p != rank_ && peers_[p].local && peers_[p].pulled_by) return true;
  }
  return false;
}

bool UcxTransport::read_by_every_local_peer() const {
  for (int p = 0; p < size_; ++p) {
    if (p != rank_ && peers_[p].local && !peers_[p].pulled_by) {
      return false;
    }
  }
  return true;
}

bool UcxTransport::has_local_peers() const {
  for (int p = 0; p < size_; ++p) {
    if (p != rank_ && peers_[p].local) return true;
  }
  return false;
}

}  // namespace shardline::ucx_internal
