"""One rank of tensor parallel under FSDP on a (dp 2, tp 2) mesh of 4 ranks, run by
test_fully_shard_tp.py under shardline.launch (gloo process group):

    tp_worker.py OUT_DIR

Each block's fc1 is ColwiseParallel and fc2 RowwiseParallel over the tp sub-mesh
(torch.distributed.tensor.parallel.parallelize_module: DTensor parameters, torch's tp process
group), then every block and the root are fully_shard'ed over the dp sub-mesh: once with
shardline's fully_shard, once with torch's FSDP2, and the plain model trains in one process on
the global batch. The ranks of a dp group take different rows of each batch; the two ranks of a
tp group take the same. OUT_DIR/rank<r>.json: the three runs' losses and, per parameter of the
full state dicts, the largest difference from FSDP2's and the relative error against the
reference; then the trained shardline model goes through DCP into fresh tensor-parallel models
under FSDP2 and under shardline (dcp_round_trips).
"""
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import shardline.torch as slt

D_IN, D, H, D_OUT = 11, 12, 30, 5  # H and D divisible by tp = 2
GLOBAL_BATCH, STEPS = 8, 3


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
        self.head = nn.Linear(D, D_OUT)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build(way, mesh, seed=0):
    torch.manual_seed(seed)
    model = Net()
    if way != "reference":
        shard = slt.fully_shard if way == "shardline" else torch_fully_shard
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"fc1": ColwiseParallel(),
                                                   "fc2": RowwiseParallel()})
            shard(block, mesh=mesh["dp"])
        shard(model, mesh=mesh["dp"])
    return model


def full_weights(model, way):
    if way == "shardline":
        return slt.full_state_dict(model)
    if way == "fsdp2":
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach() for k, v in model.state_dict().items()}


def train(way, mesh):
    model = build(way, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 + step)
        x = torch.randn(GLOBAL_BATCH, D_IN, generator=g)
        y = torch.randn(GLOBAL_BATCH, D_OUT, generator=g)
        if way != "reference":
            per = GLOBAL_BATCH // dp_size
            x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().double().reshape(1)
        if way != "reference":
            dist.all_reduce(t)
            t /= dist.get_world_size()  # the tp ranks hold the same loss
        losses.append(t.item())
    return losses, full_weights(model, way), model


def dcp_round_trips(model, weights, mesh, ckpt):
    """The trained shardline model saved with DCP (its sharded state dict), loaded into fresh
    tensor-parallel models under FSDP2 and under shardline: the largest differences of their
    full weights from the saved ones."""
    dcp.save(get_model_state_dict(model), checkpoint_id=ckpt)
    out = {}
    for way in ("fsdp2", "shardline"):
        fresh = build(way, mesh, seed=3)
        state = get_model_state_dict(fresh)
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(fresh, state)
        got = full_weights(fresh, way)
        out[way] = max((v - got[k]).abs().max().item() for k, v in weights.items())
    return out


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    runs = {way: train(way, mesh) for way in ("shardline", "fsdp2", "reference")}
    ours, theirs, ref = (runs[w][1] for w in ("shardline", "fsdp2", "reference"))
    result = {
        "rank": dist.get_rank(),
        "losses": {w: runs[w][0] for w in runs},
        "keys": [sorted(ours) == sorted(theirs) == sorted(ref)],
        "vs_fsdp2": {k: (v - theirs[k]).abs().max().item() for k, v in ours.items()},
        "vs_reference": {k: ((v - ref[k]).norm() / ref[k].norm()).item()
                         for k, v in ours.items()},
        "shapes": [all(tuple(v.shape) == tuple(ref[k].shape) for k, v in ours.items())],
        "dcp": dcp_round_trips(runs["shardline"][2], ours, mesh, os.path.join(out_dir, "ckpt")),
    }
    with open(os.path.join(out_dir, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
