// File: scheduler/tune/internal/simulate_backend.h
// -----------------------------------------------------------------------------
// Private to scheduler/tune/ (not installed): what the simulation driver (simulate.cc) and its
// backends (simulate_backends.cc) share. One driver plays the framework for every rank; a
// Backend says where the ranks' streams, communicators and memory come from: virtual time and
// phantom memory (Simulate), or the local backend and host memory (RunOnHostBackend).

#ifndef SHARDLINE_SCHEDULER_TUNE_INTERNAL_SIMULATE_BACKEND_H_
#define SHARDLINE_SCHEDULER_TUNE_INTERNAL_SIMULATE_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "runtime/allocator.h"
#include "runtime/caching_pool.h"
#include "runtime/stream.h"
#include "runtime/virtual_time.h"
#include "scheduler/scheduler.h"
#include "scheduler/tune/counting_communicator.h"
#include "scheduler/tune/simulate.h"

namespace shardline::tune_internal {

// An allocator over `backing` with its own accounting: the driver's categories of device memory
// (shards, pools, optimizer state, activations) each keep their own peak while the backing
// allocator keeps the device's.
class SubAllocator final : public Allocator {
 public:
  SubAllocator(Allocator& backing, std::string name)
      : Allocator(backing.device(), std::move(name)), backing_(backing) {}
  ~SubAllocator() override;

 protected:
  absl::StatusOr<void*> AllocateRaw(size_t bytes, Stream* first_user) override;
  void DeallocateRaw(void* data, size_t bytes) override;

 private:
  Allocator& backing_;
  std::mutex mu_;
  absl::flat_hash_map<void*, Buffer> live_;
};

struct Rank {
  std::unique_ptr<Allocator> device;
  std::unique_ptr<SubAllocator> shards, gather_blocks, reduce_blocks, optimizer, activations;
  // CPU offload: host memory, with the offloaded shards and the optimizer state.
  std::unique_ptr<Allocator> host;
  std::unique_ptr<SubAllocator> host_shards, host_optimizer;
  std::unique_ptr<CachingPool> gather_pool, reduce_pool;
  std::unique_ptr<Stream> compute;
  std::shared_ptr<CollectiveCounter> counter;
  std::unique_ptr<Scheduler> scheduler;
  Buffer optimizer_state;
  std::vector<Buffer> activations_held;  // per forward use
  uint64_t master_shard_bytes = 0;
  size_t issues_seen = 0;
  std::vector<std::vector<std::string>> logs;  // per step
};

// Where ranks live. Subclasses own the timeline (if any) and must outlive the ranks.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> World(int size) = 0;
  // Representative mode: rank 0 of a world of `size`, alone (a vector of one).
  virtual absl::StatusOr<std::vector<std::shared_ptr<Communicator>>> Representative(
      int size, int shard_size) = 0;
  virtual std::unique_ptr<Allocator> DeviceMemory(int rank) = 0;
  virtual std::unique_ptr<Allocator> HostMemory(int rank) = 0;
  virtual absl::StatusOr<std::unique_ptr<Stream>> ComputeStream(int rank,
                                                                StreamOptions options) = 0;
  // SchedulerOptions::stream_factory of rank `rank` (null: the scheduler's default).
  virtual std::function<absl::StatusOr<std::unique_ptr<Stream>>(StreamOptions)> Factory(
      int rank) = 0;
  // Representative mode (virtual time): one rank stands for the `world_size` ranks.
  virtual void UseRepresentative(int /*world_size*/) {}
  // A compute op of `flops` FLOPs that takes `duration` (virtual time; the host backend runs
  // nothing).
  virtual absl::Status Compute(Stream& stream, std::string name, uint64_t flops,
                               absl::Duration duration) = 0;
  // Runs everything enqueued so far to completion.
  virtual absl::Status Drain(std::vector<Rank>& ranks) = 0;
  // For LastStepMetrics and the host's waits for its compute.
  virtual absl::Time Deadline() = 0;
};

// The backend of Simulate: the ranks on `timeline` (virtual streams, the cluster's sim
// communicators, phantom memory). `cluster` must outlive it.
std::unique_ptr<Backend> CreateVirtualBackend(const SimCluster& cluster,
                                              std::unique_ptr<VirtualTimeline> timeline);
// The backend of RunOnHostBackend: local communicators, host streams, host memory.
std::unique_ptr<Backend> CreateHostBackend();

}  // namespace shardline::tune_internal

#endif  // SHARDLINE_SCHEDULER_TUNE_INTERNAL_SIMULATE_BACKEND_H_
