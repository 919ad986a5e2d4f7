// Conformance tests run over every Store implementation (MemoryStore, PrefixStore over a
// MemoryStore, TcpStore), then the TCP store's failure behaviour: port in use, unreachable
// store, tokens, garbage on the wire, a server that goes away, many clients.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collectives/store/internal/server_access.h"
#include "collectives/store/memory_store.h"
#include "collectives/store/prefix_store.h"
#include "collectives/store/store_protocol.h"
#include "collectives/store/tcp_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/logging.h"
#include "runtime/status.h"
#include "tests/common/rank_threads.h"
#include "tests/common/scoped_env.h"

namespace shardline {
namespace {

using ::shardline::testing::RunRankThreads;
using ::testing::HasSubstr;
using ::testing::Not;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

// A deadline no healthy test comes near; it only bounds a broken one.
absl::Time Bound() { return In(absl::Seconds(10)); }

TcpStoreOptions ClientOptions(int port) {
  TcpStoreOptions options;
  options.host = "127.0.0.1";
  options.port = port;
  options.token = "";
  options.timeout = absl::Seconds(10);
  return options;
}

// Waits (until `deadline`) for the server to reach a state, e.g. a Get parked.
bool AwaitStats(const TcpStoreServer& server,
                const std::function<bool(const TcpStoreServer::Stats&)>& ready,
                absl::Time deadline) {
  return store_internal::ServerAccess::AwaitStats(server, ready, deadline);
}

TcpStoreServerOptions ServerOptions() {
  TcpStoreServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.token = "";
  return options;
}

// ---------------------------------------------------------------------------------------------
// The harness: one store under test plus "peers" (other ranks' views of the same store). TCP
// peers are separate connections, as separate ranks would be.

enum class Kind { kMemory, kPrefix, kTcp };

std::string KindName(const ::testing::TestParamInfo<Kind>& info) {
  switch (info.param) {
    case Kind::kMemory:
      return "Memory";
    case Kind::kPrefix:
      return "Prefix";
    case Kind::kTcp:
      return "Tcp";
  }
  return "Unknown";
}

class StoreConformanceTest : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    switch (GetParam()) {
      case Kind::kMemory:
        memory_ = std::make_shared<MemoryStore>();
        break;
      case Kind::kPrefix:
        memory_ = std::make_shared<MemoryStore>();
        // A key outside the prefix must stay invisible to the prefixed view.
        ASSERT_TRUE(memory_->Set("k", "outside").ok());
        break;
      case Kind::kTcp: {
        auto server = TcpStoreServer::Start(ServerOptions());
        ASSERT_TRUE(server.ok()) << server.status();
        server_ = *std::move(server);
        break;
      }
    }
    store_ = Peer();
    ASSERT_NE(store_, nullptr);
  }

  std::shared_ptr<Store> Peer() {
    switch (GetParam()) {
      case Kind::kMemory:
        return memory_;
      case Kind::kPrefix:
        return std::make_shared<PrefixStore>("group0", memory_);
      case Kind::kTcp: {
        auto client = TcpStore::Connect(ClientOptions(server_->port()), Bound());
        EXPECT_TRUE(client.ok()) << client.status();
        if (!client.ok()) return nullptr;
        return std::shared_ptr<Store>(*std::move(client));
      }
    }
    return nullptr;
  }

  std::shared_ptr<MemoryStore> memory_;
  std::unique_ptr<TcpStoreServer> server_;
  std::shared_ptr<Store> store_;
};

TEST_P(StoreConformanceTest, SetThenGet) {
  ASSERT_TRUE(store_->Set("alpha", "1").ok());
  EXPECT_EQ(store_->Get("alpha", Bound()).value(), "1");
  ASSERT_TRUE(store_->Set("alpha", "two").ok());
  EXPECT_EQ(store_->Get("alpha", Bound()).value(), "two");
  const std::string binary("a\0b\xff", 4);
  ASSERT_TRUE(store_->Set(binary, binary).ok());
  EXPECT_EQ(store_->Get(binary, Bound()).value(), binary);
  ASSERT_TRUE(store_->Set("empty", "").ok());
  EXPECT_EQ(store_->Get("empty", Bound()).value(), "");
}

TEST(PrefixStoreTest, KeysAreIsolatedByPrefix) {
  auto memory = std::make_shared<MemoryStore>();
  ASSERT_TRUE(memory->Set("k", "outside").ok());
  PrefixStore store("group0", memory);
  ASSERT_TRUE(store.Set("k", "inside").ok());
  EXPECT_EQ(store.Get("k", Bound()).value(), "inside");
  EXPECT_EQ(memory->Get("k", Bound()).value(), "outside");
  EXPECT_EQ(memory->Get("group0/k", Bound()).value(), "inside");
  PrefixStore nested("sub", store);
  ASSERT_TRUE(nested.Set("k", "nested").ok());
  EXPECT_EQ(memory->Get("group0/sub/k", Bound()).value(), "nested");
  EXPECT_EQ(nested.Get("k", Bound()).value(), "nested");
}

TEST_P(StoreConformanceTest, EmptyKeyIsInvalid) {
  EXPECT_TRUE(absl::IsInvalidArgument(store_->Set("", "v")));
  EXPECT_TRUE(absl::IsInvalidArgument(store_->Get("", Bound()).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(store_->Wait({"a", ""}, Bound())));
}

TEST_P(StoreConformanceTest, GetBlocksUntilAnotherRankSets) {
  std::shared_ptr<Store> peer = Peer();
  ASSERT_NE(peer, nullptr);
  const absl::Time start = absl::Now();
  std::thread setter([&] {
    // The delay is what the test observes: Get must still be blocked when it ends.
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_TRUE(peer->Set("late", "value").ok());
  });
  absl::StatusOr<std::string> value = store_->Get("late", Bound());
  setter.join();
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "value");
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(40));
}

TEST_P(StoreConformanceTest, GetDeadlineNamesTheKey) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> value = store_->Get("never-set", In(absl::Milliseconds(100)));
  const absl::Duration elapsed = absl::Now() - start;
  ASSERT_TRUE(absl::IsDeadlineExceeded(value.status())) << value.status();
  EXPECT_THAT(std::string(value.status().message()), HasSubstr("never-set"));
  EXPECT_GE(elapsed, absl::Milliseconds(90));
  EXPECT_LT(elapsed, absl::Seconds(3));
  // A deadline already past still answers for an existing key, and fails fast otherwise.
  ASSERT_TRUE(store_->Set("present", "x").ok());
  EXPECT_EQ(store_->Get("present", absl::Now() - absl::Seconds(1)).value(), "x");
  EXPECT_TRUE(
      absl::IsDeadlineExceeded(store_->Get("never-set", absl::Now() - absl::Seconds(1)).status()));
}

