// File: collectives/store/internal/server_access.h
// -----------------------------------------------------------------------------
// Test access to a TcpStoreServer's internals (not part of the public API): tests that must know
// that the server reached a state (a Get is parked, a connection was dropped) before they act
// wait on its statistics here instead of sleeping.

#ifndef SHARDLINE_COLLECTIVES_STORE_INTERNAL_SERVER_ACCESS_H_
#define SHARDLINE_COLLECTIVES_STORE_INTERNAL_SERVER_ACCESS_H_

#include <functional>

#include "absl/time/time.h"
#include "collectives/store/tcp_store.h"

namespace shardline::store_internal {

class ServerAccess {
 public:
  // Blocks until `ready(server.stats())` holds (re-checked at every change of the statistics)
  // or `deadline` passes; returns whether it holds.
  static bool AwaitStats(const TcpStoreServer& server,
                         const std::function<bool(const TcpStoreServer::Stats&)>& ready,
                         absl::Time deadline);
};

}  // namespace shardline::store_internal

#endif  // SHARDLINE_COLLECTIVES_STORE_INTERNAL_SERVER_ACCESS_H_
