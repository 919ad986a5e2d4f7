"""torch's own distributed test suite on the "shardline" backend (tests/python/torch_suite.py runs
it; torch_suite_ids.txt lists the tests gloo passes at 2 ranks).

In the test command: those tests on shardline at 2 ranks, every one of which must pass. In the
long tier (`pytest -m long`): the whole suite on gloo and on shardline at 2, 3 and 8 ranks,
compared test by test: every test gloo passes must pass on shardline; at 2 ranks the committed
list must still be exactly gloo's passes.
"""

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch's test utilities import it
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

HERE = pathlib.Path(__file__).resolve().parent
SUITE = HERE / "torch_suite.py"
IDS = HERE / "torch_suite_ids.txt"

# The only tests gloo passes that shardline may fail, each with its reason. Empty.
EXCEPTIONS = {}


def run_suite(backend, world, out, ids=None, timeout=600):
    cmd = [sys.executable, str(SUITE), backend, str(world), "--out", str(out)]
    if ids is not None:
        cmd += ["--ids", str(ids)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(out.read_text())


def listed_ids():
    lines = (line.split("#")[0].strip() for line in IDS.read_text().splitlines())
    return [line for line in lines if line]


def expect_gloos_passes(shardline, gloo_passed):
    missing = {t: shardline["results"].get(t, "not run") for t in gloo_passed
               if shardline["results"].get(t) != "passed" and t not in EXCEPTIONS}
    details = "\n".join(f"{t}: {status}\n{shardline['tracebacks'].get(t, '')[-3000:]}"
                        for t, status in sorted(missing.items()))
    assert not missing, (f"{len(missing)} of gloo's {len(gloo_passed)} passing tests do not "
                         f"pass on shardline:\n{details}")


def test_shardline_passes_gloos_tests_at_two_ranks(tmp_path):
    ids = listed_ids()
    assert len(ids) >= 90, f"the list holds {len(ids)} tests"
    shardline = run_suite("shardline", 2, tmp_path / "shardline.json", ids=IDS)
    assert sorted(shardline["results"]) == sorted(ids)
    expect_gloos_passes(shardline, ids)


@pytest.mark.long
@pytest.mark.parametrize("world", [2, 3, 8])
def test_shardline_passes_every_test_gloo_passes(world, tmp_path):
    timeout = 600 if world < 8 else 1800
    gloo = run_suite("gloo", world, tmp_path / "gloo.json", timeout=timeout)
    shardline = run_suite("shardline", world, tmp_path / "shardline.json", timeout=timeout)
    passed = sorted(t for t, status in gloo["results"].items() if status == "passed")
    print(f"world {world}: gloo passes {len(passed)}; shardline passes "
          f"{sum(s == 'passed' for s in shardline['results'].values())}")
    expect_gloos_passes(shardline, passed)
    if world == 2:
        assert passed == sorted(listed_ids()), (
            "tests/python/torch_suite_ids.txt is no longer gloo's passing tests at 2 ranks: "
            f"gloo now passes {passed}")
