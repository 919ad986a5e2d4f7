// File: runtime/check.h
// -----------------------------------------------------------------------------
// Invariant checks. A broken invariant is a bug in shardline, not bad input: it aborts with
// the file, line, condition and an optional message. Bad input is an absl::Status instead.
//
//   SL_CHECK(offset + len <= size) << "tensor " << name;
//   SL_CHECK_OK(stream->status());
//   SL_DCHECK(...)   // compiled out with NDEBUG

#ifndef SHARDLINE_RUNTIME_CHECK_H_
#define SHARDLINE_RUNTIME_CHECK_H_

#include <sstream>

#include "absl/base/optimization.h"
#include "absl/status/status.h"

namespace shardline::check_internal {

// Collects the streamed message and aborts in its destructor.
class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* condition);
  [[noreturn]] ~CheckFailure();
  std::ostream& stream() { return stream_; }

 private:
  const char* file_;
  int line_;
  std::ostringstream stream_;
};

// Lets `cond ? (void)0 : Voidify() & CheckFailure(...).stream() << ...` type-check.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace shardline::check_internal

#define SL_CHECK(cond)                       \
  ABSL_PREDICT_TRUE(cond)                    \
  ? (void)0                                  \
  : ::shardline::check_internal::Voidify() & \
          ::shardline::check_internal::CheckFailure(__FILE__, __LINE__, #cond).stream()

#define SL_CHECK_OK(expr)                                \
  do {                                                   \
    ::absl::Status sl_check_status_ = (expr);            \
    SL_CHECK(sl_check_status_.ok()) << sl_check_status_; \
  } while (0)

#ifdef NDEBUG
#define SL_DCHECK(cond) \
  while (false) SL_CHECK(cond)
#else
#define SL_DCHECK(cond) SL_CHECK(cond)
#endif

#endif  // SHARDLINE_RUNTIME_CHECK_H_
