// File: collectives/ucx/internal/ucx_communicator_internal.h
// -----------------------------------------------------------------------------
// CreateUcxCommunicator with explicit tuning instead of the SHARDLINE_UCX_* knobs
// (backend-private). Ranks run as threads of one process share one environment: this is how a
// test gives them different settings.

#ifndef SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_COMMUNICATOR_INTERNAL_H_
#define SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_COMMUNICATOR_INTERNAL_H_

#include <memory>

#include "absl/status/statusor.h"
#include "collectives/communicator.h"
#include "collectives/ucx/internal/ucx_transport.h"
#include "collectives/ucx/ucx_communicator.h"

namespace shardline::ucx_internal {

// As CreateUcxCommunicator, with `tuning` in place of Tuning::FromEnvironment(). Subgroups from
// Split inherit it.
absl::StatusOr<std::shared_ptr<Communicator>> CreateUcxCommunicatorWithTuning(
    const UcxOptions& options, const Tuning& tuning);

}  // namespace shardline::ucx_internal

#endif  // SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_COMMUNICATOR_INTERNAL_H_
