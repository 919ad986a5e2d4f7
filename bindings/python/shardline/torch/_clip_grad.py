"""clip_grad_norm_ for fully_shard'ed parameters: the global norm of sharded gradients."""

import torch

from ._fsdp_init import stream_for
from ._fsdp_param_group import _sharded_owner

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
    """torch.nn.utils.clip_grad_norm_ for fully_shard'ed parameters: the norm is global.

    A fully_shard'ed parameter's .grad is this rank's slice of the sharded gradient, so torch's
    own clip_grad_norm_ would return (and clip by) a local norm. Here the parts of the sharded
    gradients are reduced over the ranks (each replica counted once); gradients of parameters
    that no fully_shard call manages are taken as replicated (the same on every rank). Returns
    the total norm as a tensor and scales every gradient in place by
    min(1, max_norm / (total + 1e-6)), as torch does.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    sharded, replicated, roots = [], [], []
    for p in params:
        st = _sharded_owner(p)
        if st is not None and any(q is p and spec is not None
                                  for q, spec in zip(st.params, st.dtensors)):
            raise NotImplementedError(
                "clip_grad_norm_: a tensor-parallel parameter's gradient is sharded over the tp "
                "group too, which this norm (summed over the shard group) does not reduce")
        if st is not None and st.root is not None:
            sharded.append(p)
            if st.root not in roots:
                roots.append(st.root)
        else:
            replicated.append(p)
    if len(roots) > 1:
        worlds = {id(r.world) for r in roots}
        if len(worlds) > 1:
            raise NotImplementedError("clip_grad_norm_: parameters of roots on different "
                                      "communicators")
    inf = norm_type == float("inf")

    def local(ps):
        if not ps:
            return torch.zeros((), dtype=torch.float64)
        grads = [p.grad.detach().to(torch.float64) for p in ps]
        if inf:
            return torch.stack([g.abs().max() if g.numel() else torch.zeros((), dtype=g.dtype)
                                for g in grads]).max()
        return torch.stack([g.abs().pow(norm_type).sum() for g in grads]).sum()

    total = local(sharded)
    if roots:
        root = roots[0]
        # In the memory the world moves: CUDA for an nccl world (offloaded gradients are on the
        # CPU), the host for ucx.
        buf = total.reshape(1).to(root.world_device, copy=True)
        work = root.world.all_reduce(buf, op="max" if inf else "sum",
                                     stream=stream_for(root.world))
        if not root.cuda:
            work.wait()  # (on CUDA torch's later work on the stream comes after it)
        buf = buf.to(total.device)
        total = buf[0] if inf else buf[0] / root.replicas
    rest = local(replicated)
    if inf:
        total = torch.maximum(total, rest)
    else:
        total = (total + rest).pow(1.0 / norm_type)
    total = total.to(torch.float32)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable this "
                           "error and scale the gradients by the non-finite norm anyway, set "
                           "`error_if_nonfinite=False`")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total
