// One rank of an elastic hybrid-sharded training (collectives/elastic/elastic_group.h) driven by
// tests/scripts/elastic_test.py: the Scheduler (rebuilt over each round's groups) gathers three
// units, reduces hashed gradients (different per replica, shard rank and step) with a
// reduce-scatter and the replicate all-reduce, and SGD with momentum steps on the master shards
// after each committed round. A rank may SIGKILL itself at a given step and phase; a restarted
// replica group joins and receives the master shards and momenta. At the end the rank checks
// every element it owns against a plain-loop reference over the full tensors, which averages
// the gradients of exactly the replicas each committed step had, and prints a CRC-32C of its
// state so that the driver can compare replicas bit for bit.
//
//   elastic_mp --replicas 2 --shard-size 2 --replica R --shard S [--incarnation I] [--steps 20]
//              [--kill STEP:forward|backward|reduce|optimizer [--kill-rank RANK]]
//              [--await-joiners-at STEP] [--trace DIR] [--hold-at STEP]
//   environment: MASTER_ADDR, MASTER_PORT (a store outside the ranks: shardline-store),
//                SHARDLINE_STORE_TOKEN, SHARDLINE_TIMEOUT_S
//   shardline-launch -n 4 --max-restarts 1 --shard-size 2 -- elastic_mp [--steps ...] [--kill
//              STEP:PHASE --kill-rank RANK]: identity from the launcher's environment; the kill
//              applies to the first incarnation only
//
// --hold-at STEP: in the first round that trains STEP, after its communicators and any state
// transfer, the rank prints "HOLD step STEP" and waits for a line on its standard input before it
// trains, so that a driver can act at a known point of a step on every rank (cut a host's link:
// tests/scripts/elastic_multihost_test.py).
//
// Output lines: "START at_ms T", "HOLD step k", "STEP k replicas a,b at_ms T" (T: Unix ms),
// "KILLING at step K PHASE at_ms T", "RECOVERY round R step K detect_ms D resume_ms M: why",
// "DIGEST replica r shard s crc", "CHECK ok max_error E" (then exit 0). Exit 3: this rank was
// left out of a quorum (its replica lost a rank); 4: no replica holds the state; 5: wrong
// parameters; 1: any other error.

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "collectives/elastic/elastic_group.h"
#include "collectives/process_mesh.h"
#include "collectives/store/tcp_store.h"
#include "runtime/config.h"
#include "runtime/crc32c.h"
#include "runtime/flat_layout.h"
#include "runtime/status.h"
#include "runtime/stream.h"
#include "runtime/trace.h"
#include "scheduler/scheduler.h"

namespace shardline {
namespace {

constexpr float kLearningRate = 0.05f;
constexpr float kMomentum = 0.9f;

struct Args {
  int replicas = 2;
  int shard_size = 2;
  int replica = -1;  // -1: from the environment (shardline-launch --max-restarts)
  int shard = 0;
  int incarnation = 0;
  int steps = 20;
  int kill_rank = -1;     // with --kill: only this rank (replica * shard_size + shard) dies
  std::string trace_dir;  // --trace DIR: each rank writes DIR/elastic.<rank>.<incarnation>.json
  int kill_step = -1;
  std::string kill_phase;
  int await_joiners_at = -1;
  int hold_at = -1;
};

// The units: odd sizes, so that shards split tensors and carry padding.
std::vector<std::vector<TensorSpec>> UnitSpecs() {
  return {{{.name = "w0", .shape = {13, 7}}, {.name = "b0", .shape = {7}}},
          {{.name = "w1", .shape = {7, 11}}},
          {{.name = "w2", .shape = {29}}, {.name = "b2", .shape = {3}}}};
}

float Hashed(uint64_t a, uint64_t b, uint64_t c, uint64_t i) {
  uint64_t x = (a << 50) ^ (b << 40) ^ (c << 30) ^ i;
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<float>(static_cast<double>(x >> 40) / (1ull << 23) - 1.0);
}

// Unix time in milliseconds, for the driver's timings across processes.
int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

float InitialValue(int unit, int tensor, size_t i) { return Hashed(1, unit, tensor, i); }
// The gradient rank (replica, shard) computes at `step` (its micro-batch differs from every other
// rank's).
float GradientValue(int64_t step, int replica, int shard, int unit, int tensor, size_t i) {
  return Hashed(step + 2, replica * 64 + shard + 1, unit * 16 + tensor, i);
}

struct UnitState {
  FlatLayout layout;
  std::vector<float> master;    // this rank's shard (shard_elements)
  std::vector<float> momentum;  // likewise
};

class Worker {
 public:
  explicit Worker(Args args) : args_(std::move(args)) {}

