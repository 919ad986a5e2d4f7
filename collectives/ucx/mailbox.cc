#include "collectives/ucx/internal/mailbox.h"

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace shardline::ucx_internal {

namespace {

size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

// The sequence word of collective `count` (slots alternate, so two collectives apart never
// compare equal, also where the 32 bits wrap).
uint32_t SeqWord(uint64_t count) { return static_cast<uint32_t>(count); }

// Shared (not process-private) futex calls: waiter and waker map the same file.
void FutexWait(const uint32_t* word, uint32_t seen, absl::Duration timeout) {
  const timespec ts = absl::ToTimespec(timeout);
  syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, nullptr, 0);
}
void FutexWakeAll(uint32_t* word) {
  syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Mailboxes>> Mailboxes::Create(int rank, int size,
                                                             size_t fingerprint_bytes,
                                                             size_t payload_bytes) {
  const size_t fingerprint_stride = RoundUp(fingerprint_bytes, kLine);
  const size_t slot_stride = kLine + fingerprint_stride + RoundUp(payload_bytes, kLine);
  const size_t bytes = kLine + 2 * slot_stride;
  const int fd = static_cast<int>(syscall(SYS_memfd_create, "shardline-mailbox", MFD_CLOEXEC));
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int error = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("ftruncate(", bytes, "): ", std::strerror(error)));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int error = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("mmap(", bytes, "): ", std::strerror(error)));
  }
  // A fresh file reads as zeros: no slot is complete, nobody sleeps.
  return std::unique_ptr<Mailboxes>(new Mailboxes(rank, size, fd, static_cast<uint8_t*>(base),
                                                  bytes, fingerprint_stride, payload_bytes));
}

Mailboxes::Mailboxes(int rank, int size, int fd, uint8_t* base, size_t bytes,
                     size_t fingerprint_stride, size_t payload_bytes)
    : rank_(rank),
      fd_(fd),
      base_(base),
      bytes_(bytes),
      fingerprint_stride_(fingerprint_stride),
      payload_bytes_(payload_bytes),
      slot_stride_((bytes - kLine) / 2),  // Create: kLine + 2 slots
      peers_(size, nullptr) {}

Mailboxes::~Mailboxes() {
  munmap(base_, bytes_);
  close(fd_);
}

void Mailboxes::Publish(uint64_t count) {
  auto* seq = reinterpret_cast<uint32_t*>(Slot(base_, count));
  // Sequentially consistent, as the sleeper's flag and its second look (Sleep): either this
  // rank sees the flag, or the sleeper sees the new sequence and does not sleep.
  __atomic_store_n(seq, SeqWord(count), __ATOMIC_SEQ_CST);
  for (size_t p = 0; p < peers_.size(); ++p) {
    if (peers_[p] == nullptr) continue;
    const auto* sleeping = reinterpret_cast<const uint32_t*>(peers_[p]);
    if (__atomic_load_n(sleeping, __ATOMIC_SEQ_CST) == static_cast<uint32_t>(rank_) + 1) {
      // One wake-up for every sleeper on this word.
      FutexWakeAll(seq);
      return;
    }
  }
}

bool Mailboxes::Arrived(int peer, uint64_t count) const {
  const auto* seq = reinterpret_cast<const uint32_t*>(Slot(peers_[peer], count));
  return __atomic_load_n(seq, __ATOMIC_ACQUIRE) == SeqWord(count);
}

void Mailboxes::Sleep(int peer, uint64_t count, absl::Duration timeout) {
  uint32_t* sleeping = SleepingOn(base_);
  const auto* seq = reinterpret_cast<const uint32_t*>(Slot(peers_[peer], count));
  __atomic_store_n(sleeping, static_cast<uint32_t>(peer) + 1, __ATOMIC_SEQ_CST);
  const uint32_t seen = __atomic_load_n(seq, __ATOMIC_SEQ_CST);
  // The kernel sleeps only while the word still holds `seen`: a store in between is not missed.
  if (seen != SeqWord(count)) FutexWait(seq, seen, timeout);
  __atomic_store_n(sleeping, 0, __ATOMIC_RELAXED);
}

void Mailboxes::MarkAborted() {
  __atomic_store_n(const_cast<uint64_t*>(AbortedWord(base_)),
                   completed_.load(std::memory_order_relaxed) + 1, __ATOMIC_RELEASE);
  // Before anything this rank writes later (the buffers of the collective it gave up on, freed
  // and reused): a peer that reads such a write and then looks (its acquire fence in
  // AbortedBefore's callers) finds the mark.
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

bool Mailboxes::AbortedBefore(int peer, uint64_t count) const {
  const uint64_t mark = __atomic_load_n(AbortedWord(peers_[peer]), __ATOMIC_ACQUIRE);
  return mark != 0 && mark - 1 < count;
}

}  // namespace shardline::ucx_internal
