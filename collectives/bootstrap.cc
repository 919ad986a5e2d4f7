#include "collectives/bootstrap.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "collectives/store/internal/tcp_util.h"
#include "collectives/store/tcp_store.h"
#include "collectives/ucx/ucx_communicator.h"
#ifdef SHARDLINE_WITH_CUDA
#include "collectives/nccl/nccl_communicator.h"
#include "collectives/staged/staged_communicator.h"
#endif
#include "runtime/config.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace shardline {
namespace {

constexpr absl::string_view kVersion = "0.1.0";
// The join record of a rank that never registered, written by a process that found its rank
// taken, so that everyone's Wait for the records ends at once. No real record starts with it.
constexpr char kAbandonedRecord = '\x01';
// How long a duplicate waits for the first holder of its rank to say who it is.
constexpr absl::Duration kOwnerWait = absl::Seconds(2);
// After a duplicate rank ended the join, how long rank 0 keeps the store up for ranks that had
// not arrived yet to read why.
constexpr absl::Duration kLateRankGrace = absl::Seconds(2);

SL_PARAM(std::string, StoreListenAddr, "STORE_LISTEN_ADDR", "",
         "Address rank 0's store listens on. Empty: the address MASTER_ADDR names (so the store "
         "is reachable where the job was told it is, and nowhere else); 0.0.0.0 or :: listens on "
         "every interface (behind NAT, say).");

SL_PARAM(bool, AgentStore, "AGENT_STORE", false,
         "The store at MASTER_ADDR:MASTER_PORT is hosted outside the training ranks (by the "
         "launcher: shardline-launch --max-restarts sets it), so rank 0 connects to it instead "
         "of hosting one.");

// Where each launcher puts the rank.
std::string RankVariable(absl::string_view launcher) {
  if (launcher == "torchrun") return "RANK";
  if (launcher == "openmpi") return "OMPI_COMM_WORLD_RANK";
  if (launcher == "slurm") return "SLURM_PROCID";
  return "the rank given to InitProcessGroup";
}

std::string Hostname() {
  char name[HOST_NAME_MAX + 1] = {};
  if (gethostname(name, sizeof(name)) != 0) return "unknown host";
  return name;
}

std::optional<std::string> Env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

// An integer variable in [min, max]; `fallback` if unset; InvalidArgument naming it otherwise.
absl::StatusOr<int> IntEnv(const char* name, int min, int max, std::optional<int> fallback) {
  std::optional<std::string> text = Env(name);
  if (!text.has_value()) {
    if (fallback.has_value()) return *fallback;
    return absl::InvalidArgumentError(absl::StrCat("environment variable ", name, " is not set"));
  }
  int value = 0;
  if (!absl::SimpleAtoi(*text, &value) || value < min || value > max) {
    return absl::InvalidArgumentError(absl::StrCat("environment variable ", name, "='", *text,
                                                   "' is not an integer in [", min, ", ", max,
                                                   "]"));
  }
  return value;
}

// A non-negative 64-bit integer; InvalidArgument naming the variable otherwise.
absl::StatusOr<int64_t> Int64Env(const char* name) {
  const std::string text = Env(name).value_or("");
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", name, "='", text, "' is not a non-negative integer"));
  }
  return value;
}

// SLURM_TASKS_PER_NODE is a list like "4(x2),3": tasks on node 0, 1 and 2.
absl::StatusOr<int> SlurmTasksOnNode(absl::string_view list, int node) {
  int index = 0;
  for (absl::string_view item : absl::StrSplit(list, ',')) {
    int tasks = 0, repeat = 1;
    std::vector<absl::string_view> parts = absl::StrSplit(item, "(x");
    bool ok = absl::SimpleAtoi(parts[0], &tasks);
    if (parts.size() == 2) {
      absl::string_view rep = parts[1];
      ok = ok && !rep.empty() && rep.back() == ')' &&
           absl::SimpleAtoi(rep.substr(0, rep.size() - 1), &repeat);
    }
    if (!ok || parts.size() > 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("environment variable SLURM_TASKS_PER_NODE='", list, "' is malformed"));
    }
    if (node < index + repeat) return tasks;
    index += repeat;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("SLURM_TASKS_PER_NODE='", list, "' has no entry for SLURM_NODEID=", node));
}

