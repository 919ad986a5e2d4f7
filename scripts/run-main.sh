#!/usr/bin/env bash
# Installs what is missing, builds what the main job runs, and runs it: the README's first command.
#
# The main job trains the example language model (examples/train_fsdp.cc: a tied embedding/head
# and 10 residual MLP blocks, AdamW, synthetic data) sharded over two processes on the UCX
# backend with the FSDP scheduler: the loss per step, the step time, the exposed communication and
# the communication memory in flight against the budget, then a check of the final parameters
# against a single-process unsharded run, and a merged Chrome trace (build/train_fsdp_trace.json;
# open it in https://ui.perfetto.dev). Then the same under hybrid sharding on 4 ranks (2 x 2) with
# bf16 parameters and 2 micro-batches, the scheduler tour, and a short all-gather benchmark.
#
#   scripts/run-main.sh            the above (builds only its own targets: no tests, no benches)
#   scripts/run-main.sh --python   then also a two-layer numpy model trained with the scheduler
#                                  from Python (installs .venv/ and the module: minutes more)
#
# The training runs set SHARDLINE_UCX_SPIN_US=0: on a machine with fewer cores than the ranks'
# compute, stream and UCX threads, spinning for a peer steals the core the compute needs.
set -euo pipefail
cd "$(dirname "$0")/.."
python=0
for arg in "$@"; do
  case $arg in
    --python) python=1 ;;
    *) echo "run-main: unknown argument $arg (--python)" >&2; exit 2 ;;
  esac
done
scripts/install-deps.sh
scripts/build.sh build -- train_fsdp scheduler_tour all_gather_perf
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
echo "=== all_gather_perf: 2 ranks, ucx backend"
build/bin/shardline-launch -n 2 -- build/bench/all_gather_perf -b 1M -e 16M -f 4 -c 1
if ((python)); then
  echo
  echo "=== from Python: .venv and pip install ., then a numpy model trained with the scheduler"
  scripts/install-python.sh --no-torch --module
  SHARDLINE_UCX_SPIN_US=0 .venv/bin/shardline-launch -n 2 -- .venv/bin/python examples/python/train_scheduler.py
else
  echo
  echo "(the same scheduler from Python: scripts/run-main.sh --python)"
fi
