#include "collectives/elastic/elastic_group.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "collectives/store/tcp_store.h"
#include "runtime/config.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace shardline {

using elastic::Entry;
using elastic::Phase;
using elastic::Quorum;

namespace {

std::string Members(const std::vector<int>& replicas) {
  return replicas.empty() ? std::string("none") : absl::StrJoin(replicas, ", ");
}

// The group log's entries: "arrive <k> <shard>", "vote <k> <shard> ok|fail", and "lost <shard>"
// (the store's, when a rank's process goes).
struct GroupEntry {
  std::string kind;
  int64_t k = -1;
  int shard = -1;
  bool ok = false;
};

std::optional<GroupEntry> ParseGroupEntry(absl::string_view text) {
  const std::vector<absl::string_view> words = absl::StrSplit(text, ' ');
  GroupEntry entry;
  entry.kind = std::string(words[0]);
  if (entry.kind == "lost" && words.size() == 2 && absl::SimpleAtoi(words[1], &entry.shard)) {
    return entry;
  }
  if ((entry.kind == "arrive" && words.size() == 3) ||
      (entry.kind == "vote" && words.size() == 4 && (words[3] == "ok" || words[3] == "fail"))) {
    if (!absl::SimpleAtoi(words[1], &entry.k) || !absl::SimpleAtoi(words[2], &entry.shard)) {
      return std::nullopt;
    }
    entry.ok = words.size() == 4 && words[3] == "ok";
    return entry;
  }
  return std::nullopt;
}

}  // namespace

SL_PARAM(int64_t, ShardSize, "SHARD_SIZE", 0,
         "Ranks per replica group of an elastic job (ElasticOptionsFromEnvironment); 0: "
         "LOCAL_WORLD_SIZE, one group per host.",
         InRange<int64_t>(0, 1 << 20));
SL_PARAM(int64_t, RestartCount, "RESTART_COUNT", 0,
         "How many times shardline-launch --max-restarts restarted this process's replica group: "
         "its incarnation in an elastic job.",
         InRange<int64_t>(0, 1 << 20));

namespace {

// A launcher's per-process variable: read at every call, as RANK is (a knob's Get() reads the
// environment once per process), and checked against the knob's range.
absl::StatusOr<int64_t> IdentityVariable(const Param<int64_t>& param) {
  const char* text = std::getenv(param.env_name().c_str());
  if (text == nullptr || *text == '\0') return param.default_value();
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < 0 || value > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat(param.env_name(), "='", text, "' is not an integer in [0, 1048576]"));
  }
  return value;
}

}  // namespace

absl::StatusOr<ElasticOptions> ElasticOptionsFromEnvironment(absl::Time deadline) {
  SL_ASSIGN_OR_RETURN(LaunchInfo launch, ReadLaunchEnvironment());
  SL_ASSIGN_OR_RETURN(int64_t shard_size, IdentityVariable(ParamShardSize()));
  SL_ASSIGN_OR_RETURN(int64_t restarts, IdentityVariable(ParamRestartCount()));
  if (shard_size <= 0) shard_size = launch.local_world_size;
  if (shard_size < 1 || launch.world_size % shard_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("SHARDLINE_SHARD_SIZE (or LOCAL_WORLD_SIZE) ",
                                                   shard_size, " does not divide the world size ",
                                                   launch.world_size, " into replica groups"));
  }
  if (restarts < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("SHARDLINE_RESTART_COUNT ", restarts, " is negative"));
  }
  SL_ASSIGN_OR_RETURN(absl::Duration timeout, DefaultTimeout());
  TcpStoreOptions store;
  store.host = launch.master_addr;
  store.port = launch.master_port;
  store.rank = launch.rank;
  store.timeout = timeout;
  store.client_name = absl::StrCat("elastic rank ", launch.rank, " incarnation ", restarts);
  SL_ASSIGN_OR_RETURN(std::unique_ptr<TcpStore> client, TcpStore::Connect(store, deadline));
  ElasticOptions options;
  options.store = std::move(client);
  options.shard_size = static_cast<int>(shard_size);
  options.replicas = launch.world_size / options.shard_size;
  options.replica = launch.rank / options.shard_size;
  options.shard = launch.rank % options.shard_size;
  options.incarnation = static_cast<int>(restarts);
  options.timeout = timeout;
  return options;
}

