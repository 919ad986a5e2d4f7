"""The torch.distributed backend "shardline" (shardline.torch): collectives value-checked against
plain-torch references, torch's FSDP2 and DDP against gloo and a one-process run, errors, a dead
peer, and the store adapter under it (shardline._core.init_with_store).

The two-rank runs are tests/python/workers/torch_backend_worker.py under shardline.launch; each
launch runs all of its checks once and the tests below read its per-rank results.
"""
import json
import pathlib
import re
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import numpy as np  # noqa: E402

import shardline  # noqa: E402
import shardline.torch  # noqa: E402,F401

WORKER = pathlib.Path(__file__).resolve().parent / "workers" / "torch_backend_worker.py"


def launch(*args, timeout=150):
    return subprocess.run(
        [sys.executable, "-m", "shardline.launch", "-n", "2", "--grace", "20", "--",
         sys.executable, str(WORKER), *args],
        capture_output=True, text=True, timeout=timeout)


def run_worker(mode, out_dir):
    result = launch(mode, str(out_dir))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    return ranks, output


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """init_process_group("shardline"): a ProcessGroupShardline."""
    return run_worker("run", tmp_path_factory.mktemp("shardline_alone"))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """init_process_group("cpu:shardline,cuda:gloo"): shardline as the CPU Backend."""
    return run_worker("mixed", tmp_path_factory.mktemp("shardline_mixed"))


def section(ranks, name, at_least):
    for rank, result in enumerate(ranks):
        failures = result["failures"].get(name, [])
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
        assert len(result["passed"].get(name, [])) >= at_least, (rank, result["passed"])


def test_base_package_does_not_import_torch():
    code = "import sys, shardline; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_entry_point_registers_the_backend_without_the_import():
    from importlib.metadata import entry_points
    if not any(e.name == "shardline" for e in entry_points(group="torch.distributed.backends")):
        pytest.skip("shardline is not pip-installed here (no entry point)")
    code = "\n".join([
        "import sys, torch, torch.distributed as dist",
        "dist.init_process_group('shardline', rank=0, world_size=1, store=dist.HashStore())",
        "t = torch.ones(3)",
        "dist.all_reduce(t)",
        "assert dist.get_backend() == 'shardline' and 'shardline.torch' in sys.modules",
        "dist.destroy_process_group()",
    ])
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_backend_is_registered_for_cpu():
    assert "shardline" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["shardline"] == ["cpu"]


@pytest.mark.parametrize("which", ["alone", "mixed"])
def test_collectives_match_references(which, request):
    ranks, _ = request.getfixturevalue(which)
    expected_class = "ProcessGroupShardline" if which == "alone" else "BackendShardline"
    assert [r["cpu_class"] for r in ranks] == [expected_class] * 2
    # 2 dtypes x 3 sizes x (6 all_reduce + 6 reduce_scatter + all_gather + broadcast +
    # all_to_all), coalesced, views, other dtypes, edge shapes, futures, shardline.init().
    section(ranks, "collectives", 2 * 3 * 15 + 6)


@pytest.mark.parametrize("which", ["alone", "mixed"])
def test_point_to_point_and_rooted_ops_match_references(which, request):
    """send/recv, isend/irecv from any rank, batch_isend_irecv, reduce (every op, every root),
    gather, scatter and their object variants, all-to-all with unequal splits, monitored_barrier
    (alone: it needs the group's CPU backend), the ops gloo has against gloo's results in f64,
    bf16 and f32, and the bytes each rank sends in reduce, gather and scatter
    (workers/torch_p2p_checks.py)."""
    ranks, _ = request.getfixturevalue(which)
    section(ranks, "p2p", 2 * 2 * 6 + 7 + (1 if which == "alone" else 0))


@pytest.mark.parametrize("which", ["alone", "mixed"])
def test_errors_name_the_collective(which, request):
    ranks, _ = request.getfixturevalue(which)
    section(ranks, "errors", 6)


@pytest.mark.parametrize("which", ["alone", "mixed"])
def test_fsdp2_same_losses_as_gloo_and_one_process(which, request):
    ranks, _ = request.getfixturevalue(which)
    section(ranks, "fsdp2", 1)
    for r in ranks:
        assert len(r["fsdp2_shardline"]) == 3


@pytest.mark.parametrize("which", ["alone", "mixed"])
def test_ddp_same_losses_as_gloo_and_one_process(which, request):
    ranks, _ = request.getfixturevalue(which)
    section(ranks, "ddp", 1)
    assert ranks[0]["ddp_shardline"] != ranks[1]["ddp_shardline"]  # each rank its own batch


def test_no_leaked_native_objects(alone, mixed):
    for _, output in (alone, mixed):
        assert "leaked" not in output, output


def test_dead_peer_fails_the_collective_within_the_deadline():
    # Rank 1 exits after the first collective; rank 0's next all_reduce must fail (group
    # timeout 6 s) naming the collective, not hang.
    t0 = time.monotonic()
    result = launch("kill", timeout=90)
    output = result.stdout + result.stderr
    assert result.returncode == 7, output  # the launcher reports rank 1's exit status
    match = re.search(r"rank 0: (\w+) after ([\d.]+) s: (.*)", result.stdout)
    assert match, output
    assert float(match.group(2)) < 6 + 10, output
    assert "allreduce" in match.group(3) and "rank 1" in match.group(3), output
    assert time.monotonic() - t0 < 60


# ---- init_with_store in one process --------------------------------------------------------


def test_init_with_store_two_threads_over_a_torch_store():
    store = dist.HashStore()
    results = {}

    def rank(r):
        try:
            comm = shardline.init_with_store(dist.PrefixStore("job", store), r, 2, timeout=20,
                                             name="threads")
            x = np.arange(11, dtype=np.float32) * (r + 1)
            comm.all_reduce(x).wait(timeout=20)
            # A subgroup's creation goes through the store too (GIL taken again per call).
            dup = comm.dup(timeout=20)
            dup.all_reduce(x, op="max").wait(timeout=20)
            results[r] = x
        except Exception as e:  # noqa: BLE001 - reported below
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in range(2):
        assert isinstance(results.get(r), np.ndarray), results
        np.testing.assert_array_equal(results[r], np.arange(11, dtype=np.float32) * 3)


def test_init_with_store_times_out_naming_the_missing_rank():
    t0 = time.monotonic()
    with pytest.raises(shardline.DeadlineExceededError, match="rank"):
        shardline.init_with_store(dist.HashStore(), 0, 2, timeout=1.0)
    assert time.monotonic() - t0 < 15


def test_init_with_store_reports_the_store_error():
    class Failing:
        def __getattr__(self, method):
            def fail(*args):
                raise KeyError(f"no luck in {method}")
            return fail

    with pytest.raises(shardline.Error, match="torch store add of .*KeyError.*no luck in add"):
        shardline.init_with_store(Failing(), 0, 2, timeout=2.0)


def test_init_with_store_refuses_what_is_not_a_store():
    with pytest.raises(shardline.InvalidArgumentError, match="no method 'set'"):
        shardline.init_with_store(object(), 0, 2)
    with pytest.raises(shardline.InvalidArgumentError, match="rank 2"):
        shardline.init_with_store(dist.HashStore(), 2, 2)
