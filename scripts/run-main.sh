#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: the README's first command.
#
# The main job trains the example language model (examples/train_fsdp.cc: a tied embedding/head
# and 10 residual MLP blocks, AdamW, synthetic data) sharded over two processes on the UCX
# backend with the FSDP scheduler: the loss per step, the step time, the exposed communication and
# the communication memory in flight against the budget, then a check of the final parameters
# against a single-process unsharded run, and a merged Chrome trace (build/train_fsdp_trace.json;
# open it in https://ui.perfetto.dev). Then the same under hybrid sharding on 4 ranks (2 x 2) with
# bf16 parameters and 2 micro-batches, the scheduler tour, a two-layer numpy model trained with
# the scheduler from Python (the module pip-installed into .venv/), and a short all-gather
# benchmark.
# The training runs set SHARDLINE_UCX_SPIN_US=0: on a machine with fewer cores than the ranks'
# compute, stream and UCX threads, spinning for a peer steals the core the compute needs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh build
echo
echo "=== sharded training: 2 ranks, full shard, prefetch 1, 192 KiB budget (ucx)"
SHARDLINE_UCX_SPIN_US=0 build/bin/shardline-launch -n 2 -- build/examples/train_fsdp --steps 10 --budget-kib 192 \
  --trace build/train_fsdp_trace.json
echo
echo "=== sharded training: 4 ranks, hybrid 2 x 2, bf16 parameters, 2 micro-batches (ucx)"
SHARDLINE_UCX_SPIN_US=0 build/bin/shardline-launch -n 4 -- build/examples/train_fsdp --steps 10 --strategy hybrid_shard \
  --shard-size 2 --param-dtype bf16 --micro 2 --accumulation defer_all_reduce --trace ""
echo
echo "=== the scheduler API in one page"
build/examples/scheduler_tour
echo
echo "=== from Python: pip install . into .venv, then a numpy model trained with the scheduler"
scripts/install-python.sh --no-torch
.venv/bin/python -m pip install --no-build-isolation --disable-pip-version-check -q . \
  >build-pip.log 2>&1 || { cat build-pip.log; exit 1; }
SHARDLINE_UCX_SPIN_US=0 .venv/bin/shardline-launch -n 2 -- .venv/bin/python examples/python/train_scheduler.py
echo
echo "=== all_gather_perf: 2 ranks, ucx backend"
build/bin/shardline-launch -n 2 -- build/bench/all_gather_perf -b 1M -e 16M -f 4 -c 1
