"""shardline.torch.save_checkpoint / load_checkpoint and full_state_dict.

A job of 4 processes trains fully_shard_worker.py's model (a root unit and three block units of
odd sizes) with AdamW for 3 steps, saves, and trains 3 more (the uninterrupted run). Jobs of 2
processes (full shard) and of 4 (hybrid 2 x 2) build the model with other values and a fresh
AdamW, load the checkpoint and train the same 3 steps on the same global batches
(tests/python/workers/torch_checkpoint_worker.py). Each rank's shard slices of every parameter
and optimizer state are assembled here into whole tensors: right after the load they equal the
saved ones bit for bit (exp_avg, exp_avg_sq, step); the continued losses and final parameters
match the uninterrupted run within 1e-5 (the gradient reductions add in another order). The
trained model's full_state_dict(rank0_only=True) loads into a plain torch model (strict) whose
outputs equal the sharded model's. In one process: the errors.

Background save: the training job also saves with background=True right after the synchronous
save and trains on while it is written; a job of 2 resumes from it with the same checks (the
checkpoint holds the state at the call, not the one after). Full weights: the trained model's
export_safetensors read by safetensors.torch.load_file equals full_state_dict, loads (strict) into
a plain model with the sharded model's outputs, and its bf16 export equals torch's own rounding;
a file written by safetensors.torch.save_file from a plain model imports at world 2 and 3 (every
element of every shard compared with the file; the outputs with the plain model's).
sync_module_states: ranks seeded differently end with rank 0's parameters and buffers exactly and
train as the plain model does on the global batches.
"""
import json
import math

import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402

import shardline  # noqa: E402
import shardline.torch as slt  # noqa: E402
from fully_shard_worker import Net  # noqa: E402

TOLERANCE = 1e-5
SHAPES = {n: tuple(p.shape) for n, p in Net().named_parameters()}


def run(launch, out, nprocs, ckpt, mode, *args):
    out.mkdir(exist_ok=True)
    result = launch(nprocs, ["torch_checkpoint_worker.py", out, ckpt, mode, *args], timeout=150)
    assert result.returncode == 0, result.describe()
    assert "leaked" not in result.output, result.describe()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nprocs)]


def assemble(files, replicas=1):
    """name -> (whole parameter, {state key: whole tensor or the scalar every rank holds})."""
    parts = [torch.load(f, weights_only=False) for f in files]
    out = {}
    for name, shape in SHAPES.items():
        numel = math.prod(shape)
        param = torch.full((numel,), float("nan"))
        covered = 0
        state = {}
        for part in parts:
            offset, values, st = part[name]
            n = values.numel()
            param[offset:offset + n] = values
            covered += n
            for key, v in st.items():
                if v.dim() == 0:
                    assert state.setdefault(key, v).dtype == v.dtype, (name, key)
                    assert torch.equal(state[key], v), (name, key, state[key], v)
                else:
                    whole = state.setdefault(key, torch.full((numel,), float("nan"), dtype=v.dtype))
                    whole[offset:offset + n] = v
        assert covered == replicas * numel, (name, covered, numel)
        out[name] = (param.reshape(shape), state)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tmp_path_factory.mktemp("torch_ckpt")


def train_once(launch, base):
    ckpt = base / "ckpt"
    if not ckpt.exists():
        ranks = run(launch, base / "train", 4, ckpt, "train")
        assert sorted(p.name for p in ckpt.iterdir())[0] == "manifest.json"
        (base / "train.json").write_text(json.dumps(ranks))
    return ckpt, json.loads((base / "train.json").read_text())


