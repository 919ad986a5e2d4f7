#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test: the README's second command, and what
# .ci/run calls. Stages, in order (the first failure stops the run):
#   1. build/ (RelWithDebInfo; CUDA sources compile whenever nvcc is present): ctest -L unit,
#      then, three at a time, ctest -L multiprocess (real processes over UCX, started by
#      shardline-launch) and -L multihost (processes on test hosts made of Linux namespaces;
#      skipped, with the reason, where they cannot be created, e.g. without root)
#   2. the installed CMake package, consumed by tests/consumer through find_package(shardline)
#   3. Python: .venv/ and `pip install .` into it (scripts/install-python.sh --module: build
#      tools, pytest, numpy, torch from PyPI once per machine, installed in the background from
#      the start at the lowest priority, log build/python-install.log; build-pip/, beside
#      build/: ccache serves the C++ layers stage 1 compiled, so only the module's own sources
#      compile), pytest tests/python (test_safetensors.py also runs build/bin's
#      checkpoint_fixture and shardline-checkpoint); tests marked `long` are left to
#      scripts/run-long-tests.sh.
#      Meanwhile stages 4 and 5 build in the background at the lowest priority (log:
#      build/sanitizer-prebuild.log), on the cores the Python tests leave idle
#   4. build-asan/ (AddressSanitizer + UndefinedBehaviorSanitizer on the libraries, at -O1 -g1 as
#      a unity build; the test code uninstrumented, compiled as in build/, so ccache serves it from
#      stage 1): ctest -L unit
#   5. build-tsan/ (ThreadSanitizer on the libraries, likewise, and on the test code, at -O0):
#      ctest -L threads (streams, pools, collectives, the store, the scheduler)
#   6. clang-format of every tracked C++ file
#   7. build-fuzz/ (clang, libFuzzer): the store's message decoder, fuzzed for 20 s
# SHARDLINE_TEST_STAGES="1 2" runs a subset. A failure prints the command that reruns just the
# failing test. The slow tiers (sweeps over thousands of seeds) are scripts/run-long-tests.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
source scripts/ccache-env.sh
stages=${SHARDLINE_TEST_STAGES:-1 2 3 4 5 6 7}
jobs=${SHARDLINE_JOBS:-$(nproc)}
ctest_args=(--output-on-failure --no-tests=error -j "$jobs")
want() { [[ " $stages " == *" $1 "* ]]; }
stage() { printf '\n=== %s (%ds)\n' "$1" "$SECONDS"; }

# ctest_run ENV BUILD_DIR CTEST_ARGS...: ctest in BUILD_DIR (ENV: variables the stage sets, or
# ""); when a test fails, prints the command that reruns each failing test alone.
ctest_run() {
  local env=$1 dir=$2
  shift 2
  if env $env ctest --test-dir "$dir" "$@"; then
    return 0
  fi
  echo
  echo "To rerun a failing test alone:"
  local failed=$dir/Testing/Temporary/LastTestsFailed.log
  if [[ -f $failed ]]; then
    local name
    while IFS=: read -r _ name; do
      echo "  ${env:+$env }ctest --test-dir $dir -R '^$name\$' --output-on-failure"
    done <"$failed"
  fi
  exit 1
}

