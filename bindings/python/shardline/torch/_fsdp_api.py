"""fully_shard's policies: FSDP2's MixedPrecisionPolicy, OffloadPolicy and CPUOffloadPolicy (as in
torch/distributed/fsdp/_fully_shard/_fsdp_api.py), each documented with what shardline's
scheduler does with it."""

import dataclasses
from typing import Optional

import torch

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's MixedPrecisionPolicy. param_dtype: the dtype of the unsharded parameters (the
    forward and backward compute, the all-gather); reduce_dtype: of the gradient reduction;
    output_dtype: the module's floating outputs are cast to it, inside tuples, named tuples,
    lists, dicts, dataclasses and their subclasses (HF's ModelOutput), each kept as its own
    type; cast_forward_inputs: floating inputs of every fully_shard'ed module are cast to
    param_dtype. None: float32. param_dtype and reduce_dtype are one root's scheduler's and must
    be the same on every module under it; output_dtype and cast_forward_inputs may differ per
    module."""
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """FSDP2's OffloadPolicy: no offloading."""


@dataclasses.dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """FSDP2's CPUOffloadPolicy: the master shards and sharded gradients in host memory (the
    scheduler's cpu_offload). pin_memory is accepted for FSDP2 compatibility; on this CPU-only
    path there is no device memory to pin against, so it changes nothing."""
    pin_memory: bool = True


# The dtypes a MixedPrecisionPolicy may name, by the scheduler's names for them.
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
