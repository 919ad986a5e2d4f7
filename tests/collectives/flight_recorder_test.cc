// The flight recorder (collectives/flight_recorder.h): the ring, the states, the JSON dump, and
// what the Communicator records over the local backend — tags, times, the peers a running or
// timed-out collective waits on, mismatches, dumps on abort and on SIGUSR1 — and that the dump on
// disk shows a collective that failed as failed (local and ucx).
#include "collectives/flight_recorder.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collectives/communicator.h"
#include "collectives/local/local_communicator.h"
#include "runtime/check.h"
#include "runtime/config.h"
#include "runtime/stream.h"
#include "tests/collectives/rank_comms.h"

namespace shardline {
namespace {

using ::shardline::testing::Comms;
using ::shardline::testing::MakeUcxComms;
using ::shardline::testing::RunRanks;
using ::shardline::testing::WaitFor;

CollectiveFingerprint Fp(uint64_t seq, CollectiveKind kind = CollectiveKind::kAllReduce,
                         uint64_t count = 5) {
  return CollectiveFingerprint{kind, seq, count, DType::kF32, ReduceOp::kSum, 0};
}

// Sets a SHARDLINE_* knob for the rest of the test process and drops its cached value.
void SetKnob(const std::string& name, const std::string& value) {
  ASSERT_EQ(setenv(name.c_str(), value.c_str(), 1), 0);
  for (const ParamBase* param : AllParams()) {
    if (param->env_name() == name) param->ResetCacheForTesting();
  }
}
void ClearKnob(const std::string& name) {
  unsetenv(name.c_str());
  for (const ParamBase* param : AllParams()) {
    if (param->env_name() == name) param->ResetCacheForTesting();
  }
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A fresh directory of the running test's own under gtest's temporary directory, removed with
// its dumps when the test is done.
class TestDir {
 public:
  TestDir()
      : path_(absl::StrCat(::testing::TempDir(), "/flight_", getpid(), "_",
                           ::testing::UnitTest::GetInstance()->current_test_info()->name())) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TestDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TestDir(const TestDir&) = delete;
  TestDir& operator=(const TestDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(FlightRecorderTest, RingKeepsTheLastCapacityRecordsOldestFirst) {
  FlightRecorder rec(4);
  EXPECT_TRUE(rec.Snapshot().empty());
  for (uint64_t seq = 10; seq < 20; ++seq) {
    rec.Enqueued(Fp(seq, CollectiveKind::kAllGather, seq * 3), "gather", absl::StrCat("u", seq),
                 static_cast<int64_t>(seq * 100));
  }
  EXPECT_EQ(rec.recorded(), 10u);
  std::vector<FlightRecord> records = rec.Snapshot();
  ASSERT_EQ(records.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const uint64_t seq = 16 + i;
    EXPECT_EQ(records[i].seq, seq);
    EXPECT_EQ(records[i].count, seq * 3);
    EXPECT_EQ(records[i].kind, CollectiveKind::kAllGather);
    EXPECT_EQ(records[i].tag, absl::StrCat("u", seq));
    EXPECT_EQ(records[i].stream, "gather");
    EXPECT_EQ(records[i].enqueued_ns, static_cast<int64_t>(seq * 100));
    EXPECT_EQ(records[i].state, FlightState::kQueued);
  }
  // Events for collectives the ring no longer (or never) held change nothing.
  rec.Started(15, 1);
  rec.Ended(15, absl::OkStatus(), 2);
  rec.Started(20, 1);
  FlightRecord r;
  EXPECT_FALSE(rec.Find(15, &r));
  EXPECT_FALSE(rec.Find(20, &r));
  ASSERT_TRUE(rec.Find(16, &r));
  EXPECT_EQ(r.state, FlightState::kQueued);
  for (const FlightRecord& x : rec.Snapshot()) EXPECT_EQ(x.state, FlightState::kQueued);
}

TEST(FlightRecorderTest, StatesMoveForwardOnly) {
  FlightRecorder rec(8);
  for (uint64_t seq = 0; seq < 3; ++seq) rec.Enqueued(Fp(seq), "s", "", 1);
  rec.Started(0, 5);
  rec.SetWaitingOn(0, {2, 3});
  rec.Ended(0, absl::OkStatus(), 9);
  rec.Started(1, 6);
  rec.SetWaitingOn(1, {1});
  rec.Ended(1, absl::DeadlineExceededError("timed out"), 10);
  rec.Ended(1, absl::OkStatus(), 11);                  // a failed collective stays failed
  rec.Ended(0, absl::AbortedError("late abort"), 12);  // and a done one done
  rec.SetWaitingOn(0, {7});

  FlightRecord r;
  ASSERT_TRUE(rec.Find(0, &r));
  EXPECT_EQ(r.state, FlightState::kDone);
  EXPECT_EQ(r.started_ns, 5);
  EXPECT_EQ(r.ended_ns, 9);
  EXPECT_FALSE(r.waiting_known);
  EXPECT_TRUE(r.error.empty());

  ASSERT_TRUE(rec.Find(1, &r));
  EXPECT_EQ(r.state, FlightState::kFailed);
  EXPECT_EQ(r.ended_ns, 10);
  EXPECT_TRUE(r.waiting_known);
  EXPECT_EQ(r.waiting_on, std::vector<int>({1}));
  EXPECT_EQ(r.error, "DEADLINE_EXCEEDED: timed out");

  ASSERT_TRUE(rec.Find(2, &r));
  EXPECT_EQ(r.state, FlightState::kQueued);
  EXPECT_EQ(r.started_ns, 0);

  // A reused slot starts clean.
  FlightRecorder small(1);
  small.Enqueued(Fp(0), "s", "t", 1);
  small.SetWaitingOn(0, {1});
  small.Ended(0, absl::InternalError("x"), 2);
  small.Enqueued(Fp(1), "s2", "", 3);
  ASSERT_TRUE(small.Find(1, &r));
  EXPECT_EQ(r.state, FlightState::kQueued);
  EXPECT_FALSE(r.waiting_known);
  EXPECT_TRUE(r.error.empty());
  EXPECT_TRUE(r.tag.empty());
  EXPECT_EQ(r.stream, "s2");
}

TEST(FlightRecorderTest, CapacityZeroRecordsNothing) {
  FlightRecorder rec(0);
  EXPECT_FALSE(rec.enabled());
  rec.Enqueued(Fp(0), "s", "t", 1);
  rec.Started(0, 2);
  rec.Ended(0, absl::OkStatus(), 3);
  EXPECT_EQ(rec.recorded(), 0u);
  EXPECT_TRUE(rec.Snapshot().empty());
}

TEST(FlightRecorderTest, JsonHasEveryFieldAndEscapes) {
  FlightRecorder rec(4);
  rec.Enqueued(
      CollectiveFingerprint{CollectiveKind::kBroadcast, 7, 9, DType::kBF16, ReduceOp::kSum, 2},
      "str\"eam", "tag\\with\nnewline", 100);
  rec.Started(7, 150);
  rec.SetWaitingOn(7, {0, 3});
  FlightDumpHeader header{.communicator = "world/split0",
                          .backend = "local",
                          .rank = 1,
                          .size = 4,
                          .reason = "test",
                          .capacity = 4,
                          .recorded = 1,
                          .next_seq = 8};
  const std::string json = FlightRecordsToJson(header, rec.Snapshot());
  for (const char* needle :
       {"\"format\": \"shardline-flight-recorder\"", "\"communicator\": \"world/split0\"",
        "\"backend\": \"local\"", "\"rank\": 1", "\"size\": 4", "\"reason\": \"test\"",
        "\"next_seq\": 8", "\"seq\": 7", "\"call\": \"broadcast(count=9, bf16, root=2)\"",
        "\"kind\": \"broadcast\"", "\"dtype\": \"bf16\"", "\"root\": 2",
        "\"stream\": \"str\\\"eam\"", "\"tag\": \"tag\\\\with\\nnewline\"",
        "\"state\": \"running\"", "\"enqueued_ns\": 100", "\"started_ns\": 150", "\"ended_ns\": 0",
        "\"waiting_on\": [0, 3]"}) {
    EXPECT_TRUE(absl::StrContains(json, needle)) << needle << " not in " << json;
  }
  EXPECT_EQ(FlightDumpPath("/tmp/x", "world/split0.color1", 3),
            "/tmp/x/flight.world_split0.color1.rank3.json");
  EXPECT_EQ(FlightDumpPath("/tmp/x/", "a b", 0), "/tmp/x/flight.a_b.rank0.json");
}

TEST(FlightRecorderTest, WriteFailsNamingThePath) {
  absl::Status status = WriteFlightDump("/nonexistent-dir/x.json", "{}");
  EXPECT_FALSE(status.ok());
  EXPECT_TRUE(absl::StrContains(status.message(), "/nonexistent-dir/x.json")) << status;
}

// Over the local backend: every collective of every rank, with its tag, stream, times and state.
TEST(FlightRecorderCommunicatorTest, RecordsEveryCollectiveWithTagsAndTimes) {
  const int n = 3;
  const int kRounds = 7;
  absl::StatusOr<Comms> comms = CreateLocalCommunicators(n, {.timeout = absl::Seconds(30)});
  ASSERT_TRUE(comms.ok());
  const int64_t before = absl::GetCurrentTimeNanos();
  RunRanks(*comms, [&](int r, Communicator& comm, Stream& stream) {
    for (int i = 0; i < kRounds; ++i) {
      const size_t count = 3 + static_cast<size_t>(i);
      std::vector<float> in(count), out(count * n);
      for (size_t k = 0; k < count; ++k) in[k] = static_cast<float>(r * 1000 + i * 10 + k);
      CollectiveOptions options;
      options.tag = absl::StrCat("block.", i);
      ASSERT_TRUE(
          WaitFor(comm.AllGather(in.data(), out.data(), count, DType::kF32, stream, options)).ok());
      for (int s = 0; s < n; ++s) {
        for (size_t k = 0; k < count; ++k) {
          ASSERT_EQ(out[s * count + k], static_cast<float>(s * 1000 + i * 10 + k));
        }
      }
      ReduceOptions reduce;
      reduce.op = ReduceOp::kMax;
      int64_t value = r * 7 + i;
      ASSERT_TRUE(WaitFor(comm.AllReduce(&value, &value, 1, DType::kI64, stream, reduce)).ok());
      ASSERT_EQ(value, (n - 1) * 7 + i);
    }
  });
  const int64_t after = absl::GetCurrentTimeNanos();
  for (int r = 0; r < n; ++r) {
    std::vector<FlightRecord> records = (*comms)[r]->FlightRecords();
    ASSERT_EQ(records.size(), 2u * kRounds);
    for (int i = 0; i < kRounds; ++i) {
      const FlightRecord& ag = records[2 * i];
      const FlightRecord& ar = records[2 * i + 1];
      EXPECT_EQ(ag.seq, 2u * i);
      EXPECT_EQ(ag.kind, CollectiveKind::kAllGather);
      EXPECT_EQ(ag.count, 3u + i);
      EXPECT_EQ(ag.dtype, DType::kF32);
      EXPECT_EQ(ag.tag, absl::StrCat("block.", i));
      EXPECT_EQ(ar.seq, 2u * i + 1);
      EXPECT_EQ(ar.kind, CollectiveKind::kAllReduce);
      EXPECT_EQ(ar.op, ReduceOp::kMax);
      EXPECT_EQ(ar.dtype, DType::kI64);
      EXPECT_EQ(ar.tag, "");
      for (const FlightRecord* x : {&ag, &ar}) {
        EXPECT_EQ(x->state, FlightState::kDone);
        EXPECT_EQ(x->stream, absl::StrCat("comm", r));
        EXPECT_LE(before, x->enqueued_ns);
        EXPECT_LE(x->enqueued_ns, x->started_ns);
        EXPECT_LE(x->started_ns, x->ended_ns);
        EXPECT_LE(x->ended_ns, after);
        EXPECT_FALSE(x->waiting_known);
      }
    }
  }
}

TEST(FlightRecorderCommunicatorTest, KnobSetsCapacityAndZeroTurnsItOff) {
  SetKnob("SHARDLINE_FLIGHT_RECORDER", "5");
  absl::StatusOr<Comms> small = CreateLocalCommunicators(2, {.timeout = absl::Seconds(30)});
  SetKnob("SHARDLINE_FLIGHT_RECORDER", "0");
  absl::StatusOr<Comms> off = CreateLocalCommunicators(2, {.timeout = absl::Seconds(30)});
  SetKnob("SHARDLINE_FLIGHT_RECORDER", "-1");
  EXPECT_FALSE(ValidateAllParams().ok());
  ClearKnob("SHARDLINE_FLIGHT_RECORDER");
  ASSERT_TRUE(small.ok() && off.ok());
  for (Comms* comms : {&*small, &*off}) {
    RunRanks(*comms, [&](int r, Communicator& comm, Stream& stream) {
      for (int i = 0; i < 12; ++i) {
        int32_t v = r + i;
        ASSERT_TRUE(WaitFor(comm.AllReduce(&v, &v, 1, DType::kI32, stream)).ok());
        ASSERT_EQ(v, 1 + 2 * i);
      }
    });
  }
  std::vector<FlightRecord> records = (*small)[1]->FlightRecords();
  ASSERT_EQ(records.size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(records[i].seq, 7 + i);
  EXPECT_TRUE((*off)[1]->FlightRecords().empty());
  const TestDir dir;
  absl::StatusOr<std::string> dumped = (*off)[1]->DumpFlightRecord(dir.path(), "test");
  EXPECT_EQ(dumped.status().code(), absl::StatusCode::kFailedPrecondition) << dumped.status();
}

// Polls `fn` until it returns true or 10 s pass (state that no event announces).
template <typename Fn>
bool Eventually(Fn fn) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    if (fn()) return true;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return fn();
}

TEST(FlightRecorderCommunicatorTest, RunningCollectiveNamesThePeersItWaitsOn) {
  const int n = 3;
  absl::StatusOr<Comms> comms = CreateLocalCommunicators(n, {.timeout = absl::Seconds(30)});
  ASSERT_TRUE(comms.ok());
  std::vector<std::unique_ptr<Stream>> streams;
  for (int r = 0; r < n; ++r) streams.push_back(*CreateHostStream({.name = absl::StrCat("s", r)}));
  std::vector<double> values = {1.5, -2.25, 4.0};
  std::vector<Work> works;
  // Ranks 0 and 1 enter; rank 2 is late.
  for (int r = 0; r < 2; ++r) {
    works.push_back(*(*comms)[r]->AllReduce(&values[r], &values[r], 1, DType::kF64, *streams[r]));
  }
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(Eventually([&] {
      std::vector<FlightRecord> records = (*comms)[r]->FlightRecords();
      return records.size() == 1 && records[0].state == FlightState::kRunning &&
             records[0].waiting_known && records[0].waiting_on == std::vector<int>({2});
    })) << "rank "
        << r;
  }
  const std::string json = (*comms)[0]->FlightRecordJson("probe");
  EXPECT_TRUE(absl::StrContains(json, "\"state\": \"running\"")) << json;
  EXPECT_TRUE(absl::StrContains(json, "\"waiting_on\": [2]")) << json;
  EXPECT_TRUE((*comms)[2]->FlightRecords().empty());

  works.push_back(*(*comms)[2]->AllReduce(&values[2], &values[2], 1, DType::kF64, *streams[2]));
  for (Work& w : works) ASSERT_TRUE(w.Wait(absl::Now() + absl::Seconds(30)).ok());
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(values[r], 1.5 - 2.25 + 4.0);
    std::vector<FlightRecord> records = (*comms)[r]->FlightRecords();
    ASSERT_EQ(records.size(), 1u);
    EXPECT_EQ(records[0].state, FlightState::kDone);
    EXPECT_FALSE(records[0].waiting_known);
  }
}

TEST(FlightRecorderCommunicatorTest, DeadlineRecordsTheMissingRankAndDumps) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  SetKnob("SHARDLINE_FLIGHT_RECORDER_DIR", dir);
  const int n = 3;
  absl::StatusOr<Comms> comms =
      CreateLocalCommunicators(n, {.name = "deadline", .timeout = absl::Milliseconds(300)});
  ASSERT_TRUE(comms.ok());
  // Everyone completes #0; rank 2 never issues #1.
  RunRanks(*comms, [&](int r, Communicator& comm, Stream& stream) {
    ASSERT_TRUE(WaitFor(comm.Barrier(stream, {.tag = "warmup"})).ok());
    if (r == 2) return;
    float v = 1.0f;
    absl::Status status =
        WaitFor(comm.AllReduce(&v, &v, 1, DType::kF32, stream, {{.tag = "block.1"}}));
    ASSERT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  });
  ClearKnob("SHARDLINE_FLIGHT_RECORDER_DIR");
  for (int r = 0; r < 2; ++r) {
    std::vector<FlightRecord> records = (*comms)[r]->FlightRecords();
    ASSERT_EQ(records.size(), 2u);
    EXPECT_EQ(records[0].state, FlightState::kDone);
    EXPECT_EQ(records[0].tag, "warmup");
    EXPECT_EQ(records[1].state, FlightState::kFailed);
    EXPECT_EQ(records[1].tag, "block.1");
    EXPECT_TRUE(records[1].waiting_known);
    EXPECT_EQ(records[1].waiting_on, std::vector<int>({2}));
    EXPECT_TRUE(absl::StrContains(records[1].error, "DEADLINE_EXCEEDED")) << records[1].error;

    const std::string path = FlightDumpPath(dir, "deadline", r);
    ASSERT_TRUE(std::filesystem::exists(path)) << path;
    const std::string json = ReadFile(path);
    EXPECT_TRUE(absl::StrContains(json, "\"reason\": \"aborted: DEADLINE_EXCEEDED")) << json;
    EXPECT_TRUE(absl::StrContains(json, "\"tag\": \"block.1\"")) << json;
    EXPECT_TRUE(absl::StrContains(json, "\"waiting_on\": [2]")) << json;
    EXPECT_TRUE(absl::StrContains(json, "\"call\": \"all_reduce(count=1, f32, sum)\"")) << json;
  }
  // Rank 2's communicator was never aborted itself (it issued nothing after the barrier).
  EXPECT_FALSE(std::filesystem::exists(FlightDumpPath(dir, "deadline", 2)));
}

// Issue 27: the abort's dump was written while the collective it ended still ran, and nothing
// wrote it again: the file said "running" for a collective that had failed.
TEST(FlightRecorderCommunicatorTest, AbortWhileRunningLeavesADumpThatSaysFailed) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  SetKnob("SHARDLINE_FLIGHT_RECORDER_DIR", dir);
  absl::StatusOr<Comms> comms =
      CreateLocalCommunicators(2, {.name = "aborted", .timeout = absl::Seconds(30)});
  ASSERT_TRUE(comms.ok());
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream({.name = "s0"});
  ASSERT_TRUE(stream.ok());
  Communicator& comm = *(*comms)[0];
  float v = 1.0f;
  // Rank 1 never comes: rank 0's all-reduce runs until the abort.
  absl::StatusOr<Work> work =
      comm.AllReduce(&v, &v, 1, DType::kF32, **stream, {{.tag = "block.3"}});
  ASSERT_TRUE(work.ok()) << work.status();
  ASSERT_TRUE(Eventually([&] {
    std::vector<FlightRecord> records = comm.FlightRecords();
    return records.size() == 1 && records[0].state == FlightState::kRunning;
  }));
  comm.Abort(absl::AbortedError("stopped by the test"));
  const absl::Status status = work->Wait(absl::Now() + absl::Seconds(30));
  ClearKnob("SHARDLINE_FLIGHT_RECORDER_DIR");
  ASSERT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  ASSERT_EQ(comm.FlightRecords()[0].state, FlightState::kFailed);
  // The collective's failure was reported after its record ended, and the dump after that.
  const std::string json = ReadFile(FlightDumpPath(dir, "aborted", 0));
  EXPECT_TRUE(absl::StrContains(json, "\"reason\": \"aborted: ABORTED: stopped by the test\""))
      << json;
  EXPECT_TRUE(absl::StrContains(json, "\"tag\": \"block.3\"")) << json;
  EXPECT_TRUE(absl::StrContains(json, "\"state\": \"failed\"")) << json;
  EXPECT_FALSE(absl::StrContains(json, "\"state\": \"running\"")) << json;
}

// The ucx backend aborts inside Run (to tell the peers at once), before the collective's end is
// recorded: its deadline dumps said "running" for the collective that timed out, and so did the
// dumps of the ranks that its abort notice reached while they waited.
TEST(FlightRecorderCommunicatorTest, UcxDeadlineDumpsSayFailed) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  SetKnob("SHARDLINE_FLIGHT_RECORDER_DIR", dir);
  const int n = 3;
  Comms comms = MakeUcxComms(n, absl::Seconds(30), /*store=*/nullptr, "ucxdeadline");
  // Everyone completes #0; rank 2 never issues #1.
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    ASSERT_TRUE(WaitFor(comm.Barrier(stream, {.tag = "warmup"})).ok());
    if (r == 2) return;
    float v = 1.0f;
    ReduceOptions options;
    options.tag = "block.1";
    options.timeout = absl::Milliseconds(400);
    const absl::Status status = WaitFor(comm.AllReduce(&v, &v, 1, DType::kF32, stream, options));
    ASSERT_FALSE(status.ok());
  });
  ClearKnob("SHARDLINE_FLIGHT_RECORDER_DIR");
  bool timed_out = false;
  for (int r = 0; r < 2; ++r) {
    std::vector<FlightRecord> records = comms[r]->FlightRecords();
    ASSERT_EQ(records.size(), 2u);
    ASSERT_EQ(records[1].state, FlightState::kFailed) << records[1].error;
    // The first rank to time out names rank 2; the other may have been told of its abort.
    if (absl::StrContains(records[1].error, "DEADLINE_EXCEEDED")) {
      timed_out = true;
      EXPECT_EQ(records[1].waiting_on, std::vector<int>({2}));
    }
    const std::string json = ReadFile(FlightDumpPath(dir, "ucxdeadline", r));
    EXPECT_TRUE(absl::StrContains(json, "\"reason\": \"aborted: ")) << json;
    EXPECT_TRUE(absl::StrContains(json, "\"tag\": \"block.1\", \"state\": \"failed\"")) << json;
    EXPECT_FALSE(absl::StrContains(json, "\"state\": \"running\"")) << json;
  }
  EXPECT_TRUE(timed_out);
}

