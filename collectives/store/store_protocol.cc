#include "collectives/store/store_protocol.h"

#include "absl/strings/str_cat.h"

namespace shardline::store_protocol {
namespace {

constexpr uint16_t kMaxOp = static_cast<uint16_t>(Op::kAppendOnClose);
constexpr uint32_t kMaxStatusCode = static_cast<uint32_t>(absl::StatusCode::kUnauthenticated);

bool KnownOp(uint16_t opcode) { return opcode >= 1 && opcode <= kMaxOp; }

// --- Encoding: explicit little-endian bytes, never a memcpy of a struct. ---

void PutU8(std::string* out, uint8_t v) { out->push_back(static_cast<char>(v)); }

void PutU16(std::string* out, uint16_t v) {
  for (int i = 0; i < 2; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void PutI64(std::string* out, int64_t v) {
  const uint64_t u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((u >> (8 * i)) & 0xff));
}

void PutBytes(std::string* out, absl::string_view bytes) {
  PutU32(out, static_cast<uint32_t>(bytes.size()));
  out->append(bytes.data(), bytes.size());
}

void PutKeys(std::string* out, const std::vector<std::string>& keys) {
  PutU32(out, static_cast<uint32_t>(keys.size()));
  for (const std::string& key : keys) PutBytes(out, key);
}

std::string Frame(Op op, bool response, uint32_t id, const std::string& payload) {
  std::string frame;
  frame.reserve(kHeaderBytes + payload.size());
  PutU32(&frame, kMagic);
  PutU16(&frame, kVersion);
  PutU16(&frame, static_cast<uint16_t>(static_cast<uint16_t>(op) | (response ? kResponseBit : 0)));
  PutU32(&frame, id);
  PutU32(&frame, static_cast<uint32_t>(payload.size()));
  frame += payload;
  return frame;
}

uint32_t LoadU32(const unsigned char* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

uint16_t LoadU16(const unsigned char* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// --- Decoding: a cursor over the payload that names the message and field in every error. ---

class Reader {
 public:
  Reader(absl::string_view what, absl::string_view payload) : what_(what), payload_(payload) {}

  absl::Status U8(absl::string_view field, uint8_t* v) {
    absl::string_view bytes;
    if (absl::Status s = Take(field, 1, &bytes); !s.ok()) return s;
    *v = static_cast<uint8_t>(bytes[0]);
    return absl::OkStatus();
  }

  absl::Status U32(absl::string_view field, uint32_t* v) {
    absl::string_view bytes;
    if (absl::Status s = Take(field, 4, &bytes); !s.ok()) return s;
    *v = LoadU32(reinterpret_cast<const unsigned char*>(bytes.data()));
    return absl::OkStatus();
  }

  absl::Status I64(absl::string_view field, int64_t* v) {
    absl::string_view bytes;
    if (absl::Status s = Take(field, 8, &bytes); !s.ok()) return s;
    const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
    uint64_t u = 0;
    for (int i = 7; i >= 0; --i) u = (u << 8) | p[i];
    *v = static_cast<int64_t>(u);
    return absl::OkStatus();
  }

  absl::Status Bytes(absl::string_view field, std::string* v) {
    uint32_t length = 0;
    if (absl::Status s = U32(field, &length); !s.ok()) return s;
    absl::string_view bytes;
    if (absl::Status s = Take(field, length, &bytes); !s.ok()) return s;
    v->assign(bytes.data(), bytes.size());
    return absl::OkStatus();
  }

  absl::Status Key(absl::string_view field, std::string* v) {
    const size_t offset = offset_;
    if (absl::Status s = Bytes(field, v); !s.ok()) return s;
    if (v->empty())
      return Error(absl::StrCat("field '", field, "' at offset ", offset, " is empty"));
    return absl::OkStatus();
  }

  absl::Status Keys(absl::string_view field, std::vector<std::string>* v) {
    uint32_t count = 0;
    if (absl::Status s = U32(field, &count); !s.ok()) return s;
    // Each key takes at least 5 bytes (length + one byte): a count the payload cannot hold is
    // refused before anything is reserved, so a forged count cannot make us allocate.
    if (count > (payload_.size() - offset_) / 5) {
      return Error(absl::StrCat("field '", field, "' claims ", count, " keys but only ",
                                payload_.size() - offset_, " bytes follow"));
    }
    v->clear();
    v->reserve(count);
    for (uint32_t i = 0; i < count; ++i) {
      std::string key;
      if (absl::Status s = Key(field, &key); !s.ok()) return s;
      v->push_back(std::move(key));
    }
    return absl::OkStatus();
  }

  absl::Status Finish() {
    if (offset_ != payload_.size()) {
      return Error(absl::StrCat(payload_.size() - offset_, " trailing bytes after the last field"));
    }
    return absl::OkStatus();
  }

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("malformed store ", what_, ": ", what));
  }

 private:
  absl::Status Take(absl::string_view field, size_t n, absl::string_view* out) {
    const size_t left = payload_.size() - offset_;
    if (n > left) {
      return Error(absl::StrCat("field '", field, "' truncated: needs ", n, " bytes at offset ",
                                offset_, ", ", left, " left"));
    }
    *out = payload_.substr(offset_, n);
    offset_ += n;
    return absl::OkStatus();
  }

  std::string what_;
  absl::string_view payload_;
  size_t offset_ = 0;
};

#define SL_PROTO_TRY(expr)                               \
  do {                                                   \
    ::absl::Status sl_proto_status_ = (expr);            \
    if (!sl_proto_status_.ok()) return sl_proto_status_; \
  } while (0)

bool HasValue(Op op) { return op == Op::kGet || op == Op::kCompareSet; }
bool HasNumber(Op op) { return op == Op::kAdd || op == Op::kNumKeys; }
bool HasFlag(Op op) { return op == Op::kCheck || op == Op::kDelete; }

}  // namespace

std::string OpName(uint16_t opcode) {
  switch (opcode) {
    case static_cast<uint16_t>(Op::kHello):
      return "HELLO";
    case static_cast<uint16_t>(Op::kSet):
      return "SET";
    case static_cast<uint16_t>(Op::kGet):
      return "GET";
    case static_cast<uint16_t>(Op::kAdd):
      return "ADD";
    case static_cast<uint16_t>(Op::kCompareSet):
      return "COMPARE_SET";
    case static_cast<uint16_t>(Op::kWait):
      return "WAIT";
    case static_cast<uint16_t>(Op::kCheck):
      return "CHECK";
    case static_cast<uint16_t>(Op::kDelete):
      return "DELETE";
    case static_cast<uint16_t>(Op::kNumKeys):
      return "NUM_KEYS";
    case static_cast<uint16_t>(Op::kAppendOnClose):
      return "APPEND_ON_CLOSE";
    default:
      return absl::StrCat("UNKNOWN(", opcode, ")");
  }
}

std::string EncodeRequest(const Request& r) {
  std::string p;
  switch (r.op) {
    case Op::kHello:
      PutBytes(&p, r.token);
      PutBytes(&p, r.client_name);
      PutI64(&p, r.rank);
      break;
    case Op::kSet:
      PutBytes(&p, r.key);
      PutBytes(&p, r.value);
      break;
    case Op::kGet:
      PutBytes(&p, r.key);
      PutI64(&p, r.timeout_ms);
      break;
    case Op::kAdd:
      PutBytes(&p, r.key);
      PutI64(&p, r.delta);
      break;
    case Op::kCompareSet:
      PutBytes(&p, r.key);
      PutBytes(&p, r.expected);
      PutBytes(&p, r.desired);
      break;
    case Op::kWait:
      PutKeys(&p, r.keys);
      PutI64(&p, r.timeout_ms);
      break;
    case Op::kCheck:
      PutKeys(&p, r.keys);
      break;
    case Op::kDelete:
      PutBytes(&p, r.key);
      break;
    case Op::kNumKeys:
      break;
    case Op::kAppendOnClose:
      PutBytes(&p, r.key);
      PutBytes(&p, r.value);
      break;
  }
  return Frame(r.op, /*response=*/false, r.id, p);
}

std::string EncodeResponse(const Response& r) {
  std::string p;
  PutU32(&p, static_cast<uint32_t>(r.code));
  // An error always carries a message (the decoder insists), an OK response never does.
  if (r.code == absl::StatusCode::kOk) {
    PutBytes(&p, absl::string_view());
  } else {
    PutBytes(&p, r.message.empty() ? absl::string_view("error without a message") : r.message);
  }
  if (r.code == absl::StatusCode::kOk) {
    if (HasValue(r.op)) PutBytes(&p, r.value);
    if (HasNumber(r.op)) PutI64(&p, r.number);
    if (HasFlag(r.op)) PutU8(&p, r.flag ? 1 : 0);
  }
  return Frame(r.op, /*response=*/true, r.id, p);
}

absl::StatusOr<FrameHeader> DecodeHeader(absl::string_view bytes, uint32_t max_payload_bytes) {
  if (bytes.size() < kHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("malformed store frame: header truncated (",
                                                   bytes.size(), " of ", kHeaderBytes, " bytes)"));
  }
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const uint32_t magic = LoadU32(p);
  if (magic != kMagic) {
    return absl::InvalidArgumentError(absl::StrCat(
        "malformed store frame: bad magic 0x", absl::Hex(magic, absl::kZeroPad8), " (expected 0x",
        absl::Hex(kMagic, absl::kZeroPad8), "; not a shardline store peer?)"));
  }
  FrameHeader header;
  header.version = LoadU16(p + 4);
  if (header.version != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("store protocol version ", header.version,
                                                   " from the peer, this build speaks version ",
                                                   kVersion, " (mixed shardline builds?)"));
  }
  const uint16_t opcode = LoadU16(p + 6);
  header.is_response = (opcode & kResponseBit) != 0;
  const uint16_t base = opcode & static_cast<uint16_t>(~kResponseBit);
  if (!KnownOp(base)) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed store frame: unknown opcode 0x", absl::Hex(opcode)));
  }
  header.op = static_cast<Op>(base);
  header.request_id = LoadU32(p + 8);
  header.payload_bytes = LoadU32(p + 12);
  if (header.payload_bytes > max_payload_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("store ", OpName(base), header.is_response ? " response" : "", " of ",
                     header.payload_bytes, " bytes exceeds the maximum message size of ",
                     max_payload_bytes, " bytes (SHARDLINE_STORE_MAX_MESSAGE_BYTES)"));
  }
  return header;
}

