// Full weights as safetensors (scheduler/checkpoint/safetensors.h, full_weights.h), ranks as
// threads over the local backend, real files under the test's temporary directory:
//   * the format: a written file read back (header, metadata, every data byte); each malformed
//     file (truncated, extended, bad JSON, duplicate name, wrong size, overlap, hole, unknown
//     dtype, bad metadata, oversized header) the named error; the writer's own checks;
//   * the writer's file operations in order (temporary file, fsync, close, rename, parent fsync)
//     and a failure injected at every one of them: the target never exists half-written;
//   * export at world 4 (full shard) and at hybrid 2 x 2 (writer rank 3): every element of every
//     tensor equal to the hashed values, ties written once, no padding, both files identical;
//     a bf16 export checked against a plain-loop round-to-nearest-even reference;
//   * import at world 3 and 1 (shards first filled with garbage): every element bit-identical,
//     every padding element zero; the bf16 file imported into f32/f64 masters;
//   * import errors on every rank: truncated file, bad header, wrong shape, missing tensor,
//     unknown tensor (and ignore_unknown_tensors), a tie with other values; export errors: a
//     duplicate name across units, an existing target, an integer cast; a unit that cannot be
//     gathered whole for lack of memory (RLIMIT_AS) is ResourceExhausted on every rank.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <latch>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collectives/local/local_communicator.h"
#include "runtime/check.h"
#include "runtime/status.h"
#include "scheduler/checkpoint/file_system.h"
#include "scheduler/checkpoint/full_weights.h"
#include "scheduler/checkpoint/safetensors.h"
#include "scheduler/scheduler.h"
#include "tests/common/local_ranks.h"
#include "tests/common/sanitizers.h"
#include "tests/common/status_and_hash.h"

namespace shardline {
namespace {

namespace fs = std::filesystem;

constexpr absl::Duration kTimeout = absl::Seconds(30);
absl::Time Deadline() { return absl::Now() + kTimeout; }

using ::shardline::testing::HashMix;
// A float in [-1, 1) from (unit, tensor, element).
float HashFloat(uint64_t u, uint64_t t, uint64_t i) {
  const uint64_t h = HashMix(HashMix(HashMix(u) ^ t) ^ i);
  return static_cast<float>(static_cast<double>(h >> 11) / 4503599627370496.0 - 1.0);
}

// bf16 bits of f by round to nearest even, bit by bit from the definition (no NaN here).
uint16_t RoundToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t lower = bits & 0xFFFF;
  uint32_t upper = bits >> 16;
  if (lower > 0x8000 || (lower == 0x8000 && (upper & 1) != 0)) ++upper;
  return static_cast<uint16_t>(upper);
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
// A file of the given header text and data.
std::string RawFile(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  return out + header + data;
}

class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ =
        fs::path(::testing::TempDir()) /
        absl::StrCat("shardline_st_", getpid(), "_", info->test_suite_name(), "_", info->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }
  std::string Path(absl::string_view name) const { return (root_ / std::string(name)).string(); }

