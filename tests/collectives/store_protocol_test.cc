// The store's wire format: every message round-trips, and every kind of damage is refused with
// InvalidArgument (never a crash, never a huge allocation).

#include "collectives/store/store_protocol.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardline::store_protocol {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kMax = 1 << 20;

absl::StatusOr<Request> DecodeRequestFrame(absl::string_view frame, uint32_t max = kMax) {
  absl::StatusOr<FrameHeader> header = DecodeHeader(frame, max);
  if (!header.ok()) return header.status();
  return DecodeRequest(*header, frame.substr(kHeaderBytes));
}

absl::StatusOr<Response> DecodeResponseFrame(absl::string_view frame) {
  absl::StatusOr<FrameHeader> header = DecodeHeader(frame, kMax);
  if (!header.ok()) return header.status();
  return DecodeResponse(*header, frame.substr(kHeaderBytes));
}

std::vector<Request> SampleRequests() {
  std::vector<Request> requests;
  Request r;
  r.op = Op::kHello;
  r.id = 1;
  r.token = "tok";
  r.client_name = "rank 3";
  r.rank = 3;
  requests.push_back(r);
  r = Request();
  r.op = Op::kSet;
  r.id = 2;
  r.key = "k";
  r.value = std::string("v\0w", 3);
  requests.push_back(r);
  r = Request();
  r.op = Op::kGet;
  r.id = 3;
  r.key = "key";
  r.timeout_ms = 1234;
  requests.push_back(r);
  r = Request();
  r.op = Op::kAdd;
  r.id = 4;
  r.key = "c";
  r.delta = -9'000'000'000;
  requests.push_back(r);
  r = Request();
  r.op = Op::kCompareSet;
  r.id = 5;
  r.key = "cas";
  r.expected = "";
  r.desired = "d";
  requests.push_back(r);
  r = Request();
  r.op = Op::kWait;
  r.id = 6;
  r.keys = {"a", "bb", "ccc"};
  r.timeout_ms = -1;
  requests.push_back(r);
  r = Request();
  r.op = Op::kCheck;
  r.id = 7;
  r.keys = {"x"};
  requests.push_back(r);
  r = Request();
  r.op = Op::kDelete;
  r.id = 8;
  r.key = "gone";
  requests.push_back(r);
  r = Request();
  r.op = Op::kNumKeys;
  r.id = 0xffffffffu;
  requests.push_back(r);
  r = Request();
  r.op = Op::kAppendOnClose;
  r.id = 9;
  r.key = "elastic/log";
  r.value = std::string("lost 1 0 \0\xff", 13);
  requests.push_back(r);
  return requests;
}

TEST(StoreProtocolTest, RequestsRoundTrip) {
  for (const Request& in : SampleRequests()) {
    const std::string frame = EncodeRequest(in);
    absl::StatusOr<Request> out = DecodeRequestFrame(frame);
    ASSERT_TRUE(out.ok()) << OpName(in.op) << ": " << out.status();
    EXPECT_EQ(out->op, in.op);
    EXPECT_EQ(out->id, in.id);
    EXPECT_EQ(out->key, in.key);
    EXPECT_EQ(out->keys, in.keys);
    EXPECT_EQ(out->value, in.value);
    EXPECT_EQ(out->expected, in.expected);
    EXPECT_EQ(out->desired, in.desired);
    EXPECT_EQ(out->delta, in.delta);
    EXPECT_EQ(out->token, in.token);
    EXPECT_EQ(out->client_name, in.client_name);
    if (in.op == Op::kHello) EXPECT_EQ(out->rank, in.rank);
    if (in.op == Op::kGet || in.op == Op::kWait) EXPECT_EQ(out->timeout_ms, in.timeout_ms);
  }
}

TEST(StoreProtocolTest, ResponsesRoundTrip) {
  for (const Request& request : SampleRequests()) {
    Response in;
    in.op = request.op;
    in.id = request.id;
    in.value = "value";
    in.number = -42;
    in.flag = true;
    absl::StatusOr<Response> out = DecodeResponseFrame(EncodeResponse(in));
    ASSERT_TRUE(out.ok()) << OpName(in.op) << ": " << out.status();
    EXPECT_EQ(out->code, absl::StatusCode::kOk);
    EXPECT_EQ(out->id, in.id);
    if (in.op == Op::kGet || in.op == Op::kCompareSet) EXPECT_EQ(out->value, "value");
    if (in.op == Op::kAdd || in.op == Op::kNumKeys) EXPECT_EQ(out->number, -42);
    if (in.op == Op::kCheck || in.op == Op::kDelete) EXPECT_TRUE(out->flag);

    Response error;
    error.op = request.op;
    error.id = request.id;
    error.code = absl::StatusCode::kDeadlineExceeded;
    error.message = "too late";
    out = DecodeResponseFrame(EncodeResponse(error));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->status(), absl::DeadlineExceededError("too late"));
  }
}

