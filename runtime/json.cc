// A recursive-descent JSON reader (runtime/json.h). Recursion is bounded by
// kMaxJsonDepth, so hostile input cannot exhaust the stack; every read checks the end first.

#include "runtime/json.h"

#include <charconv>
#include <cmath>
#include <limits>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "runtime/check.h"

namespace shardline {

JsonValue JsonValue::Bool(bool b) {
  JsonValue v;
  v.kind_ = Kind::kBool;
  v.bool_ = b;
  return v;
}
JsonValue JsonValue::Integer(int64_t i) {
  JsonValue v;
  v.kind_ = Kind::kInteger;
  v.integer_ = i;
  return v;
}
JsonValue JsonValue::Number(double d) {
  JsonValue v;
  v.kind_ = Kind::kNumber;
  v.number_ = d;
  return v;
}
JsonValue JsonValue::String(std::string s) {
  JsonValue v;
  v.kind_ = Kind::kString;
  v.string_ = std::move(s);
  return v;
}
JsonValue JsonValue::Array(std::vector<JsonValue> items) {
  JsonValue v;
  v.kind_ = Kind::kArray;
  v.items_ = std::move(items);
  return v;
}
JsonValue JsonValue::Object(std::vector<Member> members) {
  JsonValue v;
  v.kind_ = Kind::kObject;
  v.members_ = std::move(members);
  return v;
}

const JsonValue* JsonValue::Find(absl::string_view key) const {
  for (const Member& m : members_) {
    if (m.first == key) return &m.second;
  }
  return nullptr;
}

absl::string_view JsonKindName(JsonValue::Kind kind) {
  switch (kind) {
    case JsonValue::Kind::kNull:
      return "null";
    case JsonValue::Kind::kBool:
      return "bool";
    case JsonValue::Kind::kInteger:
      return "integer";
    case JsonValue::Kind::kNumber:
      return "number";
    case JsonValue::Kind::kString:
      return "string";
    case JsonValue::Kind::kArray:
      return "array";
    case JsonValue::Kind::kObject:
      return "object";
  }
  return "?";
}

namespace {

class Parser {
 public:
  explicit Parser(absl::string_view text) : text_(text) {}

  absl::StatusOr<JsonValue> Document() {
    JsonValue v;
    absl::Status s = Value(0, &v);
    if (!s.ok()) return s;
    SkipSpace();
    if (pos_ != text_.size()) return Error("unexpected text after the value");
    return v;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    int line = 1, column = 1;
    for (size_t i = 0; i < pos_ && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat("JSON line ", line, " column ", column, ": ", what));
  }

  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  bool Consume(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  absl::Status Value(int depth, JsonValue* out) {
    if (depth > kMaxJsonDepth) return Error(absl::StrCat("nested deeper than ", kMaxJsonDepth));
    SkipSpace();
    if (pos_ >= text_.size()) return Error("unexpected end of input, expected a value");
    const char c = text_[pos_];
    if (c == '{') return Object(depth, out);
    if (c == '[') return Array(depth, out);
    if (c == '"') {
      std::string s;
      absl::Status st = String(&s);
      if (!st.ok()) return st;
      *out = JsonValue::String(std::move(s));
      return absl::OkStatus();
    }
    if (c == '-' || (c >= '0' && c <= '9')) return Number(out);
    if (Consume("true")) {
      *out = JsonValue::Bool(true);
      return absl::OkStatus();
    }
    if (Consume("false")) {
      *out = JsonValue::Bool(false);
      return absl::OkStatus();
    }
    if (Consume("null")) {
      *out = JsonValue();
      return absl::OkStatus();
    }
    return Error(absl::StrCat("unexpected character '", absl::string_view(&c, 1), "'"));
  }

  absl::Status Object(int depth, JsonValue* out) {
    ++pos_;  // '{'
    std::vector<JsonValue::Member> members;
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == '}') {
      ++pos_;
      *out = JsonValue::Object(std::move(members));
      return absl::OkStatus();
    }
    while (true) {
      SkipSpace();
      if (pos_ >= text_.size() || text_[pos_] != '"') return Error("expected a member name");
      std::string key;
      absl::Status s = String(&key);
      if (!s.ok()) return s;
      for (const JsonValue::Member& m : members) {
        if (m.first == key) return Error(absl::StrCat("duplicate member \"", key, "\""));
      }
      SkipSpace();
      if (pos_ >= text_.size() || text_[pos_] != ':') return Error("expected ':'");
      ++pos_;
      JsonValue v;
      s = Value(depth + 1, &v);
      if (!s.ok()) return s;
      members.emplace_back(std::move(key), std::move(v));
      SkipSpace();
      if (pos_ < text_.size() && text_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < text_.size() && text_[pos_] == '}') {
        ++pos_;
        *out = JsonValue::Object(std::move(members));
        return absl::OkStatus();
      }
      return Error("expected ',' or '}'");
    }
  }

  absl::Status Array(int depth, JsonValue* out) {
    ++pos_;  // '['
    std::vector<JsonValue> items;
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == ']') {
      ++pos_;
      *out = JsonValue::Array(std::move(items));
      return absl::OkStatus();
    }
    while (true) {
      JsonValue v;
      absl::Status s = Value(depth + 1, &v);
      if (!s.ok()) return s;
      items.push_back(std::move(v));
      SkipSpace();
      if (pos_ < text_.size() && text_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < text_.size() && text_[pos_] == ']') {
        ++pos_;
        *out = JsonValue::Array(std::move(items));
        return absl::OkStatus();
      }
      return Error("expected ',' or ']'");
    }
  }