  fs::path root_;
};

// ---- The format ------------------------------------------------------------------------------

using SafetensorsFormatTest = TempDirTest;

TEST_F(SafetensorsFormatTest, WrittenFileReadsBack) {
  const std::string path = Path("a.safetensors");
  const std::vector<SafetensorsTensorInfo> infos = {
      {.name = "w", .dtype = SafetensorsDType::kF32, .shape = {3, 5}},
      {.name = "empty", .dtype = SafetensorsDType::kBF16, .shape = {0, 7}},
      {.name = "scalar", .dtype = SafetensorsDType::kI64, .shape = {}},
      {.name = "b\"q\\", .dtype = SafetensorsDType::kU8, .shape = {13}},
  };
  auto writer = SafetensorsWriter::Create(PosixFileSystem(), path, infos,
                                          {{"format", "pt"}, {"note", "x\ny"}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  std::string data;
  for (size_t i = 0; i < 60 + 8 + 13; ++i) data.push_back(static_cast<char>(HashMix(i)));
  // Odd pieces, crossing tensor boundaries.
  for (size_t at = 0; at < data.size(); at += 7) {
    ASSERT_OK((*writer)->Append(&data[at], std::min<size_t>(7, data.size() - at)));
  }
  EXPECT_FALSE(fs::exists(path));  // not before Finish
  ASSERT_OK((*writer)->Finish());

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const SafetensorsHeader& h = (*file)->header();
  EXPECT_EQ(h.header_bytes % 8, 0u);
  EXPECT_EQ(h.data_bytes, data.size());
  EXPECT_EQ((*file)->file_bytes(), 8 + h.header_bytes + data.size());
  ASSERT_EQ(h.metadata.size(), 2u);
  EXPECT_EQ(h.metadata[1].second, "x\ny");
  uint64_t at = 0;
  for (const SafetensorsTensorInfo& info : infos) {
    const SafetensorsTensor* t = h.Find(info.name);
    ASSERT_NE(t, nullptr) << info.name;
    EXPECT_EQ(t->dtype, info.dtype);
    EXPECT_EQ(t->shape, info.shape);
    EXPECT_EQ(t->begin, at);
    EXPECT_EQ((*file)->Data(*t), absl::string_view(data).substr(at, t->bytes()));
    at = t->end;
  }
  EXPECT_EQ(h.Find("nope"), nullptr);
  // The file's bytes: the data follows the header unchanged.
  EXPECT_EQ(ReadAll(path).substr(8 + h.header_bytes), data);
}

TEST_F(SafetensorsFormatTest, WriterChecks) {
  const std::string path = Path("w.safetensors");
  const std::vector<SafetensorsTensorInfo> infos = {
      {.name = "a", .dtype = SafetensorsDType::kF32, .shape = {2}},
      {.name = "b", .dtype = SafetensorsDType::kF16, .shape = {3}}};
  auto writer = SafetensorsWriter::Create(PosixFileSystem(), path, infos, {});
  ASSERT_TRUE(writer.ok()) << writer.status();
  const char bytes[16] = {};
  ASSERT_OK((*writer)->Append(bytes, 10));
  absl::Status s = (*writer)->Finish();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "tensor 'b' is incomplete")) << s;
  s = (*writer)->Append(bytes, 5);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_FALSE(fs::exists(path));

  WriteAll(path, "x");
  auto exists = SafetensorsWriter::Create(PosixFileSystem(), path, infos, {});
  EXPECT_TRUE(absl::IsAlreadyExists(exists.status())) << exists.status();
  auto dup = SafetensorsWriter::Create(PosixFileSystem(), Path("d"), {infos[0], infos[0]}, {});
  EXPECT_TRUE(absl::IsInvalidArgument(dup.status())) << dup.status();
  EXPECT_TRUE(absl::StrContains(dup.status().message(), "'a'")) << dup.status();
  auto meta =
      SafetensorsWriter::Create(PosixFileSystem(), Path("m"), infos, {{"k", "1"}, {"k", "2"}});
  EXPECT_TRUE(absl::IsInvalidArgument(meta.status())) << meta.status();
}

struct BadFile {
  std::string label;
  std::string bytes;
  absl::StatusCode code;
  std::string message;  // a substring of the error
};

TEST_F(SafetensorsFormatTest, MalformedFilesAreNamedErrors) {
  const std::string ok_header =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}})";
  const std::string data(11, 'x');
  const std::vector<BadFile> cases = {
      {"short", "abc", absl::StatusCode::kDataLoss, "shorter than the 8-byte header length"},
      {"header beyond end", RawFile(ok_header, data).substr(0, 40), absl::StatusCode::kDataLoss,
       "(truncated)"},
      {"data truncated", RawFile(ok_header, data.substr(0, 10)), absl::StatusCode::kDataLoss,
       "tensor 'b' (data_offsets [8, 11]) lies beyond the end of the data"},
      {"data extended", RawFile(ok_header, data + "y"), absl::StatusCode::kDataLoss,
       "bytes were added"},
      {"bad json", RawFile(R"({"a":{"dtype":"F32",)", ""), absl::StatusCode::kInvalidArgument,
       "header"},
      {"not an object", RawFile("[1]", ""), absl::StatusCode::kInvalidArgument, "not an object"},
      {"duplicate",
       RawFile(
           R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
           "xx"),
       absl::StatusCode::kInvalidArgument, "duplicate member \"a\""},
      {"wrong size",
       RawFile(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "12345678"),
       absl::StatusCode::kInvalidArgument, "tensor 'a': shape [3] F32 is 12 bytes"},
      {"overlap",
       RawFile(
           R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
           "123456"),
       absl::StatusCode::kInvalidArgument, "tensor 'b' (data_offsets [2, 6]) overlaps tensor 'a'"},
      {"hole",
       RawFile(
           R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})",
           "123456"),
       absl::StatusCode::kInvalidArgument, "data bytes [2, 4) belong to no tensor"},
      {"end before begin",
       RawFile(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[4,2]}})", "1234"),
       absl::StatusCode::kInvalidArgument, "tensor 'a': data_offsets [4, 2]"},
      {"unknown dtype", RawFile(R"({"a":{"dtype":"F7","shape":[1],"data_offsets":[0,1]}})", "1"),
       absl::StatusCode::kInvalidArgument, "tensor 'a': unknown dtype 'F7'"},
      {"negative dim", RawFile(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", "1"),
       absl::StatusCode::kInvalidArgument, "tensor 'a': shape holds"},
      {"missing member", RawFile(R"({"a":{"dtype":"U8","shape":[1]}})", "1"),
       absl::StatusCode::kInvalidArgument, "tensor 'a': no data_offsets"},
      {"extra member",
       RawFile(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}})", "1"),
       absl::StatusCode::kInvalidArgument, "unknown member 'x'"},
      {"metadata", RawFile(R"({"__metadata__":{"k":1}})", ""), absl::StatusCode::kInvalidArgument,
       "__metadata__ member 'k'"},
      {"huge header", std::string("\xff\xff\xff\xff\x00\x00\x00\x00", 8) + "{}",
       absl::StatusCode::kInvalidArgument, "above the limit"},
  };
  for (const BadFile& c : cases) {
    const std::string path = Path("bad.safetensors");
    WriteAll(path, c.bytes);
    auto file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok()) << c.label;
    EXPECT_EQ(file.status().code(), c.code) << c.label << ": " << file.status();
    EXPECT_TRUE(absl::StrContains(file.status().message(), c.message))
        << c.label << ": " << file.status();
    EXPECT_TRUE(absl::StrContains(file.status().message(), path)) << c.label;
  }
  // The well-formed one opens.
  WriteAll(Path("good"), RawFile(ok_header, data));
  EXPECT_TRUE(SafetensorsFile::Open(Path("good")).ok());
  auto missing = SafetensorsFile::Open(Path("none"));
  EXPECT_TRUE(absl::IsNotFound(missing.status())) << missing.status();
}

