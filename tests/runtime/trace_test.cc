// The Chrome-trace writer: structure, escaping, bounded memory, merging. The JSON is checked with
// Python's json module, an independent parser, when python3 is on PATH.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "runtime/trace.h"
#include "tests/common/rank_threads.h"

namespace shardline {
namespace {

using ::shardline::testing::RunRankThreads;

std::string ReadFile(const std::string& path) {
  std::ifstream file(path);
  std::stringstream buffer;
  buffer << file.rdbuf();
  return buffer.str();
}

// A file in the test temp directory, named for this process: test binaries of several build
// directories (plain, sanitized) may run at the same time.
std::string TempPath(absl::string_view name) {
  return absl::StrCat(::testing::TempDir(), "/shardline_trace_test_", getpid(), "_", name);
}

bool HavePython() { return std::system("python3 -c 'import json' >/dev/null 2>&1") == 0; }

// Runs a Python snippet with the file as argv[1]; returns its exit status.
int RunPython(const std::string& code, const std::string& path) {
  const std::string script = TempPath("check_trace.py");
  std::ofstream(script) << code;
  return std::system(absl::StrCat("python3 ", script, " ", path).c_str());
}

TEST(TraceTest, TracksGetStableTids) {
  TraceWriter trace(3);
  EXPECT_EQ(trace.Track("gather"), 1);
  EXPECT_EQ(trace.Track("reduce"), 2);
  EXPECT_EQ(trace.Track("gather"), 1);
}

TEST(TraceTest, WritesValidChromeTrace) {
  TraceWriter trace(2, "rank 2 (test)");
  const int gather = trace.Track("gather");
  const int compute = trace.Track("compute \"main\"");
  const absl::Time t0 = absl::FromUnixMicros(1'700'000'000'000'000);
  trace.AddComplete(gather, "all_gather unit\t0", "coll", t0, absl::Microseconds(250),
                    TraceArgs{{{"bytes", 1 << 20}}, {{"dtype", "bf16"}}});
  trace.AddComplete(compute, "forward", "compute", t0 + absl::Microseconds(100),
                    absl::Microseconds(400));
  trace.AddCounter("memory", t0, {{"unsharded_bytes", 4096}});
  {
    TraceSpan span(&trace, gather, "span", "coll");
    span.args().ints.emplace_back("unit", 7);
  }
  TraceSpan disabled(nullptr, 0, "ignored", "x");  // no-op
  EXPECT_EQ(trace.num_events(), 4u);

  const std::string path = TempPath("trace_rank2.json");
  ASSERT_TRUE(trace.WriteFile(path).ok());
  const std::string text = ReadFile(path);
  EXPECT_TRUE(absl::StrContains(text, "\"thread_name\""));
  EXPECT_TRUE(absl::StrContains(text, "compute \\\"main\\\""));
  EXPECT_TRUE(absl::StrContains(text, "all_gather unit\\t0"));

  if (!HavePython()) GTEST_SKIP() << "python3 not found: JSON not checked by an independent parser";
  const char* kCheck = R"(
import json, sys
d = json.load(open(sys.argv[1]))
ev = d["traceEvents"]
x = [e for e in ev if e["ph"] == "X"]
assert len(x) == 3, x
assert all(e["pid"] == 2 for e in ev)
g = [e for e in x if e["name"] == "all_gather unit\t0"][0]
assert g["tid"] == 1 and abs(g["dur"] - 250) < 1e-6 and g["args"]["bytes"] == 1048576, g
assert abs(g["ts"] - 1.7e15) < 1, g["ts"]
names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
assert names == {1: "gather", 2: 'compute "main"'}, names
c = [e for e in ev if e["ph"] == "C"][0]
assert c["args"]["unsharded_bytes"] == 4096
)";
  EXPECT_EQ(RunPython(kCheck, path), 0);
}

TEST(TraceTest, BoundedMemoryCountsDrops) {
  TraceWriter trace(0, "", /*max_events=*/10);
  const int tid = trace.Track("t");
  for (int i = 0; i < 25; ++i) {
    trace.AddComplete(tid, "e", "c", absl::Now(), absl::Microseconds(1));
  }
  EXPECT_EQ(trace.num_events(), 10u);
  EXPECT_EQ(trace.num_dropped(), 15u);
  EXPECT_TRUE(absl::StrContains(trace.ToJson(), "15 events dropped"));
}

TEST(TraceTest, ConcurrentWritersLoseNothing) {
  TraceWriter trace(0);
  RunRankThreads(4, [&](int t) {
    const int tid = trace.Track(absl::StrCat("stream", t));
    for (int i = 0; i < 1000; ++i) {
      trace.AddComplete(tid, "op", "c", absl::Now(), absl::Microseconds(1));
    }
  });
  EXPECT_EQ(trace.num_events(), 4000u);
}

TEST(TraceTest, MergeKeepsOnePidPerRank) {
  std::vector<std::string> paths;
  for (int rank = 0; rank < 3; ++rank) {
    TraceWriter trace(rank);
    trace.AddComplete(trace.Track("gather"), "op", "coll", absl::Now(), absl::Microseconds(5));
    paths.push_back(TempPath(absl::StrCat("merge_rank", rank, ".json")));
    ASSERT_TRUE(trace.WriteFile(paths.back()).ok());
  }
  const std::string merged = TempPath("merged.json");
  ASSERT_TRUE(MergeTraceFiles(paths, merged).ok());

  const std::string bogus = TempPath("bogus.json");
  std::ofstream(bogus) << "{\"not\": \"ours\"}";
  absl::Status bad = MergeTraceFiles({paths[0], bogus}, merged + ".bad");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.message(), "bogus.json"));

  if (!HavePython()) GTEST_SKIP() << "python3 not found: JSON not checked by an independent parser";
  const char* kCheck = R"(
import json, sys
ev = json.load(open(sys.argv[1]))["traceEvents"]
assert sorted({e["pid"] for e in ev if e["ph"] == "X"}) == [0, 1, 2]
)";
  EXPECT_EQ(RunPython(kCheck, merged), 0);
}

}  // namespace
}  // namespace shardline