TEST_P(StoreConformanceTest, AddIsAtomicAcrossThreads) {
  constexpr int kThreads = 8;
  constexpr int kAddsPerThread = 150;
  std::vector<std::shared_ptr<Store>> peers;
  for (int t = 0; t < kThreads; ++t) {
    peers.push_back(t % 2 == 0 ? store_ : Peer());  // shared and separate clients
    ASSERT_NE(peers.back(), nullptr);
  }
  std::vector<std::vector<int64_t>> seen(kThreads);
  RunRankThreads(kThreads, [&](int t) {
    for (int i = 0; i < kAddsPerThread; ++i) {
      absl::StatusOr<int64_t> v = peers[t]->Add("counter", 1);
      ASSERT_TRUE(v.ok()) << v.status();
      seen[t].push_back(*v);
    }
  });
  // Every intermediate value was handed out exactly once: 1..N.
  std::set<int64_t> all;
  for (const auto& values : seen) all.insert(values.begin(), values.end());
  const int64_t total = int64_t{kThreads} * kAddsPerThread;
  ASSERT_EQ(static_cast<int64_t>(all.size()), total);
  EXPECT_EQ(*all.begin(), 1);
  EXPECT_EQ(*all.rbegin(), total);
  EXPECT_EQ(store_->Get("counter", Bound()).value(), absl::StrCat(total));
}

TEST_P(StoreConformanceTest, AddSemantics) {
  EXPECT_EQ(store_->Add("c", 5).value(), 5);
  EXPECT_EQ(store_->Add("c", -7).value(), -2);
  EXPECT_EQ(store_->Get("c", Bound()).value(), "-2");
  ASSERT_TRUE(store_->Set("text", "hello").ok());
  absl::StatusOr<int64_t> bad = store_->Add("text", 1);
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << bad.status();
  EXPECT_EQ(store_->Get("text", Bound()).value(), "hello");
  ASSERT_TRUE(store_->Set("big", absl::StrCat(INT64_MAX)).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(store_->Add("big", 1).status()));
}

TEST_P(StoreConformanceTest, CompareSetSemantics) {
  // Missing key, expected empty: set.
  EXPECT_EQ(store_->CompareSet("cas", "", "first").value(), "first");
  EXPECT_EQ(store_->Get("cas", Bound()).value(), "first");
  // Mismatch: unchanged, returns the current value.
  EXPECT_EQ(store_->CompareSet("cas", "wrong", "second").value(), "first");
  EXPECT_EQ(store_->Get("cas", Bound()).value(), "first");
  // Match: swapped.
  EXPECT_EQ(store_->CompareSet("cas", "first", "second").value(), "second");
  EXPECT_EQ(store_->Get("cas", Bound()).value(), "second");
  // Missing key, expected non-empty: nothing is created, "" comes back.
  EXPECT_EQ(store_->CompareSet("absent", "x", "y").value(), "");
  EXPECT_FALSE(store_->Check({"absent"}).value());
}

TEST_P(StoreConformanceTest, CompareSetWakesWaiters) {
  std::shared_ptr<Store> peer = Peer();
  ASSERT_NE(peer, nullptr);
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(20));
    EXPECT_EQ(peer->CompareSet("leader", "", "rank3").value(), "rank3");
  });
  absl::StatusOr<std::string> leader = store_->Get("leader", Bound());
  setter.join();
  EXPECT_EQ(leader.value(), "rank3");
}

TEST_P(StoreConformanceTest, WaitForSeveralKeys) {
  std::shared_ptr<Store> peer = Peer();
  ASSERT_NE(peer, nullptr);
  std::thread setter([&] {
    for (const char* key : {"w1", "w2", "w3"}) {
      absl::SleepFor(absl::Milliseconds(10));
      EXPECT_TRUE(peer->Set(key, "x").ok());
    }
  });
  absl::Status waited = store_->Wait({"w1", "w2", "w3"}, Bound());
  setter.join();
  EXPECT_TRUE(waited.ok()) << waited;
  EXPECT_TRUE(store_->Wait({}, absl::Now()).ok());

  absl::Status missing = store_->Wait({"w1", "w-missing"}, In(absl::Milliseconds(80)));
  ASSERT_TRUE(absl::IsDeadlineExceeded(missing)) << missing;
  EXPECT_THAT(std::string(missing.message()), HasSubstr("w-missing"));
  EXPECT_THAT(std::string(missing.message()), Not(HasSubstr("'w1'")));
}

TEST_P(StoreConformanceTest, CheckAndDelete) {
  EXPECT_FALSE(store_->Check({"d"}).value());
  EXPECT_TRUE(store_->Check({}).value());
  ASSERT_TRUE(store_->Set("d", "v").ok());
  ASSERT_TRUE(store_->Set("e", "v").ok());
  EXPECT_TRUE(store_->Check({"d", "e"}).value());
  EXPECT_TRUE(store_->Delete("d").value());
  EXPECT_FALSE(store_->Delete("d").value());
  EXPECT_FALSE(store_->Check({"d", "e"}).value());
  EXPECT_TRUE(absl::IsDeadlineExceeded(store_->Get("d", In(absl::Milliseconds(20))).status()));
}

TEST_P(StoreConformanceTest, NumKeysCounts) {
  const int64_t before = store_->NumKeys().value();
  ASSERT_TRUE(store_->Set("n1", "").ok());
  ASSERT_TRUE(store_->Set("n2", "").ok());
  ASSERT_TRUE(store_->Set("n1", "again").ok());
  EXPECT_EQ(store_->NumKeys().value(), before + 2);
  ASSERT_TRUE(store_->Delete("n1").ok());
  EXPECT_EQ(store_->NumKeys().value(), before + 1);
}

TEST_P(StoreConformanceTest, LargeValueRoundTrips) {
  std::string value(1 << 20, '\0');
  std::mt19937 rng(7);
  for (char& c : value) c = static_cast<char>(rng());
  ASSERT_TRUE(store_->Set("large", value).ok());
  std::shared_ptr<Store> peer = Peer();
  ASSERT_NE(peer, nullptr);
  absl::StatusOr<std::string> read = peer->Get("large", Bound());
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(*read == value);
}

INSTANTIATE_TEST_SUITE_P(AllStores, StoreConformanceTest,
                         ::testing::Values(Kind::kMemory, Kind::kPrefix, Kind::kTcp), KindName);

// ---------------------------------------------------------------------------------------------
// TCP-specific behaviour.

