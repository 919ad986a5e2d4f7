// File: collectives/ucx/internal/ucx_point_to_point.h
// -----------------------------------------------------------------------------
// Send and Recv of the ucx backend (backend-private; the rules are communicator.h's).
//
// A message is one UCX tagged message whose tag says everything the receiver checks before it
// writes a byte: the phase (kPointToPoint), the sender's rank, the dtype and the message tag;
// its length is the count. A receive probes the unexpected queue for the earliest arrived
// message that matches its peer (any peer for kAnySource) and message tag, checks its dtype and
// length, and only then receives it into the caller's buffer; a message of another size or dtype
// is a peer error naming both sides. UCX matches messages of one sender and tag in the order
// they were sent, which is the non-overtaking rule.
//
// A send copies its data into a buffer of its own and posts the message: it completes at once,
// never waiting for its receive (two ranks that both send first do not deadlock), and the
// transport's progress (the idle progress thread, or any thread waiting in a collective or a
// receive) carries the message to its receiver. A message of SHARDLINE_UCX_SMALL_BYTES or more to
// a peer on this host that may read this process's memory travels as a descriptor of that copy
// (its address and length, on phase kPointToPointRead): the receiver reads the bytes straight
// out of the sender (UcxTransport::CmaRead: one copy, no progress needed from the sender) and
// answers with a fin (kPointToPointFin, tagged with the send's number), which frees the copy. Sent
// buffers are reused once their messages are delivered. A large message is delivered by its
// receiver reading it out of this process, so a communicator being destroyed first waits (Flush)
// until its sends are delivered, a receiver failed, the communicator was aborted or its timeout
// passed; sends still undelivered then stay with the transport, which closes its endpoints by
// force.
//
// A receive waits like a collective: it progresses the worker itself (the idle progress thread
// pauses meanwhile), spins for SHARDLINE_UCX_SPIN_US, then sleeps on the worker's event fd, and
// fails on an aborted communicator, a dead peer on this host, or its deadline (naming the ranks
// it waited for). Receives run concurrently with collectives of other streams: all of them
// progress the one worker (UCS_THREAD_MODE_MULTI), so a receive that progresses the worker wakes
// the other waiters, and sleeps at most 5 ms at a time (another thread may have taken the event
// that announced its message).

#ifndef SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_POINT_TO_POINT_H_
#define SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_POINT_TO_POINT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/ucx/internal/ucx_collective.h"
#include "collectives/ucx/internal/ucx_transport.h"

namespace shardline::ucx_internal {

// Point-to-point tag layout (64 bits): phase (4) | source rank (16) | dtype (8) | message tag
// (36). The largest message tag the backend carries:
constexpr uint64_t kMaxMessageTag = (uint64_t{1} << 36) - 1;

class PointToPoint {
 public:
  // `transport` outlives this object.
  PointToPoint(UcxTransport& transport, Tuning tuning) : transport_(transport), tuning_(tuning) {}
  PointToPoint(const PointToPoint&) = delete;
  PointToPoint& operator=(const PointToPoint&) = delete;
  // Hands the sends still undelivered to the transport (UcxTransport::Abandon).
  ~PointToPoint();

  // Progresses the worker until every send was delivered (or failed), `deadline` passes or
  // `healthy()` turns false.
  void Flush(absl::Time deadline, absl::FunctionRef<bool()> healthy);
  // Whether sends are still undelivered (those delivered are recycled first): the transport's
  // idle progress thread asks while it is urged to carry them (UcxTransport::Urge).
  bool SendsPending();

  // `fp` is the operation's (kind kSend / kRecv, count, dtype, peer in root, tag in key).
  absl::Status Send(const CollectiveFingerprint& fp, const void* data, size_t element_size,
                    const CollectiveHooks& hooks);
  // Stores the sender's rank in `source` once the data is in `data`. `batch` receives the
  // batch of a receive that failed, for the caller to release after it aborted the
  // communicator (its request may still be pending).
  absl::Status Recv(const CollectiveFingerprint& fp, void* data, size_t element_size,
                    absl::Time deadline, const CollectiveHooks& hooks, std::atomic<int>* source,
                    std::unique_ptr<Batch>* batch);

 private:
  // A batch with no slot and no buffer in use: a recycled one, else a new one.
  std::unique_ptr<Batch> TakeBatch();
  // Moves the sends whose messages were delivered back to the free batches.
  void ReapSends();
  // Tells rank `to` that its descriptor `number` was read (its copy may go).
  void SendFin(int to, uint64_t number);

  UcxTransport& transport_;
  const Tuning tuning_;
  std::mutex mu_;  // guards sending_ and free_ (sends and receives run on any stream)
  std::vector<std::unique_ptr<Batch>> sending_;  // one undelivered message each
  std::vector<std::unique_ptr<Batch>> free_;
  uint64_t reads_ = 0;  // descriptors sent (their fins' numbers), under mu_
};

}  // namespace shardline::ucx_internal

#endif  // SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_POINT_TO_POINT_H_
