#include "runtime/shared_memory.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "runtime/check.h"

namespace shardline {

SL_PARAM(int64_t, HostShareableBytes, "HOST_SHAREABLE_BYTES", 1 << 20,
         "Host allocations of at least this many bytes come from memory files that local peers "
         "can map (the ucx backend then copies and reduces straight out of them); 0: never.",
         [](const int64_t& v) {
           return v >= 0 ? absl::OkStatus()
                         : absl::InvalidArgumentError("shareable bytes must be >= 0");
         });

namespace {

struct Region {
  uint64_t id;
  int fd;
  size_t bytes;  // mapped length (whole pages)
};

class Registry {
 public:
  static Registry& Get() {
    static Registry* const registry = new Registry();  // outlives static destructors
    return *registry;
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return regions_.size();
  }

  uint64_t Add(uintptr_t base, int fd, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t id = ++last_id_;
    regions_[base] = Region{id, fd, bytes};
    return id;
  }

  // Removes the region at `base`; its fd, or -1 if there is none.
  int Remove(uintptr_t base) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(base);
    if (it == regions_.end()) return -1;
    const int fd = it->second.fd;
    regions_.erase(it);
    return fd;
  }

  std::optional<ShareableSpan> Find(uintptr_t begin, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.upper_bound(begin);
    if (it == regions_.begin()) return std::nullopt;
    --it;
    const uintptr_t base = it->first;
    const Region& r = it->second;
    if (begin - base > r.bytes || bytes > r.bytes - (begin - base)) return std::nullopt;
    return ShareableSpan{r.id, r.fd, r.bytes, begin - base};
  }

 private:
  std::mutex mu_;
  std::map<uintptr_t, Region> regions_;  // by base address
  uint64_t last_id_ = 0;
};

size_t RoundToPages(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

}  // namespace

namespace {

// Every region holds a file descriptor for as long as it lives; a quarter of the process's
// descriptor limit at most, so that shareable memory never starves the rest of the process
// (sockets, files) of descriptors.
size_t MaxRegions() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 1 << 16;
  return static_cast<size_t>(limit.rlim_cur / 4);
}

}  // namespace

absl::StatusOr<void*> AllocateShareable(size_t bytes) {
  SL_CHECK(bytes > 0) << "AllocateShareable: zero bytes";
  const size_t max_regions = MaxRegions();
  if (Registry::Get().size() >= max_regions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("shareable memory already holds ", max_regions,
                     " file descriptors (a quarter of RLIMIT_NOFILE, the most it may use)"));
  }
  const size_t length = RoundToPages(bytes);
  const int fd = memfd_create("shardline", MFD_CLOEXEC);
  if (fd < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("memfd_create for ", bytes, " shareable bytes: ", std::strerror(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(length)) != 0) {
    const int error = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("ftruncate of a memory file to ", length, " bytes: ", std::strerror(error)));
  }
  void* data = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const int error = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of ", length, " shareable bytes: ", std::strerror(error)));
  }
  Registry::Get().Add(reinterpret_cast<uintptr_t>(data), fd, length);
  return data;
}

void FreeShareable(void* data, size_t bytes) {
  if (data == nullptr) return;
  const int fd = Registry::Get().Remove(reinterpret_cast<uintptr_t>(data));
  SL_CHECK(fd >= 0) << "FreeShareable: " << data << " is not shareable memory";
  munmap(data, RoundToPages(bytes));
  close(fd);
}

std::optional<ShareableSpan> FindShareable(const void* data, size_t bytes) {
  return Registry::Get().Find(reinterpret_cast<uintptr_t>(data), bytes);
}

}  // namespace shardline
