#!/usr/bin/env bash
# Runs on a GPU machine from the bundle that scripts/gpu-bundle.sh made (as gpu/run.sh): every
# CUDA/NCCL test, the perf binaries with --backend nccl (world of one), two examples, and
# compute-sanitizer's memcheck on the scheduler, NCCL and allocator tests. NCCL comes from the
# machine (the first libnccl.so.2 under /usr/local, /opt or /usr/lib, e.g. torch's wheel). Logs go
# to $OUT (default /tmp/shardline-gpu); a summary is printed at the end. Then, unless
# SHARDLINE_GPU_HOST_BENCH=0, the scheduler's host benchmarks on that machine's cores (more than
# the 2-core development VM has): scheduler_hooks_bench, and overlap_bench over UCX at 2 and 4
# ranks (JSON and logs in $OUT/host-bench.tgz).
set -u
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/shardline-gpu}
mkdir -p "$OUT"
log=$OUT/gpu.log
exec > >(tee "$log") 2>&1
nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nccl=$(find /usr/local /opt /usr/lib -name 'libnccl.so.2*' 2>/dev/null | head -1)
echo "nccl found: $nccl"
mkdir -p /tmp/ncclib && ln -sf "$nccl" /tmp/ncclib/libnccl.so.2
export LD_LIBRARY_PATH=$PWD/lib:/tmp/ncclib
export SHARDLINE_TIMEOUT_S=60
summary=()
for t in runtime_cuda_stream_test runtime_cuda_kernels_test runtime_cuda_allocator_test runtime_allocator_test \
         runtime_config_test runtime_stream_test runtime_basics_test runtime_phantom_allocator_test \
         collectives_nccl_communicator_test collectives_bootstrap_test scheduler_external_memory_test scheduler_cuda_scheduler_test; do
  [[ -x bin/$t ]] || { summary+=("$t: MISSING"); continue; }
  echo "=== $t"
  start=$(date +%s.%N)
  timeout 150 bin/$t --gtest_color=no > /tmp/$t.log 2>&1; rc=$?
  end=$(date +%s.%N)
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|^\[  SKIPPED \]|Failure|error:' /tmp/$t.log | head -40
  cp /tmp/$t.log $OUT/ 2>/dev/null
  summary+=("$t: rc=$rc $(grep -c '^\[       OK \]' /tmp/$t.log) ok, $(grep -c '^\[  SKIPPED \] [A-Z]' /tmp/$t.log) skipped, $(grep -c '^\[  FAILED  \] [A-Z].*(' /tmp/$t.log) failed, $(awk "BEGIN{printf \"%.1f\", $end - $start}") s")
done
echo "=== c_api_test"; timeout 120 bin/c_api_test > /tmp/c_api.log 2>&1; rc=$?; tail -5 /tmp/c_api.log; summary+=("c_api_test: rc=$rc")
for p in all_reduce_perf all_gather_perf reduce_scatter_perf; do
  echo "=== $p nccl world 1"
  timeout 60 bin/$p --backend nccl -b 8 -e 64M -f 8 -c 1 -n 20 -w 5 2>&1 | tail -14; summary+=("$p: rc=${PIPESTATUS[0]}")
done
echo "=== scheduler_tour / framework_streams"
timeout 60 bin/scheduler_tour > /tmp/tour.log 2>&1; summary+=("scheduler_tour: rc=$?"); tail -3 /tmp/tour.log
timeout 60 bin/framework_streams > /tmp/fs.log 2>&1; summary+=("framework_streams: rc=$?"); tail -3 /tmp/fs.log
if [[ "${SHARDLINE_GPU_HOST_BENCH:-1}" != 0 ]]; then
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
cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
for t in scheduler_cuda_scheduler_test collectives_nccl_communicator_test runtime_cuda_allocator_test; do
  echo "=== memcheck $t"
  timeout 100 $cs --tool memcheck --report-api-errors no --error-exitcode 9 bin/$t --gtest_color=no > /tmp/memcheck_$t.log 2>&1; rc=$?
  grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED) " /tmp/memcheck_$t.log | head -5; summary+=("memcheck $t: rc=$rc")
done
echo "=== SUMMARY"; printf '%s\n' "${summary[@]}"
# tarball of per-test logs (at most 8 files come back)
tar czf $OUT/logs.tgz -C /tmp $(cd /tmp && ls *.log) 2>/dev/null
rm -f $OUT/*_test.log
