// The runtime tour: one FSDP forward pass, by hand, over what shardline has today.
//
// Two ranks (threads, local backend) hold a 6-unit model as sharded f32 flat buffers. For each
// unit a rank casts its shard to bf16 straight into its slice of an unsharded buffer taken from
// a caching pool, all-gathers in place on a "gather" stream, and its "compute" stream (the
// calling thread) waits for the gather's event, checks every element against the original
// weights and returns the buffer to the pool guarded by the compute event. Gathers run up to
// two units ahead (a rate limit), so the pool's peak stays at two unsharded units no matter how
// deep the model is. The timeline goes to a Chrome trace (open it in Perfetto).
//
//   runtime_tour [--trace out.json] [--units N] [--width W]

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "collectives/local/local_communicator.h"
#include "runtime/allocator.h"
#include "runtime/caching_pool.h"
#include "runtime/flat_layout.h"
#include "runtime/half.h"
#include "runtime/host_kernels.h"
#include "runtime/status.h"
#include "runtime/stream.h"
#include "runtime/trace.h"

namespace shardline {
namespace {

constexpr int kRanks = 2;
constexpr int kPrefetch = 2;  // unsharded units in flight at most

struct Options {
  std::string trace_path;
  int units = 6;
  int width = 512;
};

// The original (unsharded) value of element i of a unit: what every rank must see after the
// gather, rounded to bf16.
float Weight(int unit, size_t i) { return std::sin(0.001f * static_cast<float>(i) + unit); }

struct RankReport {
  absl::Status status;
  double checksum = 0;
  MemoryStats pool;
  PoolCacheStats cache;
  absl::Duration elapsed;
};

absl::Status RunRank(int rank, Communicator& comm, const std::vector<FlatLayout>& layouts,
                     TraceWriter& trace, RankReport& report) {
  const absl::Time start = absl::Now();
  std::unique_ptr<Allocator> host = CreateHostAllocator();
  CachingPool pool(*host, {.name = absl::StrCat("rank", rank, ".unsharded")});
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> gather, CreateHostStream({.name = "gather"}));
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> compute, CreateCallerStream({.name = "compute"}));
  const int gather_track = trace.Track("gather");
  const int compute_track = trace.Track("compute");

  // This rank's master shards (f32), filled from the original weights; padding stays zero.
  std::vector<Buffer> shards;
  for (size_t u = 0; u < layouts.size(); ++u) {
    const FlatLayout& layout = layouts[u];
    SL_ASSIGN_OR_RETURN(Buffer shard, host->Allocate(layout.shard_bytes()));
    std::memset(shard.data(), 0, shard.size());
    for (const ShardSlice& slice : layout.ShardSlices(rank)) {
      const size_t begin = layout.tensor(slice.tensor).offset + slice.tensor_offset;
      for (size_t k = 0; k < slice.length; ++k) {
        shard.as<float>()[slice.shard_offset + k] = Weight(static_cast<int>(u), begin + k);
      }
    }
    shards.push_back(std::move(shard));
  }

  struct InFlight {
    Buffer unsharded;
    Work gathered;
  };
  std::deque<InFlight> in_flight;
  size_t next_gather = 0;
  auto issue_gather = [&]() -> absl::Status {
    const FlatLayout& layout = layouts[next_gather];
    const int unit = static_cast<int>(next_gather++);
    SL_ASSIGN_OR_RETURN(Buffer unsharded, pool.Allocate(layout.total_elements() * 2));
    auto* my_slice = unsharded.as<uint8_t>() + layout.ShardBegin(rank) * 2;
    const void* shard = shards[unit].data();
    // Cast into place: the all-gather's input is this rank's slice of its output.
    SL_RETURN_IF_ERROR(gather->Enqueue([&, shard, my_slice, unit]() -> absl::Status {
      TraceSpan span(&trace, gather_track, absl::StrCat("cast unit ", unit), "cast");
      return Cast(shard, DType::kF32, my_slice, DType::kBF16, layout.shard_elements());
    }));
    SL_ASSIGN_OR_RETURN(Work work, comm.AllGather(my_slice, unsharded.data(),
                                                  layout.shard_elements(), DType::kBF16, *gather));
    in_flight.push_back({std::move(unsharded), std::move(work)});
    return absl::OkStatus();
  };

