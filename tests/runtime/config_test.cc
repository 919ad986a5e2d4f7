// Environment knobs and logging configuration.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "runtime/config.h"
#include "runtime/logging.h"
#include "tests/common/scoped_env.h"

namespace shardline {
namespace {

SL_PARAM(int64_t, TestChunk, "TEST_CHUNK_BYTES", 4096, "A knob declared by this test.",
         [](const int64_t& v) {
           return v > 0 ? absl::OkStatus() : absl::InvalidArgumentError("must be positive");
         });
SL_PARAM(bool, TestFlag, "TEST_FLAG", false, "A boolean knob declared by this test.");
SL_PARAM(double, TestRatio, "TEST_RATIO", 0.5, "A floating knob declared by this test.",
         InRange<double>(0.0, 1.0));
SL_PARAM(int64_t, TestBounded, "TEST_BOUNDED", 8192, "A bounded knob declared by this test.",
         InRange<int64_t>(4096, int64_t{256} << 20));

using ::shardline::testing::ScopedEnv;

TEST(ConfigTest, DefaultWhenUnset) {
  ScopedEnv env("SHARDLINE_TEST_CHUNK_BYTES", nullptr);
  ParamTestChunk().ResetCacheForTesting();
  EXPECT_EQ(*ParamTestChunk().Get(), 4096);
  EXPECT_EQ(ParamTestChunk().env_name(), "SHARDLINE_TEST_CHUNK_BYTES");
}

TEST(ConfigTest, ReadsAndCachesTheEnvironment) {
  ScopedEnv env("SHARDLINE_TEST_CHUNK_BYTES", "65536");
  ParamTestChunk().ResetCacheForTesting();
  EXPECT_EQ(*ParamTestChunk().Get(), 65536);
  setenv("SHARDLINE_TEST_CHUNK_BYTES", "1", 1);
  EXPECT_EQ(*ParamTestChunk().Get(), 65536);  // read once
  ParamTestChunk().ResetCacheForTesting();
  EXPECT_EQ(*ParamTestChunk().Get(), 1);
}

TEST(ConfigTest, BadValueNamesTheVariable) {
  ScopedEnv env("SHARDLINE_TEST_CHUNK_BYTES", "12k");
  ParamTestChunk().ResetCacheForTesting();
  absl::StatusOr<int64_t> value = ParamTestChunk().Get();
  ASSERT_EQ(value.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(value.status().message(), "SHARDLINE_TEST_CHUNK_BYTES"));
  EXPECT_TRUE(absl::StrContains(value.status().message(), "'12k'"));
  // ValidateAllParams finds it too.
  absl::Status all = ValidateAllParams();
  EXPECT_TRUE(absl::StrContains(all.message(), "SHARDLINE_TEST_CHUNK_BYTES")) << all;
}

TEST(ConfigTest, CheckRejectsOutOfRange) {
  ScopedEnv env("SHARDLINE_TEST_CHUNK_BYTES", "-5");
  ParamTestChunk().ResetCacheForTesting();
  absl::Status status = ParamTestChunk().Get().status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "must be positive")) << status;
  ParamTestChunk().ResetCacheForTesting();
}

TEST(ConfigTest, BooleanAndDoubleGrammar) {
  for (const char* yes : {"1", "true", "YES", "on"}) {
    ScopedEnv env("SHARDLINE_TEST_FLAG", yes);
    ParamTestFlag().ResetCacheForTesting();
    EXPECT_TRUE(*ParamTestFlag().Get()) << yes;
  }
  for (const char* no : {"0", "false", "No", "OFF"}) {
    ScopedEnv env("SHARDLINE_TEST_FLAG", no);
    ParamTestFlag().ResetCacheForTesting();
    EXPECT_FALSE(*ParamTestFlag().Get()) << no;
  }
  {
    ScopedEnv env("SHARDLINE_TEST_FLAG", "maybe");
    ParamTestFlag().ResetCacheForTesting();
    EXPECT_FALSE(ParamTestFlag().Get().ok());
  }
  {
    ScopedEnv env("SHARDLINE_TEST_RATIO", "nan");
    ParamTestRatio().ResetCacheForTesting();
    EXPECT_FALSE(ParamTestRatio().Get().ok());
  }
  ParamTestFlag().ResetCacheForTesting();
  ParamTestRatio().ResetCacheForTesting();
}

