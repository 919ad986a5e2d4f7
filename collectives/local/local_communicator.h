// File: collectives/local/local_communicator.h
// -----------------------------------------------------------------------------
// The `local` backend: the ranks of a group are threads of one process. Each collective is a
// rendezvous in shared memory: every rank posts its fingerprint and buffer pointers, all
// compare fingerprints, then each rank reads its peers' buffers directly (one copy per byte).
// It exists for unit tests (the scheduler's, the flat parameter's) and for single-process
// experiments; it is also the reference the other backends are checked against.
//
//   SL_ASSIGN_OR_RETURN(auto comms, CreateLocalCommunicators(4));
//   // thread r: comms[r]->AllGather(..., *stream_r)
//
// Failure behaviour is the API's: mismatched collectives fail on every rank naming the two
// differing ranks; a rank that never arrives makes the others fail at the deadline naming it;
// aborting one rank's communicator aborts the whole group (the in-process analogue of a dead
// peer being an error on every survivor).

#ifndef SHARDLINE_COLLECTIVES_LOCAL_LOCAL_COMMUNICATOR_H_
#define SHARDLINE_COLLECTIVES_LOCAL_LOCAL_COMMUNICATOR_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"

namespace shardline {

struct LocalOptions {
  std::string name = "world";
  // Unset (zero): SHARDLINE_TIMEOUT_S.
  absl::Duration timeout = absl::ZeroDuration();
};

// `size` communicators forming one group; element r is rank r. InvalidArgument if size < 1 or
// the timeout knob is invalid.
absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> CreateLocalCommunicators(
    int size, const LocalOptions& options = {});

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_LOCAL_LOCAL_COMMUNICATOR_H_
