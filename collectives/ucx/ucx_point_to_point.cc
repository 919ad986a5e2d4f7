#include "collectives/ucx/internal/ucx_point_to_point.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "runtime/clock.h"
#include "runtime/status.h"

namespace shardline::ucx_internal {
namespace {

constexpr uint64_t kSourceBits = uint64_t{0xFFFF} << 44;
constexpr uint64_t kDTypeBits = uint64_t{0xFF} << 36;
// How many delivered sends' batches (each keeping up to Batch::kRetainBytes) wait for reuse.
constexpr size_t kFreeBatches = 8;
// The longest sleep of a receive: another thread progressing the worker may take the event that
// announced its message.
constexpr absl::Duration kLongestSleep = absl::Milliseconds(5);

uint64_t MessageTag(int source, DType dtype, uint64_t tag, Phase phase = Phase::kPointToPoint) {
  return (static_cast<uint64_t>(phase) << 60) | (static_cast<uint64_t>(source) << 44) |
         (static_cast<uint64_t>(dtype) << 36) | (tag & kMaxMessageTag);
}

// The fin of descriptor `number` of rank `sender`'s sends, sent by `receiver`.
uint64_t FinTag(int receiver, uint64_t number) {
  return (static_cast<uint64_t>(Phase::kPointToPointFin) << 60) |
         (static_cast<uint64_t>(receiver) << 44) | (number & ((uint64_t{1} << 44) - 1));
}

// What a descriptor message carries: where the copy of the data is in the sender, its length,
// and the number the fin must carry.
struct Descriptor {
  uint64_t address;
  uint64_t bytes;
  uint64_t number;
};

}  // namespace

PointToPoint::~PointToPoint() {
  std::lock_guard<std::mutex> lock(mu_);
  for (std::unique_ptr<Batch>& batch : sending_) {
    if (!transport_.Reap(*batch)) transport_.Abandon(std::move(batch));
  }
}

void PointToPoint::Flush(absl::Time deadline, absl::FunctionRef<bool()> healthy) {
  while (true) {
    ReapSends();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (sending_.empty()) return;
    }
    if (!healthy() || absl::Now() >= deadline) return;
    if (!transport_.Progress()) transport_.Sleep(std::min(deadline, absl::Now() + kLongestSleep));
  }
}

std::unique_ptr<Batch> PointToPoint::TakeBatch() {
  std::unique_ptr<Batch> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      batch = std::move(free_.back());
      free_.pop_back();
    }
  }
  if (batch == nullptr) batch = std::make_unique<Batch>();
  batch->set_limit_bytes(tuning_.staging_limit_bytes);
  return batch;
}

void PointToPoint::ReapSends() {
  std::lock_guard<std::mutex> lock(mu_);
  auto delivered =
      std::partition(sending_.begin(), sending_.end(),
                     [&](const std::unique_ptr<Batch>& b) { return !transport_.Reap(*b); });
  for (auto it = delivered; it != sending_.end(); ++it) {
    if (free_.size() == kFreeBatches) break;
    (*it)->Reset();
    free_.push_back(std::move(*it));
  }
  sending_.erase(delivered, sending_.end());
}

