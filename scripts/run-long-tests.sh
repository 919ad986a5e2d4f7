#!/usr/bin/env bash
# The slow tiers, outside .ci/run: run before resolving an issue whose tests have one.
#
#   scripts/run-long-tests.sh [SEED]
#
# 1. The scheduler's randomized property tests with many more seeds than CI runs: 3,000
#    configurations on virtual time (tests/scheduler/scheduler_property_test.cc) from SEED
#    (default: the time), printed first so that a failure can be rerun with
#    SHARDLINE_PROPERTY_FIRST_SEED=<seed> SHARDLINE_PROPERTY_SEEDS=1.
# SHARDLINE_LONG_SEEDS sets the number of configurations.
# 2. The Python tests marked `long` (pytest -m long in tests/python: the PyTorch headline
#    benchmark's smoke test; torch's distributed suite on gloo and shardline at 2, 3 and 8 ranks,
#    about 10 minutes), against the package scripts/run-tests.sh installed into .venv/.
set -euo pipefail
cd "$(dirname "$0")/.."
seed=${1:-$(date +%s)}
seeds=${SHARDLINE_LONG_SEEDS:-3000}
[[ -x build/tests/scheduler_scheduler_property_test ]] ||
  cmake --build build --target scheduler_scheduler_property_test
echo "run-long-tests: scheduler property test, $seeds configurations from seed $seed"
SHARDLINE_PROPERTY_FIRST_SEED=$seed SHARDLINE_PROPERTY_SEEDS=$seeds \
  build/tests/scheduler_scheduler_property_test \
  --gtest_filter='SchedulerPropertyTest.RandomConfigurationsKeepEveryPromiseOnVirtualTime'
echo "run-long-tests: Python tests marked long"
[[ -x .venv/bin/python ]] || scripts/install-python.sh --module
(cd tests/python && ../../.venv/bin/python -m pytest -q -rf -p no:cacheprovider -m long .)
echo "run-long-tests: all passed (seed $seed)"