std::unique_ptr<TcpStoreServer> StartServer(TcpStoreServerOptions options = ServerOptions()) {
  auto server = TcpStoreServer::Start(std::move(options));
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

// A raw TCP connection for sending bytes no well-behaved client would.
class RawSocket {
 public:
  explicit RawSocket(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawSocket() { Close(); }
  bool connected() const { return connected_; }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

  // Sends as much as the server takes (it may close the connection part-way).
  void Send(absl::string_view bytes) {
    while (!bytes.empty()) {
      ssize_t n = send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n <= 0) return;
      bytes.remove_prefix(static_cast<size_t>(n));
    }
  }

  // Reads (and discards) until the server closes the connection; false if still open at
  // `deadline`.
  bool AwaitClosed(absl::Time deadline) {
    char buf[4096];
    while (true) {
      const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (ms <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(ms)) <= 0) continue;
      ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) return true;
    }
  }

  // Reads one whole response frame.
  absl::StatusOr<store_protocol::Response> ReadResponse(absl::Time deadline) {
    std::string bytes;
    auto fill = [&](size_t want) -> bool {
      char buf[4096];
      while (bytes.size() < want) {
        const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
        if (ms <= 0) return false;
        pollfd p{fd_, POLLIN, 0};
        if (poll(&p, 1, static_cast<int>(ms)) <= 0) continue;
        ssize_t n = recv(fd_, buf, std::min(sizeof(buf), want - bytes.size()), 0);
        if (n <= 0) return false;
        bytes.append(buf, static_cast<size_t>(n));
      }
      return true;
    };
    if (!fill(store_protocol::kHeaderBytes)) return absl::UnavailableError("no header");
    auto header = store_protocol::DecodeHeader(bytes, 1 << 20);
    if (!header.ok()) return header.status();
    if (!fill(store_protocol::kHeaderBytes + header->payload_bytes)) {
      return absl::UnavailableError("no payload");
    }
    return store_protocol::DecodeResponse(
        *header, absl::string_view(bytes).substr(store_protocol::kHeaderBytes));
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

std::string HelloFrame(absl::string_view token = "") {
  store_protocol::Request hello;
  hello.op = store_protocol::Op::kHello;
  hello.token = std::string(token);
  hello.client_name = "raw";
  return store_protocol::EncodeRequest(hello);
}

// A header with arbitrary fields, for frames the encoder would never write.
std::string RawHeader(uint32_t magic, uint16_t version, uint16_t opcode, uint32_t id,
                      uint32_t length) {
  std::string out;
  auto put = [&](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  put(magic, 4);
  put(version, 2);
  put(opcode, 2);
  put(id, 4);
  put(length, 4);
  return out;
}

TEST(TcpStoreTest, PortInUseIsAClearError) {
  auto first = StartServer();
  ASSERT_NE(first, nullptr);
  TcpStoreServerOptions options = ServerOptions();
  options.port = first->port();
  auto second = TcpStoreServer::Start(options);
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(second.status())) << second.status();
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(absl::StrCat(first->port())));
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("already in use"));
}

TEST(TcpStoreTest, UnreachableStoreFailsWithinItsDeadline) {
  int closed_port = 0;
  {
    auto server = StartServer();
    ASSERT_NE(server, nullptr);
    closed_port = server->port();
  }  // shut down: nothing listens on the port now
  const absl::Time start = absl::Now();
  auto store = TcpStore::Connect(ClientOptions(closed_port), In(absl::Milliseconds(300)));
  const absl::Duration elapsed = absl::Now() - start;
  ASSERT_FALSE(store.ok());
  EXPECT_TRUE(absl::IsUnavailable(store.status())) << store.status();
  EXPECT_THAT(std::string(store.status().message()),
              HasSubstr(absl::StrCat("127.0.0.1:", closed_port)));
  EXPECT_THAT(std::string(store.status().message()), HasSubstr("unreachable"));
  EXPECT_LT(elapsed, absl::Seconds(3));
}

// A loopback TCP socket with SO_REUSEADDR bound to an ephemeral port. While it is bound and not
// listening, nobody without SO_REUSEADDR can take the port, and a connect to it is refused; a
// TcpStoreServer (which sets SO_REUSEADDR) can still bind and listen on it.
class PortHolder {
 public:
  explicit PortHolder(int port = 0) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(addr);
    if (bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
        getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &length) == 0) {
      port_ = ntohs(addr.sin_port);
    }
  }
  ~PortHolder() { Close(); }
  int port() const { return port_; }
  bool Listen() { return listen(fd_, 8) == 0; }
  // Accepts one connection and closes it at once; false if none arrives by `deadline`.
  bool AcceptAndHangUp(absl::Time deadline) {
    pollfd p{fd_, POLLIN, 0};
    const int64_t ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (poll(&p, 1, static_cast<int>(ms)) != 1) return false;
    const int conn = accept(fd_, nullptr, nullptr);
    if (conn < 0) return false;
    close(conn);
    return true;
  }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(TcpStoreTest, ConnectRetriesUntilTheServerComesUp) {
  // `reserved` keeps the port ours for the whole test (bound, never listening); `decoy` listens
  // on it to see the client's first attempt and hang up on it, then makes way for the server.
  PortHolder reserved;
  ASSERT_GT(reserved.port(), 0);
  PortHolder decoy(reserved.port());
  ASSERT_EQ(decoy.port(), reserved.port());
  ASSERT_TRUE(decoy.Listen());
  absl::StatusOr<std::unique_ptr<TcpStore>> store;
  std::thread client([&] { store = TcpStore::Connect(ClientOptions(reserved.port()), Bound()); });
  const bool attempted = decoy.AcceptAndHangUp(Bound());
  decoy.Close();
  std::unique_ptr<TcpStoreServer> late;
  if (attempted) {
    TcpStoreServerOptions options = ServerOptions();
    options.port = reserved.port();
    late = StartServer(options);
  }
  client.join();
  ASSERT_TRUE(attempted) << "the client never tried to connect";
  ASSERT_NE(late, nullptr);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE((*store)->Set("k", "v").ok());
  EXPECT_EQ((*store)->Get("k", Bound()).value(), "v");
}

TEST(TcpStoreTest, TokenIsRequiredAndChecked) {
  TcpStoreServerOptions server_options = ServerOptions();
  server_options.token = "s3cret";
  auto server = StartServer(server_options);
  ASSERT_NE(server, nullptr);

  for (const char* token : {"wrong", ""}) {
    TcpStoreOptions options = ClientOptions(server->port());
    options.token = token;
    const absl::Time start = absl::Now();
    auto store = TcpStore::Connect(options, Bound());
    ASSERT_FALSE(store.ok()) << "token '" << token << "' accepted";
    EXPECT_TRUE(absl::IsPermissionDenied(store.status())) << store.status();
    EXPECT_THAT(std::string(store.status().message()), HasSubstr("refused the token"));
    EXPECT_THAT(std::string(store.status().message()), HasSubstr("SHARDLINE_STORE_TOKEN"));
    EXPECT_THAT(std::string(store.status().message()),
                HasSubstr(absl::StrCat("127.0.0.1:", server->port())));
    // Refusal is final: no retrying until the deadline.
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  }
  TcpStoreOptions options = ClientOptions(server->port());
  options.token = "s3cret";
  auto store = TcpStore::Connect(options, Bound());
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE((*store)->Set("k", "v").ok());
  EXPECT_EQ((*store)->Get("k", Bound()).value(), "v");

  // Before HELLO nothing is served: a raw request without the handshake is dropped.
  RawSocket raw(server->port());
  ASSERT_TRUE(raw.connected());
  store_protocol::Request get;
  get.op = store_protocol::Op::kGet;
  get.key = "k";
  get.timeout_ms = 0;
  raw.Send(store_protocol::EncodeRequest(get));
  EXPECT_TRUE(raw.AwaitClosed(Bound()));
}

