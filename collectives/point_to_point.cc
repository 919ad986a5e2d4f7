// Communicator::Send and Communicator::Recv: validation, numbering and recording of point-to-point
// operations (the rules in communicator.h); the backends move the data in Run().

#include <cstdint>
#include <limits>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "collectives/communicator.h"
#include "runtime/status.h"

namespace shardline {

absl::StatusOr<Work> Communicator::Send(const void* data, size_t count, DType dtype, int peer,
                                        Stream& stream, const PointToPointOptions& options) {
  return IssuePointToPoint(CollectiveKind::kSend, data, nullptr, count, dtype, peer, stream,
                           options);
}

absl::StatusOr<Work> Communicator::Recv(void* data, size_t count, DType dtype, int peer,
                                        Stream& stream, const PointToPointOptions& options) {
  return IssuePointToPoint(CollectiveKind::kRecv, nullptr, data, count, dtype, peer, stream,
                           options);
}

absl::Status Communicator::CheckPointToPoint(CollectiveKind kind, int peer,
                                             uint64_t match_tag) const {
  return absl::UnimplementedError(
      absl::StrCat("the ", backend(),
                   " backend has no point-to-point operations yet "
                   "(send and recv run on the local and ucx backends)"));
}

absl::StatusOr<Work> Communicator::IssuePointToPoint(CollectiveKind kind, const void* input,
                                                     void* output, size_t count, DType dtype,
                                                     int peer, Stream& stream,
                                                     const PointToPointOptions& options) {
  std::lock_guard<std::mutex> issue_lock(issue_mu_);
  SL_RETURN_IF_ERROR(status());
  const bool send = kind == CollectiveKind::kSend;
  std::string& call_site = call_sites_[static_cast<size_t>(kind)];
  if (call_site.empty()) {
    call_site =
        absl::StrCat(CollectiveName(kind), " on ", name_, " (rank ", rank_, " of ", size_, ")");
  }
  auto invalid = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(call_site, ": ", parts...));
  };
  const bool any = !send && peer == kAnySource;
  if (!any && (peer < 0 || peer >= size_)) {
    return invalid("peer ", peer, " is not a rank of this communicator (size ", size_, ")",
                   send ? "" : "; kAnySource (-1) receives from any rank");
  }
  if (any && size_ == 1) {
    return invalid("a receive from any rank in a group of one: there is no other rank");
  }
  if (peer == rank_) {
    return invalid("peer ", peer, " is this rank: it cannot ", send ? "send to" : "receive from",
                   " itself");
  }
  if (options.timeout < absl::ZeroDuration()) {
    return invalid("negative timeout ", absl::FormatDuration(options.timeout));
  }
  const size_t esize = DTypeSize(dtype);
  if (count > std::numeric_limits<size_t>::max() / 16 / esize) {
    return invalid("count ", count, " of ", DTypeName(dtype), " overflows the address space");
  }
  const size_t bytes = count * esize;
  if (bytes > 0 && (send ? input == nullptr : output == nullptr)) {
    return invalid("data is null but count is ", count);
  }
  if (absl::Status supported = CheckPointToPoint(kind, peer, options.match_tag); !supported.ok()) {
    return Annotate(supported, call_site);
  }
  SL_RETURN_IF_ERROR(CheckStream(stream));
  SL_RETURN_IF_ERROR(CheckBuffers(call_site, input, send ? bytes : 0, output, send ? 0 : bytes));
  if (&stream.clock() != &WallClock() && !AcceptsAnyClock()) {
    return invalid("stream '", stream.name(), "' runs on a ", stream.clock().name(),
                   " clock, but the ", backend(), " backend moves data in wall-clock time");
  }

  Op op;
  op.fingerprint.kind = kind;
  op.fingerprint.seq = next_p2p_seq_++;
  op.fingerprint.count = count;
  op.fingerprint.dtype = dtype;
  op.fingerprint.root = peer;
  op.fingerprint.key = options.match_tag;
  op.input = input;
  op.output = output;
  op.element_size = esize;
  op.input_count = send ? count : 0;
  op.output_count = send ? 0 : count;
  op.timeout = options.timeout == absl::ZeroDuration() ? timeout_ : options.timeout;
  if (!send) op.source = std::make_shared<std::atomic<int>>(-1);
  std::shared_ptr<std::atomic<int>> source = op.source;
  SL_ASSIGN_OR_RETURN(std::shared_ptr<Event> done, EnqueueAndRecord(op, stream, options.label));
  return Work(std::move(done), weak_from_this(), kind, op.fingerprint.seq, std::move(source));
}

}  // namespace shardline
