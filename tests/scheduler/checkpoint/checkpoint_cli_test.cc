// shardline-checkpoint (scheduler/tools/shardline_checkpoint.cc), run as a process on a checkpoint
// of the fixture model (checkpoint_fixture.h) saved at world 4 and at hybrid 2 x 2:
//   * inspect prints the mesh, the files, every unit, tensor (with its tie) and state;
//   * verify passes on a good checkpoint, and names the file, unit, state and tensor of a flipped
//     byte, a truncated file, a deleted file (exit status 1 each); a garbled manifest is exit 1;
//   * export writes the same bytes as ExportSafetensors of the same weights (as saved, and cast
//     to bf16), exports a registered state (every element checked), refuses an unknown state,
//     an integer cast, an existing target, a corrupt piece (leaving no file);
//   * a bad command line is exit status 2;
//   * verify checks replicated.bin as a load does: a flipped byte, a truncated and a deleted
//     replicated.bin are exit 1 naming the file (and the replicated state);
//   * a FIFO in place of manifest.json or of a data file makes inspect, verify and export fail
//     at once naming it (each run bounded by timeout(1)); a path that is a plain file is named
//     as such.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "scheduler/checkpoint/full_weights.h"
#include "scheduler/checkpoint/safetensors.h"
#include "tests/common/run_tool.h"
#include "tests/scheduler/checkpoint/checkpoint_fixture.h"

