// File: collectives/ucx/internal/ucx_context.h
// -----------------------------------------------------------------------------
// What the ucx backend shares per process (backend-private): the SHARDLINE_UCX_* knobs, the
// tuning they describe, and the ucp context every communicator's worker is created from.

#ifndef SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_CONTEXT_H_
#define SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_CONTEXT_H_

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "runtime/config.h"

namespace shardline::ucx_internal {

// SHARDLINE_UCX_* knobs.
const Param<int64_t>& ParamUcxChunkBytes();
const Param<int64_t>& ParamUcxSmallBytes();
const Param<int64_t>& ParamUcxWindow();
const Param<int64_t>& ParamUcxSpinUs();
const Param<bool>& ParamUcxShm();
const Param<std::string>& ParamUcxYield();
const Param<bool>& ParamUcxCma();
const Param<bool>& ParamUcxMap();
const Param<bool>& ParamUcxMailbox();

// What the SHARDLINE_UCX_* knobs say about running collectives. The wire protocol depends on
// chunk_bytes, small_bytes and window (which messages are small, how large chunks are tagged), so
// every rank of a communicator must use the same values; creation compares them. spin and
// mailbox are local.
struct Tuning {
  size_t chunk_bytes;
  size_t small_bytes;
  int window;
  absl::Duration spin;
  // SHARDLINE_UCX_MAILBOX (local: the ranks agree at creation, falling back to UCX messages
  // unless all have it).
  bool mailbox = true;
  // Test hook, not a knob: the most staging memory one collective of this rank may hold (0: no
  // limit beyond the system's). Past it, the allocation fails as an exhausted system would
  // make it fail (ResourceExhausted).
  size_t staging_limit_bytes = 0;
  // The knobs' values (their defaults where unset); InvalidArgument for an invalid one.
  static absl::StatusOr<Tuning> FromEnvironment();
};

// The process's ucp context (features TAG and WAKEUP, workers shared between threads). One per
// kind, shared by every communicator of the process and cleaned up with the last of them.
class UcxContext {
 public:
  // `shm` false: a context without UCX's shared-memory transports (unless UCX_TLS is set), so
  // that peers on this host talk over the network. Internal if UCX cannot be initialised.
  static absl::StatusOr<std::shared_ptr<UcxContext>> Acquire(bool shm);

  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;
  ~UcxContext();

  ucp_context_h get() const { return context_; }

 private:
  explicit UcxContext(ucp_context_h context) : context_(context) {}

  const ucp_context_h context_;
};

// "Connection reset by remote peer" for a UCX status.
std::string UcxError(ucs_status_t status);

}  // namespace shardline::ucx_internal

#endif  // SHARDLINE_COLLECTIVES_UCX_INTERNAL_UCX_CONTEXT_H_
