// File: collectives/elastic/elastic_group.h
// -----------------------------------------------------------------------------
// One rank of an elastic hybrid-sharded job: the rounds of the protocol of elastic_log.h over the
// job's store, and the communicators of each round (the rank's shard group and, over the round's
// member replicas, its replicate group). A replica group that loses a rank drops out of the
// replicate dimension at the next round; the other replicas redo the step without it and train
// on; a restarted group joins again at a round boundary and is fed the state by a live replica.
//
//   SL_ASSIGN_OR_RETURN(auto group, ElasticGroup::Join({.store = store, .replicas = 2,
//                                                       .shard_size = 2, .replica = r,
//                                                       .shard = s, .incarnation = i}, deadline));
//   while (group->committed_steps() < steps) {
//     SL_ASSIGN_OR_RETURN(ElasticGroup::Round round, group->BeginRound(deadline));
//     if (round.rebuilt) rebuild the scheduler over round.shard and round.replicate, on new
//                        streams (an aborted round poisons every stream that waited on it);
//     if (!round.joiners.empty()) SL_RETURN_IF_ERROR(group->TransferState(state, deadline));
//     absl::Status step = run step round.step (gradients zeroed first);
//     SL_ASSIGN_OR_RETURN(bool committed, group->EndRound(step, deadline));
//     if (committed) optimizer step;     // otherwise the next round redoes round.step
//   }
//
// Two levels, so that the store's work per round grows with the replica groups, not with every
// rank: each group's leader (its shard 0) gathers its ranks' arrivals and votes from a small log
// of the group's, speaks for the group in the job's log (elastic_log.h, with one "rank" per
// group) and hands each decision to the group's other ranks under a key of the group's, which
// they read (a log of the group's, where the store also writes the leader's death). A rank whose
// process dies is reported in its group's log (the leader's: in the job's log too) by the store's
// connection-close signal; a group that loses a rank is out.
//
// The store must outlive every training process: host it in the launcher or a process of its
// own (shardline-launch --max-restarts does), never in a training rank. Every wait of the
// protocol is bounded: a rank that is neither there nor reported lost is waited for until
// nothing new has appeared in the log for `timeout`, after which the waiting rank writes a
// timeout entry that decides the round for everyone.
//
// Thread safety: one thread calls a group's methods.

#ifndef SHARDLINE_COLLECTIVES_ELASTIC_ELASTIC_GROUP_H_
#define SHARDLINE_COLLECTIVES_ELASTIC_ELASTIC_GROUP_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "collectives/bootstrap.h"
#include "collectives/communicator.h"
#include "collectives/elastic/elastic_log.h"
#include "collectives/elastic/store_log.h"
#include "collectives/store/store.h"
#include "runtime/trace.h"

