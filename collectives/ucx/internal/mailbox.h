// File: collectives/ucx/internal/mailbox.h
// -----------------------------------------------------------------------------
// The fingerprint round of a ucx collective through shared memory, for communicators whose ranks
// all run on one host (backend-private; no UCX in here).
//
// Each rank owns a mailbox: a memory file that it writes and that every peer maps read-only
// (PeerMemory::Map, at creation). A collective's fingerprint, followed for a small collective by
// its payload, goes into one of the mailbox's two slots (collective c into slot c % 2); the slot's
// sequence word, stored last, says it is complete. Peers read the fingerprint and their part of
// the payload straight out of the slot: one copy in, one copy out, no message, no system call.
//
// No acknowledgements are needed. A rank writes collective c + 2 into the slot of c only after it
// has seen every peer's c + 1, and each peer published c + 1 only after it had finished c,
// reading included. Every collective passes through this round (large ones publish their
// fingerprint only), so the argument holds for any sequence of collectives.
//
// A rank that has waited its spin out sleeps on the awaited peer's sequence word: a futex in
// shared memory, so the peer's store is followed by a FUTEX_WAKE when the sleeper said (in its
// own mailbox) that it sleeps on that peer.

#ifndef SHARDLINE_COLLECTIVES_UCX_INTERNAL_MAILBOX_H_
#define SHARDLINE_COLLECTIVES_UCX_INTERNAL_MAILBOX_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardline::ucx_internal {

class Mailboxes {
 public:
  // This rank's mailbox in a communicator of `size` ranks, each slot with room for a fingerprint
  // of `fingerprint_bytes` and `payload_bytes` of payload. Internal if the memory file cannot
  // be made.
  static absl::StatusOr<std::unique_ptr<Mailboxes>> Create(int rank, int size,
                                                           size_t fingerprint_bytes,
                                                           size_t payload_bytes);
  Mailboxes(const Mailboxes&) = delete;
  Mailboxes& operator=(const Mailboxes&) = delete;
  ~Mailboxes();

  // The memory file (its descriptor in this process, for peers' pidfd_getfd) and its length:
  // what a peer needs to map it.
  int fd() const { return fd_; }
  size_t bytes() const { return bytes_; }
  size_t payload_bytes() const { return payload_bytes_; }

  // `mapping`: peer `peer`'s mailbox, mapped by this process (bytes() long: every rank of a
  // communicator makes its mailbox with the same arguments).
  void SetPeer(int peer, const uint8_t* mapping) { peers_[peer] = mapping; }

  // The number of the next collective (1, 2, ...): every rank numbers its collectives alike.
  uint64_t Next() { return ++count_; }

  // This rank's slot for collective `count`: fill fingerprint and payload, then Publish.
  uint8_t* fingerprint(uint64_t count) { return Slot(base_, count) + kLine; }
  uint8_t* payload(uint64_t count) { return Slot(base_, count) + kLine + fingerprint_stride_; }
  // Completes this rank's slot of `count` and wakes a peer that sleeps on it.
  void Publish(uint64_t count);

  // Whether `peer` has published `count`; then its fingerprint and payload may be read (until
  // this rank publishes count + 1).
  bool Arrived(int peer, uint64_t count) const;
  const uint8_t* fingerprint(int peer, uint64_t count) const {
    return Slot(peers_[peer], count) + kLine;
  }
  const uint8_t* payload(int peer, uint64_t count) const {
    return Slot(peers_[peer], count) + kLine + fingerprint_stride_;
  }

  // Sleeps until `peer` publishes `count`, `timeout` passes, or a spurious wake-up.
  void Sleep(int peer, uint64_t count, absl::Duration timeout);

  // Collective `count` finished well on this rank (its data moved, its output written).
  void Completed(uint64_t count) { completed_.store(count, std::memory_order_relaxed); }
  // Says in this rank's mailbox that it aborted the communicator (any thread), and after which
  // collective, so that a peer that finds this rank's slot of a later one complete does not
  // finish it: this rank may have given up on it (its reason follows as a UCX abort notice).
  // Idempotent. Every abort writes it (also one on a peer's notice), before the rank returns
  // from a collective it gave up on, and ordered before every later write of the rank (the
  // buffers of that collective, freed and reused).
  void MarkAborted();
  // Whether `peer` aborted before it finished collective `count`. A rank that has read a peer's
  // memory for `count` and then finds no such mark read it while the peer was still in that
  // collective (or had finished it): what it read was the peer's data.
  bool AbortedBefore(int peer, uint64_t count) const;

 private:
  static constexpr size_t kLine = 64;

  Mailboxes(int rank, int size, int fd, uint8_t* base, size_t bytes, size_t fingerprint_stride,
            size_t payload_bytes);

  // Slot `count % 2` of the mailbox at `base`: its sequence word's line, then the fingerprint,
  // then the payload.
  uint8_t* Slot(uint8_t* base, uint64_t count) const {
    return base + kLine + (count % 2) * slot_stride_;
  }
  const uint8_t* Slot(const uint8_t* base, uint64_t count) const {
    return base + kLine + (count % 2) * slot_stride_;
  }
  // The first word of a mailbox: 1 + the peer whose sequence word its owner sleeps on, or 0.
  static uint32_t* SleepingOn(uint8_t* base) { return reinterpret_cast<uint32_t*>(base); }
  // The second (8-byte aligned): 1 + the last collective its owner finished, once it aborted;
  // 0 before.
  static const uint64_t* AbortedWord(const uint8_t* base) {
    return reinterpret_cast<const uint64_t*>(base) + 1;
  }

  const int rank_;
  const int fd_;
  uint8_t* const base_;
  const size_t bytes_;
  const size_t fingerprint_stride_;
  const size_t payload_bytes_;
  const size_t slot_stride_;
  std::vector<const uint8_t*> peers_;  // their mailboxes (this rank's own: null)
  uint64_t count_ = 0;
  std::atomic<uint64_t> completed_{0};  // the last collective finished here (MarkAborted reads it)
};

}  // namespace shardline::ucx_internal

#endif  // SHARDLINE_COLLECTIVES_UCX_INTERNAL_MAILBOX_H_
