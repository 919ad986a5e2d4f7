"""One rank of a shardline.torch.fully_shard training, run by test_fully_shard.py under
shardline.launch, next to the same training in one process on the global batch.

    fully_shard_worker.py OUT_DIR --mesh world|device1d|no_shard|hybrid
                          [--reshard-after-forward 0|1] [--micro M] [--defer-all-reduce]
                          [--clip MAX_NORM]
                          [--steps S]

Every rank trains a small transformer-like model (an input projection and a final norm and head
in the root unit, three residual MLP blocks, each its own unit; odd sizes, so the flat shards
cut tensors) with AdamW for a few steps, and also runs the unsharded reference itself. It
writes OUT_DIR/rank<r>.json: the losses of both, and for every parameter the squared error of
this rank's shard slice against the reference's same elements (after the first backward: of
the gradients; at the end: of the parameters), so the test can sum the slices of all ranks
into a per-tensor relative norm and check that they cover every element once.
"""
import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardline.torch as slt
from shardline.torch import _fsdp_param_group

D_IN, D, H, D_OUT, T = 11, 13, 29, 5, 3
GLOBAL_BATCH = 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, D_OUT)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def make_model():
    torch.manual_seed(1234)
    model = Net()
    with torch.no_grad():  # LayerNorm starts at ones/zeros: make every tensor distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def batch(step, micro):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return (torch.randn(GLOBAL_BATCH, T, D_IN, generator=g),
            torch.randn(GLOBAL_BATCH, T, D_OUT, generator=g))


def local(t, rank, world):
    per = GLOBAL_BATCH // world
    return t[rank * per:(rank + 1) * per]


def adamw(params):
    return torch.optim.AdamW(params, lr=2e-2, weight_decay=0.1)


def reference(args, world):
    """One process, the whole model: each micro-batch's gradient is the mean over the ranks of
    their local losses' gradients, summed over the micro-batches."""
    model = make_model()
    opt = adamw(model.parameters())
    losses, norms, first_grads = [], [], None
    for step in range(args.steps):
        for micro in range(args.micro):
            x, y = batch(step, micro)
            per_rank = [F.mse_loss(model(local(x, r, world)), local(y, r, world))
                        for r in range(world)]
            loss = torch.stack(per_rank).mean()
            loss.backward()
            losses.append([l.item() for l in per_rank])
        if first_grads is None:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if args.clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip).item())
        opt.step()
        opt.zero_grad()
    return model, losses, norms, first_grads


def mesh_of(args, world_size):
    if args.mesh == "world":
        return None
    from torch.distributed.device_mesh import init_device_mesh
    if args.mesh == "device1d":
        return init_device_mesh("cpu", (world_size,))
    if args.mesh == "no_shard":
        return init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    if args.mesh == "hybrid":
        return init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("replicate", "shard"))
    raise ValueError(args.mesh)


def slices(model):
    """name -> (tensor_offset, length, sharded parameter) of this rank's slice of each tensor."""
    out = {}
    for name, p in model.named_parameters():
        st = _fsdp_param_group._owner(p)
        i = next(k for k, q in enumerate(st.params) if q is p)
        out[name] = (st.tensor_offsets[i], st.slices[i][1], p)
    return out


def compare(model_slices, reference_tensors):
    """name -> [tensor_offset, length, numel, squared error of the slice, squared norm of the
    whole reference tensor]."""
    out = {}
    for name, (offset, length, got) in model_slices.items():
        want = reference_tensors[name].detach().reshape(-1).double()
        got = got.detach().reshape(-1).double()
        assert got.numel() == length, (name, got.numel(), length)
        err = (got - want[offset:offset + length]).pow(2).sum().item()
        out[name] = [offset, length, want.numel(), err, want.pow(2).sum().item()]
    return out