namespace shardline {

struct ElasticOptions {
  // The job's store, shared by every process and hosted outside the training ranks.
  std::shared_ptr<Store> store;
  int replicas = 1;    // replica groups at full strength
  int shard_size = 1;  // ranks per replica group
  int replica = 0;     // this rank's replica group
  int shard = 0;       // and its index within it
  // 0 at launch; each restart of the replica group's processes adds one (shardline-launch sets
  // SHARDLINE_RESTART_COUNT).
  int incarnation = 0;
  std::string backend = "ucx";
  Device device = Device::Host();
  std::string name = "elastic";
  // Bound on the rounds' communicators, and how long a wait of the protocol lasts with nothing new
  // in the log before this rank declares a timeout. Zero: SHARDLINE_TIMEOUT_S.
  absl::Duration timeout = absl::ZeroDuration();
  // Registers `lost r s i` with the store (Store::AppendOnClose), so that this process's death is
  // known at once. Off for in-process tests over a MemoryStore, which call ReportLost instead.
  bool watch_liveness = true;
  // EndRound fails (Aborted) after this many aborted rounds in a row: a step that cannot succeed
  // (the same error on every try) ends the job instead of looping.
  int max_consecutive_aborts = 8;
  // After an aborted round the survivors' collectives have all been aborted, so every member
  // that is alive arrives at the next round at once: one that has not arrived after this long
  // (nothing new in the job's log meanwhile) is taken as gone, instead of after `timeout` (a
  // silent loss, a cut link, then costs the collectives' deadline plus this). Zero: 3 s, or
  // `timeout` if that is shorter.
  absl::Duration quorum_timeout_after_abort = absl::ZeroDuration();
  // Where the rounds go on the Chrome trace (runtime/trace.h), on the track "elastic": one span
  // per round ("round 3 (step 2)", category "elastic", args committed/aborted and why) and one
  // per recovery ("recovery", from reading the abort to the next round's communicators). Null:
  // none. Must outlive the group.
  TraceWriter* trace = nullptr;
  // Makes the rounds' communicators. Null: CreateCommunicator.
  std::function<absl::StatusOr<std::shared_ptr<Communicator>>(const CommunicatorOptions&)>
      communicator_factory;
};

// The options of a process started by shardline-launch --max-restarts (or any launcher that sets
// the same variables): rank and world from the launcher's environment (bootstrap.h), the replica
// group size from SHARDLINE_SHARD_SIZE (0 or unset: LOCAL_WORLD_SIZE, one group per host), the
// incarnation from SHARDLINE_RESTART_COUNT, and a client of the store at MASTER_ADDR:MASTER_PORT
// (hosted outside the ranks; connecting waits until `deadline`). Rank r is shard r % S of replica
// r / S. InvalidArgument naming the variable if the shard size does not divide the world.
absl::StatusOr<ElasticOptions> ElasticOptionsFromEnvironment(absl::Time deadline);

// One contiguous piece of a rank's training state (a master shard, an optimizer moment, the step
// counter), in host memory: what TransferState moves to a joining replica.
struct StatePiece {
  void* data = nullptr;
  size_t bytes = 0;
};

// What a recovery cost, as seen by one surviving rank. Each is also logged (WARN when the round
// aborts, INFO when the next round is ready), drawn on the trace (ElasticOptions::trace), and
// kept by the flight recorder: an aborted round aborts its communicators with the reason
// ("elastic round 3 aborted: rank (1, 0) incarnation 0 was lost; step 2 is redone"; a
// communicator that a failed collective aborted first keeps that error), which dumps their
// records where SHARDLINE_FLIGHT_RECORDER_DIR is set (flight_recorder.h).
struct ElasticRecovery {
  int64_t failed_round = 0;
  int64_t step = 0;         // the step that was redone
  std::string what_failed;  // the abort reason of the round ("rank (1, 0) voted fail", ...)
  // From the start of the failed round's step (EndRound's caller measured nothing before) to
  // the moment this rank read the abort: how long the failure took to become a decision.
  absl::Duration detect;
  // From reading the abort to the next round's communicators being ready.
  absl::Duration resume;
  std::vector<int> replicas_after;  // the next round's members
};

class ElasticGroup {
 public:
  struct Round {
    int64_t round = 0;
    int64_t step = 0;                         // the step to train (committed rounds so far)
    std::vector<int> replicas;                // the member replica groups, ascending
    std::vector<int> joiners;                 // those that join now (TransferState before training)
    bool joining = false;                     // this rank's replica is one of them
    bool rebuilt = false;                     // new communicators: build the scheduler anew
    std::shared_ptr<Communicator> shard;      // this replica group (size shard_size)
    std::shared_ptr<Communicator> replicate;  // shard index `shard` of every member replica
  };

  // Registers this rank's liveness with the store. InvalidArgument for bad options (naming the
  // field); the store's error if the registration fails.
  static absl::StatusOr<std::unique_ptr<ElasticGroup>> Join(ElasticOptions options,
                                                            absl::Time deadline);
  ~ElasticGroup();

  // Arrives at the next round and waits for its quorum; builds the round's communicators when
  // the last round's cannot serve (the returned `rebuilt`). A round whose communicators cannot be
  // built (a member died meanwhile) is voted down and the next one is tried; so is a round decided
  // before every rank of this process's (new) replica group arrived: it arrives at the next one.
  // Errors: Aborted if this rank's replica, a member before, is not in the quorum (a rank of it
  // was lost: the process should exit, or be restarted to join with a new incarnation); DataLoss
  // if no member
  // holds the state (every replica that did was lost); DeadlineExceeded at `deadline`.
  absl::StatusOr<Round> BeginRound(absl::Time deadline);

  // Votes for the round's commit (ok iff `step` is OK) and waits for the outcome: true if every
  // member rank voted ok (the optimizer may step), false if the round aborted (recovery() says
  // why; the next round redoes the step). The round's communicators are dropped on an abort.
  absl::StatusOr<bool> EndRound(const absl::Status& step, absl::Time deadline);

  // In a round with joiners: the first member replica that is not joining (the donor) sends each
  // piece to every joiner of its shard index, point to point over the round's replicate group,
  // one piece at a time, each followed by its CRC-32C; a joiner receives in place and checks it
  // (DataLoss naming the piece on a mismatch). Every rank of a joining round calls it with the
  // same list of piece sizes (InvalidArgument if the sizes differ from the donor's); ranks that
  // neither send nor receive return at once.
  absl::Status TransferState(absl::Span<const StatePiece> pieces, absl::Time deadline);

