// File: collectives/ucx/internal/ucx_transport.h
// -----------------------------------------------------------------------------
// The UCX plumbing of one communicator (backend-private): a ucp worker (the ucp context is
// shared by every communicator of the process), an endpoint to every peer, tagged sends and
// receives that complete into Completion slots, a control channel (abort notices, goodbyes),
// failure detection, and the progress model:
//
//   * While a collective runs, the stream thread that runs it drives the worker itself
//     (ucp_worker_progress, a short bounded spin, then ucp_worker_arm + poll on the worker's
//     event fd, so an idle wait sleeps in the kernel).
//   * Between collectives an idle progress thread sleeps on the same event fd and handles what
//     arrives (peer aborts, goodbyes, endpoint errors, UCX wire-up and keepalive); it pauses
//     while a collective runs so that two threads never compete for the worker.
//   The worker is created with UCS_THREAD_MODE_MULTI: Abort() may post control messages from
//   any thread.
//
// Every endpoint uses UCP_ERR_HANDLING_MODE_PEER with an error callback, so a peer's death is an
// error, never a crash: UCX 1.13 then uses its shared-memory transports (sysv/posix, with
// UCX_MM_ERROR_HANDLING=y) within a host and TCP/IB across hosts, but not its CMA transport,
// whose failed reads of a dead peer are fatal to the reader. Large messages between ranks on the
// same host therefore take our own single-copy path (SHARDLINE_UCX_CMA, default on): the sender
// sends a descriptor (address, length) on the data tag, the receiver copies the bytes straight
// out of the sender's memory with process_vm_readv (CmaRead) and answers with a "fin" on the
// matching FinPhase tag, which completes the send. A read from a peer that died fails with
// ESRCH and becomes Unavailable naming the peer. Whether rank a may read rank b's memory is
// probed at creation and agreed through the store, so both sides always pick the same protocol.
// Peers on the same host are also watched through a pidfd opened at creation (CheckPeers), which
// notices a death within 200 ms even when no read is in flight, and never mistakes a new process
// that reuses the pid for the peer. When the sender's buffer is shareable memory
// (runtime/shared_memory.h) its descriptor also names its arena and offset, and the receiver
// copies from its own mapping of that arena (MapPeerRegion) instead: plain memcpy, no system
// call. What
// touches the local peers' processes (liveness, reads, mappings) is PeerMemory (peer_memory.h).
// Where every rank runs on this host, the fingerprint round of each collective (and a small
// collective's payload) goes through shared-memory mailboxes instead of messages (mailbox.h).
//
// The implementation is split by job: ucx_wireup.cc (creation: addresses, the CMA agreement, the
// handshake and its tuning check), ucx_control.cc (control channel, aborts, liveness),
// ucx_progress.cc (the progress model), ucx_transport.cc (send, receive, release, teardown).

#ifndef SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_TRANSPORT_H_
#define SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_TRANSPORT_H_

#include <ucp/api/ucp.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collectives/store/store.h"
#include "collectives/ucx/internal/mailbox.h"
#include "collectives/ucx/internal/peer_memory.h"
#include "collectives/ucx/internal/ucx_context.h"

