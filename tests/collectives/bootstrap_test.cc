// Reading the launchers' environments and the join check.
#include "collectives/bootstrap.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "runtime/logging.h"
#include "tests/common/rank_threads.h"
#include "tests/common/scoped_env.h"

namespace shardline {
namespace {

using ::shardline::testing::RunRankThreads;
using ::shardline::testing::ScopedEnv;

// Every variable any launcher sets, unset, so each test starts from a clean environment.
#define CLEAN_LAUNCH_ENV                                                                   \
  ScopedEnv clean {                                                                        \
    {"RANK", nullptr}, {"WORLD_SIZE", nullptr}, {"LOCAL_RANK", nullptr},                   \
        {"LOCAL_WORLD_SIZE", nullptr}, {"MASTER_ADDR", nullptr}, {"MASTER_PORT", nullptr}, \
        {"OMPI_COMM_WORLD_RANK", nullptr}, {"OMPI_COMM_WORLD_SIZE", nullptr},              \
        {"OMPI_COMM_WORLD_LOCAL_RANK", nullptr}, {"OMPI_COMM_WORLD_LOCAL_SIZE", nullptr},  \
        {"SLURM_PROCID", nullptr}, {"SLURM_NTASKS", nullptr}, {"SLURM_LOCALID", nullptr},  \
        {"SLURM_NTASKS_PER_NODE", nullptr}, {"SLURM_TASKS_PER_NODE", nullptr},             \
        {"SLURM_NODEID", nullptr}, {"SLURM_LAUNCH_NODE_IPADDR", nullptr},                  \
        {"SLURM_JOB_ID", nullptr}, {"OMPI_MCA_ess_base_jobid", nullptr},                   \
  }

TEST(LaunchEnvironmentTest, NoneIsNotFound) {
  CLEAN_LAUNCH_ENV;
  EXPECT_EQ(ReadLaunchEnvironment().status().code(), absl::StatusCode::kNotFound);
}

TEST(LaunchEnvironmentTest, Torchrun) {
  CLEAN_LAUNCH_ENV;
  ScopedEnv env{{"RANK", "5"},
                {"WORLD_SIZE", "8"},
                {"LOCAL_RANK", "1"},
                {"LOCAL_WORLD_SIZE", "4"},
                {"MASTER_ADDR", "node0"},
                {"MASTER_PORT", "29501"}};
  absl::StatusOr<LaunchInfo> info = ReadLaunchEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->launcher, "torchrun");
  EXPECT_EQ(info->rank, 5);
  EXPECT_EQ(info->world_size, 8);
  EXPECT_EQ(info->local_rank, 1);
  EXPECT_EQ(info->local_world_size, 4);
  EXPECT_EQ(info->master_addr, "node0");
  EXPECT_EQ(info->master_port, 29501);
}

TEST(LaunchEnvironmentTest, TorchrunErrorsNameTheVariable) {
  CLEAN_LAUNCH_ENV;
  {
    ScopedEnv env{{"RANK", "x"}, {"WORLD_SIZE", "2"}};
    absl::Status status = ReadLaunchEnvironment().status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(status.message(), "RANK='x'")) << status;
  }
  {
    ScopedEnv env{{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}};
    absl::Status status = ReadLaunchEnvironment().status();
    EXPECT_TRUE(absl::StrContains(status.message(), "not below the world size 2")) << status;
  }
  {
    ScopedEnv env{{"RANK", "0"}, {"WORLD_SIZE", "2"}};
    absl::Status status = ReadLaunchEnvironment().status();
    EXPECT_TRUE(absl::StrContains(status.message(), "MASTER_ADDR")) << status;
  }
  {
    ScopedEnv env{
        {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}};
    absl::Status status = ReadLaunchEnvironment().status();
    EXPECT_TRUE(absl::StrContains(status.message(), "MASTER_PORT='70000'")) << status;
  }
}