  absl::Status Run() {
    const absl::Time deadline = absl::Now() + absl::Seconds(240);
    SL_ASSIGN_OR_RETURN(absl::Duration timeout, DefaultTimeout());
    ElasticOptions options;
    if (args_.replica < 0) {
      // Started by shardline-launch --max-restarts: everything from the environment.
      SL_ASSIGN_OR_RETURN(options, ElasticOptionsFromEnvironment(deadline));
      args_.replicas = options.replicas;
      args_.shard_size = options.shard_size;
      args_.replica = options.replica;
      args_.shard = options.shard;
      args_.incarnation = options.incarnation;
    } else {
      TcpStoreOptions store_options;
      store_options.host = getenv("MASTER_ADDR") != nullptr ? getenv("MASTER_ADDR") : "127.0.0.1";
      const char* port = getenv("MASTER_PORT");
      if (port == nullptr || !absl::SimpleAtoi(port, &store_options.port)) {
        return absl::InvalidArgumentError("MASTER_PORT is not set to the store's port");
      }
      store_options.rank = args_.replica * args_.shard_size + args_.shard;
      store_options.client_name = absl::StrCat("elastic_mp (", args_.replica, ", ", args_.shard,
                                               ") incarnation ", args_.incarnation);
      SL_ASSIGN_OR_RETURN(std::unique_ptr<TcpStore> tcp,
                          TcpStore::Connect(store_options, deadline));
      options = ElasticOptions{.store = std::move(tcp),
                               .replicas = args_.replicas,
                               .shard_size = args_.shard_size,
                               .replica = args_.replica,
                               .shard = args_.shard,
                               .incarnation = args_.incarnation,
                               .timeout = timeout};
    }
    store_ = options.store;
    const int rank = args_.replica * args_.shard_size + args_.shard;
    if (!args_.trace_dir.empty()) {
      trace_ = std::make_unique<TraceWriter>(rank);
      options.trace = trace_.get();
    }
    if (args_.kill_rank >= 0 && (args_.kill_rank != rank || args_.incarnation != 0)) {
      args_.kill_step = -1;  // the kill is another rank's (or this group's first life's)
    }
    SL_ASSIGN_OR_RETURN(group_, ElasticGroup::Join(options, deadline));
    SL_RETURN_IF_ERROR(InitState());
    while (group_->committed_steps() < args_.steps) {
      if (group_->committed_steps() == args_.await_joiners_at) {
        SL_RETURN_IF_ERROR(AwaitJoiners(deadline));
        args_.await_joiners_at = -1;
      }
      SL_ASSIGN_OR_RETURN(ElasticGroup::Round round, group_->BeginRound(deadline));
      if (round.rebuilt) {
        scheduler_.reset();
        // A failed round poisons every stream that waited on its work, the compute stream too.
        SL_ASSIGN_OR_RETURN(compute_, CreateCallerStream({.name = "compute"}));
        absl::Status built = BuildScheduler(round, deadline);
        if (!built.ok()) {
          // A member died meanwhile: this round cannot train.
          SL_ASSIGN_OR_RETURN(bool committed, group_->EndRound(built, deadline));
          if (committed) return absl::InternalError("a round committed with a failed rank");
          continue;
        }
      }
      if (!round.joiners.empty()) {
        std::vector<StatePiece> pieces;
        for (UnitState& unit : units_) {
          pieces.push_back({unit.master.data(), unit.master.size() * sizeof(float)});
          pieces.push_back({unit.momentum.data(), unit.momentum.size() * sizeof(float)});
        }
        pieces.push_back({&step_, sizeof(step_)});
        absl::Status moved = group_->TransferState(pieces, deadline);
        if (!moved.ok()) {
          scheduler_.reset();
          SL_ASSIGN_OR_RETURN(bool committed, group_->EndRound(moved, deadline));
          if (committed) return absl::InternalError("a round committed with a failed transfer");
          continue;
        }
      }
      if (step_ != round.step) {
        return absl::InternalError(
            absl::StrCat("at step ", step_, " but round ", round.round, " trains ", round.step));
      }
      if (round.step == args_.hold_at) {
        SL_RETURN_IF_ERROR(Hold(round.step, deadline));
        args_.hold_at = -1;
      }
      const absl::Status trained = TrainStep(round.step);
      SL_ASSIGN_OR_RETURN(bool committed, group_->EndRound(trained, deadline));
      if (!committed) {
        scheduler_.reset();
        continue;
      }
      MaybeDie(round.step, "optimizer");
      SL_RETURN_IF_ERROR(Optimize());
      std::printf("STEP %lld replicas %s at_ms %lld\n", static_cast<long long>(round.step),
                  absl::StrJoin(round.replicas, ",").c_str(), static_cast<long long>(NowMs()));
      std::fflush(stdout);
      history_[round.step] = round.replicas;
      ++step_;
    }
    for (const ElasticRecovery& r : group_->recoveries()) {
      std::printf("RECOVERY round %lld step %lld detect_ms %.1f resume_ms %.1f: %s\n",
                  static_cast<long long>(r.failed_round), static_cast<long long>(r.step),
                  absl::ToDoubleMilliseconds(r.detect), absl::ToDoubleMilliseconds(r.resume),
                  r.what_failed.c_str());
    }
    scheduler_.reset();
    if (trace_ != nullptr) {
      SL_RETURN_IF_ERROR(trace_->WriteFile(
          absl::StrCat(args_.trace_dir, "/elastic.", rank, ".", args_.incarnation, ".json")));
    }
    return Check();
  }

