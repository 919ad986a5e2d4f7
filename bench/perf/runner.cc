#include "bench/perf/runner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/perf/memory.h"
#include "bench/perf/report.h"
#include "bench/perf/values.h"
#include "runtime/allocator.h"
#include "runtime/status.h"
#include "runtime/stream.h"
#include "testing/typed_values.h"

namespace shardline::perf {
namespace {

// Elements are read and written as doubles with the shared test helpers.
using ::shardline::testing::GetElement;
using ::shardline::testing::SetElement;

class RankRunner {
 public:
  RankRunner(const CollectiveSpec& spec, const Options& options, Communicator& comm, Stream& stream,
             Memory& memory, int processes)
      : spec_(spec),
        o_(options),
        comm_(comm),
        stream_(stream),
        memory_(memory),
        rank_(comm.rank()),
        n_(comm.size()),
        printer_(comm.rank() == 0),
        run_{spec.binary, std::string(comm.backend()), comm.size(), processes, options} {}

  // Runs the whole test; returns the exit code.
  int Run() {
    absl::Status status = RunAll();
    if (!status.ok()) {
      std::fprintf(stderr, "%s: rank %d: %s\n", spec_.binary, rank_, status.ToString().c_str());
      std::fflush(stderr);
      comm_.Abort(status);
      return 1;
    }
    return errors_ > 0 ? 1 : 0;
  }

 private:
  absl::Time WaitDeadline(int calls) const {
    return absl::Now() + comm_.timeout() * (calls + 1) + absl::Seconds(10);
  }

  absl::Status Wait(const absl::StatusOr<Work>& work, int calls = 1) {
    SL_RETURN_IF_ERROR(work.status());
    return work->Wait(WaitDeadline(calls));
  }

  // A scalar reduced over the ranks (op), or rank 0's value (broadcast) if `from_rank0`.
  absl::StatusOr<double> AllReduceScalar(double value, ReduceOp op, bool from_rank0 = false) {
    SL_RETURN_IF_ERROR(
        memory_.Write(scratch_.data(), 8, [&](void* p) { std::memcpy(p, &value, 8); }));
    if (from_rank0) {
      SL_RETURN_IF_ERROR(Wait(comm_.Broadcast(scratch_.data(), 1, DType::kF64, stream_)));
    } else {
      SL_RETURN_IF_ERROR(Wait(
          comm_.AllReduce(scratch_.data(), scratch_.data(), 1, DType::kF64, stream_, {.op = op})));
    }
    double out = 0;
    SL_RETURN_IF_ERROR(
        memory_.Read(scratch_.data(), 8, [&](const void* p) { std::memcpy(&out, p, 8); }));
    return out;
  }

  // A barrier. Built from a one-element all-reduce rather than Communicator::Barrier: the local
  // backend's barrier lets a fast rank post its next collective before a slow one has compared
  // the barrier's fingerprints, which then reports a spurious mismatch.
  absl::Status Sync() { return AllReduceScalar(0, ReduceOp::kSum).status(); }

  absl::Status RunAll() {
    if (o_.root >= n_) {
      return absl::InvalidArgumentError(
          absl::StrCat("root ", o_.root, " is not a rank of a world of ", n_));
    }
    SL_ASSIGN_OR_RETURN(scratch_, memory_.Allocate(kInfoBytes * (n_ + 1)));
    SL_ASSIGN_OR_RETURN(send_, memory_.Allocate(o_.max_bytes));
    SL_ASSIGN_OR_RETURN(recv_, memory_.Allocate(o_.max_bytes));
    SL_RETURN_IF_ERROR(PrintHeader());
    if (printer_) PrintColumnHeader();
    const std::vector<ReduceOp> ops =
        spec_.reduces ? o_.ops : std::vector<ReduceOp>{ReduceOp::kSum};
    for (DType dtype : o_.dtypes) {
      for (ReduceOp op : ops) SL_RETURN_IF_ERROR(TimeTest(dtype, op));
    }
    const double avg_busbw = busbw_cells_ > 0 ? busbw_sum_ / busbw_cells_ : 0;
    if (printer_) {
      PrintFooter(run_, errors_, avg_busbw);
      if (!o_.json_path.empty()) SL_RETURN_IF_ERROR(WriteJson(run_, rows_, errors_, avg_busbw));
    }
    // Nobody leaves while a peer may still need it for the last reductions.
    return Sync();
  }

  static constexpr size_t kInfoBytes = 256;

  absl::Status PrintHeader() {
    // Every rank's line, gathered to all (rank 0 prints): as nccl-tests' "Using devices".
    const std::string mine = RankLine(rank_, comm_.device(), comm_.backend());
    std::vector<char> line(kInfoBytes, '\0');
    std::memcpy(line.data(), mine.data(), std::min(mine.size(), kInfoBytes - 1));
    uint8_t* base = scratch_.as<uint8_t>();
    SL_RETURN_IF_ERROR(memory_.Write(base + kInfoBytes * n_, kInfoBytes,
                                     [&](void* p) { std::memcpy(p, line.data(), kInfoBytes); }));
    SL_RETURN_IF_ERROR(
        Wait(comm_.AllGather(base + kInfoBytes * n_, base, kInfoBytes, DType::kU8, stream_)));
    std::vector<std::string> lines;
    SL_RETURN_IF_ERROR(memory_.Read(base, kInfoBytes * n_, [&](const void* p) {
      const char* text = static_cast<const char*>(p);
      for (int r = 0; r < n_; ++r) lines.emplace_back(text + r * kInfoBytes);
    }));
    if (printer_) PrintRunHeader(run_, lines);
    return absl::OkStatus();
  }