TEST(ConfigTest, RegistryListsEveryKnobOnce) {
  std::vector<const ParamBase*> params = AllParams();
  int timeout = 0, chunk = 0;
  for (const ParamBase* p : params) {
    timeout += p->env_name() == "SHARDLINE_TIMEOUT_S";
    chunk += p->env_name() == "SHARDLINE_TEST_CHUNK_BYTES";
  }
  EXPECT_EQ(timeout, 1);
  EXPECT_EQ(chunk, 1);
  EXPECT_TRUE(absl::StrContains(DescribeParams(), "SHARDLINE_DEBUG_SUBSYS"));
}

// The bounds are inclusive; a value past them is an error naming the knob, the value and the
// bounds (the SHARDLINE_UCX_CHUNK_BYTES=99999999999999 passed before bounds existed).
TEST(ConfigTest, BoundsAreCheckedWhenTheKnobIsRead) {
  struct Case {
    const char* text;
    bool ok;
  };
  for (const Case& c : {Case{"4096", true}, Case{"268435456", true}, Case{"4095", false},
                        Case{"268435457", false}, Case{"99999999999999", false}}) {
    ScopedEnv env("SHARDLINE_TEST_BOUNDED", c.text);
    ParamTestBounded().ResetCacheForTesting();
    absl::StatusOr<int64_t> value = ParamTestBounded().Get();
    ASSERT_EQ(value.ok(), c.ok) << c.text << ": " << value.status();
    if (c.ok) {
      EXPECT_EQ(absl::StrCat(*value), c.text);
      continue;
    }
    EXPECT_EQ(value.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(value.status().message(),
              absl::StrCat("environment variable SHARDLINE_TEST_BOUNDED: ", c.text,
                           " is out of range [4096, 268435456]"));
    // Readers that cannot fail take the default.
    EXPECT_EQ(ParamTestBounded().GetOrDefault(), 8192);
    EXPECT_TRUE(absl::StrContains(ValidateAllParams().message(), "SHARDLINE_TEST_BOUNDED"));
  }
  {
    ScopedEnv env("SHARDLINE_TEST_RATIO", "1.5");
    ParamTestRatio().ResetCacheForTesting();
    EXPECT_TRUE(
        absl::StrContains(ParamTestRatio().Get().status().message(), "1.5 is out of range [0, 1]"));
    EXPECT_EQ(ParamTestRatio().GetOrDefault(), 0.5);
  }
  ParamTestBounded().ResetCacheForTesting();
  ParamTestRatio().ResetCacheForTesting();
}

// An integer or floating knob must declare bounds: one without is a bug caught at start-up.
TEST(ConfigDeathTest, IntegerKnobWithoutBoundsAborts) {
  EXPECT_DEATH({ Param<int64_t> unbounded("TEST_UNBOUNDED", "int64_t", 1, "no bounds"); },
               "SHARDLINE_TEST_UNBOUNDED is an integer or floating knob declared without bounds");
  EXPECT_DEATH({ Param<double> unbounded("TEST_UNBOUNDED", "double", 1.0, "no bounds"); },
               "declared without bounds");
}

TEST(ConfigTest, TimeoutMustBePositive) {
  {
    ScopedEnv env("SHARDLINE_TIMEOUT_S", "0");
    ParamTimeout().ResetCacheForTesting();
    absl::StatusOr<absl::Duration> timeout = DefaultTimeout();
    EXPECT_EQ(timeout.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(timeout.status().message(), "SHARDLINE_TIMEOUT_S"));
    // Waits still get a finite deadline: the default.
    EXPECT_LT(DefaultDeadline(), absl::Now() + absl::Seconds(601));
  }
  {
    ScopedEnv env("SHARDLINE_TIMEOUT_S", "2.5");
    ParamTimeout().ResetCacheForTesting();
    EXPECT_EQ(*DefaultTimeout(), absl::Milliseconds(2500));
  }
  ParamTimeout().ResetCacheForTesting();
}

TEST(LoggingTest, ParsersFollowNcclGrammar) {
  EXPECT_EQ(*ParseLogLevel("info"), LogLevel::kInfo);
  EXPECT_EQ(*ParseLogLevel("TRACE"), LogLevel::kTrace);
  EXPECT_FALSE(ParseLogLevel("LOUD").ok());
  EXPECT_EQ(*ParseLogSubsys("INIT,COLL"), kLogInit | kLogColl);
  EXPECT_EQ(*ParseLogSubsys("ALL"), kLogAll);
  EXPECT_EQ(*ParseLogSubsys("^STORE"), ~static_cast<uint32_t>(kLogStore));
  absl::StatusOr<uint32_t> bad = ParseLogSubsys("INIT,BOGUS");
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "BOGUS"));
}