 private:
  absl::Status InitState() {
    const auto specs = UnitSpecs();
    for (size_t u = 0; u < specs.size(); ++u) {
      SL_ASSIGN_OR_RETURN(FlatLayout layout,
                          FlatLayout::Create(specs[u], {.num_shards = args_.shard_size}));
      UnitState unit{.layout = std::move(layout)};
      unit.master.assign(unit.layout.shard_elements(), 0.0f);
      unit.momentum.assign(unit.layout.shard_elements(), 0.0f);
      for (int t = 0; t < unit.layout.num_tensors(); ++t) {
        std::optional<ShardSlice> slice = unit.layout.Intersection(t, args_.shard);
        if (!slice.has_value()) continue;
        for (size_t k = 0; k < slice->length; ++k) {
          unit.master[slice->shard_offset + k] =
              InitialValue(static_cast<int>(u), t, slice->tensor_offset + k);
        }
      }
      units_.push_back(std::move(unit));
    }
    return absl::OkStatus();
  }

  absl::Status BuildScheduler(const ElasticGroup::Round& round, absl::Time deadline) {
    SL_ASSIGN_OR_RETURN(ProcessMesh mesh, ProcessMesh::FromGroups(round.shard, round.replicate));
    SchedulerOptions options;
    options.name = absl::StrCat("elastic.q", round.round);
    options.strategy = ShardingStrategy::kHybridShard;
    // Known from the start: no order check over a world that changes.
    options.forward_order = {0, 1, 2};
    SL_ASSIGN_OR_RETURN(scheduler_,
                        Scheduler::Create(std::move(mesh), *compute_, options, deadline));
    const auto specs = UnitSpecs();
    for (size_t u = 0; u < specs.size(); ++u) {
      UnitSpec spec{.name = absl::StrCat("unit", u), .tensors = specs[u]};
      spec.master_shard = Buffer::View(units_[u].master.data(),
                                       units_[u].master.size() * sizeof(float), Device::Host());
      SL_RETURN_IF_ERROR(scheduler_->RegisterUnit(std::move(spec)).status());
    }
    return absl::OkStatus();
  }

  void MaybeDie(int64_t step, absl::string_view phase) {
    if (step == args_.kill_step && phase == args_.kill_phase) {
      std::printf("KILLING at step %lld %s at_ms %lld\n", static_cast<long long>(step),
                  std::string(phase).c_str(), static_cast<long long>(NowMs()));
      std::fflush(stdout);
      raise(SIGKILL);
    }
  }

