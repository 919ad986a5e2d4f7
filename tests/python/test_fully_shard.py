"""shardline.torch.fully_shard: FSDP2's interface on shardline's scheduler.

Multi-process runs (tests/python/workers/fully_shard_worker.py under shardline.launch, 2 and 4
ranks) train a small model with AdamW and compare every rank's shard slices of the gradients
(after the first backward) and of the parameters (after the last step) with the same training in
one process on the global batch: the slices of all ranks must cover every element of every
tensor exactly once (per replica) and match within a per-tensor relative norm of 1e-5 (f32).
Each rank trains on its own part of the batch, so without the adapter's gradient reduction the
parameters would follow the local batches and miss the reference by far more than that.

In-process runs (a world of one rank, shardline.init_local(1)) check what needs no peers: the
forward views moving between the forward and the backward gather (the saved-tensor hooks),
frozen parameters, a parameter used twice in one unit, and the errors.
"""
import collections
import dataclasses
import json
import math
import typing

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import shardline  # noqa: E402
import shardline.torch as slt  # noqa: E402
from shardline.torch import _fsdp_state  # noqa: E402

TOLERANCE = 1e-5


def run_worker(launch, tmp_path, nprocs, *args):
    result = launch(nprocs, ["fully_shard_worker.py", tmp_path, *args], timeout=150)
    assert result.returncode == 0, result.describe()
    assert "leaked" not in result.output, result.describe()  # nanobind's exit check
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nprocs)]
    assert [r["rank"] for r in ranks] == list(range(nprocs))
    check_default_world(ranks)
    return ranks


def check_default_world(ranks):
    """shardline.torch.get_default_world(): the same communicator at every call and the one the
    root's scheduler shards over (mesh None or a DeviceMesh), of the launcher's rank and size; an
    all-reduce over it sums the ranks."""
    n = len(ranks)
    for r in ranks:
        d = r["default_world"]
        assert d["same"] and d["scheduler_world"], d
        assert (d["rank"], d["size"]) == (r["rank"], n), d
        assert d["rank_sum"] == n * (n - 1) / 2, d


def check_parity(ranks, *, replicas=1):
    """Per tensor: the ranks' slices cover it `replicas` times and match the reference."""
    for kind in ("grads", "params"):
        for name, (_, _, numel, _, ref_sq) in ranks[0][kind].items():
            covered = sum(r[kind][name][1] for r in ranks)
            assert covered == replicas * numel, (kind, name, covered, numel)
            err_sq = sum(r[kind][name][3] for r in ranks) / replicas
            assert ref_sq > 0, (kind, name)
            rel = math.sqrt(err_sq / ref_sq)
            assert rel <= TOLERANCE, f"{kind} of {name}: relative error {rel:.3g}"
    for r in ranks:
        assert len(r["losses"]) == len(r["reference_losses"]) > 0
        for got, want in zip(r["losses"], r["reference_losses"]):
            assert abs(got - want) <= TOLERANCE * abs(want), (r["rank"], got, want)


def check_unshard(ranks):
    for r in ranks:
        assert r["full_state_dict_keys"]
        for name, (same_shape, rel) in r["full_state_dict"].items():
            assert same_shape and rel <= TOLERANCE, (r["rank"], name, rel)
        for name, (_, _, _, err, _) in r["loaded"].items():
            assert err == 0, (r["rank"], name, err)  # the initial values, loaded exactly
        u = r["unshard"]
        for name in ("fc1.weight", "fc2.bias", "norm.weight"):
            same_shape, rel = u[name]
            assert same_shape and rel <= TOLERANCE, (r["rank"], name, u[name])
        assert u["resharded"] and u["written_back"] and u["others_kept"], u


def check_sharded(ranks):
    """The optimizer saw 1/N of the parameters on each rank (full shard: no replicas)."""
    total = sum(ranks[0]["full_numel"].values())
    assert sum(r["sharded_numel"] for r in ranks) == total
    assert all(r["sharded_numel"] < total for r in ranks)


def test_full_shard_two_ranks_with_clip(launch, tmp_path):
    ranks = run_worker(launch, tmp_path, 2, "--clip", "0.5")
    check_parity(ranks)
    check_sharded(ranks)
    check_unshard(ranks)
    for r in ranks:
        assert r["num_units"] == 4 and r["mesh"] == "1 x 2 (replicate x shard)"
        assert r["steps"] == 4
        # The global norm (the reference's), not this rank's part of it; it clipped.
        assert len(r["norms"]) == 4
        for got, want in zip(r["norms"], r["reference_norms"]):
            assert abs(got - want) <= TOLERANCE * want and want > 0.5, (got, want)


def test_shard_grad_op_with_gradient_accumulation(launch, tmp_path):
    ranks = run_worker(launch, tmp_path, 2, "--reshard-after-forward", "0", "--micro", "2")
    check_parity(ranks)
    check_sharded(ranks)
    check_unshard(ranks)
    for r in ranks:
        # set_requires_gradient_sync(False): no reduction, so .grad stayed None after the
        # first micro-batch of each step.
        assert r["grad_none_after_no_sync"] == [True] * 4
        assert len(r["losses"]) == 8