TEST(LaunchEnvironmentTest, MasterAddrWithAPortIsRefusedNamingIt) {
  CLEAN_LAUNCH_ENV;
  for (const char* addr : {"node0:29500", "10.0.0.1:29500", "[::1]:29500", "tcp://node0"}) {
    ScopedEnv env{
        {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", addr}, {"MASTER_PORT", "29500"}};
    absl::Status status = ReadLaunchEnvironment().status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), absl::StrCat("MASTER_ADDR='", addr, "'")))
        << status;
  }
  // IPv6 literals are plain addresses.
  ScopedEnv env{
      {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "fe80::1"}, {"MASTER_PORT", "1"}};
  EXPECT_TRUE(ReadLaunchEnvironment().ok());
}

TEST(LaunchEnvironmentTest, SingleProcessNeedsNoStoreAddress) {
  CLEAN_LAUNCH_ENV;
  ScopedEnv env{{"RANK", "0"}, {"WORLD_SIZE", "1"}};
  absl::StatusOr<LaunchInfo> info = ReadLaunchEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->master_addr, "127.0.0.1");
  EXPECT_EQ(info->master_port, 0);
}

TEST(LaunchEnvironmentTest, OpenMpi) {
  CLEAN_LAUNCH_ENV;
  ScopedEnv env{{"OMPI_COMM_WORLD_RANK", "3"},       {"OMPI_COMM_WORLD_SIZE", "4"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                {"MASTER_ADDR", "10.0.0.1"},         {"MASTER_PORT", "29400"}};
  absl::StatusOr<LaunchInfo> info = ReadLaunchEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->launcher, "openmpi");
  EXPECT_EQ(info->rank, 3);
  EXPECT_EQ(info->local_world_size, 2);
  EXPECT_EQ(info->master_addr, "10.0.0.1");
}

TEST(LaunchEnvironmentTest, OpenMpiWithoutStoreAddressSaysHow) {
  CLEAN_LAUNCH_ENV;
  ScopedEnv env{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}};
  absl::Status status = ReadLaunchEnvironment().status();
  EXPECT_TRUE(absl::StrContains(status.message(), "mpirun -x")) << status;
}

TEST(LaunchEnvironmentTest, OpenMpiOnOneHostDerivesLoopbackAndPortFromJobId) {
  CLEAN_LAUNCH_ENV;
  ScopedEnv env{{"OMPI_COMM_WORLD_RANK", "1"},
                {"OMPI_COMM_WORLD_SIZE", "3"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"},
                {"OMPI_MCA_ess_base_jobid", "1186660353"}};
  absl::StatusOr<LaunchInfo> info = ReadLaunchEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->master_addr, "127.0.0.1");
  EXPECT_EQ(info->master_port, 20000 + 1186660353 % 20000);
  EXPECT_EQ(std::getenv("MASTER_ADDR"), nullptr);
  // MASTER_ADDR/MASTER_PORT still win.
  ScopedEnv given{{"MASTER_ADDR", "10.0.0.9"}, {"MASTER_PORT", "29600"}};
  info = ReadLaunchEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->master_addr, "10.0.0.9");
  EXPECT_EQ(info->master_port, 29600);
}

TEST(LaunchEnvironmentTest, OpenMpiAcrossHostsStillNeedsTheStoreAddress) {
  CLEAN_LAUNCH_ENV;
  ScopedEnv env{{"OMPI_COMM_WORLD_RANK", "0"},
                {"OMPI_COMM_WORLD_SIZE", "4"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                {"OMPI_MCA_ess_base_jobid", "1186660353"}};
  absl::Status status = ReadLaunchEnvironment().status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "ranks on several hosts")) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "set MASTER_ADDR and MASTER_PORT")) << status;
}

TEST(LaunchEnvironmentTest, OpenMpiWithABadJobIdNamesIt) {
  CLEAN_LAUNCH_ENV;
  ScopedEnv env{{"OMPI_COMM_WORLD_RANK", "0"},
                {"OMPI_COMM_WORLD_SIZE", "2"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                {"OMPI_MCA_ess_base_jobid", "12x"}};
  absl::Status status = ReadLaunchEnvironment().status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "OMPI_MCA_ess_base_jobid='12x'")) << status;
}