  // --hold-at: says so, then waits for a line on standard input (until `deadline`).
  absl::Status Hold(int64_t step, absl::Time deadline) {
    std::printf("HOLD step %lld\n", static_cast<long long>(step));
    std::fflush(stdout);
    while (true) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError(
            absl::StrCat("--hold-at ", step, ": no line on standard input before the deadline"));
      }
      pollfd in{.fd = STDIN_FILENO, .events = POLLIN, .revents = 0};
      const int ready = poll(&in, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
      if (ready < 0 && errno != EINTR) {
        return absl::InternalError(
            absl::StrCat("--hold-at ", step, ": poll on standard input: ", std::strerror(errno)));
      }
      if (ready <= 0) continue;
      char c = 0;
      const ssize_t got = read(STDIN_FILENO, &c, 1);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("--hold-at ", step, ": standard input closed while holding"));
      }
      if (c == '\n') return absl::OkStatus();
    }
  }

  absl::Status TrainStep(int64_t step) {
    if (scheduler_ == nullptr) return absl::FailedPreconditionError("no scheduler this round");
    Scheduler& s = *scheduler_;
    SL_RETURN_IF_ERROR(s.ZeroGrad());
    for (int u = 0; u < s.num_units(); ++u) {
      SL_RETURN_IF_ERROR(s.PreForward(u));
      if (u == 1) MaybeDie(step, "forward");
      SL_RETURN_IF_ERROR(s.PostForward(u));
    }
    for (int u = s.num_units() - 1; u >= 0; --u) {
      SL_RETURN_IF_ERROR(s.PreBackward(u));
      if (u == 1) MaybeDie(step, "backward");
      for (int t = 0; t < units_[u].layout.num_tensors(); ++t) {
        SL_ASSIGN_OR_RETURN(TensorView grad, s.unit(u).GradView(t));
        float* g = static_cast<float*>(grad.data);
        for (size_t i = 0; i < grad.numel; ++i) {
          g[i] += GradientValue(step, args_.replica, args_.shard, u, t, i);
        }
      }
      SL_RETURN_IF_ERROR(s.PostBackward(u));
    }
    // The reductions (reduce-scatter, replicate all-reduce) are in flight now.
    MaybeDie(step, "reduce");
    return s.FinishBackward();
  }

  absl::Status Optimize() {
    for (size_t u = 0; u < units_.size(); ++u) {
      SL_ASSIGN_OR_RETURN(FlatShardView grad, scheduler_->unit(static_cast<int>(u)).ShardGrad());
      const float* g = static_cast<const float*>(grad.data);
      UnitState& unit = units_[u];
      for (size_t i = 0; i < unit.master.size(); ++i) {
        unit.momentum[i] = kMomentum * unit.momentum[i] + g[i];
        unit.master[i] -= kLearningRate * unit.momentum[i];
      }
    }
    return absl::OkStatus();
  }

  // Holds the next round until a restarted group is ready to join it.
  absl::Status AwaitJoiners(absl::Time deadline) {
    if (args_.incarnation > 0) return absl::OkStatus();  // a joiner itself
    return group_->AwaitJoiner(deadline);
  }

  // The reference: the full tensors trained by a plain loop, each committed step averaging the
  // gradients of every rank of the replicas it had.
  absl::Status Check() {
    double max_error = 0;
    uint32_t digest = 0;
    for (size_t u = 0; u < units_.size(); ++u) {
      const UnitState& unit = units_[u];
      for (int t = 0; t < unit.layout.num_tensors(); ++t) {
        const size_t numel = unit.layout.tensor(t).numel;
        std::vector<float> param(numel), momentum(numel, 0.0f);
        for (size_t i = 0; i < numel; ++i) param[i] = InitialValue(static_cast<int>(u), t, i);
        for (const auto& [step, replicas] : history_) {
          const float ranks = static_cast<float>(replicas.size() * args_.shard_size);
          for (size_t i = 0; i < numel; ++i) {
            float sum = 0;
            for (int r : replicas) {
              for (int s = 0; s < args_.shard_size; ++s) {
                sum += GradientValue(step, r, s, static_cast<int>(u), t, i);
              }
            }
            momentum[i] = kMomentum * momentum[i] + sum / ranks;
            param[i] -= kLearningRate * momentum[i];
          }
        }
        std::optional<ShardSlice> slice = unit.layout.Intersection(t, args_.shard);
        if (!slice.has_value()) continue;
        for (size_t k = 0; k < slice->length; ++k) {
          const double error = std::abs(static_cast<double>(unit.master[slice->shard_offset + k]) -
                                        param[slice->tensor_offset + k]);
          max_error = std::max(max_error, error);
        }
      }
      digest = Crc32cExtend(digest, unit.master.data(), unit.master.size() * sizeof(float));
      digest = Crc32cExtend(digest, unit.momentum.data(), unit.momentum.size() * sizeof(float));
    }
    std::printf("DIGEST replica %d shard %d %08x\n", args_.replica, args_.shard, digest);
    if (args_.incarnation > 0) {
      // A joiner does not know which replicas the steps before it had: the driver compares its
      // digest with a survivor's instead.
      std::printf("CHECK joined\n");
      return absl::OkStatus();
    }
    if (history_.size() != static_cast<size_t>(args_.steps) && args_.incarnation == 0) {
      return absl::InternalError(
          absl::StrCat("trained ", history_.size(), " steps of ", args_.steps));
    }
    if (!(max_error < 2e-4)) {
      std::printf("CHECK failed max_error %g\n", max_error);
      return absl::DataLossError(
          absl::StrCat("parameters differ from the reference by ", max_error));
    }
    std::printf("CHECK ok max_error %g\n", max_error);
    return absl::OkStatus();
  }

  Args args_;
  std::shared_ptr<Store> store_;
  std::unique_ptr<TraceWriter> trace_;  // declared before the group, which draws on it
  std::unique_ptr<ElasticGroup> group_;
  std::unique_ptr<Stream> compute_;
  std::unique_ptr<Scheduler> scheduler_;
  std::vector<UnitState> units_;
  int64_t step_ = 0;
  std::map<int64_t, std::vector<int>> history_;
};

