#!/usr/bin/env bash
# Configures and builds shardline with Ninja (and ccache when present).
#
#   scripts/build.sh [BUILD_DIR] [extra cmake arguments...] [-- TARGET...]
#
# BUILD_DIR defaults to build/. Targets after `--` build only those (and what they need); without
# them, everything. SHARDLINE_JOBS sets the parallelism (default: nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ccache-env.sh
build_dir=${1:-build}
shift || true
cmake_args=()
targets=()
while (($#)); do
  if [[ $1 == -- ]]; then
    shift
    targets=("$@")
    break
  fi
  cmake_args+=("$1")
  shift
done
jobs=${SHARDLINE_JOBS:-$(nproc)}
mkdir -p "$build_dir"
cmake -S . -B "$build_dir" -G Ninja "${cmake_args[@]}" >"$build_dir/configure.log" 2>&1 ||
  { cat "$build_dir/configure.log"; exit 1; }
if ((${#targets[@]})); then
  cmake --build "$build_dir" -j "$jobs" --target "${targets[@]}"
else
  cmake --build "$build_dir" -j "$jobs"
fi
