// File: bindings/c/c_status.cc
// -----------------------------------------------------------------------------
// The C API's results: a Status as a result code and this thread's error text, and the entry
// points that report on results and the library (version, last error, result names).

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "bindings/c/c_internal.h"
#include "bindings/c/shardline.h"
#include "collectives/communicator.h"

namespace shardline::c_api {

namespace {

// shardline_last_error's text: per thread, so that ranks as threads do not mix their errors.
thread_local std::string last_error;

}  // namespace

shardlineResult_t Fail(shardlineResult_t code, std::string message) {
  last_error = std::move(message);
  return code;
}

shardlineResult_t ResultOf(const absl::Status& status) {
  if (status.ok()) return shardlineSuccess;
  if (IsPeerError(status)) return shardlineRemoteError;
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return shardlineInvalidArgument;
    case absl::StatusCode::kDeadlineExceeded:
      return shardlineTimeout;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted:
      return shardlineRemoteError;
    case absl::StatusCode::kFailedPrecondition:
      return shardlineFailedPrecondition;
    case absl::StatusCode::kNotFound:
      return shardlineNotFound;
    case absl::StatusCode::kResourceExhausted:
      return shardlineResourceExhausted;
    case absl::StatusCode::kUnimplemented:
      return shardlineUnimplemented;
    case absl::StatusCode::kDataLoss:
      return shardlineDataLoss;
    case absl::StatusCode::kAlreadyExists:
      return shardlineAlreadyExists;
    default:
      return shardlineInternalError;
  }
}

shardlineResult_t FromStatus(const absl::Status& status) {
  if (!status.ok()) last_error = status.ToString();
  return ResultOf(status);
}

#ifdef SHARDLINE_WITH_CUDA
shardlineResult_t FromDeviceStatus(const absl::Status& status) {
  const shardlineResult_t result = FromStatus(status);
  return status.code() == absl::StatusCode::kUnavailable ? shardlineDeviceUnavailable : result;
}
#endif

}  // namespace shardline::c_api

extern "C" {

shardlineResult_t shardline_get_version(int* version) {
  SL_C_REQUIRE(version != nullptr, "shardline_get_version: version is NULL");
  *version = SHARDLINE_VERSION_CODE;
  return shardlineSuccess;
}

const char* shardline_last_error(void) { return shardline::c_api::last_error.c_str(); }

const char* shardline_result_string(shardlineResult_t result) {
  switch (result) {
    case shardlineSuccess:
      return "shardlineSuccess";
    case shardlineInvalidArgument:
      return "shardlineInvalidArgument";
    case shardlineTimeout:
      return "shardlineTimeout";
    case shardlineRemoteError:
      return "shardlineRemoteError";
    case shardlineFailedPrecondition:
      return "shardlineFailedPrecondition";
    case shardlineNotFound:
      return "shardlineNotFound";
    case shardlineResourceExhausted:
      return "shardlineResourceExhausted";
    case shardlineUnimplemented:
      return "shardlineUnimplemented";
    case shardlineInternalError:
      return "shardlineInternalError";
    case shardlineDeviceUnavailable:
      return "shardlineDeviceUnavailable";
    case shardlineDataLoss:
      return "shardlineDataLoss";
    case shardlineAlreadyExists:
      return "shardlineAlreadyExists";
    default:
      break;
  }
  return "unknown shardlineResult_t";
}

}  // extern "C"
