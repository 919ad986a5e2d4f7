// The TCP store server. Everything but Start/Shutdown/stats runs on the one I/O thread, which
// owns the table, the connections and the parked requests: no locks on the request path.

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <boost/asio.hpp>

#include "absl/strings/str_cat.h"
#include "collectives/store/internal/kv_table.h"
#include "collectives/store/internal/server_access.h"
#include "collectives/store/internal/tcp_util.h"
#include "collectives/store/store_protocol.h"
#include "collectives/store/tcp_store.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace shardline {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
namespace proto = store_protocol;

namespace {

// A response may still be in the socket when the client's next request arrives; more than this
// many unwritten responses means the client is not reading them.
constexpr size_t kMaxQueuedResponses = 2;
// Above this, a connection's payload buffer is released after each request.
constexpr size_t kKeepBufferBytes = 4 << 10;
// A request's buffer starts at this and doubles as bytes arrive, up to the announced length.
constexpr size_t kReadChunkBytes = 64 << 10;
// Peer-triggered warnings (drops, refusals): at most this many per period, the rest counted.
constexpr int kWarnBurst = 10;
constexpr absl::Duration kWarnPeriod = absl::Seconds(10);
// TCP keepalive on accepted sockets: a peer whose host died is noticed within about
// kKeepIdleS + kKeepCount * kKeepIntervalS seconds even while its Wait is parked.
constexpr int kKeepIdleS = 60;
constexpr int kKeepIntervalS = 10;
constexpr int kKeepCount = 6;

using SteadyTime = std::chrono::steady_clock::time_point;
// Timers are clamped to this, so that a far deadline cannot overflow the steady clock.
constexpr absl::Duration kMaxTimerDuration = absl::Hours(30 * 24);

}  // namespace

class TcpStoreServer::Impl {
 public:
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
    Conn(Impl* server, tcp::socket socket, std::string peer)
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
    tcp::socket socket;
    std::string peer;
    std::array<char, proto::kHeaderBytes> header{};
    // The request being received: its header, and the payload bytes that have arrived so far
    // (capacity grows with them; all of it is counted in buffered_bytes_).
    proto::FrameHeader pending;
    bool in_message = false;
    std::vector<char> payload;
    size_t received = 0;  // of payload's bytes (its size may include the chunk being read)
    // A refused request: payload bytes still to read and discard, then `refusal` is sent.
    uint64_t drain_left = 0;
    proto::Response refusal;
    std::deque<std::string> out;
    // Before HELLO: the handshake deadline. After: the idle check (see OnTimer).
    asio::steady_timer timer;
    SteadyTime last_activity;
    bool hello_done = false;
    bool close_after_write = false;
    bool closed = false;
    uint64_t parked_id = 0;  // 0: none
    int64_t rank = -1;
    std::string name;
  };

 private:
  // A Get/Wait whose keys are missing: answered when they all exist or its timer fires.
  struct Parked {
    std::shared_ptr<Conn> conn;
    proto::Request request;
    std::vector<std::string> watched;  // keys registered in watchers_
    std::unique_ptr<asio::steady_timer> timer;
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
  void Handle(const std::shared_ptr<Conn>& conn, proto::Request request);
  void Send(const std::shared_ptr<Conn>& conn, const proto::Response& response);
  void Write(const std::shared_ptr<Conn>& conn);
  // Closes after a protocol violation: one WARN line naming the peer and the reason.
  void Drop(const std::shared_ptr<Conn>& conn, absl::string_view reason);
  void Close(const std::shared_ptr<Conn>& conn);
  void CloseAll();

  void Park(const std::shared_ptr<Conn>& conn, proto::Request request);
  void KeyChanged(const std::string& key);
  void Unpark(uint64_t id, std::optional<absl::Status> timeout_error);
  proto::Response Answer(const proto::Request& request);

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
  asio::io_context io_;
  tcp::acceptor acceptor_;
  asio::steady_timer accept_retry_timer_;
  std::thread thread_;
  std::once_flag shutdown_once_;
  bool shutting_down_ = false;  // I/O thread only

  // I/O thread only.
  store_internal::KvTable table_;
  std::set<std::shared_ptr<Conn>> conns_;
  std::map<uint64_t, Parked> parked_;
  std::unordered_multimap<std::string, uint64_t> watchers_;
  uint64_t next_parked_id_ = 1;
  int64_t buffered_bytes_ = 0;
  // Where refused payloads are read to and forgotten (one I/O thread: one buffer serves all).
  std::array<char, kReadChunkBytes> discard_{};

  mutable std::mutex stats_mu_;
  mutable std::condition_variable stats_cv_;
  Stats stats_;
};