def check_resumed(base, train_ranks, out, ranks, nprocs, replicas):
    saved = assemble([base / "train" / f"saved{r}.pt" for r in range(4)])
    loaded = assemble([out / f"loaded{r}.pt" for r in range(nprocs)], replicas)
    for name, (param, state) in saved.items():
        got_param, got_state = loaded[name]
        assert torch.equal(got_param, param), name
        assert sorted(state) == sorted(got_state) == ["exp_avg", "exp_avg_sq", "step"], name
        for key, value in state.items():
            assert got_state[key].dtype == value.dtype, (name, key)
            assert torch.equal(got_state[key], value), (name, key)
        assert state["step"].item() == 3
    # The global loss of each continued step: the mean of the ranks' local losses (equal parts
    # of one global batch).
    want = [sum(r["losses"][s] for r in train_ranks) / 4 for s in range(3)]
    got = [sum(r["losses"][s] for r in ranks) / nprocs for s in range(3)]
    for g, w in zip(got, want):
        assert abs(g - w) <= TOLERANCE * abs(w), (got, want)
    final = torch.load(base / "train" / "final.pt")
    resumed = torch.load(out / "final.pt")
    assert sorted(final) == sorted(resumed) == sorted(SHAPES)
    for name, w in final.items():
        rel = ((resumed[name] - w).double().norm() / w.double().norm()).item()
        assert rel <= TOLERANCE, (name, rel)
        assert not torch.equal(w, saved[name][0]), name  # it trained after the save


def test_train_at_four_resume_at_two(launch, trained):
    ckpt, train_ranks = train_once(launch, trained)
    out = trained / "resume2"
    ranks = run(launch, out, 2, ckpt, "resume")
    check_resumed(trained, train_ranks, out, ranks, 2, 1)


def test_train_at_four_resume_hybrid_2x2(launch, trained):
    ckpt, train_ranks = train_once(launch, trained)
    out = trained / "hybrid"
    ranks = run(launch, out, 4, ckpt, "resume", "--mesh", "hybrid")
    check_resumed(trained, train_ranks, out, ranks, 4, 2)


def test_background_save_resume_at_two(launch, trained):
    ckpt, train_ranks = train_once(launch, trained)
    out = trained / "resume_bg"
    ranks = run(launch, out, 2, ckpt.parent / (ckpt.name + "-bg"), "resume")
    check_resumed(trained, train_ranks, out, ranks, 2, 1)


def test_export_safetensors_into_a_plain_model(launch, trained):
    _, train_ranks = train_once(launch, trained)
    r0 = train_ranks[0]
    assert r0["export_max_output_difference"] <= 1e-6 * r0["output_norm"], r0


@pytest.mark.parametrize("nprocs", [2, 3])
def test_import_a_plain_models_file(launch, tmp_path, nprocs):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch.manual_seed(99)
    plain = Net()
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path / "plain.safetensors"
    safetensors_torch.save_file(plain.state_dict(), str(path))
    ranks = run(launch, tmp_path / "out", nprocs, path, "import")
    for name, shape in SHAPES.items():
        assert sum(r["checked"][name] for r in ranks) == math.prod(shape), name
    r0 = ranks[0]
    assert r0["output_norm"] > 0
    assert r0["max_output_difference"] <= 1e-6 * r0["output_norm"], r0


def test_sync_module_states(launch, tmp_path):
    ranks = run(launch, tmp_path / "out", 2, tmp_path / "unused", "sync", "--after", "3")
    assert "stat" in ranks[0]["checked"] and "blocks.1.count" in ranks[0]["checked"]
    want = ranks[0]["reference_losses"]
    got = [sum(r["losses"][s] for r in ranks) / 2 for s in range(3)]
    for g, w in zip(got, want):
        assert abs(g - w) <= TOLERANCE * abs(w), (got, want)


def test_full_state_dict_into_a_plain_model(launch, trained):
    _, train_ranks = train_once(launch, trained)
    r0 = train_ranks[0]
    assert r0["output_norm"] > 0
    assert r0["max_output_difference"] <= 1e-6 * r0["output_norm"], r0


# ---- In process: one rank ----------------------------------------------------------------------

