#!/usr/bin/env bash
# Packs the GPU tests of a CUDA build (build/) into gpu/: the test, perf and example binaries that
# touch CUDA or NCCL, stripped, with the shared libraries they need that a bare GPU machine lacks
# (absl, UCX and its cma module, libstdc++, cudart; not libcuda or NCCL, which the machine
# provides), the host benchmarks run on that machine's cores (overlap_bench, scheduler_hooks_bench,
# shardline-launch), plus scripts/gpu-run.sh as gpu/run.sh. Copy gpu/ to a GPU machine and run `bash gpu/run.sh` there
# (OUT=<dir> for the logs). This is how the GPU results in docs/collectives.md were taken.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf gpu; mkdir -p gpu/bin gpu/lib
bins=(tests/runtime_cuda_stream_test tests/runtime_cuda_kernels_test tests/runtime_cuda_allocator_test
      tests/runtime_allocator_test tests/runtime_config_test tests/runtime_stream_test tests/runtime_basics_test
      tests/runtime_phantom_allocator_test tests/collectives_nccl_communicator_test tests/collectives_bootstrap_test
      tests/scheduler_external_memory_test tests/scheduler_cuda_scheduler_test tests/c_api_test bench/all_reduce_perf bench/all_gather_perf
      bench/reduce_scatter_perf examples/scheduler_tour examples/framework_streams
      bench/overlap_bench bench/scheduler_hooks_bench bin/shardline-launch)
for b in "${bins[@]}"; do
  f=$(find build -path "*$b" -type f -perm -u+x | head -1)
  [[ -n "$f" ]] || { echo "missing $b"; continue; }
  if file "$f" | grep -q 'script'; then cp "$f" gpu/bin/; continue; fi
  objcopy --strip-debug "$f" gpu/bin/$(basename "$f")
  ldd "$f" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$lib" in */libc.so*|*/libm.so*|*/libdl.so*|*/libpthread.so*|*/librt.so*|*/ld-linux*|*/libcuda.so*|*/libnccl.so*) ;;
      *) [[ -e gpu/lib/$(basename "$lib") ]] || objcopy --strip-debug "$lib" gpu/lib/$(basename "$lib") ;; esac
  done
done
# UCX loads its cross-memory-attach transport as a module; gpu-run.sh points UCX_MODULE_DIR here.
mkdir -p gpu/lib/ucx
cp -L /usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so.0 gpu/lib/ucx/
cp -L /usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so gpu/lib/ucx/
cp scripts/gpu-run.sh gpu/run.sh
du -sh gpu gpu/bin gpu/lib