  struct Pointers {
    const void* send;
    void* recv;
  };

  Pointers PointersFor(const CollCounts& c, size_t e, bool in_place) {
    uint8_t* recv = recv_.as<uint8_t>();
    if (!in_place) return {send_.data(), recv};
    return {recv + rank_ * c.send_inplace_offset * e, recv + rank_ * c.recv_inplace_offset * e};
  }

  // Sentinel (all bits set: NaN or -1) over the output and every byte in-place inputs share with
  // it, then this rank's input pattern.
  absl::Status InitData(const CollCounts& c, DType dtype, bool in_place, uint64_t seed) {
    const size_t e = DTypeSize(dtype);
    const Pointers p = PointersFor(c, e, in_place);
    size_t extent = c.recv;
    if (in_place) {
      extent =
          std::max(rank_ * c.send_inplace_offset + c.send, rank_ * c.recv_inplace_offset + c.recv);
    }
    SL_RETURN_IF_ERROR(memory_.Write(recv_.data(), extent * e, [&](void* dst) {
      std::memset(dst, 0xFF, extent * e);
      if (in_place) {
        FillInput(static_cast<uint8_t*>(dst) + rank_ * c.send_inplace_offset * e, c.send, dtype,
                  seed);
      }
    }));
    if (!in_place) {
      SL_RETURN_IF_ERROR(memory_.Write(const_cast<void*>(p.send), c.send * e,
                                       [&](void* dst) { FillInput(dst, c.send, dtype, seed); }));
    }
    return absl::OkStatus();
  }

  void FillInput(void* dst, size_t count, DType dtype, uint64_t seed) {
    for (size_t i = 0; i < count; ++i) {
      SetElement(dtype, dst, i, InputValue(dtype, spec_.reduces, rank_, i, seed));
    }
  }

  absl::StatusOr<int64_t> CheckData(const CollCounts& c, DType dtype, ReduceOp op, int root,
                                    bool in_place, uint64_t seed) {
    const Pointers p = PointersFor(c, DTypeSize(dtype), in_place);
    const CheckArgs args{rank_, n_, c.param, dtype, op, root, seed};
    int64_t wrong = 0;
    SL_RETURN_IF_ERROR(memory_.Read(p.recv, c.recv * DTypeSize(dtype), [&](const void* out) {
      for (size_t j = 0; j < c.recv; ++j) {
        const double want = spec_.expected(args, j);
        const double got = GetElement(dtype, out, j);
        if (!(std::abs(got - want) <= CheckTolerance(dtype, op, want))) ++wrong;
      }
    }));
    return wrong;
  }

  absl::StatusOr<Work> Issue(const CollCounts& c, DType dtype, ReduceOp op, int root,
                             bool in_place) {
    const Pointers p = PointersFor(c, DTypeSize(dtype), in_place);
    return spec_.issue({comm_, stream_, p.send, p.recv, c.param, dtype, op, root});
  }

  // `iters` calls back to back, then a wait for the last one (they run in order on the stream).
  absl::Status RunBurst(const CollCounts& c, DType dtype, ReduceOp op, int root, bool in_place,
                        int iters) {
    absl::StatusOr<Work> last = Work();
    for (int i = 0; i < iters; ++i) {
      last = Issue(c, dtype, op, root, in_place);
      SL_RETURN_IF_ERROR(last.status());
    }
    return Wait(last, iters);
  }

