// The TCP store client. Each call in flight has a connection of its own, taken from a small pool
// (opened on demand, kept for reuse): a call never waits behind another thread's blocking Get,
// which may be waiting for the very key this call sets. A call runs its connection's private
// io_context on the calling thread until the exchange finishes or the deadline passes, in which
// case the socket is closed (so no late answer can be mistaken for the answer to a later
// request).

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
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

// A parked Get/Wait is answered by the server when its timeout passes; the client waits this
// much longer for that answer before it gives up on the connection.
constexpr absl::Duration kServerAnswerGrace = absl::Seconds(2);
// Responses carry a few bytes more than the request that stored the value.
constexpr uint32_t kResponseSlackBytes = 4096;
constexpr absl::Duration kInitialBackoff = absl::Milliseconds(10);
constexpr absl::Duration kMaxBackoff = absl::Seconds(1);
// A lost connection is re-established once per call, within at most this long; so is a
// connection opened for a call that finds every other one busy.
constexpr absl::Duration kReconnectTimeout = absl::Seconds(2);

std::string Describe(const proto::Request& request) {
  std::string text = proto::OpName(request.op);
  if (!request.key.empty()) absl::StrAppend(&text, " ", PrintableKey(request.key));
  if (!request.keys.empty()) absl::StrAppend(&text, " ", PrintableKeys(request.keys));
  return text;
}

int64_t TimeoutMs(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)));
}

}  // namespace

class TcpStore::Client {
 public:
  Client(TcpStoreOptions options, std::string token, uint32_t max_payload)
      : options_(std::move(options)),
        max_payload_(max_payload),
        where_(store_internal::HostPort(options_.host, options_.port)),
        hello_(MakeHello(options_, std::move(token))) {}

  const std::string& where() const { return where_; }
  const TcpStoreOptions& options() const { return options_; }

