// File: runtime/status.h
// -----------------------------------------------------------------------------
// Status propagation for shardline. Every fallible function in the C++ API returns
// absl::Status or absl::StatusOr<T>; only bindings/ turns a Status into an exception.
//
// Codes, as abseil documents them and as shardline uses them:
//   InvalidArgument     bad input from the caller (sizes, dtypes, names, env values)
//   FailedPrecondition  a call in the wrong state (gather while already gathered, ...)
//   DeadlineExceeded    a wait ran past its deadline
//   Unavailable/Aborted a peer is gone, a connection dropped, a collective was aborted
//   Internal            a backend library (CUDA, NCCL, UCX) reported an error
//
// The site that decides what went wrong writes the message, with the cause and the
// coordinates (collective, rank, peer, sizes); callers only pass it up with the macros below.
// Debian's abseil (20220623) predates ABSL_RETURN_IF_ERROR, hence our own. This header is
// installed, so it defines only SL_-prefixed names: an embedding framework's own
// RETURN_IF_ERROR or ASSIGN_OR_RETURN never depends on include order.

#ifndef SHARDLINE_RUNTIME_STATUS_H_
#define SHARDLINE_RUNTIME_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#define SL_STATUS_CONCAT_INNER_(a, b) a##b
#define SL_STATUS_CONCAT_(a, b) SL_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the current function if not OK.
#define SL_RETURN_IF_ERROR(expr)                                 \
  do {                                                           \
    ::absl::Status sl_status_ = (expr);                          \
    if (ABSL_PREDICT_FALSE(!sl_status_.ok())) return sl_status_; \
  } while (0)

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status, else moves the value
// into `lhs`, which may be a declaration: SL_ASSIGN_OR_RETURN(auto buf, pool.Allocate(n));
#define SL_ASSIGN_OR_RETURN(lhs, rexpr) \
  SL_ASSIGN_OR_RETURN_IMPL_(SL_STATUS_CONCAT_(sl_statusor_, __LINE__), lhs, rexpr)
#define SL_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr)             \
  auto statusor = (rexpr);                                          \
  if (ABSL_PREDICT_FALSE(!statusor.ok())) return statusor.status(); \
  lhs = std::move(statusor).value()

namespace shardline {

// Returns `status` with `context` prepended to its message ("context: message"), same code.
// OK stays OK.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_STATUS_H_
