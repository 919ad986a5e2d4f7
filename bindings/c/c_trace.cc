// File: bindings/c/c_trace.cc
// -----------------------------------------------------------------------------
// The C API's Chrome traces (runtime/trace.h): one rank's TraceWriter behind a handle.

#include "absl/strings/str_cat.h"
#include "bindings/c/c_internal.h"
#include "bindings/c/shardline.h"
#include "runtime/trace.h"

using shardline::c_api::FromStatus;
using shardline::c_api::Guard;

extern "C" {

// ---- Traces --------------------------------------------------------------------------------

shardlineResult_t shardline_trace_create(int rank, const char* process_name,
                                         shardlineTrace_t* trace) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(trace != nullptr, "shardline_trace_create: trace is NULL");
    SL_C_REQUIRE(rank >= 0, absl::StrCat("shardline_trace_create: rank ", rank, " < 0"));
    *trace = new shardlineTrace_s{
        shardline::TraceWriter(rank, process_name != nullptr ? process_name : "")};
    return shardlineSuccess;
  });
}

shardlineResult_t shardline_trace_write(shardlineTrace_t trace, const char* path) {
  return Guard([&]() -> shardlineResult_t {
    SL_C_REQUIRE(trace != nullptr && path != nullptr, "shardline_trace_write: NULL argument");
    return FromStatus(trace->writer.WriteFile(path));
  });
}

shardlineResult_t shardline_trace_num_events(shardlineTrace_t trace, size_t* events) {
  SL_C_REQUIRE(trace != nullptr && events != nullptr, "shardline_trace_num_events: NULL argument");
  *events = trace->writer.num_events();
  return shardlineSuccess;
}

shardlineResult_t shardline_trace_destroy(shardlineTrace_t trace) {
  return Guard([&] {
    delete trace;
    return shardlineSuccess;
  });
}

}  // extern "C"