def test_full_shard_four_ranks_accumulation_and_clip(launch, tmp_path):
    ranks = run_worker(launch, tmp_path, 4, "--micro", "2", "--clip", "0.3", "--steps", "3")
    check_parity(ranks)
    check_sharded(ranks)
    check_unshard(ranks)
    for r in ranks:
        assert r["mesh"] == "1 x 4 (replicate x shard)"
        for got, want in zip(r["norms"], r["reference_norms"]):
            assert abs(got - want) <= TOLERANCE * want, (got, want)


def test_no_shard_on_a_2d_device_mesh(launch, tmp_path):
    ranks = run_worker(launch, tmp_path, 2, "--mesh", "no_shard", "--steps", "3")
    check_parity(ranks, replicas=2)
    check_unshard(ranks)
    for r in ranks:
        assert r["mesh"] == "2 x 1 (replicate x shard)"
        assert r["sharded_numel"] == sum(r["full_numel"].values())


def test_tensor_parallel_under_fully_shard(launch, tmp_path):
    """torch's tensor parallel (ColwiseParallel / RowwiseParallel on the tp sub-mesh of a
    (dp 2, tp 2) mesh), then fully_shard over dp (tests/python/workers/tp_worker.py): losses and
    every full weight equal FSDP2's bit for bit and are within 1e-5 of one process; the trained
    model's DCP checkpoint loads into fresh tensor-parallel models under FSDP2 and shardline."""
    result = launch(4, ["tp_worker.py", tmp_path], timeout=150)
    assert result.returncode == 0, result.describe()
    for r in range(4):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["keys"] == [True] and got["shapes"] == [True], got
        assert got["losses"]["shardline"] == got["losses"]["fsdp2"], got["losses"]
        for a, b in zip(got["losses"]["shardline"], got["losses"]["reference"]):
            assert abs(a - b) <= TOLERANCE * b, got["losses"]
        worst = max(got["vs_fsdp2"].items(), key=lambda kv: kv[1])
        assert worst[1] == 0.0, (r, worst)
        worst = max(got["vs_reference"].items(), key=lambda kv: kv[1])
        assert worst[1] <= TOLERANCE, (r, worst)
        assert got["dcp"] == {"fsdp2": 0.0, "shardline": 0.0}, got["dcp"]


def test_hybrid_2x2_deferred_all_reduce_and_clip(launch, tmp_path):
    # Two micro-batches per step; the first reduce-scatters without the replicate all-reduce
    # (set_requires_all_reduce(False)), the second all-reduces the accumulated shard once.
    ranks = run_worker(launch, tmp_path, 4, "--mesh", "hybrid", "--micro", "2",
                       "--defer-all-reduce", "--clip", "0.3", "--steps", "3")
    check_parity(ranks, replicas=2)
    check_unshard(ranks)
    for r in ranks:
        assert r["mesh"] == "2 x 2 (replicate x shard)"
        for got, want in zip(r["norms"], r["reference_norms"]):
            assert abs(got - want) <= TOLERANCE * want, (got, want)


# ---- In process: one rank ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def world():
    return shardline.init_local(1, timeout=30)[0]


class Block(nn.Module):
    def __init__(self, d, h, inner_checkpoint=None):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)
        # "reentrant" / "nonreentrant": the forward checkpoints itself, below fully_shard's
        # hooks, as Hugging Face's gradient checkpointing does.
        self.inner_checkpoint = inner_checkpoint

    def forward(self, x):
        if self.inner_checkpoint:
            return torch.utils.checkpoint.checkpoint(
                self.compute, x, use_reentrant=self.inner_checkpoint == "reentrant")
        return self.compute(x)

    def compute(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Tied(nn.Module):
    """Embedding and output head share one weight; four blocks of the same size in between."""

    def __init__(self, vocab=23, d=9, h=17, blocks=4, checkpoint=None, inner_checkpoint=None):
        super().__init__()
        self.checkpoint = checkpoint  # "reentrant" / "nonreentrant" around each block
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, h, inner_checkpoint) for _ in range(blocks)])
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        for b in self.blocks:
            if self.checkpoint:
                h = torch.utils.checkpoint.checkpoint(
                    b, h, use_reentrant=self.checkpoint == "reentrant")
            else:
                h = b(h)
        return self.head(h)