TEST_F(SafetensorsFormatTest, WriteIsAtomic) {
  const std::string path = Path("atomic.safetensors");
  const std::vector<SafetensorsTensorInfo> infos = {
      {.name = "a", .dtype = SafetensorsDType::kF32, .shape = {5}}};
  const char data[20] = {1, 2, 3};
  auto write = [&](FileSystem& fsys) -> absl::Status {
    SL_ASSIGN_OR_RETURN(auto w, SafetensorsWriter::Create(fsys, path, infos, {}));
    SL_RETURN_IF_ERROR(w->Append(data, 20));
    return w->Finish();
  };
  RecordingFileSystem rec;
  ASSERT_OK(write(rec));
  const std::vector<FileOperation> ops = rec.operations();
  ASSERT_EQ(ops.size(), 7u);
  const std::string tmp = ops[0].path;
  EXPECT_TRUE(absl::StartsWith(tmp, path + ".tmp-")) << tmp;
  using K = FileOperation::Kind;
  EXPECT_EQ(ops[0].kind, K::kCreateFile);
  EXPECT_EQ(ops[1].kind, K::kAppend);  // the header
  EXPECT_EQ(ops[2], (FileOperation{.kind = K::kAppend, .path = tmp, .bytes = 20}));
  EXPECT_EQ(ops[3], (FileOperation{.kind = K::kSync, .path = tmp}));
  EXPECT_EQ(ops[4], (FileOperation{.kind = K::kClose, .path = tmp}));
  EXPECT_EQ(ops[5], (FileOperation{.kind = K::kRename, .path = tmp, .to = path}));
  EXPECT_EQ(ops[6], (FileOperation{.kind = K::kSyncDir, .path = root_.string()}));
  // A failure at every operation: the target exists only if the rename happened, and then whole.
  for (int k = 0; k < 7; ++k) {
    fs::remove_all(root_);
    fs::create_directories(root_);
    RecordingFileSystem failing;
    failing.FailFrom(k);
    EXPECT_FALSE(write(failing).ok()) << k;
    EXPECT_EQ(fs::exists(path), k > 5) << k;
    if (k > 5) {
      EXPECT_TRUE(SafetensorsFile::Open(path).ok());
    }
  }
}

// ---- Export and import over a scheduler ------------------------------------------------------

struct UnitDef {
  std::string name;
  std::vector<TensorSpec> tensors;
  UnitPolicy policy;
};

std::vector<UnitDef> MakeModel() {
  std::vector<UnitDef> m;
  m.push_back({.name = "embed",
               .tensors = {{.name = "emb", .shape = {13, 7}},
                           {.name = "bias", .shape = {5}},
                           {.name = "head", .shape = {13, 7}, .tied_to = "emb"}}});
  m.push_back({.name = "block",
               .tensors = {{.name = "w", .shape = {3, 5, 7}},
                           {.name = "scale", .shape = {}},
                           {.name = "empty", .shape = {0, 4}},
                           {.name = "b", .shape = {11}}}});
  UnitDef tail{.name = "tail", .tensors = {{.name = "big", .shape = {1031}}}};
  tail.policy.precision.master_dtype = DType::kF64;
  m.push_back(tail);
  return m;
}

struct RunConfig {
  int world = 4;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int shard_size = 0;
  bool fill = true;  // false: master shards hold garbage (0xCD)
  std::function<void(std::vector<UnitDef>&)> edit;
};

