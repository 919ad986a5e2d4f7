// Communicator::Send and Communicator::Recv, the same cases on the local and ucx backends (ranks
// as threads): every element of odd-sized messages of every dtype, both orders, many tags in
// flight, any source, and the failures (a size or dtype mismatch, a send that never comes, a dead
// peer, bad arguments); point-to-point stays out of the collectives' issue order; backends
// without it say so.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collectives/communicator.h"
#include "collectives/local/local_communicator.h"
#include "collectives/sim/sim_communicator.h"
#include "gmock/gmock.h"
#include "runtime/stream.h"
#include "runtime/virtual_time.h"
#include "tests/collectives/rank_comms.h"
#include "tests/common/gate.h"
#include "tests/common/hashed_bytes.h"
#include "tests/common/rank_threads.h"

namespace shardline {
namespace {

using ::shardline::testing::Comms;
using ::shardline::testing::HashedBytes;
using ::shardline::testing::MakeUcxComms;
using ::shardline::testing::RunRanks;
using ::shardline::testing::RunRankThreads;
using ::shardline::testing::WaitFor;
using ::testing::HasSubstr;

// The backend under test: "local" or "ucx".
class PointToPointTest : public ::testing::TestWithParam<std::string> {
 protected:
  Comms Make(int n, absl::Duration timeout = absl::Seconds(30)) {
    if (GetParam() == "ucx") return MakeUcxComms(n, timeout);
    absl::StatusOr<Comms> comms = CreateLocalCommunicators(n, {.timeout = timeout});
    EXPECT_TRUE(comms.ok()) << comms.status();
    return *std::move(comms);
  }
};

std::unique_ptr<Stream> MakeStream(const std::string& name) {
  absl::StatusOr<std::unique_ptr<Stream>> stream = CreateHostStream({.name = name});
  EXPECT_TRUE(stream.ok()) << stream.status();
  return *std::move(stream);
}

// Every byte; the first difference named.
void ExpectSameBytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                     const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << what << ": byte " << i;
  }
}

// A ring: rank r sends to r + 1 and receives from r - 1, for odd sizes of every dtype. Sends
// first on one stream; or receives first, on a stream of their own, with the sends after them
// on another (a receive blocks its stream until its message is there).
TEST_P(PointToPointTest, EveryElementOfOddSizesInBothOrders) {
  constexpr int n = 3;
  Comms comms = Make(n);
  const size_t counts[] = {0, 1, 7, 4097, 100003};
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kU8, DType::kI64};
  for (bool receive_first : {false, true}) {
    RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
      std::unique_ptr<Stream> other = MakeStream(absl::StrCat("recv", r));
      Stream& recv_stream = receive_first ? *other : stream;
      const int to = (r + 1) % n, from = (r + n - 1) % n;
      int message = 0;
      for (DType dtype : dtypes) {
        for (size_t count : counts) {
          SCOPED_TRACE(
              absl::StrCat(DTypeName(dtype), " x ", count, receive_first ? ", recv first" : ""));
          const size_t bytes = count * DTypeSize(dtype);
          std::vector<uint8_t> out = HashedBytes(r, message, bytes);
          std::vector<uint8_t> in(bytes, 0xEE);
          absl::StatusOr<Work> received, sent;
          if (receive_first) {
            received = comm.Recv(in.data(), count, dtype, from, recv_stream);
            sent = comm.Send(out.data(), count, dtype, to, stream);
          } else {
            sent = comm.Send(out.data(), count, dtype, to, stream);
            received = comm.Recv(in.data(), count, dtype, from, recv_stream);
          }
          ASSERT_TRUE(WaitFor(sent).ok()) << WaitFor(sent);
          ASSERT_TRUE(WaitFor(received).ok()) << WaitFor(received);
          EXPECT_EQ(received->source(), from);
          EXPECT_EQ(sent->source(), -1);
          ExpectSameBytes(in, HashedBytes(from, message, bytes), "received");
          ExpectSameBytes(out, HashedBytes(r, message, bytes), "the send's buffer");
          ++message;
        }
      }
    });
  }
}

