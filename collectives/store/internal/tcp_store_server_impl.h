// File: collectives/store/internal/tcp_store_server_impl.h
// -----------------------------------------------------------------------------
// The TCP store server's implementation (private to collectives/store/). Everything but
// Start/Shutdown/stats runs on the one I/O thread, which owns the table, the connections and
// the parked requests: no locks on the request path.
//
//   tcp_store_server.cc              listening, accepting, shutdown, the public class
//   tcp_store_server_connections.cc  a connection's I/O: framing, buffers and their budget,
//                                    refusals, timers, answers, closing
//   tcp_store_server_requests.cc     the requests: handshake, answers from the table, parked
//                                    Get/Wait and their wake-ups

#ifndef SHARDLINE_COLLECTIVES_STORE_INTERNAL_TCP_STORE_SERVER_IMPL_H_
#define SHARDLINE_COLLECTIVES_STORE_INTERNAL_TCP_STORE_SERVER_IMPL_H_

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <boost/asio.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "collectives/store/internal/kv_table.h"
#include "collectives/store/store_protocol.h"
#include "collectives/store/tcp_store.h"
#include "runtime/logging.h"

namespace shardline {

class TcpStoreServer::Impl {
 public:
  // A request's buffer starts at this and doubles as bytes arrive, up to the announced length.
  static constexpr size_t kReadChunkBytes = 64 << 10;
  // Peer-triggered warnings (drops, refusals): at most this many per period, the rest counted.
  static constexpr int kWarnBurst = 10;
  static constexpr absl::Duration kWarnPeriod = absl::Seconds(10);
  using SteadyTime = std::chrono::steady_clock::time_point;
  // Timers are clamped to this, so that a far deadline cannot overflow the steady clock.
  static constexpr absl::Duration kMaxTimerDuration = absl::Hours(30 * 24);

  struct Conn;

  Impl(TcpStoreServerOptions options, std::string token, uint32_t max_payload, int64_t max_buffered,
       absl::Duration idle_timeout)
      : options_(std::move(options)),
        token_(std::move(token)),
        max_payload_(max_payload),
        max_buffered_(max_buffered),
        idle_timeout_(idle_timeout),
        acceptor_(io_),
        accept_retry_timer_(io_) {}

  absl::Status Listen();
  void Run() {
    thread_ = std::thread([this] { io_.run(); });
  }
  void Shutdown();

  const std::string& host() const { return options_.host; }
  const std::string& bound_address() const { return bound_address_; }
  int port() const { return port_; }
  Stats stats() const {
    std::lock_guard<std::mutex> lock(stats_mu_);
    return stats_;
  }
  bool AwaitStats(const std::function<bool(const Stats&)>& ready, absl::Time deadline) const {
    std::unique_lock<std::mutex> lock(stats_mu_);
    return stats_cv_.wait_until(lock, absl::ToChronoTime(deadline), [&] { return ready(stats_); });
  }

  struct Conn : std::enable_shared_from_this<Conn> {
    Conn(Impl* server, boost::asio::ip::tcp::socket socket, std::string peer)
        : server(server),
          socket(std::move(socket)),
          peer(std::move(peer)),
          timer(server->io_),
          last_activity(std::chrono::steady_clock::now()) {}

    // "rank 3 (trainer) at 10.0.0.2:41234" once HELLO told us who it is, else the address.
    std::string Describe() const {
      if (!hello_done) return peer;
      std::string who = rank >= 0 ? absl::StrCat("rank ", rank) : std::string("client");
      if (!name.empty()) absl::StrAppend(&who, " (", name, ")");
      return absl::StrCat(who, " at ", peer);
    }

    Impl* server;
    boost::asio::ip::tcp::socket socket;
    std::string peer;
    std::array<char, store_protocol::kHeaderBytes> header{};
    // The request being received: its header, and the payload bytes that have arrived so far
    // (capacity grows with them; all of it is counted in buffered_bytes_).
    store_protocol::FrameHeader pending;
    bool in_message = false;
    std::vector<char> payload;
    size_t received = 0;  // of payload's bytes (its size may include the chunk being read)
    // A refused request: payload bytes still to read and discard, then `refusal` is sent.
    uint64_t drain_left = 0;
    store_protocol::Response refusal;
    std::deque<std::string> out;
    // Before HELLO: the handshake deadline. After: the idle check (see OnTimer).
    boost::asio::steady_timer timer;
    SteadyTime last_activity;
    bool hello_done = false;
    bool close_after_write = false;
    bool closed = false;
    uint64_t parked_id = 0;  // 0: none
    // APPEND_ON_CLOSE requests: (log key, entry), appended when the connection closes.
    std::vector<std::pair<std::string, std::string>> appends_on_close;
    int64_t rank = -1;
    std::string name;
  };

