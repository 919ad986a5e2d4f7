// File: scheduler/checkpoint/safetensors.h
// -----------------------------------------------------------------------------
// The safetensors file format (the full-weight format inference stacks load), read and written
// without loading a file into memory: a reader that memory-maps a file and checks its header
// strictly, and a writer that streams tensors through a FileSystem and publishes the file
// atomically. scheduler/checkpoint/full_weights.h uses both for a Scheduler's units.
//
// The format: an unsigned 64-bit little-endian N, then N bytes of UTF-8 JSON (the header), then
// the data. The header is one object: per tensor, "<name>": {"dtype": "F32", "shape": [2, 3],
// "data_offsets": [begin, end]}, offsets in bytes relative to the first data byte, elements
// row-major and little-endian; and optionally "__metadata__": an object of string values.
//
// What the reader accepts (anything else is an error naming the file and, where there is one, the
// tensor):
//   DataLoss         the file is shorter than 8 bytes, than 8 + N, or than the data the header
//                    describes (truncated); bytes after the last tensor's data (extended)
//   InvalidArgument  N above kMaxSafetensorsHeaderBytes; malformed JSON; a duplicate name; a
//                    tensor entry without exactly the members dtype, shape, data_offsets, of the
//                    right types; an unknown dtype name; a negative dimension; end < begin; a
//                    byte count other than numel x dtype size; two tensors whose bytes overlap,
//                    or bytes between tensors that belong to none (the format has no holes); a
//                    "__metadata__" that is not an object of strings
// as the reference implementation (huggingface/safetensors) does. The writer pads the header with
// spaces to a multiple of 8 bytes (so that the data is 8-byte aligned, as that implementation
// also does) and writes the tensors back to back in the order given.

#ifndef SHARDLINE_SCHEDULER_CHECKPOINT_SAFETENSORS_H_
#define SHARDLINE_SCHEDULER_CHECKPOINT_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "runtime/dtype.h"
#include "scheduler/checkpoint/file_system.h"

namespace shardline {

// The reference implementation's limit on the header (bytes).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;
// The name of the header's metadata member.
inline constexpr absl::string_view kSafetensorsMetadataKey = "__metadata__";

// The element types of the format that have a whole number of bytes per element.
enum class SafetensorsDType : uint8_t {
  kBool,
  kU8,
  kI8,
  kF8E5M2,
  kF8E4M3,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64,
};

// "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
// "F64", "I64", "U64".
absl::string_view SafetensorsDTypeName(SafetensorsDType dtype);
size_t SafetensorsDTypeSize(SafetensorsDType dtype);
// One of the names above (case-sensitive, as the format spells them). InvalidArgument otherwise.
absl::StatusOr<SafetensorsDType> ParseSafetensorsDType(absl::string_view name);
// The format's name for a shardline dtype (f32 -> F32, bf16 -> BF16, ...).
SafetensorsDType ToSafetensorsDType(DType dtype);
// The shardline dtype of a format dtype, if there is one (nullopt for BOOL, F8_*, I16, U16, U32,
// U64).
std::optional<DType> FromSafetensorsDType(SafetensorsDType dtype);

// One tensor of a header.
struct SafetensorsTensor {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<int64_t> shape;  // {} for a scalar
  uint64_t begin = 0;          // data_offsets, relative to the first data byte
  uint64_t end = 0;

  uint64_t numel() const;
  uint64_t bytes() const { return end - begin; }
};

struct SafetensorsHeader {
  // In the order of their data (by begin); ties in begin (empty tensors) by name.
  std::vector<SafetensorsTensor> tensors;
  // "__metadata__", in the header's order; empty if there is none.
  std::vector<std::pair<std::string, std::string>> metadata;
  // N, and the data's size (the sum of the tensors' bytes).
  uint64_t header_bytes = 0;
  uint64_t data_bytes = 0;

