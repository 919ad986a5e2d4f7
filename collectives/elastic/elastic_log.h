// File: collectives/elastic/elastic_log.h
// -----------------------------------------------------------------------------
// The agreement of an elastic hybrid-sharded job, as a state machine over one log. Every rank of
// the job appends what it knows to a log in the job's store (collectives/store/store.h: the keys
// "<log>/1", "<log>/2", ..., each written once) and reads the whole log in order; ElasticLog
// applies the entries one by one and reaches its decisions at fixed positions of the log, so
// every process that reads the same log decides the same thing, whenever it reads it. Nothing
// here does I/O (collectives/elastic/elastic_group.h does); a test feeds entries and reads the
// decisions.
//
// The job: `replicas` replica groups of `shard_size` ranks each. Rank (r, s) is shard s of replica
// r; the shard groups are fixed, and the replicate dimension is what changes. A replica group
// has an incarnation: 0 at launch, then one more each time its processes are replaced.
//
// Rounds. Training runs in rounds; a round trains one step and either commits it (the optimizer
// may step) or aborts it (every surviving member redoes the same step in the next round).
//   quorum   Each rank that wants to take part appends `arrive q r s i`. The quorum of round q
//            is decided at the first entry after which every expected replica is complete (all
//            its shard ranks arrived with its incarnation) or has lost a rank, or at the first
//            `timeout q quorum` entry (a rank whose wait ran out). Expected: the members of the
//            last round, less the replicas that lost a rank since (at round 0: every replica,
//            incarnation 0). The members are the complete replicas, ascending. A complete
//            replica that was not a member of the last round (a restarted group, with a new
//            incarnation) joins: it must receive the state before it trains. A replica that is
//            not complete at the decision sits the round out (its ranks are told so) and is not
//            expected again; it may come back as a joiner with a new incarnation.
//   commit   Each member rank appends `vote q r s i ok` or `... fail` after its step. The round
//            aborts at the first fail vote of a member, a `lost` entry of a member rank, or a
//            `timeout q commit` entry; it commits at the entry that completes the ok votes of
//            every member rank.
//   lost     `lost r s i` says the process of rank (r, s), incarnation i, is gone. The store's
//            server appends it when that process's connection closes (Store::AppendOnClose).
//
// A quorum without a member that holds the state (every replica that trained was lost) ends the
// job: job_lost(), and nothing after it is decided. Entries of earlier rounds, arrivals for a
// round whose quorum is decided, and entries of non-members are ignored; so are entries that do
// not parse (counted, for a warning).

#ifndef SHARDLINE_COLLECTIVES_ELASTIC_ELASTIC_LOG_H_
#define SHARDLINE_COLLECTIVES_ELASTIC_ELASTIC_LOG_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardline::elastic {

enum class Phase : uint8_t { kQuorum, kCommit };

struct Entry {
  enum class Kind : uint8_t { kArrive, kVote, kLost, kTimeout };
  Kind kind = Kind::kArrive;
  int64_t round = 0;             // arrive, vote, timeout
  int replica = 0;               // every kind
  int shard = 0;                 // every kind
  int incarnation = 0;           // arrive, vote, lost
  bool ok = false;               // vote
  Phase phase = Phase::kQuorum;  // timeout

  static Entry Arrive(int64_t round, int replica, int shard, int incarnation);
  static Entry Vote(int64_t round, int replica, int shard, int incarnation, bool ok);
  static Entry Lost(int replica, int shard, int incarnation);
  static Entry Timeout(int64_t round, Phase phase, int replica, int shard);

  // "arrive 3 1 0 2", "vote 3 1 0 2 ok", "lost 1 0 2", "timeout 3 commit 1 0". Unique per rank,
  // round and kind, so that an append by compare-and-set knows its own entry.
  std::string Encode() const;
  static absl::StatusOr<Entry> Decode(absl::string_view text);
};

// One round's quorum.
struct Quorum {
  int64_t round = 0;
  // The step the round trains: the number of rounds committed before it.
  int64_t step = 0;
  // (replica, incarnation) of the members, by replica.
  std::vector<std::pair<int, int>> members;
  // The members that join in this round (their state comes from a member that does not).
  std::vector<int> joiners;
  // The communicators of the last round cannot serve this one: round 0, a change of members, or
  // an aborted last round (its collectives were aborted).
  bool rebuild = true;
  // Why the quorum was decided: "every expected replica arrived", "a timeout", ...
  std::string reason;

  // "<round> <step> <rebuild 0|1> <replica:incarnation,...|-> <joiner,...|-> <reason>": how a
  // group's leader hands the quorum to the other ranks of its group.
  std::string Encode() const;
  static absl::StatusOr<Quorum> Decode(absl::string_view text);

  bool IsMember(int replica, int incarnation) const;
  bool IsJoiner(int replica) const;
  // The member replicas, ascending.
  std::vector<int> replicas() const;
};

class ElasticLog {
 public:
  ElasticLog(int replicas, int shard_size);

  // Applies the next entry of the log.
  void Apply(const Entry& entry);
  // Applies an entry's text; one that does not parse is counted and ignored.
  void ApplyText(absl::string_view text);

  // The round open now and where it stands.
  int64_t round() const { return round_; }
  Phase phase() const { return phase_; }
  // The quorum of `round`, once decided.
  const Quorum* quorum(int64_t round) const;
  // The outcome of `round`'s commit phase, once decided: true committed.
  std::optional<bool> outcome(int64_t round) const;
  // Why `round` aborted ("rank (1, 0) voted fail", "rank (1, 0) incarnation 0 was lost", ...).
  std::string abort_reason(int64_t round) const;
  int64_t committed_steps() const { return committed_; }
  // Whether the job cannot go on: a quorum was decided with no member that holds the state
  // (every replica that trained was lost). Final: the log decides nothing after it.
  bool job_lost() const { return job_lost_; }
  // Whether rank (replica, shard) of `incarnation` was reported lost.
  bool lost(int replica, int shard, int incarnation) const;
  int64_t entries() const { return entries_; }
  int64_t unparsed_entries() const { return unparsed_; }

  int replicas() const { return replicas_; }
  int shard_size() const { return shard_size_; }

 private:
  bool ReplicaLost(int replica, int incarnation) const;
  void MaybeDecideQuorum(const std::string& timeout_reason);
  void DecideCommit(bool committed, std::string reason);

  const int replicas_;
  const int shard_size_;
  int64_t round_ = 0;
  Phase phase_ = Phase::kQuorum;
  int64_t committed_ = 0;
  bool job_lost_ = false;
  int64_t entries_ = 0;
  int64_t unparsed_ = 0;
  // Expected in the open quorum: replica -> incarnation.
  std::map<int, int> expected_;
  bool last_aborted_ = false;
  std::vector<std::pair<int, int>> last_members_;
  // Arrivals by round (the open one, and early ones for later rounds): replica -> incarnation ->
  // shards arrived.
  std::map<int64_t, std::map<int, std::map<int, std::set<int>>>> arrived_;
  // Open commit: member ranks that voted ok.
  std::set<std::pair<int, int>> ok_votes_;
  std::set<std::tuple<int, int, int>> lost_;
  std::map<int64_t, Quorum> quorums_;
  std::map<int64_t, bool> outcomes_;
  std::map<int64_t, std::string> abort_reasons_;
};

}  // namespace shardline::elastic

#endif  // SHARDLINE_COLLECTIVES_ELASTIC_ELASTIC_LOG_H_
