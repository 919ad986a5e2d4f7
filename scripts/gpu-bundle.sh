#!/usr/bin/env bash
# Packs the GPU tests of a CUDA build (build/) into gpu/: the test, perf and example binaries that
# touch CUDA or NCCL, stripped, with the shared libraries they need that a bare GPU machine lacks
# (absl, UCX and its cma module, libstdc++, cudart; not libcuda or NCCL, which the machine
# provides), the host benchmarks run on that machine's cores (overlap_bench, scheduler_hooks_bench,
# shardline-launch), plus scripts/gpu-run.sh as gpu/run.sh, and the Python module for CPython 3.12
# with the GPU tests (below). Copy gpu/ to a GPU machine and run `bash gpu/run.sh` there
# (OUT=<dir> for the logs). This is how the GPU results in docs/collectives.md were taken.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf gpu; mkdir -p gpu/bin gpu/lib
bins=(tests/runtime_cuda_stream_test tests/runtime_cuda_kernels_test tests/runtime_cuda_allocator_test
      tests/runtime_allocator_test tests/runtime_config_test tests/runtime_stream_test tests/runtime_basics_test
      tests/runtime_phantom_allocator_test tests/collectives_nccl_communicator_test tests/collectives_bootstrap_test
      tests/scheduler_external_memory_test tests/scheduler_cuda_scheduler_test tests/c_api_test
      tests/collectives_staged_communicator_test bench/all_reduce_perf bench/all_gather_perf
      bench/reduce_scatter_perf examples/scheduler_tour examples/framework_streams
      bench/overlap_bench bench/scheduler_hooks_bench bin/shardline-launch bin/shardline-tune)
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

# The Python module for the GPU machine's CPython 3.12 (beside its own torch): built here with a
# 3.12 interpreter (pyenv's python3.12, or SHARDLINE_PY312), in .venv312/ and build-pip312/
# (ccache serves the C++ layers build/ compiled), stripped, with the libraries it needs that the
# machine lacks; plus the GPU tests (tests/python/test_cuda.py and its workers), train_gpt.py and
# the GPU benchmark driver. SHARDLINE_GPU_PYTHON=0 skips it.
if [[ "${SHARDLINE_GPU_PYTHON:-1}" != 0 ]]; then
  py312=${SHARDLINE_PY312:-}
  if [[ -z "$py312" ]]; then
    for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
      if "$candidate" -c '' 2>/dev/null; then py312=$candidate; break; fi
    done
  fi
  [[ -n "$py312" ]] || { echo "gpu-bundle: no python3.12 (set SHARDLINE_PY312)"; exit 1; }
  [[ -x .venv312/bin/python ]] || "$py312" -m venv .venv312
  .venv312/bin/python -m pip install -q --disable-pip-version-check scikit-build-core nanobind
  source scripts/ccache-env.sh
  rm -rf build-wheel312
  .venv312/bin/python -m pip wheel -q --disable-pip-version-check --no-build-isolation \
      --no-deps -w build-wheel312 -Cbuild-dir=build-pip312 . > build-wheel312.log 2>&1 ||
    { tail -40 build-wheel312.log; exit 1; }
  mkdir -p gpu/python
  (cd gpu/python && python3 -m zipfile -e ../../build-wheel312/shardline-*.whl .)
  rm -rf gpu/python/shardline-*.dist-info
  core=$(ls gpu/python/shardline/_core*.so)
  objcopy --strip-debug "$core"
  ldd "$core" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$lib" in */libc.so*|*/libm.so*|*/libdl.so*|*/libpthread.so*|*/librt.so*|*/ld-linux*|*/libcuda.so*|*/libnccl.so*) ;;
      *) [[ -e gpu/lib/$(basename "$lib") ]] || objcopy --strip-debug "$lib" gpu/lib/$(basename "$lib") ;; esac
  done
  mkdir -p gpu/tests/python/workers
  cp tests/python/conftest.py tests/python/harness.py tests/python/test_cuda.py gpu/tests/python/
  cp tests/python/workers/cuda_fully_shard_worker.py tests/python/workers/cuda_c10d_worker.py \
     gpu/tests/python/workers/
  # The repository's layout, as bench/torch/timeline.py expects it.
  mkdir -p gpu/examples gpu/scripts gpu/bench/torch
  cp examples/train_gpt.py gpu/examples/
  cp scripts/merge_traces.py scripts/plot_timeline.py gpu/scripts/
  cp bench/torch/gpu_bench.py bench/torch/timeline.py gpu/bench/torch/
fi
# One file for the device tool (its working tree travels up to 64 MiB; gpu/ is larger
# uncompressed): carry gpu.tar.xz and run `tar xJf gpu.tar.xz && OUT=$OUT bash gpu/run.sh`.
tar cJf gpu.tar.xz gpu
du -sh gpu gpu/bin gpu/lib gpu.tar.xz
