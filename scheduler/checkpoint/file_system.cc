// PosixFileSystem and RecordingFileSystem (scheduler/checkpoint/file_system.h).

#include "scheduler/checkpoint/file_system.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"

namespace shardline {
namespace {

absl::Status ErrnoError(int error, absl::string_view what, absl::string_view path) {
  return absl::Status(absl::ErrnoToStatusCode(error),
                      absl::StrCat(what, " '", path, "': ", std::strerror(error)));
}

// "a FIFO", "a directory", ...: what a path that should be a regular file is instead.
absl::string_view FileTypeName(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "a special file";
}

class PosixWritableFile : public WritableFile {
 public:
  PosixWritableFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
  }

  absl::Status Append(const void* data, size_t size) override {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = ::write(fd_, p, size);
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoError(errno, "write", path_);
      }
      p += n;
      size -= static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  absl::Status Sync() override {
    while (::fsync(fd_) != 0) {
      if (errno != EINTR) return ErrnoError(errno, "fsync", path_);
    }
    return absl::OkStatus();
  }

  absl::Status Close() override {
    const int fd = fd_;
    fd_ = -1;
    // close(2) must not be retried on EINTR (Linux frees the descriptor either way).
    if (fd >= 0 && ::close(fd) != 0 && errno != EINTR) return ErrnoError(errno, "close", path_);
    return absl::OkStatus();
  }

 private:
  int fd_;
  std::string path_;
};

class PosixReadableFile : public ReadableFile {
 public:
  PosixReadableFile(int fd, uint64_t size, std::string path)
      : fd_(fd), size_(size), path_(std::move(path)) {}
  ~PosixReadableFile() override { ::close(fd_); }

  uint64_t size() const override { return size_; }

  absl::Status ReadAt(uint64_t offset, size_t size, void* out) override {
    char* p = static_cast<char*>(out);
    while (size > 0) {
      const ssize_t n = ::pread(fd_, p, size, static_cast<off_t>(offset));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoError(errno, "read", path_);
      }
      if (n == 0) {
        return absl::DataLossError(absl::StrCat("read '", path_, "': the file ends at byte ",
                                                offset, ", ", size, " bytes short"));
      }
      p += n;
      offset += static_cast<uint64_t>(n);
      size -= static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

 private:
  int fd_;
  uint64_t size_;
  std::string path_;
};

class PosixFileSystemImpl : public FileSystem {
 public:
  absl::Status CreateDir(const std::string& path) override {
    if (::mkdir(path.c_str(), 0755) != 0) return ErrnoError(errno, "mkdir", path);
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<WritableFile>> CreateFile(const std::string& path) override {
    int fd;
    do {
      fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return ErrnoError(errno, "create", path);
    return std::make_unique<PosixWritableFile>(fd, path);
  }

  absl::StatusOr<std::unique_ptr<ReadableFile>> OpenFile(const std::string& path) override {
    SL_ASSIGN_OR_RETURN(const OpenedFile file, OpenRegularFile(path));
    return std::make_unique<PosixReadableFile>(file.fd, file.size, path);
  }

  absl::StatusOr<bool> Exists(const std::string& path) override {
    struct stat st;
    if (::lstat(path.c_str(), &st) == 0) return true;
    if (errno == ENOENT || errno == ENOTDIR) return false;
    return ErrnoError(errno, "stat", path);
  }

  absl::StatusOr<bool> IsDirectory(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) == 0) return S_ISDIR(st.st_mode);
    if (errno == ENOENT || errno == ENOTDIR) return false;
    return ErrnoError(errno, "stat", path);
  }

  absl::Status Rename(const std::string& from, const std::string& to) override {
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) {
      return absl::OkStatus();
    }
    // File systems without RENAME_NOREPLACE (some network ones) answer EINVAL: plain rename.
    if (errno == EINVAL && ::rename(from.c_str(), to.c_str()) == 0) return absl::OkStatus();
    return ErrnoError(errno, "rename", absl::StrCat(from, "' -> '", to));
  }

  absl::Status SyncDir(const std::string& path) override {
    int fd;
    do {
      fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return ErrnoError(errno, "open directory", path);
    absl::Status status;
    while (::fsync(fd) != 0) {
      if (errno != EINTR) {
        status = ErrnoError(errno, "fsync directory", path);
        break;
      }
    }
    ::close(fd);
    return status;
  }
};

}  // namespace

absl::StatusOr<OpenedFile> OpenRegularFile(const std::string& path) {
  int fd;
  // O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer, forever. It changes
  // nothing for a regular file (reads from disk never return EAGAIN).
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return ErrnoError(errno, "open", path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    return ErrnoError(error, "stat", path);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "open '", path, "': not a regular file (it is ", FileTypeName(st.st_mode), ")"));
  }
  return OpenedFile{.fd = fd, .size = static_cast<uint64_t>(st.st_size)};
}

FileSystem& PosixFileSystem() {
  static PosixFileSystemImpl* fs = new PosixFileSystemImpl();
  return *fs;
}

absl::string_view FileOperationKindName(FileOperation::Kind kind) {
  switch (kind) {
    case FileOperation::Kind::kCreateDir:
      return "create_dir";
    case FileOperation::Kind::kCreateFile:
      return "create_file";
    case FileOperation::Kind::kAppend:
      return "append";
    case FileOperation::Kind::kSync:
      return "sync";
    case FileOperation::Kind::kClose:
      return "close";
    case FileOperation::Kind::kRename:
      return "rename";
    case FileOperation::Kind::kSyncDir:
      return "sync_dir";
  }
  return "?";
}