absl::Status PointToPoint::Send(const CollectiveFingerprint& fp, const void* data,
                                size_t element_size, const CollectiveHooks& hooks) {
  ReapSends();
  const size_t bytes = fp.count * element_size;
  std::unique_ptr<Batch> batch = TakeBatch();
  uint8_t* copy = nullptr;
  if (bytes > 0) {
    absl::StatusOr<uint8_t*> buffer = batch->Buffer(bytes);
    if (!buffer.ok()) return Annotate(buffer.status(), hooks.describe());
    copy = *buffer;
    std::memcpy(copy, data, bytes);
  }
  Completion* c = batch->Add(fp.root, /*is_send=*/true);
  if (bytes >= tuning_.small_bytes && transport_.PulledBy(fp.root)) {
    // The receiver reads the copy: post the fin's receive first, then the descriptor.
    absl::StatusOr<uint8_t*> buffers = batch->Buffer(sizeof(Descriptor) + sizeof(uint64_t));
    if (!buffers.ok()) return Annotate(buffers.status(), hooks.describe());
    auto* descriptor = reinterpret_cast<Descriptor*>(*buffers);
    {
      std::lock_guard<std::mutex> lock(mu_);
      *descriptor = {reinterpret_cast<uint64_t>(copy), bytes, reads_++};
    }
    Completion* fin = batch->Add(fp.root, /*is_send=*/false);
    SL_RETURN_IF_ERROR(transport_.Recv(fp.root, *buffers + sizeof(Descriptor), sizeof(uint64_t),
                                       FinTag(fp.root, descriptor->number), fin));
    SL_RETURN_IF_ERROR(transport_.Send(
        fp.root, descriptor, sizeof(Descriptor),
        MessageTag(transport_.rank(), fp.dtype, fp.key, Phase::kPointToPointRead), c));
  } else {
    SL_RETURN_IF_ERROR(
        transport_.Send(fp.root, copy, bytes, MessageTag(transport_.rank(), fp.dtype, fp.key), c));
  }
  if (c->done.load(std::memory_order_acquire) && c->status != UCS_OK) {
    return MarkPeerError(
        absl::UnavailableError(absl::StrCat(hooks.describe(), ": sending to rank ", fp.root,
                                            " failed (ucx: ", UcxError(c->status), ")")),
        absl::StrCat(fp.root));
  }
  const bool pending = !c->done.load(std::memory_order_acquire);
  {
    std::lock_guard<std::mutex> lock(mu_);
    sending_.push_back(std::move(batch));
  }
  // Nothing may drive the worker until the next operation: the progress thread must, now.
  if (pending) transport_.Urge();
  return absl::OkStatus();
}

