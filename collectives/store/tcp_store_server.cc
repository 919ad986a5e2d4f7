// The TCP store server: listening, accepting connections, shutting down, and the public
// TcpStoreServer. The implementation's class and its threading rule are in
// internal/tcp_store_server_impl.h; connections and requests have their own files.

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <boost/asio.hpp>

#include "absl/strings/str_cat.h"
#include "collectives/store/internal/server_access.h"
#include "collectives/store/internal/tcp_store_server_impl.h"
#include "collectives/store/internal/tcp_util.h"
#include "collectives/store/tcp_store.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace shardline {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

// TCP keepalive on accepted sockets: a peer whose host died is noticed within about
// kKeepIdleS + kKeepCount * kKeepIntervalS seconds even while its Wait is parked.
constexpr int kKeepIdleS = 60;
constexpr int kKeepIntervalS = 10;
constexpr int kKeepCount = 6;

}  // namespace

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
  // With SO_REUSEADDR two sockets may both bind the port before either listens; the second
  // listen then fails with EADDRINUSE: the port is taken either way.
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
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

void TcpStoreServer::Impl::Warn(const std::string& message) {
  int64_t suppressed = 0;
  if (!warnings_.Allow(&suppressed)) return;
  SL_LOG(WARN, STORE) << "store server on port " << port_ << ": " << message
                      << SuppressedSuffix(suppressed);
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