struct Rank {
  std::unique_ptr<Stream> compute;
  std::unique_ptr<Scheduler> sched;
};

absl::StatusOr<Rank> MakeRank(const RunConfig& setup, std::shared_ptr<Communicator> comm) {
  Rank rank;
  std::vector<UnitDef> model = MakeModel();
  if (setup.edit) setup.edit(model);
  SL_ASSIGN_OR_RETURN(rank.compute,
                      CreateCallerStream({.name = "compute", .wait_timeout = kTimeout}));
  SL_ASSIGN_OR_RETURN(
      rank.sched,
      Scheduler::Create(comm, *rank.compute,
                        {.strategy = setup.strategy, .shard_size = setup.shard_size}, Deadline()));
  for (size_t u = 0; u < model.size(); ++u) {
    SL_ASSIGN_OR_RETURN(int id, rank.sched->RegisterUnit({.name = model[u].name,
                                                          .tensors = model[u].tensors,
                                                          .policy = model[u].policy}));
    FlatParameter& unit = rank.sched->unit(id);
    if (setup.fill) {
      std::vector<std::vector<float>> full(model[u].tensors.size());
      std::vector<const void*> ptrs;
      for (size_t t = 0; t < full.size(); ++t) {
        full[t].resize(unit.layout().tensor(t).numel);
        for (size_t i = 0; i < full[t].size(); ++i) full[t][i] = HashFloat(u, t, i);
        ptrs.push_back(full[t].data());
      }
      SL_RETURN_IF_ERROR(unit.SetShardFromTensors(ptrs, Deadline()));
    } else {
      FlatShardView master = unit.master_shard();
      std::memset(master.data, 0xCD, master.elements * DTypeSize(master.dtype));
    }
  }
  return rank;
}

std::vector<absl::Status> RunRanks(
    int world, const std::function<absl::Status(int, std::shared_ptr<Communicator>)>& fn) {
  return testing::RunLocalRanks(world, kTimeout, fn);
}

void ExpectAllOk(const std::vector<absl::Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
  }
}

// Every rank failed with `code`; the message of each contains `text`.
void ExpectAllFail(const std::vector<absl::Status>& statuses, absl::StatusCode code,
                   absl::string_view text) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_EQ(statuses[r].code(), code) << "rank " << r << ": " << statuses[r];
    EXPECT_TRUE(absl::StrContains(statuses[r].message(), text))
        << "rank " << r << ": " << statuses[r];
  }
}

// The expected bits of element i of tensor t of unit u in `dtype` (f32/f64 exact; bf16 rounded).
void Expected(int u, int t, size_t i, DType dtype, char* out) {
  const float f = HashFloat(u, t, i);
  if (dtype == DType::kF64) {
    const double d = f;
    std::memcpy(out, &d, 8);
  } else if (dtype == DType::kF32) {
    std::memcpy(out, &f, 4);
  } else {
    SL_CHECK(dtype == DType::kBF16);
    const uint16_t b = RoundToBf16(f);
    std::memcpy(out, &b, 2);
  }
}

// Every tensor of the model in the file, every element as expected in `dtype` (nullopt: the
// master dtypes); ties absent and recorded in the metadata; no byte beyond the tensors.
void ExpectFileHoldsModel(const std::string& path, std::optional<DType> dtype) {
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const SafetensorsHeader& h = (*file)->header();
  const std::vector<UnitDef> model = MakeModel();
  uint64_t data_bytes = 0;
  size_t tensors = 0;
  for (size_t u = 0; u < model.size(); ++u) {
    const DType d = dtype.value_or(model[u].policy.precision.master_dtype);
    const size_t size = DTypeSize(d);
    for (size_t t = 0; t < model[u].tensors.size(); ++t) {
      const TensorSpec& spec = model[u].tensors[t];
      const SafetensorsTensor* entry = h.Find(spec.name);
      if (!spec.tied_to.empty()) {
        EXPECT_EQ(entry, nullptr) << spec.name;
        bool recorded = false;
        for (const auto& [k, v] : h.metadata) {
          recorded |= k == absl::StrCat(kSafetensorsTiePrefix, spec.name) && v == spec.tied_to;
        }
        EXPECT_TRUE(recorded) << spec.name;
        continue;
      }
      ASSERT_NE(entry, nullptr) << spec.name;
      ++tensors;
      EXPECT_EQ(entry->dtype, ToSafetensorsDType(d));
      EXPECT_EQ(entry->shape, spec.shape);
      const absl::string_view bytes = (*file)->Data(*entry);
      ASSERT_EQ(bytes.size(), entry->numel() * size);
      data_bytes += bytes.size();
      size_t wrong = 0;
      char want[8];
      for (size_t i = 0; i < entry->numel(); ++i) {
        Expected(u, t, i, d, want);
        if (std::memcmp(want, bytes.data() + i * size, size) != 0) ++wrong;
      }
      EXPECT_EQ(wrong, 0u) << "tensor " << spec.name;
    }
  }
  EXPECT_EQ(h.tensors.size(), tensors);
  EXPECT_EQ(h.data_bytes, data_bytes);  // no padding
  EXPECT_EQ(h.metadata[0], (std::pair<std::string, std::string>("format", "pt")));
}