void PointToPoint::SendFin(int to, uint64_t number) {
  std::unique_ptr<Batch> batch = TakeBatch();
  absl::StatusOr<uint8_t*> payload = batch->Buffer(sizeof(uint64_t));
  if (!payload.ok()) return;  // the sender then frees its copy when its communicator goes
  std::memcpy(*payload, &number, sizeof(number));
  Completion* c = batch->Add(to, /*is_send=*/true);
  if (!transport_.Send(to, *payload, sizeof(number), FinTag(transport_.rank(), number), c).ok()) {
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  sending_.push_back(std::move(batch));
}

bool PointToPoint::SendsPending() {
  ReapSends();
  std::lock_guard<std::mutex> lock(mu_);
  return !sending_.empty();
}

namespace {

// The wait of a receive (see the file comment) until `ready()`: OK, or the communicator's
// failure, a dead peer, or DeadlineExceeded naming `awaited`.
absl::Status Wait(UcxTransport& transport, const Tuning& tuning, absl::Time deadline,
                  const CollectiveHooks& hooks, const std::vector<int>& awaited,
                  absl::FunctionRef<bool()> ready) {
  absl::Time last_activity = WallNow();
  while (true) {
    const bool activity = transport.Progress();
    // What this thread progressed may complete another waiter's request, and the event that
    // would have woken that waiter is spent: wake it to look.
    if (activity) transport.Wake();
    if (ready()) return absl::OkStatus();
    absl::Status comm = hooks.comm_status();
    if (!comm.ok()) return Annotate(comm, hooks.describe());
    const absl::Time now = WallNow();
    absl::Status peers = transport.CheckPeers(now);
    if (!peers.ok()) return Annotate(peers, hooks.describe());
    if (now >= deadline) return hooks.deadline_error(awaited);
    if (activity) last_activity = now;
    if (now - last_activity < tuning.spin) {
      transport.YieldIfOversubscribed(now, now - last_activity);
      continue;
    }
    hooks.waiting_on(awaited);
    transport.Sleep(std::min(deadline, now + kLongestSleep));
  }
}

}  // namespace

absl::Status PointToPoint::Recv(const CollectiveFingerprint& fp, void* data, size_t element_size,
                                absl::Time deadline, const CollectiveHooks& hooks,
                                std::atomic<int>* source, std::unique_ptr<Batch>* batch_out) {
  transport_.BeginCollective();
  absl::Cleanup end = [&] { transport_.EndCollective(); };

  const bool any = fp.root == kAnySource;
  const uint64_t tag = MessageTag(any ? 0 : fp.root, DType{}, fp.key);
  // Either phase: kPointToPoint (6) and kPointToPointRead (7) differ in the lowest phase bit.
  const uint64_t mask =
      kFullMask & ~kDTypeBits & ~(uint64_t{1} << 60) & (any ? ~kSourceBits : kFullMask);
  std::vector<int> awaited;
  for (int r = 0; r < transport_.size(); ++r) {
    if (r != transport_.rank() && (any || r == fp.root)) awaited.push_back(r);
  }
  ucp_tag_recv_info_t info{};
  ucp_tag_message_h message = nullptr;
  SL_RETURN_IF_ERROR(Wait(transport_, tuning_, deadline, hooks, awaited, [&] {
    message = transport_.Probe(tag, mask, &info);
    return message != nullptr;
  }));

  const int from = TagSource(info.sender_tag);
  const uint64_t dtype_code = (info.sender_tag & kDTypeBits) >> 36;
  const size_t bytes = fp.count * element_size;
  std::unique_ptr<Batch> batch = TakeBatch();
  Completion* c = batch->Add(from, /*is_send=*/false);
  const bool read = (info.sender_tag >> 60) == static_cast<uint64_t>(Phase::kPointToPointRead);
  Descriptor descriptor{};
  if (read && info.length == sizeof(Descriptor)) {
    // The descriptor first (a small message: it is here), then the size check on its length.
    transport_.RecvProbed(message, from, &descriptor, sizeof(Descriptor), c);
    SL_RETURN_IF_ERROR(Wait(transport_, tuning_, deadline, hooks, {from},
                            [&] { return c->done.load(std::memory_order_acquire); }));
    info.length = descriptor.bytes;
    message = nullptr;
  }
  if (dtype_code != static_cast<uint64_t>(fp.dtype) || info.length != bytes) {
    // Received into a buffer of its own (the caller's stays untouched), so that the worker
    // holds no probed message that nobody receives.
    if (message != nullptr) {
      absl::StatusOr<uint8_t*> sink = batch->Buffer(std::max<size_t>(info.length, 1));
      if (sink.ok()) {
        transport_.RecvProbed(message, from, *sink, info.length, c);
      } else {
        c->done.store(true, std::memory_order_release);
      }
    }
    *batch_out = std::move(batch);
    std::string sent;
    if (dtype_code < kAllDTypes.size()) {
      const DType sent_dtype = static_cast<DType>(dtype_code);
      CollectiveFingerprint send;
      send.kind = CollectiveKind::kSend;
      send.count = info.length / DTypeSize(sent_dtype);
      send.dtype = sent_dtype;
      send.root = transport_.rank();
      send.key = fp.key;
      sent = send.CallString();
      if (info.length % DTypeSize(sent_dtype) != 0)
        absl::StrAppend(&sent, " of ", info.length, " bytes");
    } else {
      sent = absl::StrCat(info.length, " bytes of dtype code ", dtype_code);
    }
    return MarkPeerError(
        absl::InvalidArgumentError(absl::StrCat(hooks.describe(), ": rank ", from, " sent ", sent,
                                                " but this rank receives ", fp.CallString(),
                                                ": sizes and dtypes must match")),
        absl::StrCat(from));
  }
  absl::Status received;
  if (message == nullptr) {
    // A descriptor: one copy out of the sender, then the fin that frees its buffer.
    received =
        bytes == 0 ? absl::OkStatus() : transport_.CmaRead(from, data, descriptor.address, bytes);
    if (received.ok()) SendFin(from, descriptor.number);
  } else {
    transport_.RecvProbed(message, from, data, bytes, c);
    received = Wait(transport_, tuning_, deadline, hooks, {from},
                    [&] { return c->done.load(std::memory_order_acquire); });
  }
  if (!received.ok() && !IsPeerError(received)) received = Annotate(received, hooks.describe());
  if (received.ok() && c->status != UCS_OK) {
    received = MarkPeerError(
        absl::UnavailableError(absl::StrCat(hooks.describe(), ": receiving from rank ", from,
                                            " failed (ucx: ", UcxError(c->status), ")")),
        absl::StrCat(from));
  }
  if (!received.ok()) {
    *batch_out = std::move(batch);
    return received;
  }
  source->store(from, std::memory_order_release);
  transport_.Reap(*batch);
  batch->Reset();
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.size() < kFreeBatches) free_.push_back(std::move(batch));
  return absl::OkStatus();
}

}  // namespace shardline::ucx_internal
