// The process-wide side of the flight recorder: knobs, the registry SIGUSR1 dumps, the watcher.
#include "collectives/internal/flight_dump.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collectives/communicator.h"
#include "runtime/config.h"
#include "runtime/logging.h"

namespace shardline {
namespace {

SL_PARAM(int64_t, FlightRecorder, "FLIGHT_RECORDER", 2048,
         "How many of its last collectives each communicator's flight recorder keeps (sequence "
         "number, fingerprint, stream, tag, times, state, awaited peers). 0: no recording.",
         InRange<int64_t>(0, int64_t{1} << 24));
SL_PARAM(std::string, FlightRecorderDir, "FLIGHT_RECORDER_DIR", "",
         "Directory where each rank writes its communicators' flight records as JSON when a "
         "communicator is aborted (collective error, deadline, peer abort, Abort()) and on "
         "SIGUSR1. Empty: no dumps (records are still kept).");

std::mutex& RegistryMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::vector<std::weak_ptr<Communicator>>& Registry() {
  static auto* comms = new std::vector<std::weak_ptr<Communicator>>;
  return *comms;
}

// The self-pipe of SIGUSR1: the handler writes a byte, the watcher thread reads it and dumps.
int g_signal_pipe[2] = {-1, -1};

extern "C" void OnFlightSignal(int /*signo*/) {
  // Async-signal-safe: write(2) on a non-blocking pipe, errno preserved.
  const int saved = errno;
  const char byte = 1;
  [[maybe_unused]] const ssize_t n = ::write(g_signal_pipe[1], &byte, 1);
  errno = saved;
}

void WatchSignals() {
  char buf[64];
  while (true) {
    const ssize_t n = ::read(g_signal_pipe[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    const std::string dir = flight_internal::Dir();
    absl::StatusOr<std::vector<std::string>> paths = DumpAllFlightRecords(dir, "SIGUSR1");
    if (!paths.ok()) {
      SL_LOG(WARN, COLL) << "flight recorder: SIGUSR1 dump into " << dir << ": " << paths.status();
    } else {
      SL_LOG(WARN, COLL) << "flight recorder: SIGUSR1: wrote " << paths->size() << " dump(s) into "
                         << dir;
    }
  }
}

void InstallSignalWatcher() {
  struct sigaction old = {};
  if (::sigaction(SIGUSR1, nullptr, &old) != 0) return;
  if ((old.sa_flags & SA_SIGINFO) != 0 || old.sa_handler != SIG_DFL) {
    SL_LOG(INFO, COLL) << "flight recorder: SIGUSR1 already has a handler; no dumps on SIGUSR1";
    return;
  }
  if (::pipe2(g_signal_pipe, O_CLOEXEC) != 0) {
    SL_LOG(WARN, COLL) << "flight recorder: pipe2 failed (errno " << errno
                       << "); no dumps on SIGUSR1";
    return;
  }
  ::fcntl(g_signal_pipe[1], F_SETFL, ::fcntl(g_signal_pipe[1], F_GETFL) | O_NONBLOCK);
  // The watcher lives as long as the process (blocked in read(2) when idle).
  std::thread(WatchSignals).detach();
  struct sigaction action = {};
  action.sa_handler = OnFlightSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  if (::sigaction(SIGUSR1, &action, nullptr) != 0) {
    SL_LOG(WARN, COLL) << "flight recorder: sigaction(SIGUSR1) failed (errno " << errno << ")";
  }
}

}  // namespace

namespace flight_internal {

size_t Capacity() { return static_cast<size_t>(ParamFlightRecorder().GetOrDefault()); }

std::string Dir() {
  absl::StatusOr<std::string> dir = ParamFlightRecorderDir().Get();
  return dir.ok() ? *dir : std::string();
}

void Register(std::weak_ptr<Communicator> comm) {
  static std::once_flag installed;
  if (!Dir().empty()) std::call_once(installed, InstallSignalWatcher);
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto& comms = Registry();
  std::erase_if(comms, [](const std::weak_ptr<Communicator>& c) { return c.expired(); });
  comms.push_back(std::move(comm));
}

}  // namespace flight_internal

absl::StatusOr<std::vector<std::string>> DumpAllFlightRecords(absl::string_view dir,
                                                              absl::string_view reason) {
  std::vector<std::shared_ptr<Communicator>> live;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    for (const std::weak_ptr<Communicator>& weak : Registry()) {
      if (std::shared_ptr<Communicator> comm = weak.lock()) live.push_back(std::move(comm));
    }
  }
  std::vector<std::string> paths;
  absl::Status first;
  for (const std::shared_ptr<Communicator>& comm : live) {
    absl::StatusOr<std::string> path = comm->DumpFlightRecord(dir, reason);
    if (path.ok()) {
      paths.push_back(*std::move(path));
    } else if (first.ok() && !absl::IsFailedPrecondition(path.status())) {
      first = path.status();
    }
  }
  // If the last reference was ours, the communicator is destroyed here, on this thread.
  live.clear();
  if (!first.ok()) return first;
  return paths;
}

}  // namespace shardline
