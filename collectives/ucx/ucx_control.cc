#include "collectives/ucx/internal/ucx_transport.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "collectives/communicator.h"
#include "runtime/clock.h"
#include "runtime/config.h"
#include "runtime/logging.h"

namespace shardline::ucx_internal {

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
  error->transport->failures_pending_.store(true, std::memory_order_release);
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

namespace {
// The transport whose abort handler this thread is running, if any.
thread_local const UcxTransport* reporting = nullptr;
}  // namespace

void UcxTransport::Report(const absl::Status& status, bool forward) {
  unclean_ = true;
  AbortHandler handler;
  {
    std::lock_guard<std::mutex> lock(handler_mu_);
    if (cleared_) return;
    if (!abort_handler_) {
      early_reports_.emplace_back(status, forward);
      return;
    }
    handler = abort_handler_;
    ++handler_calls_;
  }
  const UcxTransport* outer = reporting;
  reporting = this;
  handler(status, forward);
  reporting = outer;
  std::lock_guard<std::mutex> lock(handler_mu_);
  if (--handler_calls_ == 0) handler_cv_.notify_all();
}

void UcxTransport::ClearAbortHandler() {
  std::unique_lock<std::mutex> lock(handler_mu_);
  cleared_ = true;
  abort_handler_ = nullptr;
  early_reports_.clear();
  // Not for a call on this thread: the handler itself let go of the communicator.
  const int own = reporting == this ? 1 : 0;
  if (!WallClock().WaitUntil(handler_cv_, lock, DefaultDeadline(),
                             [&] { return handler_calls_ == own; })) {
    SL_LOG(WARN, COLL) << "ucx communicator " << name_ << " rank " << rank_
                       << ": an abort report still runs after SHARDLINE_TIMEOUT_S; destroying "
                          "the communicator anyway";
  }
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

void UcxTransport::MarkAborted() {
  if (mailboxes_ != nullptr) mailboxes_->MarkAborted();
}

void UcxTransport::BroadcastAbort(const absl::Status& reason) {
  // First: a peer that finds this rank's mailbox slot complete must not take it as agreement.
  MarkAborted();
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

absl::Status UcxTransport::CheckPeers(absl::Time now) {
  if (now < next_peer_check_) return peers_status_;
  next_peer_check_ = now + absl::Milliseconds(200);
  if (!peers_status_.ok()) return peers_status_;
  const int64_t self = getpid();
  for (int p = 0; p < size_; ++p) {
    const Peer& peer = peers_[p];
    if (p == rank_ || !peer.local || peer_memory_.pid(p) == self) continue;
    if (!peer_memory_.Alive(p)) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        peers_[p].failed = true;
      }
      // A peer error on this rank too, as on the ranks that learn it from the abort notice.
      peers_status_ = MarkPeerError(
          absl::UnavailableError(absl::StrCat("peer rank ", p, " (pid ", peer_memory_.pid(p),
                                              " on this host) exited")),
          absl::StrCat(p));
      Report(peers_status_, /*forward=*/true);
      return peers_status_;
    }
  }
  return absl::OkStatus();
}

}  // namespace shardline::ucx_internal