absl::Status TcpStoreServer::Impl::Listen() {
  const std::string where = store_internal::HostPort(options_.host, options_.port);
  boost::system::error_code ec;
  tcp::resolver resolver(io_);
  auto endpoints = resolver.resolve(options_.host, std::to_string(options_.port),
                                    tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || endpoints.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("store server: cannot resolve listen address ", where, ": ", ec.message()));
  }
  const tcp::endpoint endpoint = endpoints.begin()->endpoint();
  bound_address_ = endpoint.address().to_string();
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (ec == asio::error::address_in_use) {
    return absl::FailedPreconditionError(absl::StrCat(
        "store server: port ", options_.port, " on ", options_.host,
        " is already in use (another job, or a store left over from an earlier run?); choose "
        "another port (MASTER_PORT) or 0 for an ephemeral one"));
  }
  if (ec == boost::system::errc::address_not_available) {
    return absl::FailedPreconditionError(absl::StrCat(
        "store server: cannot listen on ", where, " (", bound_address_,
        "): that address is not one of this host's (the store must run on the host it names)"));
  }
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("store server: cannot listen on ", where, ": ", ec.message()));
  }
  port_ = acceptor_.local_endpoint(ec).port();
  SL_LOG(INFO, STORE) << "store server listening on "
                      << store_internal::HostPort(options_.host, port_) << " (bound to "
                      << bound_address_ << ")"
                      << (token_.empty() ? " (no token)" : " (token required)") << ", max message "
                      << max_payload_ << " bytes, buffering at most " << max_buffered_
                      << " bytes, idle timeout " << idle_timeout_;
  Accept();
  return absl::OkStatus();
}

void TcpStoreServer::Impl::Accept() {
  acceptor_.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
    if (shutting_down_ || ec == asio::error::operation_aborted) return;
    if (ec) {
      // Out of descriptors, say: retry shortly instead of spinning on the error.
      Warn(absl::StrCat("accept failed: ", ec.message()));
      accept_retry_timer_.expires_after(std::chrono::milliseconds(50));
      accept_retry_timer_.async_wait([this](boost::system::error_code wait_ec) {
        if (!wait_ec && !shutting_down_) Accept();
      });
      return;
    }
    boost::system::error_code peer_ec;
    const tcp::endpoint remote = socket.remote_endpoint(peer_ec);
    std::string peer = peer_ec
                           ? std::string("unknown peer")
                           : store_internal::HostPort(remote.address().to_string(), remote.port());
    if (conns_.size() >= static_cast<size_t>(options_.max_connections)) {
      Warn(absl::StrCat("refusing connection from ", peer, ": already ", conns_.size(),
                        " connections (max ", options_.max_connections, ")"));
      socket.close(peer_ec);
      UpdateStats([](Stats& s) { ++s.refused_connections; });
    } else {
      socket.set_option(tcp::no_delay(true), peer_ec);
      socket.set_option(asio::socket_base::keep_alive(true), peer_ec);
      const int fd = socket.native_handle();
      for (auto [option, value] :
           {std::pair{TCP_KEEPIDLE, kKeepIdleS}, std::pair{TCP_KEEPINTVL, kKeepIntervalS},
            std::pair{TCP_KEEPCNT, kKeepCount}}) {
        (void)setsockopt(fd, IPPROTO_TCP, option, &value, sizeof(value));
      }
      auto conn = std::make_shared<Conn>(this, std::move(socket), std::move(peer));
      conns_.insert(conn);
      UpdateStats([&](Stats& s) { s.open_connections = static_cast<int64_t>(conns_.size()); });
      SL_LOG(TRACE, STORE) << "store server: connection from " << conn->peer;
      ArmTimer(conn, options_.handshake_timeout);
      ReadHeader(conn);
    }
    Accept();
  });
}