namespace shardline::ucx_internal {

// Tag layout (64 bits): phase (4) | source rank (16) | sequence (24) | chunk (20). A worker
// belongs to one communicator, so tags never need a communicator id. Header tags carry no
// sequence: headers from one peer are matched in send order, so a peer that is at another
// collective is reported as a mismatch instead of never matching.
enum class Phase : uint64_t {
  kHeader = 0,  // fingerprint (+ the payload of a small collective)
  kData = 2,    // first data phase of large collectives
  kGather = 3,  // all-gather phase of the large all-reduce
  kWireup = 4,  // the one-message handshake at creation (never used by a collective)
  // Send / Recv (their own tag layout: ucx_point_to_point.h): a message with its data, or the
  // descriptor of one its receiver reads out of the sender's memory (single copy).
  kPointToPoint = 6,
  kPointToPointRead = 7,
  // 8 | p: the receiver's "read done" answer to a single-copy (CMA) message of phase p.
  kDataFin = 10,
  kGatherFin = 11,
  kPointToPointFin = 14,  // FinPhase(kPointToPoint): the read of a descriptor's data is done
  kControl = 15           // abort notices and goodbyes
};
inline Phase FinPhase(Phase phase) { return static_cast<Phase>(8 | static_cast<uint64_t>(phase)); }
constexpr int kMaxRanks = 1 << 16;
constexpr uint64_t kMaxChunks = uint64_t{1} << 20;
constexpr uint64_t kFullMask = ~uint64_t{0};
constexpr uint64_t kPhaseMask = uint64_t{0xF} << 60;

inline uint64_t MakeTag(Phase phase, int src, uint64_t seq, uint64_t chunk) {
  return (static_cast<uint64_t>(phase) << 60) | (static_cast<uint64_t>(src) << 44) |
         ((seq & 0xFFFFFF) << 20) | (chunk & (kMaxChunks - 1));
}
inline int TagSource(uint64_t tag) { return static_cast<int>((tag >> 44) & 0xFFFF); }

// Where one posted send or receive completes. Written by UCX callbacks (on whichever thread
// progresses the worker), read by the thread that runs the collective.
struct Completion {
  std::atomic<bool> done{false};
  ucs_status_t status = UCS_OK;
  size_t length = 0;    // bytes received
  size_t expected = 0;  // for a receive: its buffer's size, and the length it must have
  // A receive whose length its caller checks (it may be shorter than `expected`).
  bool any_length = false;
  bool is_send = false;
  int peer = -1;
  void* request = nullptr;  // UCX's request while pending; freed by Batch
  // Where a done receive's bytes are: its buffer, or for a borrowed single-copy receive the
  // sender's own memory (see CollectiveRun::Recv).
  const uint8_t* view = nullptr;
  // For a leased single-copy receive that this rank does not map (CollectiveRun::Lease): the
  // sender's address of the bytes.
  uint64_t remote = 0;
  ucp_tag_recv_info_t info{};
};

// Callbacks of posted requests: they complete the Completion passed as user data.
void SendCallback(void* request, ucs_status_t status, void* user);
void RecvCallback(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user);
// Records what a ucp_*_nbx call returned: done at once (OK or an error), or a request whose
// callback completes `c` later.
void Track(ucs_status_ptr_t r, Completion* c);

// The posted operations of one collective and the buffers they use. Completion slots have
// stable addresses; a Batch outlives every request that points into it (see Release). A
// communicator keeps its batch from one collective to the next (Reset): the slots and the
// buffers' memory are reused, so a small collective allocates nothing.
class Batch {
 public:
  // The slots in use, in the order they were added.
  class Slots {
   public:
    using iterator = std::deque<Completion>::iterator;
    Slots(iterator begin, iterator end) : begin_(begin), end_(end) {}
    iterator begin() const { return begin_; }
    iterator end() const { return end_; }

   private:
    iterator begin_;
    iterator end_;
  };

  Batch() = default;
  ~Batch();
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;

  Completion* Add(int peer, bool is_send) {
    if (used_ == slots_.size()) slots_.emplace_back();
    Completion& c = slots_[used_++];
    c.done.store(false, std::memory_order_relaxed);
    c.status = UCS_OK;
    c.length = 0;
    c.expected = 0;
    c.any_length = false;
    c.is_send = is_send;
    c.peer = peer;
    c.request = nullptr;
    c.view = nullptr;
    c.remote = 0;
    c.info = {};
    return &c;
  }
  // A buffer owned by the batch (staging, scratch, encoded headers), 64-byte aligned, valid
  // until the batch is reset or destroyed. ResourceExhausted naming the bytes if the memory
  // cannot be had (or the limit below would be passed): never an abort.
  absl::StatusOr<uint8_t*> Buffer(size_t bytes);
  // Test hook: the most buffer memory the batch may hold (0: no limit beyond the system's), so
  // that a test can make one rank's staging allocation fail.
  void set_limit_bytes(size_t limit) { limit_bytes_ = limit; }
  Slots slots() { return {slots_.begin(), slots_.begin() + static_cast<std::ptrdiff_t>(used_)}; }
  // Forgets every slot and buffer (every request must be done and freed: see Release). Keeps
  // the memory, up to kRetainBytes of buffers (a large collective's scratch is given back).
  void Reset();
  // Bytes of buffer memory the batch holds (handed out or not).
  size_t held_bytes() const {
    size_t total = 0;
    for (const Arena& a : arenas_) total += a.bytes;
    return total;
  }