absl::StatusOr<Args> ParseArgs(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(flag, " needs a value"));
    const std::string value = argv[++i];
    auto number = [&](int* out) {
      return absl::SimpleAtoi(value, out)
                 ? absl::OkStatus()
                 : absl::InvalidArgumentError(absl::StrCat(flag, " takes a number: ", value));
    };
    if (flag == "--replicas") {
      SL_RETURN_IF_ERROR(number(&args.replicas));
    } else if (flag == "--shard-size") {
      SL_RETURN_IF_ERROR(number(&args.shard_size));
    } else if (flag == "--replica") {
      SL_RETURN_IF_ERROR(number(&args.replica));
    } else if (flag == "--shard") {
      SL_RETURN_IF_ERROR(number(&args.shard));
    } else if (flag == "--incarnation") {
      SL_RETURN_IF_ERROR(number(&args.incarnation));
    } else if (flag == "--steps") {
      SL_RETURN_IF_ERROR(number(&args.steps));
    } else if (flag == "--trace") {
      args.trace_dir = value;
    } else if (flag == "--kill-rank") {
      SL_RETURN_IF_ERROR(number(&args.kill_rank));
    } else if (flag == "--await-joiners-at") {
      SL_RETURN_IF_ERROR(number(&args.await_joiners_at));
    } else if (flag == "--hold-at") {
      SL_RETURN_IF_ERROR(number(&args.hold_at));
    } else if (flag == "--kill") {
      std::vector<std::string> parts = absl::StrSplit(value, ':');
      if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &args.kill_step)) {
        return absl::InvalidArgumentError(absl::StrCat("--kill takes STEP:PHASE, not ", value));
      }
      args.kill_phase = parts[1];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", flag));
    }
  }
  return args;
}

}  // namespace
}  // namespace shardline

int main(int argc, char** argv) {
  absl::StatusOr<shardline::Args> args = shardline::ParseArgs(argc, argv);
  if (!args.ok()) {
    std::fprintf(stderr, "elastic_mp: %s\n", args.status().ToString().c_str());
    return 2;
  }
  std::printf("START at_ms %lld\n", static_cast<long long>(shardline::NowMs()));
  shardline::Worker worker(*args);
  const absl::Status status = worker.Run();
  std::fflush(stdout);
  if (status.ok()) return 0;
  std::fprintf(stderr, "elastic_mp: %s\n", status.ToString().c_str());
  if (absl::IsAborted(status)) return 3;
  if (absl::IsDataLoss(status) &&
      status.message().find("holds the training state") != std::string::npos) {
    return 4;
  }
  return absl::IsDataLoss(status) ? 5 : 1;
}