void TcpStoreServer::Impl::ArmTimer(const std::shared_ptr<Conn>& conn, absl::Duration after) {
  conn->timer.expires_after(absl::ToChronoNanoseconds(std::min(after, kMaxTimerDuration)));
  // A weak pointer: the timer belongs to the connection and must not keep it alive.
  conn->timer.async_wait([this, weak = std::weak_ptr<Conn>(conn)](boost::system::error_code ec) {
    std::shared_ptr<Conn> conn = weak.lock();
    if (ec || conn == nullptr || conn->closed) return;
    OnTimer(conn);
  });
}

void TcpStoreServer::Impl::OnTimer(const std::shared_ptr<Conn>& conn) {
  if (!conn->hello_done) {
    return Drop(conn,
                absl::StrCat("no HELLO within ", absl::FormatDuration(options_.handshake_timeout),
                             " of connecting (handshake timeout)"));
  }
  // A parked Get/Wait is a client legitimately waiting, however long; bytes that arrived but
  // whose handler has not run yet are traffic too.
  boost::system::error_code ec;
  if (conn->parked_id != 0 || conn->socket.available(ec) > 0) Touch(conn);
  const absl::Duration quiet =
      absl::FromChrono(std::chrono::steady_clock::now() - conn->last_activity);
  if (quiet < idle_timeout_) return ArmTimer(conn, idle_timeout_ - quiet);
  UpdateStats([](Stats& s) { ++s.idle_closed; });
  if (conn->in_message) {
    const uint64_t received =
        conn->drain_left > 0 ? conn->pending.payload_bytes - conn->drain_left : conn->received;
    return Drop(conn, absl::StrCat("stalled in the middle of a ", proto::OpName(conn->pending.op),
                                   " request: ", received, " of ", conn->pending.payload_bytes,
                                   " payload bytes received, nothing for ",
                                   absl::FormatDuration(idle_timeout_),
                                   " (SHARDLINE_STORE_IDLE_TIMEOUT_S)"));
  }
  // A client's pooled connection that went unused: not an error, it reconnects when needed.
  SL_LOG(INFO, STORE) << "store server: closing connection from " << conn->Describe()
                      << ": idle for " << absl::FormatDuration(idle_timeout_)
                      << " (SHARDLINE_STORE_IDLE_TIMEOUT_S)";
  Close(conn);
}

void TcpStoreServer::Impl::Warn(const std::string& message) {
  int64_t suppressed = 0;
  if (!warnings_.Allow(&suppressed)) return;
  SL_LOG(WARN, STORE) << "store server on port " << port_ << ": " << message
                      << SuppressedSuffix(suppressed);
}

void TcpStoreServer::Impl::ReadHeader(const std::shared_ptr<Conn>& conn) {
  asio::async_read(
      conn->socket, asio::buffer(conn->header),
      [this, conn](boost::system::error_code ec, size_t /*bytes*/) {
        if (conn->closed) return;
        if (ec) {
          // EOF between messages is a client leaving, not an error.
          if (ec != asio::error::eof) {
            SL_LOG(INFO, STORE) << "store server: connection from " << conn->Describe()
                                << " ended: " << ec.message();
          }
          Close(conn);
          return;
        }
        Touch(conn);
        absl::StatusOr<proto::FrameHeader> header = proto::DecodeHeader(
            absl::string_view(conn->header.data(), conn->header.size()), max_payload_);
        if (!header.ok()) return Drop(conn, header.status().message());
        // Checked before any payload is read: an unauthenticated peer must not make the server
        // buffer a maximum-size message.
        if (!conn->hello_done && header->payload_bytes > proto::kMaxHelloPayloadBytes) {
          return Drop(
              conn,
              absl::StrCat("sent a ", proto::OpName(header->op), " header claiming ",
                           header->payload_bytes, " payload bytes before the handshake; at most ",
                           proto::kMaxHelloPayloadBytes, " are accepted until HELLO succeeds"));
        }
        if (conn->parked_id != 0 || conn->out.size() >= kMaxQueuedResponses) {
          return Drop(conn, absl::StrCat("sent a ", proto::OpName(header->op),
                                         " request before reading the answer to the previous "
                                         "one (one request at a time per connection)"));
        }
        conn->pending = *header;
        conn->in_message = true;
        conn->payload.clear();
        conn->received = 0;
        ReadPayload(conn);
      });
}