  // Opens the first connection and authenticates, retrying with exponential backoff until
  // `deadline`.
  absl::Status Connect(absl::Time deadline) {
    const size_t hello_bytes = proto::EncodeRequest(hello_).size() - proto::kHeaderBytes;
    if (hello_bytes > proto::kMaxHelloPayloadBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "store at ", where_, ": the HELLO message (token of ", hello_.token.size(),
          " bytes, client name of ", hello_.client_name.size(), " bytes) is ", hello_bytes,
          " bytes, over the ", proto::kMaxHelloPayloadBytes,
          " that a server accepts before the handshake; shorten SHARDLINE_STORE_TOKEN or "
          "client_name"));
    }
    auto connection = std::make_unique<Connection>(this, "never connected");
    const absl::Time start = absl::Now();
    absl::Duration backoff = kInitialBackoff;
    absl::Status last;
    int attempts = 0;
    while (true) {
      ++attempts;
      last = connection->ConnectOnce(deadline);
      if (absl::IsPermissionDenied(last)) return last;
      if (last.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        idle_.push_back(std::move(connection));
        opened_ = 1;
        return absl::OkStatus();
      }
      if (absl::Now() + backoff >= deadline) break;
      SL_LOG(TRACE, STORE) << "store at " << where_ << ": attempt " << attempts
                           << " failed, retrying in " << backoff << ": " << last;
      // Nothing to wait on but time: the server may simply not be up yet.
      std::this_thread::sleep_for(absl::ToChronoNanoseconds(backoff));
      backoff = std::min(backoff * 2, kMaxBackoff);
    }
    return absl::UnavailableError(absl::StrCat(
        "store at ", where_, " unreachable: no connection after ", attempts, " attempts in ",
        absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1))),
        " (until the deadline); last error: ", last.message()));
  }

  // Sends `request` on a connection of its own and returns the server's response (whose code
  // may be an error).
  absl::StatusOr<proto::Response> Call(proto::Request request, absl::Time deadline) {
    SL_ASSIGN_OR_RETURN(std::unique_ptr<Connection> connection, Acquire(request, deadline));
    absl::StatusOr<proto::Response> response = connection->Call(std::move(request), deadline);
    Release(std::move(connection));
    return response;
  }

  // Sends `request` on a new connection that is then held, unused, until this client is
  // destroyed (APPEND_ON_CLOSE: its closing is the message).
  absl::StatusOr<proto::Response> CallAndHold(proto::Request request, absl::Time deadline) {
    auto connection = std::make_unique<Connection>(this, "opened to be held until the end");
    absl::StatusOr<proto::Response> response = connection->Call(std::move(request), deadline);
    if (response.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      held_.push_back(std::move(connection));
    }
    return response;
  }

 private:
  // One socket with its own io_context, used by one call at a time (the pool hands it out).
  class Connection {
   public:
    Connection(const Client* client, std::string lost_reason)
        : client_(client), socket_(io_), lost_reason_(std::move(lost_reason)) {}

    ~Connection() { CloseSocket(); }

    // One attempt: resolve, connect, HELLO. Leaves the socket closed unless it returns OK.
    absl::Status ConnectOnce(absl::Time deadline);

    // Exchanges `request` for its response, first reconnecting once if the connection was lost.
    absl::StatusOr<proto::Response> Call(proto::Request request, absl::Time deadline) {
      DisconnectIfClosedByPeer();
      if (!connected_) {
        absl::Status status = ConnectOnce(std::min(deadline, absl::Now() + kReconnectTimeout));
        if (!status.ok()) {
          return absl::Status(
              absl::IsPermissionDenied(status) ? status.code() : absl::StatusCode::kUnavailable,
              absl::StrCat("store at ", client_->where_, ": not connected (", lost_reason_,
                           ") and connecting for ", Describe(request),
                           " failed: ", status.message()));
        }
      }
      return Exchange(std::move(request), deadline);
    }

   private:
    absl::StatusOr<proto::Response> Exchange(proto::Request request, absl::Time deadline);

    // Runs the io_context until its pending operations finish (true) or `deadline` passes
    // (false: `cancel` is called and the aborted handlers are drained before returning).
    template <typename Cancel>
    bool RunUntil(absl::Time deadline, Cancel cancel) {
      io_.restart();
      // run_for in chunks: a far deadline must not overflow the steady clock.
      constexpr absl::Duration kChunk = absl::Hours(1);
      while (!io_.stopped()) {
        const absl::Duration left = deadline - absl::Now();
        if (left <= absl::ZeroDuration()) break;
        io_.run_for(absl::ToChronoNanoseconds(std::min(left, kChunk)));
      }
      if (io_.stopped()) return true;
      cancel();
      io_.restart();
      io_.run();
      return false;
    }

    // A pooled connection the server closed while it sat unused (its idle timeout, say) has a
    // FIN waiting: reopen it rather than fail the call on it.
    void DisconnectIfClosedByPeer() {
      if (!connected_) return;
      char byte;
      const ssize_t n = recv(socket_.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
      Disconnect(n == 0  ? "the server closed it while it was idle"
                 : n > 0 ? "the server sent bytes nobody asked for"
                         : "the connection failed while it was idle");
    }

    void CloseSocket() {
      boost::system::error_code ec;
      socket_.close(ec);
    }

    void Disconnect(absl::string_view reason) {
      if (connected_) lost_reason_ = std::string(reason);
      connected_ = false;
      CloseSocket();
    }

    const Client* const client_;
    asio::io_context io_;
    tcp::socket socket_;
    bool connected_ = false;
    std::string lost_reason_;
    uint32_t next_id_ = 1;
  };

  static proto::Request MakeHello(const TcpStoreOptions& options, std::string token) {
    proto::Request hello;
    hello.op = proto::Op::kHello;
    hello.token = std::move(token);
    hello.rank = options.rank;
    hello.client_name =
        options.client_name.empty() ? absl::StrCat("pid ", getpid()) : options.client_name;
    return hello;
  }

  // An idle connection, else a new (not yet connected) one while fewer than
  // max_concurrent_calls exist, else waits for one to be released until `deadline`.
  absl::StatusOr<std::unique_ptr<Connection>> Acquire(const proto::Request& request,
                                                      absl::Time deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    const auto available = [&] {
      return !idle_.empty() || opened_ < options_.max_concurrent_calls;
    };
    if (deadline == absl::InfiniteFuture()) {
      cv_.wait(lock, available);
    } else if (!cv_.wait_until(lock, absl::ToChronoTime(deadline), available)) {
      return absl::DeadlineExceededError(
          absl::StrCat("store at ", where_, ": ", Describe(request), " found all ",
                       options_.max_concurrent_calls,
                       " connections of this store busy with other calls until its deadline "
                       "(TcpStoreOptions::max_concurrent_calls)"));
    }
    if (!idle_.empty()) {
      std::unique_ptr<Connection> connection = std::move(idle_.back());
      idle_.pop_back();
      return connection;
    }
    ++opened_;
    SL_LOG(TRACE, STORE) << "store at " << where_ << ": opening connection " << opened_ << " for "
                         << Describe(request) << " (the others are busy)";
    return std::make_unique<Connection>(this, "opened for a call while the others were busy");
  }

  void Release(std::unique_ptr<Connection> connection) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      idle_.push_back(std::move(connection));
    }
    cv_.notify_one();
  }

  const TcpStoreOptions options_;
  const uint32_t max_payload_;
  const std::string where_;
  const proto::Request hello_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Connection>> idle_;  // guarded by mu_
  std::vector<std::unique_ptr<Connection>> held_;  // guarded by mu_; CallAndHold's
  int opened_ = 0;                                 // guarded by mu_; idle and in use
};

