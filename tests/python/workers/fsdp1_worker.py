"""One rank of shardline's FullyShardedDataParallel (FSDP1's wrapper) over a matrix of its
constructor arguments, run by test_fsdp1.py under shardline.launch (gloo process group):

    fsdp1_worker.py OUT_DIR CASE [CASE ...]

CASE is OPTION[:OPTION,...] (the first also names the case); the options are the wrapper's
arguments and what the training does (the model is fully_shard_worker.py's):
    shard_grad_op | no_shard | hybrid      sharding_strategy (default FULL_SHARD; hybrid: a 2-D
                                           mesh (replicate 2, shard N/2))
    offload                                cpu_offload=CPUOffload(offload_params=True)
    post | noprefetch | forward            backward_prefetch BACKWARD_POST / None,
                                           forward_prefetch=True
    nolimit                                limit_all_gathers=False
    orig                                   use_orig_params=True (default False: one flat
                                           parameter per unit is what the optimizer steps)
    sync                                   sync_module_states=True, every rank initialised with
                                           its own seed (the reference uses rank 0's)
    zero2 | pgpair                         _HYBRID_SHARD_ZERO2; hybrid over process_group=
                                           (intra-node group, inter-node group)
    meta                                   the model built on the meta device, param_init_fn
                                           initialising each module (the same values as built)
    ignored                                ignored_modules=[the head] (replicated, not reduced:
                                           its gradient is averaged by hand, as FSDP1 users do)
    size | lambda | module                 the auto-wrap policy (default transformer_auto_wrap_
                                           policy on the blocks): size_based (min 200
                                           parameters), a lambda policy, ModuleWrapPolicy
    nosync                                 two micro-batches, the first under no_sync()
    clip                                   model.clip_grad_norm_(0.5)
    clipfn                                 shardline.torch.clip_grad_norm_(model.parameters(),
                                           0.5): over the flat parameters
    ac                                     apply_activation_checkpointing(checkpoint_wrapper) on
                                           the blocks' wrappers: no extra gathers
    roundtrip                              the state-dict checks (round_trips)
    buffers                                floating buffers the forward reads (add_buffers) and
                                           mixed_precision=MixedPrecision(buffer_dtype=bf16):
                                           the buffer checks (buffer_checks)
Every case trains 3 SGD steps (momentum) on this rank's rows of the global batches and the plain model on
all of them in the same process. OUT_DIR/rank<r>.json per case: both runs' losses, per weight of
the FULL_STATE_DICT the relative error, the scheduler's gathers per unit and peak in-flight
units, and the budget the rate limiter promised; and checks of summon_full_params,
SHARDED_STATE_DICT and optim_state_dict round trips.
"""
import functools
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardline.torch as slt
from fully_shard_worker import D, D_IN, D_OUT, Block, Net
from shardline.torch import (BackwardPrefetch, CPUOffload, FullStateDictConfig,
                             FullyShardedDataParallel as FSDP, MixedPrecision, ModuleWrapPolicy,
                             ShardingStrategy, StateDictType)

GLOBAL_BATCH, STEPS = 8, 3


def policy_of(options):
    if "size" in options:
        return functools.partial(slt.size_based_auto_wrap_policy, min_num_params=200)
    if "lambda" in options:
        return functools.partial(slt.lambda_auto_wrap_policy,
                                 lambda_fn=lambda m: isinstance(m, Block))
    if "module" in options:
        return ModuleWrapPolicy({Block})
    return functools.partial(slt.transformer_auto_wrap_policy, transformer_layer_cls={Block})


def add_buffers(model):
    """Floating buffers that the forward reads, with values bf16 holds exactly (so that
    buffer_dtype changes no number): a scale on the root's output, a shift into each block."""
    model.register_buffer("scale", torch.tensor(0.75))
    model.register_forward_hook(lambda m, args, out: out * m.scale.to(out.dtype))
    for block in model.blocks:
        block.register_buffer("shift", torch.full((D,), 2.0 ** -6))
        block.register_forward_pre_hook(lambda m, args: (args[0] + m.shift.to(args[0].dtype),))
    return model


