// The TCP store client. One socket per TcpStore, used by one call at a time (a mutex); each call
// runs the client's private io_context on the calling thread until the exchange finishes or the
// deadline passes, in which case the socket is closed (so no late answer can be mistaken for
// the answer to a later request).

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <mutex>
#include <thread>
#include <utility>

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
// A lost connection is re-established once per call, within at most this long.
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
        token_(std::move(token)),
        max_payload_(max_payload),
        where_(store_internal::HostPort(options_.host, options_.port)),
        socket_(io_) {}

  ~Client() {
    boost::system::error_code ec;
    socket_.close(ec);
  }

  const std::string& where() const { return where_; }
  const TcpStoreOptions& options() const { return options_; }

  // Connects and authenticates, retrying with exponential backoff until `deadline`.
  absl::Status Connect(absl::Time deadline) {
    std::lock_guard<std::mutex> lock(mu_);
    const absl::Time start = absl::Now();
    absl::Duration backoff = kInitialBackoff;
    absl::Status last;
    int attempts = 0;
    while (true) {
      ++attempts;
      last = ConnectOnce(deadline);
      if (last.ok() || absl::IsPermissionDenied(last)) return last;
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

  // Sends `request` and returns the server's response (whose code may be an error).
  absl::StatusOr<proto::Response> Call(proto::Request request, absl::Time deadline) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!connected_) {
      absl::Status status = ConnectOnce(std::min(deadline, absl::Now() + kReconnectTimeout));
      if (!status.ok()) {
        return absl::Status(
            absl::IsPermissionDenied(status) ? status.code() : absl::StatusCode::kUnavailable,
            absl::StrCat("store at ", where_, ": not connected (", lost_reason_,
                         ") and reconnecting failed: ", status.message()));
      }
    }
    return Exchange(std::move(request), deadline);
  }

 private:
  // One attempt: resolve, connect, HELLO. Leaves the socket closed unless it returns OK.
  absl::Status ConnectOnce(absl::Time deadline) {
    Disconnect("reconnecting");
    tcp::resolver resolver(io_);
    boost::system::error_code ec;
    tcp::resolver::results_type endpoints;
    resolver.async_resolve(options_.host, std::to_string(options_.port),
                           tcp::resolver::numeric_service,
                           [&](boost::system::error_code e, tcp::resolver::results_type r) {
                             ec = e;
                             endpoints = std::move(r);
                           });
    if (!RunUntil(deadline, [&] { resolver.cancel(); })) {
      return absl::DeadlineExceededError(absl::StrCat("resolving ", options_.host, " timed out"));
    }
    if (ec)
      return absl::UnavailableError(
          absl::StrCat("cannot resolve ", options_.host, ": ", ec.message()));
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

    proto::Request hello;
    hello.op = proto::Op::kHello;
    hello.token = token_;
    hello.rank = options_.rank;
    hello.client_name =
        options_.client_name.empty() ? absl::StrCat("pid ", getpid()) : options_.client_name;
    absl::StatusOr<proto::Response> response = Exchange(std::move(hello), deadline);
    if (!response.ok()) return response.status();
    if (response->code == absl::StatusCode::kPermissionDenied ||
        response->code == absl::StatusCode::kUnauthenticated) {
      Disconnect("token refused");
      return absl::PermissionDeniedError(absl::StrCat(
          "store at ", where_, " refused the token (SHARDLINE_STORE_TOKEN): ", response->message));
    }
    if (response->code != absl::StatusCode::kOk) {
      Disconnect("HELLO refused");
      return absl::Status(
          response->code,
          absl::StrCat("store at ", where_, " refused the connection: ", response->message));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<proto::Response> Exchange(proto::Request request, absl::Time deadline) {
    request.id = next_id_++;
    const std::string frame = proto::EncodeRequest(request);
    if (frame.size() - proto::kHeaderBytes > max_payload_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "store ", Describe(request), ": message of ", frame.size() - proto::kHeaderBytes,
          " bytes exceeds the maximum message size of ", max_payload_,
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
                                    max_payload_ + kResponseSlackBytes);
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
      return absl::DeadlineExceededError(absl::StrCat("store at ", where_, ": no answer to ",
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
      return absl::UnavailableError(absl::StrCat("store at ", where_, ": connection lost during ",
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
    return absl::UnavailableError(absl::StrCat("store at ", where_, ": bad response to ",
                                               Describe(request), ": ", bad_frame.message()));
  }

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

  void CloseSocket() {
    boost::system::error_code ec;
    socket_.close(ec);
  }

  void Disconnect(absl::string_view reason) {
    if (connected_) lost_reason_ = std::string(reason);
    connected_ = false;
    CloseSocket();
  }

  const TcpStoreOptions options_;
  const std::string token_;
  const uint32_t max_payload_;
  const std::string where_;

  std::mutex mu_;
  asio::io_context io_;
  tcp::socket socket_;
  bool connected_ = false;
  std::string lost_reason_ = "never connected";
  uint32_t next_id_ = 1;
};

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
  if (options.host.empty()) {
    return absl::InvalidArgumentError("store host (MASTER_ADDR) must not be empty");
  }
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
    server_options.host = options.listen_host;
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

}  // namespace shardline