// This rank's master shards hold the expected values (in `dtype`, widened back to the master
// dtype), every padding element zero.
void ExpectShardsHoldModel(const Scheduler& sched, std::optional<DType> dtype,
                           absl::string_view label) {
  const std::vector<UnitDef> model = MakeModel();
  const int shard = sched.mesh().shard_rank();
  for (int u = 0; u < sched.num_units(); ++u) {
    const FlatParameter& unit = sched.unit(u);
    const FlatLayout& layout = unit.layout();
    const DType master = unit.policy().master_dtype;
    const size_t size = DTypeSize(master);
    const char* data = static_cast<const char*>(unit.master_shard().data);
    size_t wrong = 0, dirty = 0;
    for (const ShardSlice& s : layout.ShardSlices(shard)) {
      for (size_t j = 0; j < s.length; ++j) {
        char want[8];
        if (dtype == DType::kBF16) {
          const uint32_t bits =
              static_cast<uint32_t>(RoundToBf16(HashFloat(u, s.tensor, s.tensor_offset + j))) << 16;
          float f;
          std::memcpy(&f, &bits, 4);
          const double d = f;
          std::memcpy(want, master == DType::kF64 ? static_cast<const void*>(&d) : &f, size);
        } else {
          Expected(u, s.tensor, s.tensor_offset + j, master, want);
        }
        if (std::memcmp(want, data + (s.shard_offset + j) * size, size) != 0) ++wrong;
      }
    }
    const size_t begin = layout.ShardBegin(shard);
    for (const PaddingRange& p : layout.ShardPadding(shard)) {
      for (size_t b = (p.begin - begin) * size; b < (p.end - begin) * size; ++b) {
        if (data[b] != 0) ++dirty;
      }
    }
    EXPECT_EQ(wrong, 0u) << label << " unit " << unit.name() << " shard " << shard;
    EXPECT_EQ(dirty, 0u) << label << " unit " << unit.name() << " padding";
  }
}

class FullWeightsTest : public TempDirTest {
 protected:
  std::vector<absl::Status> Export(const RunConfig& setup, const std::string& path,
                                   SafetensorsExportOptions options = {}) {
    return RunRanks(setup.world, [&](int, std::shared_ptr<Communicator> comm) -> absl::Status {
      SL_ASSIGN_OR_RETURN(Rank rank, MakeRank(setup, comm));
      return ExportSafetensors(*rank.sched, path, options, Deadline());
    });
  }
  // Imports `path` into garbage-filled shards; checks them if the import succeeded.
  std::vector<absl::Status> Import(const RunConfig& setup, const std::string& path,
                                   std::optional<DType> file_dtype = std::nullopt,
                                   SafetensorsImportOptions options = {}) {
    RunConfig s = setup;
    s.fill = false;
    return RunRanks(s.world, [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
      SL_ASSIGN_OR_RETURN(Rank rank, MakeRank(s, comm));
      SL_RETURN_IF_ERROR(ImportSafetensors(*rank.sched, path, options, Deadline()));
      ExpectShardsHoldModel(*rank.sched, file_dtype, absl::StrCat(path, " rank ", r));
      return absl::OkStatus();
    });
  }
};

TEST_F(FullWeightsTest, ExportAtFourAndHybridImportAtThreeAndOne) {
  const std::string a = Path("world4.safetensors");
  ExpectAllOk(Export({.world = 4}, a));
  ExpectFileHoldsModel(a, std::nullopt);
  const std::string b = Path("hybrid.safetensors");
  ExpectAllOk(Export({.world = 4, .strategy = ShardingStrategy::kHybridShard, .shard_size = 2}, b,
                     {.writer_rank = 3}));
  ExpectFileHoldsModel(b, std::nullopt);
  EXPECT_EQ(ReadAll(a), ReadAll(b));  // the same model gives the same bytes, whatever the mesh
  // No temporary file left beside them.
  int files = 0;
  for (const auto& entry : fs::directory_iterator(root_)) files += entry.is_regular_file();
  EXPECT_EQ(files, 2);

  ExpectAllOk(Import({.world = 3}, a));
  ExpectAllOk(Import({.world = 1}, b));
  ExpectAllOk(Import({.world = 4, .strategy = ShardingStrategy::kHybridShard, .shard_size = 2}, a));
}