TEST(TcpStoreTest, TokenFromTheEnvironment) {
  ASSERT_EQ(setenv("SHARDLINE_STORE_TOKEN", "from-env", 1), 0);
  ParamStoreToken().ResetCacheForTesting();
  TcpStoreOptions options = ClientOptions(0);
  options.token.reset();
  options.listen_host = "127.0.0.1";
  auto host = TcpStore::Create(options, /*is_server=*/true, Bound());
  ASSERT_TRUE(host.ok()) << host.status();
  options.port = (*host)->port();
  auto peer = TcpStore::Connect(options, Bound());
  EXPECT_TRUE(peer.ok()) << peer.status();
  options.token = "other";
  EXPECT_TRUE(absl::IsPermissionDenied(TcpStore::Connect(options, Bound()).status()));
  ASSERT_EQ(unsetenv("SHARDLINE_STORE_TOKEN"), 0);
  ParamStoreToken().ResetCacheForTesting();
}

TEST(TcpStoreTest, GarbageOnOneConnectionDoesNotDisturbTheOthers) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  const int port = server->port();

  // Two well-behaved ranks count and exchange values the whole time.
  constexpr int kWorkers = 2;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> adds{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      auto store = TcpStore::Connect(ClientOptions(port), Bound());
      ASSERT_TRUE(store.ok()) << store.status();
      for (int i = 0; !stop.load() || i < 20; ++i) {
        ASSERT_TRUE((*store)->Add("count", 1).ok());
        adds.fetch_add(1);
        const std::string key = absl::StrCat("w", w, "/", i);
        ASSERT_TRUE((*store)->Set(key, key).ok());
        ASSERT_EQ((*store)->Get(key, Bound()).value(), key);
      }
    });
  }

  using store_protocol::kMagic;
  using store_protocol::kVersion;
  const uint16_t kSet = static_cast<uint16_t>(store_protocol::Op::kSet);
  const uint16_t kHello = static_cast<uint16_t>(store_protocol::Op::kHello);
  std::mt19937 rng(42);
  auto random_bytes = [&](size_t n) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    return s;
  };
  struct Attack {
    std::string bytes;
    bool hang_up = false;  // close our end right after sending
  };
  const std::vector<Attack> attacks = {
      {random_bytes(64 << 10)},                                       // noise
      {RawHeader(kMagic, kVersion, kHello, 1, 0xfffffff0u)},          // oversized length
      {RawHeader(kMagic, kVersion, kHello, 1, 100) + "short", true},  // truncated, then EOF
      {RawHeader(kMagic, kVersion + 1, kHello, 1, 0)},                // future version
      {RawHeader(kMagic, kVersion, 0x77, 1, 0)},                      // unknown opcode
      {RawHeader(kMagic, kVersion, kSet, 1, 0)},                      // SET before HELLO
      {HelloFrame() + RawHeader(kMagic, kVersion, kSet, 2, 8) +       // key length past the end
       std::string("\xff\xff\xff\x7f"
                   "abcd")},
      {HelloFrame() + HelloFrame()},  // second HELLO
      {HelloFrame() + RawHeader(kMagic, kVersion, kSet, 2, 0) + random_bytes(1000)},
  };
  constexpr int kRounds = 16;
  int64_t expected_drops = 0;
  for (int round = 0; round < kRounds; ++round) {
    for (const Attack& attack : attacks) {
      RawSocket raw(port);
      ASSERT_TRUE(raw.connected());
      raw.Send(attack.bytes);
      ++expected_drops;
      if (attack.hang_up) {
        raw.Close();
      } else {
        EXPECT_TRUE(raw.AwaitClosed(Bound())) << "server kept a connection open after an attack of "
                                              << attack.bytes.size() << " bytes";
      }
    }
  }
  EXPECT_TRUE(AwaitStats(
      *server,
      [&](const TcpStoreServer::Stats& s) { return s.dropped_connections >= expected_drops; },
      Bound()))
      << "dropped " << server->stats().dropped_connections << " of " << expected_drops;
  stop.store(true);
  for (std::thread& worker : workers) worker.join();

  // The server still answers, and every well-behaved Add counted.
  auto after = TcpStore::Connect(ClientOptions(port), Bound());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ((*after)->Get("count", Bound()).value(), absl::StrCat(adds.load()));
  EXPECT_TRUE(AwaitStats(
      *server, [](const TcpStoreServer::Stats& s) { return s.open_connections == 1; }, Bound()));
}

TEST(TcpStoreTest, OversizedValueIsRefusedBeforeSending) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  TcpStoreOptions options = ClientOptions(server->port());
  options.max_message_bytes = 4096;
  auto store = TcpStore::Connect(options, Bound());
  ASSERT_TRUE(store.ok()) << store.status();
  absl::Status status = (*store)->Set("k", std::string(8192, 'x'));
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("SHARDLINE_STORE_MAX_MESSAGE_BYTES"));
  EXPECT_TRUE((*store)->Set("k", "small").ok());  // the connection is still good
}

TEST(TcpStoreTest, ServerDropsAMessageOverItsLimitAndKeepsServing) {
  TcpStoreServerOptions server_options = ServerOptions();
  server_options.max_message_bytes = 4096;
  auto server = StartServer(server_options);
  ASSERT_NE(server, nullptr);
  auto big = TcpStore::Connect(ClientOptions(server->port()), Bound());  // default 64 MiB limit
  auto small = TcpStore::Connect(ClientOptions(server->port()), Bound());
  ASSERT_TRUE(big.ok() && small.ok());
  absl::Status status = (*big)->Set("k", std::string(8192, 'x'));
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_TRUE((*small)->Set("k", "fine").ok());
  EXPECT_EQ((*small)->Get("k", Bound()).value(), "fine");
  // The refused client reconnects on its next call.
  EXPECT_EQ((*big)->Get("k", Bound()).value(), "fine");
}

TEST(TcpStoreTest, OversizedFrameBeforeHelloIsRefusedUnread) {
  auto server = StartServer();  // the default 64 MiB message limit
  ASSERT_NE(server, nullptr);
  auto store = TcpStore::Connect(ClientOptions(server->port()), Bound());
  ASSERT_TRUE(store.ok()) << store.status();
  const uint16_t kHello = static_cast<uint16_t>(store_protocol::Op::kHello);
  const uint16_t kSet = static_cast<uint16_t>(store_protocol::Op::kSet);
  // Each header claims a payload under the message limit but over the pre-HELLO bound, and no
  // payload follows: a server that sized its buffer for it would wait for the bytes, keeping the
  // connection open; the fixed one closes it on the header alone.
  const std::vector<std::string> headers = {
      RawHeader(store_protocol::kMagic, store_protocol::kVersion, kHello, 1,
                store_protocol::kMaxHelloPayloadBytes + 1),
      RawHeader(store_protocol::kMagic, store_protocol::kVersion, kHello, 1, 32u << 20),
      RawHeader(store_protocol::kMagic, store_protocol::kVersion, kSet, 1, 60u << 20),
  };
  for (const std::string& header : headers) {
    RawSocket raw(server->port());
    ASSERT_TRUE(raw.connected());
    raw.Send(header);
    EXPECT_TRUE(raw.AwaitClosed(Bound())) << "the server waits for an unauthenticated payload";
  }
  EXPECT_TRUE(AwaitStats(
      *server, [](const TcpStoreServer::Stats& s) { return s.dropped_connections == 3; }, Bound()));
  // The authenticated client is still served, and so is a new one.
  ASSERT_TRUE((*store)->Set("k", "v").ok());
  auto again = TcpStore::Connect(ClientOptions(server->port()), Bound());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->Get("k", Bound()).value(), "v");
}