// Ten tags in flight from rank 0, received by rank 1 in the reverse order of their tags; two
// messages of one tag arrive in the order they were sent.
TEST_P(PointToPointTest, ManyTagsInFlightMatchByTagInOrder) {
  Comms comms = Make(2);
  constexpr int kTags = 10;
  constexpr size_t kBytes = 333;
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    if (r == 0) {
      std::vector<std::vector<uint8_t>> out;
      for (int t = 0; t < kTags; ++t) out.push_back(HashedBytes(0, t, kBytes));
      out.push_back(HashedBytes(0, 100, kBytes));  // a second message with tag 3
      std::vector<Work> works;
      for (int t = 0; t <= kTags; ++t) {
        absl::StatusOr<Work> sent = comm.Send(out[t].data(), kBytes, DType::kU8, 1, stream,
                                              {.match_tag = t == kTags ? 3u : uint64_t(t)});
        ASSERT_TRUE(sent.ok()) << sent.status();
        works.push_back(*sent);
      }
      for (const Work& w : works) ASSERT_TRUE(w.Wait(absl::Now() + absl::Seconds(30)).ok());
      return;
    }
    std::vector<std::vector<uint8_t>> in(kTags + 1, std::vector<uint8_t>(kBytes));
    std::vector<Work> works;
    for (int t = kTags - 1; t >= 0; --t) {
      absl::StatusOr<Work> received =
          comm.Recv(in[t].data(), kBytes, DType::kU8, 0, stream, {.match_tag = uint64_t(t)});
      ASSERT_TRUE(received.ok()) << received.status();
      works.push_back(*received);
    }
    absl::StatusOr<Work> second =
        comm.Recv(in[kTags].data(), kBytes, DType::kU8, 0, stream, {.match_tag = 3});
    ASSERT_TRUE(second.ok()) << second.status();
    works.push_back(*second);
    for (const Work& w : works) ASSERT_TRUE(w.Wait(absl::Now() + absl::Seconds(30)).ok());
    for (int t = 0; t < kTags; ++t)
      ExpectSameBytes(in[t], HashedBytes(0, t, kBytes), absl::StrCat("tag ", t));
    ExpectSameBytes(in[kTags], HashedBytes(0, 100, kBytes), "the second message of tag 3");
  });
}

// Rank 0 receives from any rank, three times: each sender's message exactly once, and
// Work::source() names who sent the buffer it filled.
TEST_P(PointToPointTest, AnySourceTakesEachSendersMessage) {
  constexpr int n = 4;
  constexpr size_t kCount = 1001;
  Comms comms = Make(n);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    const size_t bytes = kCount * sizeof(float);
    if (r != 0) {
      std::vector<uint8_t> out = HashedBytes(r, 7, bytes);
      ASSERT_TRUE(
          WaitFor(comm.Send(out.data(), kCount, DType::kF32, 0, stream, {.match_tag = 5})).ok());
      return;
    }
    std::set<int> sources;
    for (int k = 0; k < n - 1; ++k) {
      std::vector<uint8_t> in(bytes);
      absl::StatusOr<Work> received =
          comm.Recv(in.data(), kCount, DType::kF32, kAnySource, stream, {.match_tag = 5});
      ASSERT_TRUE(WaitFor(received).ok()) << WaitFor(received);
      const int source = received->source();
      ASSERT_TRUE(source >= 1 && source < n) << source;
      EXPECT_TRUE(sources.insert(source).second) << "rank " << source << " twice";
      ExpectSameBytes(in, HashedBytes(source, 7, bytes), absl::StrCat("from rank ", source));
    }
  });
}

