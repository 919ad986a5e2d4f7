"""One rank of test_torch_checkpoint.py's jobs under shardline.launch: fully_shard's model and
AdamW through shardline.torch.save_checkpoint / load_checkpoint (the model and batches of
fully_shard_worker.py: a root unit and three block units of odd sizes).

    torch_checkpoint_worker.py OUT_DIR CKPT_DIR train|resume [--mesh world|hybrid]
                               [--before K] [--after M]

train (the uninterrupted run): K steps, then this rank's shard slices of every parameter and
optimizer state to OUT_DIR/saved<r>.pt, save_checkpoint(CKPT_DIR), M more steps; the local losses
of those M steps and, from rank 0, full_state_dict(rank0_only=True) to OUT_DIR/final.pt; then
rank 0 loads that full state dict into a plain, never sharded model (strict) and compares its
outputs with the sharded model's on a batch (every rank runs the sharded forward).
resume: a model initialised differently and a fresh AdamW load CKPT_DIR; the slices right after
the load go to OUT_DIR/loaded<r>.pt, then the same M steps (the same global batches) run.
OUT_DIR/rank<r>.json: the local losses and the output comparison.
"""
import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.nn.functional as F

import shardline.torch as slt
from fully_shard_worker import Net, adamw, batch, local, make_model, mesh_of, slices


def shard_state(model, opt):
    """name -> (tensor_offset, this rank's parameter slice, {optimizer state key: value})."""
    out = {}
    for name, (offset, _, p) in slices(model).items():
        state = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                 for k, v in opt.state.get(p, {}).items()}
        out[name] = (offset, p.detach().clone(), state)
    return out


def train_steps(model, opt, first, count, rank, world):
    losses = []
    for step in range(first, first + count):
        x, y = batch(step, 0)
        loss = F.mse_loss(model(local(x, rank, world)), local(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("ckpt_dir")
    p.add_argument("mode", choices=["train", "resume"])
    p.add_argument("--mesh", default="world")
    p.add_argument("--before", type=int, default=3)
    p.add_argument("--after", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.mesh != "world":
        import torch.distributed as dist
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mesh = mesh_of(a, world)

    model = make_model()
    if a.mode == "resume":
        with torch.no_grad():  # other values: only the load can make them right
            for q in model.parameters():
                q.mul_(-0.5).add_(0.25)
    for block in model.blocks:
        slt.fully_shard(block, mesh=mesh)
    slt.fully_shard(model, mesh=mesh)
    opt = adamw(model.parameters())
    result = {"rank": rank, "world": world}

    if a.mode == "train":
        train_steps(model, opt, 0, a.before, rank, world)
        torch.save(shard_state(model, opt), os.path.join(a.out_dir, f"saved{rank}.pt"))
        slt.save_checkpoint(model, opt, a.ckpt_dir)
        result["losses"] = train_steps(model, opt, a.before, a.after, rank, world)
        full = slt.full_state_dict(model, rank0_only=True)
        assert (full == {}) == (rank != 0), sorted(full)
        offloaded = slt.full_state_dict(model, cpu_offload=True)  # FSDP2's: rank 0 only
        assert sorted(offloaded) == sorted(full) and all(
            torch.equal(offloaded[k], full[k]) for k in full), sorted(offloaded)
        x = torch.randn(5, 3, 11, generator=torch.Generator().manual_seed(77))
        with torch.no_grad():
            sharded_out = model(x)
        if rank == 0:
            torch.save(full, os.path.join(a.out_dir, "final.pt"))
            plain = Net()
            plain.load_state_dict(full)  # strict: the same keys and shapes
            with torch.no_grad():
                plain_out = plain(x)
            result["max_output_difference"] = (plain_out - sharded_out).abs().max().item()
            result["output_norm"] = plain_out.norm().item()
    else:
        slt.load_checkpoint(model, opt, a.ckpt_dir)
        torch.save(shard_state(model, opt), os.path.join(a.out_dir, f"loaded{rank}.pt"))
        result["losses"] = train_steps(model, opt, a.before, a.after, rank, world)
        full = slt.full_state_dict(model)
        if rank == 0:
            torch.save(full, os.path.join(a.out_dir, "final.pt"))
    with open(os.path.join(a.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if a.mesh != "world":
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