TEST(LaunchEnvironmentTest, SlurmWithTaskListAndDerivedPort) {
  CLEAN_LAUNCH_ENV;
  ScopedEnv env{{"SLURM_PROCID", "9"},
                {"SLURM_NTASKS", "11"},
                {"SLURM_LOCALID", "1"},
                {"SLURM_NODEID", "2"},
                {"SLURM_TASKS_PER_NODE", "4(x2),3"},
                {"SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"},
                {"SLURM_JOB_ID", "123456"}};
  absl::StatusOr<LaunchInfo> info = ReadLaunchEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->launcher, "slurm");
  EXPECT_EQ(info->rank, 9);
  EXPECT_EQ(info->world_size, 11);
  EXPECT_EQ(info->local_world_size, 3);  // node 2 has 3 tasks
  EXPECT_EQ(info->master_addr, "10.1.2.3");
  EXPECT_EQ(info->master_port, 20000 + 123456 % 20000);
  // Derived, not written into the environment (setenv would race other threads' getenv).
  EXPECT_EQ(std::getenv("MASTER_ADDR"), nullptr);
  EXPECT_EQ(std::getenv("MASTER_PORT"), nullptr);
}

TEST(LaunchEnvironmentTest, SlurmPrefersMasterAddrAndPort) {
  CLEAN_LAUNCH_ENV;
  ScopedEnv env{{"SLURM_PROCID", "0"},
                {"SLURM_NTASKS", "2"},
                {"SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"},
                {"SLURM_JOB_ID", "not a number, and unused"},
                {"MASTER_ADDR", "node7"},
                {"MASTER_PORT", "29511"}};
  absl::StatusOr<LaunchInfo> info = ReadLaunchEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->master_addr, "node7");
  EXPECT_EQ(info->master_port, 29511);
}

TEST(LaunchEnvironmentTest, SlurmMalformedTaskList) {
  CLEAN_LAUNCH_ENV;
  ScopedEnv env{{"SLURM_PROCID", "0"},
                {"SLURM_NTASKS", "2"},
                {"SLURM_TASKS_PER_NODE", "2(x"},
                {"MASTER_ADDR", "h"},
                {"MASTER_PORT", "5"}};
  absl::Status status = ReadLaunchEnvironment().status();
  EXPECT_TRUE(absl::StrContains(status.message(), "SLURM_TASKS_PER_NODE")) << status;
}

// A port that was free a moment ago (the store binds it right after; tests only).
int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// The options of `rank` joining a world of `world_size` whose ranks all run on this host, with the
// store of rank 0 at `port`.
InitOptions JoinOptions(int rank, int world_size, int port, absl::Duration timeout) {
  InitOptions options;
  options.device = Device::Host();
  options.timeout = timeout;
  LaunchInfo info;
  info.rank = rank;
  info.world_size = world_size;
  info.local_rank = rank;
  info.local_world_size = world_size;
  info.master_port = port;
  options.launch = info;
  return options;
}

// Joins `n` ranks as threads; `backend_of(rank)` picks each rank's backend.
std::vector<absl::Status> JoinAsThreads(int n, const std::function<std::string(int)>& backend_of,
                                        absl::Duration timeout) {
  const int port = FreePort();
  return RunRankThreads(n, [&](int r) {
    InitOptions options = JoinOptions(r, n, port, timeout);
    options.backend = backend_of(r);
    return InitProcessGroup(options).status();
  });
}

TEST(InitProcessGroupTest, MismatchedJoinFailsOnEveryRankNamingTheField) {
  std::vector<absl::Status> results = JoinAsThreads(
      3, [](int r) { return r == 2 ? "nccl" : "ucx"; }, absl::Seconds(20));
  for (const absl::Status& status : results) {
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_TRUE(
        absl::StrContains(status.message(), "rank 2 has backend=nccl but rank 0 has backend=ucx"))
        << status;
  }
}

