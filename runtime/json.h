// File: runtime/json.h
// -----------------------------------------------------------------------------
// A small JSON reader, string quoting and number formatting: for the checkpoint manifest
// (scheduler/checkpoint/) and the sim backend's topology files (collectives/sim/topology.h).
// RFC 8259, with nesting at most kMaxJsonDepth deep; duplicate object keys are an error. Numbers
// keep their form: one without a fraction or an exponent is an integer (kInteger, exact within
// int64: outside it is an error, not a rounding); one with them is a number (kNumber, the
// nearest double; out of the double range is an error). Readers that want integers check the
// kind; readers of measurements take number(), which accepts both. Errors are InvalidArgument
// with the line and column.

#ifndef SHARDLINE_RUNTIME_JSON_H_
#define SHARDLINE_RUNTIME_JSON_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardline {

inline constexpr int kMaxJsonDepth = 64;

class JsonValue {
 public:
  enum class Kind : uint8_t { kNull, kBool, kInteger, kNumber, kString, kArray, kObject };
  using Member = std::pair<std::string, JsonValue>;

  JsonValue() = default;
  static JsonValue Bool(bool b);
  static JsonValue Integer(int64_t v);
  static JsonValue Number(double v);
  static JsonValue String(std::string s);
  static JsonValue Array(std::vector<JsonValue> items);
  static JsonValue Object(std::vector<Member> members);

  Kind kind() const { return kind_; }
  bool boolean() const { return bool_; }
  int64_t integer() const { return integer_; }
  // A kNumber's value, or a kInteger's converted to double (0 for other kinds).
  double number() const { return kind_ == Kind::kNumber ? number_ : static_cast<double>(integer_); }
  // kInteger or kNumber.
  bool is_number() const { return kind_ == Kind::kInteger || kind_ == Kind::kNumber; }
  const std::string& string() const { return string_; }
  const std::vector<JsonValue>& items() const { return items_; }
  const std::vector<Member>& members() const { return members_; }
  // The member named `key` of an object, or null.
  const JsonValue* Find(absl::string_view key) const;

 private:
  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  int64_t integer_ = 0;
  double number_ = 0;
  std::string string_;
  std::vector<JsonValue> items_;
  std::vector<Member> members_;
};

// "null", "bool", "integer", "number", "string", "array", "object".
absl::string_view JsonKindName(JsonValue::Kind kind);

// Parses one JSON value (surrounding whitespace allowed, nothing else after it).
absl::StatusOr<JsonValue> ParseJson(absl::string_view text);

// `s` as a JSON string literal, quotes included; control characters, '"' and '\' escaped,
// other bytes (UTF-8) as they are.
std::string JsonQuote(absl::string_view s);

// `v` as a JSON number: the shortest text that reads back as the same double ("0.5", "3.7e+11",
// "1e-06"). `v` must be finite (checked).
std::string JsonNumber(double v);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_JSON_H_