// MASTER_ADDR and MASTER_PORT, else the launcher's own `fallback_addr` / `fallback_port`.
absl::Status FillStoreAddress(LaunchInfo& info, absl::string_view hint,
                              std::optional<std::string> fallback_addr = std::nullopt,
                              std::optional<int> fallback_port = std::nullopt) {
  std::optional<std::string> addr = Env("MASTER_ADDR");
  if (addr.has_value()) {
    SL_RETURN_IF_ERROR(
        store_internal::CheckHostHasNoPort(*addr, "environment variable MASTER_ADDR"));
  }
  SL_ASSIGN_OR_RETURN(std::optional<int> port_or, ([]() -> absl::StatusOr<std::optional<int>> {
                        if (!Env("MASTER_PORT").has_value()) return std::optional<int>();
                        SL_ASSIGN_OR_RETURN(int port, IntEnv("MASTER_PORT", 1, 65535, {}));
                        return std::optional<int>(port);
                      }()));
  if (!addr.has_value()) addr = std::move(fallback_addr);
  if (!port_or.has_value()) port_or = fallback_port;
  if (addr.has_value()) info.master_addr = *addr;
  if (port_or.has_value()) info.master_port = *port_or;
  if (info.world_size == 1 && !addr.has_value()) {
    info.master_addr = "127.0.0.1";
    if (!port_or.has_value()) info.master_port = 0;  // alone: any free port will do
    return absl::OkStatus();
  }
  if (!addr.has_value() || !port_or.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        info.launcher, " launch of ", info.world_size, " ranks: ", hint.empty() ? "" : hint,
        "set MASTER_ADDR and MASTER_PORT to the address and a free port of rank 0's host"));
  }
  return absl::OkStatus();
}

absl::Status CheckRanks(const LaunchInfo& info, absl::string_view rank_var) {
  if (info.rank >= info.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(rank_var, "=", info.rank, " is not below the world size ", info.world_size));
  }
  if (info.local_rank >= info.local_world_size || info.local_world_size > info.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        info.launcher, " launch: local rank ", info.local_rank, " of ", info.local_world_size,
        " ranks per host does not fit a world of ", info.world_size));
  }
  return absl::OkStatus();
}

// One "key=value" line per field that every rank of a job must agree on.
std::vector<std::pair<std::string, std::string>> JoinFields(const LaunchInfo& info,
                                                            const std::string& backend,
                                                            Device device, absl::Duration timeout) {
  return {{"version", std::string(kVersion)},
          {"world_size", absl::StrCat(info.world_size)},
          {"backend", backend},
          {"device", device.is_host() ? "host" : "cuda"},
          {"timeout_s", absl::StrCat(absl::ToDoubleSeconds(timeout))}};
}

std::string EncodeFields(const std::vector<std::pair<std::string, std::string>>& fields) {
  return absl::StrJoin(fields, "\n", absl::PairFormatter("="));
}

std::string ThisProcess() { return absl::StrCat("pid ", getpid(), " on ", Hostname()); }

// The key under which the process hosting the store (the one rank 0) names itself.
std::string HostKey(const std::string& name) { return absl::StrCat(name, "/store_host"); }

// This process holds the same rank as `owner`: FailedPrecondition naming the rank and both
// processes, after making every other rank's join fail at once with the same message (their
// Wait for the records ends on the records of the ranks nobody will register).
absl::Status ReportDuplicateRank(Store& store, const std::string& name, const LaunchInfo& info,
                                 const std::string& owner) {
  const std::string message = absl::StrCat(
      "join of ", name, ": rank ", info.rank, " was given to two processes (", owner, " and ",
      ThisProcess(), "): check ", RankVariable(info.launcher), " of each process");
  (void)store.CompareSet(absl::StrCat(name, "/join_error"), "", message);
  for (int r = 0; r < info.world_size; ++r) {
    (void)store.CompareSet(absl::StrCat(name, "/join/", r), "", std::string(1, kAbandonedRecord));
  }
  return absl::FailedPreconditionError(message);
}

