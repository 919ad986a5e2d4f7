// SyncModuleStates (scheduler/sync_states.h): bucketed broadcasts of the root's tensors.

#include "scheduler/sync_states.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"

namespace shardline {
namespace {

// Calls fn(tensor index, offset within the tensor, stream offset, length) for every part of
// stream bytes [begin, end), in order. `starts[i]` is tensor i's first stream byte.
template <typename Fn>
void ForEachPart(const std::vector<uint64_t>& starts, const std::vector<uint64_t>& sizes,
                 uint64_t begin, uint64_t end, Fn fn) {
  size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
  for (; i < starts.size() && starts[i] < end; ++i) {
    const uint64_t lo = std::max(begin, starts[i]);
    const uint64_t hi = std::min(end, starts[i] + sizes[i]);
    if (hi > lo) fn(i, lo - starts[i], lo, hi - lo);
  }
}

}  // namespace

absl::Status SyncModuleStates(Communicator& comm, absl::Span<const SyncTensor> tensors,
                              const SyncModuleStatesOptions& options, absl::Time deadline) {
  const std::string what = absl::StrCat("sync_module_states on ", comm.name(), " (rank ",
                                        comm.rank(), " of ", comm.size(), ")");
  if (options.bucket_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": bucket_bytes is 0"));
  }
  if (options.root < 0 || options.root >= comm.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": root ", options.root, " is not a rank of the group"));
  }
  std::vector<uint64_t> starts(tensors.size()), sizes(tensors.size());
  uint64_t total = 0;
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const SyncTensor& t = tensors[i];
    if (static_cast<size_t>(t.dtype) >= kAllDTypes.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": tensor ", i, " has an invalid dtype"));
    }
    sizes[i] = t.count * DTypeSize(t.dtype);
    if (t.data == nullptr && sizes[i] > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": tensor ", i, " has ", t.count, " elements and no data"));
    }
    starts[i] = total;
    total += sizes[i];
    for (int b = 0; b < 8; ++b) {
      hash ^= (sizes[i] >> (8 * b)) & 0xFF;
      hash *= 0x100000001b3ULL;
    }
  }

  std::unique_ptr<Stream> own_stream;
  Stream* stream = options.stream;
  if (stream == nullptr) {
    SL_ASSIGN_OR_RETURN(own_stream, CreateCallerStream({.name = "sync_module_states"}));
    stream = own_stream.get();
  }
  auto wait = [&](absl::StatusOr<Work> work) -> absl::Status {
    if (!work.ok()) return work.status();
    return work->Wait(deadline);
  };
  auto timeout = [&] { return std::max(deadline - absl::Now(), absl::Milliseconds(1)); };

  // Every rank's (tensor count, total bytes, size hash), compared with the root's.
  const uint64_t mine[3] = {tensors.size(), total, hash};
  std::vector<uint64_t> all(3 * comm.size());
  CollectiveOptions check;
  check.timeout = timeout();
  check.tag = options.tag;
  SL_RETURN_IF_ERROR(
      Annotate(wait(comm.AllGather(mine, all.data(), 3, DType::kI64, *stream, check)), what));
  const uint64_t* root = &all[3 * options.root];
  for (int r = 0; r < comm.size(); ++r) {
    const uint64_t* theirs = &all[3 * r];
    if (theirs[0] != root[0] || theirs[1] != root[1] || theirs[2] != root[2]) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": rank ", r, " has ", theirs[0], " tensors of ", theirs[1],
          " bytes, the root (rank ", options.root, ") ", root[0], " tensors of ", root[1], " bytes",
          theirs[0] == root[0] && theirs[1] == root[1] ? " (sizes in another order)" : "",
          "; every rank passes tensors of the same sizes"));
    }
  }

  const bool is_root = comm.rank() == options.root;
  std::vector<char> bucket;
  for (uint64_t begin = 0; begin < total; begin += options.bucket_bytes) {
    const uint64_t end = std::min<uint64_t>(total, begin + options.bucket_bytes);
    // Inside one tensor: broadcast in place.
    const size_t first = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    BroadcastOptions bo;
    bo.root = options.root;
    bo.timeout = timeout();
    bo.tag = options.tag;
    if (end <= starts[first] + sizes[first]) {
      char* p = static_cast<char*>(tensors[first].data) + (begin - starts[first]);
      SL_RETURN_IF_ERROR(
          Annotate(wait(comm.Broadcast(p, end - begin, DType::kU8, *stream, bo)), what));
      continue;
    }
    bucket.resize(end - begin);
    if (is_root) {
      ForEachPart(starts, sizes, begin, end, [&](size_t i, uint64_t off, uint64_t at, uint64_t n) {
        std::memcpy(&bucket[at - begin], static_cast<const char*>(tensors[i].data) + off, n);
      });
    }
    SL_RETURN_IF_ERROR(Annotate(
        wait(comm.Broadcast(bucket.data(), bucket.size(), DType::kU8, *stream, bo)), what));
    if (!is_root) {
      ForEachPart(starts, sizes, begin, end, [&](size_t i, uint64_t off, uint64_t at, uint64_t n) {
        std::memcpy(static_cast<char*>(tensors[i].data) + off, &bucket[at - begin], n);
      });
    }
  }
  return absl::OkStatus();
}

}  // namespace shardline
