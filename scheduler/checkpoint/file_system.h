// File: scheduler/checkpoint/file_system.h
// -----------------------------------------------------------------------------
// The file layer under checkpoints: every file operation a save or a load performs goes through a
// FileSystem, so that tests can record the order of writes, fsyncs and renames (which a killed
// process cannot show) and make the k-th operation fail (which a kill at that point leaves on
// disk: the same files, the same missing ones).
//
//   PosixFileSystem()        the real one (open/pwrite/fsync/renameat2/...), process-wide.
//   RecordingFileSystem      a decorator: logs every mutating operation, optionally failing
//                            every operation from index k on (a process killed before it), or
//                            raising SIGKILL right before operation k (a process killed there).
//
// Errors name the path and the errno text ("fsync 'ckpt.tmp-1f/shard-00001-of-00004.bin':
// No space left on device"); codes follow errno (ENOENT NotFound, EEXIST AlreadyExists, ENOSPC
// ResourceExhausted, EACCES PermissionDenied, others absl::ErrnoToStatusCode's mapping).
//
// Thread safety: a FileSystem may be used from several threads at once; one WritableFile or
// ReadableFile by one thread at a time.

#ifndef SHARDLINE_SCHEDULER_CHECKPOINT_FILE_SYSTEM_H_
#define SHARDLINE_SCHEDULER_CHECKPOINT_FILE_SYSTEM_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardline {

// A file opened for writing; bytes go at the end.
class WritableFile {
 public:
  virtual ~WritableFile() = default;
  // Appends data[0, size) (all of it; short writes are retried).
  virtual absl::Status Append(const void* data, size_t size) = 0;
  // fsync(2): the file's data and metadata are on stable storage when it returns OK.
  virtual absl::Status Sync() = 0;
  // Closes the file (a destructor without Close closes it and drops the error).
  virtual absl::Status Close() = 0;
};

// A file opened for reading at offsets.
class ReadableFile {
 public:
  virtual ~ReadableFile() = default;
  // The file's size when it was opened.
  virtual uint64_t size() const = 0;
  // Reads exactly `size` bytes at `offset` into `out`. DataLoss naming the file if it ends first.
  virtual absl::Status ReadAt(uint64_t offset, size_t size, void* out) = 0;
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  // mkdir(2) with mode 0755. AlreadyExists if `path` exists, NotFound if its parent does not.
  virtual absl::Status CreateDir(const std::string& path) = 0;
  // Creates a new file for writing (O_CREAT | O_EXCL, mode 0644): AlreadyExists if it exists.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> CreateFile(const std::string& path) = 0;
  // Opens an existing regular file for reading: NotFound if there is none, FailedPrecondition
  // naming what it is if it is not a regular file (a FIFO, a directory, a device). Never blocks
  // on what the path names (see OpenRegularFile).
  virtual absl::StatusOr<std::unique_ptr<ReadableFile>> OpenFile(const std::string& path) = 0;
  // Whether anything (file, directory, ...) exists at `path`.
  virtual absl::StatusOr<bool> Exists(const std::string& path) = 0;
  // Whether `path` is a directory (a symbolic link to one counts); false if nothing is there.
  virtual absl::StatusOr<bool> IsDirectory(const std::string& path) = 0;
  // Atomically renames `from` to `to`. AlreadyExists if `to` exists (where the file system can
  // refuse atomically: renameat2 RENAME_NOREPLACE; elsewhere plain rename(2), which replaces an
  // empty directory).
  virtual absl::Status Rename(const std::string& from, const std::string& to) = 0;
  // fsync(2) of a directory: its entries (created, renamed files) are on stable storage.
  virtual absl::Status SyncDir(const std::string& path) = 0;
};

// The operating system's file system. Lives for the whole process.
FileSystem& PosixFileSystem();

