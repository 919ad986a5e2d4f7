// File: scheduler/tune/failures.h
// -----------------------------------------------------------------------------
// The tuner's failure model: how often a job of n GPUs loses one, and what each loss costs under
// two recovery strategies, for a step time the simulator gives (scheduler/tune/simulate.h).
//
//   SL_ASSIGN_OR_RETURN(RecoveryScenario s,
//                       SimulatedScenario(model, *cluster, {.gpus = 1024, .shard_size = 8}));
//   s.checkpoint_every = {100, 1000};
//   SL_ASSIGN_OR_RETURN(RecoveryEstimate e, EstimateRecovery(s, RecoveryOptions{}));
//   e.failures_per_day; e.elastic.resume_s; e.checkpoint[0].restart_s; e.elastic.goodput;
//
// Failures. GPUs fail independently at a constant rate (Poisson): a GPU's mean time between
// failures (MTBF) comes from a published count of job interruptions on a known fleet
// (PublishedFailureRates: every figure cited with its source), and a job of n GPUs fails at
// lambda = n / MTBF_gpu (job MTBF = MTBF_gpu / n). Detection takes detect_s for a failure that
// ends a process (the store's liveness signal) and timeout_s for the hang_fraction that ends
// none (a collective's deadline), for both strategies.
//
// Checkpoint restart, a checkpoint every N steps (CheckpointRestartCost). The checkpoint is the
// training state, state_bytes (master weights and optimizer state, held once per replica).
//   write_s    = state_bytes / (storage per node x nodes)            (the ranks write in parallel)
//   blocked    = write_s per save (synchronous), or a snapshot of a rank's share, state_bytes / k
//                over its host link, plus any part of the write that does not fit in N steps
//                (asynchronous)
//   restart_s  = detect + relaunch_s + init_s + load_s, load_s = R x state_bytes / (storage per
//                node x nodes): every rank reads its own shard of the state, so all R replicas
//                read it
//   lost steps = N / 2 on average: the failure falls uniformly in the interval, so the steps
//                since the last save plus the part of the step in flight average N / 2
//   lost_s     = restart_s + (N / 2) x step_s                        (job seconds per failure)
//
// Elastic HSDP (collectives/elastic/elastic_group.h), R = gpus / k replica groups of k ranks:
//   the survivors abort the round in flight and redo that step: on average half a step of work
//   is lost. resume_s = detect + resume_base_s + quorum_s (n arrivals appended to the store's log,
//   each read by every rank); the step redone after it commits. Meanwhile the job runs at
//   (R - 1) / R until the replacement group has started (relaunch_s + init_s); the joining round
//   then rebuilds the communicators (resume_base_s) and stops everyone while each donor rank
//   sends its k-th of the state to its joiner, point to point over the rail, and the joiner checks
//   its CRC-32C: transfer_s = (state_bytes / k) / link + (state_bytes / k) / crc.
//   lost_s = resume_s + step_s / 2 + (relaunch_s + init_s) / R + resume_base_s + transfer_s.
//   Every step is a round of the protocol, all of it served by the store's one server. As built
//   (StoreReads::kTwoLevel), per phase (arrive, vote): every rank appends to its group's log (n),
//   each group's leader reads its group's entries (n), appends for the group to the job log (R)
//   and reads that log entry by entry (R^2), and hands the decision to its group (R appends,
//   n - R reads): 3n + R + R^2 operations, protocol_s = 2 (3n + R + R^2) / store_ops_per_s per
//   step, a lower bound (the retries of contending compare-and-sets and the catch-up checks are
//   not counted; the reads and appends are exactly ElasticGroup's,
//   tune_failures_protocol_test). Variants for comparison: kPerEntry, the first design (every
//   rank in the job log: n + n^2 per phase); kBatched, one read per rank per phase (2n); kLeaders,
//   leaders that read the job log once per phase and relay over their shard group (2R).
//
// Goodput (the useful fraction of wall time). With a steady fraction s of the time training
// (checkpoints, or the protocol, take the rest) and failures at lambda per second of wall time,
// each costing L seconds of the whole job: wall = useful / s + lambda x wall x L, so
//   goodput = s x (1 - lambda x L)          (0 when lambda x L >= 1: the job makes no progress).
// It ignores a failure during a recovery (counted as another failure costing L), correlated
// failures, and the spare nodes a replacement needs (both strategies need one).