  static constexpr size_t kRetainBytes = size_t{4} << 20;

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  struct Arena {
    std::unique_ptr<uint8_t, Free> memory;
    size_t bytes = 0;
  };
  static constexpr size_t kAlign = 64;
  static constexpr size_t kMinArenaBytes = size_t{64} << 10;

  std::deque<Completion> slots_;
  size_t used_ = 0;
  std::vector<Arena> arenas_;
  size_t arena_ = 0;   // the arena Buffer() carves from
  size_t offset_ = 0;  // bytes of it in use
  size_t limit_bytes_ = 0;
};

class UcxTransport {
 public:
  // Publishes this rank's address under "<name>/ucx/<epoch>/addr/<rank>", reads every peer's
  // (until `deadline`) and connects to them. `epoch` counts this rank's creations under `name`
  // (the counter "<name>/ucx/epoch/<rank>"), so a communicator re-created under a name never
  // reads the keys of an earlier one; each rank deletes its keys once every peer has read them.
  // Every rank sends its wire-protocol `tuning` to every peer in the wire-up handshake;
  // creation fails on every rank with InvalidArgument naming the first knob on which a rank
  // differs from rank 0, both ranks and both values.
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(int rank, int size, Store& store,
                                                              absl::string_view name,
                                                              const Tuning& tuning,
                                                              absl::Time deadline);
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;
  // Says goodbye to the peers, closes the endpoints (bounded: a few seconds at most, forced for
  // failed peers) and destroys the worker.
  ~UcxTransport();

  int rank() const { return rank_; }
  int size() const { return size_; }

  // Called (never with an internal lock held) with the error that must abort the communicator:
  // a peer's abort notice (`forward` false: the sender told everyone itself), an unreachable or
  // dead peer (`forward` true). Set once, right after Create; reports that arrived before are
  // delivered then.
  using AbortHandler = std::function<void(const absl::Status&, bool forward)>;
  void SetAbortHandler(AbortHandler handler);
  // Removes the handler and returns once no call of it is running (bounded by
  // SHARDLINE_TIMEOUT_S); reports that arrive later are dropped. The communicator calls it
  // first thing in its destructor, so its handler can hold a plain pointer to it: the
  // transport's threads never own the communicator, and so never destroy the transport from one
  // of its own threads (whose destructor joins the progress thread).
  void ClearAbortHandler();

  // Posts a tagged send of `bytes` at `buffer` to `peer` / a receive from `peer` of at most
  // `bytes` into `buffer`. The buffer must stay valid until `c` is done. Internal on a UCX error.
  absl::Status Send(int peer, const void* buffer, size_t bytes, uint64_t tag, Completion* c);
  // One message gathered from `count` pieces (UCX packs them itself: no copy into a contiguous
  // buffer first). `iov` and the pieces must stay valid until `c` is done.
  absl::Status SendIov(int peer, const ucp_dt_iov_t* iov, size_t count, uint64_t tag,
                       Completion* c);
  absl::Status Recv(int peer, void* buffer, size_t bytes, uint64_t tag, Completion* c);
  // Takes the earliest arrived message whose tag matches `tag` in the bits of `mask` off the
  // unexpected queue (null if none has arrived; `info` then says nothing): its sender's tag and
  // length are in `info`, and RecvProbed must receive it. Any thread.
  ucp_tag_message_h Probe(uint64_t tag, uint64_t mask, ucp_tag_recv_info_t* info);
  // Receives the probed `message` (of `bytes`, as Probe said) into `buffer`, completing `c`.
  void RecvProbed(ucp_tag_message_h message, int peer, void* buffer, size_t bytes, Completion* c);
  // Frees the requests of `batch` that are done; whether none is still pending.
  bool Reap(Batch& batch);
  // Keeps `batch`, whose requests may still be pending, until the transport is destroyed
  // (which then closes the endpoints by force): for sends that nobody will receive.
  void Abandon(std::unique_ptr<Batch> batch);

