#!/usr/bin/env bash
# Runs on a GPU machine from the bundle that scripts/gpu-bundle.sh made (as gpu/run.sh), in order
# of priority, each tier bounded (tiers 1-3 fit in about 6 minutes on an H200):
#   1. the PyTorch side on the GPU: tests/python/test_cuda.py (fully_shard of a CUDA model against
#      one process: world 1 over NCCL, 2 and 4 ranks sharing the GPU over ucx staged through host
#      memory; the "shardline" c10d backend on CUDA tensors), with the module built for the
#      machine's CPython 3.12 and its own torch;
#   2. every CUDA/NCCL C++ test;
#   3. compute-sanitizer memcheck and racecheck on the scheduler's CUDA test and on one
#      fully_shard step (it refuses the device on one of the runtimes these machines come up on:
#      the log says where it ran);
#   4. the GPU benchmark (bench/torch/gpu_bench.py: train_gpt at world 1, plain vs fully_shard
#      vs FSDP2, and the c10d backend against nccl) and a world-2 timeline picture;
#   5. the perf binaries with --backend nccl (world of one), two examples, and unless
#      SHARDLINE_GPU_HOST_BENCH=0 the scheduler's host benchmarks on the machine's cores.
# SHARDLINE_GPU_TIERS="1 2 3" runs those tiers only. NCCL comes from the machine (the first
# libnccl.so.2 under /usr/local, /opt or /usr/lib, e.g. torch's wheel). Logs go to $OUT (default
# /tmp/shardline-gpu); a summary is printed at the end.
set -u
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/shardline-gpu}
TIERS=" ${SHARDLINE_GPU_TIERS:-1 2 3 4 5} "
tier() { [[ "$TIERS" == *" $1 "* ]]; }
mkdir -p "$OUT"
log=$OUT/gpu.log
exec > >(tee "$log") 2>&1
nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nccl=$(find /usr/local /opt /usr/lib -name 'libnccl.so.2*' 2>/dev/null | head -1)
echo "nccl found: $nccl"
mkdir -p /tmp/ncclib && ln -sf "$nccl" /tmp/ncclib/libnccl.so.2
export LD_LIBRARY_PATH=$PWD/lib:/tmp/ncclib
export UCX_MODULE_DIR=$PWD/lib/ucx
export SHARDLINE_TIMEOUT_S=60
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
python3 -c "import torch, shardline; print('python', __import__('sys').version.split()[0], 'torch', torch.__version__, 'shardline', shardline.__version__, 'cuda', torch.cuda.is_available())"
summary=()
if tier 1 && [[ -d python ]]; then
  echo "=== tier 1: pytest tests/python/test_cuda.py"
  start=$(date +%s)
  (cd tests/python && timeout 330 python3 -m pytest -q -rA -p no:cacheprovider test_cuda.py \
     > /tmp/pytest_cuda.log 2>&1); rc=$?
  tail -40 /tmp/pytest_cuda.log;
  summary+=("pytest test_cuda.py: rc=$rc, $(( $(date +%s) - start )) s: $(tail -1 /tmp/pytest_cuda.log)")
fi
tier 2 && for t in runtime_cuda_stream_test runtime_cuda_kernels_test runtime_cuda_allocator_test runtime_allocator_test \
         runtime_config_test runtime_stream_test runtime_basics_test runtime_phantom_allocator_test \
         collectives_nccl_communicator_test collectives_staged_communicator_test collectives_bootstrap_test \
         scheduler_external_memory_test scheduler_cuda_scheduler_test; do
  [[ -x bin/$t ]] || { summary+=("$t: MISSING"); continue; }
  echo "=== $t"
  start=$(date +%s.%N)
  timeout 150 bin/$t --gtest_color=no > /tmp/$t.log 2>&1; rc=$?
  end=$(date +%s.%N)
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|^\[  SKIPPED \]|Failure|error:' /tmp/$t.log | head -40
  cp /tmp/$t.log $OUT/ 2>/dev/null
  summary+=("$t: rc=$rc $(grep -c '^\[       OK \]' /tmp/$t.log) ok, $(grep -c '^\[  SKIPPED \] [A-Z]' /tmp/$t.log) skipped, $(grep -c '^\[  FAILED  \] [A-Z].*(' /tmp/$t.log) failed, $(awk "BEGIN{printf \"%.1f\", $end - $start}") s")
done
if tier 2; then
  echo "=== c_api_test"; timeout 120 bin/c_api_test > /tmp/c_api.log 2>&1; rc=$?; tail -5 /tmp/c_api.log; summary+=("c_api_test: rc=$rc")
fi
if tier 3; then
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  echo "=== tier 3: compute-sanitizer ($cs) on $(uname -r)"
  for tool in memcheck racecheck; do
    timeout 120 $cs --tool $tool --error-exitcode 9 bin/scheduler_cuda_scheduler_test --gtest_color=no \
        > /tmp/${tool}_scheduler.log 2>&1; rc=$?
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) |rror" /tmp/${tool}_scheduler.log | head -5
    summary+=("$tool scheduler_cuda_scheduler_test: rc=$rc")
    if [[ -d python ]]; then
      RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29577 \
        timeout 200 $cs --tool $tool --error-exitcode 9 --target-processes all python3 \
        tests/python/workers/cuda_fully_shard_worker.py /tmp/sanitized.json --variants full_shard \
        --steps 2 > /tmp/${tool}_fully_shard.log 2>&1; rc=$?
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|full_shard|rror" /tmp/${tool}_fully_shard.log | head -5
      summary+=("$tool fully_shard step: rc=$rc")
    fi
  done