std::string FileOperationToString(const FileOperation& op) {
  std::string out = absl::StrCat(FileOperationKindName(op.kind), " '", op.path, "'");
  if (op.kind == FileOperation::Kind::kRename) absl::StrAppend(&out, " -> '", op.to, "'");
  if (op.kind == FileOperation::Kind::kAppend) absl::StrAppend(&out, " (", op.bytes, " bytes)");
  return out;
}

std::ostream& operator<<(std::ostream& os, const FileOperation& op) {
  return os << FileOperationToString(op);
}

// ---- RecordingFileSystem -----------------------------------------------------------------

class RecordingFileSystem::File : public WritableFile {
 public:
  File(RecordingFileSystem* fs, std::unique_ptr<WritableFile> base, std::string path)
      : fs_(fs), base_(std::move(base)), path_(std::move(path)) {}

  absl::Status Append(const void* data, size_t size) override {
    SL_RETURN_IF_ERROR(
        fs_->Record({.kind = FileOperation::Kind::kAppend, .path = path_, .bytes = size}));
    return base_->Append(data, size);
  }
  absl::Status Sync() override {
    SL_RETURN_IF_ERROR(fs_->Record({.kind = FileOperation::Kind::kSync, .path = path_}));
    return base_->Sync();
  }
  absl::Status Close() override {
    absl::Status injected = fs_->Record({.kind = FileOperation::Kind::kClose, .path = path_});
    absl::Status closed = base_->Close();
    return injected.ok() ? closed : injected;
  }

 private:
  RecordingFileSystem* fs_;
  std::unique_ptr<WritableFile> base_;
  std::string path_;
};

class RecordingFileSystem::ReadFile : public ReadableFile {
 public:
  ReadFile(RecordingFileSystem* fs, std::unique_ptr<ReadableFile> base, std::string path)
      : fs_(fs), base_(std::move(base)), path_(std::move(path)) {}

  uint64_t size() const override { return base_->size(); }
  absl::Status ReadAt(uint64_t offset, size_t size, void* out) override {
    {
      std::lock_guard<std::mutex> lock(fs_->mu_);
      fs_->reads_.push_back({.path = path_, .offset = offset, .bytes = size});
    }
    return base_->ReadAt(offset, size, out);
  }

 private:
  RecordingFileSystem* fs_;
  std::unique_ptr<ReadableFile> base_;
  std::string path_;
};

void RecordingFileSystem::FailFrom(int64_t k) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_from_ = k;
}

void RecordingFileSystem::KillAt(int64_t k) {
  std::lock_guard<std::mutex> lock(mu_);
  kill_at_ = k;
}

std::vector<FileOperation> RecordingFileSystem::operations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return log_;
}

int64_t RecordingFileSystem::operation_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(log_.size());
}

std::vector<FileRead> RecordingFileSystem::reads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reads_;
}

void RecordingFileSystem::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  log_.clear();
  reads_.clear();
  fail_from_ = -1;
  kill_at_ = -1;
}

absl::Status RecordingFileSystem::Record(FileOperation op) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t index = static_cast<int64_t>(log_.size());
  log_.push_back(op);
  if (index == kill_at_) {
    // Stderr is unbuffered: the line is out before the kill, for the test driver's log.
    std::fprintf(stderr, "shardline: SIGKILL before file operation %lld (%s)\n",
                 static_cast<long long>(index), FileOperationToString(op).c_str());
    std::raise(SIGKILL);
  }
  if (fail_from_ >= 0 && index >= fail_from_) {
    return absl::UnavailableError(absl::StrCat("injected failure at file operation ", index, " (",
                                               FileOperationToString(op), ")"));
  }
  return absl::OkStatus();
}

absl::Status RecordingFileSystem::CreateDir(const std::string& path) {
  SL_RETURN_IF_ERROR(Record({.kind = FileOperation::Kind::kCreateDir, .path = path}));
  return base_.CreateDir(path);
}

absl::StatusOr<std::unique_ptr<WritableFile>> RecordingFileSystem::CreateFile(
    const std::string& path) {
  if (absl::Status s = Record({.kind = FileOperation::Kind::kCreateFile, .path = path}); !s.ok()) {
    return s;
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> file = base_.CreateFile(path);
  if (!file.ok()) return file.status();
  return std::make_unique<File>(this, *std::move(file), path);
}

absl::StatusOr<std::unique_ptr<ReadableFile>> RecordingFileSystem::OpenFile(
    const std::string& path) {
  absl::StatusOr<std::unique_ptr<ReadableFile>> file = base_.OpenFile(path);
  if (!file.ok()) return file.status();
  return std::make_unique<ReadFile>(this, *std::move(file), path);
}

absl::StatusOr<bool> RecordingFileSystem::Exists(const std::string& path) {
  return base_.Exists(path);
}

absl::StatusOr<bool> RecordingFileSystem::IsDirectory(const std::string& path) {
  return base_.IsDirectory(path);
}

absl::Status RecordingFileSystem::Rename(const std::string& from, const std::string& to) {
  SL_RETURN_IF_ERROR(Record({.kind = FileOperation::Kind::kRename, .path = from, .to = to}));
  return base_.Rename(from, to);
}

absl::Status RecordingFileSystem::SyncDir(const std::string& path) {
  SL_RETURN_IF_ERROR(Record({.kind = FileOperation::Kind::kSyncDir, .path = path}));
  return base_.SyncDir(path);
}

}  // namespace shardline