void TcpStoreServer::Impl::ReadPayload(const std::shared_ptr<Conn>& conn) {
  const size_t want = conn->pending.payload_bytes;
  const size_t have = conn->received;
  if (have == want) return FinishPayload(conn);
  if (conn->payload.capacity() == have) {
    // Doubling what has arrived, never sizing from the announced length: a peer that announces
    // a large value and stalls costs about what it sent.
    const size_t target = std::min(want, std::max(2 * have, have + kReadChunkBytes));
    // Small requests (a Get, a Wait, an address) are always taken, so that a job keeps working
    // while others hold the budget; at most max_connections * kKeepBufferBytes of them.
    if (!Reserve(conn, target, /*capped=*/want > kKeepBufferBytes)) {
      return Refuse(
          conn, absl::StrCat(proto::OpName(conn->pending.op), " of ", want,
                             " bytes refused: the store server already buffers ", buffered_bytes_,
                             " bytes of incomplete requests (limit ", max_buffered_,
                             ", SHARDLINE_STORE_MAX_BUFFERED_BYTES); retry"));
    }
  }
  const size_t step = std::min(want, conn->payload.capacity()) - have;
  conn->payload.resize(have + step);
  conn->socket.async_read_some(
      asio::buffer(conn->payload.data() + have, step),
      [this, conn, have](boost::system::error_code ec, size_t bytes) {
        if (conn->closed) return;
        conn->received = have + bytes;
        conn->payload.resize(conn->received);
        if (ec) {
          if (ec == asio::error::operation_aborted) return;
          return Drop(conn,
                      absl::StrCat("truncated ", proto::OpName(conn->pending.op), " message: got ",
                                   conn->received, " of ", conn->pending.payload_bytes,
                                   " payload bytes before: ", ec.message()));
        }
        Touch(conn);
        ReadPayload(conn);
      });
}

void TcpStoreServer::Impl::FinishPayload(const std::shared_ptr<Conn>& conn) {
  conn->in_message = false;
  absl::StatusOr<proto::Request> request = proto::DecodeRequest(
      conn->pending, absl::string_view(conn->payload.data(), conn->payload.size()));
  if (conn->payload.capacity() > kKeepBufferBytes) ReleaseBuffer(conn);
  if (!request.ok()) return Drop(conn, request.status().message());
  Handle(conn, *std::move(request));
  if (!conn->closed) ReadHeader(conn);
}

bool TcpStoreServer::Impl::Reserve(const std::shared_ptr<Conn>& conn, size_t bytes, bool capped) {
  const size_t before = conn->payload.capacity();
  if (bytes <= before) return true;
  if (capped && buffered_bytes_ + static_cast<int64_t>(bytes - before) > max_buffered_) {
    return false;
  }
  conn->payload.reserve(bytes);
  buffered_bytes_ += static_cast<int64_t>(conn->payload.capacity() - before);
  UpdateStats([&](Stats& s) { s.buffered_bytes = buffered_bytes_; });
  return true;
}

void TcpStoreServer::Impl::ReleaseBuffer(const std::shared_ptr<Conn>& conn) {
  const size_t capacity = conn->payload.capacity();
  if (capacity == 0) return;
  std::vector<char>().swap(conn->payload);
  buffered_bytes_ -= static_cast<int64_t>(capacity);
  UpdateStats([&](Stats& s) { s.buffered_bytes = buffered_bytes_; });
}

void TcpStoreServer::Impl::Refuse(const std::shared_ptr<Conn>& conn, std::string message) {
  Warn(absl::StrCat("refusing a request of ", conn->Describe(), ": ", message));
  conn->drain_left = conn->pending.payload_bytes - conn->received;
  ReleaseBuffer(conn);
  conn->refusal = proto::Response();
  conn->refusal.op = conn->pending.op;
  conn->refusal.id = conn->pending.request_id;
  conn->refusal.code = absl::StatusCode::kResourceExhausted;
  conn->refusal.message = std::move(message);
  UpdateStats([](Stats& s) { ++s.refused_requests; });
  Drain(conn);
}