fi
if tier 4 && [[ -d python ]]; then
  echo "=== tier 4: bench/torch/gpu_bench.py"
  timeout 420 python3 bench/torch/gpu_bench.py --out $OUT > /tmp/gpu_bench.log 2>&1; rc=$?
  tail -20 /tmp/gpu_bench.log; summary+=("gpu_bench: rc=$rc")
  echo "=== the simulator's prediction for that model at world 1 (dgx-h100's device; GPT's MLP"
  echo "    as a gated FFN of 5461 for the same FLOPs): compare its step_ms with fully_shard's"
  bin/shardline-tune sweep --model llama3-8b --layers 24 --hidden 2048 --ffn 5461 --heads 16 \
      --kv-heads 16 --vocab 32768 --seq-len 2048 --micro-batch 2 --topology dgx-h100 --world 1 \
      --strategies full --param-dtypes bf16 --reduce-dtypes f32 --checkpointing off \
      --forward-prefetch 1 --top 1 --no-progress 2>&1 | tail -3
  echo "=== world 2 sharing the GPU (ucx staged): a timeline"
  timeout 150 python3 bench/torch/timeline.py --out $OUT/world2_timeline.png --ranks 2 \
      --steps 4 --keep /tmp/w2 -- --device cuda --dtype bfloat16 --dim 1024 --layers 8 \
      --seq 1024 --vocab 8192 > /tmp/world2.log 2>&1; rc=$?
  tail -8 /tmp/world2.log; summary+=("world 2 staged timeline: rc=$rc")
fi
tier 5 && for p in all_reduce_perf all_gather_perf reduce_scatter_perf; do
  echo "=== $p nccl world 1"
  timeout 60 bin/$p --backend nccl -b 8 -e 64M -f 8 -c 1 -n 20 -w 5 2>&1 | tail -14; summary+=("$p: rc=${PIPESTATUS[0]}")
done
if tier 5; then
  echo "=== scheduler_tour / framework_streams"
  timeout 60 bin/scheduler_tour > /tmp/tour.log 2>&1; summary+=("scheduler_tour: rc=$?"); tail -3 /tmp/tour.log
  timeout 60 bin/framework_streams > /tmp/fs.log 2>&1; summary+=("framework_streams: rc=$?"); tail -3 /tmp/fs.log
fi
if tier 5 && [[ "${SHARDLINE_GPU_HOST_BENCH:-1}" != 0 ]]; then
  export UCX_MODULE_DIR=$PWD/lib/ucx
  hb=/tmp/host-bench; mkdir -p $hb
  echo "=== host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), load $(cut -d' ' -f1-3 /proc/loadavg)"
  timeout 120 bin/scheduler_hooks_bench --benchmark_min_time=0.5 --benchmark_repetitions=3 \
      --benchmark_report_aggregates_only=true --benchmark_out=$hb/hooks.json \
      --benchmark_out_format=json > $hb/hooks.log 2>&1
  summary+=("scheduler_hooks_bench: rc=$?"); grep -E "median" $hb/hooks.log | head -16
  run_overlap() {  # name, ranks, spin, overlap_bench flags...
    local name=$1 n=$2 spin=$3; shift 3
    echo "=== overlap_bench $name (-n $n, SHARDLINE_UCX_SPIN_US=$spin) $*"
    SHARDLINE_UCX_SPIN_US=$spin timeout 150 bin/shardline-launch -n "$n" -- bin/overlap_bench \
        --json $hb/overlap_$name.json "$@" > $hb/overlap_$name.log 2>&1
    local rc=$?; summary+=("overlap_bench $name: rc=$rc"); grep -E "^\| |calibrat" $hb/overlap_$name.log | head -14
  }
  run_overlap n2_auto_spin0 2 0
  run_overlap n2_auto_spin2000 2 2000
  run_overlap n2_4M_spin0 2 0 --unit-bytes 4M
  run_overlap n4_auto_spin0 4 0
  tar czf $OUT/host-bench.tgz -C /tmp host-bench
fi
echo "=== SUMMARY"; printf '%s\n' "${summary[@]}"
# tarball of per-test logs (at most 8 files come back)
tar czf $OUT/logs.tgz -C /tmp $(cd /tmp && ls *.log) 2>/dev/null
rm -f $OUT/*_test.log