TEST(LoggingTest, DebugFilePatternExpandsHostAndPid) {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  EXPECT_EQ(ExpandDebugFilePattern("/tmp/sl.%h.%p.log"),
            absl::StrCat("/tmp/sl.", host, ".", getpid(), ".log"));
  EXPECT_EQ(ExpandDebugFilePattern("100%%"), "100%");
}

std::string ReadFile(const std::string& path) {
  std::ifstream file(path);
  std::stringstream buffer;
  buffer << file.rdbuf();
  return buffer.str();
}

TEST(LoggingTest, LevelsSubsystemsAndFile) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/shardline_log_%p.txt");
  const std::string expanded = ExpandDebugFilePattern(path);
  std::remove(expanded.c_str());
  {
    ScopedEnv level("SHARDLINE_DEBUG", "INFO");
    ScopedEnv subsys("SHARDLINE_DEBUG_SUBSYS", "COLL");
    ScopedEnv file("SHARDLINE_DEBUG_FILE", path.c_str());
    ReinitLoggingForTesting();
    EXPECT_TRUE(SL_LOG_ENABLED(INFO, COLL));
    EXPECT_FALSE(SL_LOG_ENABLED(INFO, STORE));
    EXPECT_FALSE(SL_LOG_ENABLED(TRACE, COLL));
    EXPECT_TRUE(SL_LOG_ENABLED(WARN, STORE));  // warnings ignore SUBSYS
    SetLogRank(5);
    SL_LOG(INFO, COLL) << "collective line";
    SL_LOG(INFO, STORE) << "filtered line";
    SL_LOG(WARN, STORE) << "warning line";
    SetLogRank(-1);
  }
  ReinitLoggingForTesting();
  const std::string text = ReadFile(expanded);
  EXPECT_TRUE(absl::StrContains(text, "[5] shardline INFO COLL collective line")) << text;
  EXPECT_TRUE(absl::StrContains(text, "shardline WARN STORE warning line")) << text;
  EXPECT_FALSE(absl::StrContains(text, "filtered line")) << text;
  std::remove(expanded.c_str());
}

TEST(LoggingTest, BadLevelIsReportedNotFatal) {
  ScopedEnv level("SHARDLINE_DEBUG", "LOUD");
  ParamTimeout().ResetCacheForTesting();
  ReinitLoggingForTesting();
  EXPECT_FALSE(SL_LOG_ENABLED(INFO, INIT));  // falls back to WARN
  EXPECT_TRUE(SL_LOG_ENABLED(WARN, INIT));
  absl::Status all = ValidateAllParams();
  EXPECT_TRUE(absl::StrContains(all.message(), "SHARDLINE_DEBUG")) << all;
}

TEST(LoggingTest, RateLimiterLetsABurstThroughPerPeriodAndCountsTheRest) {
  LogRateLimiter limiter(3, absl::Seconds(10));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  int64_t suppressed = -1;
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(limiter.Allow(&suppressed, t0 + absl::Seconds(i))) << i;
    EXPECT_EQ(suppressed, 0);
  }
  int allowed = 0;
  for (int i = 0; i < 4900; ++i) allowed += limiter.Allow(&suppressed, t0 + absl::Seconds(9));
  EXPECT_EQ(allowed, 0);
  // A new window: the first event through reports what the old one held back.
  EXPECT_TRUE(limiter.Allow(&suppressed, t0 + absl::Seconds(10)));
  EXPECT_EQ(suppressed, 4900);
  EXPECT_TRUE(limiter.Allow(&suppressed, t0 + absl::Seconds(11)));
  EXPECT_EQ(suppressed, 0);
  EXPECT_TRUE(limiter.Allow(nullptr, t0 + absl::Seconds(12)));
  EXPECT_FALSE(limiter.Allow(nullptr, t0 + absl::Seconds(13)));
  EXPECT_EQ(limiter.TakeSuppressed(), 1);
  EXPECT_EQ(limiter.TakeSuppressed(), 0);
  EXPECT_EQ(SuppressedSuffix(0), "");
  EXPECT_EQ(SuppressedSuffix(1), " (1 similar message suppressed)");
  EXPECT_EQ(SuppressedSuffix(7), " (7 similar messages suppressed)");
}

}  // namespace
}  // namespace shardline