// Registers this process as the holder of its rank; a second process with the same rank (two
// RANK=3) gets ReportDuplicateRank's error. (Rank 0 is the process that hosts the store; a
// second rank 0 finds the port taken and is caught in InitProcessGroup.)
absl::Status ClaimRank(Store& store, const std::string& name, const LaunchInfo& info,
                       absl::Time deadline) {
  const std::string owner_key = absl::StrCat(name, "/owner/", info.rank);
  SL_ASSIGN_OR_RETURN(int64_t claims, store.Add(absl::StrCat(name, "/claim/", info.rank), 1));
  if (claims == 1) return store.Set(owner_key, ThisProcess());
  absl::StatusOr<std::string> owner =
      store.Get(owner_key, std::min(deadline, absl::Now() + kOwnerWait));
  return ReportDuplicateRank(store, name, info,
                             owner.ok() ? *owner : std::string("another process"));
}

// Publishes this rank's join fields and compares everyone's. `joined` receives the ranks that
// showed up (all of them unless the deadline passed), which rank 0 waits for before it takes the
// store away; `linger`, if CheckJoin sets it, bounds that wait.
absl::Status CheckJoin(Store& store, const std::string& name, const LaunchInfo& info,
                       const std::string& mine, absl::Time deadline, std::vector<int>* joined,
                       std::optional<absl::Time>* linger) {
  std::vector<std::string> keys;
  for (int r = 0; r < info.world_size; ++r) keys.push_back(absl::StrCat(name, "/join/", r));
  SL_RETURN_IF_ERROR(ClaimRank(store, name, info, deadline));
  SL_RETURN_IF_ERROR(store.Set(keys[info.rank], mine));
  absl::Status all_joined = store.Wait(keys, deadline);
  for (int r = 0; r < info.world_size; ++r) joined->push_back(r);
  if (absl::IsDeadlineExceeded(all_joined)) {
    joined->clear();
    std::vector<int> missing;
    for (int r = 0; r < info.world_size; ++r) {
      absl::StatusOr<bool> present = store.Check({keys[r]});
      if (present.ok() && !*present) {
        missing.push_back(r);
      } else {
        joined->push_back(r);
      }
    }
    return absl::DeadlineExceededError(
        absl::StrCat("join of ", name, " (rank ", info.rank, " of ", info.world_size,
                     "): timed out waiting for rank(s) ", absl::StrJoin(missing, ", ")));
  }
  SL_RETURN_IF_ERROR(all_joined);
  // A process that found its rank taken ended the wait: report what it found. Some ranks may
  // not have arrived (the records the duplicate wrote for them ended the wait): rank 0 keeps the
  // store up a little for them to read the error too, rather than until the deadline.
  const std::string error_key = absl::StrCat(name, "/join_error");
  SL_ASSIGN_OR_RETURN(bool failed, store.Check({error_key}));
  if (failed) {
    SL_ASSIGN_OR_RETURN(std::string message, store.Get(error_key, deadline));
    *linger = std::min(deadline, absl::Now() + kLateRankGrace);
    return absl::FailedPreconditionError(message);
  }
  // Every rank compares every rank with rank 0, so all report the same first difference.
  SL_ASSIGN_OR_RETURN(std::string reference, store.Get(keys[0], deadline));
  std::vector<std::string> ref_lines = absl::StrSplit(reference, '\n');
  for (int r = 1; r < info.world_size; ++r) {
    SL_ASSIGN_OR_RETURN(std::string theirs, store.Get(keys[r], deadline));
    std::vector<std::string> lines = absl::StrSplit(theirs, '\n');
    for (size_t i = 0; i < std::max(lines.size(), ref_lines.size()); ++i) {
      const std::string a = i < ref_lines.size() ? ref_lines[i] : "<missing>";
      const std::string b = i < lines.size() ? lines[i] : "<missing>";
      if (a != b) {
        return absl::FailedPreconditionError(
            absl::StrCat("join of ", name, ": rank ", r, " has ", b, " but rank 0 has ", a));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LaunchInfo> ReadLaunchEnvironment() {
  constexpr int kMaxRanks = 1 << 24;
  LaunchInfo info;
  if (Env("RANK").has_value() || Env("WORLD_SIZE").has_value()) {
    info.launcher = "torchrun";
    SL_ASSIGN_OR_RETURN(info.world_size, IntEnv("WORLD_SIZE", 1, kMaxRanks, {}));
    SL_ASSIGN_OR_RETURN(info.rank, IntEnv("RANK", 0, kMaxRanks, {}));
    SL_ASSIGN_OR_RETURN(info.local_rank, IntEnv("LOCAL_RANK", 0, kMaxRanks, info.rank));
    SL_ASSIGN_OR_RETURN(info.local_world_size,
                        IntEnv("LOCAL_WORLD_SIZE", 1, kMaxRanks, info.world_size));
    SL_RETURN_IF_ERROR(CheckRanks(info, "RANK"));
    SL_RETURN_IF_ERROR(FillStoreAddress(info, ""));
    return info;
  }
  if (Env("OMPI_COMM_WORLD_RANK").has_value()) {
    info.launcher = "openmpi";
    SL_ASSIGN_OR_RETURN(info.world_size, IntEnv("OMPI_COMM_WORLD_SIZE", 1, kMaxRanks, {}));
    SL_ASSIGN_OR_RETURN(info.rank, IntEnv("OMPI_COMM_WORLD_RANK", 0, kMaxRanks, {}));
    SL_ASSIGN_OR_RETURN(info.local_rank,
                        IntEnv("OMPI_COMM_WORLD_LOCAL_RANK", 0, kMaxRanks, info.rank));
    SL_ASSIGN_OR_RETURN(info.local_world_size,
                        IntEnv("OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMaxRanks, info.world_size));
    SL_RETURN_IF_ERROR(CheckRanks(info, "OMPI_COMM_WORLD_RANK"));
    // All ranks on this host (mpirun says so through OMPI_COMM_WORLD_LOCAL_SIZE): the store can
    // live on the loopback, at a port that follows Open MPI's job id (OMPI_MCA_ess_base_jobid,
    // distinct for concurrent mpiruns), as the Slurm path derives one from SLURM_JOB_ID. Across
    // hosts nothing names rank 0's host to the others: MASTER_ADDR stays required.
    std::optional<std::string> one_host_addr;
    std::optional<int> job_port;
    const bool one_host =
        Env("OMPI_COMM_WORLD_LOCAL_SIZE").has_value() && info.local_world_size == info.world_size;
    if (one_host && Env("OMPI_MCA_ess_base_jobid").has_value()) {
      SL_ASSIGN_OR_RETURN(int64_t job, Int64Env("OMPI_MCA_ess_base_jobid"));
      one_host_addr = "127.0.0.1";
      job_port = static_cast<int>(20000 + job % 20000);
    }
    SL_RETURN_IF_ERROR(FillStoreAddress(
        info,
        one_host ? "pass them with mpirun -x; "
                 : absl::StrCat(
                       "ranks on several hosts (OMPI_COMM_WORLD_LOCAL_SIZE=", info.local_world_size,
                       " of ", info.world_size, "): pass them with mpirun -x; "),
        one_host_addr, job_port));
    return info;
  }
  if (Env("SLURM_PROCID").has_value()) {
    info.launcher = "slurm";
    SL_ASSIGN_OR_RETURN(info.world_size, IntEnv("SLURM_NTASKS", 1, kMaxRanks, {}));
    SL_ASSIGN_OR_RETURN(info.rank, IntEnv("SLURM_PROCID", 0, kMaxRanks, {}));
    SL_ASSIGN_OR_RETURN(info.local_rank, IntEnv("SLURM_LOCALID", 0, kMaxRanks, 0));
    if (Env("SLURM_NTASKS_PER_NODE").has_value()) {
      SL_ASSIGN_OR_RETURN(info.local_world_size, IntEnv("SLURM_NTASKS_PER_NODE", 1, kMaxRanks, {}));
    } else if (std::optional<std::string> per_node = Env("SLURM_TASKS_PER_NODE")) {
      SL_ASSIGN_OR_RETURN(int node, IntEnv("SLURM_NODEID", 0, kMaxRanks, 0));
      SL_ASSIGN_OR_RETURN(info.local_world_size, SlurmTasksOnNode(*per_node, node));
    } else {
      info.local_world_size = 1;
    }
    SL_RETURN_IF_ERROR(CheckRanks(info, "SLURM_PROCID"));
    // Slurm names the launch node; the port follows the job id so concurrent jobs differ. Both
    // stay in `info`: writing them into the environment would race other threads' getenv.
    std::optional<int> job_port;
    if (!Env("MASTER_PORT").has_value()) {
      SL_ASSIGN_OR_RETURN(int job, IntEnv("SLURM_JOB_ID", 0, 1 << 30, 0));
      job_port = 20000 + job % 20000;
    }
    SL_RETURN_IF_ERROR(FillStoreAddress(info, "", Env("SLURM_LAUNCH_NODE_IPADDR"), job_port));
    return info;
  }
  return absl::NotFoundError(
      "no launcher environment found: start the processes with shardline-launch, torchrun, "
      "mpirun or srun, or pass the rank, world size and store address explicitly");
}

absl::StatusOr<std::shared_ptr<Communicator>> CreateCommunicator(
    const CommunicatorOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", options.rank, " is not in a world of ", options.size));
  }
  if (options.store == nullptr) {
    return absl::InvalidArgumentError("CreateCommunicator needs a store");
  }
  if (options.backend == "ucx") {
#ifndef SHARDLINE_WITH_CUDA
    if (!options.device.is_host()) {
      return absl::UnimplementedError(
          absl::StrCat("the ucx backend moves ", options.device.ToString(),
                       " memory staged through host memory, but shardline was built without CUDA"));
    }
#endif
    absl::StatusOr<std::shared_ptr<Communicator>> host =
        CreateUcxCommunicator({.rank = options.rank,
                               .size = options.size,
                               .store = options.store,
                               .name = options.name,
                               .timeout = options.timeout});
#ifdef SHARDLINE_WITH_CUDA
    // CUDA memory over ucx: staged through pinned host memory (ranks that share a GPU).
    if (host.ok() && options.device.is_cuda()) {
      return CreateStagedCommunicator(*std::move(host), options.device.index());
    }
#endif
    return host;
  }
  if (options.backend == "nccl") {
#ifdef SHARDLINE_WITH_CUDA
    if (!options.device.is_cuda()) {
      return absl::InvalidArgumentError(absl::StrCat("the nccl backend moves CUDA memory; device ",
                                                     options.device.ToString(),
                                                     " needs the ucx backend"));
    }
    return CreateNcclCommunicator({.rank = options.rank,
                                   .size = options.size,
                                   .store = options.store,
                                   .device = options.device.index(),
                                   .name = options.name,
                                   .timeout = options.timeout});
#else
    return absl::UnimplementedError(
        "shardline was built without CUDA: the nccl backend is not available");
#endif
  }
  if (options.backend == "local") {
    return absl::InvalidArgumentError(
        "the local backend joins threads of one process: use CreateLocalCommunicators");
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend '", options.backend, "' (expected ucx or nccl)"));
}

absl::StatusOr<ProcessGroup> InitProcessGroup(const InitOptions& options) {
  SL_RETURN_IF_ERROR(ValidateAllParams());
  ProcessGroup group;
  if (options.launch.has_value()) {
    group.launch = *options.launch;
  } else {
    SL_ASSIGN_OR_RETURN(group.launch, ReadLaunchEnvironment());
  }
  const LaunchInfo& info = group.launch;
  SL_RETURN_IF_ERROR(CheckRanks(info, "rank"));
  absl::Duration timeout = options.timeout;
  if (timeout == absl::ZeroDuration()) {
    SL_ASSIGN_OR_RETURN(timeout, DefaultTimeout());
  }
  const absl::Time deadline = absl::Now() + timeout;
  SetLogRank(info.rank);

  TcpStoreOptions store_options;
  store_options.host = info.master_addr;
  store_options.port = info.master_port;
  store_options.rank = info.rank;
  store_options.timeout = timeout;
  SL_ASSIGN_OR_RETURN(std::string listen_addr, ParamStoreListenAddr().Get());
  store_options.listen_host = listen_addr;  // empty: MASTER_ADDR
  SL_ASSIGN_OR_RETURN(const bool agent_store, ParamAgentStore().Get());
  absl::StatusOr<std::unique_ptr<TcpStore>> store =
      TcpStore::Create(store_options, /*is_server=*/info.rank == 0 && !agent_store, deadline);
  if (info.rank == 0 && !agent_store && absl::IsFailedPrecondition(store.status())) {
    // The port is taken. If by this job's store (its host named itself there), another process
    // got rank 0 as well: say that rather than blame the port.
    absl::StatusOr<std::unique_ptr<TcpStore>> other =
        TcpStore::Create(store_options, /*is_server=*/false, absl::Now() + kOwnerWait);
    if (other.ok()) {
      absl::StatusOr<std::string> owner =
          (*other)->Get(HostKey(options.name), absl::Now() + kOwnerWait);
      if (owner.ok()) return ReportDuplicateRank(**other, options.name, info, *owner);
    }
    return store.status();
  }
  SL_RETURN_IF_ERROR(store.status());
  if (info.rank == 0) SL_RETURN_IF_ERROR((*store)->Set(HostKey(options.name), ThisProcess()));
  if (const TcpStoreServer* server = (*store)->server(); server != nullptr) {
    const std::string& bound = server->bound_address();
    const std::string& listen = listen_addr.empty() ? store_options.host : listen_addr;
    if (store_internal::IsLoopbackAddress(bound) && info.local_world_size < info.world_size) {
      SL_LOG(WARN, INIT) << "the store listens on "
                         << store_internal::HostPort(bound, server->port()) << " only: " << listen
                         << " resolves to a loopback address on this host"
                         << ", which ranks on other hosts cannot reach (" << info.local_world_size
                         << " of " << info.world_size
                         << " ranks run here); set MASTER_ADDR to this host's network address, or "
                            "SHARDLINE_STORE_LISTEN_ADDR=0.0.0.0 to listen on every interface";
    } else {
      SL_LOG(INFO, INIT) << "the store listens on "
                         << store_internal::HostPort(bound, server->port()) << " (" << listen
                         << ")";
    }
  }
  group.store = *std::move(store);

  Device device = options.device.value_or(options.backend == "nccl" ? Device::Cuda(info.local_rank)
                                                                    : Device::Host());
  std::vector<int> joined;
  std::optional<absl::Time> linger;
  absl::Status join = CheckJoin(*group.store, options.name, info,
                                EncodeFields(JoinFields(info, options.backend, device, timeout)),
                                deadline, &joined, &linger);
  // Rank 0 hosts the store: it must not take it away while the others still read the join
  // records, whether the join succeeded or not. Each rank marks that it is done reading; rank 0
  // waits for the marks of everyone who joined (bounded: a few seconds past the deadline).
  const std::string done_prefix = absl::StrCat(options.name, "/join_done/");
  absl::Status marked = group.store->Set(absl::StrCat(done_prefix, info.rank), "");
  if (info.rank == 0 && marked.ok()) {
    std::vector<std::string> done_keys;
    for (int r : joined) done_keys.push_back(absl::StrCat(done_prefix, r));
    (void)group.store->Wait(done_keys,
                            linger.value_or(std::max(deadline, absl::Now()) + absl::Seconds(5)));
  }
  SL_RETURN_IF_ERROR(join);
  SL_LOG(INFO, INIT) << "rank " << info.rank << " of " << info.world_size << " joined "
                     << options.name << " (" << info.launcher << ", store " << info.master_addr
                     << ":" << info.master_port << ", backend " << options.backend << ")";
  CommunicatorOptions comm;
  comm.backend = options.backend;
  comm.rank = info.rank;
  comm.size = info.world_size;
  comm.store = group.store;
  comm.device = device;
  comm.name = options.name;
  comm.timeout = timeout;
  SL_ASSIGN_OR_RETURN(group.world, CreateCommunicator(comm));
  return group;
}

}  // namespace shardline
