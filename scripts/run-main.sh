#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: the README's first command.
#
# The main job is the collective benchmark on two local ranks over the UCX backend (nccl-tests'
# output: all-gather and reduce-scatter, 1 MiB to 64 MiB, results checked), then the runtime
# tour: one FSDP forward pass driven by hand over two ranks (casts into place, in-place
# all-gathers on a gather stream, a caching pool bounded by the prefetch limit), which writes a
# Chrome trace to build/runtime_tour.json, then one FSDP step of FlatParameters driven from a
# framework's own streams, events and memory (examples/framework_streams.cc, checked against a
# plain loop). With the scheduler (next issue) it becomes a sharded training demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh build
for collective in all_gather reduce_scatter; do
  echo
  echo "=== ${collective}_perf: 2 ranks, ucx backend"
  build/bin/shardline-launch -n 2 -- "build/bench/${collective}_perf" -b 1M -e 64M -f 4 -c 1
done
echo
echo "=== scheduler tour"
build/examples/scheduler_tour
echo
echo "=== a framework's streams and memory through gathers and reduce-scatters"
build/examples/framework_streams
