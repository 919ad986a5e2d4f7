// gloo_perf: Gloo's collectives in the nccl-tests columns, for bench/compare.
//   shardline-launch -n 2 gloo_perf all -b 4K -e 64M -f 4 -n 20 -w 5 -c 1
// Ranks come from RANK / WORLD_SIZE (shardline-launch, torchrun); the rendezvous is a
// gloo::rendezvous::FileStore in $GLOO_STORE_DIR (default /tmp/shardline-gloo-$MASTER_PORT), the
// transport Gloo's TCP device on loopback, as PyTorch's Gloo process group uses them.
//   all_gather      gloo::allgather (in place: no input, this rank's block already in the output)
//   all_reduce      gloo::allreduce (ring; in place: outputs only)
//   reduce_scatter  gloo::ReduceScatterHalvingDoubling(ctx, {buf}, count = n * c, recvElems =
//                   {c, ..., c}): in place only (out-of-place prints N/A). Its contract (see
//                   reduce_scatter.h's distribution phase, and Gloo's own benchmark verify()):
//                   rank r's reduced block -- elements [sum(recvElems[0..r)), +recvElems[r]) of
//                   the sum -- ends at the START of buf, buf[0, recvElems[r]), on every rank and
//                   rank count; the rest of buf is scratch (partial sums, not the input).
//                   Recursive halving leaves rank r holding global chunk bitreverse(r) at offset
//                   bitreverse(r) * c; the distribution phase then sends each chunk to its owner,
//                   which copies it to offset 0. So "block r at offset r" holds only where
//                   bitreverse(r) == r (ranks 0 and 3 of 4; both ranks of 2, where rank 1's block
//                   is also still at offset c), and "block at offset bitreverse(r)" finds the
//                   right values under the wrong index -- hence half the elements wrong at 4 ranks.

#include <sys/stat.h>

#include <map>
#include <memory>

#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/config.h"
#include "gloo/math.h"
#include "gloo/reduce_scatter.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/transport/tcp/device.h"
#include "report.h"

namespace {

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : fallback;
}

class GlooPeer {
 public:
  GlooPeer() {
    const int rank = EnvInt("RANK", 0);
    const int size = EnvInt("WORLD_SIZE", 1);
    std::string dir = std::getenv("GLOO_STORE_DIR") != nullptr
                          ? std::getenv("GLOO_STORE_DIR")
                          : "/tmp/shardline-gloo-" + std::to_string(EnvInt("MASTER_PORT", 0));
    mkdir(dir.c_str(), 0700);
    gloo::rendezvous::FileStore store(dir);
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(std::chrono::seconds(120));
    context->connectFullMesh(store, device);
    context_ = context;
    scalar_ = std::vector<double>(1);
  }
  int rank() const { return context_->rank; }
  int size() const { return context_->size; }
  void Barrier() { AverageOverRanks(0); }
  double AverageOverRanks(double v) {
    scalar_[0] = v;
    gloo::AllreduceOptions opts(context_);
    opts.setOutput(scalar_.data(), 1);
    opts.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<double>));
    opts.setTag(1);
    gloo::allreduce(opts);
    return scalar_[0] / size();
  }
  long SumOverRanks(long v) {
    return static_cast<long>(AverageOverRanks(double(v)) * size() + 0.5);
  }

  bool Supports(peer::Kind k, bool in_place) {
    switch (k) {
      case peer::Kind::kAllGather:
      case peer::Kind::kAllReduce:
        return true;
      case peer::Kind::kReduceScatter:
        return in_place;
      default:
        return false;
    }
  }
  size_t InPlaceInput(peer::Kind k, size_t param) {
    return k == peer::Kind::kAllGather ? size_t(rank()) * param : 0;
  }
  // Reduce-scatter leaves this rank's block at the start of the buffer (see the top comment),
  // as MPI_Reduce_scatter_block with MPI_IN_PLACE does; all-reduce and all-gather fill it whole.
  size_t InPlaceOutput(peer::Kind, size_t) { return 0; }

  void Run(peer::Kind k, bool ip, float* send, float* recv, size_t param) {
    const int n = size();
    switch (k) {
      case peer::Kind::kAllGather: {
        if (param == 0) return;
        gloo::AllgatherOptions opts(context_);
        if (!ip) opts.setInput(send, param);
        opts.setOutput(recv, param * n);
        gloo::allgather(opts);
        return;
      }
      case peer::Kind::kAllReduce: {
        if (param == 0) return;
        gloo::AllreduceOptions opts(context_);
        if (!ip) opts.setInput(send, param);
        opts.setOutput(recv, param);
        opts.setReduceFunction(
            static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
        gloo::allreduce(opts);
        return;
      }
      case peer::Kind::kReduceScatter: {
        if (param == 0) return;
        // The algorithm object binds its buffers at construction (as a framework keeps one per
        // tensor); one per size, reused across iterations. Its counts are ints (count * 4 bytes
        // must stay below 2 GiB). Bytes moved are those of a plain reduce-scatter of n * c
        // elements, so busbw uses nccl-tests' size = n * c * 4 and factor (n - 1) / n.
        auto& algo = reduce_scatter_[param];
        if (algo == nullptr) {
          algo = std::make_unique<gloo::ReduceScatterHalvingDoubling<float>>(
              context_, std::vector<float*>{recv}, static_cast<int>(param * n),
              std::vector<int>(n, static_cast<int>(param)));
        }
        algo->run();
        return;
      }
      default:
        return;
    }
  }

 private:
  std::shared_ptr<gloo::Context> context_;
  std::vector<double> scalar_;
  std::map<size_t, std::unique_ptr<gloo::ReduceScatterHalvingDoubling<float>>> reduce_scatter_;
};

}  // namespace

int main(int argc, char** argv) {
  const peer::Flags flags = peer::ParseFlags(argc, argv);
  GlooPeer gloo;
  if (gloo.rank() == 0)
    std::printf("# gloo_perf: Gloo %d.%d.%d, TCP transport on loopback\n", GLOO_VERSION_MAJOR,
                GLOO_VERSION_MINOR, GLOO_VERSION_PATCH);
  const long errors = peer::Sweep(gloo, flags, "gloo");
  gloo.Barrier();
  return errors ? 1 : 0;
}