def build(options, rank):
    torch.manual_seed(100 + rank if "sync" in options else 0)
    if "meta" in options:
        with torch.device("meta"):
            model = Net()
    else:
        model = Net()
    if "buffers" in options:
        add_buffers(model)
    kwargs = dict(auto_wrap_policy=policy_of(options), use_orig_params="orig" in options,
                  sync_module_states="sync" in options,
                  limit_all_gathers="nolimit" not in options,
                  forward_prefetch="forward" in options,
                  backward_prefetch=(BackwardPrefetch.BACKWARD_POST if "post" in options else
                                     None if "noprefetch" in options else
                                     BackwardPrefetch.BACKWARD_PRE))
    if "shard_grad_op" in options:
        kwargs["sharding_strategy"] = ShardingStrategy.SHARD_GRAD_OP
    if "no_shard" in options:
        kwargs["sharding_strategy"] = ShardingStrategy.NO_SHARD
    if "hybrid" in options or "zero2" in options:
        from torch.distributed.device_mesh import init_device_mesh
        size = dist.get_world_size()
        kwargs["sharding_strategy"] = (ShardingStrategy._HYBRID_SHARD_ZERO2 if "zero2" in options
                                       else ShardingStrategy.HYBRID_SHARD)
        if "pgpair" in options:  # (intra-node group, inter-node group), as FSDP1 takes them
            shard = size // 2
            intra = [dist.new_group(list(range(r * shard, (r + 1) * shard))) for r in range(2)]
            inter = [dist.new_group(list(range(k, size, shard))) for k in range(shard)]
            rank_ = dist.get_rank()
            kwargs["process_group"] = (intra[rank_ // shard], inter[rank_ % shard])
        else:
            kwargs["device_mesh"] = init_device_mesh("cpu", (2, size // 2))
    if "meta" in options:
        def init(module):  # only this module's own tensors, as FSDP1 asks
            module.to_empty(device="cpu", recurse=False)
            module.reset_parameters()
        kwargs["param_init_fn"] = init
    if "offload" in options:
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    if "ignored" in options:
        kwargs["ignored_modules"] = [model.head]
    if "buffers" in options:
        kwargs["mixed_precision"] = MixedPrecision(buffer_dtype=torch.bfloat16)
    wrapped = FSDP(model, **kwargs)
    if "ac" in options:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing, checkpoint_wrapper)
        apply_activation_checkpointing(
            wrapped, checkpoint_wrapper_fn=checkpoint_wrapper,
            check_fn=lambda m: isinstance(m, FSDP) and isinstance(m.module, Block))
    return wrapped


def batch(step, micro):
    g = torch.Generator().manual_seed(50 + 10 * step + micro)
    return torch.randn(GLOBAL_BATCH, D_IN, generator=g), torch.randn(GLOBAL_BATCH, D_OUT,
                                                                       generator=g)


def train(model, options, rank, size, sharded):
    # SGD with momentum: AdamW's first steps blow rounding noise in near-zero gradients up to
    # the learning rate.
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    micro = 2 if "nosync" in options else 1
    per = GLOBAL_BATCH // size
    losses = []
    for step in range(STEPS):
        total = 0.0
        for m in range(micro):
            x, y = batch(step, m)
            if sharded:
                x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
            loss = F.mse_loss(model(x), y) / micro
            if sharded and m < micro - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
            total += loss.item()
        if sharded and "ignored" in options:
            for p in model.module.head.parameters():  # outside every unit: replicated
                dist.all_reduce(p.grad)
                p.grad /= size
        if options & {"clip", "clipfn"}:
            if sharded and "clipfn" in options:
                slt.clip_grad_norm_(model.parameters(), 0.5)
            elif sharded:
                model.clip_grad_norm_(0.5)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        if sharded:
            t = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(t)
            total = t.item() / size
        losses.append(total)
    return opt, losses


def round_trips(model, opt, rank, options):
    """summon_full_params (writeback and not), SHARDED_STATE_DICT into a fresh copy with the
    other use_orig_params (flat parameters one way, the originals the other), and the
    optimizer's state through optim_state_dict / optim_state_dict_to_load: the largest
    differences (0 means exact)."""
    out = {}
    with FSDP.summon_full_params(model):
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        shapes_full = all(p.dim() == full[n].dim() for n, p in model.named_parameters())
    with FSDP.summon_full_params(model, writeback=False):
        for p in model.parameters():
            with torch.no_grad():
                p.add_(1.0)
    with FSDP.summon_full_params(model):
        out["writeback_false"] = max((p - full[n]).abs().max().item()
                                     for n, p in model.named_parameters())
    out["full_params_named"] = shapes_full and sorted(full) == sorted(
        n for n, _ in Net().named_parameters())
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(rank0_only=True, offload_to_cpu=True)):
        rank0 = model.state_dict()
    out["rank0_only"] = (len(rank0) > 0) == (rank == 0)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
        osd = FSDP.optim_state_dict(model, opt)
    other = build(set() if "orig" in options else {"orig"}, rank)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.05, momentum=0.9)
    with FSDP.state_dict_type(other, StateDictType.SHARDED_STATE_DICT):
        other.load_state_dict(sharded)
        other_opt.load_state_dict(FSDP.optim_state_dict_to_load(other, other_opt, osd))
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        mine, my_osd = model.state_dict(), FSDP.optim_state_dict(model, opt)
    with FSDP.state_dict_type(other, StateDictType.FULL_STATE_DICT):
        theirs, their_osd = other.state_dict(), FSDP.optim_state_dict(other, other_opt)
    out["sharded_state_dict"] = max((v - theirs[k]).abs().max().item() for k, v in mine.items())
    out["optim_state_dict"] = max(
        (torch.as_tensor(v).double() - torch.as_tensor(their_osd["state"][fqn][k]).double())
        .abs().max().item()
        for fqn, state in my_osd["state"].items() for k, v in state.items())
    return out


def buffer_checks(model, ref):
    """The buffers' dtypes in the module (buffer_dtype) and in the full and sharded state dicts
    (their original dtype, as FSDP1 saves them), and a full state dict loaded back: the buffers
    keep buffer_dtype and their values."""
    names = sorted(n for n, _ in ref.named_buffers())
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = model.state_dict()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
    full[names[0]] = full[names[0]] * 2
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model.load_state_dict(full)
    loaded = dict(model.named_buffers())
    want = dict(ref.named_buffers())
    return {
        "module": sorted({str(b.dtype) for b in loaded.values()}),
        "full": sorted({str(full[n].dtype) for n in names}),
        "sharded": sorted({str(sharded[n].dtype) for n in names}),
        "loaded": max(((loaded[n].double() - want[n].double() * (2 if n == names[0] else 1))
                       .abs().max().item()) for n in names),
        "names": names,
    }


def run_case(case, rank, size):
    name, _, rest = case.partition(":")
    options = {name} | (set(rest.split(",")) if rest else set())
    model = build(options, rank)
    opt, losses = train(model, options, rank, size, sharded=True)
    torch.manual_seed(100 if "sync" in options else 0)  # sync: rank 0's initial values
    ref = Net()
    if "buffers" in options:
        add_buffers(ref)
    _, ref_losses = train(ref, options, rank, size, sharded=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        weights = model.state_dict()
    ref_weights = ref.state_dict()
    root = model.module._shardline_state.root
    metrics = root.scheduler.metrics()
    result = {
        "losses": [losses, ref_losses],
        "keys": sorted(weights) == sorted(ref_weights),
        "weights": {k: ((v - ref_weights[k]).norm() / ref_weights[k].norm()).item()
                    for k, v in weights.items()},
        "units": len(metrics.units),
        "gathers": [u.gathers for u in metrics.units],
        "peak_inflight_units": metrics.peak_inflight_units,
        "budget_units": metrics.budget_units,
        "minimum_budget_units": root.scheduler.minimum_budget_units,
        "wrappers": sum(isinstance(m, FSDP) for m in model.modules()),
        "optimizer_params": sum(len(g["params"]) for g in opt.param_groups),
        "flat_names": sum(n.endswith("_flat_param") for n, _ in model.named_parameters()),
        "repr": repr(model),
        "checkpointed": sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules()),
    }
    if "roundtrip" in options:
        result["round_trips"] = round_trips(model, opt, rank, options)
    if "buffers" in options:
        result["buffers"] = buffer_checks(model, ref)
    return result


def main():
    out_dir, cases = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = {case: run_case(case, rank, size) for case in cases}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "cases": results}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