absl::StatusOr<Request> DecodeRequest(const FrameHeader& header, absl::string_view payload) {
  const std::string what = absl::StrCat(OpName(static_cast<uint16_t>(header.op)), " request");
  if (header.is_response) {
    return absl::InvalidArgumentError(absl::StrCat("store peer sent a ",
                                                   OpName(static_cast<uint16_t>(header.op)),
                                                   " response where a request was expected"));
  }
  Reader in(what, payload);
  if (payload.size() != header.payload_bytes) {
    return in.Error(
        absl::StrCat("payload is ", payload.size(), " bytes, header says ", header.payload_bytes));
  }
  Request r;
  r.op = header.op;
  r.id = header.request_id;
  switch (r.op) {
    case Op::kHello:
      SL_PROTO_TRY(in.Bytes("token", &r.token));
      SL_PROTO_TRY(in.Bytes("client name", &r.client_name));
      SL_PROTO_TRY(in.I64("rank", &r.rank));
      break;
    case Op::kSet:
      SL_PROTO_TRY(in.Key("key", &r.key));
      SL_PROTO_TRY(in.Bytes("value", &r.value));
      break;
    case Op::kGet:
      SL_PROTO_TRY(in.Key("key", &r.key));
      SL_PROTO_TRY(in.I64("timeout", &r.timeout_ms));
      break;
    case Op::kAdd:
      SL_PROTO_TRY(in.Key("key", &r.key));
      SL_PROTO_TRY(in.I64("delta", &r.delta));
      break;
    case Op::kCompareSet:
      SL_PROTO_TRY(in.Key("key", &r.key));
      SL_PROTO_TRY(in.Bytes("expected", &r.expected));
      SL_PROTO_TRY(in.Bytes("desired", &r.desired));
      break;
    case Op::kWait:
      SL_PROTO_TRY(in.Keys("keys", &r.keys));
      SL_PROTO_TRY(in.I64("timeout", &r.timeout_ms));
      break;
    case Op::kCheck:
      SL_PROTO_TRY(in.Keys("keys", &r.keys));
      break;
    case Op::kDelete:
      SL_PROTO_TRY(in.Key("key", &r.key));
      break;
    case Op::kNumKeys:
      break;
    case Op::kAppendOnClose:
      SL_PROTO_TRY(in.Key("log key", &r.key));
      SL_PROTO_TRY(in.Bytes("entry", &r.value));
      break;
  }
  if ((r.op == Op::kGet || r.op == Op::kWait) && r.timeout_ms < -1) {
    return in.Error(absl::StrCat("timeout ", r.timeout_ms, " ms is negative"));
  }
  SL_PROTO_TRY(in.Finish());
  return r;
}

