// File: collectives/internal/data_movement.h
// -----------------------------------------------------------------------------
// The data movement of the backends that see every rank's buffers in one address space (local:
// ranks as threads; sim: ranks in one virtual timeline), collectives-private. Both move bytes
// and reduce with the same code, so that they give the same results bit for bit: reductions add
// the ranks' inputs in rank order, whichever rank computes them.
//
// `inputs[s]` is rank s's input buffer as it posted it (the group's size is inputs.size()); a
// rank's output is the buffer it posted for the collective. The kinds, counts and in-place forms
// are those of communicator.h.

#ifndef SHARDLINE_COLLECTIVES_INTERNAL_DATA_MOVEMENT_H_
#define SHARDLINE_COLLECTIVES_INTERNAL_DATA_MOVEMENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "collectives/communicator.h"

namespace shardline::data_movement {

// Writes rank `rank`'s output of `fp` (element size `element_size`) from the inputs, for the
// kinds whose output on one rank is a function of the inputs alone: all-gather, all-to-all,
// broadcast and reduce-scatter; a barrier moves nothing. In the in-place forms, what it writes
// is read by no other rank's call. Not for an all-reduce (a bug: it aborts): its callers split it
// into ReduceSlice and CopyIntoEach (the local backend reduces one block per rank, between
// phases).
absl::Status WriteRankOutput(const CollectiveFingerprint& fp, size_t element_size,
                             absl::Span<const void* const> inputs, int rank, void* output);

// Reduces elements [begin, begin + count) of every input with fp.op, in rank order (the result
// does not depend on who computes it), into `out`; ReduceOp::kAvg then divides by the group's
// size. count 0: nothing is touched.
absl::Status ReduceSlice(const CollectiveFingerprint& fp, size_t element_size,
                         absl::Span<const void* const> inputs, size_t begin, size_t count,
                         void* out);

// Copies `bytes` from `src` to byte `offset` of every output.
void CopyIntoEach(absl::Span<void* const> outputs, size_t offset, const void* src, size_t bytes);

// `bytes` of scratch for a reduction (null for 0). Memory that cannot be had is the
// collective's error, ResourceExhausted ("cannot allocate the N bytes of the reduction's
// scratch"), not a std::bad_alloc that terminates.
absl::StatusOr<std::unique_ptr<uint8_t[]>> AllocateScratch(size_t bytes);

}  // namespace shardline::data_movement

#endif  // SHARDLINE_COLLECTIVES_INTERNAL_DATA_MOVEMENT_H_
