// The TCP store server's requests (tcp_store_server_impl.h): the HELLO handshake, answers from
// the table, and Get/Wait requests whose keys are missing, parked until the keys exist or their
// timeout fires.

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <boost/asio.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "collectives/store/internal/tcp_store_server_impl.h"
#include "collectives/store/internal/tcp_util.h"
#include "collectives/store/store.h"
#include "collectives/store/store_protocol.h"
#include "runtime/logging.h"

namespace shardline {

namespace asio = boost::asio;
namespace proto = store_protocol;

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
  if (request.op == Op::kAppendOnClose) {
    SL_LOG(TRACE, STORE) << "store server: " << conn->Describe() << " appends "
                         << PrintableKey(request.value) << " to " << PrintableKey(request.key)
                         << " when it closes";
    conn->appends_on_close.emplace_back(std::move(request.key), std::move(request.value));
    proto::Response response;
    response.op = request.op;
    response.id = request.id;
    Send(conn, response);
    return;
  }

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
    case Op::kAppendOnClose:  // handled by Handle: it changes the connection, not the table
      break;
  }
  return response;
}

void TcpStoreServer::Impl::AppendToLog(const std::string& log, const std::string& entry) {
  int64_t& next = log_next_[log];
  if (next < 1) next = 1;
  std::string key = absl::StrCat(log, "/", next);
  while (table_.Find(key) != nullptr) key = absl::StrCat(log, "/", ++next);
  SL_LOG(INFO, STORE) << "store server: appending " << PrintableKey(entry) << " to "
                      << PrintableKey(key) << " (its client's connection closed)";
  table_.Set(key, entry);
  ++next;
  KeyChanged(key);
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

}  // namespace shardline
