#include "collectives/elastic/elastic_group.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "collectives/store/tcp_store.h"
#include "runtime/config.h"
#include "runtime/crc32c.h"
#include "runtime/logging.h"
#include "runtime/status.h"
#include "runtime/stream.h"

namespace shardline {

using elastic::Entry;
using elastic::Phase;
using elastic::Quorum;

namespace {

std::string Members(const std::vector<int>& replicas) {
  return replicas.empty() ? std::string("none") : absl::StrJoin(replicas, ", ");
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

absl::StatusOr<ElasticOptions> ElasticOptionsFromEnvironment(absl::Time deadline) {
  SL_ASSIGN_OR_RETURN(LaunchInfo launch, ReadLaunchEnvironment());
  SL_ASSIGN_OR_RETURN(int64_t shard_size, ParamShardSize().Get());
  SL_ASSIGN_OR_RETURN(int64_t restarts, ParamRestartCount().Get());
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
      log_key_(absl::StrCat(options_.name, "/log")),
      log_(options_.replicas, options_.shard_size) {}

ElasticGroup::~ElasticGroup() = default;

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
  if (options.timeout <= absl::ZeroDuration()) {
    SL_ASSIGN_OR_RETURN(options.timeout, DefaultTimeout());
  }
  if (!options.communicator_factory) options.communicator_factory = CreateCommunicator;
  std::unique_ptr<ElasticGroup> group(new ElasticGroup(std::move(options)));
  const ElasticOptions& o = group->options_;
  if (o.watch_liveness) {
    absl::Status watched = o.store->AppendOnClose(
        group->log_key_, Entry::Lost(o.replica, o.shard, o.incarnation).Encode(), deadline);
    if (!watched.ok()) return Annotate(watched, absl::StrCat(what, ": registering liveness"));
  }
  SL_LOG(INFO, COLL) << what << ": rank (" << o.replica << ", " << o.shard << ") incarnation "
                     << o.incarnation << " of " << o.replicas << " x " << o.shard_size;
  return group;
}

absl::Status ElasticGroup::Append(const Entry& entry) {
  const std::string text = entry.Encode();
  // Entries are unique, so finding ours at an index means this rank wrote it (a retry).
  for (int64_t index = read_ + 1;; ++index) {
    SL_ASSIGN_OR_RETURN(std::string value,
                        options_.store->CompareSet(absl::StrCat(log_key_, "/", index), "", text));
    if (value == text) return absl::OkStatus();
  }
}

absl::StatusOr<bool> ElasticGroup::ReadNext(absl::Time until) {
  absl::StatusOr<std::string> entry =
      options_.store->Get(absl::StrCat(log_key_, "/", read_ + 1), until);
  if (absl::IsDeadlineExceeded(entry.status()) && absl::Now() >= until) return false;
  if (!entry.ok()) return entry.status();
  ++read_;
  SL_LOG(TRACE, COLL) << "elastic group '" << options_.name << "': log entry " << read_ << ": "
                      << *entry;
  const int64_t unparsed = log_.unparsed_entries();
  log_.ApplyText(*entry);
  if (log_.unparsed_entries() != unparsed) {
    SL_LOG(WARN, COLL) << "elastic group '" << options_.name << "': ignoring entry " << read_
                       << " of the log, which does not parse: '" << *entry << "'";
  }
  return true;
}

absl::Status ElasticGroup::ReadUntil(const std::function<bool()>& decided, const Entry& on_timeout,
                                     absl::Time deadline) {
  bool timed_out = false;
  absl::Time quiet_until = absl::Now() + options_.timeout;
  while (!decided()) {
    const absl::Time until = timed_out ? deadline : std::min(deadline, quiet_until);
    SL_ASSIGN_OR_RETURN(bool read, ReadNext(until));
    if (read) {
      quiet_until = absl::Now() + options_.timeout;
      continue;
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("elastic group '", options_.name, "': no decision of round ", log_.round(),
                       " before the deadline (", read_, " log entries read)"));
    }
    // Nothing new for a whole timeout: decide the round for everyone.
    SL_LOG(WARN, COLL) << "elastic group '" << options_.name << "': nothing new in the log for "
                       << options_.timeout << "; appending '" << on_timeout.Encode() << "'";
    SL_RETURN_IF_ERROR(Append(on_timeout));
    timed_out = true;
  }
  return absl::OkStatus();
}

absl::Status ElasticGroup::JobLost(const std::string& what) const {
  const Quorum* quorum = log_.quorum(log_.round());
  return absl::DataLossError(
      absl::StrCat(what, ": round ", log_.round(),
                   " has no replica that holds the training state (members: replicas ",
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
  const std::string what = absl::StrCat("elastic group '", o.name, "', rank (", o.replica, ", ",
                                        o.shard, ") incarnation ", o.incarnation);
  if (in_round_) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": BeginRound twice without EndRound (round ", current_.round, ")"));
  }
  while (true) {
    // Catch up with what is already there (a process that joins late reads the job's history).
    while (true) {
      SL_ASSIGN_OR_RETURN(bool exists, o.store->Check({absl::StrCat(log_key_, "/", read_ + 1)}));
      if (!exists) break;
      SL_ASSIGN_OR_RETURN(bool read, ReadNext(deadline));
      if (!read) break;
    }
    if (log_.job_lost()) return JobLost(what);
    const int64_t round = log_.phase() == Phase::kQuorum ? log_.round() : log_.round() + 1;
    SL_RETURN_IF_ERROR(Append(Entry::Arrive(round, o.replica, o.shard, o.incarnation)));
    SL_RETURN_IF_ERROR(ReadUntil([&] { return log_.quorum(round) != nullptr || log_.job_lost(); },
                                 Entry::Timeout(round, Phase::kQuorum, o.replica, o.shard),
                                 deadline));
    if (log_.job_lost()) return JobLost(what);
    const Quorum& quorum = *log_.quorum(round);
    const bool lost = log_.lost(o.replica, o.shard, o.incarnation);
    if (!quorum.IsMember(o.replica, o.incarnation) && !ever_member_ && !lost) {
      // A new process whose group was not complete when the round was decided (its ranks
      // arrived in different rounds, or after the members): it arrives at the next one.
      SL_LOG(INFO, COLL) << what << ": not in round " << round << " (replicas "
                         << Members(quorum.replicas()) << "); arriving at the next round";
      continue;
    }
    if (!quorum.IsMember(o.replica, o.incarnation)) {
      return absl::AbortedError(absl::StrCat(
          what, ": not in the quorum of round ", round, " (members: replicas ",
          Members(quorum.replicas()), "; ", quorum.reason, ")",
          lost ? "; this rank was reported lost" : "",
          ": leave, and restart the replica group with a new incarnation to join again"));
    }
    ever_member_ = true;
    current_.round = round;
    current_.step = quorum.step;
    current_.replicas = quorum.replicas();
    current_.joiners = quorum.joiners;
    current_.joining = quorum.IsJoiner(o.replica);
    current_.rebuilt = quorum.rebuild || current_.shard == nullptr;
    absl::Status built = absl::OkStatus();
    if (current_.rebuilt) built = BuildCommunicators(quorum, deadline);
    if (recovering_) {
      ElasticRecovery& recovery = recoveries_.back();
      recovery.resume = absl::Now() - abort_read_;
      recovery.replicas_after = current_.replicas;
      recovering_ = false;
      SL_LOG(INFO, COLL) << what << ": recovered from round " << recovery.failed_round << " ("
                         << recovery.what_failed << ") in " << recovery.resume
                         << " after reading the abort; redoing step " << recovery.step
                         << " with replicas " << Members(recovery.replicas_after);
    }
    in_round_ = true;
    step_started_ = absl::Now();
    if (built.ok()) return current_;
    // A member died between the quorum and the communicators: this round cannot train.
    SL_LOG(WARN, COLL) << what << ": round " << round << " cannot train: " << built;
    SL_ASSIGN_OR_RETURN(bool committed, EndRound(built, deadline));
    if (committed) {
      return absl::InternalError(
          absl::StrCat(what, ": round ", round, " committed although this rank voted fail"));
    }
  }
}

absl::StatusOr<bool> ElasticGroup::EndRound(const absl::Status& step, absl::Time deadline) {
  const ElasticOptions& o = options_;
  if (!in_round_) {
    return absl::FailedPreconditionError(
        absl::StrCat("elastic group '", o.name, "': EndRound without BeginRound"));
  }
  in_round_ = false;
  const int64_t round = current_.round;
  if (!step.ok()) {
    SL_LOG(WARN, COLL) << "elastic group '" << o.name << "': round " << round
                       << " failed on this rank: " << step;
  }
  SL_RETURN_IF_ERROR(Append(Entry::Vote(round, o.replica, o.shard, o.incarnation, step.ok())));
  SL_RETURN_IF_ERROR(ReadUntil([&] { return log_.outcome(round).has_value() || log_.job_lost(); },
                               Entry::Timeout(round, Phase::kCommit, o.replica, o.shard),
                               deadline));
  if (!log_.outcome(round).has_value()) {
    return JobLost(absl::StrCat("elastic group '", o.name, "'"));
  }
  const bool committed = *log_.outcome(round);
  consecutive_aborts_ = committed ? 0 : consecutive_aborts_ + 1;
  if (!committed) {
    ElasticRecovery recovery;
    recovery.failed_round = round;
    recovery.step = current_.step;
    recovery.what_failed = log_.abort_reason(round);
    abort_read_ = absl::Now();
    recovery.detect = abort_read_ - step_started_;
    recoveries_.push_back(std::move(recovery));
    recovering_ = true;
    // Their collectives may have been aborted: the next round builds new ones.
    current_.shard = nullptr;
    current_.replicate = nullptr;
    SL_LOG(WARN, COLL) << "elastic group '" << o.name << "': round " << round << " (step "
                       << current_.step << ") aborted: " << recoveries_.back().what_failed;
  }
  if (consecutive_aborts_ >= o.max_consecutive_aborts) {
    return absl::AbortedError(absl::StrCat(
        "elastic group '", o.name, "': step ", current_.step, " aborted in ", consecutive_aborts_,
        " rounds in a row (max_consecutive_aborts); the last: ", recoveries_.back().what_failed,
        step.ok() ? "" : absl::StrCat("; this rank's error: ", step.ToString())));
  }
  return committed;
}

absl::Status ElasticGroup::TransferState(absl::Span<const StatePiece> pieces, absl::Time deadline) {
  const ElasticOptions& o = options_;
  const std::string what = absl::StrCat("elastic group '", o.name, "', rank (", o.replica, ", ",
                                        o.shard, "): state transfer of round ", current_.round);
  if (!in_round_ || current_.replicate == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": not inside a round"));
  }
  if (current_.joiners.empty()) return absl::OkStatus();
  // The donor: the first member that does not join (BeginRound made sure there is one).
  int donor = -1;
  std::vector<int> joiner_ranks;
  for (size_t i = 0; i < current_.replicas.size(); ++i) {
    const int replica = current_.replicas[i];
    const bool joins = std::find(current_.joiners.begin(), current_.joiners.end(), replica) !=
                       current_.joiners.end();
    if (joins) {
      joiner_ranks.push_back(static_cast<int>(i));
    } else if (donor < 0) {
      donor = static_cast<int>(i);
    }
  }
  Communicator& comm = *current_.replicate;
  const int me = comm.rank();
  if (me != donor && !current_.joining) return absl::OkStatus();
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream,
                      CreateHostStream({.name = "elastic.transfer"}));
  // Each piece is preceded by its size and followed by its checksum, so that a joiner whose
  // model differs fails naming the piece instead of receiving garbage.
  struct Trailer {
    uint64_t bytes;
    uint32_t crc;
    uint32_t index;
  };
  PointToPointOptions p2p;
  p2p.label = "elastic state";
  for (size_t i = 0; i < pieces.size(); ++i) {
    const StatePiece& piece = pieces[i];
    const std::string where =
        absl::StrCat(what, ": piece ", i, " of ", pieces.size(), " (", piece.bytes, " bytes)");
    if (me == donor) {
      const Trailer trailer{piece.bytes, Crc32c(piece.data, piece.bytes), static_cast<uint32_t>(i)};
      for (int joiner : joiner_ranks) {
        SL_ASSIGN_OR_RETURN(Work head,
                            comm.Send(&trailer, sizeof(trailer), DType::kU8, joiner, *stream, p2p));
        SL_RETURN_IF_ERROR(Annotate(head.Wait(deadline), where));
        if (piece.bytes > 0) {
          SL_ASSIGN_OR_RETURN(Work body,
                              comm.Send(piece.data, piece.bytes, DType::kU8, joiner, *stream, p2p));
          SL_RETURN_IF_ERROR(Annotate(body.Wait(deadline), where));
        }
      }
      continue;
    }
    Trailer trailer{};
    SL_ASSIGN_OR_RETURN(Work head,
                        comm.Recv(&trailer, sizeof(trailer), DType::kU8, donor, *stream, p2p));
    SL_RETURN_IF_ERROR(Annotate(head.Wait(deadline), where));
    if (trailer.bytes != piece.bytes || trailer.index != i) {
      // The donor sends what it has regardless; give up on the round (the donor's sends fail
      // when this rank's communicators go).
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": the donor (replica ", current_.replicas[donor], ") sends piece ", trailer.index,
          " of ", trailer.bytes,
          " bytes here: the replicas' states differ in layout (same model and optimizer?)"));
    }
    if (piece.bytes > 0) {
      SL_ASSIGN_OR_RETURN(Work body,
                          comm.Recv(piece.data, piece.bytes, DType::kU8, donor, *stream, p2p));
      SL_RETURN_IF_ERROR(Annotate(body.Wait(deadline), where));
    }
    const uint32_t crc = Crc32c(piece.data, piece.bytes);
    if (crc != trailer.crc) {
      return absl::DataLossError(absl::StrCat(where, ": CRC-32C ", absl::Hex(crc),
                                              " where the donor sent ", absl::Hex(trailer.crc)));
    }
  }
  SL_LOG(INFO, COLL) << what << ": " << (me == donor ? "sent " : "received ") << pieces.size()
                     << " pieces";
  return absl::OkStatus();
}

absl::Status ElasticGroup::ReportLost() {
  return Append(Entry::Lost(options_.replica, options_.shard, options_.incarnation));
}

}  // namespace shardline