void TcpStoreServer::Impl::Drain(const std::shared_ptr<Conn>& conn) {
  if (conn->drain_left == 0) {
    conn->in_message = false;
    Send(conn, conn->refusal);
    if (!conn->closed) ReadHeader(conn);
    return;
  }
  const size_t step = static_cast<size_t>(std::min<uint64_t>(conn->drain_left, discard_.size()));
  conn->socket.async_read_some(
      asio::buffer(discard_.data(), step), [this, conn](boost::system::error_code ec, size_t n) {
        if (conn->closed) return;
        if (ec) {
          if (ec == asio::error::operation_aborted) return;
          SL_LOG(INFO, STORE) << "store server: connection from " << conn->Describe()
                              << " ended while its refused request was discarded: " << ec.message();
          return Close(conn);
        }
        conn->drain_left -= n;
        Touch(conn);
        Drain(conn);
      });
}

void TcpStoreServer::Impl::Handle(const std::shared_ptr<Conn>& conn, proto::Request request) {
  using proto::Op;
  if (!conn->hello_done) {
    if (request.op != Op::kHello) {
      return Drop(conn,
                  absl::StrCat("first message is ", proto::OpName(request.op), ", expected HELLO"));
    }
    conn->rank = request.rank;
    conn->name = request.client_name;
    proto::Response response;
    response.op = Op::kHello;
    response.id = request.id;
    if (!token_.empty() && !store_internal::TokensEqual(token_, request.token)) {
      // Logged here because the server swallows the error: it only closes this connection.
      Warn(absl::StrCat(
          "refusing ",
          request.rank >= 0 ? absl::StrCat("rank ", request.rank) : std::string("client"), " at ",
          conn->peer, ": ", request.token.empty() ? "no token" : "wrong token",
          " (SHARDLINE_STORE_TOKEN)"));
      response.code = absl::StatusCode::kPermissionDenied;
      response.message = request.token.empty()
                             ? "the store requires a token and the client sent none"
                             : "the client's token does not match the store's";
      conn->close_after_write = true;
      UpdateStats([](Stats& s) { ++s.dropped_connections; });
      Send(conn, response);
      return;
    }
    conn->hello_done = true;
    ArmTimer(conn, idle_timeout_);  // replaces the handshake deadline
    SL_LOG(TRACE, STORE) << "store server: hello from " << conn->Describe();
    Send(conn, response);
    return;
  }
  if (request.op == Op::kHello) return Drop(conn, "sent a second HELLO");

  const bool parks = (request.op == Op::kGet && table_.Find(request.key) == nullptr) ||
                     (request.op == Op::kWait && !table_.ContainsAll(request.keys));
  if (parks && request.timeout_ms != 0) return Park(conn, std::move(request));

  proto::Response response = Answer(request);
  Send(conn, response);
  if (response.code != absl::StatusCode::kOk) return;
  switch (request.op) {
    case Op::kSet:
    case Op::kAdd:
      KeyChanged(request.key);
      break;
    case Op::kCompareSet:
      if (response.value == request.desired) KeyChanged(request.key);
      break;
    case Op::kDelete:
      UpdateStats([](Stats&) {});
      break;
    default:
      break;
  }
}

// Answers `request` from the table as it is now; a Get/Wait whose keys are missing times out.
proto::Response TcpStoreServer::Impl::Answer(const proto::Request& request) {
  using proto::Op;
  proto::Response response;
  response.op = request.op;
  response.id = request.id;
  auto fail = [&](const absl::Status& status) {
    response.code = status.code();
    response.message = std::string(status.message());
  };
  switch (request.op) {
    case Op::kHello:
      break;
    case Op::kSet:
      table_.Set(request.key, request.value);
      break;
    case Op::kGet:
      if (const std::string* value = table_.Find(request.key)) {
        response.value = *value;
      } else {
        fail(absl::DeadlineExceededError(absl::StrCat("Get: key ", PrintableKey(request.key),
                                                      " was not set within ", request.timeout_ms,
                                                      " ms")));
      }
      break;
    case Op::kAdd: {
      absl::StatusOr<int64_t> sum = table_.Add(request.key, request.delta);
      if (sum.ok()) {
        response.number = *sum;
      } else {
        fail(sum.status());
      }
      break;
    }
    case Op::kCompareSet:
      response.value = table_.CompareSet(request.key, request.expected, request.desired);
      break;
    case Op::kWait:
      if (!table_.ContainsAll(request.keys)) {
        fail(absl::DeadlineExceededError(
            absl::StrCat("Wait: keys ", PrintableKeys(table_.Missing(request.keys)),
                         " were not set within ", request.timeout_ms, " ms")));
      }
      break;
    case Op::kCheck:
      response.flag = table_.ContainsAll(request.keys);
      break;
    case Op::kDelete:
      response.flag = table_.Delete(request.key);
      break;
    case Op::kNumKeys:
      response.number = table_.size();
      break;
  }
  return response;
}