absl::StatusOr<Response> DecodeResponse(const FrameHeader& header, absl::string_view payload) {
  const std::string what = absl::StrCat(OpName(static_cast<uint16_t>(header.op)), " response");
  if (!header.is_response) {
    return absl::InvalidArgumentError(absl::StrCat("store peer sent a ",
                                                   OpName(static_cast<uint16_t>(header.op)),
                                                   " request where a response was expected"));
  }
  Reader in(what, payload);
  if (payload.size() != header.payload_bytes) {
    return in.Error(
        absl::StrCat("payload is ", payload.size(), " bytes, header says ", header.payload_bytes));
  }
  Response r;
  r.op = header.op;
  r.id = header.request_id;
  uint32_t code = 0;
  SL_PROTO_TRY(in.U32("status code", &code));
  if (code > kMaxStatusCode) return in.Error(absl::StrCat("unknown status code ", code));
  r.code = static_cast<absl::StatusCode>(code);
  SL_PROTO_TRY(in.Bytes("message", &r.message));
  if (r.code == absl::StatusCode::kOk) {
    if (!r.message.empty()) return in.Error("an OK response carries an error message");
    if (HasValue(r.op)) SL_PROTO_TRY(in.Bytes("value", &r.value));
    if (HasNumber(r.op)) SL_PROTO_TRY(in.I64("number", &r.number));
    if (HasFlag(r.op)) {
      uint8_t flag = 0;
      SL_PROTO_TRY(in.U8("flag", &flag));
      if (flag > 1)
        return in.Error(absl::StrCat("flag byte ", static_cast<int>(flag), " is not 0 or 1"));
      r.flag = flag == 1;
    }
  } else if (r.message.empty()) {
    return in.Error("an error response carries no message");
  }
  SL_PROTO_TRY(in.Finish());
  return r;
}

#undef SL_PROTO_TRY

}  // namespace shardline::store_protocol
