// File: runtime/device.h
// -----------------------------------------------------------------------------
// Where a buffer lives and where a stream runs: the host, or CUDA device N.
// Printed and parsed as "host" (also "cpu") and "cuda:N" ("cuda" alone means cuda:0).

#ifndef SHARDLINE_RUNTIME_DEVICE_H_
#define SHARDLINE_RUNTIME_DEVICE_H_

#include <ostream>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace shardline {

class Device {
 public:
  enum class Kind : uint8_t { kHost, kCuda };

  constexpr Device() = default;
  static constexpr Device Host() { return Device(Kind::kHost, 0); }
  static constexpr Device Cuda(int index) { return Device(Kind::kCuda, index); }

  // InvalidArgument naming the text if it is neither "host"/"cpu" nor "cuda[:N]" with N >= 0.
  static absl::StatusOr<Device> Parse(absl::string_view text);

  constexpr Kind kind() const { return kind_; }
  // The CUDA ordinal; 0 for the host.
  constexpr int index() const { return index_; }
  constexpr bool is_host() const { return kind_ == Kind::kHost; }
  constexpr bool is_cuda() const { return kind_ == Kind::kCuda; }

  std::string ToString() const;

  friend constexpr bool operator==(const Device&, const Device&) = default;

 private:
  constexpr Device(Kind kind, int index) : kind_(kind), index_(index) {}

  Kind kind_ = Kind::kHost;
  int index_ = 0;
};

std::ostream& operator<<(std::ostream& os, const Device& device);

}  // namespace shardline

#endif  // SHARDLINE_RUNTIME_DEVICE_H_