// A receive of another size than its send fails naming both sides, as a peer error; the
// receiver's failure aborts the group, so the sender's next operation fails too.
TEST_P(PointToPointTest, AMismatchedSizeFailsNamingBothSides) {
  Comms comms = Make(2);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    std::vector<float> buffer(7, 1.5f);
    if (r == 0) {
      ASSERT_TRUE(WaitFor(comm.Send(buffer.data(), 5, DType::kF32, 1, stream)).ok());
      // Rank 1 sends nothing: this receive ends when the receiver's failure reaches this rank.
      absl::Status next = WaitFor(comm.Recv(buffer.data(), 5, DType::kF32, 1, stream));
      EXPECT_EQ(next.code(), absl::StatusCode::kInvalidArgument) << next;
      EXPECT_THAT(next.message(), HasSubstr("peer rank 1 aborted"));
      EXPECT_TRUE(IsPeerError(next)) << next;
      EXPECT_FALSE(comm.status().ok());
      return;
    }
    absl::Status status = WaitFor(comm.Recv(buffer.data(), 7, DType::kF32, 0, stream));
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(status.message(), HasSubstr("recv #0 from rank 0"));
    EXPECT_THAT(status.message(), HasSubstr("rank 0 sent send(count=5, f32, to=1, tag=0)"));
    EXPECT_THAT(status.message(), HasSubstr("recv(count=7, f32, from=0, tag=0)"));
    EXPECT_TRUE(IsPeerError(status));
    for (float v : buffer) EXPECT_EQ(v, 1.5f) << "the mismatched receive wrote its buffer";
  });
}

// A receive that matches a send of as many bytes but another dtype fails the same way, before it
// writes a byte.
TEST_P(PointToPointTest, AMismatchedDTypeOfTheSameBytesFails) {
  Comms comms = Make(2);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    if (r == 0) {
      std::vector<float> out = {1.25f, -2.5f, 3.75f, 0.125f};
      ASSERT_TRUE(WaitFor(comm.Send(out.data(), 4, DType::kF32, 1, stream, {.match_tag = 6})).ok());
      return;
    }
    std::vector<double> in(2, 9.5);
    absl::Status status =
        WaitFor(comm.Recv(in.data(), 2, DType::kF64, 0, stream, {.match_tag = 6}));
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(status.message(), HasSubstr("rank 0 sent send(count=4, f32, to=1, tag=6)"));
    EXPECT_THAT(status.message(), HasSubstr("recv(count=2, f64, from=0, tag=6)"));
    EXPECT_EQ(in, std::vector<double>(2, 9.5)) << "the mismatched receive wrote its buffer";
  });
}

// A receive whose send never comes fails at its deadline, naming the rank it waited for in the
// words torch's tests look for; a receive from any rank names every other rank. The flight
// record shows both sides: the send done, the receive failed waiting on its peer.
TEST_P(PointToPointTest, AReceiveWithoutItsSendTimesOutNamingThePeer) {
  Comms comms = Make(3);
  testing::Gate sent;  // the receive starts once the send is done (its timeout aborts the group)
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    float x = 0;
    if (r == 2) {  // a message with another tag, which the receive must not take
      ASSERT_TRUE(
          WaitFor(comm.Send(&x, 1, DType::kF32, 1, stream, {.label = "probe", .match_tag = 8}))
              .ok());
      const std::string json = comm.FlightRecordJson("test");
      EXPECT_THAT(json, HasSubstr("\"call\": \"send(count=1, f32, to=1, tag=8)\""));
      EXPECT_THAT(json, HasSubstr("\"key\": 8"));
      EXPECT_THAT(json, HasSubstr("\"tag\": \"probe\""));
      EXPECT_THAT(json, HasSubstr("\"state\": \"done\""));
      sent.Open();
      return;
    }
    if (r != 1) return;
    ASSERT_TRUE(sent.Wait());
    absl::Status status = WaitFor(comm.Recv(&x, 1, DType::kF32, 2, stream,
                                            {.timeout = absl::Milliseconds(200), .match_tag = 9}));
    EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
    EXPECT_THAT(status.message(), HasSubstr("recv #0 from rank 2"));
    EXPECT_THAT(status.message(), HasSubstr(" timeout after 200ms waiting for rank(s) 2"));
    std::vector<FlightRecord> records = comm.PointToPointFlightRecords();
    ASSERT_EQ(records.size(), 1u);
    EXPECT_EQ(records[0].state, FlightState::kFailed);
    EXPECT_EQ(records[0].fingerprint().CallString(), "recv(count=1, f32, from=2, tag=9)");
    EXPECT_EQ(records[0].waiting_on, std::vector<int>{2});
    EXPECT_TRUE(comm.FlightRecords().empty()) << "a receive recorded as a collective";
    EXPECT_THAT(comm.FlightRecordJson("test"), HasSubstr("\"point_to_point\": [\n{\"seq\": 0"));
  });
  comms = Make(3);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    if (r != 1) return;
    float x = 0;
    absl::Status status = WaitFor(
        comm.Recv(&x, 1, DType::kF32, kAnySource, stream, {.timeout = absl::Milliseconds(200)}));
    EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
    EXPECT_THAT(status.message(), HasSubstr("recv #0 from any rank"));
    EXPECT_THAT(status.message(), HasSubstr("waiting for rank(s) 0, 2"));
  });
}

