"""shardline.torch.ShardedGradScaler: torch.amp.GradScaler for fully_shard'ed parameters.

A fully_shard'ed parameter's .grad is this rank's slice of the sharded gradient, so torch's
GradScaler would look for infs and NaNs in this rank's slices only: a rank whose slices are
finite would step while another skips, and the replicas would drift apart. Here the found-inf
flags are max-all-reduced over the world of the roots that own the optimizer's parameters before
step() reads them, so every rank skips the same steps and the scale follows the same course.
"""

import torch

from ._fsdp_init import _torch_device, stream_for
from ._fsdp_param_group import _sharded_owner

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler (same arguments; device defaults to "cpu": pass "cuda" for a model
    fully_shard'ed on CUDA) whose unscale_ (explicit, or inside step) agrees on found-inf across the ranks.
    Collective: every rank calls unscale_/step for the same optimizers in the same order."""

    def __init__(self, device="cpu", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True):
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        found = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        worlds = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = _sharded_owner(p)
                if st is not None and st.root is not None:
                    worlds.setdefault(id(st.root.world), st.root.world)
        if len(worlds) > 1:
            raise NotImplementedError("ShardedGradScaler: one optimizer over parameters of roots "
                                      "on different communicators")
        if not worlds:
            return found  # nothing sharded: every rank holds the same gradients
        world = next(iter(worlds.values()))
        # One flag for every device, agreed in the memory the world moves (host memory, or
        # CUDA memory for an nccl world); a device with no gradient here still gets the agreed
        # flag, so every rank's step reads the same.
        local = torch.zeros(1, dtype=torch.float32, device=_torch_device(world))
        for f in found.values():
            local = torch.maximum(local, f.reshape(1).to(local.device, torch.float32))
        work = world.all_reduce(local, op="max", stream=stream_for(world))
        if world.device == "host":
            work.wait()  # (on CUDA torch's later work on the stream comes after it)
        if not found:
            found[found_inf.device] = found_inf
        for device, f in found.items():
            f.copy_(local.reshape(f.shape).to(f.device, f.dtype))
        return found