  // Progresses the worker, then handles control messages and endpoint failures. Returns
  // whether UCX reported any activity.
  bool Progress();
  // Sleeps until the worker has events, Wake() is called, or `until` (capped at 200 ms).
  // Returns false where the sleep ran to that limit with no event.
  bool Sleep(absl::Time until);
  // Interrupts Sleep() (from any thread).
  void Wake();

  // Single-copy (CMA) protocol for data messages, see the file comment. PullsFrom(p): this rank
  // reads p's large messages out of p's memory (p sends descriptors). PulledBy(p): p reads this
  // rank's large messages (this rank sends descriptors and waits for p's fin).
  bool PullsFrom(int peer) const { return peers_[peer].pulls_from; }
  bool PulledBy(int peer) const { return peers_[peer].pulled_by; }
  // Copies `bytes` from address `remote` of peer `peer`'s memory to `dst`. Unavailable if the
  // peer has exited, Internal naming the peer and range for any other failure.
  absl::Status CmaRead(int peer, void* dst, uint64_t remote, size_t bytes);

  // This process's read-only mapping of peer `peer`'s shareable arena `region_id` (its memory
  // file `fd` in the peer, `bytes` reserved; runtime/shared_memory.h), of which the caller reads
  // at most the first `needed` bytes; mapped on first use and kept until the transport is
  // destroyed (one mapping per peer arena). Null when the peer cannot be mapped
  // (SHARDLINE_UCX_MAP off, no CMA permission, pidfd_getfd refused, or the file is not what the
  // peer described), or for now (out of file descriptors: tried again at the next call): the
  // caller then falls back to CmaRead. Only the thread that runs collectives may call it.
  const uint8_t* MapPeerRegion(int peer, uint64_t region_id, int fd, size_t bytes, size_t needed);
  // Whether same-host peers read this rank's shareable memory out of their mappings
  // (SHARDLINE_UCX_MAP on here, and some same-host peer reads this rank's memory).
  bool maps_peers() const;
  // Whether every same-host peer reads this rank's large messages out of its memory (the
  // single-copy protocol), and whether it has same-host peers at all.
  bool read_by_every_local_peer() const;
  bool has_local_peers() const;

  // The fingerprint round's shared-memory mailboxes (mailbox.h): made where every rank runs on
  // this host, every rank mapped every peer's and none turned them off (SHARDLINE_UCX_MAILBOX);
  // agreed at creation, so all ranks have them or none. Null otherwise. Only the thread that
  // runs collectives may use them.
  Mailboxes* mailboxes() const { return mailboxes_.get(); }

  // A dead peer on this host (Unavailable naming it) — checked at most every 200 ms; also
  // reports it through the abort handler. OK otherwise.
  absl::Status CheckPeers(absl::Time now);

  // More ranks of this communicator run on this host than this process has CPUs: a waiting
  // rank must hand its core to a peer (sched_yield) instead of spinning on it.
  bool oversubscribed() const { return oversubscribed_; }
  // Gives the CPU to another runnable thread as SHARDLINE_UCX_YIELD says: under auto, if the host
  // is oversubscribed by this communicator's own ranks or, as last seen (HostBusy), by more
  // runnable threads than it has CPUs while another host-stream worker of this process is awake
  // or the wait has made no progress for `idle` >= 50 us (the peer it waits for may be one of
  // those threads). `now` is the caller's clock reading (the look at the host is at most every
  // 10 ms).
  // `mates_pending` false: the caller knows that none of the ranks it awaits shares its CPU
  // (mailbox waits of pinned ranks), so the communicator's own oversubscription is no reason.
  void YieldIfOversubscribed(absl::Time now, absl::Duration idle, bool mates_pending = true) const;
  // Whether this rank and `peer` are pinned to the same CPU (shardline-launch --bind-to core: each
  // rank publishes its CPU at wire-up). A pinned rank is oversubscribed only if some peer is.
  bool SharesCpu(int peer) const {
    return pinned_cpu_ >= 0 && peers_[peer].local && peers_[peer].cpu == pinned_cpu_;
  }
  bool pinned() const { return pinned_cpu_ >= 0; }

