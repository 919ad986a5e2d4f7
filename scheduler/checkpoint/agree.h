// File: scheduler/checkpoint/agree.h
// -----------------------------------------------------------------------------
// The outcome exchange that ends every phase of a collective file operation (a full-weight
// export or import, scheduler/checkpoint/full_weights.h): one all-gather over a communicator of
// every rank's status, a fingerprint (what every rank must agree on: its units, say) and some
// phase-specific bytes. Every rank issues it whatever failed where, so nobody waits for a rank
// that gave up, and every rank returns the same outcome.
//
// Checkpointer::Agree (scheduler/checkpoint/checkpoint.cc) calls it too. The phases' extra bytes
// are little-endian fields (PutLittleEndian / GetLittleEndian).

#ifndef SHARDLINE_SCHEDULER_CHECKPOINT_AGREE_H_
#define SHARDLINE_SCHEDULER_CHECKPOINT_AGREE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "runtime/stream.h"

namespace shardline {

// Exchanges `mine` (its code and the first 496 bytes of its message), `fingerprint` and the
// first `extra_bytes` bytes of `extra` (zero-padded) with every rank of `comm`, on `stream` (a
// caller stream: the call blocks until the exchange is done or `deadline` passes). Returns:
//   `mine` if it is an error (after the exchange);
//   the exchange's own error, prefixed with `what`;
//   the lowest failing rank's code and message, prefixed "failed on rank N: " and marked as a
//   peer error (IsPeerError);
//   FailedPrecondition naming `what` and the first rank whose fingerprint differs from rank 0's
//   (`mismatch` says what that means: "has other units than rank 0");
//   OK, with every rank's extra bytes in `all` (if not null), by rank.
// The low `bytes` (1-8) bytes of `v` at out[0, bytes), least significant first; and back.
void PutLittleEndian(char* out, uint64_t v, int bytes);
uint64_t GetLittleEndian(const char* in, int bytes);

absl::Status AgreeOnOutcome(Communicator& comm, Stream& stream, absl::Status mine,
                            absl::string_view what, uint64_t fingerprint,
                            absl::string_view mismatch, const std::string& extra,
                            size_t extra_bytes, std::vector<std::string>* all, absl::Time deadline);

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_CHECKPOINT_AGREE_H_