class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_errors_and_round_trip_in_process(tmp_path):
    world = shardline.init_local(1, timeout=30)[0]
    torch.manual_seed(3)
    model = Small()
    slt.fully_shard(model.a, mesh=world)
    slt.fully_shard(model, mesh=world)
    model.b.bias.requires_grad_(False)  # frozen: no optimizer state, none after the load
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match="root module"):
        slt.save_checkpoint(nn.Linear(2, 2), None, tmp_path / "x")
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="not the root"):
        slt.save_checkpoint(model.a, opt, tmp_path / "x")
    foreign = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="no fully_shard unit"):
        slt.save_checkpoint(model, foreign, tmp_path / "x")
    slt.save_checkpoint(model, opt, tmp_path / "ok")
    with pytest.raises(shardline.AlreadyExistsError, match="exists"):
        slt.save_checkpoint(model, opt, tmp_path / "ok")
    with pytest.raises(shardline.NotFoundError, match="missing"):
        slt.load_checkpoint(model, opt, tmp_path / "missing")
    # SGD's momentum_buffer round trip: changed after the save, the load restores it exactly.
    frozen = model.b.bias
    assert frozen not in opt.state
    saved = {p: opt.state[p]["momentum_buffer"].clone() for p in model.parameters()
             if p is not frozen}
    params = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    slt.load_checkpoint(model, opt, tmp_path / "ok")
    for p, before in zip(model.parameters(), params):
        assert torch.equal(p.detach(), before)
        if p is frozen:
            assert p not in opt.state
        else:
            assert torch.equal(opt.state[p]["momentum_buffer"], saved[p])
    # The full state dict loads into a plain model with the same outputs.
    plain = Small()
    plain.load_state_dict(slt.full_state_dict(model, cpu_offload=True))
    x = torch.randn(6, 5)
    with torch.no_grad():
        assert torch.equal(plain(x), model(x))


def test_background_steps_weights_and_sync_in_process(tmp_path):
    """One rank: per-parameter AdamW steps that differ survive a background save; a save waits
    for a pending one; import's strictness; the argument errors."""
    world = shardline.init_local(1, timeout=30)[0]
    torch.manual_seed(5)
    model = Small()
    slt.fully_shard(model.a, mesh=world)
    slt.fully_shard(model, mesh=world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(3):
        model(torch.randn(4, 5)).sum().backward()
        if step == 0:
            model.b.bias.grad = None  # b.bias steps twice, the others three times
        opt.step()
        opt.zero_grad()
    steps = {n: opt.state[p]["step"].clone() for n, p in model.named_parameters()}
    assert steps["b.bias"].item() == 2 and steps["a.weight"].item() == 3
    saved = {n: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
             for n, p in model.named_parameters()}
    handle = slt.save_checkpoint(model, opt, tmp_path / "bg", background=True)
    # The optimizer's state is copied once, into the save's own buffers, which the background
    # write reads: the snapshot holds the f32 master shards alone.
    assert handle.stats["snapshot_bytes"] == 4 * sum(p.numel() for p in model.parameters())
    model(torch.randn(4, 5)).sum().backward()  # training goes on meanwhile
    opt.step()
    opt.zero_grad()
    # The next save waits for the pending one (its handle is then done).
    slt.save_checkpoint(model, None, tmp_path / "after")
    assert handle.done and handle.stats["finished"]
    slt.load_checkpoint(model, opt, tmp_path / "bg")
    for n, p in model.named_parameters():
        param, state = saved[n]
        assert torch.equal(p.detach(), param), n
        assert sorted(opt.state[p]) == sorted(state), n
        for k, v in state.items():
            assert opt.state[p][k].dtype == v.dtype and torch.equal(opt.state[p][k], v), (n, k)
    # Full weights: a plain model's file, with an extra tensor only strict=False skips.
    safetensors_torch = pytest.importorskip("safetensors.torch")
    plain = Small()
    extra = dict(plain.state_dict())
    extra["unused"] = torch.ones(3)
    safetensors_torch.save_file(extra, str(tmp_path / "extra.safetensors"))
    with pytest.raises(shardline.InvalidArgumentError, match="unused"):
        slt.import_safetensors(model, tmp_path / "extra.safetensors")
    slt.import_safetensors(model, tmp_path / "extra.safetensors", strict=False)
    x = torch.randn(6, 5)
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
    with pytest.raises(ValueError, match="dtype"):
        slt.export_safetensors(model, tmp_path / "x.safetensors", torch.int32)
    with pytest.raises(TypeError, match="root module"):
        slt.export_safetensors(nn.Linear(2, 2), tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="before fully_shard"):
        slt.sync_module_states(model, mesh=world)
    lone = nn.Linear(3, 2)
    before = lone.weight.detach().clone()
    slt.sync_module_states(lone, mesh=world)  # one rank: its own values
    assert torch.equal(lone.weight.detach(), before)
