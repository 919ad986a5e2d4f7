// File: collectives/ucx/internal/peer_memory.h
// -----------------------------------------------------------------------------
// The memory of the processes of one communicator that run on this host (backend-private; no
// UCX in here): whether a peer's process still runs, single copies out of its memory with
// process_vm_readv, and mappings of its shareable arenas (runtime/shared_memory.h).
//
// A peer's process is known by a pidfd opened when the peer is first watched (Watch), so that a
// new process that reuses the pid is never taken for the peer; where the kernel offers no pidfd
// the pid is watched instead. A mapping needs a descriptor of the peer's memory file
// (pidfd_getfd); without one to spare (EMFILE and the like) the caller copies with Read and
// the next Map tries again.

#ifndef SHARDLINE_COLLECTIVES_UCX_INTERNAL_PEER_MEMORY_H_
#define SHARDLINE_COLLECTIVES_UCX_INTERNAL_PEER_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace shardline::ucx_internal {

// Ranks with equal host identities share memory: same host name, same boot, same pid namespace
// (so that their pids mean something to each other).
std::string HostIdentity();

// Under Yama's ptrace_scope 1 only ancestors may read a process's memory: lets any process of
// the same user read this one's (once per process), as UCX and Open MPI do for CMA.
void AllowPeerReads();

class PeerMemory {
 public:
  // `size` ranks; `describe` ("ucx communicator world rank 0") starts every log line.
  PeerMemory(int size, std::string describe);
  PeerMemory(const PeerMemory&) = delete;
  PeerMemory& operator=(const PeerMemory&) = delete;
  // Unmaps every mapping and closes the pidfds.
  ~PeerMemory();

  // Rank `peer` runs on this host as process `pid`: opens a pidfd on it (if the kernel refuses,
  // one WARN line, and the pid is watched instead).
  void Watch(int peer, int64_t pid);
  int64_t pid(int peer) const { return peers_[peer].pid; }
  // Whether the watched peer's process still runs.
  bool Alive(int peer) const;

  // Copies `bytes` at address `remote` of the peer's memory to `dst`: 0, or the errno of the
  // failed process_vm_readv (ESRCH: the peer has exited).
  int Read(int peer, void* dst, uint64_t remote, size_t bytes) const;

  // This process's read-only mapping of the peer's shareable arena `region_id` (its memory file
  // `fd` in the peer, `bytes` reserved; runtime/shared_memory.h), of which the caller will read
  // the first `needed` bytes at most. Mapped as far as the arena's memory file reaches (not its
  // whole reservation: a read-only view of many gigabytes made the pipelined reductions out of
  // it bimodal, a quarter of the runs 1.5-2x slower; docs/benchmarks.md), and mapped again, at
  // least twice as long, when `needed` passes that end. Every mapping is kept until this object
  // is destroyed (found again by a lookup), so a pointer returned stays valid. Null when the peer
  // cannot be mapped (pidfd_getfd refused, or the file is not what the peer described; one WARN
  // line, for good), or not now (out of file descriptors or memory; one WARN line, tried again at
  // the next call). Not thread-safe: one thread at a time.
  const uint8_t* Map(int peer, uint64_t region_id, int fd, size_t bytes, size_t needed);
  // Mappings held now.
  size_t mappings() const { return mappings_.size(); }

 private:
  struct Process {
    int64_t pid = 0;
    int pidfd = -1;
    bool warned_pidfd = false;      // pidfd_open failed (logged once)
    bool unmappable = false;        // mapping failed for good
    bool warned_transient = false;  // mapping failed for want of descriptors (logged once)
    bool mapped_before = false;
  };
  struct Mapping {
    const uint8_t* base;
    size_t bytes;     // mapped: the memory file's length when it was mapped
    size_t reserved;  // what the peer reserved for the arena
  };

  // Opens peers_[peer].pidfd; false (logged once per peer, errno kept) if the kernel refuses.
  bool OpenPidfd(int peer);

  const std::string describe_;
  std::vector<Process> peers_;
  std::map<std::pair<int, uint64_t>, Mapping> mappings_;  // by (peer, arena id)
  std::vector<Mapping> retired_;  // outgrown by their arena's file; still read by borrowed views
};

}  // namespace shardline::ucx_internal

#endif  // SHARDLINE_COLLECTIVES_UCX_INTERNAL_PEER_MEMORY_H_