TEST_F(FullWeightsTest, Bf16ExportRoundsToNearestEvenAndImportsWidened) {
  const std::string path = Path("bf16.safetensors");
  ExpectAllOk(Export({.world = 2}, path, {.dtype = DType::kBF16, .cast_chunk_bytes = 6}));
  ExpectFileHoldsModel(path, DType::kBF16);
  ExpectAllOk(Import({.world = 3}, path, DType::kBF16));
}

TEST_F(FullWeightsTest, ImportErrorsAreNamedOnEveryRank) {
  const std::string good = Path("good.safetensors");
  ExpectAllOk(Export({.world = 2}, good));
  const std::string bytes = ReadAll(good);

  const std::string truncated = Path("truncated.safetensors");
  WriteAll(truncated, bytes.substr(0, bytes.size() - 3));
  ExpectAllFail(Import({.world = 3}, truncated), absl::StatusCode::kDataLoss, "truncated");
  auto statuses = Import({.world = 3}, truncated);
  EXPECT_TRUE(absl::StrContains(statuses[0].message(), "tensor 'big'")) << statuses[0];
  EXPECT_TRUE(absl::StrContains(statuses[0].message(), truncated)) << statuses[0];
  EXPECT_FALSE(IsPeerError(statuses[0]));

  const std::string garbled = Path("garbled.safetensors");
  std::string g = bytes;
  g[8] = '[';
  WriteAll(garbled, g);
  ExpectAllFail(Import({.world = 2}, garbled), absl::StatusCode::kInvalidArgument, "header");

  auto wider = [](std::vector<UnitDef>& m) { m[1].tensors[0].shape = {3, 5, 8}; };
  ExpectAllFail(Import({.world = 3, .edit = wider}, good), absl::StatusCode::kInvalidArgument,
                "tensor 'w' (unit 'block'): the file has shape [3, 5, 7] F32, the unit [3, 5, 8]");

  auto extra = [](std::vector<UnitDef>& m) {
    m[2].tensors.push_back({.name = "extra", .shape = {4}});
    m[2].tensors.push_back({.name = "extra2", .shape = {1}});
  };
  ExpectAllFail(Import({.world = 3, .edit = extra}, good), absl::StatusCode::kNotFound,
                "the file has no tensor 'extra', 'extra2'");

  auto fewer = [](std::vector<UnitDef>& m) { m[1].tensors.pop_back(); };
  ExpectAllFail(Import({.world = 2, .edit = fewer}, good), absl::StatusCode::kInvalidArgument,
                "the file's tensors 'b' belong to no unit");
  // Skipped on request: the rest loads (checked against the model, whose 'b' is not there).
  RunConfig s{.world = 2, .fill = false, .edit = fewer};
  ExpectAllOk(RunRanks(2, [&](int, std::shared_ptr<Communicator> comm) -> absl::Status {
    SL_ASSIGN_OR_RETURN(Rank rank, MakeRank(s, comm));
    SL_RETURN_IF_ERROR(
        ImportSafetensors(*rank.sched, good, {.ignore_unknown_tensors = true}, Deadline()));
    ExpectShardsHoldModel(*rank.sched, std::nullopt, "ignore_unknown_tensors");
    return absl::OkStatus();
  }));

  auto missing = Import({.world = 2}, Path("none.safetensors"));
  ExpectAllFail(missing, absl::StatusCode::kNotFound, "none.safetensors");
}

TEST_F(FullWeightsTest, TiePresentInTheFileMustHoldTheTargetsValues) {
  // A file that also stores the tie 'head' (as a torch state dict cloned before saving would).
  auto write = [&](const std::string& path, float delta) {
    std::vector<SafetensorsTensorInfo> infos;
    std::vector<std::string> data;
    const std::vector<UnitDef> model = MakeModel();
    for (size_t u = 0; u < model.size(); ++u) {
      const DType d = model[u].policy.precision.master_dtype;
      for (size_t t = 0; t < model[u].tensors.size(); ++t) {
        const TensorSpec& spec = model[u].tensors[t];
        const size_t source = spec.tied_to.empty() ? t : 0;
        size_t numel = 1;
        for (int64_t dim : spec.shape) numel *= dim;
        std::string bytes(numel * DTypeSize(d), '\0');
        for (size_t i = 0; i < numel; ++i) Expected(u, source, i, d, &bytes[i * DTypeSize(d)]);
        if (!spec.tied_to.empty() && delta != 0) {
          float f;
          std::memcpy(&f, &bytes[40 * 4], 4);
          f += delta;
          std::memcpy(&bytes[40 * 4], &f, 4);
        }
        infos.push_back({.name = spec.name, .dtype = ToSafetensorsDType(d), .shape = spec.shape});
        data.push_back(bytes);
      }
    }
    auto w = SafetensorsWriter::Create(PosixFileSystem(), path, infos, {});
    SL_CHECK(w.ok());
    for (const std::string& d : data) SL_CHECK((*w)->Append(d.data(), d.size()).ok());
    SL_CHECK((*w)->Finish().ok());
  };
  const std::string same = Path("same.safetensors");
  write(same, 0);
  ExpectAllOk(Import({.world = 3}, same));
  const std::string differs = Path("differs.safetensors");
  write(differs, 0.5f);
  // Element 40 lies in one rank's range: that rank names it, the others report its error.
  auto statuses = Import({.world = 3}, differs);
  ExpectAllFail(statuses, absl::StatusCode::kInvalidArgument,
                "tensor 'head' (unit 'embed') is tied to 'emb', but the file's values differ at "
                "element 40");
}

