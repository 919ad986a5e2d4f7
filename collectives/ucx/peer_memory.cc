#include "collectives/ucx/internal/peer_memory.h"

#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/logging.h"

namespace shardline::ucx_internal {

namespace {

std::string ReadFirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Without a pidfd (kernels before 5.3, or no descriptor to spare): the pid, which another
// process may have taken over since the peer exited.
bool ProcessAlive(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM) return false;
  // A zombie has exited; it only waits for its parent.
  std::string stat = ReadFirstLine(absl::StrCat("/proc/", pid, "/stat").c_str());
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return !stat.empty();
  const char state = stat[paren + 2];
  return state != 'Z' && state != 'X';
}

}  // namespace

std::string HostIdentity() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  char ns[128] = {};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  if (n > 0) ns[n] = 0;
  return absl::StrCat(host, "|", ReadFirstLine("/proc/sys/kernel/random/boot_id"), "|", ns);
}

// The communicator's probe finds out whether this worked.
void AllowPeerReads() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (ReadFirstLine("/proc/sys/kernel/yama/ptrace_scope") == "1") {
      prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
    }
  });
}

PeerMemory::PeerMemory(int size, std::string describe)
    : describe_(std::move(describe)), peers_(size) {}

PeerMemory::~PeerMemory() {
  for (const auto& [key, m] : mappings_) munmap(const_cast<uint8_t*>(m.base), m.bytes);
  for (const Mapping& m : retired_) munmap(const_cast<uint8_t*>(m.base), m.bytes);
  for (Process& peer : peers_) {
    if (peer.pidfd >= 0) close(peer.pidfd);
  }
}

void PeerMemory::Watch(int peer, int64_t pid) {
  peers_[peer].pid = pid;
  OpenPidfd(peer);
}

bool PeerMemory::OpenPidfd(int p) {
  Process& peer = peers_[p];
  peer.pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(peer.pid), 0));
  if (peer.pidfd >= 0) return true;
  const int error = errno;  // for the caller, whatever logging does to it
  if (!peer.warned_pidfd) {
    peer.warned_pidfd = true;
    SL_LOG(WARN, COLL) << describe_ << ": pidfd_open for peer rank " << p << " (pid " << peer.pid
                       << ") failed (" << std::strerror(error)
                       << "); watching its pid instead, which a new process may reuse";
  }
  errno = error;
  return false;
}

bool PeerMemory::Alive(int p) const {
  const Process& peer = peers_[p];
  if (peer.pidfd < 0) return ProcessAlive(peer.pid);
  // A pidfd names one process for good: it turns readable once that process has exited, even
  // if its pid now belongs to another.
  pollfd fd{peer.pidfd, POLLIN, 0};
  int ready;
  do {
    ready = poll(&fd, 1, 0);
  } while (ready < 0 && errno == EINTR);
  return ready <= 0;
}

// One process_vm_readv loop (short reads continue where they stopped).
int PeerMemory::Read(int peer, void* dst, uint64_t remote, size_t bytes) const {
  const int64_t pid = peers_[peer].pid;
  size_t done = 0;
  while (done < bytes) {
    iovec local{static_cast<uint8_t*>(dst) + done, bytes - done};
    iovec far{reinterpret_cast<void*>(static_cast<uintptr_t>(remote + done)), bytes - done};
    const ssize_t n = process_vm_readv(static_cast<pid_t>(pid), &local, 1, &far, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EFAULT;
    done += static_cast<size_t>(n);
  }
  return 0;
}

const uint8_t* PeerMemory::Map(int peer, uint64_t region_id, int fd, size_t bytes, size_t needed) {
  Process& p = peers_[peer];
  if (p.unmappable || bytes == 0 || needed > bytes) return nullptr;
  auto found = mappings_.find({peer, region_id});
  if (found != mappings_.end()) {
    if (found->second.reserved != bytes) return nullptr;
    if (needed <= found->second.bytes) return found->second.base;
  }
  // Out of descriptors (or memory) is transient: copy this message with process_vm_readv and try
  // again with the next. Anything else means this peer's memory cannot be mapped at all.
  auto fail = [&](const char* what) -> const uint8_t* {
    const int error = errno;
    const bool transient = error == EMFILE || error == ENFILE || error == ENOMEM;
    if (!transient) {
      p.unmappable = true;
    } else if (p.warned_transient) {
      return nullptr;
    } else {
      p.warned_transient = true;
    }
    SL_LOG(WARN, COLL) << describe_ << ": " << what << " for peer rank " << peer << " failed ("
                       << std::strerror(error) << "); reading its memory with process_vm_readv"
                       << (transient ? " until this succeeds (not logged again)" : "");
    return nullptr;
  };
  // Opened at creation; again here if that failed for want of a descriptor.
  if (p.pidfd < 0 && !OpenPidfd(peer)) return fail("pidfd_open");
  const int local_fd = static_cast<int>(syscall(SYS_pidfd_getfd, p.pidfd, fd, 0));
  if (local_fd < 0) return fail("pidfd_getfd");
  // The arena's memory file only grows, up to its reservation: it must hold the span now and
  // never exceed what the peer reserved.
  struct stat st {};
  void* base = MAP_FAILED;
  errno = 0;
  size_t length = 0;
  if (fstat(local_fd, &st) == 0 && static_cast<size_t>(st.st_size) >= needed &&
      static_cast<size_t>(st.st_size) <= bytes) {
    // At least twice what was mapped before, so that a file growing in small steps is mapped
    // again only a logarithmic number of times (a mapping may reach past the file's end: only
    // what the file holds is ever read).
    const size_t before = found != mappings_.end() ? found->second.bytes : 0;
    length = std::min(bytes, std::max(static_cast<size_t>(st.st_size), 2 * before));
    base = mmap(nullptr, length, PROT_READ, MAP_SHARED | MAP_NORESERVE, local_fd, 0);
  }
  const int map_error = base == MAP_FAILED && errno != 0 ? errno : EINVAL;
  close(local_fd);
  if (base == MAP_FAILED) {
    errno = map_error;
    return fail("mapping a shared arena");
  }
  if (!p.mapped_before) {
    p.mapped_before = true;
    SL_LOG(INFO, COLL) << describe_ << ": maps the shareable memory of peer rank " << peer;
  }
  // Kept until this object is destroyed: an arena lives as long as its process, a peer has a
  // handful of them, and each is mapped again a logarithmic number of times. An outgrown
  // mapping may still be read through a borrowed chunk.
  const Mapping mapping{static_cast<const uint8_t*>(base), length, bytes};
  if (found != mappings_.end()) {
    retired_.push_back(found->second);
    found->second = mapping;
  } else {
    mappings_.emplace(std::make_pair(peer, region_id), mapping);
  }
  return mapping.base;
}

}  // namespace shardline::ucx_internal
