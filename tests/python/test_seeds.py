"""The FSDP1 snippets of the project's background documents (../shared/seeds/), completed into
the scripts of tests/python/seeds/ (each quotes its snippet and says what it changed), run on
shardline's FullyShardedDataParallel at 2 ranks: the losses and every final weight (the wrapped
model's FULL_STATE_DICT, under the plain model's names) match one process on the same global
batches (fp32 within 1e-5 relative; the bfloat16 snippet's losses within bfloat16's resolution,
1e-2, of an autocast run), and the losses equal torch's own FSDP1 (which runs on the CPU with
gloo here, except with CPU offload) to the printed digits, its weights within 1e-6. CI runs
torch's FSDP1 beside the bfloat16 script; the long tier beside the
others."""
import contextlib
import io
import pathlib
import runpy
import sys

import pytest

torch = pytest.importorskip("torch")

SEEDS = pathlib.Path(__file__).resolve().parent / "seeds"
SCRIPTS = ["tutorial_fsdp_basic.py", "tutorial_fsdp_full_shard.py",
           "tutorial_fsdp_auto_wrap.py", "tutorial_fsdp_cpu_offload.py",
           "paper_fsdp_mixed_precision.py"]
WITH_TORCH_IN_CI = {"paper_fsdp_mixed_precision.py"}
# torch's FSDP1 with CPUOffload(offload_params=True) pins memory through CUDA: without a GPU it
# fails ("Found no NVIDIA driver"), so that script is compared with one process only.
TORCH_FAILS_ON_CPU = {"tutorial_fsdp_cpu_offload.py"}


def losses(output):
    out = []
    for line in output.splitlines():
        if ">: " in line:
            line = line.split(">: ", 1)[1]
        if line.startswith("step "):
            out.append(float(line.split("loss ")[1]))
    return out


def run_script(launch, tmp_path, script, *flags):
    out = tmp_path / ("torch" if "--torch" in flags else "shardline")
    out.mkdir()
    result = launch(2, [SEEDS / script, "--out", out, *flags], timeout=150)
    assert result.returncode == 0, result.describe()
    return result, torch.load(out / "0.pt")


def run_single(script, out):
    """The script with --single in this process (torch is imported already): its stdout."""
    argv, path = sys.argv, list(sys.path)
    sys.argv = [str(SEEDS / script), "--single", "--out", str(out)]
    sys.path.insert(0, str(SEEDS))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(SEEDS / script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path
    return printed.getvalue()


def check(launch, tmp_path, script, with_torch):
    sharded, weights = run_script(launch, tmp_path, script)
    single = run_single(script, tmp_path)
    reference = torch.load(tmp_path / "single.pt")
    tolerance = 1e-2 if "mixed_precision" in script else 1e-5
    got, want = losses(sharded.output), losses(single)
    assert len(got) == len(want) == 4, (sharded.output, single)
    for g, w in zip(got, want):
        assert abs(g - w) <= tolerance * w, (got, want)
    assert sorted(weights) == sorted(reference), (sorted(weights), sorted(reference))
    if "mixed_precision" not in script:  # (autocast is not FSDP's bfloat16: see below)
        for name, w in reference.items():
            rel = ((weights[name] - w).norm() / w.norm()).item()
            assert rel <= tolerance, (name, rel)
    if "auto_wrap" in script:  # the printed structure: one wrapper per Linear
        assert sharded.output.count("FullyShardedDataParallel(") == 1 + 8, sharded.output
        assert "(_fsdp_wrapped_module): Linear(" in sharded.output, sharded.output
    if with_torch:
        theirs, their_weights = run_script(launch, tmp_path, script, "--torch")
        assert losses(theirs.output) == got, (theirs.output, got)
        for name, w in their_weights.items():
            rel = ((weights[name] - w).norm() / w.norm()).item()
            assert rel <= 1e-6, (name, rel)


@pytest.mark.parametrize("script", SCRIPTS)
def test_seed_snippet_runs_on_shardline(launch, tmp_path, script):
    check(launch, tmp_path, script, script in WITH_TORCH_IN_CI)


@pytest.mark.long
@pytest.mark.parametrize("script", sorted(set(SCRIPTS) - WITH_TORCH_IN_CI - TORCH_FAILS_ON_CPU))
def test_seed_snippet_against_torchs_fsdp1(launch, tmp_path, script):
    check(launch, tmp_path, script, True)