  // Brackets a collective: the idle progress thread pauses in between, and resumes only once no
  // collective ran for a short grace period (so back-to-back collectives never wake it).
  void BeginCollective();
  void EndCollective();

  // Work that only progress completes and that no waiting thread drives (point-to-point sends
  // whose receivers read them out of this process): once `Urge()` is called, the idle progress
  // thread polls at once instead of after its grace period, until `pending()` (called on that
  // thread, never with the transport's locks held) says nothing is left. SetPendingWork(nullptr)
  // returns once no call of the previous hook runs.
  void SetPendingWork(std::function<bool()> pending);
  void Urge();

  // Marks this rank's mailbox aborted (Mailboxes::MarkAborted; any thread, idempotent), then
  // sends `reason` to every peer still reachable (best effort, does not wait).
  void BroadcastAbort(const absl::Status& reason);
  // The mark alone (an abort on a peer's notice, which the peers have had already): a peer
  // that read this rank's memory for a collective it gave up on must find it. No-op without
  // mailboxes.
  void MarkAborted();

  // Cancels what is still pending in `batch` (after a failed collective), waits (bounded: 1 s
  // for cancelled receives, 100 ms for sends to live peers, which UCX cannot cancel) and frees
  // the requests. A batch whose requests do not complete in time is kept alive until the
  // transport is destroyed (which closes the endpoints by force), so late completions never
  // touch freed memory. Returns the batch, reset, when every request finished (for the next
  // collective to reuse); null when it was kept.
  std::unique_ptr<Batch> Release(std::unique_ptr<Batch> batch);

 private:
  struct Peer {
    ucp_ep_h ep = nullptr;
    bool local = false;       // same host: shared memory, watched through peer_memory_
    bool pulls_from = false;  // this rank reads the peer's large messages (CMA)
    bool pulled_by = false;   // the peer reads this rank's large messages (CMA)
    bool failed = false;      // endpoint error seen
    bool departed = false;    // said goodbye
    int cpu = -1;             // local peer pinned to one CPU (shardline-launch --bind-to core)
  };
  struct ErrorArg {
    UcxTransport* transport;
    int peer;
  };
  struct Failure {
    int peer;
    ucs_status_t status;
  };
  enum ControlType : uint8_t { kAbortNotice = 1, kGoodbye = 2 };
  static constexpr size_t kControlBytes = 4096;  // the largest control message

  struct Outgoing {
    std::string bytes;
    Completion completion;
  };

  UcxTransport(int rank, int size, std::string name);
  absl::Status Init(Store& store, const Tuning& tuning, absl::Time deadline);
  // Probes which local peers this rank can read with CMA and agrees on it through the store;
  // agrees on the mailboxes at the same time (`mailboxes_ready`: this rank mapped every peer's),
  // dropping them unless every rank has them ready.
  absl::Status AgreeOnCma(Store& store, const std::vector<std::string>& values, bool cma,
                          bool mailboxes_ready, absl::Time deadline);
  // Maps every peer's mailbox, given as "fd bytes" in `described` (fd -1: none); whether all
  // were mapped (every peer on this host, each mailbox the size of this rank's).
  bool MapMailboxes(const std::vector<std::pair<int, size_t>>& described);
  // Completes UCX's lazy wire-up with every peer before the first collective: one small message
  // each way on the kWireup tag (this rank's wire-protocol tuning), then a flush of every
  // endpoint, all until `deadline`. `tunings` receives every rank's tuning. (UCX 1.13 aborts a
  // survivor whose endpoint to a dead peer fails while a wire-up message is still queued on a
  // shared-memory lane; fixed upstream in openucx PR #8175.)
  absl::Status CompleteWireup(const Tuning& tuning, absl::Time deadline, absl::string_view where,
                              std::vector<Tuning>* tunings);
  // InvalidArgument naming the first wire-protocol knob on which a rank differs from rank 0 (the
  // same error on every rank, returned once every rank has found it); OK if none does.
  absl::Status AgreeOnTuning(Store& store, const std::vector<Tuning>& tunings, absl::Time deadline,
                             absl::string_view where);
  // Closes `peer`'s endpoint (if open); returns the close request still in flight, if any.
  void* CloseEndpoint(Peer& peer, bool force);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  void PostControlRecv();
  void HandleControl(const Completion& c, std::vector<absl::Status>* notices);
  void SendControl(int peer, uint8_t type, const absl::Status& status);
  void ProgressThread();
  void Report(const absl::Status& status, bool forward);
  void FreeRequests(Batch& batch);
  void DrainUnexpected();