  absl::Status BenchTime(size_t size, DType dtype, ReduceOp op, int root, bool in_place,
                         Cell& cell) {
    const size_t e = DTypeSize(dtype);
    const CollCounts c = spec_.counts(size / e, n_);
    // Initialised even without checking, as nccl-tests does: a never-written buffer reads as
    // the kernel's shared zero page, which would flatter every copy out of it.
    SL_RETURN_IF_ERROR(InitData(c, dtype, in_place, 99));
    SL_RETURN_IF_ERROR(RunBurst(c, dtype, op, root, in_place, 1));
    SL_RETURN_IF_ERROR(Sync());

    const absl::Time start = absl::Now();
    SL_RETURN_IF_ERROR(RunBurst(c, dtype, op, root, in_place, o_.iters));
    double seconds = absl::ToDoubleSeconds(absl::Now() - start) / o_.iters;
    // -a: rank 0's time (a broadcast), or the average, minimum or maximum over the ranks.
    const ReduceOp combine = o_.average == 2   ? ReduceOp::kMin
                             : o_.average == 3 ? ReduceOp::kMax
                                               : ReduceOp::kAvg;
    SL_ASSIGN_OR_RETURN(seconds, AllReduceScalar(seconds, combine, o_.average == 0));
    cell.present = true;
    cell.time_us = seconds * 1e6;
    cell.algbw = seconds > 0 ? spec_.alg_bytes(c.param, e, n_) / 1e9 / seconds : 0;
    cell.busbw = cell.algbw * spec_.bus_factor(n_);

    int64_t wrong = 0;
    for (int k = 0; k < o_.check; ++k) {
      const uint64_t seed = ++check_seed_;
      SL_RETURN_IF_ERROR(InitData(c, dtype, in_place, seed));
      SL_RETURN_IF_ERROR(RunBurst(c, dtype, op, root, in_place, 1));
      SL_ASSIGN_OR_RETURN(int64_t mine, CheckData(c, dtype, op, root, in_place, seed));
      SL_ASSIGN_OR_RETURN(double total, AllReduceScalar(static_cast<double>(mine), ReduceOp::kSum));
      wrong = static_cast<int64_t>(total);
      if (wrong != 0) break;
    }
    if (o_.check > 0) {
      cell.wrong = wrong;
      if (wrong != 0) ++errors_;
    }
    busbw_sum_ += cell.busbw;
    ++busbw_cells_;
    return absl::OkStatus();
  }

  absl::Status TimeTest(DType dtype, ReduceOp op) {
    const int root = spec_.rooted ? o_.root : -1;
    const std::string redop = spec_.reduces ? std::string(ReduceOpName(op)) : "none";
    const size_t e = DTypeSize(dtype);
    SL_RETURN_IF_ERROR(Sync());
    // Warm-up at the largest, then at the smallest size (nccl-tests' order), out of place when
    // the collective has that form.
    const bool warm_in_place = !spec_.has_out_of_place;
    for (size_t size : {o_.max_bytes, o_.min_bytes}) {
      if (o_.warmup > 0) {
        SL_RETURN_IF_ERROR(
            RunBurst(spec_.counts(size / e, n_), dtype, op, root, warm_in_place, o_.warmup));
      }
    }
    for (size_t size = o_.min_bytes; size <= o_.max_bytes;
         size = o_.step_factor > 1 ? size * o_.step_factor : size + o_.step_bytes) {
      const CollCounts c = spec_.counts(size / e, n_);
      Row row;
      row.bytes = std::max(c.send, c.recv) * e;
      row.count = c.param;
      row.dtype = dtype;
      row.redop = redop;
      row.root = root;
      if (printer_) {
        // Not flushed until the row is complete: a write to the launcher's pipe in the middle of
        // a row wakes the process reading it while the next cell is being timed, which on a
        // machine with few cores slows that cell down.
        std::printf("%s", RowPrefix(row).c_str());
      }
      if (spec_.has_out_of_place) {
        SL_RETURN_IF_ERROR(BenchTime(size, dtype, op, root, false, row.out_of_place));
      }
      if (printer_) std::printf("%s", CellText(row.out_of_place).c_str());
      if (spec_.has_in_place) {
        SL_RETURN_IF_ERROR(BenchTime(size, dtype, op, root, true, row.in_place));
      }
      if (printer_) {
        std::printf("%s\n", CellText(row.in_place).c_str());
        std::fflush(stdout);
      }
      rows_.push_back(std::move(row));
      if (o_.step_factor <= 1 && o_.step_bytes == 0) break;  // -b == -e
      if (size > o_.max_bytes / std::max<size_t>(o_.step_factor, 1) && o_.step_factor > 1) break;
    }
    return absl::OkStatus();
  }

  const CollectiveSpec& spec_;
  const Options& o_;
  Communicator& comm_;
  Stream& stream_;
  Memory& memory_;
  const int rank_;
  const int n_;
  const bool printer_;
  const RunInfo run_;
  Buffer scratch_;
  Buffer send_;
  Buffer recv_;
  std::vector<Row> rows_;
  int64_t errors_ = 0;
  double busbw_sum_ = 0;
  int busbw_cells_ = 0;
  uint64_t check_seed_ = 0;
};

absl::StatusOr<std::unique_ptr<Stream>> MakeStream(const Options& o, Device device) {
  StreamOptions options{.name = "perf"};
  if (!device.is_host()) return CreateStream(device, options);
  if (o.stream_kind == "caller") return CreateCallerStream(options);
  return CreateHostStream(options);
}

}  // namespace

int RunRank(const CollectiveSpec& spec, const Options& o, Communicator& comm, int processes) {
  absl::StatusOr<std::unique_ptr<Memory>> memory = Memory::Create(comm);
  absl::StatusOr<std::unique_ptr<Stream>> stream =
      memory.ok() ? MakeStream(o, comm.device()) : memory.status();
  if (!memory.ok() || !stream.ok()) {
    const absl::Status s = !memory.ok() ? memory.status() : stream.status();
    std::fprintf(stderr, "%s: rank %d: %s\n", spec.binary, comm.rank(), s.ToString().c_str());
    comm.Abort(s);
    return 1;
  }
  RankRunner runner(spec, o, comm, **stream, **memory, processes);
  return runner.Run();
}

}  // namespace shardline::perf