absl::Status TcpStore::Client::Connection::ConnectOnce(absl::Time deadline) {
  Disconnect("reconnecting");
  const TcpStoreOptions& options = client_->options_;
  tcp::resolver resolver(io_);
  boost::system::error_code ec;
  tcp::resolver::results_type endpoints;
  resolver.async_resolve(options.host, std::to_string(options.port), tcp::resolver::numeric_service,
                         [&](boost::system::error_code e, tcp::resolver::results_type r) {
                           ec = e;
                           endpoints = std::move(r);
                         });
  if (!RunUntil(deadline, [&] { resolver.cancel(); })) {
    return absl::DeadlineExceededError(absl::StrCat("resolving ", options.host, " timed out"));
  }
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", options.host, ": ", ec.message()));
  }
  asio::async_connect(socket_, endpoints,
                      [&](boost::system::error_code e, const tcp::endpoint&) { ec = e; });
  if (!RunUntil(deadline, [&] { CloseSocket(); })) {
    CloseSocket();
    return absl::DeadlineExceededError("connect timed out");
  }
  if (ec) {
    CloseSocket();
    return absl::UnavailableError(absl::StrCat("connect failed: ", ec.message()));
  }
  socket_.set_option(tcp::no_delay(true), ec);
  connected_ = true;

  absl::StatusOr<proto::Response> response = Exchange(client_->hello_, deadline);
  if (!response.ok()) return response.status();
  const std::string& where = client_->where_;
  if (response->code == absl::StatusCode::kPermissionDenied ||
      response->code == absl::StatusCode::kUnauthenticated) {
    Disconnect("token refused");
    return absl::PermissionDeniedError(absl::StrCat(
        "store at ", where, " refused the token (SHARDLINE_STORE_TOKEN): ", response->message));
  }
  if (response->code != absl::StatusCode::kOk) {
    Disconnect("HELLO refused");
    return absl::Status(
        response->code,
        absl::StrCat("store at ", where, " refused the connection: ", response->message));
  }
  return absl::OkStatus();
}

absl::StatusOr<proto::Response> TcpStore::Client::Connection::Exchange(proto::Request request,
                                                                       absl::Time deadline) {
  const uint32_t max_payload = client_->max_payload_;
  const std::string& where = client_->where_;
  request.id = next_id_++;
  const std::string frame = proto::EncodeRequest(request);
  if (frame.size() - proto::kHeaderBytes > max_payload) {
    return absl::InvalidArgumentError(absl::StrCat(
        "store ", Describe(request), ": message of ", frame.size() - proto::kHeaderBytes,
        " bytes exceeds the maximum message size of ", max_payload,
        " bytes (SHARDLINE_STORE_MAX_MESSAGE_BYTES)"));
  }
  boost::system::error_code io_error;
  size_t payload_read = 0;
  absl::Status bad_frame;
  std::array<char, proto::kHeaderBytes> header_bytes{};
  proto::FrameHeader header;
  std::string payload;
  asio::async_write(socket_, asio::buffer(frame), [&](boost::system::error_code ec, size_t) {
    if (ec) {
      io_error = ec;
      return;
    }
    asio::async_read(
        socket_, asio::buffer(header_bytes), [&](boost::system::error_code ec, size_t) {
          if (ec) {
            io_error = ec;
            return;
          }
          absl::StatusOr<proto::FrameHeader> decoded =
              proto::DecodeHeader(absl::string_view(header_bytes.data(), header_bytes.size()),
                                  max_payload + kResponseSlackBytes);
          if (!decoded.ok()) {
            bad_frame = decoded.status();
            return;
          }
          header = *decoded;
          payload.resize(header.payload_bytes);
          asio::async_read(socket_, asio::buffer(payload),
                           [&](boost::system::error_code ec, size_t n) {
                             io_error = ec;
                             payload_read = n;
                           });
        });
  });
  if (!RunUntil(deadline, [&] { CloseSocket(); })) {
    Disconnect("a call timed out");
    return absl::DeadlineExceededError(absl::StrCat("store at ", where, ": no answer to ",
                                                    Describe(request), " before the deadline"));
  }
  if (io_error) {
    const std::string cause = io_error == asio::error::eof
                                  ? std::string("the server closed the connection")
                                  : io_error.message();
    Disconnect(absl::StrCat("connection lost during ", proto::OpName(request.op)));
    const char* hint = request.op == proto::Op::kHello
                           ? " (a protocol version mismatch, a server at its connection limit, "
                             "or not a shardline store?)"
                           : "";
    return absl::UnavailableError(absl::StrCat("store at ", where, ": connection lost during ",
                                               Describe(request), ": ", cause, hint));
  }
  if (bad_frame.ok()) {
    absl::StatusOr<proto::Response> response = proto::DecodeResponse(header, payload);
    if (!response.ok()) {
      bad_frame = response.status();
    } else if (response->id != request.id || response->op != request.op) {
      bad_frame = absl::InvalidArgumentError(
          absl::StrCat("answer to ", proto::OpName(response->op), " #", response->id, " where ",
                       proto::OpName(request.op), " #", request.id, " was expected"));
    } else {
      return response;
    }
  }
  Disconnect("malformed response");
  return absl::UnavailableError(absl::StrCat("store at ", where, ": bad response to ",
                                             Describe(request), ": ", bad_frame.message()));
}

