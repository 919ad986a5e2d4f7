// shardline-store: a rendezvous store in a process of its own, for jobs whose store must outlive
// any training rank (elastic jobs: shardline-launch --max-restarts starts one). It serves the
// TCP store protocol (collectives/store/tcp_store.h) until its standard input closes or it gets
// SIGINT/SIGTERM, so a parent that dies takes it along.
//
//   shardline-store [--host 0.0.0.0] [--port 0]
//
// Prints one line, "shardline-store: listening on HOST:PORT", once it accepts connections (with
// --port 0 the kernel picks the port: read it from that line). The token is
// SHARDLINE_STORE_TOKEN's, as for every store; clients of an elastic job then run with
// SHARDLINE_AGENT_STORE=1 so that rank 0 connects to this store instead of hosting one.

#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "collectives/store/tcp_store.h"

namespace {

int Usage(const char* why) {
  std::fprintf(stderr, "shardline-store: %s\nusage: shardline-store [--host H] [--port P]\n", why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  shardline::TcpStoreServerOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--host" || arg == "--port") && i + 1 >= argc) return Usage("missing a value");
    if (arg == "--host") {
      options.host = argv[++i];
    } else if (arg == "--port") {
      if (!absl::SimpleAtoi(argv[++i], &options.port) || options.port < 0 || options.port > 65535) {
        return Usage("--port takes 0..65535");
      }
    } else {
      return Usage(("unknown argument " + arg).c_str());
    }
  }
  // Signals are taken synchronously below, so block them before the server's thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  absl::StatusOr<std::unique_ptr<shardline::TcpStoreServer>> server =
      shardline::TcpStoreServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "shardline-store: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::printf("shardline-store: listening on %s:%d\n", (*server)->bound_address().c_str(),
              (*server)->port());
  std::fflush(stdout);
  // Until standard input closes (the parent is gone) or a signal arrives: one poll on both.
  const int signal_fd = signalfd(-1, &signals, SFD_CLOEXEC);
  if (signal_fd < 0) {
    std::perror("shardline-store: signalfd");
    return 1;
  }
  while (true) {
    pollfd fds[2] = {{.fd = STDIN_FILENO, .events = POLLIN, .revents = 0},
                     {.fd = signal_fd, .events = POLLIN, .revents = 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[1].revents != 0) break;
    if (fds[0].revents != 0) {
      char buffer[256];
      const ssize_t n = read(STDIN_FILENO, buffer, sizeof(buffer));
      if (n <= 0) break;  // closed (or an error): the parent is gone
    }
  }
  close(signal_fd);
  (*server)->Shutdown();
  return 0;
}
