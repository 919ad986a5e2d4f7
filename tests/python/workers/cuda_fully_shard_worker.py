"""One rank of shardline.torch.fully_shard on CUDA (test_cuda.py; scripts/gpu-run.sh), checked
against the same training in one process on the global batch, on the same GPU.

    cuda_fully_shard_worker.py OUT_JSON [--variants NAME,...] [--steps S] [--mesh world|hybrid]

World 1 shards over NCCL; ranks that share the GPU (world 2, 4) over ucx staged through pinned
host memory (get_default_world's choice). --mesh hybrid: a 2-D "cuda" DeviceMesh of
(world / 2) x 2 (replicate x shard), under torch.distributed with gloo.

Each variant trains a small transformer-like model (an input projection, norm and head in the
root unit, three residual MLP blocks as units of their own; odd sizes, so shards cut tensors)
with AdamW, and the reference trains a plain copy of it on the GPU: the mean of the ranks' local
losses per micro-batch, mixed precision done by hand (a low-precision copy computes, its
gradients go to the float32 parameters the optimizer steps on). TF32 is off. The first step
(the lazy initialisation, which copies the parameters once) runs before the check; every later
step runs under torch.cuda.set_sync_debug_mode("error"), so a hidden host synchronization in a
hook fails the variant (offload excepted: its optimizer steps on the host, which must wait for
the gradients, as FSDP2's does).

Writes OUT_JSON (rank 0): per variant the largest relative error of any parameter (the norm of
the difference over the reference's norm, per tensor), of the losses, the tolerance, and what
failed. Exits 1 if a variant failed.
"""
import argparse
import copy
import json
import os
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import shardline.torch as slt
from shardline.torch import _fsdp_param_group

D_IN, D, H, D_OUT, T = 37, 131, 389, 17, 7
GLOBAL_BATCH = 8

# name -> options: reshard (after forward), mp (param_dtype, reduce_dtype), micro (batches per
# step), checkpoint (activation checkpointing of the blocks), offload (CPUOffloadPolicy), clip
# (max norm), scaler (ShardedGradScaler), post_optim (the optimizer on a stream of its own and
# set_post_optim_event), side_stream (forward and backward under another current stream).
VARIANTS = {
    "full_shard": {},
    "shard_grad_op": dict(reshard=False),
    "bf16": dict(mp=(torch.bfloat16, torch.float32)),
    "accumulation": dict(micro=2),
    "checkpoint": dict(checkpoint=True),
    "offload": dict(offload=True),
    "clip": dict(clip=0.05),
    "grad_scaler": dict(mp=(torch.float16, torch.float32), scaler=True),
    "post_optim_event": dict(post_optim=True),
    "side_stream": dict(side_stream=True),
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)
        self.checkpointed = False

    def inner(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    def forward(self, x):
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
        return self.inner(x)


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


def make_model(device, checkpoint):
    torch.manual_seed(1234)
    model = Net()
    with torch.no_grad():  # LayerNorm starts at ones/zeros: make every tensor distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    for block in model.blocks:
        block.checkpointed = checkpoint
    return model.to(device)


def batch(step, micro, device):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(GLOBAL_BATCH, T, D_IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, T, D_OUT, generator=g)
    return x.to(device), y.to(device)


def local(t, rank, world):
    per = GLOBAL_BATCH // world
    return t[rank * per:(rank + 1) * per]


def adamw(params):
    return torch.optim.AdamW(params, lr=2e-2, weight_decay=0.1)


def reference(opts, steps, world, device):
    """One process, the whole batch: each micro-batch's gradient is the mean of the ranks'
    local losses' gradients; a low-precision copy computes when mp is set."""
    master = make_model(device, opts.get("checkpoint", False))
    dtype = opts.get("mp", (torch.float32,))[0]
    compute = copy.deepcopy(master).to(dtype) if dtype != torch.float32 else master
    opt = adamw(master.parameters())
    scaler = torch.amp.GradScaler("cuda") if opts.get("scaler") else None
    losses = []
    for step in range(steps):
        if compute is not master:
            with torch.no_grad():
                for c, m in zip(compute.parameters(), master.parameters()):
                    c.copy_(m)
                    c.grad = None
        for micro in range(opts.get("micro", 1)):
            x, y = batch(step, micro, device)
            per_rank = [F.mse_loss(compute(local(x, r, world).to(dtype)).float(),
                                   local(y, r, world)) for r in range(world)]
            loss = torch.stack(per_rank).mean()
            (scaler.scale(loss) if scaler else loss).backward()
            losses.append(torch.stack(per_rank).detach())
        if compute is not master:
            for c, m in zip(compute.parameters(), master.parameters()):
                m.grad = c.grad.float()
        if scaler:
            scaler.unscale_(opt)
        if opts.get("clip"):
            torch.nn.utils.clip_grad_norm_(master.parameters(), opts["clip"])
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    return master, torch.stack(losses)


def train(opts, steps, rank, world, device, mesh):
    """fully_shard: the blocks and the root; returns the model and this rank's losses."""
    model = make_model(device, opts.get("checkpoint", False))
    mp = slt.MixedPrecisionPolicy(*opts["mp"]) if "mp" in opts else slt.MixedPrecisionPolicy()
    offload = slt.CPUOffloadPolicy(pin_memory=True) if opts.get("offload") else slt.OffloadPolicy()
    reshard = opts.get("reshard", True)
    for block in model.blocks:
        slt.fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp,
                        offload_policy=offload)
    slt.fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp,
                    offload_policy=offload)
    opt = adamw(model.parameters())
    scaler = slt.ShardedGradScaler("cuda") if opts.get("scaler") else None
    side = torch.cuda.Stream(device) if opts.get("side_stream") else None
    optim_stream = torch.cuda.Stream(device) if opts.get("post_optim") else None
    losses = []
    for step in range(steps):
        strict = step > 0 and not opts.get("offload")
        torch.cuda.set_sync_debug_mode("error" if strict else "default")
        for micro in range(opts.get("micro", 1)):
            model.set_requires_gradient_sync(micro == opts.get("micro", 1) - 1)
            x, y = batch(step, micro, device)
            current = torch.cuda.current_stream(device)
            if side is not None and step > 0:
                side.wait_stream(current)
                with torch.cuda.stream(side):
                    loss = F.mse_loss(model(local(x, rank, world)).float(), local(y, rank, world))
                    (scaler.scale(loss) if scaler else loss).backward()
                current.wait_stream(side)
            else:
                loss = F.mse_loss(model(local(x, rank, world)).float(), local(y, rank, world))
                (scaler.scale(loss) if scaler else loss).backward()
            losses.append(loss.detach())
        if scaler:
            scaler.unscale_(opt)
        if opts.get("clip"):
            slt.clip_grad_norm_(model.parameters(), opts["clip"])
        if optim_stream is not None:
            optim_stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(optim_stream):
                opt.step()
                opt.zero_grad()
                event = torch.cuda.Event()
                event.record(optim_stream)
            model.set_post_optim_event(event)
        elif scaler:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        else:
            opt.step()
            opt.zero_grad()
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    return model, torch.stack(losses)