ElasticGroup::ElasticGroup(ElasticOptions options)
    : options_(std::move(options)),
      group_key_(absl::StrCat(options_.name, "/g", options_.replica, ".", options_.incarnation)),
      job_log_(*options_.store, absl::StrCat(options_.name, "/log")),
      group_log_(*options_.store, absl::StrCat(group_key_, "/log")),
      decisions_(*options_.store, absl::StrCat(group_key_, "/decisions")),
      joiner_scan_(*options_.store, absl::StrCat(options_.name, "/log")),
      log_(options_.replicas, 1) {}

ElasticGroup::~ElasticGroup() = default;

std::string ElasticGroup::What() const {
  return absl::StrCat("elastic group '", options_.name, "', rank (", options_.replica, ", ",
                      options_.shard, ") incarnation ", options_.incarnation);
}

absl::StatusOr<std::unique_ptr<ElasticGroup>> ElasticGroup::Join(ElasticOptions options,
                                                                 absl::Time deadline) {
  const std::string what = absl::StrCat("elastic group '", options.name, "'");
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", why));
  };
  if (options.store == nullptr) return bad("store is null");
  if (options.replicas < 1) return bad(absl::StrCat("replicas ", options.replicas, " < 1"));
  if (options.shard_size < 1) return bad(absl::StrCat("shard_size ", options.shard_size, " < 1"));
  if (options.replica < 0 || options.replica >= options.replicas) {
    return bad(absl::StrCat("replica ", options.replica, " is not in [0, ", options.replicas, ")"));
  }
  if (options.shard < 0 || options.shard >= options.shard_size) {
    return bad(absl::StrCat("shard ", options.shard, " is not in [0, ", options.shard_size, ")"));
  }
  if (options.incarnation < 0) {
    return bad(absl::StrCat("incarnation ", options.incarnation, " is negative"));
  }
  if (options.max_consecutive_aborts < 1) {
    return bad(absl::StrCat("max_consecutive_aborts ", options.max_consecutive_aborts, " < 1"));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    SL_ASSIGN_OR_RETURN(options.timeout, DefaultTimeout());
  }
  if (options.quorum_timeout_after_abort < absl::ZeroDuration()) {
    return bad("quorum_timeout_after_abort is negative");
  }
  if (options.quorum_timeout_after_abort == absl::ZeroDuration()) {
    options.quorum_timeout_after_abort = std::min(options.timeout, absl::Seconds(3));
  }
  if (!options.communicator_factory) options.communicator_factory = CreateCommunicator;
  std::unique_ptr<ElasticGroup> group(new ElasticGroup(std::move(options)));
  const ElasticOptions& o = group->options_;
  if (o.trace != nullptr) group->trace_track_ = o.trace->Track("elastic");
  if (o.watch_liveness) {
    // This process's death, told to its group's leader; a leader's, to every leader and to its
    // group's other ranks.
    absl::Status watched =
        o.store->AppendOnClose(group->group_log_.key(), absl::StrCat("lost ", o.shard), deadline);
    if (watched.ok() && group->leader()) {
      watched = o.store->AppendOnClose(group->job_log_.key(),
                                       Entry::Lost(o.replica, 0, o.incarnation).Encode(), deadline);
    }
    if (watched.ok() && group->leader()) {
      watched = o.store->AppendOnClose(group->decisions_.key(), "leader lost", deadline);
    }
    if (!watched.ok()) return Annotate(watched, absl::StrCat(what, ": registering liveness"));
  }
  SL_LOG(INFO, COLL) << group->What() << " of " << o.replicas << " x " << o.shard_size << " joined";
  return group;
}