// A send is delivered even when its sender's communicator is destroyed right after it: the
// destruction waits for the receiver to take the message (ucx: a large message is read out of
// the sender's memory). The send's buffer may be reused as soon as the send completes.
TEST_P(PointToPointTest, ASendIsDeliveredAfterItsSenderIsDestroyed) {
  Comms comms = Make(2);
  constexpr size_t kBytes = (size_t{3} << 20) + 5;
  std::vector<uint8_t> out = HashedBytes(0, 9, kBytes), in(kBytes);
  std::unique_ptr<Stream> sender = MakeStream("sender"), receiver = MakeStream("receiver");
  ASSERT_TRUE(WaitFor(comms[0]->Send(out.data(), kBytes, DType::kU8, 1, *sender)).ok());
  std::fill(out.begin(), out.end(), 0);
  sender.reset();
  std::thread destroy([&] { comms[0].reset(); });
  absl::StatusOr<Work> received = comms[1]->Recv(in.data(), kBytes, DType::kU8, 0, *receiver);
  EXPECT_TRUE(WaitFor(received).ok()) << WaitFor(received);
  destroy.join();
  ExpectSameBytes(in, HashedBytes(0, 9, kBytes), "received after the sender's destruction");
}

// A peer that dies (its communicator aborted) while this rank waits for its message: an error
// here well before the deadline, naming that peer.
TEST_P(PointToPointTest, ADeadPeerFailsTheWaitingReceive) {
  Comms comms = Make(2, absl::Seconds(60));
  const absl::Time start = absl::Now();
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    if (r == 0) {
      comm.Abort(absl::UnavailableError("rank 0 died"));
      return;
    }
    float x = 0;
    absl::Status status = WaitFor(comm.Recv(&x, 1, DType::kF32, 0, stream));
    EXPECT_FALSE(status.ok());
    EXPECT_THAT(status.message(), HasSubstr("rank 0 died"));
    EXPECT_TRUE(IsPeerError(status)) << status;
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
}

// Bad arguments are InvalidArgument naming what was wrong, and enqueue nothing: the
// communicator still works.
TEST_P(PointToPointTest, BadArgumentsAreNamedAndEnqueueNothing) {
  Comms comms = Make(2);
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    float x = 0;
    auto expect_invalid = [&](const absl::StatusOr<Work>& work, const std::string& text) {
      EXPECT_EQ(work.status().code(), absl::StatusCode::kInvalidArgument) << work.status();
      EXPECT_THAT(work.status().message(), HasSubstr(text));
    };
    expect_invalid(comm.Send(&x, 1, DType::kF32, 2, stream), "peer 2 is not a rank");
    expect_invalid(comm.Send(&x, 1, DType::kF32, kAnySource, stream), "peer -1 is not a rank");
    expect_invalid(comm.Recv(&x, 1, DType::kF32, -2, stream), "kAnySource (-1)");
    expect_invalid(comm.Send(&x, 1, DType::kF32, r, stream), "cannot send to itself");
    expect_invalid(comm.Recv(&x, 1, DType::kF32, r, stream), "cannot receive from itself");
    expect_invalid(comm.Recv(nullptr, 3, DType::kF32, 1 - r, stream), "data is null");
    expect_invalid(comm.Send(&x, 1, DType::kF32, 1 - r, stream, {.timeout = absl::Seconds(-1)}),
                   "negative timeout");
    if (GetParam() == "ucx") {
      expect_invalid(comm.Send(&x, 1, DType::kF32, 1 - r, stream, {.match_tag = uint64_t{1} << 36}),
                     "message tag 68719476736 is out of the ucx backend's range");
    }
    // Still usable.
    std::vector<uint8_t> out = HashedBytes(r, 1, 4), in(4);
    absl::StatusOr<Work> sent = comm.Send(out.data(), 1, DType::kF32, 1 - r, stream);
    absl::StatusOr<Work> received = comm.Recv(in.data(), 1, DType::kF32, 1 - r, stream);
    ASSERT_TRUE(WaitFor(sent).ok());
    ASSERT_TRUE(WaitFor(received).ok());
    ExpectSameBytes(in, HashedBytes(1 - r, 1, 4), "after the bad calls");
  });
}