TEST(FlightRecorderCommunicatorTest, MismatchKeepsEachRanksOwnCall) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  SetKnob("SHARDLINE_FLIGHT_RECORDER_DIR", dir);
  const int n = 3;
  absl::StatusOr<Comms> comms =
      CreateLocalCommunicators(n, {.name = "mismatch", .timeout = absl::Seconds(30)});
  ASSERT_TRUE(comms.ok());
  RunRanks(*comms, [&](int r, Communicator& comm, Stream& stream) {
    std::vector<int32_t> in(2 * n, r), out(2 * n);
    absl::Status status =
        r == 1 ? WaitFor(comm.AllGather(in.data(), out.data(), 2, DType::kI32, stream))
               : WaitFor(comm.ReduceScatter(in.data(), out.data(), 2, DType::kI32, stream));
    ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  });
  ClearKnob("SHARDLINE_FLIGHT_RECORDER_DIR");
  for (int r = 0; r < n; ++r) {
    std::vector<FlightRecord> records = (*comms)[r]->FlightRecords();
    ASSERT_EQ(records.size(), 1u);
    EXPECT_EQ(records[0].kind,
              r == 1 ? CollectiveKind::kAllGather : CollectiveKind::kReduceScatter);
    EXPECT_EQ(records[0].state, FlightState::kFailed);
    EXPECT_TRUE(absl::StrContains(records[0].error, "disagree")) << records[0].error;
    const std::string json = ReadFile(FlightDumpPath(dir, "mismatch", r));
    EXPECT_TRUE(absl::StrContains(json, r == 1 ? "\"call\": \"all_gather(count=2, i32)\""
                                               : "\"call\": \"reduce_scatter(count=2, i32, sum)\""))
        << json;
  }
}