 private:
  // A Get/Wait whose keys are missing: answered when they all exist or its timer fires.
  struct Parked {
    std::shared_ptr<Conn> conn;
    store_protocol::Request request;
    std::vector<std::string> watched;  // keys registered in watchers_
    std::unique_ptr<boost::asio::steady_timer> timer;
  };

  void Accept();
  void ArmTimer(const std::shared_ptr<Conn>& conn, absl::Duration after);
  void OnTimer(const std::shared_ptr<Conn>& conn);
  void ReadHeader(const std::shared_ptr<Conn>& conn);
  // Receives conn->pending's payload in chunks, growing the buffer only as bytes arrive.
  void ReadPayload(const std::shared_ptr<Conn>& conn);
  void FinishPayload(const std::shared_ptr<Conn>& conn);
  // Grows conn's payload capacity to `bytes` unless (if `capped`) that takes buffered_bytes_
  // over max_buffered_.
  bool Reserve(const std::shared_ptr<Conn>& conn, size_t bytes, bool capped);
  void ReleaseBuffer(const std::shared_ptr<Conn>& conn);
  // Refuses the request being received (over max_buffered_): discards the rest of its payload,
  // then answers ResourceExhausted; the connection stays usable.
  void Refuse(const std::shared_ptr<Conn>& conn, std::string message);
  void Drain(const std::shared_ptr<Conn>& conn);
  static void Touch(const std::shared_ptr<Conn>& conn) {
    conn->last_activity = std::chrono::steady_clock::now();
  }
  // A WARN line unless the rate limiter holds it back.
  void Warn(const std::string& message);
  void Handle(const std::shared_ptr<Conn>& conn, store_protocol::Request request);
  void Send(const std::shared_ptr<Conn>& conn, const store_protocol::Response& response);
  void Write(const std::shared_ptr<Conn>& conn);
  // Closes after a protocol violation: one WARN line naming the peer and the reason.
  void Drop(const std::shared_ptr<Conn>& conn, absl::string_view reason);
  void Close(const std::shared_ptr<Conn>& conn);
  void CloseAll();

  void Park(const std::shared_ptr<Conn>& conn, store_protocol::Request request);
  // Sets the first missing key of "<log>/1", "<log>/2", ... to `entry` (the append of
  // elastic logs; clients append the same way, with COMPARE_SET).
  void AppendToLog(const std::string& log, const std::string& entry);
  void KeyChanged(const std::string& key);
  void Unpark(uint64_t id, std::optional<absl::Status> timeout_error);
  store_protocol::Response Answer(const store_protocol::Request& request);

  template <typename F>
  void UpdateStats(F&& f) {
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      f(stats_);
      stats_.keys = table_.size();
    }
    stats_cv_.notify_all();
  }

  const TcpStoreServerOptions options_;
  const std::string token_;
  const uint32_t max_payload_;
  const int64_t max_buffered_;
  const absl::Duration idle_timeout_;
  int port_ = 0;
  std::string bound_address_;
  LogRateLimiter warnings_{kWarnBurst, kWarnPeriod};

  // io_ first: destroyed last, after every object bound to it.
  boost::asio::io_context io_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer accept_retry_timer_;
  std::thread thread_;
  std::once_flag shutdown_once_;
  bool shutting_down_ = false;  // I/O thread only

  // I/O thread only.
  store_internal::KvTable table_;
  std::set<std::shared_ptr<Conn>> conns_;
  std::map<uint64_t, Parked> parked_;
  std::unordered_multimap<std::string, uint64_t> watchers_;
  // AppendToLog: where each log's scan for its first missing index starts.
  std::unordered_map<std::string, int64_t> log_next_;
  uint64_t next_parked_id_ = 1;
  int64_t buffered_bytes_ = 0;
  // Where refused payloads are read to and forgotten (one I/O thread: one buffer serves all).
  std::array<char, kReadChunkBytes> discard_{};

  mutable std::mutex stats_mu_;
  mutable std::condition_variable stats_cv_;
  Stats stats_;
};

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_STORE_INTERNAL_TCP_STORE_SERVER_IMPL_H_
