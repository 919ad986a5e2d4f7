"""What the FSDP1 snippets of the project's background documents (../shared/seeds/) leave out,
shared by the scripts beside this file: the tutorial's MLP scaled down (same structure: a
Sequential of Linear and ReLU), the data, the tutorial's train_step, and the report.

Each script runs either under shardline.launch (2 ranks; every rank trains on its rows of the
same global batches) or with --single (one process, the plain model, all the rows); --torch
imports torch's own FullyShardedDataParallel (and its enums and policies) where the script
imports shardline's, which runs on the CPU with gloo in torch 2.15. It prints
`step <i> loss <mean loss over the ranks>` and, with --out DIR, writes the final full weights
(the FSDP module's FULL_STATE_DICT on rank 0) to DIR/<rank or single>.pt, for
tests/python/test_seeds.py to compare.
"""
import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.optim as optim

WIDTH, DEPTH, GLOBAL_BATCH, STEPS = 24, 8, 8, 4


class MLP(nn.Module):
    """The tutorial's MLP: Linear(20480, 20480) and ReLU, repeated; here WIDTH wide."""

    def __init__(self, width=WIDTH, depth=DEPTH):
        super().__init__()
        layers = []
        for i in range(depth):
            layers.append(nn.Linear(width, width))
            if i < depth - 1:
                layers.append(nn.ReLU())
        self.fcs = nn.Sequential(*layers)

    def forward(self, x):
        return self.fcs(x)


def train_step(data, target, model, optimizer, criterion):
    """The tutorial's train_step, as written there."""
    optimizer.zero_grad()
    output = model(data)
    loss = criterion(output, target)
    loss.backward()
    optimizer.step()
    return loss


def fsdp_module(args):
    """The module the snippet imports FSDP and its helpers from: shardline.torch, or torch's
    (--torch)."""
    if args.torch:
        import torch.distributed.fsdp as fsdp
        import torch.distributed.fsdp.wrap as wrap
        return type("TorchFSDP1", (), {**vars(fsdp), **{k: getattr(wrap, k) for k in dir(wrap)}})
    import shardline.torch
    return shardline.torch


def arguments():
    p = argparse.ArgumentParser()
    p.add_argument("--single", action="store_true", help="one process, the plain model")
    p.add_argument("--out", default="")
    p.add_argument("--torch", action="store_true",
                   help="torch's own FSDP1 (torch.distributed.fsdp) in place of shardline's")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.single:
        rank, world = 0, 1
    return args, rank, world


def batches(rank, world, ranks=2):
    """The global batches (the same for every world size), this rank's rows of each."""
    per = GLOBAL_BATCH // (ranks if world > 1 else 1)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        data = torch.randn(GLOBAL_BATCH, WIDTH, generator=g)
        target = torch.randn(GLOBAL_BATCH, WIDTH, generator=g)
        if world > 1:
            data, target = data[rank * per:(rank + 1) * per], target[rank * per:(rank + 1) * per]
        yield data, target


def report(args, rank, world, losses, model):
    """Prints the losses (averaged over the ranks) and writes the full weights."""
    import torch.distributed as dist
    for step, loss in enumerate(losses):
        t = loss.detach().double().reshape(1)
        if world > 1:
            dist.all_reduce(t)
        if rank == 0:
            print(f"step {step} loss {t.item() / world:.9g}", flush=True)
    weights = model.state_dict()  # FSDP: FULL_STATE_DICT, FSDP1's default
    if args.out and rank == 0:
        torch.save({k: v.detach().float() for k, v in weights.items()},
                   os.path.join(args.out, "single.pt" if args.single else f"{rank}.pt"))
    if not args.single and dist.is_initialized():
        # Ends gloo's threads before the interpreter does (else a rank may abort at exit).
        dist.destroy_process_group()
    if args.torch:
        # torch's own FSDP1 (the reference) sometimes aborts in its teardown at exit
        # ("terminate called without an active exception", with mixed precision, about one run
        # in three here): everything is printed and written by now, so leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