// Point-to-point is outside the collectives' issue order. Rank 0 issues an all-reduce, then on
// another stream a send; rank 1 first waits for that message, only then joins the all-reduce.
// A send held behind the all-reduce would wait for rank 1, which waits for the send.
TEST_P(PointToPointTest, StaysOutOfTheCollectivesIssueOrder) {
  Comms comms = Make(2, absl::Seconds(20));
  RunRanks(comms, [&](int r, Communicator& comm, Stream& stream) {
    std::unique_ptr<Stream> p2p = MakeStream(absl::StrCat("p2p", r));
    float sum = 1.0f + r, message = 0;
    if (r == 0) {
      absl::StatusOr<Work> reduce = comm.AllReduce(&sum, &sum, 1, DType::kF32, stream);
      message = 4.25f;
      absl::StatusOr<Work> sent = comm.Send(&message, 1, DType::kF32, 1, *p2p);
      ASSERT_TRUE(WaitFor(sent).ok()) << WaitFor(sent);
      ASSERT_TRUE(WaitFor(reduce).ok()) << WaitFor(reduce);
    } else {
      ASSERT_TRUE(WaitFor(comm.Recv(&message, 1, DType::kF32, 0, *p2p)).ok());
      EXPECT_EQ(message, 4.25f);
      ASSERT_TRUE(WaitFor(comm.AllReduce(&sum, &sum, 1, DType::kF32, stream)).ok());
    }
    EXPECT_EQ(sum, 3.0f);
  });
}

// Where a communicator has no point-to-point (nccl, without a GPU here; a representative-rank
// sim communicator, which has no peers), Send says so and aborts nothing.
TEST(PointToPointBackendTest, CommunicatorsWithoutItSaySo) {
  std::unique_ptr<VirtualTimeline> timeline = *VirtualTimeline::Create({});
  SimOptions options;
  options.move_data = false;
  options.split_call = [](uint64_t, int rank) { return std::pair{0, rank}; };
  absl::StatusOr<std::shared_ptr<Communicator>> comm =
      CreateRepresentativeSimCommunicator(*timeline, 4, 1, options);
  ASSERT_TRUE(comm.ok()) << comm.status();
  std::unique_ptr<Stream> stream = *CreateVirtualStream(*timeline, {.name = "sim"});
  float x = 0;
  absl::StatusOr<Work> sent = (*comm)->Send(&x, 1, DType::kF32, 0, *stream);
  EXPECT_EQ(sent.status().code(), absl::StatusCode::kUnimplemented) << sent.status();
  EXPECT_THAT(sent.status().message(), HasSubstr("send on world (rank 1 of 4)"));
  EXPECT_THAT(sent.status().message(), HasSubstr("representative-rank sim communicator"));
  EXPECT_TRUE((*comm)->status().ok()) << "a refused send aborted the communicator";
}

INSTANTIATE_TEST_SUITE_P(Backends, PointToPointTest, ::testing::Values("local", "ucx"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace shardline