def unshard_checks(model, ref_params):
    """unshard() puts the full trained tensors on the module (checked against the reference);
    reshard() writes a change of them back into this rank's shard slices."""
    out = {}
    block = model.blocks[1]
    sharded = {n: p for n, p in block.named_parameters()}
    before = {n: p.detach().clone() for n, p in sharded.items()}
    block.unshard()
    for name in ("fc1.weight", "fc2.bias", "norm.weight"):
        full = getattr(getattr(block, name.split(".")[0]), name.split(".")[1])
        want = ref_params[f"blocks.1.{name}"].detach()
        out[name] = [list(full.shape) == list(want.shape),
                     ((full - want).norm() / want.norm()).item()]
    with torch.no_grad():
        block.fc1.weight.add_(1.0)
    block.reshard()
    out["resharded"] = block.fc1.weight is sharded["fc1.weight"]
    out["written_back"] = bool(torch.equal(sharded["fc1.weight"], before["fc1.weight"] + 1.0))
    out["others_kept"] = all(torch.equal(sharded[n], before[n]) for n in before
                             if n != "fc1.weight")
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--mesh", default="world")
    parser.add_argument("--reshard-after-forward", type=int, default=1)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--defer-all-reduce", action="store_true",
                        help="hybrid: micro-batches reduce-scatter but all-reduce only the last")
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    t0 = time.monotonic()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.mesh != "world":
        import torch.distributed as dist
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mesh = mesh_of(args, world)

    model = make_model()
    full_numel = {n: p.numel() for n, p in model.named_parameters()}
    for block in model.blocks:
        slt.fully_shard(block, mesh=mesh, reshard_after_forward=bool(args.reshard_after_forward))
    slt.fully_shard(model, mesh=mesh, reshard_after_forward=bool(args.reshard_after_forward))
    opt = adamw(model.parameters())  # before the first forward, as FSDP2 users do

    losses, norms, grads, grad_none_after_no_sync = [], [], None, []
    for step in range(args.steps):
        for micro in range(args.micro):
            last = micro == args.micro - 1
            if args.defer_all_reduce:
                model.set_requires_all_reduce(last)
            else:
                model.set_requires_gradient_sync(last)
            x, y = batch(step, micro)
            loss = F.mse_loss(model(local(x, rank, world)), local(y, rank, world))
            loss.backward()
            losses.append(loss.item())
            if not last:
                grad_none_after_no_sync.append(all(p.grad is None for p in model.parameters()))
        if grads is None:
            grads = {n: (o, l, p.grad.clone()) for n, (o, l, p) in slices(model).items()}
        if args.clip:
            norms.append(slt.clip_grad_norm_(model.parameters(), args.clip).item())
        opt.step()
        opt.zero_grad()

    ref_model, ref_losses, ref_norms, ref_grads = reference(args, world)
    ref_params = dict(ref_model.named_parameters())
    scheduler = model.shardline_scheduler
    result = {
        "rank": rank, "world": world,
        "losses": losses, "reference_losses": [l[rank] for l in ref_losses],
        "norms": norms, "reference_norms": ref_norms,
        "grads": compare(grads, ref_grads),
        "params": compare(slices(model), ref_params),
        "full_numel": full_numel,
        "sharded_numel": sum(p.numel() for p in model.parameters()),
        "grad_none_after_no_sync": grad_none_after_no_sync,
        "num_units": scheduler.num_units, "mesh": scheduler.mesh,
        "shard_size": scheduler.shard_size, "steps": scheduler.steps,
        "metrics": str(scheduler.metrics()),
    }
    # get_default_world(): the world the root's scheduler shards over (mesh None or a
    # DeviceMesh), the same object at every call; a sum of the ranks over it.
    default = slt.get_default_world()
    rank_sum = torch.tensor([float(rank)], dtype=torch.float64)
    default.all_reduce(rank_sum).wait()
    result["default_world"] = {
        "same": default is slt.get_default_world(),
        "scheduler_world": default is model._shardline_state.root.world,
        "rank": default.rank, "size": default.size, "rank_sum": rank_sum.item()}
    # full_state_dict: every tensor whole; load_state_dict of a full state dict (the initial
    # model's) loads each rank's slices of it.
    full = slt.full_state_dict(model)
    ref_state = ref_model.state_dict()
    result["full_state_dict"] = {
        k: [list(v.shape) == list(ref_state[k].shape),
            ((v.double() - ref_state[k].double()).norm() / ref_state[k].double().norm()).item()]
        for k, v in full.items()}
    result["full_state_dict_keys"] = sorted(full) == sorted(ref_state)
    result["unshard"] = unshard_checks(model, ref_params)  # after: it changes a parameter
    initial = make_model()
    model.load_state_dict(initial.state_dict())
    result["loaded"] = compare(slices(model), dict(initial.named_parameters()))
    result["seconds"] = time.monotonic() - t0
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    if args.mesh != "world":
        torch.distributed.destroy_process_group()
    print(f"rank {rank}: done in {time.monotonic() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