TEST(TcpStoreTest, HelloUpToItsBoundIsAcceptedAndALongerOneRefusedByTheClient) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  // HELLO payload: token (4 + 0 bytes), client name (4 + n bytes), rank (8 bytes).
  const size_t longest_name = store_protocol::kMaxHelloPayloadBytes - 16;
  TcpStoreOptions options = ClientOptions(server->port());
  options.client_name = std::string(longest_name, 'n');
  auto store = TcpStore::Connect(options, Bound());
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE((*store)->Set("k", "v").ok());

  options.client_name = std::string(longest_name + 1, 'n');
  const absl::Time start = absl::Now();
  auto refused = TcpStore::Connect(options, Bound());
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("HELLO"));
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr(absl::StrCat(store_protocol::kMaxHelloPayloadBytes)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));  // no retrying
}

TEST(TcpStoreTest, ConnectionWithoutHelloIsClosedAtTheHandshakeDeadline) {
  constexpr absl::Duration kHandshake = absl::Milliseconds(200);
  TcpStoreServerOptions server_options = ServerOptions();
  server_options.handshake_timeout = kHandshake;
  auto server = StartServer(server_options);
  ASSERT_NE(server, nullptr);
  // Authenticated before the others connect: its handshake timer, had it not been cancelled by
  // HELLO, would fire first.
  RawSocket authenticated(server->port());
  ASSERT_TRUE(authenticated.connected());
  authenticated.Send(HelloFrame());
  ASSERT_TRUE(authenticated.ReadResponse(Bound()).ok());

  const absl::Time start = absl::Now();
  RawSocket silent(server->port());
  RawSocket partial(server->port());  // half a header, then nothing
  ASSERT_TRUE(silent.connected() && partial.connected());
  partial.Send(HelloFrame().substr(0, store_protocol::kHeaderBytes / 2));
  EXPECT_TRUE(silent.AwaitClosed(Bound()));
  EXPECT_TRUE(partial.AwaitClosed(Bound()));
  EXPECT_GE(absl::Now() - start, kHandshake - absl::Milliseconds(5));
  EXPECT_TRUE(AwaitStats(
      *server,
      [](const TcpStoreServer::Stats& s) {
        return s.dropped_connections == 2 && s.open_connections == 1;
      },
      Bound()));

  store_protocol::Request set;
  set.op = store_protocol::Op::kSet;
  set.id = 2;
  set.key = "k";
  set.value = "v";
  authenticated.Send(store_protocol::EncodeRequest(set));
  absl::StatusOr<store_protocol::Response> response = authenticated.ReadResponse(Bound());
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(response->status().ok()) << response->status();
  EXPECT_TRUE(AwaitStats(
      *server, [](const TcpStoreServer::Stats& s) { return s.keys == 1; }, Bound()));
}

TEST(TcpStoreTest, HandshakeTimeoutMustBePositive) {
  TcpStoreServerOptions options = ServerOptions();
  options.handshake_timeout = absl::ZeroDuration();
  auto server = TcpStoreServer::Start(options);
  EXPECT_TRUE(absl::IsInvalidArgument(server.status())) << server.status();
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("handshake_timeout"));
}

TEST(TcpStoreTest, SetOnOneThreadCompletesWhileAnotherThreadsGetWaitsForIt) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto store = TcpStore::Connect(ClientOptions(server->port()), Bound());
  ASSERT_TRUE(store.ok()) << store.status();
  // A long Get on thread A: a Set from thread B on the same store must not wait for it.
  constexpr absl::Duration kGetDeadline = absl::Seconds(30);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> got;
  std::thread getter([&] { got = (*store)->Get("k", In(kGetDeadline)); });
  ASSERT_TRUE(AwaitStats(
      *server, [](const TcpStoreServer::Stats& s) { return s.parked_requests == 1; }, Bound()));
  absl::Status set = (*store)->Set("k", "from B");
  getter.join();
  EXPECT_TRUE(set.ok()) << set;
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "from B");
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // Both connections are kept for reuse: another round opens none.
  EXPECT_EQ(server->stats().open_connections, 2);
  std::thread second([&] { got = (*store)->Get("k2", In(kGetDeadline)); });
  ASSERT_TRUE(AwaitStats(
      *server, [](const TcpStoreServer::Stats& s) { return s.parked_requests == 1; }, Bound()));
  EXPECT_TRUE((*store)->Set("k2", "again").ok());
  second.join();
  EXPECT_EQ(got.value_or(""), "again");
  EXPECT_EQ(server->stats().open_connections, 2);
}

TEST(TcpStoreTest, CallBeyondMaxConcurrentCallsFailsAtItsDeadline) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  TcpStoreOptions options = ClientOptions(server->port());
  options.max_concurrent_calls = 1;
  options.timeout = absl::Milliseconds(200);
  auto store = TcpStore::Connect(options, Bound());
  ASSERT_TRUE(store.ok()) << store.status();
  auto peer = TcpStore::Connect(ClientOptions(server->port()), Bound());
  ASSERT_TRUE(peer.ok()) << peer.status();

  absl::StatusOr<std::string> got;
  std::thread getter([&] { got = (*store)->Get("k", Bound()); });
  ASSERT_TRUE(AwaitStats(
      *server, [](const TcpStoreServer::Stats& s) { return s.parked_requests == 1; }, Bound()));
  const absl::Time start = absl::Now();
  absl::Status set = (*store)->Set("blocked-key", "v");
  const absl::Duration waited = absl::Now() - start;
  EXPECT_TRUE(absl::IsDeadlineExceeded(set)) << set;
  EXPECT_THAT(std::string(set.message()), HasSubstr("SET 'blocked-key'"));
  EXPECT_THAT(std::string(set.message()), HasSubstr("max_concurrent_calls"));
  EXPECT_GE(waited, absl::Milliseconds(150));
  EXPECT_LT(waited, absl::Seconds(3));
  // Another client releases the Get; its connection is then free for the next call.
  ASSERT_TRUE((*peer)->Set("k", "v").ok());
  getter.join();
  EXPECT_EQ(got.value_or(""), "v");
  EXPECT_TRUE((*store)->Set("blocked-key", "v").ok());
  EXPECT_EQ(server->stats().open_connections, 2);
}

TEST(TcpStoreTest, MaxConcurrentCallsMustBePositive) {
  TcpStoreOptions options = ClientOptions(1);
  options.max_concurrent_calls = 0;
  auto store = TcpStore::Connect(options, Bound());
  EXPECT_TRUE(absl::IsInvalidArgument(store.status())) << store.status();
  EXPECT_THAT(std::string(store.status().message()), HasSubstr("max_concurrent_calls"));
}

