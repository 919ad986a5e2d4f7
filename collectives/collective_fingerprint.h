// File: collectives/collective_fingerprint.h
// -----------------------------------------------------------------------------
// What identifies one collective: its kind and name, and the fingerprint that every rank must
// agree on before any data moves (kind, sequence number, count, dtype, op, root, key), with its
// readable and wire forms. Point-to-point operations (send, recv) have fingerprints too: the
// peer in `root`, the message tag in `key`, and their own sequence numbers (communicator.h). The
// Communicator (communicator.h) stamps one on every collective; the flight recorder
// (flight_recorder.h) keeps them, without depending on the Communicator.

#ifndef SHARDLINE_COLLECTIVES_COLLECTIVE_FINGERPRINT_H_
#define SHARDLINE_COLLECTIVES_COLLECTIVE_FINGERPRINT_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "runtime/dtype.h"

namespace shardline {

enum class CollectiveKind : uint8_t {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kBroadcast,
  kAllToAll,
  kBarrier,
  // Point-to-point: not collectives, but numbered, fingerprinted and recorded alike.
  kSend,
  kRecv,
};

// "all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "barrier", "send",
// "recv".
absl::string_view CollectiveName(CollectiveKind kind);

// True for send and recv.
bool IsPointToPoint(CollectiveKind kind);

// A receive's peer when any rank may be the sender (Communicator::Recv).
inline constexpr int kAnySource = -1;

// True for the kinds that take a ReduceOp: reduce-scatter and all-reduce.
bool IsReduction(CollectiveKind kind);

// What all ranks must agree on for one collective.
struct CollectiveFingerprint {
  CollectiveKind kind = CollectiveKind::kBarrier;
  uint64_t seq = 0;
  uint64_t count = 0;
  DType dtype = DType::kU8;
  ReduceOp op = ReduceOp::kSum;
  // Broadcast: the root. Send: the destination; recv: the source, or kAnySource.
  int32_t root = 0;
  // CollectiveOptions::key: what the caller says the collective moves (0: unsaid). Send and
  // recv: the message tag they match on.
  uint64_t key = 0;

  friend bool operator==(const CollectiveFingerprint&, const CollectiveFingerprint&) = default;

  // "all_gather(count=7, f32) #12"; reductions add the op, broadcasts the root, send and recv
  // the peer and the tag ("send(count=7, f32, to=1, tag=0) #3").
  std::string ToString() const;
  // The call as the user wrote it, without the sequence number: "all_gather(count=7, f32)".
  std::string CallString() const;

  // Fixed-size little-endian wire form, for backends that ship fingerprints to peers.
  static constexpr size_t kEncodedSize = 32;
  void Encode(uint8_t out[kEncodedSize]) const;
  // InvalidArgument if the bytes do not decode to a valid fingerprint.
  static absl::StatusOr<CollectiveFingerprint> Decode(const uint8_t in[kEncodedSize]);
};

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_COLLECTIVE_FINGERPRINT_H_
