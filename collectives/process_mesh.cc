#include "collectives/process_mesh.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"

namespace shardline {

absl::StatusOr<ProcessMesh> ProcessMesh::Create(std::shared_ptr<Communicator> world, int shard_size,
                                                absl::Time deadline) {
  if (world == nullptr) return absl::InvalidArgumentError("ProcessMesh::Create: null world");
  const int n = world->size();
  if (shard_size < 1 || n % shard_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("process mesh: shard-group size ", shard_size,
                                                   " does not divide the world size ", n));
  }
  const int r = world->rank();
  ProcessMesh mesh;
  mesh.shard_size_ = shard_size;
  mesh.replicate_size_ = n / shard_size;
  // Both splits are collective over the world, in the same order on every rank.
  SL_ASSIGN_OR_RETURN(mesh.shard_, world->Split(/*color=*/r / shard_size, /*key=*/r, deadline));
  SL_ASSIGN_OR_RETURN(mesh.replicate_, world->Split(/*color=*/r % shard_size, /*key=*/r, deadline));
  mesh.world_ = std::move(world);
  return mesh;
}

absl::StatusOr<ProcessMesh> ProcessMesh::FromGroups(std::shared_ptr<Communicator> shard,
                                                    std::shared_ptr<Communicator> replicate,
                                                    std::shared_ptr<Communicator> world) {
  if (shard == nullptr || replicate == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("ProcessMesh::FromGroups: the ",
                                                   shard == nullptr ? "shard" : "replicate",
                                                   " group is null"));
  }
  ProcessMesh mesh;
  mesh.shard_size_ = shard->size();
  mesh.replicate_size_ = replicate->size();
  mesh.world_ = world != nullptr ? std::move(world) : shard;
  mesh.shard_ = std::move(shard);
  mesh.replicate_ = std::move(replicate);
  return mesh;
}

std::string ProcessMesh::ToString() const {
  return absl::StrCat(replicate_size_, " x ", shard_size_, " (replicate x shard)");
}

absl::StatusOr<int> RanksPerHost(Communicator& world, absl::Time deadline) {
  constexpr size_t kNameBytes = 256;
  std::vector<char> mine(kNameBytes, '\0');
  if (gethostname(mine.data(), kNameBytes - 1) != 0) {
    return absl::InternalError(absl::StrCat("gethostname failed: ", std::strerror(errno)));
  }
  const int n = world.size();
  std::vector<char> all(kNameBytes * n);
  SL_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream,
                      CreateCallerStream({.name = "ranks_per_host"}));
  CollectiveOptions options;
  options.timeout = std::max(deadline - absl::Now(), absl::Milliseconds(1));
  SL_ASSIGN_OR_RETURN(Work work, world.AllGather(mine.data(), all.data(), kNameBytes, DType::kU8,
                                                 *stream, options));
  SL_RETURN_IF_ERROR(work.Wait(deadline));
  auto host = [&](int rank) { return std::string(all.data() + kNameBytes * rank); };

  // Runs of equal hostnames must all have the same length and no host may appear twice.
  int per_host = 0;
  std::vector<std::string> seen;
  for (int begin = 0; begin < n;) {
    int end = begin;
    while (end < n && host(end) == host(begin)) ++end;
    if (std::find(seen.begin(), seen.end(), host(begin)) != seen.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("ranks of host ", host(begin), " are not contiguous (rank ", begin,
                       " is on it again): no shard group can stay within one host"));
    }
    seen.push_back(host(begin));
    if (per_host != 0 && end - begin != per_host) {
      return absl::FailedPreconditionError(absl::StrCat("host ", host(begin), " runs ", end - begin,
                                                        " ranks but host ", host(0), " runs ",
                                                        per_host));
    }
    per_host = end - begin;
    begin = end;
  }
  return per_host;
}

}  // namespace shardline