#ifndef SHARDLINE_SCHEDULER_TUNE_FAILURES_H_
#define SHARDLINE_SCHEDULER_TUNE_FAILURES_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "scheduler/tune/model.h"
#include "scheduler/tune/simulate.h"

namespace shardline {

// A published failure count on a known fleet.
struct FailureSource {
  std::string name;      // "llama3", "opt-175b"
  std::string citation;  // the source and the figures it gives
  int gpus = 0;          // the fleet
  double days = 0;       // the period observed
  int failures = 0;      // job interruptions attributed to failures in it
  // gpus x days x 24 / failures: the per-GPU MTBF the count implies (a derived figure).
  double GpuMtbfHours() const { return gpus * days * 24 / failures; }
};

// Every source the tuner knows, the default first (docs/tuning.md lists them).
const std::vector<FailureSource>& PublishedFailureRates();
// InvalidArgument naming the known names otherwise.
absl::StatusOr<FailureSource> FailureSourceByName(absl::string_view name);

// How each rank reads the elastic log (the per-step protocol cost above).
enum class StoreReads : uint8_t {
  kTwoLevel,  // ElasticGroup as built: each group's leader in the job log, its ranks in a log of
              // the group's, decisions handed down: per phase 3n + R + R^2 operations
  kPerEntry,  // the first design: every rank in the job log, reading it entry by entry
  kBatched,   // one read per rank per phase: a variant that is not built
  kLeaders,   // one rank per replica group appends and reads (one read per phase), and relays
              // over its shard group: R appends and R reads per phase; not built either
};
// "two_level", "per_entry", "batched", "leaders".
absl::string_view StoreReadsName(StoreReads reads);

// Every parameter of the cost model. Defaults: cited figures, this machine's measurements and
// stated assumptions (docs/tuning.md, "Failures and recovery", says which is which).
struct RecoveryOptions {
  // Per-GPU MTBF; <= 0: the first PublishedFailureRates() entry's (Llama 3).
  double gpu_mtbf_hours = 0;
  // Detection: the store's liveness signal for a process that died (measured on this machine:
  // median 174 ms from the start of the failed step to the abort decision, 2 x 2 ranks,
  // tests/scripts/elastic_test.py, 20 trials); a hang that ends no process waits for timeout_s
  // (PyTorch's NCCL default, 10 minutes, pytorch/pytorch#110947).
  double detect_s = 0.174;
  double hang_fraction = 0;  // in [0, 1]
  double timeout_s = 600;
  // Checkpoint restart (assumptions, not measured): the job's relaunch on spare nodes (the
  // scheduler's requeue, process and container start, rendezvous) and its initialisation
  // (framework and communicator set-up, model build) before the checkpoint is read.
  double relaunch_s = 60;
  double init_s = 30;
  // Storage bandwidth each node gets, read and write, bytes/s: Meta's Tectonic file system as
  // Llama 3's training used it (2 TB/s sustained for up to 16,384 GPUs, 2,048 nodes of 8):
  // 2e12 / 2048, a derived figure.
  double storage_bytes_per_s_per_node = 2e12 / 2048;
  bool async_checkpoint = false;
  // Elastic: the abort decision to the next round's communicators, measured on this machine
  // (median 28 ms, 2 x 2 ranks), taken as flat in n (the quorum's store traffic is added);
  // the store's operations per second (store_bench on this machine: Set 21-23 k, Get 25 k ops/s
  // through the server's one I/O thread); the joiner's CRC-32C check (~13 GB/s per core,
  // docs/benchmarks.md, checkpoints).
  double resume_base_s = 0.028;
  double store_ops_per_s = 22000;
  StoreReads store_reads = StoreReads::kTwoLevel;
  double crc_bytes_per_s = 13e9;
};

// OK, or InvalidArgument naming the field and the value.
absl::Status ValidateRecoveryOptions(const RecoveryOptions& options);

// One job: its size, its mesh, its step and its state.
struct RecoveryScenario {
  int gpus = 0;
  int shard_size = 0;                 // k: ranks per replica group (R = gpus / k)
  int devices_per_node = 8;           // nodes = ceil(gpus / devices_per_node)
  double step_s = 0;                  // one training step (the simulator's)
  double state_bytes = 0;             // master weights + optimizer state, once
  double link_bytes_per_s = 0;        // a rank to its donor (the topology's rail share)
  double host_link_bytes_per_s = 0;   // a rank's device-to-host copy (async snapshots); 0: none
  std::vector<int> checkpoint_every;  // the N to compare (each >= 1)
  // From the simulation (SimulatedScenario): the step's peak memory per device, and whether it
  // fits the device's memory; not used by the model.
  double peak_bytes = 0;
  bool fits = true;
};

struct CheckpointRestartCost {
  int every = 0;         // N
  double write_s = 0;    // one save's write
  double blocked_s = 0;  // the training time one save takes
  double steady = 0;     // N step / (N step + blocked)
  double restart_s = 0;  // detect + relaunch + init + load
  double load_s = 0;
  double lost_steps = 0;  // N / 2
  double lost_s = 0;      // restart_s + lost_steps x step_s
  double goodput = 0;
};

struct ElasticCost {
  double detect_s = 0;
  double quorum_s = 0;       // the abort round's arrivals through the store
  double resume_s = 0;       // detect + resume_base + quorum: the kill to training again
  double next_commit_s = 0;  // resume_s + the redone step
  double lost_steps = 0.5;   // the step in flight, on average half done
  double degraded_s = 0;     // relaunch + init of the replacement, at (R - 1) / R
  double transfer_s = 0;     // the joining round's state transfer (everyone waits)
  double rejoin_s = 0;       // degraded_s + resume_base + transfer_s: kill to full strength
  double lost_s = 0;         // job seconds per failure
  double protocol_s = 0;     // store traffic of every step's round
  double steady = 0;         // step / (step + protocol_s)
  double goodput = 0;
};

struct RecoveryEstimate {
  RecoveryScenario scenario;
  int replicas = 0;  // R
  int nodes = 0;
  double gpu_mtbf_hours = 0;
  double job_mtbf_hours = 0;
  double failures_per_day = 0;
  ElasticCost elastic;
  std::vector<CheckpointRestartCost> checkpoint;  // one per scenario.checkpoint_every
  // elastic.resume_s below every checkpoint restart's restart_s.
  bool elastic_resumes_faster = false;
};

// s x (1 - failures_per_s x lost_s), floored at 0.
double Goodput(double steady, double failures_per_s, double lost_s);

// InvalidArgument for bad options or a bad scenario (naming the field: gpus < 1, a shard size
// that does not divide gpus, a non-positive step, state or link, an N < 1); FailedPrecondition
// where the scenario has one replica group (elastic HSDP needs two).
absl::StatusOr<RecoveryEstimate> EstimateRecovery(const RecoveryScenario& scenario,
                                                  const RecoveryOptions& options);

// What the scenario's step and state are for `model` as hybrid shard (R x k) on `cluster`:
// step_s is Simulate's step time for `config` with world_size = gpus, strategy kHybridShard and
// shard_size k (by default one representative rank where the placement allows); state_bytes the
// master weights and optimizer state (parameters x (master dtype size +
// optimizer_state_bytes_per_param)); link the topology's rail share, host link and devices per node
// from it. InvalidArgument for a cluster without a topology or a world larger than it; Simulate's
// errors otherwise.
struct ScenarioShape {
  int gpus = 0;
  int shard_size = 0;
};
absl::StatusOr<RecoveryScenario> SimulatedScenario(const ModelDescription& model,
                                                   const SimCluster& cluster, ScenarioShape shape,
                                                   SimulationConfig config = {
                                                       .ranks = RankMode::kAuto});

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_TUNE_FAILURES_H_