void TcpStoreServer::Impl::Park(const std::shared_ptr<Conn>& conn, proto::Request request) {
  const uint64_t id = next_parked_id_++;
  Parked& parked = parked_[id];
  parked.conn = conn;
  parked.watched = request.op == proto::Op::kGet ? std::vector<std::string>{request.key}
                                                 : table_.Missing(request.keys);
  for (const std::string& key : parked.watched) watchers_.emplace(key, id);
  if (request.timeout_ms > 0) {
    parked.timer = std::make_unique<asio::steady_timer>(io_);
    parked.timer->expires_after(absl::ToChronoNanoseconds(
        std::min(absl::Milliseconds(request.timeout_ms), kMaxTimerDuration)));
    parked.timer->async_wait([this, id](boost::system::error_code ec) {
      if (ec) return;  // cancelled: answered or closed before the timeout
      auto it = parked_.find(id);
      if (it == parked_.end()) return;
      proto::Response response = Answer(it->second.request);
      Unpark(id, absl::Status(response.code, response.message));
    });
  }
  parked.request = std::move(request);
  conn->parked_id = id;
  UpdateStats([&](Stats& s) { s.parked_requests = static_cast<int64_t>(parked_.size()); });
}

void TcpStoreServer::Impl::KeyChanged(const std::string& key) {
  std::vector<uint64_t> ready;
  auto [begin, end] = watchers_.equal_range(key);
  for (auto it = begin; it != end; ++it) {
    auto parked = parked_.find(it->second);
    if (parked == parked_.end()) continue;
    const proto::Request& request = parked->second.request;
    const bool done = request.op == proto::Op::kGet ? table_.Find(request.key) != nullptr
                                                    : table_.ContainsAll(request.keys);
    if (done) ready.push_back(it->second);
  }
  for (uint64_t id : ready) Unpark(id, std::nullopt);
  UpdateStats([](Stats&) {});
}

// Removes parked request `id`; answers it (from the table, or with `timeout_error`) unless its
// connection is gone.
void TcpStoreServer::Impl::Unpark(uint64_t id, std::optional<absl::Status> timeout_error) {
  auto it = parked_.find(id);
  if (it == parked_.end()) return;
  Parked parked = std::move(it->second);
  parked_.erase(it);
  for (const std::string& key : parked.watched) {
    auto [begin, end] = watchers_.equal_range(key);
    for (auto w = begin; w != end; ++w) {
      if (w->second == id) {
        watchers_.erase(w);
        break;
      }
    }
  }
  if (parked.timer) parked.timer->cancel();
  parked.conn->parked_id = 0;
  UpdateStats([&](Stats& s) { s.parked_requests = static_cast<int64_t>(parked_.size()); });
  if (parked.conn->closed) return;
  proto::Response response;
  if (timeout_error.has_value()) {
    response.op = parked.request.op;
    response.id = parked.request.id;
    response.code = timeout_error->code();
    response.message = std::string(timeout_error->message());
  } else {
    response = Answer(parked.request);
  }
  Send(parked.conn, response);
}

void TcpStoreServer::Impl::Send(const std::shared_ptr<Conn>& conn,
                                const proto::Response& response) {
  if (conn->closed) return;
  conn->out.push_back(proto::EncodeResponse(response));
  if (conn->out.size() == 1) Write(conn);
}

void TcpStoreServer::Impl::Write(const std::shared_ptr<Conn>& conn) {
  asio::async_write(conn->socket, asio::buffer(conn->out.front()),
                    [this, conn](boost::system::error_code ec, size_t /*bytes*/) {
                      if (conn->closed) return;
                      if (ec) {
                        SL_LOG(INFO, STORE) << "store server: cannot answer " << conn->Describe()
                                            << ": " << ec.message();
                        return Close(conn);
                      }
                      Touch(conn);
                      conn->out.pop_front();
                      if (!conn->out.empty()) return Write(conn);
                      if (conn->close_after_write) Close(conn);
                    });
}

