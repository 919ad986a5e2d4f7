// The nccl backend: creation, Split, abort and destruction (see nccl_communicator.h; the
// collectives are in nccl_collectives.cc, the watchdog in nccl_watchdog.cc).

#include "collectives/nccl/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/nccl/internal/nccl_check.h"
#include "collectives/nccl/internal/nccl_communicator_impl.h"
#include "runtime/config.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace shardline {
namespace nccl_internal {
namespace {

SL_PARAM(bool, NcclCheckFingerprints, "NCCL_CHECK_FINGERPRINTS", false,
         "Debug aid of the nccl backend: before every collective, all-gather the ranks' "
         "fingerprints (24 bytes each) and compare them on the host, so that mismatched "
         "collectives fail on every rank with an error naming both ranks instead of hanging or "
         "corrupting memory. Costs one extra all-gather and a host-stream synchronisation per "
         "collective (no overlap of issue and execution).");
SL_PARAM(bool, NcclStreamStatus, "NCCL_STREAM_STATUS", true,
         "After every collective of the nccl backend, enqueue a host function that fails the "
         "stream if the communicator was aborted, so that Work::Wait and streams waiting on the "
         "Work report the abort. Costs one cudaLaunchHostFunc per collective; off: after an "
         "abort, Work::Wait may return OK and only Communicator::status() has the error.");
SL_PARAM(int64_t, NcclWatchdogMs, "NCCL_WATCHDOG_MS", 10,
         "How often the nccl backend's watchdog polls NCCL's error state and the deadlines of "
         "the collectives in flight (milliseconds, 1 to 60000).",
         InRange<int64_t>(1, 60000));

std::string Who(const NcclOptions& o) {
  return absl::StrCat("nccl communicator ", o.name, " (rank ", o.rank, " of ", o.size,
                      ", cuda:", o.device, ")");
}

absl::Status CheckOptions(const NcclOptions& o) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size) {
    return absl::InvalidArgumentError(absl::StrCat("nccl communicator ", o.name, ": rank ", o.rank,
                                                   " is not in a group of ", o.size));
  }
  if (o.store == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(Who(o), ": no store given"));
  }
  if (o.device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(Who(o), ": device ", o.device, " is not a CUDA ordinal"));
  }
  if (o.timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Who(o), ": negative timeout ", absl::FormatDuration(o.timeout)));
  }
  if (o.name.empty()) return absl::InvalidArgumentError("nccl communicator: empty name");
  return absl::OkStatus();
}

// Unavailable unless cuda:`device` exists.
absl::Status CheckDevice(const NcclOptions& o) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();  // do not leave the error behind for unrelated callers
    return absl::UnavailableError(
        absl::StrCat(Who(o), ": cuda:", o.device, " is not usable: no CUDA device (",
                     cudaGetErrorName(error), ": ", cudaGetErrorString(error), ")"));
  }
  if (o.device >= count) {
    return absl::UnavailableError(absl::StrCat(Who(o), ": cuda:", o.device, " does not exist (",
                                               count, count == 1 ? " device)" : " devices)"));
  }
  return absl::OkStatus();
}

constexpr absl::string_view kErrorPrefix = "error:";

// Rank 0 draws the id and publishes it; the others read it. A failure of rank 0 before that is
// published instead (any value that is not exactly an id), so the others fail at once with its
// reason rather than at the deadline.
absl::StatusOr<ncclUniqueId> ExchangeUniqueId(const NcclOptions& o, absl::Status rank0_failure,
                                              absl::Time deadline) {
  const std::string key = absl::StrCat(o.name, "/nccl/unique_id");
  ncclUniqueId id{};
  if (o.rank == 0) {
    if (rank0_failure.ok()) {
      rank0_failure = Annotate(SL_NCCL_STATUS(ncclGetUniqueId(&id), nullptr), Who(o));
    }
    if (!rank0_failure.ok()) {
      (void)o.store->Set(key, absl::StrCat(kErrorPrefix, rank0_failure.message()));
      return rank0_failure;
    }
    SL_RETURN_IF_ERROR(
        Annotate(o.store->Set(key, absl::string_view(id.internal, sizeof(id.internal))), Who(o)));
    return id;
  }
  SL_RETURN_IF_ERROR(rank0_failure);
  absl::StatusOr<std::string> value = o.store->Get(key, deadline);
  if (!value.ok()) {
    return Annotate(value.status(),
                    absl::StrCat(Who(o), ": waiting for rank 0 to publish the NCCL unique id"));
  }
  if (value->size() != sizeof(id.internal)) {
    absl::string_view reason = *value;
    if (absl::StartsWith(reason, kErrorPrefix)) reason.remove_prefix(kErrorPrefix.size());
    return absl::UnavailableError(
        absl::StrCat(Who(o), ": rank 0 could not create the communicator: ", reason));
  }
  std::copy(value->begin(), value->end(), id.internal);
  return id;
}

