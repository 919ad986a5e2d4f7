"""The shardline c10d backend's calls (private): what every ProcessGroup method shares — the
dtypes and reduce ops it takes, the checks of its tensors, and _Call, one call's buffers and the
copies that finish it."""

import torch
import torch.distributed as dist

# torch dtypes shardline reduces (and moves as they are). Other dtypes (bool, int16, complex, ...)
# move as bytes in the collectives that only copy.
_NATIVE_DTYPES = frozenset({
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.uint8, torch.int32, torch.int64,
})

_RedOpType = dist.ReduceOp.RedOpType
_REDUCE_OPS = {
    _RedOpType.SUM: "sum",
    _RedOpType.AVG: "avg",
    _RedOpType.MIN: "min",
    _RedOpType.MAX: "max",
    _RedOpType.PRODUCT: "product",
}

_SUPPORTED = ("allreduce, allreduce_coalesced, allgather, allgather_coalesced, "
              "all_gather_single(_coalesced), reduce_scatter, reduce_scatter_single(_coalesced), "
              "broadcast, reduce, gather, scatter, all_to_all_single, alltoall, barrier, "
              "monitored_barrier, send, recv, recv_anysource; CPU tensors, dense (sparse COO: "
              "allreduce SUM); CUDA tensors on a GPU machine: the collectives, not "
              "point-to-point, reduce, gather, scatter or unequal all-to-all splits")

# The collectives that take CUDA tensors (on the group's CUDA communicator: nccl, or ucx staged
# through host memory where ranks share a GPU; enqueued on torch's current stream).
_CUDA_COLLECTIVES = frozenset({
    "allreduce", "allreduce_coalesced", "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced", "allgather", "allgather_coalesced",
    "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "reduce_scatter", "broadcast",
    "all_to_all_single", "alltoall",
})

def _unsupported(what):
    return NotImplementedError(f"shardline backend: {what} is not supported (supported: "
                               f"{_SUPPORTED})")


def _reduce_op(op, collective):
    """(shardline op name, premultiply factor or None) for a torch ReduceOp."""
    kind = getattr(op, "op", op)  # a ReduceOp, or its RedOpType
    if kind == _RedOpType.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:
            raise _unsupported(f"{collective} with ReduceOp.PREMUL_SUM on torch "
                               f"{torch.__version__}, whose ReduceOp does not show its factor "
                               "to Python (torch 2.15 does)")
        return "sum", factor
    name = _REDUCE_OPS.get(kind)
    if name is None:
        raise _unsupported(f"{collective} with ReduceOp.{getattr(kind, 'name', kind)} "
                           "(SUM, AVG, MIN, MAX, PRODUCT and PREMUL_SUM are)")
    return name, None


def _check_tensor(t, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"shardline backend: {what} is a {type(t).__name__}, not a torch.Tensor")
    if t.layout != torch.strided:
        raise _unsupported(f"{what} with layout {t.layout}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"shardline backend: {what} is on {t.device}; this backend moves CPU "
                         "and CUDA tensors (a device map such as 'cpu:shardline,xpu:xccl' gives "
                         "other devices other backends)")


class _Call:
    """One ProcessGroup call being issued: its buffers and what to do once its collectives are
    done (copies back into non-contiguous outputs, into list outputs, ...)."""

    def __init__(self, collective):
        self.collective = collective
        self.works = []  # shardline Works
        self.finish = []
        self.device = None  # the device of its tensors (one per call)

    def place(self, t, what):
        """Checks `t` and that the call's tensors share one device, which a CUDA tensor's
        collective must take."""
        _check_tensor(t, what)
        if self.device is None:
            self.device = t.device
            if t.is_cuda and self.collective not in _CUDA_COLLECTIVES:
                raise _unsupported(f"{self.collective} of CUDA tensors")
        elif t.device != self.device:
            raise ValueError(f"shardline backend: {self.collective}: {what} is on {t.device} "
                             f"but the call's first tensor is on {self.device}")

    @property
    def cuda(self):
        return self.device is not None and self.device.type == "cuda"

    def source(self, t, what, reduce):
        """A contiguous tensor shardline can read with `t`'s values (`t` itself when it is)."""
        self.place(t, what)
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        return self._as_moved(t, what, reduce)

    def target(self, t, what, reduce, initial=False):
        """A contiguous tensor shardline writes whose contents end up in `t` (`t` itself when it
        is contiguous; otherwise a copy, holding `t`'s values when `initial`, copied back when
        the collective is done)."""
        self.place(t, what)
        t = t.detach()
        if t.is_contiguous():
            return self._as_moved(t, what, reduce)
        staged = (t.contiguous() if initial
                  else torch.empty(t.shape, dtype=t.dtype, device=t.device))
        self.finish.append(lambda: t.copy_(staged))
        return self._as_moved(staged, what, reduce)

    def _as_moved(self, t, what, reduce):
        if t.dtype in _NATIVE_DTYPES:
            return t
        if reduce:
            raise _unsupported(f"{self.collective} of {what} with dtype {t.dtype} (reductions "
                               "take float32/64, float16, bfloat16, int8, uint8, int32, int64)")
        # A collective that only copies moves any dtype as its bytes.
        return t.reshape(-1).view(torch.uint8)


def _copy_chunks(flat, outputs):
    def copy():
        for j, out in enumerate(outputs):
            out.detach().copy_(flat[j * out.numel():(j + 1) * out.numel()].view(out.shape))
    return copy