def relative_errors(model, ref):
    """name -> |shard slice - reference's same elements| / |reference's elements|."""
    want = dict(ref.named_parameters())
    out = {}
    for name, p in model.named_parameters():
        st = _fsdp_param_group._owner(p)
        i = next(k for k, q in enumerate(st.params) if q is p)
        offset, length = st.tensor_offsets[i], st.slices[i][1]
        w = want[name].detach().reshape(-1)[offset:offset + length].double().cpu()
        g = p.detach().reshape(-1).double().cpu()
        out[name] = ((g - w).norm() / w.norm().clamp_min(1e-30)).item()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--mesh", default="world", choices=["world", "hybrid"])
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    mesh = None
    if args.mesh == "hybrid":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cuda", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    results, failed = {}, []
    for name in args.variants.split(","):
        opts = VARIANTS[name]
        t0 = time.monotonic()
        tol = 1e-4 if "mp" not in opts else 2e-2
        try:
            model, losses = train(opts, args.steps, rank, world, device, mesh)
            ref, ref_losses = reference(opts, args.steps, world, device)
            errors = relative_errors(model, ref)
            want = ref_losses[:, rank]
            loss_error = ((losses - want).norm() / want.norm()).item()
            worst = max(errors, key=errors.get)
            ok = errors[worst] <= tol and loss_error <= tol
            results[name] = dict(ok=ok, tolerance=tol, worst_param=worst,
                                 param_error=errors[worst], loss_error=loss_error,
                                 seconds=time.monotonic() - t0,
                                 metrics=str(model.shardline_scheduler.metrics()))
        except Exception as e:  # recorded per variant, so that the others still run
            torch.cuda.set_sync_debug_mode("default")
            ok = False
            results[name] = dict(ok=False, error=f"{type(e).__name__}: {e}",
                                 traceback=traceback.format_exc())
        if not ok:
            failed.append(name)
        print(f"rank {rank}: {name}: {'ok' if ok else 'FAILED'} {results[name].get('param_error', results[name].get('error'))}",
              flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(world=world, mesh=args.mesh, device=torch.cuda.get_device_name(device),
                           torch=torch.__version__, results=results), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