// Polls a non-blocking communicator (and optionally a second one) until neither is in progress.
// On error or deadline the caller aborts.
absl::Status PollReady(ncclComm_t comm, absl::Time deadline, absl::string_view who,
                       absl::string_view timeout_detail) {
  PollBackoff backoff;
  while (true) {
    ncclResult_t state = ncclSuccess;
    SL_RETURN_IF_ERROR(Annotate(SL_NCCL_STATUS(ncclCommGetAsyncError(comm, &state), comm), who));
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) {
      return absl::Status(
          nccl_internal::NcclErrorCode(state),
          absl::StrCat(who, ": NCCL failed: ", nccl_internal::DescribeNcclError(state, comm)));
    }
    if (absl::Now() >= deadline)
      return absl::DeadlineExceededError(absl::StrCat(who, ": ", timeout_detail));
    backoff.Pause();
  }
}

}  // namespace

absl::StatusOr<NcclSettings> ReadNcclSettings() {
  NcclSettings settings;
  SL_ASSIGN_OR_RETURN(settings.check_fingerprints, ParamNcclCheckFingerprints().Get());
  SL_ASSIGN_OR_RETURN(settings.stream_status, ParamNcclStreamStatus().Get());
  SL_ASSIGN_OR_RETURN(int64_t ms, ParamNcclWatchdogMs().Get());
  settings.watchdog_interval = absl::Milliseconds(ms);
  return settings;
}

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int rank, int size, int device,
                                   std::string name, absl::Duration timeout,
                                   const NcclSettings& settings)
    : Communicator(rank, size, Device::Cuda(device), std::move(name), timeout),
      cuda_device_(device),
      settings_(settings),
      comm_(comm) {}

absl::StatusOr<std::shared_ptr<NcclCommunicator>> NcclCommunicator::Wrap(
    ncclComm_t comm, int rank, int size, int device, std::string name, absl::Duration timeout,
    const NcclSettings& settings) {
  std::shared_ptr<NcclCommunicator> self(
      new NcclCommunicator(comm, rank, size, device, std::move(name), timeout, settings));
  absl::Status allocated = self->AllocateScratch();
  if (!allocated.ok()) {
    self->Abort(allocated);  // frees the NCCL communicator
    return allocated;
  }
  self->watchdog_ = std::thread([raw = self.get()] { raw->WatchdogLoop(); });
  SL_LOG(INFO, INIT) << "nccl communicator " << self->name() << " rank " << rank << " of " << size
                     << " ready on cuda:" << device
                     << (settings.check_fingerprints ? " (fingerprint checks on)" : "");
  return self;
}

absl::Status NcclCommunicator::AllocateScratch() {
  const std::string who = absl::StrCat("nccl communicator ", name(), " (rank ", rank(), ")");
  CudaDeviceGuard guard;
  SL_RETURN_IF_ERROR(Annotate(guard.Set(cuda_device_), who));
  SL_RETURN_IF_ERROR(Annotate(
      SL_CUDA_STATUS(cudaMalloc(reinterpret_cast<void**>(&barrier_scratch_), sizeof(int32_t))),
      who));
  // cudaMemset runs on the legacy stream, which our non-blocking streams do not wait for: wait
  // here, once, so the barrier buffer holds zero before any collective reads it.
  SL_RETURN_IF_ERROR(
      Annotate(SL_CUDA_STATUS(cudaMemset(barrier_scratch_, 0, sizeof(int32_t))), who));
  SL_RETURN_IF_ERROR(Annotate(SL_CUDA_STATUS(cudaStreamSynchronize(cudaStreamLegacy)), who));
  if (settings_.check_fingerprints) {
    const size_t bytes = static_cast<size_t>(size()) * CollectiveFingerprint::kEncodedSize;
    SL_RETURN_IF_ERROR(Annotate(
        SL_CUDA_STATUS(cudaMalloc(reinterpret_cast<void**>(&fingerprints_dev_), bytes)), who));
    SL_RETURN_IF_ERROR(
        Annotate(SL_CUDA_STATUS(cudaMallocHost(reinterpret_cast<void**>(&fingerprints_host_),
                                               bytes + CollectiveFingerprint::kEncodedSize)),
                 who));
    SL_RETURN_IF_ERROR(Annotate(
        SL_CUDA_STATUS(cudaEventCreateWithFlags(&fingerprints_ready_, cudaEventDisableTiming)),
        who));
  }
  return absl::OkStatus();
}