def train_pair(world, make, steps=3, freeze=None, reshard=True, **policies):
    """The same model plain and fully_shard'ed on one rank: (reference, sharded, losses)."""
    torch.manual_seed(7)
    ref = make()
    torch.manual_seed(7)
    model = make()
    if freeze:
        for m in (ref, model):
            freeze(m)
    for b in model.blocks:
        slt.fully_shard(b, mesh=world, reshard_after_forward=reshard, **policies)
    slt.fully_shard(model, mesh=world, **policies)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for m in (ref, model)]
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 23, (3, 5), generator=g)
        target = torch.randint(0, 23, (3, 5), generator=g)
        pair = []
        for m, opt in zip((ref, model), opts):
            loss = F.cross_entropy(m(tokens).float().reshape(-1, 23), target.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            pair.append(loss.item())
        losses.append(pair)
    return ref, model, losses


def assert_same_parameters(ref, model):
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = ref_params[name].detach().reshape(-1)
        assert p.shape == want.shape, (name, p.shape)  # one rank: the whole tensor
        rel = ((p.detach() - want).norm() / want.norm()).item()
        assert rel <= TOLERANCE, (name, rel)


def test_saved_weights_survive_a_regather_elsewhere(world):
    """Four equal blocks resharded after forward: the backward gathers land at other addresses
    than the forward's (counted), and the backward still reads the right weights."""
    ref, model, losses = train_pair(world, Tied)
    for a, b in losses:
        assert abs(a - b) <= TOLERANCE * a
    assert_same_parameters(ref, model)
    root = model._shardline_state.root
    assert root.saved_unpacked > 0
    assert root.saved_moved > 0, "no saved weight was re-gathered elsewhere: the test is moot"


def test_saved_weights_without_the_hooks_go_wrong(world, monkeypatch):
    """The same training with the saved-tensor hooks disabled differs: the hooks matter."""
    monkeypatch.setattr(_fsdp_state._Root, "_pack", lambda self, t: t)
    ref, model, losses = train_pair(world, Tied)
    params = dict(ref.named_parameters())
    worst = max(((p.detach() - params[n].detach().reshape(-1)).norm() / params[n].norm()).item()
                for n, p in model.named_parameters())
    assert worst > 1e-3, worst


@pytest.mark.parametrize("where", ["around", "inside"])
@pytest.mark.parametrize("mode", ["reentrant", "nonreentrant"])
def test_activation_checkpointing_recomputes_from_the_backward_gather(world, where, mode):
    """torch.utils.checkpoint around each fully_shard'ed block (checkpoint_wrapper: the unit's
    hooks run inside the recomputation) or inside its forward (Hugging Face's gradient
    checkpointing: no hook runs during the recomputation, which reads the parameters the
    backward use put on the module). Reentrant: the forward runs without gradients, and the
    parameters' gradients come from differentiating the recomputation."""
    make = (lambda: Tied(checkpoint=mode)) if where == "around" else (
        lambda: Tied(inner_checkpoint=mode))
    ref, model, losses = train_pair(world, make)
    for a, b in losses:
        assert abs(a - b) <= TOLERANCE * a
    assert_same_parameters(ref, model)
    metrics = model.shardline_scheduler.metrics()
    # The recomputations were served by the backward gathers: one forward and one backward
    # gather per block, as without checkpointing.
    for unit in metrics.units[1:]:
        assert unit.gathers == 2, str(metrics)


class FrozenMiddle(nn.Module):
    """The root's own layers around a child run under no_grad."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 9)
        self.blocks = nn.ModuleList([Block(9, 13)])
        self.out = nn.Linear(9, 5)

    def forward(self, x):
        h = self.inp(x)
        with torch.no_grad():
            h = self.blocks[0](h)
        return self.out(h)


def test_a_child_without_gradients_leaves_the_parents_tracked(world):
    """After a child's forward under no_grad, the parent's use goes on with gradients: `out`
    (used after the child) trains as in the plain model."""
    torch.manual_seed(3)
    ref = FrozenMiddle()
    torch.manual_seed(3)
    model = FrozenMiddle()
    slt.fully_shard(model.blocks[0], mesh=world)
    slt.fully_shard(model, mesh=world)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    for m in (ref, model):
        m(x).square().sum().backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = grads[name].grad
        if want is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        assert p.grad is not None, name
        rel = ((p.grad - want.reshape(-1)).norm() / want.norm()).item()
        assert rel <= TOLERANCE, (name, rel)


class Stack(nn.Module):
    """A root with no parameters of its own."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(6, 11), Block(6, 5), Block(6, 11)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_a_root_without_parameters(world):
    torch.manual_seed(5)
    ref = Stack()
    torch.manual_seed(5)
    model = Stack()
    for b in model.blocks:
        slt.fully_shard(b, mesh=world)
    slt.fully_shard(model, mesh=world)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        for m, opt in zip((ref, model), opts):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert_same_parameters(ref, model)
    assert model.shardline_scheduler.num_units == 3


def test_bf16_param_policy_within_bf16_tolerance(world):
    policy = slt.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    ref, model, losses = train_pair(world, Tied, mp_policy=policy)
    for a, b in losses:
        assert abs(a - b) <= 1e-2 * a, losses
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32  # the master shard stays float32
        want = ref_params[name].detach().reshape(-1)
        worst = max(worst, ((p.detach() - want).norm() / want.norm()).item())
    assert 1e-6 < worst <= 1e-2, worst  # it computed in bfloat16, and closely
    with torch.no_grad():
        assert model(torch.zeros(1, 2, dtype=torch.long)).dtype == torch.bfloat16


class Parts(typing.NamedTuple):
    first: torch.Tensor
    rest: list


class Record(collections.OrderedDict):
    """A dict subclass, as Hugging Face's ModelOutput is."""


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    parts: Parts
    extras: Record
    note: str = "kept"


class StructuredOut(Tied):
    """Tied, whose forward returns a dataclass holding a named tuple, a list and a dict subclass."""

    def forward(self, tokens):
        logits = super().forward(tokens)
        return Out(logits, Parts(logits[:, :1], [logits * 2, 3]), Record(hidden=logits.sum()))


@pytest.mark.parametrize("output_dtype", [None, torch.bfloat16])
def test_structured_outputs_train_and_keep_their_types(world, output_dtype):
    """A forward that returns a dataclass trains like the plain model (its tensors are found, so
    the backward belongs to this step); output_dtype casts inside every container and keeps each
    one's type, as FSDP2 does."""
    torch.manual_seed(7)
    ref = StructuredOut()
    torch.manual_seed(7)
    model = StructuredOut()
    # output_dtype on the root only, as with FSDP2 (it acts per module: on the blocks it would
    # hand the next block bfloat16 inputs)
    for b in model.blocks:
        slt.fully_shard(b, mesh=world)
    policy = slt.MixedPrecisionPolicy(output_dtype=output_dtype)
    slt.fully_shard(model, mesh=world, mp_policy=policy)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 23, (3, 5), generator=g)
        target = torch.randint(0, 23, (3, 5), generator=g)
        outs = []
        for m, opt in zip((ref, model), opts):
            out = m(tokens)
            F.cross_entropy(out.logits.float().reshape(-1, 23), target.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
            outs.append(out)
        plain, sharded = outs
        assert type(sharded) is Out and sharded.note == "kept"
        assert type(sharded.parts) is Parts and type(sharded.parts.rest) is list
        assert type(sharded.extras) is Record and sharded.parts.rest[1] == 3
        want = output_dtype or torch.float32
        for t in (sharded.logits, sharded.parts.first, sharded.parts.rest[0],
                  sharded.extras["hidden"]):
            assert t.dtype == want
    if output_dtype is None:
        assert_same_parameters(ref, model)
    else:  # the loss read bfloat16 logits: close, not equal
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            want = ref_params[name].detach().reshape(-1)
            assert ((p.detach() - want).norm() / want.norm()).item() <= 1e-2, name


def test_cpu_offload_policy(world):
    ref, model, losses = train_pair(world, Tied, offload_policy=slt.CPUOffloadPolicy())
    assert_same_parameters(ref, model)


class Branchy(nn.Module):
    """Parallel children, a child used twice, root parameters before and after them."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 9)
        self.a = Block(9, 13)
        self.b = Block(9, 5)
        self.c = Block(9, 13)
        self.out = nn.Linear(9, 3)

    def forward(self, tokens):
        h = self.emb(tokens)
        x, y = self.a(h), self.b(h)
        z = self.c(self.c(x + y))
        return self.out(z)


@pytest.mark.parametrize("layout", ["nested", "embedding_unit", "leaf_linears"])
def test_nested_units_branches_and_a_unit_used_twice(world, layout):
    torch.manual_seed(11)
    ref = Branchy()
    torch.manual_seed(11)
    model = Branchy()
    if layout == "nested":  # a unit inside a unit inside the root
        units = [model.a.fc1, model.a, model.b, model.c]
    elif layout == "embedding_unit":  # the first unit's input needs no gradient
        units = [model.emb, model.c]
    else:
        units = [model.a.fc1, model.a.fc2, model.out]
    for i, m in enumerate(units):
        slt.fully_shard(m, mesh=world, reshard_after_forward=i % 2 == 0)
    slt.fully_shard(model, mesh=world)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for step in range(3):
        tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(step))
        for m, opt in zip((ref, model), opts):
            m(tokens).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert_same_parameters(ref, model)
    assert model.shardline_scheduler.num_units == len(units) + 1


def test_deferred_initialisation_from_the_meta_device(world):
    """Built on meta, fully_shard'ed, then to_empty + init on the CPU before the first forward:
    the units take the initialised values (and a forward on meta is refused by name)."""
    def init(m):
        torch.manual_seed(21)
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.3)

    ref = Tied()
    init(ref)
    with torch.device("meta"):
        model = Tied()
    for b in model.blocks:
        slt.fully_shard(b, mesh=world)
    slt.fully_shard(model, mesh=world)
    with torch.device("meta"):
        early = Tied()
    slt.fully_shard(early, mesh=world)
    with pytest.raises(RuntimeError, match="embed.weight' is on meta"):
        early(torch.zeros(1, 2, dtype=torch.long))
    model.to_empty(device="cpu")
    init(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for step in range(2):
        tokens = torch.randint(0, 23, (3, 4), generator=torch.Generator().manual_seed(step))
        for m, opt in zip((ref, model), opts):
            m(tokens).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert_same_parameters(ref, model)


def test_torch_compile_breaks_the_graph_at_the_hooks(world):
    """torch.compile of a fully_shard'ed model: dynamo breaks the graph at the (dynamo-disabled)
    hooks, compiles the module bodies between them and trains exactly as eager. aot_eager keeps
    the test fast; inductor behaves the same (see docs/pytorch.md)."""
    torch.manual_seed(4)
    ref = Tied()
    torch.manual_seed(4)
    model = Tied()
    for b in model.blocks:
        slt.fully_shard(b, mesh=world)
    slt.fully_shard(model, mesh=world)
    compiled = torch.compile(model, backend="aot_eager")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for step in range(3):
        tokens = torch.randint(0, 23, (3, 4), generator=torch.Generator().manual_seed(step))
        for m, opt in zip((ref, compiled), opts):
            m(tokens).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert_same_parameters(ref, model)
    torch._dynamo.reset()


def test_state_dict_forms_and_round_trip_with_a_tie(world):
    ref, model, _ = train_pair(world, Tied, steps=2)
    full = slt.full_state_dict(model)
    want = ref.state_dict()
    assert sorted(full) == sorted(want)  # both names of the tied weight
    for k, v in want.items():
        assert v.shape == full[k].shape and torch.allclose(full[k], v, rtol=1e-5, atol=1e-7), k
    # state_dict() is the sharded form: this rank's 1-D slices (one rank: the whole tensor).
    sharded = model.state_dict()
    assert all(v.dim() == 1 for k, v in sharded.items())
    # Loading a full state dict (here: a fresh model's) puts its values in the shards.
    fresh = Tied()
    model.load_state_dict(fresh.state_dict())
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), dict(fresh.named_parameters())[name].detach().reshape(-1))
    assert model.head.weight is model.embed.weight


@pytest.mark.parametrize("head_unit", ["own_unit", "in_the_root"])
def test_tie_across_fully_shard_calls(world, head_unit):
    """fully_shard on the embedding and (maybe) the head separately, where FSDP2 refuses the
    shared weight: the weight stays in the embedding's unit, used twice per forward."""
    def make():
        return Tied()

    torch.manual_seed(7)
    ref = make()
    torch.manual_seed(7)
    model = make()
    slt.fully_shard(model.embed, mesh=world)
    for b in model.blocks:
        slt.fully_shard(b, mesh=world)
    if head_unit == "own_unit":
        slt.fully_shard(model.head, mesh=world)
    slt.fully_shard(model, mesh=world)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 23, (3, 5), generator=g)
        target = torch.randint(0, 23, (3, 5), generator=g)
        for m, opt in zip((ref, model), opts):
            F.cross_entropy(m(tokens).reshape(-1, 23), target.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
    assert_same_parameters(ref, model)
    assert model.head.weight is model.embed.weight
    metrics = model.shardline_scheduler.metrics()
    embed = [u for u in metrics.units if u.name.endswith(":embed")][0]
    assert embed.reductions == 1  # one tensor, one reduction, although used twice
    full = slt.full_state_dict(model)
    for k, v in ref.state_dict().items():
        assert torch.allclose(full[k], v, rtol=1e-5, atol=1e-7), k
    fresh = make()
    model.load_state_dict(fresh.state_dict())
    assert torch.equal(model.embed.weight.detach(), fresh.embed.weight.detach().reshape(-1))


@pytest.mark.parametrize("layout", ["one_unit", "across_units"])
def test_export_records_ties_and_loads_strictly(world, tmp_path, layout):
    """export_safetensors writes a tied weight once and records the tie in the header: with it,
    safetensors.torch.load_model loads the file strictly into a plain model, tie restored, equal
    to full_state_dict; import_safetensors takes it back."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    torch.manual_seed(7)
    model = Tied()
    if layout == "across_units":
        slt.fully_shard(model.embed, mesh=world)
    for b in model.blocks:
        slt.fully_shard(b, mesh=world)
    slt.fully_shard(model, mesh=world)
    tokens = torch.randint(0, 23, (3, 5), generator=torch.Generator().manual_seed(1))
    model(tokens).square().mean().backward()
    path = tmp_path / "tied.safetensors"
    slt.export_safetensors(model, path)
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["shardline.tied_to.head.weight"] == "embed.weight"
        assert "head.weight" not in f.keys()
    plain = Tied()
    safetensors_torch.load_model(plain, path, strict=True)
    assert plain.head.weight is plain.embed.weight
    full = slt.full_state_dict(model)
    assert sorted(plain.state_dict()) == sorted(full)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, full[k]), k
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    slt.import_safetensors(model, path)
    for k, v in slt.full_state_dict(model).items():
        assert torch.equal(v, full[k]), k
    with pytest.raises(ValueError, match="ties shardline records"):
        slt.export_safetensors(model, tmp_path / "x.safetensors",
                               metadata={"shardline.tied_to.head.weight": "y"})


def test_frozen_parameters_get_no_gradient(world):
    def freeze(m):
        m.blocks[1].fc1.weight.requires_grad_(False)
        m.blocks[2].fc2.bias.requires_grad_(False)

    ref, model, losses = train_pair(world, Tied, freeze=freeze)
    assert_same_parameters(ref, model)
    assert model.blocks[1].fc1.weight.grad is None
    assert model.blocks[1].fc2.weight.requires_grad


def test_shard_grad_op_and_tied_weight_in_one_unit(world):
    ref, model, losses = train_pair(world, Tied, reshard=False)
    assert_same_parameters(ref, model)
    # The tie is one tensor of the root unit, used twice per forward.
    assert model.head.weight is model.embed.weight
    assert len(model._shardline_state.params) == 1


def test_clip_grad_norm_matches_torch_and_clips(world):
    torch.manual_seed(3)
    ref = Tied()
    torch.manual_seed(3)
    model = Tied()
    slt.fully_shard(model, mesh=world)
    tokens = torch.randint(0, 23, (2, 7))
    for m in (ref, model):
        m(tokens).square().mean().backward()
    for norm_type in (2.0, 1.0, float("inf")):
        want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type)
        got = slt.clip_grad_norm_(model.parameters(), 1e9, norm_type=norm_type)
        assert abs(got.item() - want.item()) <= 1e-5 * want.item(), (norm_type, got, want)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    got = slt.clip_grad_norm_(model.parameters(), 0.01)
    assert abs(got.item() - want.item()) <= 1e-5 * want.item()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_params[name].grad.reshape(-1), rtol=1e-5, atol=1e-8)
    for p in model.parameters():
        p.grad.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="non-finite"):
        slt.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)


def test_errors_name_what_is_wrong(world):
    with pytest.raises(ValueError, match="factor of the shard group's size 1"):
        slt.fully_shard(nn.Linear(2, 2), mesh=world, reshard_after_forward=2)
    with pytest.raises(TypeError, match="mesh"):
        slt.fully_shard(nn.Linear(2, 2), mesh="world")
    with pytest.raises(NotImplementedError, match="float64"):
        slt.fully_shard(nn.Linear(2, 2).double(), mesh=world)
    with pytest.raises(ValueError, match="mp_policy.param_dtype"):
        slt.fully_shard(nn.Linear(2, 2), mesh=world,
                        mp_policy=slt.MixedPrecisionPolicy(param_dtype=torch.int8))
    m = slt.fully_shard(nn.Linear(2, 2), mesh=world)
    with pytest.raises(ValueError, match="already"):
        slt.fully_shard(m, mesh=world)
    m.set_reshard_after_backward(False)
    m.set_reshard_after_backward(True)
    m.set_post_optim_event(None)
    assert isinstance(m, slt.FSDPModule) and isinstance(m, nn.Linear)
    assert type(m).__name__ == "FSDPLinear"


def test_train_gpt_example_matches_one_process(launch):
    """examples/train_gpt.py (a GPT with tied embeddings) on 2 ranks with --impl shardline
    prints the losses of --impl single on the same global batches."""
    import pathlib
    import subprocess
    import sys
    script = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
    small = ["--vocab", "97", "--dim", "24", "--layers", "2", "--heads", "4", "--seq", "9",
             "--batch", "3", "--steps", "4", "--warmup", "1"]

    def losses(output):
        out = []
        for line in output.splitlines():
            if line.startswith("[") and ">: " in line:
                line = line.split(">: ", 1)[1]
            if line.startswith("step "):
                out.append(float(line.split("loss ")[1].split()[0]))
        return out

    sharded = launch(2, [script, "--impl", "shardline", *small], timeout=150)
    assert sharded.returncode == 0, sharded.describe()
    assert "leaked" not in sharded.output, sharded.describe()
    single = subprocess.run([sys.executable, str(script), "--impl", "single", *small],
                            capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stdout + single.stderr
    got, want = losses(sharded.output), losses(single.stdout)
    assert len(got) == len(want) == 4, (sharded.output, single.stdout)
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-5 * w + 2e-6, (got, want)
    assert len(sharded.lines("rank ")) == 2, sharded.output


def test_shardline_trace_has_the_units_and_the_streams(world):
    """set_shardline_trace: the trace holds each unit's forward and backward use on "compute"
    (in the step's order) and the scheduler's all-gathers and reduce-scatters on "gather" and
    "reduce"."""
    torch.manual_seed(1)
    model = Stack()
    for b in model.blocks:
        slt.fully_shard(b, mesh=world)
    slt.fully_shard(model, mesh=world)
    with pytest.raises(TypeError, match="shardline.Trace"):
        model.set_shardline_trace("trace.json")
    trace = shardline.Trace(0)
    model.set_shardline_trace(trace)
    for _ in range(2):
        model(torch.randn(3, 6)).sum().backward()
    assert model.shardline_trace is trace
    with pytest.raises(RuntimeError, match="first forward"):
        model.set_shardline_trace(None)
    doc = json.loads(trace.to_json())
    tracks = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = sorted((e for e in doc["traceEvents"] if e.get("ph") == "X"), key=lambda e: e["ts"])
    compute = [e["name"] for e in spans if tracks[e["tid"]] == "compute" and e["cat"] == "compute"]
    one_step = ([f"forward blocks.{i}" for i in range(3)]
                + [f"backward blocks.{i}" for i in (2, 1, 0)])
    assert compute == one_step * 2, compute
    collectives = {(tracks[e["tid"]], e["name"]) for e in spans if e["cat"] == "collective"}
    assert {("gather", "all_gather"), ("reduce", "reduce_scatter")} <= collectives, collectives
    for e in spans:
        assert e["dur"] >= 0 and e["pid"] == 0


def scaler_run(launch, tmp_path, *args):
    result = launch(2, ["grad_scaler_worker.py", tmp_path, *args], timeout=150)
    assert result.returncode == 0, result.describe()
    return [json.loads((tmp_path / f"rank{r}.json").read_text())["steps"] for r in range(2)]


@pytest.mark.parametrize("wrapper", ["fully_shard", "fsdp1"])
def test_sharded_grad_scaler_skips_an_inf_step_on_every_rank(launch, tmp_path, wrapper):
    """f16 parameters, two ranks; in step 1 only the last rank's shard gets inf gradients (rank
    0's loss overflows one output column). Every rank skips that step and halves the scale; the
    other steps track the unsharded float32 run within f16 tolerance. Also through FSDP1's
    wrapper, whose optimizer steps flat parameters."""
    ranks = scaler_run(launch, tmp_path, *(["--fsdp1"] if wrapper == "fsdp1" else []))
    for steps in ranks:
        assert [s["scale"] for s in steps] == [1024.0, 512.0, 512.0], steps
        for name in steps[0]["slices"]:
            # Skipped: step 1 left every slice as step 0 did.
            assert steps[1]["slices"][name] == steps[0]["slices"][name]
    for k in (0, 2):
        covered = {}
        for steps in ranks:
            for name, (offset, values) in steps[k]["slices"].items():
                want = steps[k]["reference"][name]
                covered[name] = covered.get(name, 0) + len(values)
                for i, v in enumerate(values):
                    assert math.isfinite(v)
                    assert abs(v - want[offset + i]) <= 2e-3 * (abs(want[offset + i]) + 0.1), (
                        k, name, offset + i, v, want[offset + i])
        assert covered == {n: len(v) for n, v in ranks[0][k]["reference"].items()}


def test_plain_grad_scaler_lets_the_ranks_disagree(launch, tmp_path):
    """The same run with torch.amp.GradScaler: rank 0's slices are finite, so it steps while the
    last rank skips (the case ShardedGradScaler exists for)."""
    ranks = scaler_run(launch, tmp_path, "--plain-scaler")
    assert [s["scale"] for s in ranks[0]] == [1024.0, 1024.0, 1024.0]
    assert [s["scale"] for s in ranks[1]] == [1024.0, 512.0, 512.0]


def run_steps(model, opt, plan, boom=None):
    """Trains `model` with one step per entry of plan ("train", "eval": a forward under
    torch.no_grad(), "fail": a backward that raises inside `boom` and is caught); returns the
    training losses."""
    losses = []

    def fail(*args):
        raise ValueError("boom")

    for step, kind in enumerate(plan):
        # The training steps see the same batches with or without the other steps.
        g = torch.Generator().manual_seed(len(losses) if kind == "train" else 100 + step)
        tokens = torch.randint(0, 23, (3, 5), generator=g)
        target = torch.randint(0, 23, (3, 5), generator=g)
        if kind == "eval":
            with torch.no_grad():
                model(tokens)
            continue
        handle = boom.register_full_backward_hook(fail) if kind == "fail" else None
        loss = F.cross_entropy(model(tokens).float().reshape(-1, 23), target.reshape(-1))
        if kind == "fail":
            with pytest.raises(ValueError, match="boom"):
                loss.backward()
            handle.remove()
            opt.zero_grad()
            continue
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def sharded_and_plain(world):
    torch.manual_seed(7)
    ref = Tied()
    torch.manual_seed(7)
    model = Tied()
    for b in model.blocks:
        slt.fully_shard(b, mesh=world)
    slt.fully_shard(model, mesh=world)
    return ref, model, [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]


@pytest.mark.parametrize("plan", [["train", "eval", "train", "eval", "train"],
                                  ["train", "fail", "train", "train"]])
def test_an_eval_or_a_failed_backward_leaves_training_exact(world, plan):
    """A forward under torch.no_grad() between training steps, or a backward that raises in a
    block's backward hook (caught, then zero_grad), leaves the next steps as a plain model's."""
    ref, model, (ref_opt, opt) = sharded_and_plain(world)
    want = run_steps(ref, ref_opt, plan, boom=ref.blocks[2])
    got = run_steps(model, opt, plan, boom=model.blocks[2])
    assert len(got) == len(want) >= 3
    for a, b in zip(got, want):
        assert abs(a - b) <= TOLERANCE * b, (got, want)
    assert_same_parameters(ref, model)
    # The same training without the eval/failed steps: those changed nothing.
    _, clean, (_, clean_opt) = sharded_and_plain(world)
    assert run_steps(clean, clean_opt, [k for k in plan if k == "train"]) == pytest.approx(
        got, rel=1e-6)


def test_original_shape_groups_weight_decay(world):
    """original_shape(p): the full shape of a sharded (1-D) parameter, for grouping by rank."""
    torch.manual_seed(7)
    model = Tied()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for b in model.blocks:
        slt.fully_shard(b, mesh=world)
    slt.fully_shard(model, mesh=world)
    model(torch.zeros(1, 2, dtype=torch.long))  # the first forward shards
    for name, p in model.named_parameters():
        assert p.dim() == 1
        assert slt.original_shape(p) == torch.Size(shapes[name]), name
    decay = [n for n, p in model.named_parameters() if len(slt.original_shape(p)) >= 2]
    assert decay == ["embed.weight"] + [f"blocks.{i}.fc{j}.weight" for i in range(4)
                                        for j in (1, 2)]
    plain = nn.Linear(3, 2)
    assert slt.original_shape(plain.weight) == torch.Size([3, 2])[::-1]
    with pytest.raises(TypeError, match="Tensor"):
        slt.original_shape("embed.weight")



def gathers_at_hooks(world, monkeypatch, lists, steps=2):
    """Trains Tied (4 blocks) with `lists(model)` setting prefetch lists, next to a plain model;
    returns, for the last step, per block hook ("forward"/"backward", block name), the blocks
    whose all-gathers that step had issued by the time the hook returned."""
    seen = []
    start = [0]

    def gathered(root):
        return [e.split(":", 1)[1] for e in root.scheduler.issue_log if e.startswith("AG ")]

    def record(phase, original):
        def hook(self, st):
            original(self, st)
            if st.params and st is not self.root_state and self.scheduler.steps == steps - 1:
                seen.append((phase, st.name,
                             [n for n in gathered(self)[start[0]:] if n.startswith("blocks.")]))
        return hook

    def begin(original):
        def hook(self, st):
            original(self, st)
            start[0] = len(gathered(self))
        return hook

    monkeypatch.setattr(_fsdp_state._Root, "_begin_unit",
                        record("forward", _fsdp_state._Root._begin_unit))
    monkeypatch.setattr(_fsdp_state._Root, "_open_unit",
                        record("backward", _fsdp_state._Root._open_unit))
    monkeypatch.setattr(_fsdp_state._Root, "begin_step", begin(_fsdp_state._Root.begin_step))
    ref, model, opts = sharded_and_plain(world)
    lists(model)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 23, (3, 5), generator=g)
        for m, opt in zip((ref, model), opts):
            m(tokens).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert_same_parameters(ref, model)  # prefetching changes no value
    return seen


def test_prefetch_lists_steer_the_gathers(world, monkeypatch):
    """set_modules_to_forward_prefetch([next two blocks]) on each block: when block i's forward
    starts, the gathers of blocks i+1 and i+2 have been issued (without lists: only i+1); the
    backward lists likewise along the reverse order."""
    def two_ahead(model):
        b = model.blocks
        for i in range(4):
            b[i].set_modules_to_forward_prefetch(list(b[i + 1:i + 3]))
            b[i].set_modules_to_backward_prefetch(list(b[max(i - 2, 0):i])[::-1])

    names = [f"blocks.{i}" for i in range(4)]
    seen = gathers_at_hooks(world, monkeypatch, two_ahead)
    # Forward: block i's own gather and the next two. Backward (after the forward's four):
    # block i's and the two before it.
    want = ([("forward", names[i], names[:min(i + 3, 4)]) for i in range(4)]
            + [("backward", names[i], names + [names[j] for j in (3, 2, 1, 0) if j >= i - 2])
               for i in (3, 2, 1, 0)])
    assert seen == want, seen
    default = gathers_at_hooks(world, monkeypatch, lambda model: None)
    assert default[0] == ("forward", "blocks.0", names[:2]), default


def test_a_prefetch_list_off_the_order_is_refused(world):
    ref, model, (ref_opt, opt) = sharded_and_plain(world)
    with pytest.raises(TypeError, match="Linear"):
        model.blocks[1].set_modules_to_backward_prefetch([nn.Linear(2, 2)])
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[2]])
    with pytest.raises(NotImplementedError, match=r"'blocks.0' names \['blocks.2'\]"):
        model(torch.zeros(1, 2, dtype=torch.long)).sum().backward()
    with pytest.raises(RuntimeError, match="after the first forward"):
        model.blocks[1].set_modules_to_forward_prefetch([model.blocks[2]])


def test_reshard_after_backward_false_keeps_the_units_for_the_next_forward(world):
    """Gradient accumulation over 3 micro-batches with set_requires_gradient_sync(False) and
    set_reshard_after_backward(False) on all but the last: the forwards of micro-batches 2 and 3
    gather nothing (the blocks stay gathered from the backward before), and the training matches
    a plain model accumulating the same micro-batches."""
    ref, model, (ref_opt, opt) = sharded_and_plain(world)
    for step in range(2):
        forward_gathers = []
        for mb in range(3):
            last = mb == 2
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            g = torch.Generator().manual_seed(10 * step + mb)
            tokens = torch.randint(0, 23, (3, 5), generator=g)
            target = torch.randint(0, 23, (3, 5), generator=g)
            for m in (ref, model):
                before = (len(model.shardline_scheduler.issue_log)
                          if m is model and model.shardline_scheduler else 0)
                out = m(tokens)
                if m is model and model.shardline_scheduler:
                    forward_gathers.append([e for e in model.shardline_scheduler.issue_log[before:]
                                            if e.startswith("AG ")])
                (F.cross_entropy(out.float().reshape(-1, 23), target.reshape(-1)) / 3).backward()
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        if step == 1:
            assert len(forward_gathers[0]) == 5, forward_gathers  # the root and four blocks
            assert forward_gathers[1:] == [[], []], forward_gathers
    assert_same_parameters(ref, model)


def test_reshard_after_forward_as_an_int():
    """FSDP2's int form: 1 is False, the shard group's size is True, another factor (a smaller
    reshard group) is refused by name, a non-factor is a ValueError. No collective runs until the
    first forward, so a 4-rank local world's first communicator serves."""
    comms = shardline.init_local(4, timeout=30)
    for k, kept in ((1, False), (4, True)):
        m = slt.fully_shard(nn.Linear(2, 2), mesh=comms[0], reshard_after_forward=k)
        assert m._shardline_state.reshard_after_forward is kept
    with pytest.raises(NotImplementedError, match="reshard_after_forward=2 .*one shard group"):
        slt.fully_shard(nn.Linear(2, 2), mesh=comms[0], reshard_after_forward=2)
    for k in (0, 3, 8):
        with pytest.raises(ValueError, match="factor of the shard group's size 4"):
            slt.fully_shard(nn.Linear(2, 2), mesh=comms[0], reshard_after_forward=k)
    with pytest.raises(TypeError, match="bool or an int"):
        slt.fully_shard(nn.Linear(2, 2), mesh=comms[0], reshard_after_forward="yes")
