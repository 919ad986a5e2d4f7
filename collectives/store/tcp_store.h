// File: collectives/store/tcp_store.h
// -----------------------------------------------------------------------------
// The multi-process store: a TcpStoreServer (hosted by rank 0 or a standalone process) and
// TcpStore clients speaking the protocol of store_protocol.h over TCP (Boost.Asio).
//
//   // rank 0 hosts the server in-process and is also a client of it (c10d's is_master):
//   ASSIGN_OR_RETURN(auto store, TcpStore::Create({.host = addr, .port = 29500},
//                                                 /*is_server=*/rank == 0, deadline));
//   RETURN_IF_ERROR(store->Set("rank0/addr", my_address));
//
// Server: one io_context on its own thread; the table lives on that thread, so requests are
// applied one at a time in arrival order. A Get/Wait on a missing key is parked and answered
// when the key appears or its timeout passes — nothing polls. One request per connection is
// in flight at a time and each read buffer is capped by the maximum message size (by
// kMaxHelloPayloadBytes until the connection's HELLO is accepted), so a connection costs bounded
// memory: a request's buffer grows as its bytes arrive, and all connections' incomplete requests
// together stay under TcpStoreServerOptions::max_buffered_bytes (a request that would exceed it
// is read and discarded, then answered ResourceExhausted). A connection that sends a malformed,
// oversized, truncated or out-of-order message, that has not completed HELLO within
// TcpStoreServerOptions::handshake_timeout, or that stalls in the middle of a message for
// idle_timeout, is closed with a WARN line naming the peer and the reason (at most 10 such
// lines per 10 s; the next one says how many were held back); every other connection keeps
// being served. An idle connection (no Get/Wait waiting, no byte moved for idle_timeout) is
// closed quietly, and the client reopens it on its next call. If a
// token is configured (SHARDLINE_STORE_TOKEN), the first message of every connection must carry
// it (compared in constant time) or the client is refused.
//
// Client: connects with retries and exponential backoff until its deadline; every call is
// bounded by a deadline (Get/Wait: the caller's; the others: TcpStoreOptions::timeout). A call
// never hangs on a dead server: a closed connection is Unavailable, a silent one
// DeadlineExceeded (for Get/Wait the server answers at the deadline; the client gives a silent
// server 2 s more before it drops the connection). After a lost connection the next call
// reconnects once (within 2 s). Calls from several threads run concurrently, each on a
// connection of its own, so a Set never waits behind another thread's Get for the same key; a
// call beyond TcpStoreOptions::max_concurrent_calls waits for a free connection, but only until
// its own deadline.
//
// Errors (all name host:port):
//   port in use          FailedPrecondition "... port 29500 on 0.0.0.0 is already in use ..."
//   unreachable store    Unavailable "store at h:p unreachable: ... attempts ...: <last error>"
//   wrong/missing token  PermissionDenied "store at h:p refused the token (SHARDLINE_STORE_TOKEN)"
//   server gone          Unavailable "store at h:p: connection lost during GET 'k': ..."
//   server's buffer full ResourceExhausted "store at h:p: SET of N bytes refused: the store server
//                        already buffers M bytes of incomplete requests (limit L, ...); retry"
//   host with a port     InvalidArgument "store host='node0:29500' is not a plain host name ..."

#ifndef SHARDLINE_COLLECTIVES_STORE_TCP_STORE_H_
#define SHARDLINE_COLLECTIVES_STORE_TCP_STORE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "collectives/store/store.h"
#include "runtime/config.h"

namespace shardline {

namespace store_internal {
class ServerAccess;
}  // namespace store_internal

// SHARDLINE_STORE_TOKEN: shared secret; empty (default) means no authentication.
const Param<std::string>& ParamStoreToken();
// SHARDLINE_STORE_MAX_MESSAGE_BYTES: largest accepted message payload (default 64 MiB).
const Param<int64_t>& ParamStoreMaxMessageBytes();
// SHARDLINE_STORE_MAX_BUFFERED_BYTES: bytes of incomplete requests a server holds for all its
// connections together (default 256 MiB).
const Param<int64_t>& ParamStoreMaxBufferedBytes();
// SHARDLINE_STORE_IDLE_TIMEOUT_S: seconds after which a server closes a connection that has
// neither a Get/Wait waiting nor moved a byte (default 120).
const Param<double>& ParamStoreIdleTimeout();

struct TcpStoreServerOptions {
  // Address to listen on: "0.0.0.0" (every IPv4 interface), "::", "127.0.0.1", a hostname.
  std::string host = "0.0.0.0";
  // 0 picks an ephemeral port; read it back with TcpStoreServer::port().
  int port = 0;
  // Unset: SHARDLINE_STORE_TOKEN. Empty: no authentication.
  std::optional<std::string> token;
  // 0: SHARDLINE_STORE_MAX_MESSAGE_BYTES.
  int64_t max_message_bytes = 0;
  // Connections beyond this many are accepted and closed at once with a WARN line.
  int max_connections = 4096;
  // A connection that has not completed HELLO this long after it was accepted is closed with a
  // WARN line, so that half-open connections cannot hold the connection slots.
  absl::Duration handshake_timeout = absl::Seconds(10);
  // Past HELLO, a connection that has no Get/Wait waiting and has moved no byte for this long
  // is closed (half-open, or stalled in the middle of a message). TcpStore clients reopen such
  // a connection on their next call. Zero: SHARDLINE_STORE_IDLE_TIMEOUT_S.
  absl::Duration idle_timeout = absl::ZeroDuration();
  // Bytes of incomplete requests buffered for all connections together. A request's buffer
  // grows as its bytes arrive (never from the length its header announces); one that would take
  // the total over this is read to its end without being kept and answered ResourceExhausted.
  // 0: SHARDLINE_STORE_MAX_BUFFERED_BYTES.
  int64_t max_buffered_bytes = 0;
};

class TcpStoreServer {
 public:
  // Binds, listens and starts the I/O thread. FailedPrecondition naming the port if it is in
  // use; InvalidArgument for a bad option or knob.
  static absl::StatusOr<std::unique_ptr<TcpStoreServer>> Start(TcpStoreServerOptions options);

  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  // Shutdown().
  ~TcpStoreServer();

