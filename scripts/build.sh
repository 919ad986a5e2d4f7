#!/usr/bin/env bash
# Configures and builds shardline with Ninja (and ccache when present).
#
#   scripts/build.sh [BUILD_DIR] [extra cmake arguments...]
#
# BUILD_DIR defaults to build/. SHARDLINE_JOBS sets the parallelism (default: nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
shift || true
jobs=${SHARDLINE_JOBS:-$(nproc)}
mkdir -p "$build_dir"
cmake -S . -B "$build_dir" -G Ninja "$@" >"$build_dir/configure.log" 2>&1 ||
  { cat "$build_dir/configure.log"; exit 1; }
cmake --build "$build_dir" -j "$jobs"