absl::StatusOr<bool> ElasticGroup::ReadNext(absl::Time until) {
  SL_ASSIGN_OR_RETURN(std::optional<std::string> entry, job_log_.Next(until));
  if (!entry.has_value()) return false;
  SL_LOG(TRACE, COLL) << What() << ": job log entry " << job_log_.read() << ": " << *entry;
  const int64_t unparsed = log_.unparsed_entries();
  log_.ApplyText(*entry);
  if (log_.unparsed_entries() != unparsed) {
    SL_LOG(WARN, COLL) << What() << ": ignoring entry " << job_log_.read()
                       << " of the job log, which does not parse: '" << *entry << "'";
  }
  return true;
}

absl::Status ElasticGroup::ReadUntil(const std::function<bool()>& decided, const Entry& on_timeout,
                                     absl::Duration quiet, absl::Time deadline) {
  bool timed_out = false;
  absl::Time quiet_until = absl::Now() + quiet;
  while (!decided()) {
    const absl::Time until = timed_out ? deadline : std::min(deadline, quiet_until);
    SL_ASSIGN_OR_RETURN(bool read, ReadNext(until));
    if (read) {
      quiet_until = absl::Now() + quiet;
      continue;
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(What(), ": no decision of round ",
                                                      log_.round(), " before the deadline (",
                                                      job_log_.read(), " job log entries read)"));
    }
    // Nothing new for a whole timeout: decide the round for everyone.
    SL_LOG(WARN, COLL) << What() << ": nothing new in the job log for " << quiet << "; appending '"
                       << on_timeout.Encode() << "'";
    SL_RETURN_IF_ERROR(job_log_.Append(on_timeout.Encode()));
    timed_out = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<bool>> ElasticGroup::GatherGroup(absl::string_view what, int64_t k,
                                                            absl::Time deadline) {
  const int size = options_.shard_size;
  auto complete = [&] {
    return what == "arrive" ? static_cast<int>(arrived_[k].size()) == size
                            : static_cast<int>(votes_[k].size()) == size;
  };
  // A rank votes after its step, which may run into its collectives' deadline (`timeout`) when a
  // peer elsewhere went silent, and then some: its vote gets twice that. A rank that died is
  // known sooner (its `lost` entry).
  const absl::Duration quiet = what == "vote" ? 2 * options_.timeout : options_.timeout;
  absl::Time quiet_until = absl::Now() + quiet;
  while (!complete()) {
    if (!lost_shards_.empty()) {
      return absl::UnavailableError(absl::StrCat(
          "rank (", options_.replica, ", ", *lost_shards_.begin(), ") of this group was lost"));
    }
    SL_ASSIGN_OR_RETURN(std::optional<std::string> text,
                        group_log_.Next(std::min(deadline, quiet_until)));
    if (!text.has_value()) {
      std::vector<int> missing;
      for (int s = 0; s < size; ++s) {
        const bool done = what == "arrive" ? arrived_[k].count(s) > 0 : votes_[k].count(s) > 0;
        if (!done) missing.push_back(s);
      }
      return absl::DeadlineExceededError(
          absl::StrCat("shard rank(s) ", absl::StrJoin(missing, ", "), " of this group did not ",
                       what, " in group round ", k, " within ", absl::FormatDuration(quiet)));
    }
    quiet_until = absl::Now() + quiet;
    std::optional<GroupEntry> entry = ParseGroupEntry(*text);
    if (!entry.has_value() || entry->shard < 0 || entry->shard >= size) {
      SL_LOG(WARN, COLL) << What() << ": ignoring group log entry '" << *text << "'";
      continue;
    }
    if (entry->kind == "lost") lost_shards_.insert(entry->shard);
    if (entry->kind == "arrive") arrived_[entry->k].insert(entry->shard);
    if (entry->kind == "vote") votes_[entry->k][entry->shard] = entry->ok;
  }
  std::vector<bool> oks;
  if (what == "vote") {
    for (const auto& [shard, ok] : votes_[k]) oks.push_back(ok);
  }
  arrived_.erase(k);
  votes_.erase(k);
  return oks;
}

absl::StatusOr<std::string> ElasticGroup::LeaderQuorum(absl::Time deadline) {
  const ElasticOptions& o = options_;
  absl::StatusOr<std::vector<bool>> gathered = GatherGroup("arrive", group_round_, deadline);
  if (!gathered.ok()) {
    // The group cannot train: it leaves the job, and its ranks are told.
    SL_RETURN_IF_ERROR(job_log_.Append(Entry::Lost(o.replica, 0, o.incarnation).Encode()));
    return absl::StrCat("out this replica group is incomplete: ", gathered.status().message());
  }
  while (true) {
    // Catch up with what is already there (a group that joins late reads the job's history).
    while (true) {
      SL_ASSIGN_OR_RETURN(std::optional<std::string> text, job_log_.TryNext(deadline));
      if (!text.has_value()) break;
      log_.ApplyText(*text);
    }
    if (log_.job_lost()) return absl::StrCat("lost ", JobLost().message());
    const int64_t round = log_.phase() == Phase::kQuorum ? log_.round() : log_.round() + 1;
    SL_RETURN_IF_ERROR(job_log_.Append(Entry::Arrive(round, o.replica, 0, o.incarnation).Encode()));
    // After an aborted round every live member arrives at once (its collectives were aborted).
    const std::optional<bool> last = log_.outcome(round - 1);
    const absl::Duration quiet =
        last.has_value() && !*last ? o.quorum_timeout_after_abort : o.timeout;
    SL_RETURN_IF_ERROR(ReadUntil([&] { return log_.quorum(round) != nullptr || log_.job_lost(); },
                                 Entry::Timeout(round, Phase::kQuorum, o.replica, 0), quiet,
                                 deadline));
    if (log_.job_lost()) return absl::StrCat("lost ", JobLost().message());
    const Quorum& quorum = *log_.quorum(round);
    if (quorum.IsMember(o.replica, o.incarnation)) {
      ever_member_ = true;
      return absl::StrCat("member ", quorum.Encode());
    }
    const bool lost = log_.lost(o.replica, 0, o.incarnation);
    if (ever_member_ || lost) {
      return absl::StrCat("out not in the quorum of round ", round, " (members: replicas ",
                          Members(quorum.replicas()), "; ", quorum.reason, ")",
                          lost ? "; this replica group was reported lost" : "");
    }
    // New to the job and not complete when the round was decided: the next round.
    SL_LOG(INFO, COLL) << What() << ": not in round " << round << " (replicas "
                       << Members(quorum.replicas()) << "); arriving at the next round";
  }
}

absl::StatusOr<std::string> ElasticGroup::LeaderOutcome(int64_t round, bool ok,
                                                        absl::Time deadline) {
  const ElasticOptions& o = options_;
  absl::StatusOr<std::vector<bool>> votes = GatherGroup("vote", group_round_, deadline);
  bool group_ok = ok && votes.ok();
  if (votes.ok()) {
    for (bool vote : *votes) group_ok = group_ok && vote;
  } else {
    SL_LOG(WARN, COLL) << What() << ": round " << round << ": " << votes.status();
  }
  SL_RETURN_IF_ERROR(
      job_log_.Append(Entry::Vote(round, o.replica, 0, o.incarnation, group_ok).Encode()));
  if (!votes.ok()) {
    // A rank of the group is gone: the group leaves.
    SL_RETURN_IF_ERROR(job_log_.Append(Entry::Lost(o.replica, 0, o.incarnation).Encode()));
  }
  SL_RETURN_IF_ERROR(ReadUntil([&] { return log_.outcome(round).has_value() || log_.job_lost(); },
                               Entry::Timeout(round, Phase::kCommit, o.replica, 0), o.timeout,
                               deadline));
  if (!log_.outcome(round).has_value()) return absl::StrCat("0 ", JobLost().message());
  if (*log_.outcome(round)) return std::string("1");
  return absl::StrCat("0 ", log_.abort_reason(round));
}

absl::StatusOr<std::string> ElasticGroup::AwaitDecision(absl::string_view kind, int64_t k,
                                                        absl::Time deadline) {
  // A decision may take long (the commit waits for every member's step), but the store must
  // keep answering: each quiet `timeout` this rank checks that it does, so that a rank cut off
  // from the store fails after one timeout rather than at the caller's deadline.
  std::optional<std::string> text;
  while (!text.has_value()) {
    SL_ASSIGN_OR_RETURN(text, decisions_.Next(std::min(deadline, absl::Now() + options_.timeout)));
    if (text.has_value()) break;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(What(), ": no ", kind, " of group round ", k,
                       " from the group's leader before the deadline"));
    }
    absl::StatusOr<bool> answers = options_.store->Check({decisions_.key()});
    if (!answers.ok()) {
      return Annotate(answers.status(),
                      absl::StrCat(What(), ": waiting for the group leader's ", kind,
                                   " of group round ", k, ", the store stopped answering"));
    }
  }
  if (*text == "leader lost") {
    return absl::AbortedError(absl::StrCat(
        What(), ": the leader of this replica group (shard 0) was lost: the group is out"));
  }
  const std::string prefix = absl::StrCat(kind, " ", k, " ");
  if (!absl::StartsWith(*text, prefix)) {
    return absl::InternalError(absl::StrCat(What(), ": expected the leader's ", kind,
                                            " of group round ", k, ", read '", *text, "'"));
  }
  return text->substr(prefix.size());
}