  // The byte at which the data begins in the file: 8 + header_bytes.
  uint64_t data_offset() const { return 8 + header_bytes; }
  // The tensor named `name`, or null. O(log n) after the header was parsed or built.
  const SafetensorsTensor* Find(absl::string_view name) const;

  std::vector<size_t> by_name;  // indices into tensors, sorted by name (for Find)
};

// Parses the header's JSON text and checks it against a data section of `data_bytes` bytes (the
// file's size - 8 - N). Errors as listed above, naming the tensor but not the file.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view json,
                                                         uint64_t data_bytes);

// A tensor to write: its name, dtype and shape (the writer assigns the offsets).
struct SafetensorsTensorInfo {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<int64_t> shape;
};

// The 8-byte length and the header text for `tensors` laid out back to back in the given order,
// padded with spaces to a multiple of 8 bytes, with `metadata` as "__metadata__" (omitted when
// empty); and the header it describes. InvalidArgument for an empty or duplicate name, the name
// "__metadata__", a negative dimension, a duplicate metadata key, or sizes that overflow.
absl::StatusOr<std::pair<std::string, SafetensorsHeader>> MakeSafetensorsHeader(
    const std::vector<SafetensorsTensorInfo>& tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata);

// A safetensors file, memory-mapped read-only: the data is read from the page cache (or the
// disk) only where a caller touches it, so processes that map the same file share its pages and
// none copies the whole file.
class SafetensorsFile {
 public:
  // Opens, maps and checks the file. NotFound if it does not exist; the reader's errors above,
  // every one prefixed with "safetensors file '<path>': ".
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  uint64_t file_bytes() const { return size_; }
  // The bytes of `tensor` (one of header().tensors), in the mapping.
  absl::string_view Data(const SafetensorsTensor& tensor) const;

 private:
  SafetensorsFile(std::string path, const char* base, uint64_t size, SafetensorsHeader header)
      : path_(std::move(path)), base_(base), size_(size), header_(std::move(header)) {}

  std::string path_;
  const char* base_ = nullptr;  // the mapping (null for an empty file)
  uint64_t size_ = 0;
  SafetensorsHeader header_;
};

// Writes one safetensors file through a FileSystem, atomically: Create writes the header into
// "<path>.tmp-<16 hex digits>" beside `path`, Append takes the data, Finish fsyncs and closes
// the temporary file, renames it to `path` (never replacing a file) and fsyncs the directory.
// Until Finish returns OK, `path` does not exist; a writer destroyed (or a process killed) before
// leaves the temporary file, which a reader may delete. Nothing is ever deleted by the writer.
class SafetensorsWriter {
 public:
  // AlreadyExists if `path` exists; MakeSafetensorsHeader's and the file system's errors.
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      FileSystem& fs, const std::string& path, const std::vector<SafetensorsTensorInfo>& tensors,
      const std::vector<std::pair<std::string, std::string>>& metadata);

  // The next `size` bytes of data: the tensors' bytes in header order, in pieces of any size.
  // InvalidArgument if that goes beyond the header's data size.
  absl::Status Append(const void* data, size_t size);
  // FailedPrecondition (naming the tensor being written) unless every data byte was appended;
  // then the file system's errors of the fsyncs and the rename.
  absl::Status Finish();

  const SafetensorsHeader& header() const { return header_; }
  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }
  // Data bytes appended so far.
  uint64_t written() const { return written_; }

 private:
  SafetensorsWriter(FileSystem& fs, std::string path, std::string temp_path,
                    std::unique_ptr<WritableFile> file, SafetensorsHeader header)
      : fs_(fs),
        path_(std::move(path)),
        temp_path_(std::move(temp_path)),
        file_(std::move(file)),
        header_(std::move(header)) {}

  FileSystem& fs_;
  std::string path_;
  std::string temp_path_;
  std::unique_ptr<WritableFile> file_;
  SafetensorsHeader header_;
  uint64_t written_ = 0;
  bool finished_ = false;
};

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_CHECKPOINT_SAFETENSORS_H_