namespace shardline {
namespace {

namespace fs = std::filesystem;
using fixture::FixtureValue;

using testing::ToolRun;

// Runs shardline-checkpoint with `args` (shell words), bounded in time by timeout(1) (status 124
// past it).
ToolRun RunTool(const std::string& args, int timeout_s = 120) {
  return testing::RunTool(SHARDLINE_CHECKPOINT_BIN, args, timeout_s);
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

class CheckpointCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "checkpoint_cli_XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }
  std::string Path(absl::string_view name) const { return absl::StrCat(root_, "/", name); }

  // Saves the fixture model into `dir` at `world` (shard_size 0: full shard) and exports its
  // master weights with ExportSafetensors into `out` (as saved) and `out_bf16`.
  void Save(int world, int shard_size, const std::string& dir, const std::string& out,
            const std::string& out_bf16) {
    const absl::Status s = fixture::FirstError(
        fixture::RunRanks(world, [&](int, std::shared_ptr<Communicator> comm) -> absl::Status {
          SL_ASSIGN_OR_RETURN(auto rank, fixture::MakeRank(comm, shard_size, true));
          SL_RETURN_IF_ERROR(rank->ckpt->Save(dir, fixture::Deadline()));
          SL_RETURN_IF_ERROR(ExportSafetensors(*rank->sched, out, {}, fixture::Deadline()));
          return ExportSafetensors(*rank->sched, out_bf16, {.dtype = DType::kBF16},
                                   fixture::Deadline());
        }));
    ASSERT_TRUE(s.ok()) << s;
  }

  std::string root_;
};

TEST_F(CheckpointCliTest, InspectVerifyExport) {
  for (const int shard_size : {0, 2}) {
    const std::string tag = absl::StrCat("s", shard_size);
    const std::string dir = Path(tag + "ckpt");
    const std::string online = Path(tag + "online.safetensors");
    const std::string online_bf16 = Path(tag + "online_bf16.safetensors");
    Save(4, shard_size, dir, online, online_bf16);

    ToolRun run = RunTool(absl::StrCat("inspect ", dir));
    EXPECT_EQ(run.status, 0) << run.output;
    EXPECT_TRUE(absl::StrContains(run.output,
                                  shard_size == 0 ? "world 4, mesh 1 x 4" : "world 4, mesh 2 x 2"))
        << run.output;
    for (const char* want :
         {"unit 'embed': master f32", "tensor 'head' [13, 7] f32 offset 0 tied to 'emb'",
          "unit 'tail': master f64", "tensor 'scale' [] f32", "state 'adam.m' f32",
          "state 'master' f64", "shard-00001-of-"}) {
      EXPECT_TRUE(absl::StrContains(run.output, want)) << want << "\n" << run.output;
    }

    run = RunTool(absl::StrCat("verify ", dir));
    EXPECT_EQ(run.status, 0) << run.output;
    EXPECT_TRUE(absl::StrContains(run.output, "every CRC-32C matches")) << run.output;

    // The offline export is the online one, byte for byte.
    const std::string offline = Path(tag + "offline.safetensors");
    run = RunTool(absl::StrCat("export ", dir, " ", offline));
    EXPECT_EQ(run.status, 0) << run.output;
    EXPECT_EQ(ReadAll(offline), ReadAll(online));
    EXPECT_GT(ReadAll(online).size(), 4000u);
    const std::string offline_bf16 = Path(tag + "offline_bf16.safetensors");
    run = RunTool(absl::StrCat("export ", dir, " ", offline_bf16, " --dtype bf16"));
    EXPECT_EQ(run.status, 0) << run.output;
    EXPECT_EQ(ReadAll(offline_bf16), ReadAll(online_bf16));

    // A registered state: every element checked against the values.
    const std::string adam = Path(tag + "adam.safetensors");
    run = RunTool(absl::StrCat("export ", dir, " ", adam, " --state adam.m"));
    ASSERT_EQ(run.status, 0) << run.output;
    auto file = SafetensorsFile::Open(adam);
    ASSERT_TRUE(file.ok()) << file.status();
    const std::vector<fixture::UnitDef> model = fixture::Model();
    size_t checked = 0;
    for (size_t u = 0; u < model.size(); ++u) {
      for (size_t t = 0; t < model[u].tensors.size(); ++t) {
        const SafetensorsTensor* entry = (*file)->header().Find(model[u].tensors[t].name);
        if (!model[u].tensors[t].tied_to.empty()) {
          EXPECT_EQ(entry, nullptr);
          continue;
        }
        ASSERT_NE(entry, nullptr) << model[u].tensors[t].name;
        ASSERT_EQ(entry->dtype, SafetensorsDType::kF32);
        const absl::string_view data = (*file)->Data(*entry);
        for (size_t i = 0; i < entry->numel(); ++i) {
          const float want = FixtureValue(2, u, t, i);
          ASSERT_EQ(std::memcmp(&want, data.data() + 4 * i, 4), 0)
              << model[u].tensors[t].name << " element " << i;
          ++checked;
        }
      }
    }
    EXPECT_EQ(checked, 91u + 5 + 105 + 1 + 11 + 1031);
  }
}

TEST_F(CheckpointCliTest, ErrorsAreNamed) {
  const std::string dir = Path("ckpt");
  Save(4, 0, dir, Path("a.safetensors"), Path("b.safetensors"));
  const std::string pristine = Path("pristine");
  fs::copy(dir, pristine);

  ToolRun run = RunTool(absl::StrCat("export ", dir, " ", Path("x"), " --state adam.z"));
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output,
                                "unit 'embed' has no state 'adam.z' (it has: "
                                "master, adam.m)"))
      << run.output;
  run = RunTool(absl::StrCat("export ", dir, " ", Path("x"), " --dtype i32"));
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "cannot be exported as i32")) << run.output;
  run = RunTool(absl::StrCat("export ", dir, " ", Path("a.safetensors")));
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "exists")) << run.output;

  // A flipped byte in shard 2's file: verify names the block and the tensor; export refuses.
  const std::string shard2 = absl::StrCat(dir, "/shard-00002-of-00004.bin");
  std::string bytes = ReadAll(shard2);
  bytes[5] ^= 0x40;
  WriteAll(shard2, bytes);
  run = RunTool(absl::StrCat("verify ", dir));
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output,
                                "FAILED data file 'shard-00002-of-00004.bin' bytes [0, 60) have "
                                "CRC-32C"))
      << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "unit 'embed' state 'master' tensor 'emb' elements"))
      << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "1 problems")) << run.output;
  run = RunTool(absl::StrCat("export ", dir, " ", Path("corrupt.safetensors")));
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "have CRC-32C")) << run.output;
  EXPECT_FALSE(fs::exists(Path("corrupt.safetensors")));

  // Truncated and deleted files.
  WriteAll(shard2, ReadAll(absl::StrCat(pristine, "/shard-00002-of-00004.bin")).substr(0, 100));
  fs::remove(absl::StrCat(dir, "/shard-00003-of-00004.bin"));
  run = RunTool(absl::StrCat("verify ", dir));
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output,
                                "data file 'shard-00002-of-00004.bin' is 100 bytes, "
                                "the manifest says"))
      << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "(truncated)")) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "lies beyond its end")) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output,
                                "data file 'shard-00003-of-00004.bin' cannot be "
                                "opened"))
      << run.output;

  // A garbled manifest, an incomplete directory, a bad command line.
  WriteAll(absl::StrCat(dir, "/manifest.json"), "{\"format\": 1.5}");
  run = RunTool(absl::StrCat("verify ", dir));
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "manifest.json")) << run.output;
  run = RunTool(absl::StrCat("inspect ", Path("nothing")));
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "NOT_FOUND")) << run.output;
  EXPECT_EQ(RunTool("").status, 2);
  EXPECT_EQ(RunTool("frobnicate x").status, 2);
  EXPECT_EQ(RunTool(absl::StrCat("export ", pristine, " y --dtype")).status, 2);
  EXPECT_EQ(RunTool(absl::StrCat("export ", pristine, " y --bogus 1")).status, 2);
  // The pristine copy still verifies.
  run = RunTool(absl::StrCat("verify ", pristine));
  EXPECT_EQ(run.status, 0) << run.output;
}