// A descriptor open for reading and the file's size.
struct OpenedFile {
  int fd = -1;
  uint64_t size = 0;
};
// open(2)s `path` read-only with O_NONBLOCK, so that a FIFO or a device in its place cannot
// block the call (a FIFO's open otherwise waits for a writer, forever), and refuses anything
// that is not a regular file: FailedPrecondition "open '<path>': not a regular file (it is a
// FIFO)". Errors of open(2) and fstat(2) as the file comment says. The caller closes the fd.
absl::StatusOr<OpenedFile> OpenRegularFile(const std::string& path);

// One mutating operation, as RecordingFileSystem logs it.
struct FileOperation {
  enum class Kind : uint8_t { kCreateDir, kCreateFile, kAppend, kSync, kClose, kRename, kSyncDir };
  Kind kind = Kind::kCreateDir;
  std::string path;  // the file or directory (for kRename: the source)
  std::string to;    // kRename: the destination
  size_t bytes = 0;  // kAppend: the bytes appended

  friend bool operator==(const FileOperation&, const FileOperation&) = default;
};
// "create_dir", "create_file", "append", "sync", "close", "rename", "sync_dir".
absl::string_view FileOperationKindName(FileOperation::Kind kind);
// "sync 'dir/file'", "rename 'a' -> 'b'", "append 'f' (12 bytes)".
std::string FileOperationToString(const FileOperation& op);
std::ostream& operator<<(std::ostream& os, const FileOperation& op);

// One ReadableFile::ReadAt, as RecordingFileSystem logs it.
struct FileRead {
  std::string path;
  uint64_t offset = 0;
  size_t bytes = 0;
};

// Forwards to `base` and logs every mutating operation (CreateDir, CreateFile, Append, Sync,
// Close, Rename, SyncDir); reads (ReadAt) go to a log of their own, and neither they, OpenFile
// nor Exists ever fail by injection. With FailFrom(k),
// the operation of index k (0-based, counted over this object's log) and every later one fail
// with Unavailable "injected failure at file operation k (<operation>)" without reaching `base`:
// the disk then holds what a process killed before operation k would have left. A failed
// Close still closes the underlying file.
class RecordingFileSystem : public FileSystem {
 public:
  explicit RecordingFileSystem(FileSystem& base = PosixFileSystem()) : base_(base) {}

  // k >= 0: operations from index k on fail; k < 0: none fails. Does not clear the log.
  void FailFrom(int64_t k);
  // k >= 0: right before the operation of index k reaches `base`, the process raises SIGKILL
  // (a real kill, for multi-process tests: SHARDLINE_CHECKPOINT_KILL_AT); k < 0: none. The log
  // (and the count) include that operation; nothing after it runs.
  void KillAt(int64_t k);
  // Every operation attempted so far, in order, the failed ones included; and their number.
  std::vector<FileOperation> operations() const;
  int64_t operation_count() const;
  // Every read so far, in order.
  std::vector<FileRead> reads() const;
  // Forgets both logs (the count restarts at 0), any FailFrom and any KillAt.
  void Reset();

  absl::Status CreateDir(const std::string& path) override;
  absl::StatusOr<std::unique_ptr<WritableFile>> CreateFile(const std::string& path) override;
  absl::StatusOr<std::unique_ptr<ReadableFile>> OpenFile(const std::string& path) override;
  absl::StatusOr<bool> Exists(const std::string& path) override;
  absl::StatusOr<bool> IsDirectory(const std::string& path) override;
  absl::Status Rename(const std::string& from, const std::string& to) override;
  absl::Status SyncDir(const std::string& path) override;

 private:
  class File;
  class ReadFile;
  // Logs `op`; returns the injected failure if its index is at or past the failure point.
  absl::Status Record(FileOperation op);

  FileSystem& base_;
  mutable std::mutex mu_;
  std::vector<FileOperation> log_;
  std::vector<FileRead> reads_;
  int64_t fail_from_ = -1;
  int64_t kill_at_ = -1;
};

}  // namespace shardline

#endif  // SHARDLINE_SCHEDULER_CHECKPOINT_FILE_SYSTEM_H_