absl::Status ElasticGroup::JobLost() const {
  const Quorum* quorum = log_.quorum(log_.round());
  return absl::DataLossError(absl::StrCat(
      "round ", log_.round(), " has no replica that holds the training state (members: replicas ",
      Members(quorum != nullptr ? quorum->replicas() : std::vector<int>{}),
      ", none of them trained before): every replica that held it was lost"));
}

absl::Status ElasticGroup::BuildCommunicators(const Quorum& quorum, absl::Time deadline) {
  const ElasticOptions& o = options_;
  current_.shard = nullptr;
  current_.replicate = nullptr;
  CommunicatorOptions shard;
  shard.backend = o.backend;
  shard.rank = o.shard;
  shard.size = o.shard_size;
  shard.store = o.store;
  shard.device = o.device;
  shard.timeout = std::min(o.timeout, std::max(deadline - absl::Now(), absl::Milliseconds(1)));
  shard.name = absl::StrCat(o.name, "/q", quorum.round, "/replica", o.replica, ".", o.incarnation);
  CommunicatorOptions replicate = shard;
  const std::vector<int> replicas = quorum.replicas();
  replicate.rank =
      static_cast<int>(std::find(replicas.begin(), replicas.end(), o.replica) - replicas.begin());
  replicate.size = static_cast<int>(replicas.size());
  replicate.name = absl::StrCat(o.name, "/q", quorum.round, "/shard", o.shard);
  absl::StatusOr<std::shared_ptr<Communicator>> shard_comm = o.communicator_factory(shard);
  if (!shard_comm.ok()) return Annotate(shard_comm.status(), "the shard group");
  absl::StatusOr<std::shared_ptr<Communicator>> replicate_comm = o.communicator_factory(replicate);
  if (!replicate_comm.ok()) return Annotate(replicate_comm.status(), "the replicate group");
  current_.shard = *std::move(shard_comm);
  current_.replicate = *std::move(replicate_comm);
  return absl::OkStatus();
}

