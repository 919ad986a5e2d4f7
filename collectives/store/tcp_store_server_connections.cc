// The TCP store server's connections (tcp_store_server_impl.h): reading a request's frame in
// chunks within the buffering budget, refusing and draining what does not fit, the handshake
// and idle timers, writing answers in order, and closing.

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <boost/asio.hpp>

#include "absl/strings/str_cat.h"
#include "collectives/store/internal/tcp_store_server_impl.h"
#include "collectives/store/store_protocol.h"
#include "runtime/logging.h"

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

}  // namespace

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
  // A connection that appends on close is held open on purpose: its closing is the message.
  if (conn->parked_id != 0 || !conn->appends_on_close.empty() || conn->socket.available(ec) > 0) {
    Touch(conn);
  }
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
  // Not at shutdown: the server going away is not the client going away.
  if (!shutting_down_) {
    for (const auto& [log, entry] : conn->appends_on_close) AppendToLog(log, entry);
  }
  conn->appends_on_close.clear();
  conns_.erase(conn);
  UpdateStats([&](Stats& s) { s.open_connections = static_cast<int64_t>(conns_.size()); });
}

}  // namespace shardline
