#include "collectives/collective_fingerprint.h"

#include "absl/strings/str_cat.h"

namespace shardline {
namespace {

void PutU64(uint8_t* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t GetU64(const uint8_t* in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(in[i]) << (8 * i);
  return v;
}

}  // namespace

absl::string_view CollectiveName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kBroadcast:
      return "broadcast";
    case CollectiveKind::kAllToAll:
      return "all_to_all";
    case CollectiveKind::kBarrier:
      return "barrier";
    case CollectiveKind::kSend:
      return "send";
    case CollectiveKind::kRecv:
      return "recv";
  }
  return "invalid";
}

bool IsPointToPoint(CollectiveKind kind) {
  return kind == CollectiveKind::kSend || kind == CollectiveKind::kRecv;
}

bool IsReduction(CollectiveKind kind) {
  return kind == CollectiveKind::kReduceScatter || kind == CollectiveKind::kAllReduce;
}

std::string CollectiveFingerprint::CallString() const {
  if (kind == CollectiveKind::kBarrier) return "barrier()";
  std::string out = absl::StrCat(CollectiveName(kind), "(count=", count, ", ", DTypeName(dtype));
  if (IsReduction(kind)) absl::StrAppend(&out, ", ", ReduceOpName(op));
  if (kind == CollectiveKind::kBroadcast) absl::StrAppend(&out, ", root=", root);
  if (kind == CollectiveKind::kSend) absl::StrAppend(&out, ", to=", root, ", tag=", key);
  if (kind == CollectiveKind::kRecv) {
    if (root == kAnySource) {
      absl::StrAppend(&out, ", from=any, tag=", key);
    } else {
      absl::StrAppend(&out, ", from=", root, ", tag=", key);
    }
  }
  out += ")";
  return out;
}

std::string CollectiveFingerprint::ToString() const {
  return absl::StrCat(CallString(), " #", seq);
}

void CollectiveFingerprint::Encode(uint8_t out[kEncodedSize]) const {
  out[0] = static_cast<uint8_t>(kind);
  out[1] = static_cast<uint8_t>(dtype);
  out[2] = static_cast<uint8_t>(op);
  out[3] = 0;
  const uint32_t r = static_cast<uint32_t>(root);
  for (int i = 0; i < 4; ++i) out[4 + i] = static_cast<uint8_t>(r >> (8 * i));
  PutU64(out + 8, seq);
  PutU64(out + 16, count);
  PutU64(out + 24, key);
}

absl::StatusOr<CollectiveFingerprint> CollectiveFingerprint::Decode(
    const uint8_t in[kEncodedSize]) {
  if (in[0] > static_cast<uint8_t>(CollectiveKind::kRecv) ||
      in[1] > static_cast<uint8_t>(DType::kI64) ||
      in[2] > static_cast<uint8_t>(ReduceOp::kProduct) || in[3] != 0) {
    return absl::InvalidArgumentError(absl::StrCat("malformed collective fingerprint (kind ", in[0],
                                                   ", dtype ", in[1], ", op ", in[2], ")"));
  }
  CollectiveFingerprint fp;
  fp.kind = static_cast<CollectiveKind>(in[0]);
  fp.dtype = static_cast<DType>(in[1]);
  fp.op = static_cast<ReduceOp>(in[2]);
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>(in[4 + i]) << (8 * i);
  fp.root = static_cast<int32_t>(r);
  fp.seq = GetU64(in + 8);
  fp.count = GetU64(in + 16);
  fp.key = GetU64(in + 24);
  return fp;
}

}  // namespace shardline
