#include "collectives/elastic/elastic_log.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace shardline::elastic {
namespace {

std::string Rank(int replica, int shard) { return absl::StrCat("(", replica, ", ", shard, ")"); }

}  // namespace

Entry Entry::Arrive(int64_t round, int replica, int shard, int incarnation) {
  return {.kind = Kind::kArrive,
          .round = round,
          .replica = replica,
          .shard = shard,
          .incarnation = incarnation};
}

Entry Entry::Vote(int64_t round, int replica, int shard, int incarnation, bool ok) {
  return {.kind = Kind::kVote,
          .round = round,
          .replica = replica,
          .shard = shard,
          .incarnation = incarnation,
          .ok = ok};
}

Entry Entry::Lost(int replica, int shard, int incarnation) {
  return {.kind = Kind::kLost, .replica = replica, .shard = shard, .incarnation = incarnation};
}

Entry Entry::Timeout(int64_t round, Phase phase, int replica, int shard) {
  return {
      .kind = Kind::kTimeout, .round = round, .replica = replica, .shard = shard, .phase = phase};
}

std::string Entry::Encode() const {
  switch (kind) {
    case Kind::kArrive:
      return absl::StrCat("arrive ", round, " ", replica, " ", shard, " ", incarnation);
    case Kind::kVote:
      return absl::StrCat("vote ", round, " ", replica, " ", shard, " ", incarnation,
                          ok ? " ok" : " fail");
    case Kind::kLost:
      return absl::StrCat("lost ", replica, " ", shard, " ", incarnation);
    case Kind::kTimeout:
      return absl::StrCat("timeout ", round, phase == Phase::kQuorum ? " quorum " : " commit ",
                          replica, " ", shard);
  }
  return "";
}

absl::StatusOr<Entry> Entry::Decode(absl::string_view text) {
  const std::vector<absl::string_view> words = absl::StrSplit(text, ' ');
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("elastic log entry '", text.substr(0, 80), "': ", why));
  };
  // Parses words[first..] as integers into `out`.
  auto numbers = [&](size_t first, std::initializer_list<int64_t*> out) {
    size_t i = first;
    for (int64_t* value : out) {
      if (i >= words.size() || !absl::SimpleAtoi(words[i], value) || *value < 0) return false;
      ++i;
    }
    return true;
  };
  int64_t round = 0, replica = 0, shard = 0, incarnation = 0;
  Entry entry;
  const absl::string_view kind = words[0];
  if (kind == "arrive" && words.size() == 5 &&
      numbers(1, {&round, &replica, &shard, &incarnation})) {
    entry = Arrive(round, replica, shard, incarnation);
  } else if (kind == "vote" && words.size() == 6 &&
             numbers(1, {&round, &replica, &shard, &incarnation}) &&
             (words[5] == "ok" || words[5] == "fail")) {
    entry = Vote(round, replica, shard, incarnation, words[5] == "ok");
  } else if (kind == "lost" && words.size() == 4 && numbers(1, {&replica, &shard, &incarnation})) {
    entry = Lost(replica, shard, incarnation);
  } else if (kind == "timeout" && words.size() == 5 && numbers(1, {&round}) &&
             (words[2] == "quorum" || words[2] == "commit") && numbers(3, {&replica, &shard})) {
    entry = Timeout(round, words[2] == "quorum" ? Phase::kQuorum : Phase::kCommit, replica, shard);
  } else {
    return bad("not an arrive, vote, lost or timeout entry of the expected form");
  }
  if (replica > (1 << 30) || shard > (1 << 30) || incarnation > (1 << 30)) {
    return bad("a rank or incarnation out of range");
  }
  return entry;
}

std::string Quorum::Encode() const {
  std::vector<std::string> member_text;
  for (const auto& [replica, incarnation] : members) {
    member_text.push_back(absl::StrCat(replica, ":", incarnation));
  }
  return absl::StrCat(round, " ", step, " ", rebuild ? 1 : 0, " ",
                      members.empty() ? "-" : absl::StrJoin(member_text, ","), " ",
                      joiners.empty() ? "-" : absl::StrJoin(joiners, ","), " ", reason);
}

