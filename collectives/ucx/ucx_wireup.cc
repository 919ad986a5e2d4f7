#include "collectives/ucx/internal/ucx_transport.h"

#include <sched.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "collectives/communicator.h"
#include "collectives/ucx/internal/peer_memory.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace shardline::ucx_internal {

namespace {

// `prefix` is "<name>/ucx/<epoch>" (see Init).
std::string AddressKey(absl::string_view prefix, int rank) {
  return absl::StrCat(prefix, "/addr/", rank);
}

std::string CmaKey(absl::string_view prefix, int rank) {
  return absl::StrCat(prefix, "/cma/", rank);
}

// The wire-up message: the sender's rank and its wire-protocol tuning, as SHARDLINE_UCX_* knobs.
enum WireupWord : size_t {
  kWireupRank,
  kWireupChunkBytes,
  kWireupSmallBytes,
  kWireupWindow,
  kWireupWords
};
constexpr size_t kWireupBytes = kWireupWords * sizeof(uint64_t);

// The largest payload a mailbox slot holds (ranks x SHARDLINE_UCX_SMALL_BYTES): beyond it a
// communicator exchanges its fingerprints through UCX.
constexpr size_t kMaxMailboxPayload = size_t{64} << 20;
// The key of a peer's mailbox among PeerMemory's mappings (arena ids start at 1, count up).
constexpr uint64_t kMailboxRegion = ~uint64_t{0};

}  // namespace

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
  SL_ASSIGN_OR_RETURN(const std::string yield, ParamUcxYield().Get());
  yield_ = yield == "always"  ? YieldPolicy::kAlways
           : yield == "never" ? YieldPolicy::kNever
                              : YieldPolicy::kAuto;
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
  {
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0 && CPU_COUNT(&cpus) == 1) {
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &cpus)) pinned_cpu_ = c;
      }
    }
  }
  if (tuning.mailbox && shm && size_ * tuning.small_bytes <= kMaxMailboxPayload) {
    absl::StatusOr<std::unique_ptr<Mailboxes>> made = Mailboxes::Create(
        rank_, size_, CollectiveFingerprint::kEncodedSize, size_ * tuning.small_bytes);
    if (made.ok()) {
      mailboxes_ = *std::move(made);
    } else {
      SL_LOG(INFO, COLL) << where << ": no shared-memory mailbox (" << made.status().message()
                         << "): fingerprints go through UCX";
    }
  }
  // Before any peer may look: its probe read (CMA) and its mapping of the mailbox need it.
  if (cma || mailboxes_ != nullptr) AllowPeerReads();
  // host \n pid pinned-cpu mailbox-fd mailbox-bytes \n probe-address probe-value \n ucx-address
  std::string value =
      absl::StrCat(host, "\n", getpid(), " ", pinned_cpu_, " ", mailboxes_ ? mailboxes_->fd() : -1,
                   " ", mailboxes_ ? mailboxes_->bytes() : 0, "\n",
                   reinterpret_cast<uintptr_t>(&probe_), " ", probe_, "\n");
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
  std::vector<std::pair<int, size_t>> peer_mailboxes(size_, {-1, 0});  // (fd, bytes)
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    SL_ASSIGN_OR_RETURN(std::string peer_value, store.Get(keys[p], deadline));
    std::vector<size_t> nl;
    for (size_t at = peer_value.find('\n'); at != std::string::npos && nl.size() < 3;
         at = peer_value.find('\n', at + 1)) {
      nl.push_back(at);
    }
    int64_t pid = 0;
    int cpu = -1;
    // "pid cpu mailbox-fd mailbox-bytes" (the second line).
    const absl::string_view pid_line =
        nl.size() < 3 ? absl::string_view()
                      : absl::string_view(peer_value).substr(nl[0] + 1, nl[1] - nl[0] - 1);
    const std::vector<absl::string_view> fields = absl::StrSplit(pid_line, ' ');
    if (nl.size() < 3 || nl[2] + 1 >= peer_value.size() || fields.size() != 4 ||
        !absl::SimpleAtoi(fields[0], &pid) || !absl::SimpleAtoi(fields[1], &cpu) ||
        !absl::SimpleAtoi(fields[2], &peer_mailboxes[p].first) ||
        !absl::SimpleAtoi(fields[3], &peer_mailboxes[p].second)) {
      return absl::InternalError(absl::StrCat(where, ": malformed address of rank ", p,
                                              " in the store (key '", keys[p], "')"));
    }
    values[p] = peer_value.substr(nl[1] + 1, nl[2] - nl[1] - 1);
    Peer& peer = peers_[p];
    peer.local = peer_value.compare(0, nl[0], host) == 0;
    peer.cpu = peer.local ? cpu : -1;
    if (peer.local) peer_memory_.Watch(p, pid);
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
  const bool mailboxes_ready = MapMailboxes(peer_mailboxes);
  SL_RETURN_IF_ERROR(Annotate(AgreeOnCma(store, values, cma, mailboxes_ready, deadline), where));
  int on_host = 1;
  for (int p = 0; p < size_; ++p) on_host += p != rank_ && peers_[p].local;
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0) {
    cpus_ = CPU_COUNT(&cpus);
    oversubscribed_ = on_host > cpus_;
  }
  if (pinned_cpu_ >= 0) {
    // Pinned ranks (shardline-launch --bind-to core) compete for this CPU only with the peers
    // pinned to it too: two ranks on two CPUs spin, four on two yield.
    oversubscribed_ = false;
    for (int p = 0; p < size_; ++p)
      oversubscribed_ = oversubscribed_ || (p != rank_ && SharesCpu(p));
  }
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

