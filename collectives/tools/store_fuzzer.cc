// libFuzzer entry point over the TCP store's message decoder (collectives/store/store_protocol).
// The input is one frame: a header and whatever follows. Every decode must return a Status, never
// crash or allocate beyond the input; a frame that decodes must re-encode to the same bytes.
//
//   clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address -I. collectives/tools/store_fuzzer.cc \
//       collectives/store/store_protocol.cc -labsl_status -labsl_strings ... -o store_fuzzer
//   ./store_fuzzer -max_total_time=30

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "collectives/store/store_protocol.h"

namespace {

namespace proto = shardline::store_protocol;

// A small limit so that the fuzzer also reaches the "exceeds the maximum" branch.
constexpr uint32_t kMaxPayload = 1 << 16;

void Require(bool condition) {
  if (!condition) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view input(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<proto::FrameHeader> header = proto::DecodeHeader(input, kMaxPayload);
  if (!header.ok()) {
    Require(absl::IsInvalidArgument(header.status()));
    return 0;
  }
  Require(header->payload_bytes <= kMaxPayload);
  // The payload as the server would hand it over: exactly payload_bytes, if there are that many;
  // otherwise decode what there is (the decoder must refuse the length mismatch).
  absl::string_view payload = input.substr(proto::kHeaderBytes);
  if (payload.size() > header->payload_bytes) payload = payload.substr(0, header->payload_bytes);
  const std::string frame(input.substr(0, proto::kHeaderBytes + payload.size()));

  // Both decoders run on every header: each must refuse the other's kind cleanly.
  proto::FrameHeader as_request = *header;
  as_request.is_response = false;
  absl::StatusOr<proto::Request> request = proto::DecodeRequest(as_request, payload);
  if (request.ok()) {
    Require(payload.size() == header->payload_bytes);
    // Canonical re-encoding: the same bytes (but the response bit, which we cleared).
    std::string again = proto::EncodeRequest(*request);
    Require(again.size() == frame.size());
    Require(again.substr(proto::kHeaderBytes) == frame.substr(proto::kHeaderBytes));
  } else {
    Require(absl::IsInvalidArgument(request.status()));
  }

  proto::FrameHeader as_response = *header;
  as_response.is_response = true;
  absl::StatusOr<proto::Response> response = proto::DecodeResponse(as_response, payload);
  if (response.ok()) {
    std::string again = proto::EncodeResponse(*response);
    Require(again.substr(proto::kHeaderBytes) == frame.substr(proto::kHeaderBytes));
  } else {
    Require(absl::IsInvalidArgument(response.status()));
  }

  // The header's own kind, as a real peer would be decoded.
  if (header->is_response) {
    (void)proto::DecodeResponse(*header, payload);
  } else {
    (void)proto::DecodeRequest(*header, payload);
  }
  return 0;
}