absl::StatusOr<Quorum> Quorum::Decode(absl::string_view text) {
  const std::vector<absl::string_view> words = absl::StrSplit(text, absl::MaxSplits(' ', 5));
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("elastic quorum '", text.substr(0, 120), "': ", why));
  };
  Quorum quorum;
  int rebuild = 0;
  if (words.size() != 6 || !absl::SimpleAtoi(words[0], &quorum.round) ||
      !absl::SimpleAtoi(words[1], &quorum.step) || !absl::SimpleAtoi(words[2], &rebuild)) {
    return bad("not '<round> <step> <rebuild> <members> <joiners> <reason>'");
  }
  quorum.rebuild = rebuild != 0;
  if (words[3] != "-") {
    for (absl::string_view member : absl::StrSplit(words[3], ',')) {
      std::pair<absl::string_view, absl::string_view> parts = absl::StrSplit(member, ':');
      int replica = 0, incarnation = 0;
      if (!absl::SimpleAtoi(parts.first, &replica) ||
          !absl::SimpleAtoi(parts.second, &incarnation)) {
        return bad(absl::StrCat("member '", member, "' is not replica:incarnation"));
      }
      quorum.members.emplace_back(replica, incarnation);
    }
  }
  if (words[4] != "-") {
    for (absl::string_view joiner : absl::StrSplit(words[4], ',')) {
      int replica = 0;
      if (!absl::SimpleAtoi(joiner, &replica)) {
        return bad(absl::StrCat("joiner '", joiner, "' is not a number"));
      }
      quorum.joiners.push_back(replica);
    }
  }
  quorum.reason = std::string(words[5]);
  return quorum;
}

bool Quorum::IsMember(int replica, int incarnation) const {
  return std::find(members.begin(), members.end(), std::make_pair(replica, incarnation)) !=
         members.end();
}

bool Quorum::IsJoiner(int replica) const {
  return std::find(joiners.begin(), joiners.end(), replica) != joiners.end();
}

std::vector<int> Quorum::replicas() const {
  std::vector<int> out;
  for (const auto& [replica, incarnation] : members) out.push_back(replica);
  return out;
}

ElasticLog::ElasticLog(int replicas, int shard_size)
    : replicas_(replicas), shard_size_(shard_size) {
  for (int r = 0; r < replicas_; ++r) expected_[r] = 0;
}

const Quorum* ElasticLog::quorum(int64_t round) const {
  auto it = quorums_.find(round);
  return it == quorums_.end() ? nullptr : &it->second;
}

std::optional<bool> ElasticLog::outcome(int64_t round) const {
  auto it = outcomes_.find(round);
  if (it == outcomes_.end()) return std::nullopt;
  return it->second;
}

std::string ElasticLog::abort_reason(int64_t round) const {
  auto it = abort_reasons_.find(round);
  return it == abort_reasons_.end() ? std::string() : it->second;
}

bool ElasticLog::lost(int replica, int shard, int incarnation) const {
  return lost_.count({replica, shard, incarnation}) > 0;
}

bool ElasticLog::ReplicaLost(int replica, int incarnation) const {
  for (int s = 0; s < shard_size_; ++s) {
    if (lost(replica, s, incarnation)) return true;
  }
  return false;
}

void ElasticLog::ApplyText(absl::string_view text) {
  absl::StatusOr<Entry> entry = Entry::Decode(text);
  if (!entry.ok()) {
    ++entries_;
    ++unparsed_;
    return;
  }
  Apply(*entry);
}

