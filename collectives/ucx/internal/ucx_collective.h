// File: collectives/ucx/internal/ucx_collective.h
// -----------------------------------------------------------------------------
// One collective of the ucx backend in flight (backend-private): the operation, the batch of
// requests it posted, and the wait loop every algorithm uses. The algorithms themselves are free
// functions over a CollectiveRun (ucx_algorithms.cc):
//
//   RunCollective   fingerprint exchange (+ the payload of small collectives), then the
//                   large-message algorithm of the op's kind. The exchange goes through the
//                   shared-memory mailboxes (mailbox.h) where the communicator has them, else
//                   through one UCX message to and from every peer.
//
// Every wait goes through Drive(): progress the worker, serve the single-copy reads whose
// descriptors arrived, let the algorithm make a step, fail on an aborted communicator, a dead
// peer or the deadline (naming the ranks still pending), and sleep on the worker's event fd once
// a short spin found nothing to do (telling hooks.waiting_on which peers are still pending).
//
// Send/Recv of the data phases pick the protocol per peer: to and from peers on this host that
// can read each other's memory, the single-copy (CMA) protocol of ucx_transport.h; otherwise a
// UCX tagged message. Algorithms see one Completion per message either way.

#ifndef SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_COLLECTIVE_H_
#define SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_COLLECTIVE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/ucx/internal/ucx_transport.h"

namespace shardline::ucx_internal {

// What the communicator lends an algorithm (its protected helpers). An interface rather than
// callables: a collective builds no std::function and no string unless it fails.
class CollectiveHooks {
 public:
  virtual absl::Status comm_status() const = 0;
  virtual absl::Status deadline_error(const std::vector<int>& missing) const = 0;
  virtual absl::Status mismatch_error(int a, const CollectiveFingerprint& fa, int b,
                                      const CollectiveFingerprint& fb) const = 0;
  // "all_gather #3 on world (rank 0 of 2, ucx)", for error messages.
  virtual std::string describe() const = 0;
  // Told the peers with requests still pending each time the wait goes to sleep (the flight
  // recorder's "waiting on").
  virtual void waiting_on(const std::vector<int>& pending) const = 0;

 protected:
  ~CollectiveHooks() = default;
};

// Containers a collective needs, kept by the communicator from one collective to the next so
// that their capacity is reused (filled anew by each collective).
struct RunScratch {
  std::vector<Completion*> completions;
  std::vector<const uint8_t*> received;
  std::vector<const uint8_t*> staging;
  std::vector<CollectiveFingerprint> fps;
  std::vector<const void*> inputs;
  std::vector<Completion*> waits;
  std::vector<std::vector<Completion*>> offers;  // per peer, the pipelined reductions' sends
};

class CollectiveRun {
 public:
  // `batch` is empty (fresh or reset); `scratch` and `hooks` outlive the run.
  CollectiveRun(UcxTransport& transport, const CollectiveFingerprint& fp, const void* input,
                void* output, size_t element_size, absl::Time deadline,
                const CollectiveHooks& hooks, Tuning tuning, std::unique_ptr<Batch> batch,
                RunScratch& scratch)
      : transport_(transport),
        fp_(fp),
        input_(static_cast<const uint8_t*>(input)),
        output_(static_cast<uint8_t*>(output)),
        esize_(element_size),
        deadline_(deadline),
        hooks_(hooks),
        tuning_(tuning),
        batch_(batch != nullptr ? std::move(batch) : std::make_unique<Batch>()),
        scratch_(scratch) {
    batch_->set_limit_bytes(tuning.staging_limit_bytes);
  }

