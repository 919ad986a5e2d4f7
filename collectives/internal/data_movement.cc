#include "collectives/internal/data_movement.h"

#include <cstring>
#include <new>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/check.h"
#include "runtime/host_kernels.h"
#include "runtime/status.h"

namespace shardline::data_movement {
namespace {

void Copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
}

const uint8_t* Bytes(const void* p) { return static_cast<const uint8_t*>(p); }

}  // namespace

absl::Status WriteRankOutput(const CollectiveFingerprint& fp, size_t element_size,
                             absl::Span<const void* const> inputs, int rank, void* output) {
  const int n = static_cast<int>(inputs.size());
  const size_t chunk = fp.count * element_size;  // bytes per rank
  auto* out = static_cast<uint8_t*>(output);
  SL_CHECK(fp.kind != CollectiveKind::kAllReduce)
      << "an all_reduce is ReduceSlice and CopyIntoEach, not one rank's output";

  switch (fp.kind) {
    case CollectiveKind::kAllGather:
      // In place, rank s's input is slice s of its own output, which no copy writes.
      for (int s = 0; s < n; ++s) Copy(out + s * chunk, inputs[s], chunk);
      return absl::OkStatus();

    case CollectiveKind::kAllToAll:
      for (int s = 0; s < n; ++s) Copy(out + s * chunk, Bytes(inputs[s]) + rank * chunk, chunk);
      return absl::OkStatus();

    case CollectiveKind::kBroadcast:
      Copy(out, inputs[fp.root], chunk);
      return absl::OkStatus();

    case CollectiveKind::kReduceScatter:
      // In place, the output is this rank's own slice of its input, which no other rank reads
      // (and which ReduceMany may overwrite).
      return ReduceSlice(fp, element_size, inputs, rank * fp.count, fp.count, output);

    case CollectiveKind::kAllReduce:  // checked above
      break;

    case CollectiveKind::kBarrier:
      return absl::OkStatus();

    case CollectiveKind::kSend:  // not collectives: the backends move them themselves
    case CollectiveKind::kRecv:
      break;
  }
  return absl::InternalError(absl::StrCat(CollectiveName(fp.kind), " is not a collective"));
}

absl::Status ReduceSlice(const CollectiveFingerprint& fp, size_t element_size,
                         absl::Span<const void* const> inputs, size_t begin, size_t count,
                         void* out) {
  if (count == 0) return absl::OkStatus();
  const int n = static_cast<int>(inputs.size());
  std::vector<const void*> slices(n);
  for (int s = 0; s < n; ++s) slices[s] = Bytes(inputs[s]) + begin * element_size;
  SL_RETURN_IF_ERROR(ReduceMany(out, slices.data(), n, count, fp.dtype, fp.op));
  if (fp.op != ReduceOp::kAvg) return absl::OkStatus();
  return Scale(out, count, fp.dtype, 1.0 / n);
}

void CopyIntoEach(absl::Span<void* const> outputs, size_t offset, const void* src, size_t bytes) {
  for (void* output : outputs) Copy(static_cast<uint8_t*>(output) + offset, src, bytes);
}

absl::StatusOr<std::unique_ptr<uint8_t[]>> AllocateScratch(size_t bytes) {
  if (bytes == 0) return std::unique_ptr<uint8_t[]>();
  std::unique_ptr<uint8_t[]> scratch(new (std::nothrow) uint8_t[bytes]);
  if (scratch == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate the ", bytes, " bytes of the reduction's scratch"));
  }
  return scratch;
}

}  // namespace shardline::data_movement