void ElasticLog::Apply(const Entry& entry) {
  ++entries_;
  if (job_lost_) return;
  const bool in_range = entry.replica < replicas_ && entry.shard < shard_size_;
  if (!in_range) {
    ++unparsed_;
    return;
  }
  switch (entry.kind) {
    case Entry::Kind::kArrive:
      if (entry.round < round_ || (entry.round == round_ && phase_ != Phase::kQuorum)) return;
      arrived_[entry.round][entry.replica][entry.incarnation].insert(entry.shard);
      if (entry.round == round_) MaybeDecideQuorum("");
      return;
    case Entry::Kind::kLost: {
      lost_.insert({entry.replica, entry.shard, entry.incarnation});
      if (phase_ == Phase::kQuorum) {
        MaybeDecideQuorum("");
      } else if (quorums_.at(round_).IsMember(entry.replica, entry.incarnation)) {
        DecideCommit(false, absl::StrCat("rank ", Rank(entry.replica, entry.shard), " incarnation ",
                                         entry.incarnation, " was lost"));
      }
      return;
    }
    case Entry::Kind::kTimeout:
      if (entry.round != round_ || entry.phase != phase_) return;
      if (phase_ == Phase::kQuorum) {
        MaybeDecideQuorum(absl::StrCat("rank ", Rank(entry.replica, entry.shard),
                                       " timed out waiting for the quorum"));
      } else {
        DecideCommit(false, absl::StrCat("rank ", Rank(entry.replica, entry.shard),
                                         " timed out waiting for the votes"));
      }
      return;
    case Entry::Kind::kVote: {
      if (entry.round != round_ || phase_ != Phase::kCommit) return;
      const Quorum& quorum = quorums_.at(round_);
      if (!quorum.IsMember(entry.replica, entry.incarnation)) return;
      if (!entry.ok) {
        return DecideCommit(false,
                            absl::StrCat("rank ", Rank(entry.replica, entry.shard), " voted fail"));
      }
      ok_votes_.insert({entry.replica, entry.shard});
      if (ok_votes_.size() == quorum.members.size() * static_cast<size_t>(shard_size_)) {
        DecideCommit(true, "");
      }
      return;
    }
  }
}

void ElasticLog::MaybeDecideQuorum(const std::string& timeout_reason) {
  const auto& arrived = arrived_[round_];
  auto complete = [&](int replica, int incarnation) {
    auto r = arrived.find(replica);
    if (r == arrived.end()) return false;
    auto i = r->second.find(incarnation);
    return i != r->second.end() && static_cast<int>(i->second.size()) == shard_size_ &&
           !ReplicaLost(replica, incarnation);
  };
  if (timeout_reason.empty()) {
    for (const auto& [replica, incarnation] : expected_) {
      if (!complete(replica, incarnation) && !ReplicaLost(replica, incarnation)) return;
    }
  }
  Quorum quorum;
  quorum.round = round_;
  quorum.step = committed_;
  quorum.reason =
      timeout_reason.empty() ? "every expected replica arrived or was lost" : timeout_reason;
  for (const auto& [replica, incarnations] : arrived) {
    auto expected = expected_.find(replica);
    if (expected != expected_.end() && complete(replica, expected->second)) {
      quorum.members.emplace_back(replica, expected->second);
      continue;
    }
    // A joiner: the newest complete incarnation that is not the expected one (a replica still
    // expected at its old incarnation is not replaced until that one is lost or times out).
    for (auto it = incarnations.rbegin(); it != incarnations.rend(); ++it) {
      if (expected != expected_.end() && it->first <= expected->second) break;
      if (complete(replica, it->first)) {
        quorum.members.emplace_back(replica, it->first);
        quorum.joiners.push_back(replica);
        break;
      }
    }
  }
  // At round 0 every replica starts from the same initial state: none joins.
  if (round_ == 0) quorum.joiners.clear();
  quorum.rebuild = round_ == 0 || last_aborted_ || quorum.members != last_members_;
  job_lost_ = quorum.joiners.size() == quorum.members.size();
  quorums_[round_] = std::move(quorum);
  arrived_.erase(arrived_.begin(), arrived_.upper_bound(round_));
  phase_ = Phase::kCommit;
  ok_votes_.clear();
}

void ElasticLog::DecideCommit(bool committed, std::string reason) {
  const Quorum& quorum = quorums_.at(round_);
  outcomes_[round_] = committed;
  if (committed) {
    ++committed_;
  } else {
    abort_reasons_[round_] = std::move(reason);
  }
  last_aborted_ = !committed;
  last_members_ = quorum.members;
  expected_.clear();
  for (const auto& [replica, incarnation] : quorum.members) {
    if (!ReplicaLost(replica, incarnation)) expected_[replica] = incarnation;
  }
  ++round_;
  phase_ = Phase::kQuorum;
  // Arrivals that came early (joiners) may already settle the new round; with every member
  // lost, the quorum is decided at once and has no replica that holds the state.
  MaybeDecideQuorum("");
}

}  // namespace shardline::elastic