  const int rank_;
  const int size_;
  const std::string name_;
  std::string key_prefix_;  // "<name>/ucx/<epoch>": this creation's store keys
  std::shared_ptr<UcxContext> context_;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::vector<Peer> peers_;
  PeerMemory peer_memory_;  // of the local peers
  std::vector<std::unique_ptr<ErrorArg>> error_args_;

  std::mutex handler_mu_;  // guards abort_handler_, early_reports_, handler_calls_, cleared_
  std::condition_variable handler_cv_;  // handler_calls_ dropped to 0
  AbortHandler abort_handler_;
  int handler_calls_ = 0;                                     // calls of abort_handler_ running
  bool cleared_ = false;                                      // ClearAbortHandler was called
  std::vector<std::pair<absl::Status, bool>> early_reports_;  // before SetAbortHandler

  // Guards peers_[].ep against a close while another thread sends on it (SendControl from any
  // thread, Release and the destructor close). Held across UCX calls, so no UCX callback takes
  // it; taken before mu_, never after.
  std::mutex ep_mu_;
  // Guards failures_, peers_[].failed/departed, outgoing_, graveyard_, force_closing_. Never held
  // across a UCX call: the endpoint error callback takes it.
  std::mutex mu_;
  std::vector<Failure> failures_;
  std::atomic<bool> failures_pending_{false};  // failures_ has entries (checked without mu_)
  std::deque<Outgoing> outgoing_;
  std::vector<std::unique_ptr<Batch>> graveyard_;
  std::vector<void*> force_closing_;  // close requests of dead peers' endpoints
  std::atomic<bool> unclean_{false};  // a collective failed: close endpoints by force
  // What peers read to check that CMA works (random; published with the address).
  uint64_t probe_ = 0;
  bool oversubscribed_ = false;
  enum class YieldPolicy { kAuto, kAlways, kNever };
  YieldPolicy yield_ = YieldPolicy::kAuto;  // SHARDLINE_UCX_YIELD
  int cpus_ = 1;                            // CPUs this process may run on
  int pinned_cpu_ = -1;                     // the one CPU it may run on, if just one
  bool map_ = false;                        // SHARDLINE_UCX_MAP
  std::unique_ptr<Mailboxes> mailboxes_;    // see mailboxes()

  std::mutex control_mu_;  // guards the control receive
  Completion control_;
  std::unique_ptr<uint8_t[]> control_buffer_;
  bool control_posted_ = false;

  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  int active_ = 0;
  bool stop_ = false;
  bool polling_ = false;   // the progress thread is (about to be) in Sleep()
  bool urged_ = false;     // Urge() was called: see SetPendingWork
  uint64_t urges_ = 0;     // Urge() calls so far
  std::mutex pending_mu_;  // guards pending_work_ and its calls
  std::function<bool()> pending_work_;
  absl::Time last_end_ = absl::InfinitePast();  // when active_ last dropped to 0
  std::thread progress_thread_;

  absl::Time next_peer_check_ = absl::InfinitePast();
  absl::Status peers_status_;
};

// How many times, in this process, a collective waiting for its peers slept out a whole poll
// (200 ms, or up to its deadline) with no event from them. A lost wake-up shows here; a healthy
// run of ranks that keep each other busy leaves it unchanged (tests read it).
uint64_t CollectiveSleepsRunOut();
void CountCollectiveSleepRunOut();

}  // namespace shardline::ucx_internal

#endif  // SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_TRANSPORT_H_