void TcpStoreServer::Impl::Drop(const std::shared_ptr<Conn>& conn, absl::string_view reason) {
  Warn(absl::StrCat("closing connection from ", conn->Describe(), ": ", reason));
  UpdateStats([](Stats& s) { ++s.dropped_connections; });
  Close(conn);
}

void TcpStoreServer::Impl::Close(const std::shared_ptr<Conn>& conn) {
  if (conn->closed) return;
  conn->closed = true;
  boost::system::error_code ec;
  conn->socket.shutdown(tcp::socket::shutdown_both, ec);
  conn->socket.close(ec);
  conn->timer.cancel();
  conn->out.clear();
  ReleaseBuffer(conn);
  if (conn->parked_id != 0) Unpark(conn->parked_id, std::nullopt);
  conns_.erase(conn);
  UpdateStats([&](Stats& s) { s.open_connections = static_cast<int64_t>(conns_.size()); });
}

void TcpStoreServer::Impl::CloseAll() {
  shutting_down_ = true;
  boost::system::error_code ec;
  acceptor_.close(ec);
  accept_retry_timer_.cancel();
  std::vector<std::shared_ptr<Conn>> conns(conns_.begin(), conns_.end());
  for (const auto& conn : conns) Close(conn);
  parked_.clear();
  watchers_.clear();
}

void TcpStoreServer::Impl::Shutdown() {
  std::call_once(shutdown_once_, [this] {
    if (thread_.joinable()) {
      asio::post(io_, [this] {
        CloseAll();
        io_.stop();
      });
      thread_.join();
    } else {
      CloseAll();
    }
    const int64_t suppressed = warnings_.TakeSuppressed();
    if (suppressed > 0) {
      SL_LOG(WARN, STORE) << "store server on port " << port_ << " shut down; " << suppressed
                          << " warning(s) about connections were suppressed";
    } else {
      SL_LOG(INFO, STORE) << "store server on port " << port_ << " shut down";
    }
  });
}

absl::StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(
    TcpStoreServerOptions options) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("store server: port ", options.port, " is not in [0, 65535]"));
  }
  if (options.max_connections < 1) {
    return absl::InvalidArgumentError(absl::StrCat("store server: max_connections ",
                                                   options.max_connections, " must be positive"));
  }
  if (options.handshake_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("store server: handshake_timeout ",
                                                   absl::FormatDuration(options.handshake_timeout),
                                                   " must be positive"));
  }
  SL_ASSIGN_OR_RETURN(std::string token, store_internal::ResolveToken(options.token));
  SL_ASSIGN_OR_RETURN(uint32_t max_payload,
                      store_internal::ResolveMaxMessageBytes(options.max_message_bytes));
  SL_ASSIGN_OR_RETURN(int64_t max_buffered,
                      store_internal::ResolveMaxBufferedBytes(options.max_buffered_bytes));
  SL_ASSIGN_OR_RETURN(absl::Duration idle_timeout,
                      store_internal::ResolveIdleTimeout(options.idle_timeout));
  auto impl = std::make_unique<Impl>(std::move(options), std::move(token), max_payload,
                                     max_buffered, idle_timeout);
  SL_RETURN_IF_ERROR(impl->Listen());
  impl->Run();
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(impl)));
}

TcpStoreServer::TcpStoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TcpStoreServer::~TcpStoreServer() { Shutdown(); }

void TcpStoreServer::Shutdown() { impl_->Shutdown(); }

const std::string& TcpStoreServer::host() const { return impl_->host(); }

const std::string& TcpStoreServer::bound_address() const { return impl_->bound_address(); }

int TcpStoreServer::port() const { return impl_->port(); }

TcpStoreServer::Stats TcpStoreServer::stats() const { return impl_->stats(); }

namespace store_internal {

bool ServerAccess::AwaitStats(const TcpStoreServer& server,
                              const std::function<bool(const TcpStoreServer::Stats&)>& ready,
                              absl::Time deadline) {
  return server.impl_->AwaitStats(ready, deadline);
}

}  // namespace store_internal

}  // namespace shardline
