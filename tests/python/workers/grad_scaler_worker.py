"""One rank of an f16 fully_shard training with shardline.torch.ShardedGradScaler, run by
test_fully_shard.py under shardline.launch.

    grad_scaler_worker.py OUT_DIR [--plain-scaler] [--fsdp1]

The model is one fully_shard'ed Linear(9, 5) (param_dtype float16) under a root without
parameters, trained with SGD for three steps. In step 1 only rank 0 weights its loss's last
output column by 1e4: with the scale of 1024 that column's f16 gradient overflows, so the
gradients of the weight's last row and of the last bias (the end of the unit's flat buffer:
the last rank's shard) become inf after the reduce-scatter, and no other element does. Every
rank must skip step 1 and halve the scale. --plain-scaler uses torch.amp.GradScaler instead
(the test checks that the ranks then disagree). --fsdp1 wraps the model in
FullyShardedDataParallel instead (the Linear its own unit; the optimizer steps its flat
parameter, whose .grad is the sharded gradient). Each rank also runs the same training unsharded
in float32 on the global batch, skipping step 1, and writes OUT_DIR/rank<r>.json: per step its
shard slices, the scale and the reference's parameters.
"""
import argparse
import json
import os

import torch
import torch.nn as nn

import shardline.torch as slt

D_IN, D_OUT, BATCH, SCALE = 9, 5, 3, 1024.0


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(D_IN, D_OUT)

    def forward(self, x):
        return self.head(x)


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, D_IN, generator=g)


def mask(step, rank):
    m = torch.ones(BATCH, D_OUT)
    if step == 1 and rank == 0:
        m[:, -1] = 1e4
    return m


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--plain-scaler", action="store_true")
    p.add_argument("--fsdp1", action="store_true")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    torch.manual_seed(3)
    ref = Root()
    torch.manual_seed(3)
    model = Root()
    if args.fsdp1:
        model = slt.FullyShardedDataParallel(
            model, auto_wrap_policy=slt.ModuleWrapPolicy({nn.Linear}),
            mixed_precision=slt.MixedPrecision(param_dtype=torch.float16))
        st = next(u for u in model.module._shardline_state.root.units if u.params)
    else:
        slt.fully_shard(model.head,
                        mp_policy=slt.MixedPrecisionPolicy(param_dtype=torch.float16))
        slt.fully_shard(model, mp_policy=slt.MixedPrecisionPolicy(param_dtype=torch.float16))
        st = model.head._shardline_state
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    if args.plain_scaler:
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    else:
        scaler = slt.ShardedGradScaler(init_scale=SCALE, growth_interval=1000)

    steps = []
    for step in range(3):
        out = model(batch(step, rank))
        assert out.dtype == torch.float16, out.dtype
        # The reduction averages over the ranks: the mean of the ranks' losses, as below.
        loss = (out.float() * mask(step, rank)).sum() / BATCH
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step != 1:  # the reference: float32, the global batch, no scaler, step 1 skipped
            ref_loss = sum((ref(batch(step, r)) * mask(step, r)).sum()
                           for r in range(world)) / (BATCH * world)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
        steps.append({
            "scale": scaler.get_scale(),
            "slices": {n: [st.tensor_offsets[i], p.detach().tolist()]
                       for i, (n, p) in enumerate(zip(st.names, st.params))},
            "reference": {n: p.detach().reshape(-1).tolist()
                          for n, p in ref.head.named_parameters()},
        })
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "steps": steps}, f)


if __name__ == "__main__":
    main()