  absl::Status Number(JsonValue* out) {
    const size_t start = pos_;
    bool negative = false;
    if (text_[pos_] == '-') {
      negative = true;
      ++pos_;
    }
    if (pos_ >= text_.size() || text_[pos_] < '0' || text_[pos_] > '9') {
      return Error("expected a digit");
    }
    if (text_[pos_] == '0' && pos_ + 1 < text_.size() && text_[pos_ + 1] >= '0' &&
        text_[pos_ + 1] <= '9') {
      return Error("a number must not have leading zeros");
    }
    size_t end = pos_;
    while (end < text_.size() && text_[end] >= '0' && text_[end] <= '9') ++end;
    if (end < text_.size() && (text_[end] == '.' || text_[end] == 'e' || text_[end] == 'E')) {
      pos_ = end;
      return Fraction(start, out);
    }
    // Accumulate negatively: INT64_MIN has no positive counterpart.
    int64_t value = 0;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
      const int digit = text_[pos_] - '0';
      if (value < (std::numeric_limits<int64_t>::min() + digit) / 10) {
        pos_ = start;
        return Error("integer out of the 64-bit range");
      }
      value = value * 10 - digit;
      ++pos_;
    }
    if (!negative) {
      if (value == std::numeric_limits<int64_t>::min()) {
        pos_ = start;
        return Error("integer out of the 64-bit range");
      }
      value = -value;
    }
    *out = JsonValue::Integer(value);
    return absl::OkStatus();
  }

  // The rest of a number that has a fraction or an exponent; `start` is its first character.
  absl::Status Fraction(size_t start, JsonValue* out) {
    auto digits = [&] {
      const size_t from = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      return pos_ > from;
    };
    if (text_[pos_] == '.') {
      ++pos_;
      if (!digits()) return Error("expected a digit after the decimal point");
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      if (!digits()) return Error("expected a digit in the exponent");
    }
    double value = 0;
    const char* first = text_.data() + start;
    const char* last = text_.data() + pos_;
    const std::from_chars_result r = std::from_chars(first, last, value);
    if (r.ec == std::errc::result_out_of_range && Underflows(text_.substr(start, pos_ - start))) {
      value = text_[start] == '-' ? -0.0 : 0.0;  // the nearest double is (signed) zero
    } else if (r.ec != std::errc() || r.ptr != last || !std::isfinite(value)) {
      pos_ = start;
      return Error("number out of the double range");
    }
    *out = JsonValue::Number(value);
    return absl::OkStatus();
  }

  // Whether a number that from_chars found out of range is too small (not too large): it has a
  // negative exponent, or no exponent and only zeros before the point.
  static bool Underflows(absl::string_view number) {
    const size_t e = number.find_first_of("eE");
    if (e != absl::string_view::npos) return number.substr(e + 1, 1) == "-";
    const size_t digit = number.find_first_of("123456789");
    return digit != absl::string_view::npos && digit > number.find('.');
  }

  absl::Status Hex4(uint32_t* out) {
    if (text_.size() - pos_ < 4) return Error("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = text_[pos_++];
      v <<= 4;
      if (h >= '0' && h <= '9') {
        v |= static_cast<uint32_t>(h - '0');
      } else if (h >= 'a' && h <= 'f') {
        v |= static_cast<uint32_t>(h - 'a' + 10);
      } else if (h >= 'A' && h <= 'F') {
        v |= static_cast<uint32_t>(h - 'A' + 10);
      } else {
        return Error("bad hex digit in \\u escape");
      }
    }
    *out = v;
    return absl::OkStatus();
  }

  static void AppendUtf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  absl::Status String(std::string* out) {
    ++pos_;  // '"'
    while (true) {
      if (pos_ >= text_.size()) return Error("unterminated string");
      const char c = text_[pos_];
      if (c == '"') {
        ++pos_;
        return absl::OkStatus();
      }
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in a string");
      if (c != '\\') {
        out->push_back(c);
        ++pos_;
        continue;
      }
      ++pos_;
      if (pos_ >= text_.size()) return Error("unterminated escape");
      const char e = text_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out->push_back(e);
          break;
        case 'b':
          out->push_back('\b');
          break;
        case 'f':
          out->push_back('\f');
          break;
        case 'n':
          out->push_back('\n');
          break;
        case 'r':
          out->push_back('\r');
          break;
        case 't':
          out->push_back('\t');
          break;
        case 'u': {
          uint32_t cp = 0;
          absl::Status s = Hex4(&cp);
          if (!s.ok()) return s;
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            uint32_t low = 0;
            if (!Consume("\\u")) return Error("unpaired high surrogate");
            s = Hex4(&low);
            if (!s.ok()) return s;
            if (low < 0xDC00 || low > 0xDFFF) return Error("unpaired high surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return Error("unpaired low surrogate");
          }
          AppendUtf8(cp, out);
          break;
        }
        default:
          return Error(absl::StrCat("bad escape '\\", absl::string_view(&e, 1), "'"));
      }
    }
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

}  // namespace

absl::StatusOr<JsonValue> ParseJson(absl::string_view text) { return Parser(text).Document(); }

std::string JsonQuote(absl::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (u < 0x20) {
      out += "\\u00";
      out.push_back(kHex[u >> 4]);
      out.push_back(kHex[u & 0xF]);
    } else {
      out.push_back(c);
    }
  }
  out.push_back('"');
  return out;
}

std::string JsonNumber(double v) {
  SL_CHECK(std::isfinite(v)) << "JsonNumber of a non-finite value";
  char buf[64];
  // The shortest form reads back as the same double. A form without a point or an exponent reads
  // back as an integer (number() accepts it), so beyond int64 the exponent form is taken.
  const std::to_chars_result r =
      std::fabs(v) < 9e18 ? std::to_chars(buf, buf + sizeof(buf), v)
                          : std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  SL_CHECK(r.ec == std::errc());
  return std::string(buf, r.ptr);
}

}  // namespace shardline
