// File: collectives/nccl/internal/nccl_communicator_impl.h
// -----------------------------------------------------------------------------
// The NCCL communicator class, private to collectives/nccl/ (users reach it through
// CreateNcclCommunicator). Its parts live in three files:
//   nccl_communicator.cc  creation, Split, abort, destruction
//   nccl_collectives.cc   Launch: stream checks, the NCCL calls, the fingerprint debug check
//   nccl_watchdog.cc      the watchdog thread: async errors and per-collective deadlines
//
// Locking. `nccl_mu_` serialises every use of the ncclComm_t against its abort and destruction
// (NCCL allows ncclCommAbort from another thread, but not while the handle is being freed under
// a caller). Launch holds it while it enqueues and polls ncclInProgress, which is bounded by the
// collective's timeout and cut short by Abort (polling loops check status(), which Abort sets
// before it calls OnAbort). `watch_mu_` guards the in-flight list and the event pool. Never take
// nccl_mu_ while holding watch_mu_.

#ifndef SHARDLINE_COLLECTIVES_NCCL_INTERNAL_NCCL_COMMUNICATOR_IMPL_H_
#define SHARDLINE_COLLECTIVES_NCCL_INTERNAL_NCCL_COMMUNICATOR_IMPL_H_

#include <cuda_runtime.h>
#include <nccl.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/cuda_util.h"

namespace shardline::nccl_internal {

// The abort status, shared with the host functions that follow each collective on its stream
// (they may run after the communicator is gone, on CUDA's callback thread, and must not call
// CUDA or NCCL).
class SharedStatus {
 public:
  absl::Status Get() const {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }
  void Set(const absl::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) status_ = status;
  }

 private:
  mutable std::mutex mu_;
  absl::Status status_;
};

// Process-wide settings read from the SHARDLINE_NCCL_* knobs.
struct NcclSettings {
  bool check_fingerprints = false;
  bool stream_status = true;
  absl::Duration watchdog_interval = absl::Milliseconds(10);
};
absl::StatusOr<NcclSettings> ReadNcclSettings();

class NcclCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (ready: its async state is ncclSuccess), allocates the scratch
  // buffers and starts the watchdog. On failure `comm` is aborted.
  static absl::StatusOr<std::shared_ptr<NcclCommunicator>> Wrap(ncclComm_t comm, int rank, int size,
                                                                int device, std::string name,
                                                                absl::Duration timeout,
                                                                const NcclSettings& settings);
  ~NcclCommunicator() override;

  absl::string_view backend() const override { return "nccl"; }

 protected:
  absl::Status Run(const Op& op) override;
  absl::Status Launch(Op op, Stream& stream) override;
  absl::Status CheckStream(const Stream& stream) const override;
  absl::Status CheckPointToPoint(CollectiveKind kind, int peer, uint64_t match_tag) const override;
  absl::Status CheckBuffers(absl::string_view where, const void* input, size_t input_bytes,
                            const void* output, size_t output_bytes) const override;
  absl::StatusOr<std::shared_ptr<Communicator>> SplitImpl(int color, int key,
                                                          absl::Time deadline) override;
  absl::StatusOr<std::shared_ptr<Communicator>> CreateSubgroup(const std::vector<int>& ranks,
                                                               int index, const std::string& name,
                                                               absl::Time deadline) override;
  void OnAbort(const absl::Status& reason) override;

 private:
  // One collective the watchdog watches: `start` completes when it begins on its stream, `done`
  // when it has finished.
  struct InFlight {
    Op op;
    cudaEvent_t start = nullptr;
    cudaEvent_t done = nullptr;
    std::optional<absl::Time> deadline;  // set once `start` completed
  };

  NcclCommunicator(ncclComm_t comm, int rank, int size, int device, std::string name,
                   absl::Duration timeout, const NcclSettings& settings);
  absl::Status AllocateScratch();

  // nccl_collectives.cc
  absl::Status CheckBuffer(absl::string_view where, const void* ptr, size_t bytes,
                           const char* what) const;
  // A communicator of one rank: every collective is a copy (or nothing, in place), made here
  // rather than by NCCL, whose one-rank reductions before 2.29.7 leave the tail of odd counts
  // unwritten (NVIDIA/nccl#1950: avg) and which costs a kernel launch for a copy.
  absl::Status EnqueueOneRank(const Op& op, cudaStream_t stream);
  absl::Status Enqueue(const Op& op, cudaStream_t stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(nccl_mu_);
  absl::Status CheckFingerprints(const Op& op, cudaStream_t stream, absl::Time deadline);
  // Polls until the operation just issued on comm_ is no longer ncclInProgress.
  // DeadlineExceeded after `deadline` (`timeout` is for the message).
  absl::Status WaitAccepted(absl::string_view what, absl::Duration timeout, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(nccl_mu_);

  // nccl_watchdog.cc
  absl::Status TakeEvents(cudaEvent_t* start, cudaEvent_t* done);
  void ReturnEvents(cudaEvent_t start, cudaEvent_t done);
  void Track(const Op& op, cudaEvent_t start, cudaEvent_t done);
  void WatchdogLoop();
  // One sweep: the first failure found, or OK. Sets *ended_after_abort when it ended a
  // collective of the aborted communicator.
  absl::Status Sweep(bool* ended_after_abort);
  void StopWatchdog();

  // The error of NCCL's asynchronous state `state` of comm_, for messages.
  absl::Status AsyncError(ncclResult_t state, absl::string_view what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(nccl_mu_);

  const int cuda_device_;
  const NcclSettings settings_;
  const std::shared_ptr<SharedStatus> shared_status_ = std::make_shared<SharedStatus>();
  uint64_t next_split_ = 0;

  mutable std::mutex nccl_mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(nccl_mu_) = nullptr;

  // Device scratch: a zeroed int32 for barriers; size * 24 bytes for fingerprints (debug mode),
  // with pinned host buffers and an event to wait for their copies.
  int32_t* barrier_scratch_ = nullptr;
  uint8_t* fingerprints_dev_ = nullptr;
  uint8_t* fingerprints_host_ = nullptr;  // [size * 24] gathered, then [24] this rank's
  cudaEvent_t fingerprints_ready_ = nullptr;

  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  std::deque<InFlight> in_flight_ ABSL_GUARDED_BY(watch_mu_);
  std::vector<cudaEvent_t> free_events_ ABSL_GUARDED_BY(watch_mu_);
  bool stop_ ABSL_GUARDED_BY(watch_mu_) = false;
  std::thread watchdog_;
};

}  // namespace shardline::nccl_internal

#endif  // SHARDLINE_COLLECTIVES_NCCL_INTERNAL_NCCL_COMMUNICATOR_IMPL_H_