TEST(TcpStoreTest, ConnectionsOverTheLimitAreRefused) {
  TcpStoreServerOptions server_options = ServerOptions();
  server_options.max_connections = 2;
  auto server = StartServer(server_options);
  ASSERT_NE(server, nullptr);
  auto first = TcpStore::Connect(ClientOptions(server->port()), Bound());
  auto second = TcpStore::Connect(ClientOptions(server->port()), Bound());
  ASSERT_TRUE(first.ok() && second.ok());
  auto third = TcpStore::Connect(ClientOptions(server->port()), In(absl::Milliseconds(200)));
  EXPECT_TRUE(absl::IsUnavailable(third.status())) << third.status();
  EXPECT_GE(server->stats().refused_connections, 1);
  // Those already connected are unaffected, and a freed slot is usable again.
  EXPECT_TRUE((*first)->Set("k", "v").ok());
  second->reset();
  ASSERT_TRUE(AwaitStats(
      *server, [](const TcpStoreServer::Stats& s) { return s.open_connections == 1; }, Bound()));
  EXPECT_TRUE(TcpStore::Connect(ClientOptions(server->port()), Bound()).ok());
}

TEST(TcpStoreTest, ShutdownWakesABlockedGet) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto store = TcpStore::Connect(ClientOptions(server->port()), Bound());
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<std::string> result;
  absl::Time returned;
  std::thread getter([&] {
    result = (*store)->Get("never", Bound());
    returned = absl::Now();
  });
  ASSERT_TRUE(AwaitStats(
      *server, [](const TcpStoreServer::Stats& s) { return s.parked_requests == 1; }, Bound()));
  const absl::Time shutdown = absl::Now();
  server->Shutdown();
  getter.join();
  EXPECT_TRUE(absl::IsUnavailable(result.status())) << result.status();
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("never"));
  EXPECT_LT(returned - shutdown, absl::Seconds(2));
  // Later calls fail promptly too (the reconnect finds nobody).
  const absl::Time start = absl::Now();
  EXPECT_TRUE(absl::IsUnavailable((*store)->Set("k", "v")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST(TcpStoreTest, DisconnectedWaiterIsForgotten) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  {
    RawSocket raw(server->port());
    ASSERT_TRUE(raw.connected());
    raw.Send(HelloFrame());
    ASSERT_TRUE(raw.ReadResponse(Bound()).ok());
    store_protocol::Request wait;
    wait.op = store_protocol::Op::kWait;
    wait.id = 2;
    wait.keys = {"a", "b"};
    wait.timeout_ms = -1;
    raw.Send(store_protocol::EncodeRequest(wait));
    ASSERT_TRUE(AwaitStats(
        *server, [](const TcpStoreServer::Stats& s) { return s.parked_requests == 1; }, Bound()));
  }
  EXPECT_TRUE(AwaitStats(
      *server,
      [](const TcpStoreServer::Stats& s) {
        return s.parked_requests == 0 && s.open_connections == 0;
      },
      Bound()));
  // Setting the keys afterwards touches nothing that is gone.
  auto store = TcpStore::Connect(ClientOptions(server->port()), Bound());
  ASSERT_TRUE(store.ok());
  EXPECT_TRUE((*store)->Set("a", "1").ok());
  EXPECT_TRUE((*store)->Set("b", "1").ok());
}

TEST(TcpStoreTest, PipelinedRequestsCloseTheConnection) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  RawSocket raw(server->port());
  ASSERT_TRUE(raw.connected());
  store_protocol::Request get;
  get.op = store_protocol::Op::kGet;
  get.key = "missing";
  get.timeout_ms = -1;
  raw.Send(HelloFrame() + store_protocol::EncodeRequest(get) + store_protocol::EncodeRequest(get));
  EXPECT_TRUE(raw.AwaitClosed(Bound()));
  EXPECT_TRUE(AwaitStats(
      *server, [](const TcpStoreServer::Stats& s) { return s.parked_requests == 0; }, Bound()));
}

TEST(TcpStoreTest, RankZeroHostsAndManyClientsRendezvous) {
  constexpr int kRanks = 8;
  constexpr int kAdds = 50;
  TcpStoreOptions options = ClientOptions(0);
  options.listen_host = "127.0.0.1";
  options.rank = 0;
  auto host = TcpStore::Create(options, /*is_server=*/true, Bound());
  ASSERT_TRUE(host.ok()) << host.status();
  ASSERT_NE((*host)->server(), nullptr);
  const int port = (*host)->port();
  ASSERT_GT(port, 0);

  std::vector<std::string> seen(kRanks);
  std::vector<std::thread> ranks;
  for (int r = 1; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      TcpStoreOptions rank_options = ClientOptions(port);
      rank_options.rank = r;
      auto store = TcpStore::Create(rank_options, /*is_server=*/false, Bound());
      ASSERT_TRUE(store.ok()) << store.status();
      ASSERT_TRUE((*store)->Set(absl::StrCat("addr/", r), absl::StrCat("host", r)).ok());
      for (int i = 0; i < kAdds; ++i) ASSERT_TRUE((*store)->Add("adds", 1).ok());
      // Barrier: everyone arrives, then everyone reads rank 0's value.
      ASSERT_TRUE((*store)->Add("arrived", 1).ok());
      seen[r] = (*store)->Get("addr/0", Bound()).value_or("");
    });
  }
  ASSERT_TRUE((*host)->Set("addr/0", "host0").ok());
  std::vector<std::string> keys;
  for (int r = 1; r < kRanks; ++r) keys.push_back(absl::StrCat("addr/", r));
  ASSERT_TRUE((*host)->Wait(keys, Bound()).ok());
  for (std::thread& rank : ranks) rank.join();
  for (int r = 1; r < kRanks; ++r) EXPECT_EQ(seen[r], "host0") << "rank " << r;
  EXPECT_EQ((*host)->Get("adds", Bound()).value(), absl::StrCat((kRanks - 1) * kAdds));
  EXPECT_EQ((*host)->Get("arrived", Bound()).value(), absl::StrCat(kRanks - 1));
}

// ---------------------------------------------------------------------------------------------
// Resource bounds: what a peer can make the server hold, and for how long.

// This process's resident set, from /proc/self/status (-1 if unreadable).
int64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    int64_t kib = 0;
    if (sscanf(line.c_str(), "VmRSS: %ld kB", &kib) == 1) return kib << 10;
  }
  return -1;
}

// A raw connection that has completed HELLO.
std::unique_ptr<RawSocket> Authenticated(int port) {
  auto raw = std::make_unique<RawSocket>(port);
  if (!raw->connected()) return nullptr;
  raw->Send(HelloFrame());
  if (!raw->ReadResponse(Bound()).ok()) return nullptr;
  return raw;
}

// The first `prefix_bytes` of a SET frame whose value is `value_bytes` long.
std::string SetFramePrefix(absl::string_view key, size_t value_bytes, size_t prefix_bytes) {
  store_protocol::Request set;
  set.op = store_protocol::Op::kSet;
  set.id = 2;
  set.key = std::string(key);
  set.value = std::string(value_bytes, 'v');
  return store_protocol::EncodeRequest(set).substr(0, prefix_bytes);
}

