#include "runtime/check.h"

#include <cstdio>
#include <cstdlib>

namespace shardline::check_internal {

CheckFailure::CheckFailure(const char* file, int line, const char* condition)
    : file_(file), line_(line) {
  stream_ << "Check failed: " << condition << " ";
}

CheckFailure::~CheckFailure() {
  std::string message = stream_.str();
  // Written with stdio so that it reaches the terminal even if logging is misconfigured.
  std::fprintf(stderr, "shardline FATAL %s:%d: %s\n", file_, line_, message.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace shardline::check_internal