NcclCommunicator::~NcclCommunicator() {
  StopWatchdog();
  CudaDeviceGuard guard;
  (void)guard.Set(cuda_device_);
  {
    std::lock_guard<std::mutex> lock(nccl_mu_);
    if (comm_ != nullptr) {
      // Healthy: let the collectives in flight drain (bounded), then free. Otherwise abort.
      absl::Status finalized = status();
      if (finalized.ok()) finalized = SL_NCCL_ACCEPTED(ncclCommFinalize(comm_), comm_);
      if (finalized.ok()) {
        finalized =
            PollReady(comm_, absl::Now() + timeout(),
                      absl::StrCat("finalizing nccl communicator ", name(), " (rank ", rank(), ")"),
                      absl::StrCat("its collectives did not finish within ",
                                   absl::FormatDuration(timeout())));
      }
      if (finalized.ok()) {
        finalized = SL_NCCL_STATUS(ncclCommDestroy(comm_), comm_);
        if (!finalized.ok()) {
          SL_LOG(WARN, COLL) << "destroying nccl communicator " << name() << ": " << finalized;
        }
      } else {
        if (status().ok()) {
          SL_LOG(WARN, COLL) << "aborting nccl communicator " << name() << " rank " << rank()
                             << " at destruction: " << finalized;
        }
        (void)ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
  }
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    // Destroying an event that is still pending is allowed: CUDA frees it once it completes.
    for (const InFlight& f : in_flight_) {
      (void)cudaEventDestroy(f.start);
      (void)cudaEventDestroy(f.done);
    }
    in_flight_.clear();
    for (cudaEvent_t e : free_events_) (void)cudaEventDestroy(e);
    free_events_.clear();
  }
  if (fingerprints_ready_ != nullptr) (void)cudaEventDestroy(fingerprints_ready_);
  if (fingerprints_host_ != nullptr) (void)cudaFreeHost(fingerprints_host_);
  if (fingerprints_dev_ != nullptr) (void)cudaFree(fingerprints_dev_);
  if (barrier_scratch_ != nullptr) (void)cudaFree(barrier_scratch_);
}

void NcclCommunicator::OnAbort(const absl::Status& reason) {
  shared_status_->Set(reason);
  { std::lock_guard<std::mutex> lock(watch_mu_); }
  watch_cv_.notify_all();
  std::lock_guard<std::mutex> lock(nccl_mu_);
  if (comm_ == nullptr) return;
  CudaDeviceGuard guard;
  (void)guard.Set(cuda_device_);
  // Stops the kernels of every collective in flight, so no stream stays blocked on them.
  const absl::Status aborted = SL_NCCL_ACCEPTED(ncclCommAbort(comm_), nullptr);
  if (!aborted.ok()) SL_LOG(WARN, COLL) << "nccl communicator " << name() << ": " << aborted;
  comm_ = nullptr;
}

absl::Status NcclCommunicator::AsyncError(ncclResult_t state, absl::string_view what) const {
  return absl::Status(nccl_internal::NcclErrorCode(state),
                      absl::StrCat(what, ": NCCL reported an error on rank ", rank(), ": ",
                                   nccl_internal::DescribeNcclError(state, comm_)));
}

absl::Status NcclCommunicator::Run(const Op& op) {
  return absl::InternalError(
      absl::StrCat(Describe(op),
                   ": NcclCommunicator::Run is never called (collectives launch on CUDA streams)"));
}

absl::StatusOr<std::shared_ptr<Communicator>> NcclCommunicator::CreateSubgroup(
    const std::vector<int>&, int, const std::string& name, absl::Time) {
  return absl::InternalError(absl::StrCat("nccl communicator ", this->name(), ": CreateSubgroup(",
                                          name, ") is never called (Split uses ncclCommSplit)"));
}

absl::StatusOr<std::shared_ptr<Communicator>> NcclCommunicator::SplitImpl(int color, int key,
                                                                          absl::Time deadline) {
  const std::string who = absl::StrCat("split of ", name(), " (rank ", rank(), " of ", size(),
                                       ", nccl, color ", color, ", key ", key, ")");
  const uint64_t index = next_split_++;
  ncclComm_t child = nullptr;
  absl::Status failed;
  {
    std::lock_guard<std::mutex> lock(nccl_mu_);
    SL_RETURN_IF_ERROR(status());
    if (comm_ == nullptr)
      return absl::FailedPreconditionError(absl::StrCat(who, ": no NCCL communicator"));
    CudaDeviceGuard guard;
    SL_RETURN_IF_ERROR(Annotate(guard.Set(cuda_device_), who));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    failed = Annotate(SL_NCCL_ACCEPTED(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color,
                                                     key, &child, &config),
                                       comm_),
                      who);
    // The split runs in the background: the parent is busy with it and the child (none for a
    // negative color) initialises; both must settle.
    PollBackoff backoff;
    while (failed.ok()) {
      ncclResult_t parent_state = ncclSuccess;
      ncclResult_t child_state = ncclSuccess;
      failed = SL_NCCL_STATUS(ncclCommGetAsyncError(comm_, &parent_state), comm_);
      if (failed.ok() && child != nullptr) {
        failed = SL_NCCL_STATUS(ncclCommGetAsyncError(child, &child_state), child);
      }
      if (!failed.ok()) break;
      if (parent_state != ncclSuccess && parent_state != ncclInProgress) {
        failed = AsyncError(parent_state, who);
      } else if (child_state != ncclSuccess && child_state != ncclInProgress) {
        failed = absl::Status(nccl_internal::NcclErrorCode(child_state),
                              absl::StrCat(who, ": NCCL failed to create the new communicator: ",
                                           nccl_internal::DescribeNcclError(child_state, child)));
      } else if (parent_state == ncclSuccess && child_state == ncclSuccess) {
        break;
      } else if (!status().ok()) {
        failed = status();
      } else if (absl::Now() >= deadline) {
        failed =
            absl::DeadlineExceededError(absl::StrCat(who, ": timed out: not every rank of ", name(),
                                                     " called Split (NCCL cannot tell which)"));
      } else {
        backoff.Pause();
      }
    }
    if (!failed.ok() && child != nullptr) {
      (void)ncclCommAbort(child);
      child = nullptr;
    }
  }
  if (!failed.ok()) {
    // The parent's peers may be stuck in the split, and its state is undefined: abort it.
    Abort(failed);
    return failed;
  }
  if (color < 0) return std::shared_ptr<Communicator>();
  if (child == nullptr) {
    return absl::InternalError(absl::StrCat(who, ": ncclCommSplit returned no communicator"));
  }
  int new_rank = 0;
  int new_size = 0;
  absl::Status queried = SL_NCCL_STATUS(ncclCommUserRank(child, &new_rank), child);
  if (queried.ok()) queried = SL_NCCL_STATUS(ncclCommCount(child, &new_size), child);
  if (!queried.ok()) {
    (void)ncclCommAbort(child);
    return Annotate(queried, who);
  }
  SL_ASSIGN_OR_RETURN(
      std::shared_ptr<NcclCommunicator> sub,
      Wrap(child, new_rank, new_size, cuda_device_,
           absl::StrCat(name(), "/split", index, ".color", color), timeout(), settings_));
  return std::shared_ptr<Communicator>(std::move(sub));
}

}  // namespace nccl_internal