TEST(TcpStoreTest, StalledLargeSetsCostWhatWasSentNotWhatWasAnnounced) {
  constexpr int kClients = 40;
  constexpr size_t kAnnounced = 64u << 20;  // the default maximum message
  constexpr size_t kSent = 4096;
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  // The header announces a 64 MiB value; 4 KiB of it follow, then nothing.
  const std::string prefix =
      SetFramePrefix("big", kAnnounced - 64, store_protocol::kHeaderBytes + kSent);
  const int64_t before = ResidentBytes();
  ASSERT_GT(before, 0);
  std::vector<std::unique_ptr<RawSocket>> stalled;
  for (int i = 0; i < kClients; ++i) {
    stalled.push_back(Authenticated(server->port()));
    ASSERT_NE(stalled.back(), nullptr);
    stalled.back()->Send(prefix);
  }
  ASSERT_TRUE(AwaitStats(
      *server,
      [&](const TcpStoreServer::Stats& s) {
        return s.buffered_bytes >= static_cast<int64_t>(kClients * kSent);
      },
      Bound()));
  const int64_t grown = ResidentBytes() - before;
  // Sized from the headers, the buffers would take 40 x 64 MiB = 2.5 GiB.
  EXPECT_LT(grown, 200 << 20) << "resident set grew by " << (grown >> 20) << " MiB";
  EXPECT_LT(server->stats().buffered_bytes, 200 << 20);
  // The server serves others meanwhile, and forgets the buffers of those that leave.
  auto store = TcpStore::Connect(ClientOptions(server->port()), Bound());
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->Set("k", "v").ok());
  EXPECT_EQ((*store)->Get("k", Bound()).value_or(""), "v");
  stalled.clear();
  EXPECT_TRUE(AwaitStats(
      *server,
      [](const TcpStoreServer::Stats& s) {
        return s.open_connections == 1 && s.buffered_bytes <= 4096;
      },
      Bound()));
}

TEST(TcpStoreTest, RequestOverTheBufferedBytesCapIsRefusedAndTheConnectionStaysUsable) {
  TcpStoreServerOptions server_options = ServerOptions();
  server_options.max_buffered_bytes = 1536 << 10;
  auto server = StartServer(server_options);
  ASSERT_NE(server, nullptr);
  // A peer holds most of the budget: 700 KiB of a 4 MiB value (a 1 MiB buffer), then it stalls.
  std::unique_ptr<RawSocket> hog = Authenticated(server->port());
  ASSERT_NE(hog, nullptr);
  hog->Send(SetFramePrefix("hog", 4 << 20, store_protocol::kHeaderBytes + (700 << 10)));
  ASSERT_TRUE(AwaitStats(
      *server, [](const TcpStoreServer::Stats& s) { return s.buffered_bytes >= (700 << 10); },
      Bound()));

  auto store = TcpStore::Connect(ClientOptions(server->port()), Bound());
  ASSERT_TRUE(store.ok()) << store.status();
  const std::string big(512 << 10, 'b');
  absl::Status refused = (*store)->Set("big", big);
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("SHARDLINE_STORE_MAX_BUFFERED_BYTES"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("SET of"));
  EXPECT_EQ(server->stats().refused_requests, 1);
  // Small requests still pass, on the same connection.
  ASSERT_TRUE((*store)->Set("small", "v").ok());
  EXPECT_EQ((*store)->Get("small", Bound()).value_or(""), "v");
  EXPECT_EQ((*store)->Check({"big"}).value_or(true), false);
  // Once the hog is gone, the large value fits.
  hog.reset();
  ASSERT_TRUE(AwaitStats(
      *server, [](const TcpStoreServer::Stats& s) { return s.buffered_bytes <= 4096; }, Bound()));
  ASSERT_TRUE((*store)->Set("big", big).ok());
  EXPECT_EQ((*store)->Get("big", Bound()).value_or("").size(), big.size());
}

TEST(TcpStoreTest, IdleAndStalledConnectionsAreClosedButAParkedWaitIsNot) {
  constexpr absl::Duration kIdle = absl::Milliseconds(300);
  TcpStoreServerOptions server_options = ServerOptions();
  server_options.idle_timeout = kIdle;
  auto server = StartServer(server_options);
  ASSERT_NE(server, nullptr);
  // Connected first, so its idle check runs before the others' would close them.
  std::unique_ptr<RawSocket> waiter = Authenticated(server->port());
  ASSERT_NE(waiter, nullptr);
  store_protocol::Request wait;
  wait.op = store_protocol::Op::kWait;
  wait.id = 2;
  wait.keys = {"later"};
  wait.timeout_ms = -1;
  waiter->Send(store_protocol::EncodeRequest(wait));
  ASSERT_TRUE(AwaitStats(
      *server, [](const TcpStoreServer::Stats& s) { return s.parked_requests == 1; }, Bound()));

  const absl::Time start = absl::Now();
  std::unique_ptr<RawSocket> idle = Authenticated(server->port());
  std::unique_ptr<RawSocket> stalled = Authenticated(server->port());
  ASSERT_TRUE(idle != nullptr && stalled != nullptr);
  stalled->Send(SetFramePrefix("k", 1 << 20, store_protocol::kHeaderBytes + 100));
  EXPECT_TRUE(idle->AwaitClosed(Bound()));
  EXPECT_TRUE(stalled->AwaitClosed(Bound()));
  EXPECT_GE(absl::Now() - start, kIdle - absl::Milliseconds(5));
  EXPECT_TRUE(AwaitStats(
      *server,
      [](const TcpStoreServer::Stats& s) {
        return s.idle_closed == 2 && s.dropped_connections == 1 && s.open_connections == 1 &&
               s.parked_requests == 1 && s.buffered_bytes <= 4096;
      },
      Bound()));
  // The waiter, silent for longer than the idle timeout, still gets its answer.
  auto store = TcpStore::Connect(ClientOptions(server->port()), Bound());
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->Set("later", "now").ok());
  absl::StatusOr<store_protocol::Response> answer = waiter->ReadResponse(Bound());
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_TRUE(answer->status().ok()) << answer->status();
}

// The liveness signal of elastic jobs: an entry registered with AppendOnClose lands in its log
// when the client goes away (here: the store object is destroyed, as at a process's death the
// kernel closes its sockets), after the entries other clients appended themselves, and a held
// connection is not closed for being idle.
TEST(TcpStoreTest, AppendOnCloseAppendsWhenTheClientGoesAwayAndNotBefore) {
  constexpr absl::Duration kIdle = absl::Milliseconds(200);
  TcpStoreServerOptions server_options = ServerOptions();
  server_options.idle_timeout = kIdle;
  auto server = StartServer(server_options);
  ASSERT_NE(server, nullptr);
  auto observer = TcpStore::Connect(ClientOptions(server->port()), Bound());
  ASSERT_TRUE(observer.ok()) << observer.status();
  auto leaving = TcpStore::Connect(ClientOptions(server->port()), Bound());
  ASSERT_TRUE(leaving.ok()) << leaving.status();
  ASSERT_TRUE((*leaving)->AppendOnClose("log", "lost 7", Bound()).ok());
  PrefixStore prefixed("job", **leaving);
  ASSERT_TRUE(prefixed.AppendOnClose("log", "lost 7 (prefixed)", Bound()).ok());
  // An entry a live client appends itself takes index 1.
  absl::StatusOr<std::string> first = (*observer)->CompareSet("log/1", "", "arrive 3");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(*first, "arrive 3");
  // Three idle timeouts later the held connection is still open: nothing was appended.
  absl::StatusOr<std::string> early = (*observer)->Get("log/2", absl::Now() + 3 * kIdle);
  EXPECT_TRUE(absl::IsDeadlineExceeded(early.status())) << early.status();
  leaving->reset();
  absl::StatusOr<std::string> appended = (*observer)->Get("log/2", Bound());
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_EQ(*appended, "lost 7");
  absl::StatusOr<std::string> in_prefix = (*observer)->Get("job/log/1", Bound());
  ASSERT_TRUE(in_prefix.ok()) << in_prefix.status();
  EXPECT_EQ(*in_prefix, "lost 7 (prefixed)");
  absl::StatusOr<bool> third = (*observer)->Check({"log/3"});
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_FALSE(*third);
}

