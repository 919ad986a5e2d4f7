"""torch's own distributed test suite (`DistributedTest._DistTestBase` of
torch/testing/_internal/distributed/distributed_test.py) on a backend, as torch's
test_distributed_spawn.py runs it, but with forked processes (a test costs a fork, not a fresh
interpreter importing torch).

    torch_suite.py BACKEND WORLD_SIZE [--ids FILE] [--out FILE.json]

BACKEND: shardline or gloo. --ids: run only the test ids listed in FILE (one per line, `#`
comments); without it, every test of the suite. Prints one line per test and, with --out, writes
{test id: "passed" | "failed" | "skipped: <reason>"} and every failure's traceback.

How shardline is admitted. First as torch's plugin-backend tests (torch_ucc's) admit theirs:
before the suite is imported, "shardline" joins DistTestCases.backend_feature["ddp"],
["subgroup"] and ["plugin"] (not "gpu" or "cuda": shardline's torch backend moves CPU tensors).
Then, so that shardline is held to every test gloo runs and not to a smaller set, shardline
stands in for gloo: the suite is imported with BACKEND=gloo, so that its decorators, which gate
tests on a backend's name as the module is imported ("Only gloo backend supports timeouts",
require_backend_is_available({"gloo"})), select exactly gloo's tests; the tests' own code also
reads BACKEND as "gloo" (test_accumulate_gradients_no_sync builds its DDP model only for gloo,
mpi and nccl), except in the tests that check the default group's name (_CHECK_THE_NAME), which
read "shardline"; and every init_process_group the suite makes with gloo makes shardline's
group. Groups a test asks gloo for by name with new_group(backend="gloo") stay gloo's.
"""

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import unittest


# Tests that compare the default group's backend name with BACKEND: their code reads "shardline".
_CHECK_THE_NAME = {"test_get_backend"}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("backend", choices=["shardline", "gloo"])
    parser.add_argument("world_size", type=int)
    parser.add_argument("--ids", help="a file of test ids to run")
    parser.add_argument("--out", help="where to write the results (JSON)")
    return parser.parse_args()


def main():
    args = parse_args()
    os.environ["BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world_size)
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="torch_suite_"))
    # The suite's processes log every start at INFO.
    import logging
    logging.disable(logging.INFO)

    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.testing._internal.common_distributed import DistTestCases
    if args.backend == "shardline":
        for feature in ("ddp", "subgroup", "plugin"):
            DistTestCases.backend_feature[feature].add("shardline")
        import shardline.torch  # noqa: F401 - registers the backend
        # Decided for gloo, the gates the suite decides as it is imported select gloo's tests.
        os.environ["BACKEND"] = "gloo"
    from torch.testing._internal.distributed import distributed_test
    from torch.testing._internal.distributed.distributed_test import (DistributedTest,
                                                                       TestDistBackend)
    if args.backend == "shardline":
        real_init = dist.init_process_group

        def init_process_group(*a, **kw):
            # The default group of every test is shardline's.
            if kw.get("backend") in ("gloo", dist.Backend.GLOO):
                kw["backend"] = "shardline"
            return real_init(*a, **kw)
        dist.init_process_group = init_process_group

    class Suite(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            if args.backend == "shardline":
                # What the test's own code reads as the backend's name: "gloo" (shardline stands
                # in for it), except in the tests that check the name itself.
                name = self._testMethodName
                stand_in = "shardline" if name in _CHECK_THE_NAME else "gloo"
                os.environ["BACKEND"] = distributed_test.BACKEND = stand_in
            self._start_processes(mp.get_context("fork").Process)

    names = sorted(n for n in dir(Suite) if n.startswith("test_"))
    if args.ids:
        with open(args.ids) as f:
            wanted = [line.split("#")[0].strip() for line in f]
        wanted = [w for w in wanted if w]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            sys.exit(f"torch_suite: not tests of this torch's suite: {', '.join(unknown)}")
        names = wanted

    results, tracebacks = {}, {}

    class Result(unittest.TestResult):
        def startTest(self, test):
            super().startTest(test)
            self._t0 = time.monotonic()

        def _record(self, test, status, err=None):
            name = test.id().split(".")[-1]
            results[name] = status
            if err is not None:
                tracebacks[name] = "".join(traceback.format_exception(*err))
            took = time.monotonic() - self._t0
            print(f"{name}: {status.splitlines()[0]} ({took:.1f} s)", flush=True)

        def addSuccess(self, test):
            self._record(test, "passed")

        def addFailure(self, test, err):
            self._record(test, "failed", err)

        def addError(self, test, err):
            self._record(test, "failed", err)

        def addSkip(self, test, reason):
            self._record(test, f"skipped: {reason}")

        def addExpectedFailure(self, test, err):
            self._record(test, "passed")

        def addUnexpectedSuccess(self, test):
            self._record(test, "failed")

    t0 = time.monotonic()
    unittest.TestSuite(Suite(n) for n in names).run(Result())
    counts = {}
    for status in results.values():
        key = status.split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    print(f"torch_suite {args.backend} world {args.world_size}: {counts} in "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"backend": args.backend, "world_size": args.world_size,
                       "results": results, "tracebacks": tracebacks}, f, indent=1)


if __name__ == "__main__":
    main()