absl::StatusOr<std::shared_ptr<Communicator>> CreateNcclCommunicator(const NcclOptions& options) {
  SL_RETURN_IF_ERROR(nccl_internal::CheckOptions(options));
  NcclOptions o = options;
  if (o.timeout == absl::ZeroDuration()) {
    SL_ASSIGN_OR_RETURN(o.timeout, DefaultTimeout());
  }
  SL_ASSIGN_OR_RETURN(const nccl_internal::NcclSettings settings,
                      nccl_internal::ReadNcclSettings());
  const absl::Time deadline = absl::Now() + o.timeout;
  const std::string who = nccl_internal::Who(o);

  // The device must be current when NCCL initialises: it binds the communicator to it.
  CudaDeviceGuard guard;
  absl::Status device = nccl_internal::CheckDevice(o);
  if (device.ok()) device = Annotate(guard.Set(o.device), who);
  if (!device.ok() && o.rank != 0) return device;  // rank 0 publishes its own failure
  SL_ASSIGN_OR_RETURN(const ncclUniqueId id, nccl_internal::ExchangeUniqueId(o, device, deadline));

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  absl::Status init = Annotate(
      SL_NCCL_ACCEPTED(ncclCommInitRankConfig(&comm, o.size, id, o.rank, &config), comm), who);
  if (init.ok() && comm == nullptr) {
    init =
        absl::InternalError(absl::StrCat(who, ": ncclCommInitRankConfig returned no communicator"));
  }
  if (init.ok()) {
    init = nccl_internal::PollReady(
        comm, deadline, who,
        absl::StrCat("NCCL initialisation timed out after ", absl::FormatDuration(o.timeout),
                     ": not every rank of the group joined (NCCL cannot tell which)"));
  }
  if (!init.ok()) {
    if (comm != nullptr) (void)ncclCommAbort(comm);
    return init;
  }
  SL_ASSIGN_OR_RETURN(std::shared_ptr<nccl_internal::NcclCommunicator> self,
                      nccl_internal::NcclCommunicator::Wrap(comm, o.rank, o.size, o.device, o.name,
                                                            o.timeout, settings));
  return std::shared_ptr<Communicator>(std::move(self));
}

}  // namespace shardline