TEST(InitProcessGroupTest, MissingRankTimesOutNamingIt) {
  const absl::Time start = absl::Now();
  // World of 3, but only ranks 0 and 1 start.
  const int port = FreePort();
  std::vector<absl::Status> results = RunRankThreads(2, [&](int r) {
    return InitProcessGroup(JoinOptions(r, 3, port, absl::Seconds(1))).status();
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  // Rank 0 hosts the store and names the missing rank. Rank 1 does too unless rank 0 gave up
  // first and took the store with it, which rank 1 then reports as the store being gone.
  EXPECT_EQ(results[0].code(), absl::StatusCode::kDeadlineExceeded) << results[0];
  EXPECT_TRUE(absl::StrContains(results[0].message(), "waiting for rank(s) 2")) << results[0];
  if (results[1].code() == absl::StatusCode::kDeadlineExceeded) {
    EXPECT_TRUE(absl::StrContains(results[1].message(), "waiting for rank(s) 2")) << results[1];
  } else {
    EXPECT_EQ(results[1].code(), absl::StatusCode::kUnavailable) << results[1];
  }
}

// Joins one thread per entry of `ranks` (a rank may repeat) into a world of `world_size`.
std::vector<absl::Status> JoinRanks(const std::vector<int>& ranks, int world_size,
                                    absl::Duration timeout) {
  const int port = FreePort();
  return RunRankThreads(static_cast<int>(ranks.size()), [&](int i) {
    InitOptions options = JoinOptions(ranks[i], world_size, port, timeout);
    options.launch->launcher = "torchrun";
    return InitProcessGroup(options).status();
  });
}

TEST(InitProcessGroupTest, DuplicateRankIsNamedOnEveryRankAtOnce) {
  // Ranks 0, 1, 1 of a world of 3: rank 2 never comes, the second rank 1 is the cause. Rank 0 is
  // the duplicate in the second case (it finds the port taken by the first one's store).
  for (const std::vector<int>& ranks : {std::vector<int>{0, 1, 1}, std::vector<int>{0, 1, 0}}) {
    const int duplicate = ranks.back();
    const absl::Time start = absl::Now();
    std::vector<absl::Status> results = JoinRanks(ranks, 3, absl::Seconds(30));
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // not at the deadline
    for (const absl::Status& status : results) {
      EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
      EXPECT_TRUE(absl::StrContains(
          status.message(), absl::StrCat("rank ", duplicate, " was given to two processes")))
          << status;
      EXPECT_TRUE(absl::StrContains(status.message(), "RANK")) << status;
    }
  }
}

// Whether a TCP connection to `ip`:`port` is accepted.
bool Connects(const char* ip, int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, ip, &addr.sin_addr);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

TEST(InitProcessGroupTest, StoreListensOnTheAddressOfMasterAddrAndSaysSoWhenItIsLoopback) {
  const std::string log_path =
      absl::StrCat(::testing::TempDir(), "/bootstrap_test_log_", getpid(), ".txt");
  std::remove(log_path.c_str());
  const int port = FreePort();
  std::vector<absl::StatusOr<ProcessGroup>> groups(2, absl::UnknownError("not run"));
  {
    ScopedEnv log("SHARDLINE_DEBUG_FILE", log_path.c_str());
    ReinitLoggingForTesting();
    RunRankThreads(2, [&](int r) {
      InitOptions options = JoinOptions(r, 2, port, absl::Seconds(20));
      options.launch->local_rank = 0;  // as if each rank ran on a host of its own
      options.launch->local_world_size = 1;
      options.launch->master_addr = "localhost";
      groups[r] = InitProcessGroup(options);
    });
  }
  ReinitLoggingForTesting();
  for (const auto& group : groups) ASSERT_TRUE(group.ok()) << group.status();
  // Bound to the loopback address "localhost" names, not to every interface: another loopback
  // address of this host does not reach it.
  EXPECT_TRUE(Connects("127.0.0.1", port));
  EXPECT_FALSE(Connects("127.0.0.2", port));
  std::ifstream file(log_path);
  std::stringstream text;
  text << file.rdbuf();
  EXPECT_TRUE(absl::StrContains(
      text.str(), absl::StrCat("the store listens on 127.0.0.1:", port,
                               " only: localhost resolves to a loopback address on this host")))
      << text.str();
  std::remove(log_path.c_str());
}

TEST(CreateCommunicatorTest, RejectsBadArguments) {
  CommunicatorOptions options;
  options.rank = 2;
  options.size = 2;
  EXPECT_EQ(CreateCommunicator(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.rank = 0;
  EXPECT_TRUE(absl::StrContains(CreateCommunicator(options).status().message(), "store"));
}

}  // namespace
}  // namespace shardline