absl::StatusOr<std::unique_ptr<TcpStore>> TcpStore::Connect(TcpStoreOptions options,
                                                            absl::Time deadline) {
  return Create(std::move(options), /*is_server=*/false, deadline);
}

absl::StatusOr<std::unique_ptr<TcpStore>> TcpStore::Create(TcpStoreOptions options, bool is_server,
                                                           absl::Time deadline) {
  if (options.port < 0 || options.port > 65535 || (options.port == 0 && !is_server)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "store port ", options.port, " is not in [1, 65535] (0 only when hosting the server)"));
  }
  if (options.max_concurrent_calls < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "store max_concurrent_calls ", options.max_concurrent_calls, " must be positive"));
  }
  if (options.host.empty()) {
    return absl::InvalidArgumentError("store host (MASTER_ADDR) must not be empty");
  }
  SL_RETURN_IF_ERROR(store_internal::CheckHostHasNoPort(options.host, "store host"));
  if (options.timeout == absl::ZeroDuration()) {
    SL_ASSIGN_OR_RETURN(options.timeout, DefaultTimeout());
  } else if (options.timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("store timeout ", absl::FormatDuration(options.timeout), " must be positive"));
  }
  SL_ASSIGN_OR_RETURN(std::string token, store_internal::ResolveToken(options.token));
  SL_ASSIGN_OR_RETURN(uint32_t max_payload,
                      store_internal::ResolveMaxMessageBytes(options.max_message_bytes));
  std::unique_ptr<TcpStoreServer> server;
  if (is_server) {
    TcpStoreServerOptions server_options;
    server_options.host = options.listen_host.empty() ? options.host : options.listen_host;
    server_options.port = options.port;
    server_options.token = token;
    server_options.max_message_bytes = max_payload;
    server_options.max_connections = options.max_connections;
    SL_ASSIGN_OR_RETURN(server, TcpStoreServer::Start(std::move(server_options)));
    options.port = server->port();
  }
  auto client = std::make_unique<Client>(std::move(options), std::move(token), max_payload);
  SL_RETURN_IF_ERROR(client->Connect(deadline));
  return std::unique_ptr<TcpStore>(new TcpStore(std::move(server), std::move(client)));
}

TcpStore::TcpStore(std::unique_ptr<TcpStoreServer> server, std::unique_ptr<Client> client)
    : server_(std::move(server)), client_(std::move(client)) {}

TcpStore::~TcpStore() = default;

const std::string& TcpStore::host() const { return client_->options().host; }

int TcpStore::port() const { return client_->options().port; }

namespace {

// The response's status, with the store's address in front of a server-side error.
absl::Status ResponseStatus(const proto::Response& response, const std::string& where) {
  if (response.code == absl::StatusCode::kOk) return absl::OkStatus();
  return absl::Status(response.code, absl::StrCat("store at ", where, ": ", response.message));
}

}  // namespace

