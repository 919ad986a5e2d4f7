// Device-side waits for host events: the pinned flag pool, cuStreamWaitValue32 through the
// runtime's driver entry point, and the deadline watchdog (see internal/cuda_host_wait.h).

#ifdef SHARDLINE_WITH_CUDA

#include "runtime/cuda/internal/cuda_host_wait.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "runtime/cuda/cuda_check.h"

namespace shardline::cuda_internal {
namespace {

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "the device reads the flag words as plain 32-bit words");

// One page of words per allocation: waits in flight at once are few, and a page is the unit
// cudaHostAlloc pins anyway.
constexpr size_t kPageBytes = 4096;
constexpr size_t kWordsPerPage = kPageBytes / sizeof(uint32_t);

class HostFlagPool {
 public:
  absl::StatusOr<std::atomic<uint32_t>*> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) {
      void* page = nullptr;
      // Portable: the page serves streams of every device. Mapped: the devices can read it.
      const cudaError_t error =
          cudaHostAlloc(&page, kPageBytes, cudaHostAllocPortable | cudaHostAllocMapped);
      if (error != cudaSuccess) {
        (void)cudaGetLastError();
        return cuda_internal::CudaStatus(error, "cudaHostAlloc of a page of host-wait flags",
                                         __FILE__, __LINE__);
      }
      // Pages are never freed: a word may be read by a device wait long after its last use.
      auto* words = static_cast<std::atomic<uint32_t>*>(page);
      for (size_t i = 0; i < kWordsPerPage; ++i)
        free_.push_back(new (&words[i]) std::atomic<uint32_t>(0));
    }
    std::atomic<uint32_t>* word = free_.back();
    free_.pop_back();
    return word;
  }

  void Put(std::atomic<uint32_t>* word) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(word);
  }

 private:
  std::mutex mu_;
  std::vector<std::atomic<uint32_t>*> free_ ABSL_GUARDED_BY(mu_);
};

HostFlagPool& Pool() {
  static HostFlagPool* const pool = new HostFlagPool();
  return *pool;
}

using WaitValue32Fn = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

// cuStreamWaitValue32 as of the CUDA 12 ABI (the "v2" memory operations, which need no opt-in);
// nullptr if the driver lacks it.
WaitValue32Fn WaitValue32() {
  static const WaitValue32Fn fn = []() -> WaitValue32Fn {
    void* symbol = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t error = cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &symbol,
                                                               12000, cudaEnableDefault, &found);
#else
    const cudaError_t error =
        cudaGetDriverEntryPoint("cuStreamWaitValue32", &symbol, cudaEnableDefault, &found);
#endif
    if (error != cudaSuccess || found != cudaDriverEntryPointSuccess || symbol == nullptr) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<WaitValue32Fn>(symbol);
  }();
  return fn;
}

// The watchdog: deadlines in a map ordered by (deadline, id), served by one thread that sleeps
// until the earliest. Created on first use and kept for the process's lifetime.
class Watchdog {
 public:
  uint64_t Arm(absl::Time deadline, absl::AnyInvocable<void() &&> on_expiry) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_) {
      started_ = true;
      std::thread([this] { Run(); }).detach();
    }
    const uint64_t id = ++last_id_;
    const bool earliest = pending_.empty() || deadline < pending_.begin()->first.first;
    pending_.emplace(Key{deadline, id}, std::move(on_expiry));
    deadlines_.emplace(id, deadline);
    if (earliest) cv_.notify_one();
    return id;
  }

  void Cancel(uint64_t id) {
    absl::AnyInvocable<void() &&> dropped;  // destroyed after the lock is released
    std::lock_guard<std::mutex> lock(mu_);
    auto it = deadlines_.find(id);
    if (it == deadlines_.end()) return;
    auto entry = pending_.find(Key{it->second, id});
    dropped = std::move(entry->second);
    pending_.erase(entry);
    deadlines_.erase(it);
  }

 private:
  using Key = std::pair<absl::Time, uint64_t>;

  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      if (pending_.empty()) {
        cv_.wait(lock);
        continue;
      }
      const absl::Time next = pending_.begin()->first.first;
      const absl::Time now = absl::Now();
      if (now < next) {
        // Capped: a far deadline would overflow the condition variable's clock conversion.
        cv_.wait_until(lock, absl::ToChronoTime(std::min(next, now + absl::Hours(1))));
        continue;
      }
      std::vector<absl::AnyInvocable<void() &&>> due;
      while (!pending_.empty() && pending_.begin()->first.first <= now) {
        auto entry = pending_.begin();
        deadlines_.erase(entry->first.second);
        due.push_back(std::move(entry->second));
        pending_.erase(entry);
      }
      // Outside the lock: a callback cancels or arms watchdogs itself.
      lock.unlock();
      for (auto& callback : due) std::move(callback)();
      due.clear();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t last_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<Key, absl::AnyInvocable<void() &&>> pending_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, absl::Time> deadlines_ ABSL_GUARDED_BY(mu_);
};

Watchdog& TheWatchdog() {
  static Watchdog* const watchdog = new Watchdog();
  return *watchdog;
}

}  // namespace

absl::StatusOr<HostFlag> AcquireHostFlag() {
  absl::StatusOr<std::atomic<uint32_t>*> word = Pool().Take();
  if (!word.ok()) return word.status();
  // The pool's lock orders this read after the store of the word's previous signal.
  return HostFlag{*word, (*word)->load(std::memory_order_relaxed) + 1};
}

void SignalHostFlag(const HostFlag& flag) {
  // Release: host writes before the signal (the data the device is about to read) come first.
  flag.word->store(flag.target, std::memory_order_release);
  Pool().Put(flag.word);
}

void ReturnHostFlag(const HostFlag& flag) { Pool().Put(flag.word); }

bool DeviceWaitsAvailable(int device) {
  int can_map = 0;
  if (cudaDeviceGetAttribute(&can_map, cudaDevAttrCanMapHostMemory, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return can_map != 0 && WaitValue32() != nullptr;
}

absl::Status EnqueueHostFlagWait(cudaStream_t stream, const HostFlag& flag) {
  const WaitValue32Fn wait = WaitValue32();
  if (wait == nullptr) {
    return absl::UnimplementedError("the CUDA driver does not provide cuStreamWaitValue32");
  }
  void* device_ptr = nullptr;
  SL_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device_ptr, flag.word, 0));
  const CUresult result =
      wait(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(device_ptr),
           flag.target, CU_STREAM_WAIT_VALUE_GEQ);
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  if (result == CUDA_ERROR_NOT_SUPPORTED) {
    return absl::UnimplementedError(
        "cuStreamWaitValue32 failed with CUDA_ERROR_NOT_SUPPORTED: this platform has no stream "
        "memory operations");
  }
  return absl::InternalError(
      absl::StrCat("cuStreamWaitValue32 on a pinned host flag failed with CUresult ", result));
}

uint64_t ArmWatchdog(absl::Time deadline, absl::AnyInvocable<void() &&> on_expiry) {
  return TheWatchdog().Arm(deadline, std::move(on_expiry));
}

void CancelWatchdog(uint64_t id) { TheWatchdog().Cancel(id); }

}  // namespace shardline::cuda_internal

#endif  // SHARDLINE_WITH_CUDA
