// Uses the installed headers and libraries; exits non-zero if anything is off.
#include <cstdio>

#include "runtime/config.h"
#include "runtime/dtype.h"
#include "runtime/status.h"

namespace {

absl::Status Run() {
  SL_ASSIGN_OR_RETURN(shardline::DType dtype, shardline::ParseDType("bf16"));
  if (shardline::DTypeSize(dtype) != 2) return absl::InternalError("bf16 is not 2 bytes");
  SL_ASSIGN_OR_RETURN(absl::Duration timeout, shardline::DefaultTimeout());
  std::printf("shardline consumer: %s is %zu bytes; default timeout %s; %zu knobs\n",
              std::string(shardline::DTypeName(dtype)).c_str(), shardline::DTypeSize(dtype),
              absl::FormatDuration(timeout).c_str(), shardline::AllParams().size());
  return absl::OkStatus();
}

}  // namespace

int main() {
  absl::Status status = Run();
  if (!status.ok()) {
    std::fprintf(stderr, "shardline consumer failed: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