absl::Status TcpStore::DoSet(absl::string_view key, absl::string_view value) {
  proto::Request request;
  request.op = proto::Op::kSet;
  request.key = std::string(key);
  request.value = std::string(value);
  SL_ASSIGN_OR_RETURN(proto::Response response,
                      client_->Call(std::move(request), absl::Now() + client_->options().timeout));
  return ResponseStatus(response, client_->where());
}

absl::StatusOr<std::string> TcpStore::DoGet(absl::string_view key, absl::Time deadline) {
  proto::Request request;
  request.op = proto::Op::kGet;
  request.key = std::string(key);
  request.timeout_ms = TimeoutMs(deadline);
  const absl::Time io_deadline =
      deadline == absl::InfiniteFuture() ? deadline : deadline + kServerAnswerGrace;
  SL_ASSIGN_OR_RETURN(proto::Response response, client_->Call(std::move(request), io_deadline));
  SL_RETURN_IF_ERROR(ResponseStatus(response, client_->where()));
  return std::move(response.value);
}

absl::StatusOr<int64_t> TcpStore::DoAdd(absl::string_view key, int64_t delta) {
  proto::Request request;
  request.op = proto::Op::kAdd;
  request.key = std::string(key);
  request.delta = delta;
  SL_ASSIGN_OR_RETURN(proto::Response response,
                      client_->Call(std::move(request), absl::Now() + client_->options().timeout));
  SL_RETURN_IF_ERROR(ResponseStatus(response, client_->where()));
  return response.number;
}

absl::StatusOr<std::string> TcpStore::DoCompareSet(absl::string_view key,
                                                   absl::string_view expected,
                                                   absl::string_view desired) {
  proto::Request request;
  request.op = proto::Op::kCompareSet;
  request.key = std::string(key);
  request.expected = std::string(expected);
  request.desired = std::string(desired);
  SL_ASSIGN_OR_RETURN(proto::Response response,
                      client_->Call(std::move(request), absl::Now() + client_->options().timeout));
  SL_RETURN_IF_ERROR(ResponseStatus(response, client_->where()));
  return std::move(response.value);
}

absl::Status TcpStore::DoWait(absl::Span<const std::string> keys, absl::Time deadline) {
  proto::Request request;
  request.op = proto::Op::kWait;
  request.keys.assign(keys.begin(), keys.end());
  request.timeout_ms = TimeoutMs(deadline);
  const absl::Time io_deadline =
      deadline == absl::InfiniteFuture() ? deadline : deadline + kServerAnswerGrace;
  SL_ASSIGN_OR_RETURN(proto::Response response, client_->Call(std::move(request), io_deadline));
  return ResponseStatus(response, client_->where());
}

absl::StatusOr<bool> TcpStore::DoCheck(absl::Span<const std::string> keys) {
  proto::Request request;
  request.op = proto::Op::kCheck;
  request.keys.assign(keys.begin(), keys.end());
  SL_ASSIGN_OR_RETURN(proto::Response response,
                      client_->Call(std::move(request), absl::Now() + client_->options().timeout));
  SL_RETURN_IF_ERROR(ResponseStatus(response, client_->where()));
  return response.flag;
}

absl::StatusOr<bool> TcpStore::DoDelete(absl::string_view key) {
  proto::Request request;
  request.op = proto::Op::kDelete;
  request.key = std::string(key);
  SL_ASSIGN_OR_RETURN(proto::Response response,
                      client_->Call(std::move(request), absl::Now() + client_->options().timeout));
  SL_RETURN_IF_ERROR(ResponseStatus(response, client_->where()));
  return response.flag;
}

absl::StatusOr<int64_t> TcpStore::DoNumKeys() {
  proto::Request request;
  request.op = proto::Op::kNumKeys;
  SL_ASSIGN_OR_RETURN(proto::Response response,
                      client_->Call(std::move(request), absl::Now() + client_->options().timeout));
  SL_RETURN_IF_ERROR(ResponseStatus(response, client_->where()));
  return response.number;
}

absl::Status TcpStore::DoAppendOnClose(absl::string_view log, absl::string_view entry,
                                       absl::Time deadline) {
  proto::Request request;
  request.op = proto::Op::kAppendOnClose;
  request.key = std::string(log);
  request.value = std::string(entry);
  SL_ASSIGN_OR_RETURN(proto::Response response, client_->CallAndHold(std::move(request), deadline));
  return ResponseStatus(response, client_->where());
}

}  // namespace shardline