TEST_F(FullWeightsTest, ExportErrors) {
  const std::string path = Path("x.safetensors");
  auto dup = [](std::vector<UnitDef>& m) { m[2].tensors[0].name = "bias"; };
  ExpectAllFail(Export({.world = 2, .edit = dup}, path), absl::StatusCode::kInvalidArgument,
                "tensor name 'bias' is used by unit 'embed' and by unit 'tail'");
  EXPECT_FALSE(fs::exists(path));

  WriteAll(path, "keep");
  auto statuses = Export({.world = 3}, path, {.writer_rank = 1});
  ExpectAllFail(statuses, absl::StatusCode::kAlreadyExists, "exists");
  EXPECT_FALSE(IsPeerError(statuses[1]));
  EXPECT_TRUE(IsPeerError(statuses[0]));
  EXPECT_TRUE(absl::StrContains(statuses[0].message(), "failed on rank 1")) << statuses[0];
  EXPECT_EQ(ReadAll(path), "keep");

  ExpectAllFail(Export({.world = 2}, Path("i.safetensors"), {.dtype = DType::kI32}),
                absl::StatusCode::kInvalidArgument, "cannot be exported as i32");
  ExpectAllFail(Export({.world = 2}, Path("r.safetensors"), {.writer_rank = 2}),
                absl::StatusCode::kInvalidArgument, "writer_rank 2");
}

// A rank of the writer's group that cannot allocate a unit gathered whole fails the export with
// ResourceExhausted, and so does every other rank (the one already waiting in the gather at
// once, through the abort of the call's shard communicator), instead of std::bad_alloc
// terminating the process. The memory runs out for real: RLIMIT_AS, set once both ranks are
// built, leaves room for one 128 MiB gather buffer, not for two (or for none: either way
// every rank must fail alike). In a death-test child (re-executed, so the limit and any
// crash stay there), which exits 0 if every rank failed as expected.
TEST_F(FullWeightsTest, UnitThatCannotBeGatheredIsResourceExhaustedOnEveryRank) {
  if (testing::UnderSanitizer()) {
    GTEST_SKIP() << "limits the address space, which the sanitizers reserve in terabytes";
  }
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string path = Path("huge.safetensors");
  auto run = [&] {
    RunConfig setup{.world = 2, .fill = false};
    setup.edit = [](std::vector<UnitDef>& m) {
      m.push_back({.name = "huge", .tensors = {{.name = "h", .shape = {int64_t{32} << 20}}}});
    };
    std::latch built(2);
    std::vector<absl::Status> statuses =
        RunRanks(2, [&](int r, std::shared_ptr<Communicator> comm) -> absl::Status {
          SL_ASSIGN_OR_RETURN(Rank rank, MakeRank(setup, comm));
          built.arrive_and_wait();
          if (r == 0) {
            std::ifstream statm("/proc/self/statm");
            uint64_t pages = 0;
            statm >> pages;
            const uint64_t now = pages * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
            const rlimit limit{.rlim_cur = now + (uint64_t{192} << 20), .rlim_max = RLIM_INFINITY};
            SL_CHECK(setrlimit(RLIMIT_AS, &limit) == 0);
          }
          // Both start the export once the limit is set (its first exchange is a barrier).
          return ExportSafetensors(*rank.sched, path, {}, Deadline());
        });
    bool ok = true;
    for (size_t r = 0; r < statuses.size(); ++r) {
      const absl::Status& st = statuses[r];
      const bool named =
          absl::StrContains(st.message(), "cannot allocate the 134217728 bytes of unit 'huge'");
      if (!absl::IsResourceExhausted(st) || !named) {
        std::fprintf(stderr, "rank %zu: %s\n", r, st.ToString().c_str());
        ok = false;
      }
    }
    std::fflush(stderr);
    std::_Exit(ok ? 0 : 1);
  };
  EXPECT_EXIT(run(), ::testing::ExitedWithCode(0), "");
  EXPECT_FALSE(fs::exists(path));
}