absl::StatusOr<ElasticGroup::Round> ElasticGroup::BeginRound(absl::Time deadline) {
  const ElasticOptions& o = options_;
  if (in_round_) {
    return absl::FailedPreconditionError(
        absl::StrCat(What(), ": BeginRound twice without EndRound (round ", current_.round, ")"));
  }
  while (true) {
    SL_RETURN_IF_ERROR(group_log_.Append(absl::StrCat("arrive ", group_round_, " ", o.shard)));
    std::string decision;
    if (leader()) {
      SL_ASSIGN_OR_RETURN(decision, LeaderQuorum(deadline));
      SL_RETURN_IF_ERROR(decisions_.Append(absl::StrCat("quorum ", group_round_, " ", decision)));
    } else {
      SL_ASSIGN_OR_RETURN(decision, AwaitDecision("quorum", group_round_, deadline));
    }
    const std::pair<absl::string_view, absl::string_view> verdict =
        absl::StrSplit(decision, absl::MaxSplits(' ', 1));
    if (verdict.first == "lost") {
      return absl::DataLossError(absl::StrCat(What(), ": ", verdict.second));
    }
    if (verdict.first != "member") {
      return absl::AbortedError(absl::StrCat(
          What(), ": ", verdict.second,
          ": leave, and restart the replica group with a new incarnation to join again"));
    }
    SL_ASSIGN_OR_RETURN(Quorum quorum, Quorum::Decode(verdict.second));
    current_.round = quorum.round;
    current_.step = quorum.step;
    current_.replicas = quorum.replicas();
    current_.joiners = quorum.joiners;
    current_.joining = quorum.IsJoiner(o.replica);
    current_.rebuilt = quorum.rebuild || current_.shard == nullptr;
    committed_ = quorum.step;
    next_round_ = quorum.round + 1;
    absl::Status built = absl::OkStatus();
    if (current_.rebuilt) built = BuildCommunicators(quorum, deadline);
    if (recovering_) {
      ElasticRecovery& recovery = recoveries_.back();
      recovery.resume = absl::Now() - abort_read_;
      if (o.trace != nullptr) {
        TraceArgs args;
        args.strings.emplace_back("what failed", recovery.what_failed);
        args.strings.emplace_back("replicas after", Members(current_.replicas));
        args.ints.emplace_back("step", recovery.step);
        args.ints.emplace_back("detect_us", absl::ToInt64Microseconds(recovery.detect));
        o.trace->AddComplete(trace_track_, "recovery", "elastic", abort_read_, recovery.resume,
                             std::move(args));
      }
      recovery.replicas_after = current_.replicas;
      recovering_ = false;
      SL_LOG(INFO, COLL) << What() << ": recovered from round " << recovery.failed_round << " ("
                         << recovery.what_failed << ") in " << recovery.resume
                         << " after reading the abort; redoing step " << recovery.step
                         << " with replicas " << Members(recovery.replicas_after);
    }
    in_round_ = true;
    step_started_ = absl::Now();
    if (built.ok()) return current_;
    // A member died between the quorum and the communicators: this round cannot train.
    SL_LOG(WARN, COLL) << What() << ": round " << current_.round << " cannot train: " << built;
    SL_ASSIGN_OR_RETURN(bool committed, EndRound(built, deadline));
    if (committed) {
      return absl::InternalError(absl::StrCat(What(), ": round ", current_.round,
                                              " committed although this rank voted fail"));
    }
  }
}

