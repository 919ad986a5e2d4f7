// File: collectives/store/store_protocol.h
// -----------------------------------------------------------------------------
// The TCP store's wire format: pure encode/decode functions, no I/O (so that a fuzzer reaches
// every line of the decoder). Everything is little-endian, written byte by byte.
//
// Frame (16-byte header, then the payload):
//   u32 magic          0x54534C53 (the bytes "SLST")
//   u16 version        kVersion; a peer of another version is refused
//   u16 opcode         an Op; responses carry the request's opcode | kResponseBit
//   u32 request id     echoed by the response
//   u32 payload bytes  at most the receiver's maximum message size
//
// Payload fields: `bytes` = u32 length + that many bytes; `i64`; `u32`; `u8`;
// `keys` = u32 count + count × bytes. Requests:
//   HELLO        bytes token, bytes client name, i64 rank (-1: unknown)   — first on a connection,
//                at most kMaxHelloPayloadBytes
//   SET          bytes key, bytes value
//   GET          bytes key, i64 timeout ms (-1: none)
//   ADD          bytes key, i64 delta
//   COMPARE_SET  bytes key, bytes expected, bytes desired
//   WAIT         keys, i64 timeout ms (-1: none)
//   CHECK        keys
//   DELETE       bytes key
//   NUM_KEYS     (empty)
//   APPEND_ON_CLOSE  bytes log key, bytes entry   — when this connection closes (the client
//                process died, or closed it), the server appends `entry` to the log `log key`
//                (the first missing key of "<log key>/1", "<log key>/2", ...); a connection
//                holding one is never closed for being idle
// Responses: u32 status code (absl::StatusCode), bytes message, then only if the code is OK:
//   GET, COMPARE_SET: bytes value · ADD, NUM_KEYS: i64 · CHECK, DELETE: u8 0/1 · others: none.
//
// Decoders return InvalidArgument for a bad magic, an unknown version or opcode, a payload
// longer than the maximum, a truncated field, an empty key, an out-of-range code or flag, and
// trailing bytes after the last field. The message names the opcode, the field and the offset.

#ifndef SHARDLINE_COLLECTIVES_STORE_STORE_PROTOCOL_H_
#define SHARDLINE_COLLECTIVES_STORE_STORE_PROTOCOL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardline::store_protocol {

inline constexpr uint32_t kMagic = 0x54534C53;  // "SLST" on the wire
inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kHeaderBytes = 16;
inline constexpr uint16_t kResponseBit = 0x8000;
// The default maximum payload (SHARDLINE_STORE_MAX_MESSAGE_BYTES overrides it in tcp_store).
inline constexpr uint32_t kDefaultMaxPayloadBytes = 64u << 20;
// Until a connection's HELLO has been accepted, a server accepts no frame whose payload is larger
// than this (a HELLO is a token, a client name and a rank): an unauthenticated peer cannot make
// it buffer a maximum-size message.
inline constexpr uint32_t kMaxHelloPayloadBytes = 4096;

enum class Op : uint16_t {
  kHello = 1,
  kSet = 2,
  kGet = 3,
  kAdd = 4,
  kCompareSet = 5,
  kWait = 6,
  kCheck = 7,
  kDelete = 8,
  kNumKeys = 9,
  kAppendOnClose = 10,
};

// "GET", "COMPARE_SET", ... ("UNKNOWN(<n>)" for anything else).
std::string OpName(uint16_t opcode);
inline std::string OpName(Op op) { return OpName(static_cast<uint16_t>(op)); }

struct FrameHeader {
  uint16_t version = kVersion;
  Op op = Op::kHello;
  bool is_response = false;
  uint32_t request_id = 0;
  uint32_t payload_bytes = 0;
};

// The fields each opcode uses (see the table above); the others are ignored when encoding.
struct Request {
  Op op = Op::kHello;
  uint32_t id = 0;
  std::string key;                // SET GET ADD COMPARE_SET DELETE APPEND_ON_CLOSE
  std::vector<std::string> keys;  // WAIT CHECK
  std::string value;              // SET APPEND_ON_CLOSE (the entry)
  std::string expected;           // COMPARE_SET
  std::string desired;            // COMPARE_SET
  int64_t delta = 0;              // ADD
  int64_t timeout_ms = -1;        // GET WAIT; -1 waits without a server-side limit
  std::string token;              // HELLO
  std::string client_name;        // HELLO
  int64_t rank = -1;              // HELLO
};

struct Response {
  Op op = Op::kHello;  // the request's op
  uint32_t id = 0;
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string message;  // empty when OK
  std::string value;    // GET COMPARE_SET
  int64_t number = 0;   // ADD NUM_KEYS
  bool flag = false;    // CHECK DELETE

  absl::Status status() const { return absl::Status(code, message); }
};

// Whole frames: header + payload.
std::string EncodeRequest(const Request& request);
std::string EncodeResponse(const Response& response);

// Decodes the first kHeaderBytes of `bytes` (more are ignored; fewer is InvalidArgument).
absl::StatusOr<FrameHeader> DecodeHeader(absl::string_view bytes, uint32_t max_payload_bytes);

// Decode a payload whose header `header` already passed DecodeHeader. `payload` must be exactly
// header.payload_bytes long. DecodeRequest refuses a response header and vice versa.
absl::StatusOr<Request> DecodeRequest(const FrameHeader& header, absl::string_view payload);
absl::StatusOr<Response> DecodeResponse(const FrameHeader& header, absl::string_view payload);

}  // namespace shardline::store_protocol

#endif  // SHARDLINE_COLLECTIVES_STORE_STORE_PROTOCOL_H_