  int rank() const { return transport_.rank(); }
  int size() const { return transport_.size(); }
  const CollectiveFingerprint& fp() const { return fp_; }
  const uint8_t* input() const { return input_; }
  uint8_t* output() const { return output_; }
  size_t esize() const { return esize_; }
  const Tuning& tuning() const { return tuning_; }
  const CollectiveHooks& hooks() const { return hooks_; }
  RunScratch& scratch() { return scratch_; }
  // The communicator's shared-memory mailboxes (mailbox.h); null where its ranks do not all
  // share this host or did not all agree to use them.
  Mailboxes* mailboxes() const { return transport_.mailboxes(); }
  // This rank is pinned to one CPU, and whether `peer` is pinned to the same (ucx_transport.h).
  bool pinned() const { return transport_.pinned(); }
  bool SharesCpu(int peer) const { return transport_.SharesCpu(peer); }
  Batch& batch() { return *batch_; }
  std::unique_ptr<Batch> TakeBatch() { return std::move(batch_); }
  // A buffer of the batch (Batch::Buffer) for this collective; ResourceExhausted naming the
  // collective and the bytes if it cannot be had. The caller returns the error: the
  // communicator then aborts and its peers get it (with its code) from the abort notice.
  absl::StatusOr<uint8_t*> Staging(size_t bytes);

  // Post a send / receive of `bytes` with `tag` (the phase, source rank, this op's sequence and
  // `chunk`). The buffer must stay valid until the collective ends. The completion of a
  // single-copy send is done once the receiver has read the buffer; that of a single-copy
  // receive once this rank has copied the bytes (in Drive). If the staging of a single-copy
  // message's descriptor cannot be had, nothing is posted and the completion is done with the
  // staging's error (Check returns it).
  Completion* Send(int peer, const void* buffer, size_t bytes, Phase phase, uint64_t chunk);
  // A header-phase message of `count` pieces (`iov` must stay valid until the collective ends).
  Completion* SendHeader(int peer, const ucp_dt_iov_t* iov, size_t count);
  // With `borrow`, a single-copy receive out of a peer's shareable memory that this rank has
  // mapped (ucx_transport.h) is not copied: the completion's `view` points into the sender's
  // memory, which stays valid and unchanged until Return(c). Otherwise `view` is `buffer`.
  Completion* Recv(int peer, void* buffer, size_t bytes, Phase phase, uint64_t chunk,
                   bool borrow = false);
  // A single-copy receive (PullsFrom(peer) only) that copies nothing: once done, the completion's
  // `view` points into the sender's memory where this rank maps it, else is null and ReadLeased
  // copies pieces of it; either way the sender's buffer stays valid and unchanged until
  // Return(c). One message each way for a whole block that the receiver then reads piece by
  // piece at its own pace.
  Completion* Lease(int peer, size_t bytes, Phase phase, uint64_t chunk);
  // Copies `bytes` at `offset` of the leased, done, unmapped receive `c` into `dst`
  // (process_vm_readv); Unavailable / the peer's abort reason if that fails.
  absl::Status ReadLeased(const Completion* c, size_t offset, void* dst, size_t bytes);
  // Ends a borrow or a lease: tells the sender its buffer is free. No-op for any other
  // completion.
  void Return(const Completion* c);
  // The single-copy protocol with `peer` (ucx_transport.h): this rank reads peer's data
  // messages out of its memory / peer reads this rank's.
  bool PullsFrom(int peer) const { return transport_.PullsFrom(peer); }
  bool PulledBy(int peer) const { return transport_.PulledBy(peer); }

  // Loops until `step` returns true (or an error): see the file comment.
  absl::Status Drive(absl::FunctionRef<absl::StatusOr<bool>()> step);
  // The same, waiting for something other than the batch's requests: `sleep(deadline)` sleeps
  // until there may be news (or a short while), `pending()` names the peers still awaited, and
  // `mates_pending()` whether a rank that shares this rank's CPU may still be awaited
  // (UcxTransport::YieldIfOversubscribed).
  absl::Status Drive(absl::FunctionRef<absl::StatusOr<bool>()> step,
                     absl::FunctionRef<void(absl::Time deadline)> sleep,
                     absl::FunctionRef<std::vector<int>()> pending,
                     absl::FunctionRef<bool()> mates_pending);
  // One poll between steps of work: progresses the worker and serves the single-copy receives
  // whose offers arrived (what each turn of Drive does before its step).
  absl::Status PollOnce();
  // Drive() until every completion in `cs` (nulls skipped) is done and OK.
  absl::Status WaitAll(const std::vector<Completion*>& cs);
  // Drive() until every request of the batch is done.
  absl::Status WaitBatch();

