// File: scheduler/internal/json.h
// -----------------------------------------------------------------------------
// The small JSON reader and string quoting of the scheduler layer (a private header of
// scheduler/: the checkpoint manifest, the tuner's model descriptions). RFC 8259 with two
// restrictions that neither needs: numbers are integers (a fraction or an exponent is an error,
// not a rounding) within int64, and nesting is at most kMaxJsonDepth deep. Duplicate object keys
// are an error. Errors are InvalidArgument with the line and column.

#ifndef SHARDLINE_SCHEDULER_INTERNAL_JSON_H_
#define SHARDLINE_SCHEDULER_INTERNAL_JSON_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardline::scheduler_internal {

inline constexpr int kMaxJsonDepth = 64;

class JsonValue {
 public:
  enum class Kind : uint8_t { kNull, kBool, kInteger, kString, kArray, kObject };
  using Member = std::pair<std::string, JsonValue>;

  JsonValue() = default;
  static JsonValue Bool(bool b);
  static JsonValue Integer(int64_t v);
  static JsonValue String(std::string s);
  static JsonValue Array(std::vector<JsonValue> items);
  static JsonValue Object(std::vector<Member> members);

  Kind kind() const { return kind_; }
  bool boolean() const { return bool_; }
  int64_t integer() const { return integer_; }
  const std::string& string() const { return string_; }
  const std::vector<JsonValue>& items() const { return items_; }
  const std::vector<Member>& members() const { return members_; }
  // The member named `key` of an object, or null.
  const JsonValue* Find(absl::string_view key) const;

 private:
  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  int64_t integer_ = 0;
  std::string string_;
  std::vector<JsonValue> items_;
  std::vector<Member> members_;
};

// "null", "bool", "integer", "string", "array", "object".
absl::string_view JsonKindName(JsonValue::Kind kind);

// Parses one JSON value (surrounding whitespace allowed, nothing else after it).
absl::StatusOr<JsonValue> ParseJson(absl::string_view text);

// `s` as a JSON string literal, quotes included; control characters, '"' and '\' escaped,
// other bytes (UTF-8) as they are.
std::string JsonQuote(absl::string_view s);

}  // namespace shardline::scheduler_internal

#endif  // SHARDLINE_SCHEDULER_INTERNAL_JSON_H_