TEST_F(FullWeightsTest, ExportIsAtomicThroughTheFileLayer) {
  const std::string path = Path("atomic.safetensors");
  RecordingFileSystem rec;
  ExpectAllOk(Export({.world = 2}, path, {.file_system = &rec}));
  const std::vector<FileOperation> ops = rec.operations();
  ASSERT_GE(ops.size(), 6u);
  using K = FileOperation::Kind;
  const std::string tmp = ops[0].path;
  EXPECT_EQ(ops[0].kind, K::kCreateFile);
  EXPECT_TRUE(absl::StartsWith(tmp, path + ".tmp-"));
  for (size_t i = 1; i + 4 < ops.size(); ++i) EXPECT_EQ(ops[i].kind, K::kAppend) << i;
  const size_t n = ops.size();
  EXPECT_EQ(ops[n - 4], (FileOperation{.kind = K::kSync, .path = tmp}));
  EXPECT_EQ(ops[n - 3], (FileOperation{.kind = K::kClose, .path = tmp}));
  EXPECT_EQ(ops[n - 2], (FileOperation{.kind = K::kRename, .path = tmp, .to = path}));
  EXPECT_EQ(ops[n - 1], (FileOperation{.kind = K::kSyncDir, .path = root_.string()}));
  ExpectFileHoldsModel(path, std::nullopt);
  // A failure at every operation: every rank fails; the target is absent until the rename.
  for (size_t k = 0; k < n; ++k) {
    fs::remove_all(root_);
    fs::create_directories(root_);
    RecordingFileSystem failing;
    failing.FailFrom(static_cast<int64_t>(k));
    auto statuses = Export({.world = 2}, path, {.file_system = &failing});
    ExpectAllFail(statuses, absl::StatusCode::kUnavailable, "injected failure");
    EXPECT_EQ(fs::exists(path), k == n - 1) << k;
    if (k == n - 1) ExpectFileHoldsModel(path, std::nullopt);
  }
}

}  // namespace
}  // namespace shardline

namespace shardline {
namespace {

// A file of the model's storage tensors, each in the dtype `dtype_of(name)` gives: f64 holds the
// f32 values exactly; integer dtypes hold zeros.
void WriteModelFile(const std::string& path,
                    const std::function<SafetensorsDType(const std::string&)>& dtype_of) {
  std::vector<SafetensorsTensorInfo> infos;
  std::vector<std::string> data;
  const std::vector<UnitDef> model = MakeModel();
  for (size_t u = 0; u < model.size(); ++u) {
    for (size_t t = 0; t < model[u].tensors.size(); ++t) {
      const TensorSpec& spec = model[u].tensors[t];
      if (!spec.tied_to.empty()) continue;
      const SafetensorsDType d = dtype_of(spec.name);
      size_t numel = 1;
      for (int64_t dim : spec.shape) numel *= dim;
      std::string bytes(numel * SafetensorsDTypeSize(d), '\0');
      for (size_t i = 0; i < numel && (d == SafetensorsDType::kF64 || d == SafetensorsDType::kF32);
           ++i) {
        Expected(u, t, i, d == SafetensorsDType::kF64 ? DType::kF64 : DType::kF32,
                 &bytes[i * SafetensorsDTypeSize(d)]);
      }
      infos.push_back({.name = spec.name, .dtype = d, .shape = spec.shape});
      data.push_back(bytes);
    }
  }
  auto w = SafetensorsWriter::Create(PosixFileSystem(), path, infos, {});
  SL_CHECK(w.ok());
  for (const std::string& d : data) SL_CHECK((*w)->Append(d.data(), d.size()).ok());
  SL_CHECK((*w)->Finish().ok());
}

TEST_F(FullWeightsTest, FileDtypesAreCastOrRefused) {
  // F64 everywhere: narrowed into the f32 masters (exactly: the values are f32 values).
  const std::string f64 = Path("f64.safetensors");
  WriteModelFile(f64, [](const std::string&) { return SafetensorsDType::kF64; });
  ExpectAllOk(Import({.world = 3}, f64));
  // F32 everywhere: widened into the f64 master of 'tail'.
  const std::string f32 = Path("f32.safetensors");
  WriteModelFile(f32, [](const std::string&) { return SafetensorsDType::kF32; });
  ExpectAllOk(Import({.world = 2}, f32));
  // An integer tensor cannot go into a floating master.
  const std::string i32 = Path("i32.safetensors");
  WriteModelFile(i32, [](const std::string& name) {
    return name == "w" ? SafetensorsDType::kI32 : SafetensorsDType::kF32;
  });
  ExpectAllFail(Import({.world = 2}, i32), absl::StatusCode::kInvalidArgument,
                "tensor 'w' (unit 'block'): the file's dtype I32 cannot be loaded into the master "
                "dtype f32");
}

}  // namespace
}  // namespace shardline