absl::StatusOr<bool> ElasticGroup::EndRound(const absl::Status& step, absl::Time deadline) {
  const ElasticOptions& o = options_;
  if (!in_round_) {
    return absl::FailedPreconditionError(absl::StrCat(What(), ": EndRound without BeginRound"));
  }
  in_round_ = false;
  const int64_t round = current_.round;
  if (!step.ok()) {
    SL_LOG(WARN, COLL) << What() << ": round " << round << " failed on this rank: " << step;
  }
  SL_RETURN_IF_ERROR(group_log_.Append(
      absl::StrCat("vote ", group_round_, " ", o.shard, step.ok() ? " ok" : " fail")));
  std::string outcome;
  if (leader()) {
    SL_ASSIGN_OR_RETURN(outcome, LeaderOutcome(round, step.ok(), deadline));
    SL_RETURN_IF_ERROR(decisions_.Append(absl::StrCat("outcome ", group_round_, " ", outcome)));
  } else {
    SL_ASSIGN_OR_RETURN(outcome, AwaitDecision("outcome", group_round_, deadline));
  }
  ++group_round_;
  const bool committed = outcome == "1";
  consecutive_aborts_ = committed ? 0 : consecutive_aborts_ + 1;
  const std::string why = committed ? "" : (outcome.size() > 2 ? outcome.substr(2) : "aborted");
  if (o.trace != nullptr) {
    TraceArgs args;
    args.ints.emplace_back("step", current_.step);
    args.ints.emplace_back("committed", committed ? 1 : 0);
    args.strings.emplace_back("replicas", Members(current_.replicas));
    if (!committed) args.strings.emplace_back("aborted", why);
    o.trace->AddComplete(trace_track_, absl::StrCat("round ", round, " (step ", current_.step, ")"),
                         "elastic", step_started_, absl::Now() - step_started_, std::move(args));
  }
  if (committed) {
    committed_ = current_.step + 1;
    return true;
  }
  ElasticRecovery recovery;
  recovery.failed_round = round;
  recovery.step = current_.step;
  recovery.what_failed = why;
  abort_read_ = absl::Now();
  recovery.detect = abort_read_ - step_started_;
  recoveries_.push_back(std::move(recovery));
  recovering_ = true;
  // The round's collectives are over (and may have failed): abort the communicators with the
  // reason, so that any peer still blocked in one fails now and the flight recorder keeps why;
  // the next round builds new ones.
  const absl::Status reason = absl::AbortedError(absl::StrCat(
      "elastic round ", round, " aborted: ", why, "; step ", current_.step, " is redone"));
  if (current_.shard != nullptr) current_.shard->Abort(reason);
  if (current_.replicate != nullptr) current_.replicate->Abort(reason);
  current_.shard = nullptr;
  current_.replicate = nullptr;
  SL_LOG(WARN, COLL) << What() << ": round " << round << " (step " << current_.step
                     << ") aborted: " << recoveries_.back().what_failed;
  if (consecutive_aborts_ >= o.max_consecutive_aborts) {
    return absl::AbortedError(absl::StrCat(
        What(), ": step ", current_.step, " aborted in ", consecutive_aborts_,
        " rounds in a row (max_consecutive_aborts); the last: ", recoveries_.back().what_failed,
        step.ok() ? "" : absl::StrCat("; this rank's error: ", step.ToString())));
  }
  return false;
}

