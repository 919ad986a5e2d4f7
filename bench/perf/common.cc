// The entry point of the *_perf binaries (bench/perf/common.h): parse the flags, then run the
// ranks as threads of this process (--backend local) or join the job as one rank.

#include "bench/perf/common.h"

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "bench/perf/flags.h"
#include "bench/perf/runner.h"
#include "collectives/bootstrap.h"
#include "collectives/local/local_communicator.h"

namespace shardline::perf {
namespace {

int RunThreads(const CollectiveSpec& spec, const Options& o) {
  if (const char* world = std::getenv("WORLD_SIZE"); world != nullptr && std::atoi(world) > 1) {
    std::fprintf(stderr,
                 "%s: the local backend runs ranks as threads of one process; start one process "
                 "with -t N instead of %s processes\n",
                 spec.binary, world);
    return 2;
  }
  LocalOptions local;
  local.timeout = absl::Seconds(o.timeout_s);
  absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> comms =
      CreateLocalCommunicators(o.threads, local);
  if (!comms.ok()) {
    std::fprintf(stderr, "%s: %s\n", spec.binary, comms.status().ToString().c_str());
    return 1;
  }
  std::vector<int> codes(o.threads, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < o.threads; ++r) {
    threads.emplace_back([&, r] { codes[r] = RunRank(spec, o, *(*comms)[r], 1); });
  }
  for (std::thread& t : threads) t.join();
  return *std::max_element(codes.begin(), codes.end());
}

int RunProcess(const CollectiveSpec& spec, const Options& o) {
  InitOptions init;
  init.backend = o.backend;
  init.timeout = absl::Seconds(o.timeout_s);
  absl::StatusOr<LaunchInfo> launch = ReadLaunchEnvironment();
  if (!launch.ok() && absl::IsNotFound(launch.status())) {
    // Started without a launcher: a world of one, as nccl-tests runs without MPI.
    LaunchInfo alone;
    alone.master_port = 0;
    init.launch = alone;
  } else if (!launch.ok()) {
    std::fprintf(stderr, "%s: %s\n", spec.binary, launch.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<ProcessGroup> group = InitProcessGroup(init);
  if (!group.ok()) {
    std::fprintf(stderr, "%s: %s\n", spec.binary, group.status().ToString().c_str());
    return 1;
  }
  const int code = RunRank(spec, o, *group->world, group->launch.world_size);
  return code;
}

}  // namespace

int PerfMain(const CollectiveSpec& spec, int argc, char** argv) {
  setlinebuf(stdout);
  absl::StatusOr<ParseResult> parsed = ParseFlags(spec, argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s: %s\n", spec.binary, std::string(parsed.status().message()).c_str());
    PrintUsage(spec.binary, stderr);
    return 2;
  }
  if (parsed->help) {
    PrintUsage(spec.binary, stdout);
    return 0;
  }
  const Options& o = parsed->options;
  if (o.backend == "local") return RunThreads(spec, o);
  return RunProcess(spec, o);
}

}  // namespace shardline::perf
