// File: collectives/nccl/internal/nccl_check.h
// -----------------------------------------------------------------------------
// Turns an ncclResult_t into an absl::Status that names the call, the file and the line, NCCL's
// name for the code and its last error message (private to the nccl backend):
//
//   SL_NCCL_RETURN_IF_ERROR(ncclCommUserRank(comm, &rank), comm);
//
// gives "ncclCommUserRank(comm, &rank) failed at collectives/nccl/x.cc:42: ncclInvalidArgument
// (invalid argument): <ncclGetLastError>". Codes: Unavailable for ncclSystemError and
// ncclRemoteError (a peer or the network went away), Internal for everything else.
//
// Non-blocking communicators may answer ncclInProgress: the call was accepted and completes in
// the background. SL_NCCL_ACCEPTED treats that as OK; the caller then polls
// ncclCommGetAsyncError (see nccl_communicator_impl.h).

#ifndef SHARDLINE_COLLECTIVES_NCCL_INTERNAL_NCCL_CHECK_H_
#define SHARDLINE_COLLECTIVES_NCCL_INTERNAL_NCCL_CHECK_H_

#include <nccl.h>

#include <string>

#include "absl/base/optimization.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace shardline::nccl_internal {

inline absl::string_view NcclResultName(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "ncclSuccess";
    case ncclUnhandledCudaError:
      return "ncclUnhandledCudaError";
    case ncclSystemError:
      return "ncclSystemError";
    case ncclInternalError:
      return "ncclInternalError";
    case ncclInvalidArgument:
      return "ncclInvalidArgument";
    case ncclInvalidUsage:
      return "ncclInvalidUsage";
    case ncclRemoteError:
      return "ncclRemoteError";
    case ncclInProgress:
      return "ncclInProgress";
    default:
      return "ncclResult?";
  }
}

inline absl::StatusCode NcclErrorCode(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return absl::StatusCode::kOk;
    case ncclSystemError:
    case ncclRemoteError:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

// "ncclRemoteError (remote process exited or there was a network error): <last error>".
inline std::string DescribeNcclError(ncclResult_t result, ncclComm_t comm) {
  std::string out = absl::StrCat(NcclResultName(result), " (", ncclGetErrorString(result), ")");
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') absl::StrAppend(&out, ": ", last);
  return out;
}

// OK for ncclSuccess (and, if `accept_in_progress`, ncclInProgress); otherwise the error.
inline absl::Status NcclStatus(ncclResult_t result, ncclComm_t comm, bool accept_in_progress,
                               const char* call, const char* file, int line) {
  if (result == ncclSuccess || (accept_in_progress && result == ncclInProgress)) {
    return absl::OkStatus();
  }
  return absl::Status(NcclErrorCode(result), absl::StrCat(call, " failed at ", file, ":", line,
                                                          ": ", DescribeNcclError(result, comm)));
}

}  // namespace shardline::nccl_internal

// The Status of an NCCL call on `comm` (nullptr for calls without a communicator).
#define SL_NCCL_STATUS(expr, comm) \
  ::shardline::nccl_internal::NcclStatus((expr), (comm), false, #expr, __FILE__, __LINE__)
// Same, but ncclInProgress (accepted by a non-blocking communicator) counts as OK.
#define SL_NCCL_ACCEPTED(expr, comm) \
  ::shardline::nccl_internal::NcclStatus((expr), (comm), true, #expr, __FILE__, __LINE__)

#define SL_NCCL_RETURN_IF_ERROR(expr, comm)                                \
  do {                                                                     \
    ::absl::Status sl_nccl_status_ = SL_NCCL_STATUS(expr, comm);           \
    if (ABSL_PREDICT_FALSE(!sl_nccl_status_.ok())) return sl_nccl_status_; \
  } while (0)

#endif  // SHARDLINE_COLLECTIVES_NCCL_INTERNAL_NCCL_CHECK_H_
