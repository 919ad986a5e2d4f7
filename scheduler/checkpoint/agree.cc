// The outcome exchange (scheduler/checkpoint/agree.h).

#include "scheduler/checkpoint/agree.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"
#include "scheduler/checkpoint/internal/device_staging.h"

namespace shardline {
namespace {

// Per rank: u32 status code, u32 message length, u64 fingerprint, the message (truncated), then
// the phase's extra bytes.
constexpr size_t kMessageBytes = 496;
constexpr size_t kHeaderBytes = 16 + kMessageBytes;

}  // namespace

void PutLittleEndian(char* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
}

uint64_t GetLittleEndian(const char* in, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(in[i])) << (8 * i);
  return v;
}

absl::Status AgreeOnOutcome(Communicator& comm, Stream& stream, absl::Status mine,
                            absl::string_view what, uint64_t fingerprint,
                            absl::string_view mismatch, const std::string& extra,
                            size_t extra_bytes, std::vector<std::string>* all,
                            absl::Time deadline) {
  const int n = comm.size();
  const size_t per = kHeaderBytes + extra_bytes;
  std::string send(per, '\0');
  const absl::string_view message = mine.message().substr(0, kMessageBytes);
  PutLittleEndian(&send[0], static_cast<uint32_t>(mine.code()), 4);
  PutLittleEndian(&send[4], message.size(), 4);
  PutLittleEndian(&send[8], fingerprint, 8);
  if (!message.empty()) std::memcpy(&send[16], message.data(), message.size());
  std::memcpy(&send[kHeaderBytes], extra.data(), std::min(extra.size(), extra_bytes));
  std::string recv(per * n, '\0');
  CollectiveOptions options;
  options.timeout = std::max(deadline - absl::Now(), absl::Milliseconds(1));
  // (Through the device's memory when the world moves a device's: nccl, ucx staged.)
  absl::Status exchanged = checkpoint_internal::AllGatherHostBytes(
      comm, stream, send.data(), recv.data(), per, options, deadline);
  if (!mine.ok()) return mine;
  if (!exchanged.ok()) return Annotate(exchanged, absl::StrCat(what, ": exchanging outcomes"));
  const uint64_t fingerprint0 = GetLittleEndian(&recv[8], 8);
  for (int r = 0; r < n; ++r) {
    const char* p = &recv[per * r];
    const auto code = static_cast<absl::StatusCode>(GetLittleEndian(p, 4));
    if (code != absl::StatusCode::kOk) {
      const size_t length = std::min<size_t>(GetLittleEndian(p + 4, 4), kMessageBytes);
      return MarkPeerError(absl::Status(code, absl::StrCat("failed on rank ", r, ": ",
                                                           absl::string_view(p + 16, length))),
                           absl::StrCat(r));
    }
    if (GetLittleEndian(p + 8, 8) != fingerprint0) {
      return absl::FailedPreconditionError(absl::StrCat(what, ": rank ", r, " ", mismatch));
    }
  }
  if (all != nullptr) {
    all->assign(n, std::string());
    for (int r = 0; r < n; ++r) (*all)[r] = recv.substr(per * r + kHeaderBytes, extra_bytes);
  }
  return absl::OkStatus();
}

}  // namespace shardline