  // Closes the listener and every connection (parked requests see the connection drop), then
  // joins the I/O thread. Idempotent.
  void Shutdown();

  const std::string& host() const;
  // The address the listener is bound to, as resolved from host() ("127.0.1.1" for a hostname
  // that /etc/hosts maps to a loopback alias).
  const std::string& bound_address() const;
  // The bound port (the ephemeral one if options.port was 0).
  int port() const;

  struct Stats {
    int64_t open_connections = 0;
    int64_t parked_requests = 0;      // Get/Wait waiting for keys
    int64_t dropped_connections = 0;  // closed for a protocol violation or a wrong token
    int64_t refused_connections = 0;  // over max_connections
    int64_t idle_closed = 0;          // closed after idle_timeout without traffic
    int64_t buffered_bytes = 0;       // held for incomplete requests (and small reusable buffers)
    int64_t refused_requests = 0;     // answered ResourceExhausted: over max_buffered_bytes
    int64_t keys = 0;
  };
  Stats stats() const;

  class Impl;

 private:
  friend class store_internal::ServerAccess;
  explicit TcpStoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct TcpStoreOptions {
  // The server's address (MASTER_ADDR) and port. With Create(is_server=true), port 0 lets the
  // server pick one; read it back with TcpStore::port().
  std::string host = "127.0.0.1";
  int port = 0;
  // Unset: SHARDLINE_STORE_TOKEN.
  std::optional<std::string> token;
  // Bound on each short call (Set, Add, CompareSet, Check, Delete, NumKeys). Zero: the default
  // timeout (SHARDLINE_TIMEOUT_S).
  absl::Duration timeout = absl::ZeroDuration();
  // Shown in the server's logs.
  int64_t rank = -1;
  std::string client_name;
  // 0: SHARDLINE_STORE_MAX_MESSAGE_BYTES.
  int64_t max_message_bytes = 0;
  // Calls in flight at once, each on a connection of its own (opened when a call finds the others
  // busy, kept for reuse). A call beyond this many waits for a free connection until its own
  // deadline, then fails with DeadlineExceeded naming the call.
  int max_concurrent_calls = 8;
  // Create(is_server=true) only: where the hosted server listens. Empty: `host`, the address the
  // clients are given (so the store is not reachable through other interfaces); "0.0.0.0" or
  // "::" for every interface.
  std::string listen_host;
  int max_connections = 4096;
};

class TcpStore final : public Store {
 public:
  // Connects to a running server, retrying with backoff until `deadline`, and authenticates.
  static absl::StatusOr<std::unique_ptr<TcpStore>> Connect(TcpStoreOptions options,
                                                           absl::Time deadline);
  // As Connect; with `is_server` the store first starts a TcpStoreServer on
  // options.listen_host:options.port, owns it (it shuts down with this store) and connects to
  // it. The other ranks Connect (or Create with is_server=false).
  static absl::StatusOr<std::unique_ptr<TcpStore>> Create(TcpStoreOptions options, bool is_server,
                                                          absl::Time deadline);
  ~TcpStore() override;

  const std::string& host() const;
  int port() const;
  // The hosted server, or nullptr.
  TcpStoreServer* server() const { return server_.get(); }

  class Client;

 protected:
  absl::Status DoSet(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> DoGet(absl::string_view key, absl::Time deadline) override;
  absl::StatusOr<int64_t> DoAdd(absl::string_view key, int64_t delta) override;
  absl::StatusOr<std::string> DoCompareSet(absl::string_view key, absl::string_view expected,
                                           absl::string_view desired) override;
  absl::Status DoWait(absl::Span<const std::string> keys, absl::Time deadline) override;
  absl::StatusOr<bool> DoCheck(absl::Span<const std::string> keys) override;
  absl::StatusOr<bool> DoDelete(absl::string_view key) override;
  absl::StatusOr<int64_t> DoNumKeys() override;
  // Opens a connection of its own for it, held until this store is destroyed.
  absl::Status DoAppendOnClose(absl::string_view log, absl::string_view entry,
                               absl::Time deadline) override;

 private:
  TcpStore(std::unique_ptr<TcpStoreServer> server, std::unique_ptr<Client> client);

  // Declared first so that it is destroyed last: the client disconnects before the server stops.
  std::unique_ptr<TcpStoreServer> server_;
  std::unique_ptr<Client> client_;
};

}  // namespace shardline

#endif  // SHARDLINE_COLLECTIVES_STORE_TCP_STORE_H_
