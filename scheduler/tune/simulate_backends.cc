// Where the simulation driver's ranks live (scheduler/tune/internal/simulate_backend.h): on
// virtual time with phantom memory, or on the local backend with host memory.

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/local/local_communicator.h"
#include "runtime/config.h"
#include "runtime/phantom_allocator.h"
#include "runtime/status.h"
#include "runtime/virtual_sharing.h"
#include "scheduler/tune/internal/simulate_backend.h"

namespace shardline::tune_internal {
namespace {

class VirtualBackend final : public Backend {
 public:
  VirtualBackend(const SimCluster& cluster, std::unique_ptr<VirtualTimeline> timeline)
      : cluster_(cluster), timeline_(std::move(timeline)) {}

  absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> World(int size) override {
    return cluster_.CreateWorld(*timeline_, size);
  }
  absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> Representative(
      int size, int shard_size) override {
    // ProcessMesh::Create's two splits of the world: its row (shard group), then its column.
    auto split_call = [shard_size](uint64_t split, int rank) {
      return split == 0 ? std::make_pair(rank / shard_size, rank)
                        : std::make_pair(rank % shard_size, rank);
    };
    SL_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm,
                        cluster_.CreateRepresentative(*timeline_, size, 0, split_call));
    return std::vector<std::shared_ptr<Communicator>>{std::move(comm)};
  }
  std::unique_ptr<Allocator> DeviceMemory(int rank) override {
    return CreatePhantomAllocator(Device::Host(), absl::StrCat("rank", rank, ".device"));
  }
  std::unique_ptr<Allocator> HostMemory(int rank) override {
    return CreatePhantomAllocator(Device::Host(), absl::StrCat("rank", rank, ".host"));
  }
  absl::StatusOr<std::unique_ptr<Stream>> ComputeStream(int rank, StreamOptions options) override {
    return Create(*timeline_, cluster_.HostOf(rank), std::move(options));
  }
  std::function<absl::StatusOr<std::unique_ptr<Stream>>(StreamOptions)> Factory(int rank) override {
    VirtualTimeline* tl = timeline_.get();
    return [tl, host = cluster_.HostOf(rank)](StreamOptions so) {
      return Create(*tl, host, std::move(so));
    };
  }
  void UseRepresentative(int world_size) override {
    const int host = cluster_.HostOf(0);
    if (host < 0 || !(timeline_->options().host_cores > 0)) return;
    timeline_->sharing().SetCapacity(
        VirtualSharing::Host(host),
        timeline_->options().host_cores / cluster_.RanksOnHost(world_size));
  }
  absl::Status Compute(Stream& stream, std::string name, uint64_t flops,
                       absl::Duration duration) override {
    return stream.Submit({.name = std::move(name),
                          .kind = StreamOpKind::kCompute,
                          .flops = flops,
                          .duration = duration,
                          .run = [] { return absl::OkStatus(); }});
  }
  absl::Status Drain(std::vector<Rank>&) override { return timeline_->RunUntilIdle(); }
  absl::Time Deadline() override { return absl::InfiniteFuture(); }

 private:
  static absl::StatusOr<std::unique_ptr<Stream>> Create(VirtualTimeline& timeline, int host,
                                                        StreamOptions options) {
    if (host < 0) return CreateVirtualStream(timeline, std::move(options));
    return CreateVirtualStream(timeline, std::move(options), host);
  }

  const SimCluster& cluster_;
  std::unique_ptr<VirtualTimeline> timeline_;
};

class HostBackend final : public Backend {
 public:
  absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> World(int size) override {
    return CreateLocalCommunicators(size);
  }
  absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> Representative(int, int) override {
    return absl::InvalidArgumentError(
        "the host backend runs every rank: a representative rank exists only on virtual time");
  }
  std::unique_ptr<Allocator> DeviceMemory(int rank) override {
    return CreateHostAllocator(64, absl::StrCat("rank", rank, ".host"));
  }
  std::unique_ptr<Allocator> HostMemory(int rank) override {
    return CreateHostAllocator(64, absl::StrCat("rank", rank, ".offload"));
  }
  absl::StatusOr<std::unique_ptr<Stream>> ComputeStream(int, StreamOptions options) override {
    return CreateHostStream(std::move(options));
  }
  std::function<absl::StatusOr<std::unique_ptr<Stream>>(StreamOptions)> Factory(int) override {
    return nullptr;
  }
  absl::Status Compute(Stream& stream, std::string name, uint64_t flops, absl::Duration) override {
    return stream.Submit(
        {.name = std::move(name), .kind = StreamOpKind::kCompute, .flops = flops, .run = [] {
           return absl::OkStatus();
         }});
  }
  absl::Status Drain(std::vector<Rank>& ranks) override {
    for (Rank& r : ranks) SL_RETURN_IF_ERROR(r.compute->Synchronize(DefaultDeadline()));
    return absl::OkStatus();
  }
  absl::Time Deadline() override { return DefaultDeadline(); }
};

}  // namespace

SubAllocator::~SubAllocator() { DrainPending(); }

absl::StatusOr<void*> SubAllocator::AllocateRaw(size_t bytes, Stream* /*first_user*/) {
  SL_ASSIGN_OR_RETURN(Buffer block, backing_.Allocate(bytes));
  void* data = block.data();
  std::lock_guard<std::mutex> lock(mu_);
  live_.emplace(data, std::move(block));
  return data;
}

void SubAllocator::DeallocateRaw(void* data, size_t /*bytes*/) {
  Buffer block;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(data);
  block = std::move(it->second);
  live_.erase(it);
}

std::unique_ptr<Backend> CreateVirtualBackend(const SimCluster& cluster,
                                              std::unique_ptr<VirtualTimeline> timeline) {
  return std::make_unique<VirtualBackend>(cluster, std::move(timeline));
}

std::unique_ptr<Backend> CreateHostBackend() { return std::make_unique<HostBackend>(); }

}  // namespace shardline::tune_internal
