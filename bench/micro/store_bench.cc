// Microbenchmarks of the rendezvous store: operations per second of TcpStore clients against one
// TcpStoreServer on loopback, with 1 and 4 client threads (each its own connection, as each rank
// of a job has). Every operation is one request/response round trip, so the numbers are bounded
// by loopback latency and the server's single I/O thread.
//
//   store_bench --benchmark_filter=Get
//
// items_per_second is the aggregate over the client threads.

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "benchmark/benchmark.h"
#include "collectives/store/tcp_store.h"
#include "runtime/check.h"

namespace shardline {
namespace {

// One server for the whole process, on an ephemeral loopback port.
TcpStoreServer& Server() {
  static TcpStoreServer* server = [] {
    absl::StatusOr<std::unique_ptr<TcpStoreServer>> started =
        TcpStoreServer::Start({.host = "127.0.0.1", .port = 0});
    SL_CHECK(started.ok()) << started.status();
    return started->release();  // lives until exit: benchmarks may run in any order
  }();
  return *server;
}

std::unique_ptr<TcpStore> Connect(benchmark::State& state) {
  TcpStoreOptions options;
  options.host = "127.0.0.1";
  options.port = Server().port();
  options.rank = state.thread_index();
  absl::StatusOr<std::unique_ptr<TcpStore>> store =
      TcpStore::Connect(options, absl::Now() + absl::Seconds(30));
  if (!store.ok()) {
    state.SkipWithError(store.status().ToString().c_str());
    return nullptr;
  }
  return std::move(*store);
}

void BM_StoreSet(benchmark::State& state) {
  std::unique_ptr<TcpStore> store = Connect(state);
  if (store == nullptr) return;
  const std::string key = absl::StrCat("set/", state.thread_index());
  const std::string value(static_cast<size_t>(state.range(0)), 'x');
  for (auto _ : state) {
    const absl::Status s = store->Set(key, value);
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      break;
    }
  }
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

void BM_StoreGet(benchmark::State& state) {
  std::unique_ptr<TcpStore> store = Connect(state);
  if (store == nullptr) return;
  const std::string key = absl::StrCat("get/", state.thread_index());
  if (absl::Status s = store->Set(key, std::string(static_cast<size_t>(state.range(0)), 'y'));
      !s.ok()) {
    state.SkipWithError(s.ToString().c_str());
    return;
  }
  for (auto _ : state) {
    absl::StatusOr<std::string> value = store->Get(key, absl::Now() + absl::Seconds(30));
    if (!value.ok()) {
      state.SkipWithError(value.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(value->data());
  }
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

// Every thread increments the same counter: the store's barrier and sequence-number idiom.
void BM_StoreAdd(benchmark::State& state) {
  std::unique_ptr<TcpStore> store = Connect(state);
  if (store == nullptr) return;
  for (auto _ : state) {
    absl::StatusOr<int64_t> value = store->Add("counter", 1);
    if (!value.ok()) {
      state.SkipWithError(value.status().ToString().c_str());
      break;
    }
  }
  state.SetItemsProcessed(state.iterations());
}

BENCHMARK(BM_StoreSet)->Arg(16)->Arg(64 << 10)->Threads(1)->Threads(4)->UseRealTime();
BENCHMARK(BM_StoreGet)->Arg(16)->Arg(64 << 10)->Threads(1)->Threads(4)->UseRealTime();
BENCHMARK(BM_StoreAdd)->Threads(1)->Threads(4)->UseRealTime();

}  // namespace
}  // namespace shardline

BENCHMARK_MAIN();