TEST(StoreProtocolTest, HeaderIsLittleEndianWithMagicFirst) {
  Request r;
  r.op = Op::kNumKeys;
  r.id = 0x01020304;
  const std::string frame = EncodeRequest(r);
  ASSERT_EQ(frame.size(), kHeaderBytes);
  EXPECT_EQ(frame.substr(0, 4), "SLST");
  EXPECT_EQ(frame[4], 1);  // version
  EXPECT_EQ(frame[6], 9);  // opcode
  EXPECT_EQ(frame[8], 4);  // id, low byte first
  EXPECT_EQ(frame[11], 1);
}

TEST(StoreProtocolTest, DamagedHeadersAreRefused) {
  const std::string good = EncodeRequest(SampleRequests()[1]);
  auto expect_invalid = [](absl::string_view frame, absl::string_view what, uint32_t max = kMax) {
    absl::StatusOr<FrameHeader> header = DecodeHeader(frame, max);
    ASSERT_FALSE(header.ok()) << what;
    EXPECT_TRUE(absl::IsInvalidArgument(header.status())) << header.status();
    EXPECT_THAT(std::string(header.status().message()), HasSubstr(what));
  };
  expect_invalid(good.substr(0, 10), "truncated");
  std::string bad = good;
  bad[0] = 'X';
  expect_invalid(bad, "bad magic");
  bad = good;
  bad[4] = 2;
  expect_invalid(bad, "version 2");
  bad = good;
  bad[6] = 0x42;
  expect_invalid(bad, "unknown opcode");
  bad = good;
  bad[6] = 0;
  expect_invalid(bad, "unknown opcode");
  expect_invalid(good, "exceeds the maximum message size", /*max=*/4);
}

TEST(StoreProtocolTest, DamagedPayloadsAreRefused) {
  for (const Request& request : SampleRequests()) {
    const std::string frame = EncodeRequest(request);
    absl::StatusOr<FrameHeader> header = DecodeHeader(frame, kMax);
    ASSERT_TRUE(header.ok());
    const absl::string_view payload = absl::string_view(frame).substr(kHeaderBytes);
    // Every shorter payload (with the header adjusted to match) is truncated somewhere.
    for (size_t n = 0; n < payload.size(); ++n) {
      FrameHeader cut = *header;
      cut.payload_bytes = static_cast<uint32_t>(n);
      absl::StatusOr<Request> out = DecodeRequest(cut, payload.substr(0, n));
      EXPECT_TRUE(absl::IsInvalidArgument(out.status()))
          << OpName(request.op) << " cut to " << n << " bytes: " << out.status();
    }
    // One byte too many is trailing garbage.
    FrameHeader longer = *header;
    longer.payload_bytes += 1;
    const std::string padded = std::string(payload) + "!";
    absl::StatusOr<Request> out = DecodeRequest(longer, padded);
    ASSERT_FALSE(out.ok());
    EXPECT_THAT(std::string(out.status().message()), HasSubstr("trailing"));
    // A payload whose length disagrees with the header.
    EXPECT_FALSE(DecodeRequest(*header, padded).ok());
    // A request is not a response.
    EXPECT_FALSE(DecodeResponse(*header, payload).ok());
  }
}

TEST(StoreProtocolTest, ForgedCountsAllocateNothing) {
  // WAIT claiming 2^32-1 keys in an 8-byte payload.
  std::string payload = "\xff\xff\xff\xff";
  payload += std::string(8, '\0');
  FrameHeader header;
  header.op = Op::kWait;
  header.payload_bytes = static_cast<uint32_t>(payload.size());
  absl::StatusOr<Request> out = DecodeRequest(header, payload);
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("claims"));
}

TEST(StoreProtocolTest, EmptyKeysAndBadFieldsAreRefused) {
  Request set;
  set.op = Op::kSet;
  set.key = "";  // the encoder writes it; the decoder refuses it
  EXPECT_THAT(std::string(DecodeRequestFrame(EncodeRequest(set)).status().message()),
              HasSubstr("empty"));
  Request get;
  get.op = Op::kGet;
  get.key = "k";
  get.timeout_ms = -5;
  EXPECT_FALSE(DecodeRequestFrame(EncodeRequest(get)).ok());

  Response flag;
  flag.op = Op::kCheck;
  std::string frame = EncodeResponse(flag);
  frame.back() = 7;  // the flag byte
  EXPECT_THAT(std::string(DecodeResponseFrame(frame).status().message()), HasSubstr("flag"));

  Response code;
  code.op = Op::kSet;
  frame = EncodeResponse(code);
  frame[kHeaderBytes] = 99;  // status code
  EXPECT_THAT(std::string(DecodeResponseFrame(frame).status().message()), HasSubstr("status code"));
}

}  // namespace
}  // namespace shardline::store_protocol
