// File: collectives/process_mesh.h
// -----------------------------------------------------------------------------
// The 2-D (replicate × shard) process mesh of hybrid sharding. The world's ranks are laid out
// row-major: rank r sits in replicate row r / S and shard column r % S, S being the shard-group
// size. Each rank gets
//   shard()      the S ranks of its row: parameters are sharded over them (all-gather,
//                reduce-scatter)
//   replicate()  the R ranks of its column: they hold the same shard and all-reduce its gradient
// Full sharding is the mesh 1 × N, plain data parallelism (DDP) N × 1. The default S is the
// number of ranks per host, so that the bandwidth-hungry shard collectives stay within a
// machine and only the replicate all-reduce crosses the network.
//
//   SL_ASSIGN_OR_RETURN(ProcessMesh mesh, ProcessMesh::Create(world, /*shard_size=*/8, deadline));
//   mesh.shard()->AllGather(...);  mesh.replicate()->AllReduce(...);

#ifndef SHARDLINE_COLLECTIVES_PROCESS_MESH_H_
#define SHARDLINE_COLLECTIVES_PROCESS_MESH_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"

namespace shardline {

class ProcessMesh {
 public:
  // Splits `world` into the mesh (world->size() / shard_size) × shard_size. Collective over
  // `world`. InvalidArgument if shard_size < 1 or does not divide the world size.
  static absl::StatusOr<ProcessMesh> Create(std::shared_ptr<Communicator> world, int shard_size,
                                            absl::Time deadline);

  // A mesh of groups made elsewhere (an elastic job makes them per round): `shard` and
  // `replicate` must hold this rank (InvalidArgument if either is null); `world` carries what
  // spans the mesh (the scheduler's order check); null: `shard`. Collective over nothing.
  static absl::StatusOr<ProcessMesh> FromGroups(std::shared_ptr<Communicator> shard,
                                                std::shared_ptr<Communicator> replicate,
                                                std::shared_ptr<Communicator> world = nullptr);

  int replicate_size() const { return replicate_size_; }
  int shard_size() const { return shard_size_; }
  // This rank's column in its shard group and row in its replicate group.
  int shard_rank() const { return shard_->rank(); }
  int replicate_rank() const { return replicate_->rank(); }

  const std::shared_ptr<Communicator>& world() const { return world_; }
  const std::shared_ptr<Communicator>& shard() const { return shard_; }
  const std::shared_ptr<Communicator>& replicate() const { return replicate_; }

  // "2 x 4 (replicate x shard)".
  std::string ToString() const;

 private:
  ProcessMesh() = default;

  int replicate_size_ = 1;
  int shard_size_ = 1;
  std::shared_ptr<Communicator> world_;
  std::shared_ptr<Communicator> shard_;
  std::shared_ptr<Communicator> replicate_;
};

// The number of ranks per host, from the hostnames of all ranks (an all-gather over `world`,
// which must move host memory). FailedPrecondition if hosts run different numbers of ranks or a
// host's ranks are not contiguous (then no shard group fits inside one host), naming the host.
absl::StatusOr<int> RanksPerHost(Communicator& world, absl::Time deadline);

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_PROCESS_MESH_H_