  // Between rounds: returns at once if this rank's last round had every replica group;
  // otherwise blocks until a replica group that was not a member of it (a restarted group, with
  // a new incarnation) has arrived at the round this rank takes part in next, or `deadline`
  // passes (DeadlineExceeded). That round's quorum cannot be decided before
  // this rank arrives, so the group joins in it. For a loop that wants the job whole again
  // before it goes on (say, before a checkpoint), and for tests. Reads the job's log from where
  // the last call stopped (from its start the first time).
  absl::Status AwaitJoiner(absl::Time deadline);

  // In-process tests: reports this rank lost, as the store's server does when the process dies.
  absl::Status ReportLost();

  int64_t committed_steps() const { return committed_; }
  // The job's round this rank takes part in next (the last round it saw decided, plus one).
  int64_t next_round() const { return next_round_; }
  // The job log as this rank reads it: only a group's leader (shard 0) reads it.
  const elastic::ElasticLog& log() const { return log_; }
  const std::vector<ElasticRecovery>& recoveries() const { return recoveries_; }
  const ElasticOptions& options() const { return options_; }

 private:
  explicit ElasticGroup(ElasticOptions options);

  bool leader() const { return options_.shard == 0; }
  std::string What() const;
  // Followers: the leader's next decision ("quorum <k> ..." or "outcome <k> ..."), as `kind` of
  // group round k, waiting until `deadline`; Aborted if the leader was lost.
  absl::StatusOr<std::string> AwaitDecision(absl::string_view kind, int64_t k, absl::Time deadline);

  // Leader: the group log until every rank of the group did `what` ("arrive", "vote") in group
  // round k; returns the ranks' entries (for votes: whether each was ok). A lost rank, or nothing
  // new for options_.timeout (twice that for votes), is an error naming it.
  absl::StatusOr<std::vector<bool>> GatherGroup(absl::string_view what, int64_t k,
                                                absl::Time deadline);
  // Leader: reads the job log's next entry and applies it: true; false if none before `until`.
  absl::StatusOr<bool> ReadNext(absl::Time until);
  // Leader: reads the job log until `decided` holds. While nothing new appears for `quiet` it
  // appends `on_timeout` (once). DeadlineExceeded at `deadline`.
  absl::Status ReadUntil(const std::function<bool()>& decided, const elastic::Entry& on_timeout,
                         absl::Duration quiet, absl::Time deadline);
  // Leader: the quorum of the job's next round this group is in (arriving again when a round was
  // decided without it while it is new to the job), as the text followers decode: "member ...",
  // "out <why>" or "lost <why>".
  absl::StatusOr<std::string> LeaderQuorum(absl::Time deadline);
  // Leader: the group votes `ok`, then the job's outcome of `round`: "1" or "0 <why>".
  absl::StatusOr<std::string> LeaderOutcome(int64_t round, bool ok, absl::Time deadline);
  absl::Status BuildCommunicators(const elastic::Quorum& quorum, absl::Time deadline);
  // DataLoss: no replica that holds the state is left (ElasticLog::job_lost).
  absl::Status JobLost() const;

  ElasticOptions options_;
  std::string group_key_;      // "<name>/g<replica>.<incarnation>"
  elastic::StoreLog job_log_;  // leaders' entries (read by leaders only)
  elastic::StoreLog group_log_;
  // The leader's decisions for the group's other ranks, in order; "leader lost" if it dies.
  elastic::StoreLog decisions_;
  elastic::StoreLog joiner_scan_;  // AwaitJoiner's reader of the job log
  elastic::ElasticLog log_;        // the job log's state (leaders)
  int64_t group_round_ = 0;        // BeginRound calls so far (the group's rounds, in lockstep)
  int64_t committed_ = 0;
  int64_t next_round_ = 0;
  // Leader: group log entries by group round: arrivals, votes (shard -> ok), lost shards.
  std::map<int64_t, std::set<int>> arrived_;
  std::map<int64_t, std::map<int, bool>> votes_;
  std::set<int> lost_shards_;
  Round current_;
  bool in_round_ = false;
  absl::Time step_started_;
  std::vector<ElasticRecovery> recoveries_;
  bool recovering_ = false;
  int consecutive_aborts_ = 0;
  bool ever_member_ = false;  // once in a quorum, a group left out of one is out for good
  absl::Time abort_read_;
  int trace_track_ = 0;
};

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_ELASTIC_ELASTIC_GROUP_H_
