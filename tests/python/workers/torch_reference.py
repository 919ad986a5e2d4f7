"""Plain-torch references for the torch backend's checks (torch_backend_worker.py,
torch_p2p_checks.py): hashed inputs every rank can regenerate, reductions computed locally, and
an element-wise comparison that names the first bad element."""

import torch
import torch.distributed as dist


def data(seed, n, dtype):
    """Hashed random values for (seed, n): the same on every rank that asks."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


def seed_of(*parts):
    """A seed for the tuple `parts` (stable across processes, unlike hash())."""
    return sum(p * 1000003**i for i, p in enumerate(parts)) % (2**31)



def close(got, want, what):
    tol = dict(rtol=1e-2, atol=1e-2) if want.dtype == torch.bfloat16 else dict(rtol=1e-6,
                                                                                atol=1e-6)
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} "
                             f"{tuple(want.shape)}")
    if not torch.allclose(got.float(), want.float(), **tol):
        bad = (got.float() - want.float()).abs().argmax().item()
        raise AssertionError(f"{what}: element {bad} is {got.flatten()[bad].item()}, want "
                             f"{want.flatten()[bad].item()}")


def reduce_ref(values, op):
    stacked = torch.stack([v.float() for v in values])
    if op == "sum":
        out = stacked.sum(0)
    elif op == "avg":
        out = stacked.mean(0)
    elif op == "min":
        out = stacked.min(0).values
    elif op == "max":
        out = stacked.max(0).values
    elif op == "product":
        out = stacked.prod(0)
    elif op == "premul":
        out = (stacked * 0.5).sum(0)
    return out.to(values[0].dtype)


TORCH_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN,
             "max": dist.ReduceOp.MAX, "product": dist.ReduceOp.PRODUCT}


def torch_op(op):
    if op != "premul":
        return TORCH_OPS[op]
    try:
        return dist.ReduceOp.PREMUL_SUM(0.5)
    except TypeError:  # torch 2.11: not callable there
        return dist._make_nccl_premul_sum(0.5)
