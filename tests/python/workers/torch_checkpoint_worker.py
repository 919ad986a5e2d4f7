"""One rank of test_torch_checkpoint.py's jobs under shardline.launch: fully_shard's model and
AdamW through shardline.torch.save_checkpoint / load_checkpoint (the model and batches of
fully_shard_worker.py: a root unit and three block units of odd sizes).

    torch_checkpoint_worker.py OUT_DIR CKPT_DIR train|resume|import|sync [--mesh world|hybrid]
                               [--before K] [--after M]

train (the uninterrupted run): K steps, then this rank's shard slices of every parameter and
optimizer state to OUT_DIR/saved<r>.pt, save_checkpoint(CKPT_DIR), M more steps; the local losses
of those M steps and, from rank 0, full_state_dict(rank0_only=True) to OUT_DIR/final.pt; then
rank 0 loads that full state dict into a plain, never sharded model (strict) and compares its
outputs with the sharded model's on a batch (every rank runs the sharded forward).
resume: a model initialised differently and a fresh AdamW load CKPT_DIR; the slices right after
the load go to OUT_DIR/loaded<r>.pt, then the same M steps (the same global batches) run.
train also saves CKPT_DIR-bg with background=True right after the synchronous save and trains on
while it is written (waiting after the first further step), and at the end exports the weights
(export_safetensors, as f32 and bf16); rank 0 reads them with safetensors.torch.load_file: the
f32 file equals full_state_dict and loads (strict) into a plain model whose outputs are compared,
the bf16 one equals torch's own .to(torch.bfloat16) of it.
import: CKPT_DIR is a safetensors file of a plain model (safetensors.torch.save_file); the model
(other values) imports it; every element of this rank's shard slices is compared with the file,
and rank 0 compares the sharded model's outputs with the plain model's.
sync: every rank builds the model with its own seed (two buffers added, one parameter not
contiguous), sync_module_states(src=0, small buckets) makes it rank 0's (checked element for
element against the model built with rank 0's seed), then it trains M steps; rank 0 also trains
the plain model on the global batches (the reference losses).
OUT_DIR/rank<r>.json: the local losses and the output comparisons.
"""
import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.nn as nn
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
    p.add_argument("mode", choices=["train", "resume", "import", "sync"])
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
    result = {"rank": rank, "world": world}
    if a.mode == "import":
        result.update(import_file(a.ckpt_dir, mesh, rank))
    elif a.mode == "sync":
        result.update(sync(mesh, rank, world, a.after))
    else:
        result.update(train_or_resume(a, mesh, rank, world))
    with open(os.path.join(a.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if a.mesh != "world":
        torch.distributed.destroy_process_group()
    return 0


def probe():
    return torch.randn(5, 3, 11, generator=torch.Generator().manual_seed(77))


def import_file(path, mesh, rank):
    from safetensors.torch import load_file
    model = make_model()
    with torch.no_grad():
        for q in model.parameters():
            q.mul_(-0.5).add_(0.25)
    for block in model.blocks:
        slt.fully_shard(block, mesh=mesh)
    slt.fully_shard(model, mesh=mesh)
    slt.import_safetensors(model, path)  # before any forward
    file = load_file(path)
    checked = {}
    for name, (offset, length, p) in slices(model).items():
        want = file[name].reshape(-1)[offset:offset + length]
        assert torch.equal(p.detach(), want), name
        checked[name] = length
    x = probe()
    with torch.no_grad():
        out = model(x)
    result = {"checked": checked}
    if rank == 0:
        plain = Net()
        plain.load_state_dict(file)
        with torch.no_grad():
            want = plain(x)
        result["max_output_difference"] = (out - want).abs().max().item()
        result["output_norm"] = want.norm().item()
    return result


def seeded(seed):
    """The model as a rank with `seed` builds it: Net, two buffers, one non-contiguous weight."""
    torch.manual_seed(seed)
    model = Net()
    model.register_buffer("stat", torch.randn(7, 3))
    model.blocks[1].register_buffer("count", torch.randint(0, 2**40, (5,), dtype=torch.int64))
    model.blocks[0].fc1.weight = nn.Parameter(torch.randn(model.blocks[0].fc1.in_features,
                                                          model.blocks[0].fc1.out_features).t())
    return model


def sync(mesh, rank, world, steps):
    model = seeded(100 + rank)
    assert not model.blocks[0].fc1.weight.is_contiguous()
    slt.sync_module_states(model, src=0, bucket_bytes=1000)
    want = seeded(100)
    got = dict(model.named_parameters()) | dict(model.named_buffers())
    expect = dict(want.named_parameters()) | dict(want.named_buffers())
    assert sorted(got) == sorted(expect)
    for name, t in got.items():
        assert t.dtype == expect[name].dtype and torch.equal(t.detach(), expect[name].detach()), \
            name
    for block in model.blocks:
        slt.fully_shard(block, mesh=mesh)
    slt.fully_shard(model, mesh=mesh)
    result = {"checked": sorted(got),
              "losses": train_steps(model, adamw(model.parameters()), 0, steps, rank, world)}
    if rank == 0:  # the reference: rank 0's initial model, the global batches, one process
        opt = adamw(want.parameters())
        losses = []
        for step in range(steps):
            x, y = batch(step, 0)
            loss = F.mse_loss(want(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        result["reference_losses"] = losses
    return result


def train_or_resume(a, mesh, rank, world):
    model = make_model()
    if a.mode == "resume":
        with torch.no_grad():  # other values: only the load can make them right
            for q in model.parameters():
                q.mul_(-0.5).add_(0.25)
    for block in model.blocks:
        slt.fully_shard(block, mesh=mesh)
    slt.fully_shard(model, mesh=mesh)
    opt = adamw(model.parameters())
    result = {}

    if a.mode == "train":
        train_steps(model, opt, 0, a.before, rank, world)
        torch.save(shard_state(model, opt), os.path.join(a.out_dir, f"saved{rank}.pt"))
        slt.save_checkpoint(model, opt, a.ckpt_dir)
        # The same state in the background; training goes on (and changes the parameters and
        # the optimizer's state) while it is written.
        handle = slt.save_checkpoint(model, opt, a.ckpt_dir + "-bg", background=True)
        assert isinstance(handle, slt.CheckpointSave)
        result["losses"] = train_steps(model, opt, a.before, 1, rank, world)
        stats = handle.wait(timeout=60)
        assert handle.done and stats["background"] and stats["finished"], stats
        assert stats["snapshot_bytes"] > 0 and stats["write"] > 0, stats
        assert handle.wait() == stats  # once done, wait returns at once
        result["losses"] += train_steps(model, opt, a.before + 1, a.after - 1, rank, world)
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
        # Full weights: exported under the plain model's names, read back by safetensors.
        f32 = os.path.join(a.out_dir, "model.safetensors")
        bf16 = os.path.join(a.out_dir, "model-bf16.safetensors")
        slt.export_safetensors(model, f32)
        slt.export_safetensors(model, bf16, torch.bfloat16, writer_rank=world - 1,
                               metadata={"step": str(a.before + a.after)})
        if rank == 0:
            from safetensors.torch import load_file
            exported = load_file(f32)
            assert sorted(exported) == sorted(full), sorted(exported)
            for k, v in full.items():
                assert exported[k].dtype == torch.float32 and torch.equal(exported[k], v), k
            plain = Net()
            plain.load_state_dict(exported)  # strict
            with torch.no_grad():
                plain_out = plain(x)
            result["export_max_output_difference"] = (plain_out - sharded_out).abs().max().item()
            halves = load_file(bf16)
            assert sorted(halves) == sorted(full)
            for k, v in full.items():
                assert halves[k].dtype == torch.bfloat16, k
                assert torch.equal(halves[k], v.to(torch.bfloat16)), k
    else:
        slt.load_checkpoint(model, opt, a.ckpt_dir)
        torch.save(shard_state(model, opt), os.path.join(a.out_dir, f"loaded{rank}.pt"))
        result["losses"] = train_steps(model, opt, a.before, a.after, rank, world)
        full = slt.full_state_dict(model)
        if rank == 0:
            torch.save(full, os.path.join(a.out_dir, "final.pt"))
    return result


if __name__ == "__main__":
    sys.exit(main())
