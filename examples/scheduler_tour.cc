// The scheduler API in one page: two ranks (threads over the local backend) train four layers of
// one weight each with SGD under full sharding, a prefetch depth of 1 and a 1 MiB budget. The
// compute stream is the calling thread (a CPU framework); on a GPU it is the framework's
// cudaStream_t wrapped as a Stream (runtime/cuda/cuda_stream.h). See docs/scheduler.md.
#include <cstdio>
#include <thread>
#include <vector>

#include "collectives/local/local_communicator.h"
#include "runtime/status.h"
#include "scheduler/scheduler.h"

namespace sl = shardline;

absl::Status Rank(std::shared_ptr<sl::Communicator> world) {
  SL_ASSIGN_OR_RETURN(auto compute, sl::CreateCallerStream({.name = "compute"}));
  SL_ASSIGN_OR_RETURN(auto fsdp, sl::Scheduler::Create(world, *compute, {.budget_bytes = 1 << 20},
                                                       absl::Now() + absl::Seconds(30)));
  std::vector<float> init(64 * 64, 0.01f);
  for (int i = 0; i < 4; ++i) {
    SL_ASSIGN_OR_RETURN(int id,
                        fsdp->RegisterUnit({.name = "layer" + std::to_string(i),
                                            .tensors = {{.name = "w", .shape = {64, 64}}}}));
    const void* values[] = {init.data()};
    SL_RETURN_IF_ERROR(fsdp->unit(id).SetShardFromTensors(values));
  }
  for (int step = 0; step < 3; ++step) {
    float activation = 1;
    for (int i = 0; i < 4; ++i) {  // forward: each layer reads its gathered weight
      SL_RETURN_IF_ERROR(fsdp->PreForward(i));
      SL_ASSIGN_OR_RETURN(sl::TensorView w, fsdp->unit(i).View("w"));
      activation *= static_cast<const float*>(w.data)[world->rank()] * 64;
      SL_RETURN_IF_ERROR(fsdp->PostForward(i));
    }
    for (int i = 3; i >= 0; --i) {  // backward: gradients are added into the unsharded grad
      SL_RETURN_IF_ERROR(fsdp->PreBackward(i));
      SL_ASSIGN_OR_RETURN(sl::TensorView g, fsdp->unit(i).GradView("w"));
      for (size_t e = 0; e < g.numel; ++e) static_cast<float*>(g.data)[e] += activation;
      SL_RETURN_IF_ERROR(fsdp->PostBackward(i));
    }
    SL_RETURN_IF_ERROR(fsdp->FinishBackward());  // the reduce-scatters are done after this
    for (int i = 0; i < 4; ++i) {                // SGD on this rank's shards
      sl::FlatShardView p = fsdp->unit(i).master_shard();
      SL_ASSIGN_OR_RETURN(sl::FlatShardView g, fsdp->unit(i).ShardGrad());
      for (size_t e = 0; e < p.elements; ++e) {
        static_cast<float*>(p.data)[e] -= 0.001f * static_cast<const float*>(g.data)[e];
      }
    }
    SL_RETURN_IF_ERROR(fsdp->ZeroGrad());
    SL_ASSIGN_OR_RETURN(sl::StepMetrics m, fsdp->LastStepMetrics(absl::Now() + absl::Seconds(30)));
    std::printf("rank %d: activation %.4f, %s\n", world->rank(), activation, m.ToString().c_str());
  }
  return absl::OkStatus();
}

int main() {
  auto comms = sl::CreateLocalCommunicators(2);
  if (!comms.ok()) return 1;
  std::vector<absl::Status> results(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) ranks.emplace_back([&, r] { results[r] = Rank((*comms)[r]); });
  for (auto& rank : ranks) rank.join();
  for (const absl::Status& status : results) {
    if (!status.ok()) std::fprintf(stderr, "scheduler_tour: %s\n", status.ToString().c_str());
  }
  return results[0].ok() && results[1].ok() ? 0 : 1;
}