  for (size_t unit = 0; unit < layouts.size(); ++unit) {
    while (next_gather < layouts.size() && in_flight.size() < kPrefetch) {
      SL_RETURN_IF_ERROR(issue_gather());
    }
    InFlight current = std::move(in_flight.front());
    in_flight.pop_front();
    {
      TraceSpan span(&trace, compute_track, absl::StrCat("wait unit ", unit), "wait");
      SL_RETURN_IF_ERROR(current.gathered.Synchronize(*compute));
    }
    // "Compute": check every tensor element and fold it into a checksum.
    const FlatLayout& layout = layouts[unit];
    absl::Status checked;
    SL_RETURN_IF_ERROR(compute->Enqueue([&]() -> absl::Status {
      TraceSpan span(&trace, compute_track, absl::StrCat("forward unit ", unit), "compute");
      const auto* bits = current.unsharded.as<const uint16_t>();
      for (const FlatTensor& tensor : layout.tensors()) {
        for (size_t i = tensor.offset; i < tensor.end(); ++i) {
          const float expected =
              Bf16BitsToFloat(FloatToBf16Bits(Weight(static_cast<int>(unit), i)));
          const float got = Bf16BitsToFloat(bits[i]);
          if (got != expected) {
            return absl::InternalError(absl::StrCat("rank ", rank, " unit ", unit, " element ", i,
                                                    ": gathered ", got, ", expected ", expected));
          }
          report.checksum += got;
        }
      }
      return absl::OkStatus();
    }));
    SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> used, RecordEvent(*compute));
    current.unsharded.ReleaseAfter(std::move(used));  // back to the pool once compute is done
    trace.AddCounter("unsharded bytes", absl::Now(),
                     {{"in use", static_cast<double>(pool.stats().current_bytes)}});
  }
  SL_RETURN_IF_ERROR(gather->Synchronize(absl::Now() + absl::Seconds(60)));
  pool.Collect();
  report.pool = pool.stats();
  report.cache = pool.cache_stats();
  report.elapsed = absl::Now() - start;
  return absl::OkStatus();
}

absl::Status Run(const Options& options) {
  // Each unit: a square weight and a bias, like a linear layer; f32 master, 2 shards.
  std::vector<FlatLayout> layouts;
  for (int u = 0; u < options.units; ++u) {
    const int64_t w = options.width;
    std::vector<TensorSpec> specs = {{absl::StrCat("layer", u, ".weight"), {w, w}, DType::kBF16},
                                     {absl::StrCat("layer", u, ".bias"), {w}, DType::kBF16}};
    SL_ASSIGN_OR_RETURN(FlatLayout layout, FlatLayout::Create(specs, {.num_shards = kRanks,
                                                                      .element_dtype = DType::kF32,
                                                                      .alignment_bytes = 64}));
    layouts.push_back(std::move(layout));
  }
  std::printf("model: %d units, each %s\n", options.units,
              layouts[0].ToString().substr(0, layouts[0].ToString().find('\n')).c_str());

  SL_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<Communicator>> comms,
                      CreateLocalCommunicators(kRanks, {.timeout = absl::Seconds(60)}));
  std::vector<std::unique_ptr<TraceWriter>> traces;
  for (int r = 0; r < kRanks; ++r) traces.push_back(std::make_unique<TraceWriter>(r));
  std::vector<RankReport> reports(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      reports[r].status = RunRank(r, *comms[r], layouts, *traces[r], reports[r]);
      if (!reports[r].status.ok()) comms[r]->Abort(reports[r].status);
    });
  }
  for (std::thread& t : threads) t.join();

  const size_t unit_bytes = layouts[0].total_elements() * 2;
  for (int r = 0; r < kRanks; ++r) {
    const RankReport& rep = reports[r];
    SL_RETURN_IF_ERROR(Annotate(rep.status, absl::StrCat("rank ", r)));
    std::printf(
        "rank %d: %d units gathered in bf16 and verified in %s; checksum %.6f\n"
        "        pool: peak %lld bytes = %.2f unsharded units (limit %d), %lld allocations, "
        "%lld cache hits, %lld misses, %lld bytes in use at the end\n",
        r, options.units, absl::FormatDuration(rep.elapsed).c_str(), rep.checksum,
        static_cast<long long>(rep.pool.peak_bytes),
        static_cast<double>(rep.pool.peak_bytes) / unit_bytes, kPrefetch,
        static_cast<long long>(rep.pool.total_allocations), static_cast<long long>(rep.cache.hits),
        static_cast<long long>(rep.cache.misses), static_cast<long long>(rep.pool.current_bytes));
    if (rep.pool.peak_bytes >
        static_cast<int64_t>(kPrefetch * CachingPool::SizeClass(unit_bytes))) {
      return absl::InternalError("the pool held more unsharded units than the rate limit allows");
    }
  }
  if (reports[0].checksum != reports[1].checksum) {
    return absl::InternalError("ranks disagree on the gathered weights");
  }
  if (!options.trace_path.empty()) {
    std::vector<std::string> parts;
    for (int r = 0; r < kRanks; ++r) {
      parts.push_back(absl::StrCat(options.trace_path, ".rank", r));
      SL_RETURN_IF_ERROR(traces[r]->WriteFile(parts.back()));
    }
    SL_RETURN_IF_ERROR(MergeTraceFiles(parts, options.trace_path));
    for (const std::string& part : parts) std::remove(part.c_str());
    std::printf("trace: %s (open in https://ui.perfetto.dev)\n", options.trace_path.c_str());
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace shardline

int main(int argc, char** argv) {
  shardline::Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--trace" && has_value) {
      options.trace_path = argv[++i];
    } else if ((arg == "--units" || arg == "--width") && has_value &&
               absl::SimpleAtoi(argv[i + 1], arg == "--units" ? &options.units : &options.width) &&
               (arg == "--units" ? options.units : options.width) > 0) {
      ++i;
    } else {
      std::fprintf(stderr, "usage: %s [--trace out.json] [--units N>0] [--width W>0]\n", argv[0]);
      return 2;
    }
  }
  absl::Status status = shardline::Run(options);
  if (!status.ok()) {
    std::fprintf(stderr, "runtime_tour failed: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