absl::Status UcxTransport::CompleteWireup(const Tuning& tuning, absl::Time deadline,
                                          absl::string_view where, std::vector<Tuning>* tunings) {
  auto batch = std::make_unique<Batch>();
  // One message each way per peer: this rank's receives, then its sends.
  std::vector<Completion*> recvs(size_, nullptr), sends(size_, nullptr), flushes(size_, nullptr);
  absl::StatusOr<uint8_t*> staged = batch->Buffer(size_ * kWireupBytes);
  if (!staged.ok()) return Annotate(staged.status(), where);
  auto* in = reinterpret_cast<uint64_t*>(*staged);
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
      absl::Status alive = CheckPeers(absl::Now());
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

bool UcxTransport::MapMailboxes(const std::vector<std::pair<int, size_t>>& described) {
  if (mailboxes_ == nullptr) return false;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    const auto [fd, bytes] = described[p];
    if (!peers_[p].local || fd < 0 || bytes != mailboxes_->bytes()) return false;
    const uint8_t* mapping = peer_memory_.Map(p, kMailboxRegion, fd, bytes, bytes);
    if (mapping == nullptr) return false;
    mailboxes_->SetPeer(p, mapping);
  }
  return true;
}

absl::Status UcxTransport::AgreeOnCma(Store& store, const std::vector<std::string>& values,
                                      bool cma, bool mailboxes_ready, absl::Time deadline) {
  std::vector<int> local;
  for (int p = 0; p < size_; ++p) {
    if (p != rank_ && peers_[p].local) local.push_back(p);
  }
  if (local.empty()) {
    mailboxes_ = nullptr;
    return absl::OkStatus();
  }
  // '1' at position p: this rank read p's probe and found the value p published. Then 'M' if
  // this rank's mailboxes are ready, '-' if not.
  std::string readable(size_, '0');
  for (int p : local) {
    if (!cma) continue;
    std::vector<absl::string_view> parts = absl::StrSplit(values[p], ' ');
    uint64_t probe_address = 0, probe_value = 0, seen = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &probe_address) ||
        !absl::SimpleAtoi(parts[1], &probe_value)) {
      return absl::InternalError(absl::StrCat("malformed probe of rank ", p, " in the store"));
    }
    const int error = peer_memory_.Read(p, &seen, probe_address, sizeof(seen));
    if (error == 0 && seen == probe_value) {
      readable[p] = '1';
    } else {
      SL_LOG(INFO, COLL) << "ucx communicator " << name_ << " rank " << rank_
                         << ": cannot read the memory of rank " << p << " (pid "
                         << peer_memory_.pid(p) << "; "
                         << (error != 0 ? std::strerror(error) : "wrong value")
                         << "): its large messages go through UCX's shared memory";
    }
  }
  readable.push_back(mailboxes_ready ? 'M' : '-');
  SL_RETURN_IF_ERROR(store.Set(CmaKey(key_prefix_, rank_), readable));
  std::vector<std::string> keys;
  for (int p : local) keys.push_back(CmaKey(key_prefix_, p));
  absl::Status waited = store.Wait(keys, deadline);
  if (absl::IsDeadlineExceeded(waited)) {
    return absl::DeadlineExceededError(
        absl::StrCat("timed out waiting for the ranks on this host to probe each other"));
  }
  SL_RETURN_IF_ERROR(waited);
  // Every rank must see every peer's mailbox ready (all ranks on this host), or none uses them.
  bool all_ready = mailboxes_ready;
  for (int p : local) {
    SL_ASSIGN_OR_RETURN(std::string theirs, store.Get(CmaKey(key_prefix_, p), deadline));
    peers_[p].pulls_from = readable[p] == '1';
    peers_[p].pulled_by = theirs.size() == static_cast<size_t>(size_) + 1 && theirs[rank_] == '1';
    all_ready =
        all_ready && theirs.size() == static_cast<size_t>(size_) + 1 && theirs[size_] == 'M';
  }
  if (!all_ready) mailboxes_ = nullptr;
  return absl::OkStatus();
}

}  // namespace shardline::ucx_internal