sanitized_build() {  # BUILD_DIR SANITIZERS LABEL
  local dir=$1 sanitize=$2 label=$3
  mkdir -p "$dir"
  # Unity build of the libraries (CMakeLists.txt): half the compile time of a cold build.
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHARDLINE_SANITIZE="$sanitize" \
    -DSHARDLINE_UNITY_BUILD=ON -DSHARDLINE_WITH_CUDA=OFF -DSHARDLINE_BUILD_BENCH=OFF -DSHARDLINE_BUILD_EXAMPLES=OFF \
    >"$dir/configure.log" 2>&1 || { cat "$dir/configure.log"; return 1; }
  # Build only the executables of the tests that carry the label (test name = target name).
  # Scripts (label "script") are not instrumented: they run in stage 1 only.
  local targets
  mapfile -t targets < <(ctest --test-dir "$dir" -N -L "$label" -LE script |
                         sed -n 's/^ *Test *#[0-9]*: //p')
  ((${#targets[@]})) || { echo "no tests labelled $label" >&2; return 1; }
  cmake --build "$dir" -j "$jobs" --target "${targets[@]}"
}

sanitized_tests() {  # BUILD_DIR SANITIZERS LABEL ENV
  local dir=$1 sanitize=$2 label=$3 env=$4
  sanitized_build "$dir" "$sanitize" "$label" || exit 1
  ctest_run "$env" "$dir" -L "$label" -LE script "${ctest_args[@]}"
}

# The Python stage leaves cores idle while its processes wait on one another (collectives,
# deadlines of injected faults): the sanitizer stages' builds take them in the background, at
# the lowest priority so that the tests keep the cores whenever they want them. Stages 4 and 5
# then build what is left (nothing, or what the background build had not reached) and test.
prebuild_pid=""
stop_prebuild() {
  if [[ -n $prebuild_pid ]]; then
    kill -- "-$prebuild_pid" 2>/dev/null || kill "$prebuild_pid" 2>/dev/null || true
    wait "$prebuild_pid" 2>/dev/null || true
    prebuild_pid=""
  fi
}
start_prebuild() {
  local builds=()
  want 4 && builds+=("build-asan address,undefined unit")
  want 5 && builds+=("build-tsan thread threads")
  ((${#builds[@]})) || return 0
  mkdir -p build
  set -m  # its own process group, so that stop_prebuild ends the compilers too
  (
    for b in "${builds[@]}"; do
      read -r dir sanitize label <<<"$b"
      nice -n 19 bash -c "$(declare -f sanitized_build); jobs=$jobs; sanitized_build $dir $sanitize $label" ||
        true  # a failure shows again, with its output, in its own stage
    done
  ) >build/sanitizer-prebuild.log 2>&1 &
  prebuild_pid=$!
  set +m
}

# The Python stage's packages (torch and its CUDA libraries: gigabytes to unpack, a minute of
# CPU) install in the background from the start, at the lowest priority: they take what stage 1
# leaves idle (its multi-process tests mostly wait). Stage 3 waits for them. Never stopped
# halfway (a half-installed torch would look installed to the next run): a run that fails
# earlier waits for it on the way out.
pyinstall_pid=""
wait_pyinstall() {
  if [[ -n $pyinstall_pid ]]; then
    local pid=$pyinstall_pid
    pyinstall_pid=""
    wait "$pid"
  fi
}
trap 'stop_prebuild; wait_pyinstall || true' EXIT

scripts/install-deps.sh

if want 3; then
  mkdir -p build
  nice -n 19 scripts/install-python.sh >build/python-install.log 2>&1 &
  pyinstall_pid=$!
fi

if want 1; then
  stage "1. build and unit tests"
  scripts/build.sh build
  ctest_run "" build -L unit "${ctest_args[@]}"
  # The multi-process and multi-host tests spend most of their time waiting out the deadlines of
  # the faults they inject, not on a core: three at a time take 52 s here against 91 s in a row.
  ctest_run "" build -L 'multiprocess|multihost' --output-on-failure --no-tests=error -j 3
fi

if want 2; then
  stage "2. install and consume the CMake package"
  [[ -d build ]] || scripts/build.sh build
  rm -rf build/install build/consumer
  cmake --install build --prefix build/install >/dev/null
  cmake -S tests/consumer -B build/consumer -G Ninja -DCMAKE_PREFIX_PATH="$root/build/install" \
    >build/consumer-configure.log 2>&1 || { cat build/consumer-configure.log; exit 1; }
  cmake --build build/consumer
  build/consumer/shardline_consumer
  build/consumer/shardline_c_consumer
fi

if want 3; then
  stage "3. Python: pip install . and pytest"
  wait_pyinstall || { cat build/python-install.log; exit 1; }
  start_prebuild
  scripts/install-python.sh --module
  # tests/python/test_safetensors.py runs build/bin/checkpoint_fixture and shardline-checkpoint.
  [[ -x build/bin/checkpoint_fixture && -x build/bin/shardline-checkpoint ]] ||
    scripts/build.sh build -- checkpoint_fixture shardline-checkpoint
  # From tests/python, so that `import shardline` is the installed package.
  if ! (cd tests/python && "$root/.venv/bin/python" -m pytest -q -rf -p no:cacheprovider -m "not long" . |
        tee "$root/build-pytest.log"; exit "${PIPESTATUS[0]}"); then
    echo
    echo "To rerun a failing test alone:"
    sed -n 's/^FAILED \([^ ]*\).*/  (cd tests\/python \&\& ..\/..\/.venv\/bin\/python -m pytest -q "\1")/p' \
      "$root/build-pytest.log"
    exit 1
  fi
fi


# The background build is finished (or is stopped) before the sanitizer stages build and test.
if [[ -n $prebuild_pid ]]; then
  wait "$prebuild_pid" || true
  prebuild_pid=""
fi

if want 4; then
  stage "4. AddressSanitizer + UndefinedBehaviorSanitizer"
  sanitized_tests build-asan address,undefined unit \
    "ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1"
fi

if want 5; then
  stage "5. ThreadSanitizer"
  # UCX's libucm hooks madvise, which crashes TSan-instrumented binaries at thread exit.
  sanitized_tests build-tsan thread threads \
    "UCX_MEM_MMAP_HOOK_MODE=none TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1"
fi

if want 6; then
  stage "6. clang-format"
  mapfile -t files < <(git ls-files '*.h' '*.cc' '*.cu' '*.cuh')
  if ! clang-format --dry-run -Werror "${files[@]}"; then
    echo
    echo "To format the files above: clang-format -i FILE..."
    exit 1
  fi
fi

if want 7; then
  stage "7. fuzzing the store's decoder"
  mkdir -p build-fuzz
  CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DSHARDLINE_WITH_CUDA=OFF \
    -DSHARDLINE_BUILD_BENCH=OFF -DSHARDLINE_BUILD_EXAMPLES=OFF -DSHARDLINE_BUILD_TESTS=ON \
    >build-fuzz/configure.log 2>&1 || { cat build-fuzz/configure.log; exit 1; }
  cmake --build build-fuzz -j "$jobs" --target store_fuzzer
  ctest_run "" build-fuzz -L fuzz "${ctest_args[@]}"
fi

stage "all tests passed"