TEST(StoreTest, AppendOnCloseNeedsAConnection) {
  MemoryStore store;
  absl::Status status = store.AppendOnClose("log", "lost", Bound());
  EXPECT_TRUE(absl::IsUnimplemented(status)) << status;
  EXPECT_THAT(status.message(), ::testing::HasSubstr("'log'"));
}

TEST(TcpStoreTest, ClientReopensAConnectionTheServerClosedWhileIdle) {
  TcpStoreServerOptions server_options = ServerOptions();
  server_options.idle_timeout = absl::Milliseconds(100);
  auto server = StartServer(server_options);
  ASSERT_NE(server, nullptr);
  auto store = TcpStore::Connect(ClientOptions(server->port()), Bound());
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->Set("k", "v").ok());
  ASSERT_TRUE(AwaitStats(
      *server,
      [](const TcpStoreServer::Stats& s) { return s.idle_closed == 1 && s.open_connections == 0; },
      Bound()));
  absl::StatusOr<std::string> value = (*store)->Get("k", Bound());
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "v");
}

TEST(TcpStoreTest, HostWithAPortIsRefusedAtOnce) {
  for (const char* host : {"node0:29500", "[::1]:29500", "tcp://node0"}) {
    TcpStoreOptions options = ClientOptions(29500);
    options.host = host;
    const absl::Time start = absl::Now();
    auto store = TcpStore::Connect(options, In(absl::Seconds(30)));
    EXPECT_TRUE(absl::IsInvalidArgument(store.status())) << store.status();
    EXPECT_THAT(std::string(store.status().message()), HasSubstr(host));
    EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  }
}

TEST(TcpStoreTest, ServerReportsTheAddressItIsBoundTo) {
  TcpStoreServerOptions options = ServerOptions();
  options.host = "localhost";
  auto server = StartServer(options);
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(server->bound_address() == "127.0.0.1" || server->bound_address() == "::1")
      << server->bound_address();
}

// Routes this process's log lines to a file while it lives.
class LogCapture {
 public:
  LogCapture()
      : path_(absl::StrCat(::testing::TempDir(), "/store_test_log_", getpid(), ".txt")),
        env_(std::make_unique<testing::ScopedEnv>("SHARDLINE_DEBUG_FILE", path_.c_str())) {
    std::remove(path_.c_str());
    ReinitLoggingForTesting();
  }
  ~LogCapture() {
    env_.reset();
    ReinitLoggingForTesting();
    std::remove(path_.c_str());
  }
  std::vector<std::string> Lines(absl::string_view containing) const {
    std::ifstream file(path_);
    std::vector<std::string> lines;
    for (std::string line; std::getline(file, line);) {
      if (absl::StrContains(line, containing)) lines.push_back(line);
    }
    return lines;
  }

 private:
  std::string path_;
  std::unique_ptr<testing::ScopedEnv> env_;
};

TEST(TcpStoreTest, JobRunsBesideAFloodOfConnectionsAndItsWarningsAreRateLimited) {
  constexpr int kFlood = 4000;
  constexpr int kGarbage = kFlood / 2;  // dropped at once, each a warning
  constexpr int kRanks = 4;
  // Both ends of every connection live in this process.
  rlimit files{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &files), 0);
  const rlim_t needed = 2 * kFlood + 512;
  if (files.rlim_cur < needed) {
    if (files.rlim_max < needed) {
      GTEST_SKIP() << "needs " << needed << " file descriptors, the hard limit is "
                   << files.rlim_max;
    }
    files.rlim_cur = needed;
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &files), 0);
  }
  LogCapture log;
  auto server = StartServer();  // the default 4096 connections
  ASSERT_NE(server, nullptr);

  std::vector<std::unique_ptr<RawSocket>> flood;
  const std::string garbage(store_protocol::kHeaderBytes, 'x');
  const std::string hello = HelloFrame();
  for (int i = 0; i < kFlood; ++i) {
    flood.push_back(std::make_unique<RawSocket>(server->port()));
    ASSERT_TRUE(flood.back()->connected()) << "connection " << i;
    flood.back()->Send(i < kGarbage ? garbage : hello);
  }

  // The job: every rank publishes a value, then waits for and reads everyone's.
  std::vector<absl::Status> results = RunRankThreads(kRanks, [&](int r) -> absl::Status {
    TcpStoreOptions options = ClientOptions(server->port());
    options.rank = r;
    SL_ASSIGN_OR_RETURN(std::unique_ptr<TcpStore> store, TcpStore::Connect(options, Bound()));
    SL_RETURN_IF_ERROR(store->Set(absl::StrCat("job/", r), absl::StrCat("value", r)));
    SL_RETURN_IF_ERROR(store->Add("job/arrived", 1).status());
    std::vector<std::string> keys;
    for (int k = 0; k < kRanks; ++k) keys.push_back(absl::StrCat("job/", k));
    SL_RETURN_IF_ERROR(store->Wait(keys, Bound()));
    for (int k = 0; k < kRanks; ++k) {
      SL_ASSIGN_OR_RETURN(std::string value, store->Get(keys[k], Bound()));
      if (value != absl::StrCat("value", k)) {
        return absl::InternalError(absl::StrCat("rank ", r, " read ", value, " for ", k));
      }
    }
    return absl::OkStatus();
  });
  for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(results[r].ok()) << "rank " << r << results[r];
  EXPECT_TRUE(AwaitStats(
      *server, [](const TcpStoreServer::Stats& s) { return s.dropped_connections == kGarbage; },
      Bound()))
      << server->stats().dropped_connections;
  // 2,000 drops, but only a burst of warnings.
  const std::vector<std::string> warnings = log.Lines("WARN STORE");
  EXPECT_GE(warnings.size(), 1u);
  EXPECT_LE(warnings.size(), 25u) << warnings.size() << " warnings, the first: " << warnings[0];
  flood.clear();
  EXPECT_TRUE(AwaitStats(
      *server, [](const TcpStoreServer::Stats& s) { return s.open_connections == 0; }, Bound()));
}

}  // namespace
}  // namespace shardline
