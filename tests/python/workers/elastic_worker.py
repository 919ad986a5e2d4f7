"""One rank of an elastic fully_shard training (shardline.torch.elastic), run by test_elastic.py
under `python -m shardline.launch -n 4 --max-restarts M --shard-size 2`: 2 replica groups x 2
shard ranks, on the CPU.

    elastic_worker.py OUT_DIR --steps N [--kill-rank R --kill-step K
                      [--kill-phase backward|before-vote]] [--await-joiners-at J]

A small model (an input projection and a head in the root unit, two residual MLP blocks, each
its own unit; odd sizes, so the shards cut tensors) trains with SGD and momentum; every rank's
batch depends on (step, replica, shard). Rank R (first incarnation only) SIGKILLs itself in the
backward of step K, after the last block's gradients were handed to the scheduler (its
reductions in flight), or with --kill-phase before-vote after the step's backward and gradient
norm, just before optimizer.step() would vote (the other ranks' steps all succeed, and the round
must abort all the same). With --await-joiners-at J the survivors hold step J until the restarted
replica group has arrived at it (elastic.await_joiner), so that it joins there.

Output lines: "STEP k replicas a,b" per committed step (the loop's data follows step.index and
a step_committed callback, which must agree), "RECOVERY step k: why", "DIGEST replica r shard s
<sha256 of this rank's master slices and momenta>", and then "CHECK ok max_error E": this rank's
master slices, the full state dict and every committed step's global gradient norm
(clip_grad_norm_) against a plain unsharded loop that, at every committed step, averages the
gradients of exactly the ranks of the replica groups that step had (a joiner, which does not
know the steps before it joined, prints "CHECK joined" instead and is compared by its digest).
Exit 3: this rank's replica group was left out of a round (a rank of it was lost).
"""
import argparse
import copy
import hashlib
import os
import signal
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardline
import shardline.torch as slt

D_IN, D, H, D_OUT, BATCH = 7, 13, 17, 5, 3
LR, MOMENTUM = 0.05, 0.9


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, D_OUT)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def batch(step, replica, shard):
    g = torch.Generator().manual_seed(1000003 * step + 101 * replica + shard + 7)
    return torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)


def reference(initial, history, shard_size):
    """The unsharded model trained by a plain loop: at each committed step the gradients of
    every rank of that step's replica groups, averaged."""
    model = copy.deepcopy(initial)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    norms = {}
    for step in sorted(history):
        ranks = [(r, s) for r in history[step] for s in range(shard_size)]
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r, s in ranks:
            model.zero_grad()
            x, y = batch(step, r, s)
            F.mse_loss(model(x), y).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad
        for g, p in zip(grads, model.parameters()):
            p.grad = g / len(ranks)
        norms[step] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
        opt.step()
    return dict(model.named_parameters()), norms


def slices(model):
    """(name, tensor offset, this rank's 1-D slice) of every parameter of the sharded model."""
    out = []
    for m in model.modules():
        st = getattr(m, "_shardline_state", None)
        if st is None or st.root is None:
            continue
        for fqn, p, t in zip(st.fqns, st.params, st.tensor_offsets):
            out.append((fqn, t, p))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--kill-phase", choices=("backward", "before-vote"), default="backward")
    parser.add_argument("--await-joiners-at", type=int, default=-1)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Net()
    initial = copy.deepcopy(model)
    elastic = slt.elastic()
    me = f"({elastic.replica}, {elastic.shard})"
    for block in model.blocks:
        slt.fully_shard(block, mesh=elastic)
    slt.fully_shard(model, mesh=elastic)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    # The data position follows commits only: a redone step reads the same batch again. A
    # restarted process learns where the job is from its first round.
    position = [None]
    elastic.step_committed(lambda index: position.__setitem__(0, index + 1))

    kill = elastic.incarnation == 0 and elastic.rank == args.kill_rank
    first_block_out = []
    model.blocks[0].register_forward_hook(lambda mod, inp, o: first_block_out.append(o))
    history = {}
    grad_norms = {}
    while elastic.committed_steps < args.steps:
        if (elastic.committed_steps == args.await_joiners_at and elastic.incarnation == 0
                and elastic.replica != args.kill_rank // elastic.shard_size):
            # Hold the next step until the restarted group has arrived at it: it joins there.
            elastic.await_joiner(timeout=90)
        with elastic.step(model, opt) as step:
            if position[0] is None:
                position[0] = step.index
            if step.index != position[0]:
                raise AssertionError(f"{me}: round trains step {step.index}, the data is at "
                                     f"{position[0]}")
            x, y = batch(step.index, elastic.replica, elastic.shard)
            out = model(x)
            if kill and step.index == args.kill_step and args.kill_phase == "backward":
                # When the gradient reaches the first block's output, the second block's
                # backward use is over and its reductions are in flight.
                first_block_out[-1].register_hook(
                    lambda g: (print(f"KILLING {me} at step {step.index}", flush=True),
                               os.kill(os.getpid(), signal.SIGKILL)))
            first_block_out.clear()
            loss = F.mse_loss(out, y)
            loss.backward()
            # The global gradient norm, reduced over the round's shard group (no clipping).
            norm = slt.clip_grad_norm_(model.parameters(), 1e9).item()
            if kill and step.index == args.kill_step and args.kill_phase == "before-vote":
                # Every collective of the step is done everywhere; the others vote ok, and the
                # round must still abort: their optimizers must not step.
                print(f"KILLING {me} at step {step.index}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            opt.zero_grad()
        if step.committed:
            history[step.index] = step.replicas
            grad_norms[step.index] = norm
            print(f"STEP {step.index} replicas {','.join(map(str, step.replicas))}"
                  f"{' redo' if step.redo else ''}", flush=True)
    for r in elastic.recoveries:
        print(f"RECOVERY step {r.step} detect_ms {r.detect * 1e3:.1f} resume_ms "
              f"{r.resume * 1e3:.1f}: {r.what_failed}", flush=True)

    digest = hashlib.sha256()
    for _, _, p in slices(model):
        digest.update(p.detach().numpy().tobytes())
        digest.update(opt.state[p]["momentum_buffer"].numpy().tobytes())
    print(f"DIGEST replica {elastic.replica} shard {elastic.shard} {digest.hexdigest()}",
          flush=True)
    if elastic.incarnation > 0:
        print("CHECK joined", flush=True)
        return 0
    if sorted(history) != list(range(args.steps)):
        raise AssertionError(f"{me}: committed steps {sorted(history)}")
    want, want_norms = reference(initial, history, elastic.shard_size)
    max_error = 0.0
    for fqn, t, p in slices(model):
        expected = want[fqn].detach().reshape(-1)[t:t + p.numel()]
        max_error = max(max_error, (p.detach() - expected).abs().max().item() if p.numel() else 0)
    # The full state dict, gathered over the last round's shard group.
    for fqn, value in slt.full_state_dict(model).items():
        max_error = max(max_error, (value - want[fqn].detach()).abs().max().item())
    for step, norm in grad_norms.items():
        max_error = max(max_error, abs(norm - want_norms[step]) / want_norms[step])
    if not max_error < 1e-5:
        print(f"CHECK failed max_error {max_error}", flush=True)
        return 1
    print(f"CHECK ok max_error {max_error:.3g}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except shardline.RemoteError as error:
        if getattr(error, "code", "") == "ABORTED":
            print(f"LEFT OUT: {error}", flush=True)
            sys.exit(3)
        raise
