#include "collectives/ucx/internal/ucx_collective.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "collectives/ucx/internal/ucx_algorithms.h"
#include "runtime/check.h"
#include "runtime/clock.h"
#include "runtime/host_kernels.h"
#include "runtime/shared_memory.h"
#include "runtime/status.h"

namespace shardline::ucx_internal {

namespace {

// Data phases move user buffers; only they take the single-copy protocol.
bool SingleCopyPhase(Phase phase) { return phase == Phase::kData || phase == Phase::kGather; }

// What a single-copy sender tells its reader: the buffer's address and length, and, if the
// buffer is shareable memory, the arena that holds it (region id 0: it is not).
enum DescriptorWord : size_t {
  kAddress,
  kLength,
  kRegionId,
  kRegionFd,
  kRegionBytes,
  kRegionOffset,
  kDescriptorWords
};
constexpr size_t kDescriptorBytes = kDescriptorWords * sizeof(uint64_t);

// The most a receive of the fingerprint round makes room for beyond the payload it expects
// (bounds the staging of a large SHARDLINE_UCX_SMALL_BYTES).
constexpr size_t kMaxSmallCapacity = size_t{1} << 20;

}  // namespace

absl::StatusOr<uint8_t*> CollectiveRun::Staging(size_t bytes) {
  absl::StatusOr<uint8_t*> buffer = batch_->Buffer(bytes);
  if (!buffer.ok()) return Annotate(buffer.status(), hooks_.describe());
  return buffer;
}

Completion* CollectiveRun::Failed(int peer, bool is_send, absl::Status error) {
  if (staging_error_.ok()) staging_error_ = std::move(error);
  Completion* c = batch_->Add(peer, is_send);
  c->status = UCS_ERR_NO_MEMORY;
  c->done.store(true, std::memory_order_release);
  return c;
}

Completion* CollectiveRun::Send(int peer, const void* buffer, size_t bytes, Phase phase,
                                uint64_t chunk) {
  // Headers carry no sequence: see the tag layout in ucx_transport.h.
  const uint64_t seq = TagSeq(phase);
  if (SingleCopyPhase(phase) && transport_.PulledBy(peer)) {
    absl::StatusOr<uint8_t*> staged = Staging(kDescriptorBytes);
    if (!staged.ok()) return Failed(peer, /*is_send=*/true, staged.status());
    auto* desc = reinterpret_cast<uint64_t*>(*staged);
    desc[kAddress] = reinterpret_cast<uintptr_t>(buffer);
    desc[kLength] = bytes;
    desc[kRegionId] = 0;
    if (std::optional<ShareableSpan> span = FindShareable(buffer, bytes)) {
      desc[kRegionId] = span->region_id;
      desc[kRegionFd] = static_cast<uint64_t>(span->fd);
      desc[kRegionBytes] = span->region_bytes;
      desc[kRegionOffset] = span->offset;
    }
    transport_
        .Send(peer, desc, kDescriptorBytes, MakeTag(phase, rank(), seq, chunk),
              batch_->Add(peer, /*is_send=*/true))
        .IgnoreError();
    // The buffer is free again once the peer says it has read it.
    Completion* fin = batch_->Add(peer, /*is_send=*/false);
    transport_.Recv(peer, nullptr, 0, MakeTag(FinPhase(phase), peer, seq, chunk), fin)
        .IgnoreError();
    return fin;
  }
  Completion* c = batch_->Add(peer, /*is_send=*/true);
  transport_.Send(peer, buffer, bytes, MakeTag(phase, rank(), seq, chunk), c).IgnoreError();
  return c;
}

Completion* CollectiveRun::SendHeader(int peer, const ucp_dt_iov_t* iov, size_t count) {
  Completion* c = batch_->Add(peer, /*is_send=*/true);
  transport_.SendIov(peer, iov, count, MakeTag(Phase::kHeader, rank(), 0, 0), c).IgnoreError();
  return c;
}

Completion* CollectiveRun::Recv(int peer, void* buffer, size_t bytes, Phase phase, uint64_t chunk,
                                bool borrow) {
  const uint64_t seq = TagSeq(phase);
  if (SingleCopyPhase(phase) && transport_.PullsFrom(peer)) {
    absl::StatusOr<uint8_t*> staged = Staging(kDescriptorBytes);
    if (!staged.ok()) return Failed(peer, /*is_send=*/false, staged.status());
    auto* desc = reinterpret_cast<uint64_t*>(*staged);
    Completion* descriptor = batch_->Add(peer, /*is_send=*/false);
    transport_.Recv(peer, desc, kDescriptorBytes, MakeTag(phase, peer, seq, chunk), descriptor)
        .IgnoreError();
    Completion* done = batch_->Add(peer, /*is_send=*/false);
    done->expected = bytes;
    reads_.push_back({descriptor, done, desc, static_cast<uint8_t*>(buffer), bytes, peer, phase,
                      chunk, borrow, /*lease=*/false});
    return done;
  }
  Completion* c = batch_->Add(peer, /*is_send=*/false);
  c->view = static_cast<const uint8_t*>(buffer);
  transport_.Recv(peer, buffer, bytes, MakeTag(phase, peer, seq, chunk), c).IgnoreError();
  return c;
}

Completion* CollectiveRun::Lease(int peer, size_t bytes, Phase phase, uint64_t chunk) {
  SL_CHECK(SingleCopyPhase(phase) && transport_.PullsFrom(peer));
  Completion* done = Recv(peer, nullptr, bytes, phase, chunk, /*borrow=*/true);
  if (!reads_.empty() && reads_.back().done == done) reads_.back().lease = true;
  return done;
}

absl::Status CollectiveRun::ReadLeased(const Completion* c, size_t offset, void* dst,
                                       size_t bytes) {
  absl::Status status =
      Annotate(transport_.CmaRead(c->peer, dst, c->remote + offset, bytes), hooks_.describe());
  // As in ServeReads: a peer whose collective failed may have freed the buffer; its reason
  // counts.
  if (absl::IsInternal(status)) {
    if (absl::Status reason = AwaitAbortReason(absl::Milliseconds(200)); !reason.ok()) {
      status = std::move(reason);
    }
  }
  return status;
}

absl::Status CollectiveRun::ServeReads(bool* activity) {
  size_t kept = 0;
  absl::Status status;
  for (size_t i = 0; i < reads_.size(); ++i) {
    PendingRead& read = reads_[i];
    if (!status.ok() || !read.descriptor->done.load(std::memory_order_acquire)) {
      reads_[kept++] = read;
      continue;
    }
    *activity = true;
    status = Check(*read.descriptor);
    if (status.ok() && read.desc[kLength] != read.bytes) {
      status = absl::InternalError(absl::StrCat(hooks_.describe(), ": rank ", read.peer,
                                                " offered ", read.desc[kLength], " bytes where ",
                                                read.bytes, " were expected"));
    }
    const uint8_t* mapped = nullptr;
    if (status.ok() && read.desc[kRegionId] != 0 &&
        read.desc[kRegionOffset] <= read.desc[kRegionBytes] &&
        read.bytes <= read.desc[kRegionBytes] - read.desc[kRegionOffset]) {
      mapped = transport_.MapPeerRegion(
          read.peer, read.desc[kRegionId], static_cast<int>(read.desc[kRegionFd]),
          read.desc[kRegionBytes], read.desc[kRegionOffset] + read.bytes);
    }
    read.done->view = read.dst;
    const bool borrowed = mapped != nullptr && read.borrow;
    // Not mapped: the reader copies the pieces it needs (ReadLeased) and returns it at the end.
    const bool leased = !borrowed && read.lease && status.ok();
    if (borrowed) {
      read.done->view = mapped + read.desc[kRegionOffset];
      borrowed_.push_back({read.done, read.peer, read.phase, read.chunk});
    } else if (leased) {
      read.done->remote = read.desc[kAddress];
      borrowed_.push_back({read.done, read.peer, read.phase, read.chunk});
    } else if (mapped != nullptr) {
      CopyStreaming(read.dst, mapped + read.desc[kRegionOffset], read.bytes);
    } else if (status.ok()) {
      status = Annotate(transport_.CmaRead(read.peer, read.dst, read.desc[kAddress], read.bytes),
                        hooks_.describe());
      // A peer whose collective failed may have freed the buffer already: its reason counts.
      // It aborted before it freed anything, so its notice is here or on its way (as in
      // PeerAborted): wait for it a moment rather than report the read.
      if (absl::IsInternal(status)) {
        if (absl::Status reason = AwaitAbortReason(absl::Milliseconds(200)); !reason.ok()) {
          status = std::move(reason);
        }
      }
    }
    if (!status.ok()) {
      reads_[kept++] = read;
      continue;
    }
    if (!borrowed && !leased) SendFin(read.peer, read.phase, read.chunk);
    read.done->length = read.bytes;
    read.done->status = UCS_OK;
    read.done->done.store(true, std::memory_order_release);
  }
  reads_.resize(kept);
  return status;
}

void CollectiveRun::SendFin(int peer, Phase phase, uint64_t chunk) {
  transport_
      .Send(peer, nullptr, 0, MakeTag(FinPhase(phase), rank(), fp_.seq, chunk),
            batch_->Add(peer, /*is_send=*/true))
      .IgnoreError();
}

void CollectiveRun::Return(const Completion* c) {
  for (size_t i = 0; i < borrowed_.size(); ++i) {
    if (borrowed_[i].done != c) continue;
    SendFin(borrowed_[i].peer, borrowed_[i].phase, borrowed_[i].chunk);
    borrowed_[i] = borrowed_.back();
    borrowed_.pop_back();
    return;
  }
}

void CollectiveRun::AbandonReads() {
  for (PendingRead& read : reads_) {
    read.done->status = UCS_ERR_CANCELED;
    read.done->done.store(true, std::memory_order_release);
  }
  reads_.clear();
}

absl::Status CollectiveRun::Check(const Completion& c) const {
  if (c.status == UCS_OK) {
    if (!c.is_send && !c.any_length && c.length != c.expected) {
      return absl::InternalError(absl::StrCat(hooks_.describe(), ": rank ", c.peer, " sent ",
                                              c.length, " bytes where ", c.expected,
                                              " were expected"));
    }
    return absl::OkStatus();
  }
  // Only Failed() makes a completion of this status without a request.
  if (c.status == UCS_ERR_NO_MEMORY && !staging_error_.ok()) return staging_error_;
  absl::Status comm = hooks_.comm_status();
  if (!comm.ok()) return Annotate(comm, hooks_.describe());
  if (c.status == UCS_ERR_MESSAGE_TRUNCATED) {
    return absl::InternalError(absl::StrCat(hooks_.describe(), ": rank ", c.peer,
                                            " sent more than the ", c.expected,
                                            " bytes expected (message truncated, discarded)"));
  }
  return MarkPeerError(absl::UnavailableError(absl::StrCat(
                           hooks_.describe(), ": ", c.is_send ? "sending to" : "receiving from",
                           " peer rank ", c.peer, " failed (ucx: ", UcxError(c.status), ")")),
                       absl::StrCat(c.peer));
}

absl::StatusOr<bool> CollectiveRun::Done(const Completion* c) const {
  if (c == nullptr) return true;
  if (!c->done.load(std::memory_order_acquire)) return false;
  SL_RETURN_IF_ERROR(Check(*c));
  return true;
}

std::vector<int> CollectiveRun::PendingPeers() {
  std::vector<int> peers;
  for (const Completion& c : batch_->slots()) {
    if (!c.done.load(std::memory_order_acquire)) peers.push_back(c.peer);
  }
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  return peers;
}

absl::Status CollectiveRun::Drive(absl::FunctionRef<absl::StatusOr<bool>()> step) {
  return Drive(
      step,
      [this](absl::Time deadline) {
        if (!transport_.Sleep(deadline)) CountCollectiveSleepRunOut();
      },
      [this] { return PendingPeers(); }, [] { return true; });
}

absl::Status CollectiveRun::Drive(absl::FunctionRef<absl::StatusOr<bool>()> step,
                                  absl::FunctionRef<void(absl::Time deadline)> sleep,
                                  absl::FunctionRef<std::vector<int>()> pending,
                                  absl::FunctionRef<bool()> mates_pending) {
  absl::Time last_activity = WallNow();
  while (true) {
    bool activity = transport_.Progress();
    SL_RETURN_IF_ERROR(ServeReads(&activity));
    SL_ASSIGN_OR_RETURN(const bool finished, step());
    if (finished) return absl::OkStatus();
    absl::Status comm = hooks_.comm_status();
    if (!comm.ok()) return Annotate(comm, hooks_.describe());
    // One clock reading per poll, shared by the checks below (WallNow: a quarter of
    // absl::Now()'s cost, on every poll of a spin).
    const absl::Time now = WallNow();
    absl::Status peers = transport_.CheckPeers(now);
    if (!peers.ok()) return Annotate(peers, hooks_.describe());
    if (now >= deadline_) return hooks_.deadline_error(pending());
    if (activity) last_activity = now;
    // Poll, then sleep. Waking a sleeping rank costs a scheduler wake-up, which on a virtual
    // machine whose idle vCPU halted can take hundreds of microseconds: with a spin shorter than
    // that, two ranks fall into a lock-step where every collective waits for the other's
    // wake-up (docs/benchmarks.md has the measurements). Where this host runs more ranks than
    // this process has CPUs (or SHARDLINE_UCX_YIELD's rule says so), polling hands the core to
    // a runnable thread between polls; on an idle host with spare cores sched_yield only costs
    // (it brought the same lock-step back at the yield threshold).
    if (now - last_activity < tuning_.spin) {
      transport_.YieldIfOversubscribed(now, now - last_activity, mates_pending());
      continue;
    }
    // Only on the way to sleep: the spin stays free of it.
    hooks_.waiting_on(pending());
    sleep(deadline_);
  }
}

absl::Status CollectiveRun::PollOnce() {
  bool activity = transport_.Progress();
  return ServeReads(&activity);
}

absl::Status CollectiveRun::AwaitAbortReason(absl::Duration within) {
  const absl::Time until = absl::Now() + within;
  while (true) {
    transport_.Progress();
    absl::Status comm = hooks_.comm_status();
    if (!comm.ok()) return Annotate(comm, hooks_.describe());
    if (absl::Now() >= until) return absl::OkStatus();
    std::this_thread::yield();
  }
}

absl::Status CollectiveRun::PeerAborted(int peer) {
  // The notice follows the mark (BroadcastAbort): it is here or on its way.
  SL_RETURN_IF_ERROR(AwaitAbortReason(absl::Milliseconds(100)));
  return MarkPeerError(
      absl::AbortedError(absl::StrCat(hooks_.describe(), ": rank ", peer,
                                      " aborted the communicator (its reason did not arrive)")),
      absl::StrCat(peer));
}

absl::Status CollectiveRun::WaitAll(const std::vector<Completion*>& cs) {
  size_t next = 0;  // completions finish roughly in order: skip the prefix known done
  auto step = [&]() -> absl::StatusOr<bool> {
    for (; next < cs.size(); ++next) {
      SL_ASSIGN_OR_RETURN(const bool done, Done(cs[next]));
      if (!done) return false;
    }
    return true;
  };
  // Everything done already (a small collective's sends usually are): no poll.
  SL_ASSIGN_OR_RETURN(const bool finished, step());
  if (finished) return absl::OkStatus();
  return Drive(step);
}

absl::Status CollectiveRun::WaitBatch() {
  std::vector<Completion*>& all = scratch_.waits;
  all.clear();
  for (Completion& c : batch_->slots()) all.push_back(&c);
  return WaitAll(all);
}

namespace {

// Every rank compares the same table the same way, so every rank names the same pair. `encoded[p]`:
// peer p's fingerprint as it sent it (this rank's own is not read).
absl::Status CompareFingerprints(CollectiveRun& run, const std::vector<const uint8_t*>& encoded) {
  const int n = run.size();
  std::vector<CollectiveFingerprint>& fps = run.scratch().fps;
  fps.resize(n);
  for (int p = 0; p < n; ++p) {
    if (p == run.rank()) {
      fps[p] = run.fp();
      continue;
    }
    absl::StatusOr<CollectiveFingerprint> fp = CollectiveFingerprint::Decode(encoded[p]);
    if (!fp.ok()) {
      return absl::InternalError(
          absl::StrCat(run.hooks().describe(), ": rank ", p,
                       " sent a malformed fingerprint: ", fp.status().message()));
    }
    fps[p] = *fp;
  }
  for (int p = 1; p < n; ++p) {
    if (!(fps[p] == fps[0])) return run.hooks().mismatch_error(0, fps[0], p, fps[p]);
  }
  return absl::OkStatus();
}

std::atomic<void (*)(int, uint64_t)> before_data_hook{nullptr};

// The data of a collective above the small size, once the fingerprints agree.
absl::Status RunLarge(CollectiveRun& run) {
  if (auto* hook = before_data_hook.load(std::memory_order_acquire)) hook(run.rank(), run.fp().seq);
  switch (run.fp().kind) {
    case CollectiveKind::kAllGather:
      SL_RETURN_IF_ERROR(LargeAllGather(run));
      break;
    case CollectiveKind::kAllToAll:
      SL_RETURN_IF_ERROR(LargeAllToAll(run));
      break;
    case CollectiveKind::kBroadcast:
      SL_RETURN_IF_ERROR(LargeBroadcast(run));
      break;
    case CollectiveKind::kReduceScatter:
      SL_RETURN_IF_ERROR(LargeReduceScatter(run));
      break;
    case CollectiveKind::kAllReduce:
      SL_RETURN_IF_ERROR(LargeAllReduce(run));
      break;
    case CollectiveKind::kBarrier:
    case CollectiveKind::kSend:  // point-to-point never runs here (ucx_point_to_point.cc)
    case CollectiveKind::kRecv:
      break;
  }
  // Nothing may still read or write user memory when the collective returns.
  return run.WaitBatch();
}

// The fingerprint round through the mailboxes (mailbox.h): this rank's fingerprint and small
// payload into its slot, then every peer's out of theirs.
absl::Status RunThroughMailboxes(CollectiveRun& run, Mailboxes& boxes) {
  const int n = run.size();
  const int me = run.rank();
  const uint64_t count = boxes.Next();
  run.fp().Encode(boxes.fingerprint(count));
  const bool small = IsSmall(run);
  if (small) FillMailbox(run, boxes.payload(count));
  boxes.Publish(count);

  int next = 0;  // peers below it have arrived
  auto arrived = [&]() -> absl::StatusOr<bool> {
    for (; next < n; ++next) {
      if (next != me && !boxes.Arrived(next, count)) return false;
    }
    return true;
  };
  // The spin over, sleep on the first peer still awaited, a while at most: the loop around
  // progresses the worker (a peer's abort notice) and watches the peers' processes between.
  constexpr absl::Duration kLongestSleep = absl::Milliseconds(10);
  auto sleep = [&](absl::Time deadline) {
    boxes.Sleep(next, count,
                std::clamp(deadline - absl::Now(), absl::ZeroDuration(), kLongestSleep));
  };
  auto pending = [&] {
    std::vector<int> peers;
    for (int p = 0; p < n; ++p) {
      if (p != me && !boxes.Arrived(p, count)) peers.push_back(p);
    }
    return peers;
  };
  // Ranks pinned to CPUs (shardline-launch --bind-to core) know who shares theirs: once every
  // peer on this rank's CPU has published, the peers still awaited run on other CPUs and no
  // rank here needs the core, so sharing it with them is no reason to yield (a yield would
  // only bounce between two waiting ranks, a context switch each way).
  auto mates_pending = [&] {
    if (!run.pinned()) return true;
    for (int p = 0; p < n; ++p) {
      if (p != me && run.SharesCpu(p) && !boxes.Arrived(p, count)) return true;
    }
    return false;
  };
  SL_ASSIGN_OR_RETURN(const bool all_there, arrived());
  if (!all_there) SL_RETURN_IF_ERROR(run.Drive(arrived, sleep, pending, mates_pending));
  // A peer that aborted before it finished this collective (it gave up on it, say) published
  // its slot before it did. One that aborted later finished this one: its slot stands.
  for (int p = 0; p < n; ++p) {
    if (p != me && boxes.AbortedBefore(p, count)) return run.PeerAborted(p);
  }

  std::vector<const uint8_t*>& encoded = run.scratch().received;
  encoded.assign(n, nullptr);
  for (int p = 0; p < n; ++p) {
    if (p != me) encoded[p] = boxes.fingerprint(p, count);
  }
  SL_RETURN_IF_ERROR(CompareFingerprints(run, encoded));
  if (small) {
    // The fingerprints agree: every peer filled its slot for this collective the same way.
    std::vector<const uint8_t*>& staging = run.scratch().staging;
    staging.assign(n, nullptr);
    for (int p = 0; p < n; ++p) {
      if (p != me) staging[p] = MailboxPayloadFor(run, boxes.payload(p, count), p);
    }
    SL_RETURN_IF_ERROR(FinishSmall(run, staging));
  } else if (absl::Status large = RunLarge(run); !large.ok()) {
    // A read of a peer's buffer fails (EFAULT) once that peer gave up on the collective and
    // freed it; the peer marked its mailbox first (MarkAborted): report the peer's reason, not
    // the read.
    std::atomic_thread_fence(std::memory_order_acquire);
    for (int p = 0; p < n; ++p) {
      if (p != me && boxes.AbortedBefore(p, count)) return run.PeerAborted(p);
    }
    return large;
  }
  // Every read of a peer's memory for this collective is done: its slot, and the buffers of a
  // large one (mapped, borrowed or read with process_vm_readv). A peer that gave up on this
  // collective may have freed and reused those buffers meanwhile, so what was read may be
  // garbage even though every read and fin went well: a straggler resumed after its peers
  // timed out would return OK with it. Such a peer marked its mailbox before it returned from
  // the collective (UcxCommunicator::Run), ordered before its later writes (MarkAborted); read
  // after this fence, no mark means every peer was still in this collective, or past it, while
  // this rank read its memory. One load per peer.
  std::atomic_thread_fence(std::memory_order_acquire);
  for (int p = 0; p < n; ++p) {
    if (p != me && boxes.AbortedBefore(p, count)) return run.PeerAborted(p);
  }
  boxes.Completed(count);
  return absl::OkStatus();
}

}  // namespace

absl::Status RunCollective(CollectiveRun& run) {
  if (Mailboxes* boxes = run.mailboxes()) return RunThroughMailboxes(run, *boxes);
  const int n = run.size();
  const int me = run.rank();
  constexpr size_t kFp = CollectiveFingerprint::kEncodedSize;

  // One message to and from every peer: the fingerprint, followed for small collectives by the
  // payload (one message per peer, not two: at small sizes a collective costs what its
  // messages cost). A receive's buffer holds whatever a peer on the small protocol may send
  // (up to small_bytes, which every rank shares), so that a peer that called another
  // collective is reported as a mismatch, not as a truncated message.
  RunScratch& scratch = run.scratch();
  SL_ASSIGN_OR_RETURN(uint8_t* const header, run.Staging(kFp));
  run.fp().Encode(header);
  const bool small = IsSmall(run);
  std::vector<Completion*>& header_recvs = scratch.completions;
  std::vector<const uint8_t*>& received = scratch.received;
  std::vector<const uint8_t*>& staging = scratch.staging;
  header_recvs.assign(n, nullptr);
  received.assign(n, nullptr);
  staging.assign(n, nullptr);
  // Sends first: a peer waits for them, while this rank's receives may match a message that
  // arrived before them. The payload goes straight from the input: UCX gathers the fingerprint
  // and the payload into one message (no packing copy here). The pieces live in the batch,
  // which outlives the sends.
  SL_ASSIGN_OR_RETURN(uint8_t* const pieces_buffer, run.Staging(sizeof(ucp_dt_iov_t) * 2 * n));
  auto* iov = reinterpret_cast<ucp_dt_iov_t*>(pieces_buffer);
  for (int i = 1; i < n; ++i) {
    const int p = (me + i) % n;
    const size_t bytes = small ? SmallPayloadBytes(run, me, p) : 0;
    if (bytes == 0) {
      run.Send(p, header, kFp, Phase::kHeader, 0);
      continue;
    }
    ucp_dt_iov_t* pieces = iov + 2 * p;
    pieces[0] = {header, kFp};
    pieces[1] = {const_cast<void*>(SmallPayload(run, p)), bytes};
    run.SendHeader(p, pieces, 2);
  }
  for (int i = 1; i < n; ++i) {
    const int p = (me - i + n) % n;
    const size_t expected = small ? SmallPayloadBytes(run, p, me) : 0;
    const size_t capacity =
        kFp + std::max(expected, std::min(run.tuning().small_bytes, kMaxSmallCapacity));
    SL_ASSIGN_OR_RETURN(uint8_t* const buffer, run.Staging(capacity));
    received[p] = buffer;
    if (expected > 0) staging[p] = buffer + kFp;
    header_recvs[p] = run.Recv(p, buffer, capacity, Phase::kHeader, 0);
    header_recvs[p]->any_length = true;
  }
  SL_RETURN_IF_ERROR(run.WaitAll(header_recvs));

  for (int p = 0; p < n; ++p) {
    if (p != me && header_recvs[p]->length < kFp) {
      return absl::InternalError(absl::StrCat(run.hooks().describe(), ": rank ", p, " sent ",
                                              header_recvs[p]->length,
                                              " bytes where a fingerprint was expected"));
    }
  }
  SL_RETURN_IF_ERROR(CompareFingerprints(run, received));
  // The fingerprints agree, so every peer took the same protocol and sent exactly this much.
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    const size_t want = kFp + (small ? SmallPayloadBytes(run, p, me) : 0);
    if (header_recvs[p]->length != want) {
      return absl::InternalError(absl::StrCat(run.hooks().describe(), ": rank ", p, " sent ",
                                              header_recvs[p]->length, " bytes where ", want,
                                              " were expected"));
    }
  }

  if (small) {
    // Sends too: an in-place output may be the buffer a peer still reads.
    SL_RETURN_IF_ERROR(run.WaitBatch());
    return FinishSmall(run, staging);
  }
  SL_RETURN_IF_ERROR(RunLarge(run));
  // No mailboxes to hold an abort mark here (ranks on several hosts, or SHARDLINE_UCX_MAILBOX=0):
  // the peers' abort notices are the only word. A rank whose receives all matched queued
  // messages finishes without having looked for them; one poll takes in those that arrived
  // meanwhile (a straggler resumed after its peers gave up finds theirs queued). Best effort:
  // a notice still in flight is missed (docs/collectives.md).
  SL_RETURN_IF_ERROR(run.PollOnce());
  const absl::Status comm = run.hooks().comm_status();
  if (!comm.ok()) return Annotate(comm, run.hooks().describe());
  return absl::OkStatus();
}

void SetBeforeDataHookForTesting(void (*hook)(int rank, uint64_t seq)) {
  before_data_hook.store(hook, std::memory_order_release);
}

}  // namespace shardline::ucx_internal
