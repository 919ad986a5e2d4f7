#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: the README's first command.
#
# The main job grows with the project. Today it is the runtime tour (streams overlapping a
# simulated gather with compute, the caching pool's accounting, casts, a Chrome trace written
# to build/runtime_tour.json) followed by the host-kernel microbenchmark (reduce and cast
# throughput next to memcpy). When the collectives land it becomes the collective benchmark on
# two local ranks over UCX, and with the scheduler, a sharded training demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh build
echo
echo "=== runtime tour"
build/examples/runtime_tour --trace build/runtime_tour.json
echo
echo "=== host kernels next to memcpy"
build/bench/kernels_bench --benchmark_min_time=0.05 --benchmark_counters_tabular=true
