// File: collectives/bootstrap.h
// -----------------------------------------------------------------------------
// Joining a job: where this process sits (rank, world size, ranks per host), where the
// rendezvous store is, and the world communicator of the chosen backend.
//
// Processes are started by the launchers people already use, and shardline reads their
// environments, in this order of precedence:
//   torchrun / shardline-launch  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//                                MASTER_ADDR, MASTER_PORT
//   Open MPI (mpirun)            OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//   Slurm (srun)                 SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
//                                SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE
// Under Open MPI and Slurm the store address still comes from MASTER_ADDR / MASTER_PORT when set;
// otherwise Slurm's SLURM_LAUNCH_NODE_IPADDR and a port derived from SLURM_JOB_ID, and for Open
// MPI an error saying to set MASTER_ADDR and MASTER_PORT.
//
// At join every rank publishes a fingerprint (library version, world size, backend, device kind,
// timeout) in the store and checks everyone else's: any mismatch is an error on every rank
// naming the differing field, the two ranks and their values, e.g.
//   "join of world: rank 3 has backend=local but rank 0 has backend=ucx"
// so a job launched with inconsistent settings fails at once instead of hanging in its first
// collective.
//
// This is the one assembler of the collectives layer: bootstrap.cc is the only file outside the
// backends' folders that names their factories (CreateUcxCommunicator, CreateNcclCommunicator)
// and picks one by name (CreateCommunicator, InitOptions::backend), so a new multi-process
// backend is added here. The backends do not include one another, and no other file of the
// library includes a backend's communicator header. The in-process backends are not joined
// through a launcher: their callers make them directly (CreateLocalCommunicators for ranks as
// threads, CreateSimCommunicators for virtual time: tests, benchmarks, the tuner, bindings).

#ifndef SHARDLINE_COLLECTIVES_BOOTSTRAP_H_
#define SHARDLINE_COLLECTIVES_BOOTSTRAP_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/store/store.h"
#include "runtime/device.h"

namespace shardline {

struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // "torchrun", "openmpi", "slurm" or "explicit".
  std::string launcher = "explicit";
};

// Reads the launcher environment (see the file comment). NotFound if no launcher's variables
// are set; InvalidArgument naming the variable if one is malformed (not a number, out of range,
// rank >= world size, ...).
absl::StatusOr<LaunchInfo> ReadLaunchEnvironment();

struct InitOptions {
  // "ucx" (host memory, multi-process; the default) or "nccl" (CUDA memory; CUDA builds).
  std::string backend = "ucx";
  // Explicit values; unset: ReadLaunchEnvironment().
  std::optional<LaunchInfo> launch;
  // The device whose memory the world communicator moves (cuda:LOCAL_RANK for nccl if unset).
  std::optional<Device> device;
  // Bound on every wait of the communicator; unset (zero): SHARDLINE_TIMEOUT_S.
  absl::Duration timeout = absl::ZeroDuration();
  std::string name = "world";
};

// A joined process: the store every rank shares and the world communicator.
struct ProcessGroup {
  LaunchInfo launch;
  std::shared_ptr<Store> store;
  std::shared_ptr<Communicator> world;
};

// Connects to (rank 0: hosts) the TCP store at MASTER_ADDR:MASTER_PORT, checks the join
// fingerprints, and creates the world communicator. Blocks until every rank has joined or the
// timeout passes (DeadlineExceeded naming the ranks that did not join). Two processes with the
// same rank fail at once (FailedPrecondition naming the rank and both processes), and so do the
// ranks waiting for the rank nobody holds. Rank 0's store listens on the address MASTER_ADDR
// names (SHARDLINE_STORE_LISTEN_ADDR overrides it), with a WARN if that is a loopback address
// while ranks run on other hosts. With
// SHARDLINE_AGENT_STORE=1 the store is hosted outside the ranks (by the launcher, for elastic
// jobs) and rank 0 connects to it like every other rank.
absl::StatusOr<ProcessGroup> InitProcessGroup(const InitOptions& options = {});

// Creates this rank's communicator of `backend` over `store` (which all `size` ranks share and
// which the backend uses under the prefix `name`). Used by InitProcessGroup and by tests that
// bring their own store.
struct CommunicatorOptions {
  std::string backend = "ucx";
  int rank = 0;
  int size = 1;
  std::shared_ptr<Store> store;
  Device device = Device::Host();
  std::string name = "world";
  absl::Duration timeout = absl::ZeroDuration();
};
absl::StatusOr<std::shared_ptr<Communicator>> CreateCommunicator(
    const CommunicatorOptions& options);

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_BOOTSTRAP_H_