absl::Status ElasticGroup::AwaitJoiner(absl::Time deadline) {
  if (in_round_) {
    return absl::FailedPreconditionError(
        absl::StrCat(What(), ": AwaitJoiner inside round ", current_.round));
  }
  const std::vector<int>& members = current_.replicas;
  if (static_cast<int>(members.size()) == options_.replicas) return absl::OkStatus();  // whole
  while (true) {
    SL_ASSIGN_OR_RETURN(std::optional<std::string> text, joiner_scan_.Next(deadline));
    if (!text.has_value()) {
      return absl::DeadlineExceededError(absl::StrCat(
          What(), ": no new replica group arrived at round ", next_round_, " before the deadline"));
    }
    absl::StatusOr<Entry> entry = Entry::Decode(*text);
    if (entry.ok() && entry->kind == Entry::Kind::kArrive && entry->round == next_round_ &&
        std::find(members.begin(), members.end(), entry->replica) == members.end()) {
      return absl::OkStatus();
    }
  }
}

absl::Status ElasticGroup::ReportLost() {
  const ElasticOptions& o = options_;
  SL_RETURN_IF_ERROR(group_log_.Append(absl::StrCat("lost ", o.shard)));
  if (!leader()) return absl::OkStatus();
  SL_RETURN_IF_ERROR(job_log_.Append(Entry::Lost(o.replica, 0, o.incarnation).Encode()));
  return decisions_.Append("leader lost");
}

}  // namespace shardline