// A checkpoint with replicated states (a step counter, a vector): verify reads replicated.bin
// as a load does, and names it when it is corrupt, truncated or missing.
TEST_F(CheckpointCliTest, VerifyChecksTheReplicatedStates) {
  const std::string dir = Path("ckpt");
  const absl::Status saved = fixture::FirstError(
      fixture::RunRanks(2, [&](int, std::shared_ptr<Communicator> comm) -> absl::Status {
        SL_ASSIGN_OR_RETURN(auto rank, fixture::MakeRank(comm, 0, true));
        int64_t step = 1234;
        std::vector<double> lr = {0.5, 0.25, 0.125};
        SL_RETURN_IF_ERROR(rank->ckpt->AddReplicatedState(
            {.name = "step", .shape = {}, .dtype = DType::kI64, .data = &step}));
        SL_RETURN_IF_ERROR(rank->ckpt->AddReplicatedState(
            {.name = "lr", .shape = {3}, .dtype = DType::kF64, .data = lr.data()}));
        return rank->ckpt->Save(dir, fixture::Deadline());
      }));
  ASSERT_TRUE(saved.ok()) << saved;
  const std::string replicated = absl::StrCat(dir, "/replicated.bin");
  const std::string pristine = ReadAll(replicated);
  ASSERT_EQ(pristine.size(), 8u + 24u);

  ToolRun run = RunTool(absl::StrCat("verify ", dir));
  EXPECT_EQ(run.status, 0) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "3 data files")) << run.output;

  // A flipped byte in "lr" (bytes [8, 32)).
  std::string bytes = pristine;
  bytes[20] ^= 0x01;
  WriteAll(replicated, bytes);
  run = RunTool(absl::StrCat("verify ", dir));
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_TRUE(
      absl::StrContains(run.output, "FAILED data file 'replicated.bin' bytes [8, 32) have CRC-32C"))
      << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "replicated state 'lr' is corrupt")) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "1 problems")) << run.output;

  WriteAll(replicated, pristine.substr(0, 20));
  run = RunTool(absl::StrCat("verify ", dir));
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output,
                                "data file 'replicated.bin' is 20 bytes, the manifest says 32 "
                                "(truncated)"))
      << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "replicated state 'lr' (bytes [8, 32)) lies beyond"))
      << run.output;

  fs::remove(replicated);
  run = RunTool(absl::StrCat("verify ", dir));
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "data file 'replicated.bin' cannot be opened"))
      << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "replicated states 'step', 'lr'")) << run.output;

  WriteAll(replicated, pristine);
  run = RunTool(absl::StrCat("verify ", dir));
  EXPECT_EQ(run.status, 0) << run.output;
}

// Nothing the tool opens may block it: a FIFO in place of the manifest or of a data file is
// refused at once. Each run is bounded by timeout(1): a regression is status 124, not a hang.
TEST_F(CheckpointCliTest, NonRegularFilesAreRefusedAtOnce) {
  const std::string dir = Path("ckpt");
  Save(2, 0, dir, Path("a.safetensors"), Path("b.safetensors"));
  for (const std::string name : {"manifest.json", "shard-00001-of-00002.bin"}) {
    const std::string copy = Path(absl::StrCat("fifo-", name));
    fs::copy(dir, copy);
    const std::string fifo = absl::StrCat(copy, "/", name);
    ASSERT_TRUE(fs::remove(fifo));
    ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0) << std::strerror(errno);
    std::vector<std::string> commands = {"verify " + copy,
                                         absl::StrCat("export ", copy, " ", Path("x.st"))};
    if (name == "manifest.json") commands.push_back("inspect " + copy);
    for (const std::string& command : commands) {
      const ToolRun run = RunTool(command, /*timeout_s=*/20);
      EXPECT_EQ(run.status, 1) << command << "\n" << run.output;
      EXPECT_TRUE(absl::StrContains(run.output, absl::StrCat(name,
                                                             "': not a regular file (it "
                                                             "is a FIFO)")))
          << command << "\n"
          << run.output;
    }
    EXPECT_FALSE(fs::exists(Path("x.st")));
  }
  // A path that is a plain file is not an unfinished save.
  WriteAll(Path("plain"), "x");
  for (const std::string& command : {"verify " + Path("plain"), "inspect " + Path("plain"),
                                     absl::StrCat("export ", Path("plain"), " ", Path("y.st"))}) {
    const ToolRun run = RunTool(command, /*timeout_s=*/20);
    EXPECT_EQ(run.status, 1) << command << "\n" << run.output;
    EXPECT_TRUE(absl::StrContains(run.output, "is a file, not a checkpoint directory"))
        << command << "\n"
        << run.output;
    EXPECT_FALSE(absl::StrContains(run.output, "did not finish")) << run.output;
  }
}

}  // namespace
}  // namespace shardline
