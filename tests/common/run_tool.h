// File: tests/common/run_tool.h
// Runs a command-line tool as a process, as a user would, and returns its exit status and its
// output: the harness of the tests of shardline-checkpoint and shardline-tune.
//
//   ToolRun run = RunTool(SHARDLINE_TUNE_BIN, "sweep --help");
//   EXPECT_EQ(run.status, 0) << run.output;

#ifndef SHARDLINE_TESTS_COMMON_RUN_TOOL_H_
#define SHARDLINE_TESTS_COMMON_RUN_TOOL_H_

#include <stdio.h>
#include <sys/wait.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace shardline::testing {

struct ToolRun {
  int status = -1;     // the exit status; -1 if the tool could not start or died of a signal
  std::string output;  // stdout and stderr
};

// Runs `binary` with `args` (shell words) through the shell, bounded in time by timeout(1):
// status 124 if it is still running after `timeout_s` seconds.
inline ToolRun RunTool(absl::string_view binary, absl::string_view args, int timeout_s = 120) {
  const std::string command = absl::StrCat("timeout ", timeout_s, " ", binary, " ", args, " 2>&1");
  ToolRun run;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return run;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) run.output.append(buffer, n);
  const int raw = pclose(pipe);
  run.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  return run;
}

}  // namespace shardline::testing

#endif  // SHARDLINE_TESTS_COMMON_RUN_TOOL_H_