  // OK if `c` finished well (and, for a receive, got exactly the bytes expected); otherwise the
  // error to report (the communicator's abort reason if it has one).
  absl::Status Check(const Completion& c) const;
  // True if done; an error if done badly.
  absl::StatusOr<bool> Done(const Completion* c) const;

  // The error of a collective whose peer `peer` said in its mailbox that it aborted: the
  // communicator's abort reason once the peer's notice is in (waited for 100 ms at most), else
  // Aborted naming the peer.
  absl::Status PeerAborted(int peer);
  // Progresses until the communicator's status turns to an error (a peer's abort notice, which
  // follows its mailbox mark or a failed read of its memory) or `within` passes: that error
  // (annotated with the collective), or OK if none came.
  absl::Status AwaitAbortReason(absl::Duration within);

  // Marks single-copy receives that will never be served (the collective failed) as cancelled,
  // so that the batch can be released.
  void AbandonReads();

 private:
  // A single-copy receive: `descriptor` receives the sender's (address, length) into `desc`;
  // `done` is what the algorithm waits for.
  struct PendingRead {
    Completion* descriptor;
    Completion* done;
    const uint64_t* desc;
    uint8_t* dst;
    size_t bytes;
    int peer;
    Phase phase;
    uint64_t chunk;
    bool borrow;
    bool lease;  // dst is null: nothing is copied (Lease)
  };
  // A borrowed receive whose sender still waits for the fin.
  struct Borrowed {
    const Completion* done;
    int peer;
    Phase phase;
    uint64_t chunk;
  };

  std::vector<int> PendingPeers();
  // A completion that failed before anything was posted (its staging could not be had):
  // done, with `error` kept for Check.
  Completion* Failed(int peer, bool is_send, absl::Status error);
  uint64_t TagSeq(Phase phase) const { return phase == Phase::kHeader ? 0 : fp_.seq; }
  // Tells `peer` that this rank has read its single-copy message of `phase` / `chunk`.
  void SendFin(int peer, Phase phase, uint64_t chunk);
  // Copies (or borrows) the data of every pending read whose descriptor arrived and answers
  // with a fin (for a borrow: at Return).
  absl::Status ServeReads(bool* activity);

  UcxTransport& transport_;
  const CollectiveFingerprint fp_;
  const uint8_t* const input_;
  uint8_t* const output_;
  const size_t esize_;
  const absl::Time deadline_;
  const CollectiveHooks& hooks_;
  const Tuning tuning_;
  std::unique_ptr<Batch> batch_;
  RunScratch& scratch_;
  std::vector<PendingRead> reads_;
  std::vector<Borrowed> borrowed_;
  absl::Status staging_error_;  // the first staging failure of a Send or Recv
};

// The whole collective (size >= 2): fingerprints first, then the data. OK only if no peer had
// given up on the collective when this rank's reads of peer memory were done: with mailboxes,
// every peer's abort mark is checked after them (a peer that aborted before it finished the
// collective: its error, naming it); without, the abort notices that have arrived by then.
absl::Status RunCollective(CollectiveRun& run);

// Tests only: `hook` runs on the thread of every large collective of the process after its
// fingerprint round, before its data moves, with the rank and the collective's sequence number
// (a straggler held there: ucx_communicator_test). Null, the default: none (one load).
void SetBeforeDataHookForTesting(void (*hook)(int rank, uint64_t seq));

}  // namespace shardline::ucx_internal

#endif  // SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_COLLECTIVE_H_
