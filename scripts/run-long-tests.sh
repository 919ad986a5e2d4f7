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
echo "run-long-tests: all passed (seed $seed)"
