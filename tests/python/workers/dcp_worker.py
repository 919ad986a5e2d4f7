"""One rank of a torch.distributed.checkpoint (DCP) round trip, run by test_dcp.py under
shardline.launch (gloo process group):

    dcp_worker.py save IMPL CKPT_DIR    train 2 AdamW steps, save model and optimizer with DCP
    dcp_worker.py load IMPL CKPT_DIR    a fresh model (other initial values), load, compare

IMPL is shardline (shardline.torch.fully_shard) or fsdp2 (torch's fully_shard), with "-hsdp" a
hybrid 2-D mesh (replicate 2, shard N/2); the model is
fully_shard_worker.py's (odd sizes, so the flat shards cut rows), one unit per block and the
root. Both sides use torch's own functions: get_model_state_dict / get_optimizer_state_dict into
dcp.save; dcp.load into the fresh model's state dicts, then set_model_state_dict /
set_optimizer_state_dict. The saver writes, from rank 0, CKPT_DIR.ref.pt: the full model and
optimizer state dicts (get_*_state_dict(full_state_dict=True, cpu_offload=True)), the loss of one
more step on the next batch, and the full weights after it. The loader checks every tensor of
its full state dicts against them bit for bit, takes that step too, and writes (rank 0)
CKPT_DIR.load.json: the largest differences and its loss. A shardline loader also checks the
full forms (check_forms). A shardline saver checks that its sharded state dicts hold at most one
unit gathered whole at a time (one_unit_at_a_time).
"""
import gc
import json
import sys
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardline.torch as slt
from fully_shard_worker import D_IN, D_OUT, make_model

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
GLOBAL_BATCH = 12  # rows, split evenly at 2, 3 and 4 ranks


def one_unit_at_a_time():
    """Wraps the adapter's gather of a whole unit (the root's gather_full, which the sharded state
    dicts of the model and the optimizer take one unit at a time): each gather first checks that
    the tensors of the one before are gone. Returns the count of gathers."""
    from shardline.torch._fsdp_param_group import _UnitUses
    original = _UnitUses.gather_full
    earlier = []
    count = [0]

    def gather_full(self, st, shard=None):
        gc.collect()
        alive = sum(ref() is not None for ref in earlier)
        assert alive == 0, f"gather {count[0]}: {alive} tensors of the unit before are alive"
        full = original(self, st, shard)
        earlier[:] = [weakref.ref(t) for t in full]
        count[0] += 1
        return full

    _UnitUses.gather_full = gather_full
    return count


def build(impl, seed):
    torch.manual_seed(seed)
    model = make_model()
    shard = slt.fully_shard if impl.startswith("shardline") else torch_fully_shard
    mesh = None
    if impl.endswith("-hsdp"):  # hybrid: (replicate 2, shard size/2)
        from torch.distributed.device_mesh import init_device_mesh
        size = dist.get_world_size()
        mesh = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def step(model, opt, n, rank, size):
    """One AdamW step on this rank's rows of global batch n; the global loss."""
    g = torch.Generator().manual_seed(50 + n)
    x = torch.randn(GLOBAL_BATCH, D_IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, D_OUT, generator=g)
    per = GLOBAL_BATCH // size
    rows = slice(per * rank, per * (rank + 1))
    loss = F.mse_loss(model(x[rows]), y[rows])
    loss.backward()
    opt.step()
    opt.zero_grad()
    t = loss.detach().double().reshape(1)
    dist.all_reduce(t)
    return t.item() / size


def full_state(model, opt):
    return (get_model_state_dict(model, options=FULL),
            get_optimizer_state_dict(model, opt, options=FULL))


def flat(osd):
    """{name: tensor} of a full optimizer state dict (state per FQN; param_groups' lr)."""
    out = {}
    for fqn, state in osd["state"].items():
        for k, v in state.items():
            out[f"{fqn}.{k}"] = torch.as_tensor(v).double()
    return out


def check_forms(model, opt):
    """shardline only: the full state dicts on every rank equal full_state_dict, and a fresh
    model and optimizer given them with set_*_state_dict(full_state_dict=True) hold the same
    state. The largest differences."""
    options = StateDictOptions(full_state_dict=True)
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, opt, options=options)
    ours = slt.full_state_dict(model)
    other, other_opt = build("shardline", seed=9)
    set_model_state_dict(other, weights, options=options)
    set_optimizer_state_dict(other, other_opt, optim, options=options)
    got_weights, got_optim = (get_model_state_dict(other, options=options),
                              get_optimizer_state_dict(other, other_opt, options=options))
    optim, got_optim = flat(optim), flat(got_optim)
    return {"full_vs_shardline": max((v - ours[k]).abs().max().item()
                                     for k, v in weights.items()),
            "set_weights": max((v - got_weights[k]).abs().max().item()
                               for k, v in weights.items()),
            "set_optim": max((v - got_optim[k]).abs().max().item() for k, v in optim.items()),
            "keys": sorted(weights) == sorted(ours) == sorted(got_weights)}


def main():
    mode, impl, ckpt = sys.argv[1:4]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if mode == "save":
        model, opt = build(impl, seed=0)
        for n in range(2):
            step(model, opt, n, rank, size)
        gathers = one_unit_at_a_time() if impl.startswith("shardline") else None
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, opt)}
        assert gathers is None or gathers[0] >= 2 * len(model.blocks), gathers
        dcp.save(state, checkpoint_id=ckpt)
        weights, optim = full_state(model, opt)
        loss = step(model, opt, 2, rank, size)
        after, _ = full_state(model, opt)
        if rank == 0:
            torch.save({"weights": weights, "optim": flat(optim), "loss": loss, "after": after},
                       f"{ckpt}.ref.pt")
    else:
        model, opt = build(impl, seed=5)
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        weights, optim = full_state(model, opt)
        loss = step(model, opt, 2, rank, size)
        after, _ = full_state(model, opt)
        forms = {}
        if impl.startswith("shardline"):
            forms = check_forms(model, opt)
        if rank == 0:
            ref = torch.load(f"{ckpt}.ref.pt")
            optim = flat(optim)
            result = {
                "weights": {k: (v - weights[k]).abs().max().item()
                            for k, v in ref["weights"].items()},
                "optim": {k: (v - optim[k]).abs().max().item() for k, v in ref["optim"].items()},
                "keys": [sorted(ref["weights"]) == sorted(weights),
                         sorted(ref["optim"]) == sorted(optim)],
                "loss": [loss, ref["loss"]],
                "after": {k: ((v - after[k]).norm() / v.norm()).item()
                          for k, v in ref["after"].items()},
                "forms": forms,
            }
            with open(f"{ckpt}.load.json", "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
