// File: scheduler/tune/counting_communicator.h
// -----------------------------------------------------------------------------
// A Communicator that counts what is issued on it and passes every collective to the one it
// wraps, on the same stream, with the same arguments. Its splits and dups are counting
// communicators over the wrapped one's splits, sharing one CollectiveCounter, so that wrapping a
// world before Scheduler::Create counts every collective the scheduler issues on its mesh (the
// simulation driver, scheduler/tune/simulate.h, reports bytes per rank from it; the tests check
// FSDP's communication identities with it).
//
//   auto counter = std::make_shared<CollectiveCounter>();
//   std::shared_ptr<Communicator> world = WrapCounting(inner_world, counter);
//   ... Scheduler::Create(world, ...) ... a step ...
//   counter->Totals();   // per (communicator, kind): calls and payload bytes
//
// Payload bytes per collective (element size e, group size n, `count` as communicator.h defines
// it): all_gather and all_to_all count*n*e (the output), reduce_scatter count*n*e (the input),
// all_reduce and broadcast count*e, barrier 0. Bytes each rank sends on a ring (nccl-tests'
// bus-bandwidth convention, doc/PERFORMANCE.md): (n-1)/n of the payload for all_gather,
// reduce_scatter and all_to_all, 2(n-1)/n for all_reduce, (n-1)/n for broadcast (pipelined
// chain), 0 for barrier; RingSentBytesTimesSize returns n times that, an exact integer.
//
// The wrapper accepts the streams the wrapped backend accepts (errors come from the wrapped
// communicator's own checks); a call either of them refuses is not counted. Aborting the
// wrapper aborts the wrapped communicator. Thread safety: as any
// Communicator; the counter has its own lock.

#ifndef SHARDLINE_SCHEDULER_TUNE_COUNTING_COMMUNICATOR_H_
#define SHARDLINE_SCHEDULER_TUNE_COUNTING_COMMUNICATOR_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "collectives/communicator.h"

namespace shardline {

struct CollectiveTally {
  uint64_t calls = 0;
  uint64_t payload_bytes = 0;
  // n x the bytes each rank sends (see the header comment).
  uint64_t ring_sent_bytes_times_size = 0;
};

// The payload bytes and n x the ring bytes per rank of one collective.
uint64_t CollectivePayloadBytes(CollectiveKind kind, uint64_t count, size_t element_size, int size);
uint64_t RingSentBytesTimesSize(CollectiveKind kind, uint64_t payload_bytes, int size);

class CollectiveCounter {
 public:
  struct Key {
    std::string communicator;  // the wrapped communicator's name ("world/split(color=0)")
    int size = 0;              // its group size
    CollectiveKind kind = CollectiveKind::kBarrier;
    friend bool operator<(const Key& a, const Key& b) {
      return std::tie(a.communicator, a.size, a.kind) < std::tie(b.communicator, b.size, b.kind);
    }
  };

  void Record(const std::string& communicator, int size, CollectiveKind kind,
              uint64_t payload_bytes);
  std::map<Key, CollectiveTally> Totals() const;
  // Sums over every communicator of group size `size` (0: all) and kind.
  CollectiveTally Sum(CollectiveKind kind, int size = 0) const;
  // The bytes this rank sent, summed over everything counted.
  double RingSentBytes() const;
  void Reset();

 private:
  mutable std::mutex mu_;
  std::map<Key, CollectiveTally> totals_;
};

// Sums `totals` (a CollectiveCounter's Totals(), or SimulationReport::collectives) over every
// communicator of group size `size` (0: all) and kind.
CollectiveTally SumTallies(const std::map<CollectiveCounter::Key, CollectiveTally>& totals,
                           CollectiveKind kind, int size = 0);

// `inner` wrapped: same rank, size, device, name and timeout. Null `inner` gives null.
std::shared_ptr<Communicator> WrapCounting(std::shared_ptr<Communicator> inner,
                                           std::shared_ptr<CollectiveCounter> counter);

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_TUNE_COUNTING_COMMUNICATOR_H_