TEST(FlightRecorderCommunicatorTest, Sigusr1DumpsEveryLiveCommunicator) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  SetKnob("SHARDLINE_FLIGHT_RECORDER_DIR", dir);
  absl::StatusOr<Comms> comms =
      CreateLocalCommunicators(2, {.name = "sig", .timeout = absl::Seconds(30)});
  ASSERT_TRUE(comms.ok());
  RunRanks(*comms, [&](int r, Communicator& comm, Stream& stream) {
    int32_t v = r;
    ASSERT_TRUE(WaitFor(comm.AllReduce(&v, &v, 1, DType::kI32, stream, {{.tag = "t"}})).ok());
    ASSERT_EQ(v, 1);
  });
  // The handler only writes to a pipe; the watcher thread writes the files.
  ASSERT_EQ(raise(SIGUSR1), 0);
  for (int r = 0; r < 2; ++r) {
    const std::string path = FlightDumpPath(dir, "sig", r);
    ASSERT_TRUE(Eventually([&] {
      return absl::StrContains(ReadFile(path), "\"reason\": \"SIGUSR1\"");
    })) << path;
    const std::string json = ReadFile(path);
    EXPECT_TRUE(absl::StrContains(json, "\"state\": \"done\"")) << json;
    EXPECT_TRUE(absl::StrContains(json, absl::StrCat("\"rank\": ", r))) << json;
  }
  // The programmatic form: the same communicators, into another directory.
  const std::string other = dir + "/again";
  std::filesystem::create_directories(other);
  absl::StatusOr<std::vector<std::string>> paths = DumpAllFlightRecords(other, "asked");
  ASSERT_TRUE(paths.ok()) << paths.status();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(std::find(paths->begin(), paths->end(), FlightDumpPath(other, "sig", r)) !=
                paths->end());
  }
  ClearKnob("SHARDLINE_FLIGHT_RECORDER_DIR");
}

}  // namespace
}  // namespace shardline
