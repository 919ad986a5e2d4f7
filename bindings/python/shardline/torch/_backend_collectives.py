"""The shardline c10d backend's collectives (private): all-reduce, all-gather, reduce-scatter,
broadcast, all-to-all and barrier, each issued on the group's communicator (on its shardline
stream, in call order) and returned as a _Work at once (all-to-all with unequal splits moves
each pair's part as a message: _backend_p2p.py)."""

import torch
import torch.distributed as dist

from .. import _core
from .._core import Error
from ._fsdp_init import _cuda_backend, stream_for
from ._backend_calls import (_NATIVE_DTYPES, _Call, _check_tensor, _copy_chunks, _reduce_op,
                             _unsupported)
from ._backend_work import _WAIT_MARGIN_S, _Completer, _Work, _live_completers


class _Collectives:
    """The collectives of the group classes (_backend.py), which supply rank(), size(),
    _comm, _label and _timeout_s."""

    # ---- helpers -------------------------------------------------------------------------------

    def _completer(self):
        if self._completer_obj is None:
            self._completer_obj = _Completer(f"shardline-futures-{self._label}")
            _live_completers.add(self._completer_obj)
        return self._completer_obj

    def _named_error(self, collective, e):
        message = (f"shardline backend: {collective} on {self._label}, rank {self.rank()} of "
                   f"{self.size()}, failed: {e}")
        error = type(e)(message)
        error.code = getattr(e, "code", None)
        error.peer_error = getattr(e, "peer_error", False)
        return error

    def _issue(self, call, name, *args):
        """Issues the shardline collective `name` of `call`: on the group's communicator for
        CPU tensors; for CUDA tensors on its communicator of that device, enqueued on torch's
        current stream (the work before it on the stream made its inputs; the work after it
        sees its outputs). A refusal raises at once, named."""
        try:
            if call.cuda:
                comm = self._device_comm(call.device)
                call.works.append(getattr(comm, name)(*args, stream=stream_for(comm)))
            else:
                call.works.append(getattr(self._comm, name)(*args))
        except Error as e:
            raise self._named_error(call.collective, e) from e

    def _device_comm(self, device):
        """The group's communicator of CUDA device `device`, joined at its first collective
        (every rank's first CUDA collective of the group: collective, like the rest) through
        the group's store."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        comm = self._device_comms.get(index)
        if comm is None:
            comm = _core.init_with_store(self._store, self.rank(), self.size(),
                                         backend=_cuda_backend(), timeout=self._timeout_s,
                                         name=f"{self._comm_name}.cuda{index}",
                                         device=f"cuda:{index}")
            self._device_comms[index] = comm
        return comm

    # ---- all-reduce ----------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        opts = dist.AllreduceOptions() if opts is None else opts
        return self._allreduce("allreduce", tensors, opts.reduceOp)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        return self._allreduce("allreduce_coalesced", tensors, opts.reduceOp)

    def _allreduce(self, collective, tensors, reduce_op):
        call = _Call(collective)
        op, factor = _reduce_op(reduce_op, collective)
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo:
                self._sparse_allreduce(call, t, op, factor, f"tensor {i}")
                continue
            buf = call.target(t, f"tensor {i}", reduce=True, initial=True)
            if factor is not None:
                buf.mul_(factor)
            self._issue(call, "all_reduce", buf, op)
        return _Work(self, call, list(tensors))

    def _sparse_allreduce(self, call, t, op, factor, what):
        """A SUM of sparse COO tensors, never densified: every rank's coalesced indices and
        values are all-gathered (padded to the largest count, which a first all-gather of the
        counts tells), and `t` becomes their coalesced sum once they are here."""
        if op != "sum" or factor is not None:
            raise _unsupported(f"{call.collective} of sparse {what} with op {op} (SUM is)")
        if t.device.type != "cpu":
            raise ValueError(f"shardline backend: {what} is on {t.device}; this backend moves "
                             "CPU tensors only")
        src = t.detach().coalesce()
        indices = src.indices().t().contiguous()  # nnz x sparse dims
        values = src.values().contiguous()  # nnz x dense shape
        if values.dtype not in _NATIVE_DTYPES:
            raise _unsupported(f"{call.collective} of sparse {what} with dtype {values.dtype}")
        size = self.size()
        counts = torch.zeros(size, dtype=torch.int64)
        try:
            self._comm.all_gather(counts, torch.tensor([indices.shape[0]])).wait(
                self._timeout_s + _WAIT_MARGIN_S)
        except Error as e:
            raise self._named_error(call.collective, e) from e
        most = int(counts.max())
        padded = [torch.zeros((most,) + tuple(x.shape[1:]), dtype=x.dtype)
                  for x in (indices, values)]
        padded[0][:indices.shape[0]] = indices
        padded[1][:values.shape[0]] = values
        gathered = [torch.empty((size * most,) + tuple(x.shape[1:]), dtype=x.dtype)
                    for x in padded]
        for out, mine in zip(gathered, padded):
            self._issue(call, "all_gather", out, mine)

        def finish():
            keep = torch.cat([torch.arange(r * most, r * most + int(counts[r]))
                              for r in range(size)])
            total = torch.sparse_coo_tensor(gathered[0][keep].t(), gathered[1][keep],
                                            t.shape).coalesce()
            with torch.no_grad():
                t.copy_(total)
        call.finish.append(finish)

    # ---- all-gather ----------------------------------------------------------------------------

    def all_gather_single(self, output, input, opts=None):
        call = _Call("all_gather_into_tensor")
        self._all_gather_into(call, output, input, "")
        return _Work(self, call, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        call = _Call("all_gather_into_tensor_coalesced")
        if len(outputs) != len(inputs):
            raise ValueError(f"shardline backend: {call.collective}: {len(outputs)} outputs "
                             f"for {len(inputs)} inputs")
        for i, (output, input) in enumerate(zip(outputs, inputs)):
            self._all_gather_into(call, output, input, f" {i}")
        return _Work(self, call, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _check_per_rank(self, call, big_t, small_t, index, big, small):
        """`big_t` must have `small_t`'s dtype and one `small_t` per rank (the all-gather's
        output, the reduce-scatter's input)."""
        output, input = (big_t, small_t) if big == "output" else (small_t, big_t)
        if output.dtype != input.dtype:
            raise ValueError(f"shardline backend: {call.collective}: output{index} is "
                             f"{output.dtype} but input{index} is {input.dtype}")
        if big_t.numel() != small_t.numel() * self.size():
            raise ValueError(f"shardline backend: {call.collective}: {big}{index} has "
                             f"{big_t.numel()} elements; it needs {small}{index}'s "
                             f"{small_t.numel()} x {self.size()} ranks")

    def _all_gather_into(self, call, output, input, index):
        src = call.source(input, f"input{index}", reduce=False)
        self._check_per_rank(call, output, input, index, big="output", small="input")
        dst = call.target(output, f"output{index}", reduce=False)
        self._issue(call, "all_gather", dst, src)

    def allgather(self, output_lists, inputs, opts=None):
        # output_lists[i][r] receives input i of rank r.
        return self._allgather_lists("allgather", output_lists, inputs, output_lists)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        # torch's layout is the other way round: output_lists[r][i] receives input i of rank r.
        collective = "allgather_coalesced"
        if len(output_lists) != self.size():
            raise ValueError(f"shardline backend: {collective}: {len(output_lists)} output lists "
                             f"for {self.size()} ranks (output_lists[rank][i] receives input i "
                             f"of that rank)")
        for r, outputs in enumerate(output_lists):
            if len(outputs) != len(inputs):
                raise ValueError(f"shardline backend: {collective}: output list {r} has "
                                 f"{len(outputs)} tensors for {len(inputs)} inputs")
        per_input = [[output_lists[r][i] for r in range(self.size())] for i in range(len(inputs))]
        return self._allgather_lists(collective, per_input, inputs, output_lists)

    def _check_rank_list(self, collective, tensors, kind, like, like_kind, i):
        """One tensor per rank in list i, each with the dtype and size of `like`."""
        if len(tensors) != self.size():
            raise ValueError(f"shardline backend: {collective}: {kind} list {i} has "
                             f"{len(tensors)} tensors for {self.size()} ranks")
        for j, t in enumerate(tensors):
            _check_tensor(t, f"{kind} {i}[{j}]")
            if t.numel() != like.numel() or t.dtype != like.dtype:
                raise ValueError(
                    f"shardline backend: {collective}: {kind} {i}[{j}] is {t.dtype} with "
                    f"{t.numel()} elements but {like_kind} {i} is {like.dtype} with "
                    f"{like.numel()} (every rank's tensors must match)")

    def _allgather_lists(self, collective, output_lists, inputs, result):
        """All-gathers each of `inputs` into output_lists[i] (one tensor per rank); the Work's
        result is `result`, the caller's lists as given."""
        call = _Call(collective)
        if len(output_lists) != len(inputs):
            raise ValueError(f"shardline backend: {collective}: {len(output_lists)} output "
                             f"lists for {len(inputs)} inputs")
        for i, (outputs, input) in enumerate(zip(output_lists, inputs)):
            self._check_rank_list(collective, outputs, "output", input, "input", i)
            src = call.source(input, f"input {i}", reduce=False)
            flat = torch.empty(input.numel() * self.size(), dtype=input.dtype,
                               device=input.device)
            dst = call.target(flat, f"output list {i}", reduce=False)
            self._issue(call, "all_gather", dst, src)
            call.finish.append(_copy_chunks(flat, outputs))
        return _Work(self, call, [list(o) for o in result])

    # ---- reduce-scatter ------------------------------------------------------------------------

    def reduce_scatter_single(self, output, input, opts=None):
        opts = dist.ReduceScatterOptions() if opts is None else opts
        call = _Call("reduce_scatter_tensor")
        self._reduce_scatter_into(call, output, input, opts.reduceOp, "")
        return _Work(self, call, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = dist.ReduceScatterOptions() if opts is None else opts
        call = _Call("reduce_scatter_tensor_coalesced")
        if len(outputs) != len(inputs):
            raise ValueError(f"shardline backend: {call.collective}: {len(outputs)} outputs "
                             f"for {len(inputs)} inputs")
        for i, (output, input) in enumerate(zip(outputs, inputs)):
            self._reduce_scatter_into(call, output, input, opts.reduceOp, f" {i}")
        return _Work(self, call, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter_into(self, call, output, input, reduce_op, index):
        op, factor = _reduce_op(reduce_op, call.collective)
        src = call.source(input, f"input{index}", reduce=True)
        if factor is not None:
            src = src * factor
        self._check_per_rank(call, input, output, index, big="input", small="output")
        dst = call.target(output, f"output{index}", reduce=True)
        self._issue(call, "reduce_scatter", dst, src, op)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = dist.ReduceScatterOptions() if opts is None else opts
        call = _Call("reduce_scatter")
        op, factor = _reduce_op(opts.reduceOp, call.collective)
        if len(outputs) != len(input_lists):
            raise ValueError(f"shardline backend: reduce_scatter: {len(outputs)} outputs for "
                             f"{len(input_lists)} input lists")
        for i, (output, inputs) in enumerate(zip(outputs, input_lists)):
            self._check_rank_list("reduce_scatter", inputs, "input", output, "output", i)
            flat = torch.cat([t.detach().reshape(-1) for t in inputs])
            if factor is not None:
                flat.mul_(factor)
            src = call.source(flat, f"input list {i}", reduce=True)
            dst = call.target(output, f"output {i}", reduce=True)
            self._issue(call, "reduce_scatter", dst, src, op)
        return _Work(self, call, list(outputs))

    # ---- broadcast, all-to-all, barrier --------------------------------------------------------

    def broadcast(self, tensors, opts=None):
        opts = dist.BroadcastOptions() if opts is None else opts
        call = _Call("broadcast")
        root = opts.rootRank
        if not 0 <= root < self.size():
            raise ValueError(f"shardline backend: broadcast: root {root} is not a rank of "
                             f"{self.size()}")
        if opts.rootTensor != 0:
            raise _unsupported(f"broadcast with rootTensor {opts.rootTensor} (each tensor of "
                               "the list is broadcast from the root rank's same tensor)")
        for i, t in enumerate(tensors):
            buf = call.target(t, f"tensor {i}", reduce=False, initial=True)
            self._issue(call, "broadcast", buf, root)
        return _Work(self, call, list(tensors))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        call = _Call("all_to_all_single")
        _check_tensor(input, "input")
        _check_tensor(output, "output")
        if output.dtype != input.dtype:
            raise ValueError(f"shardline backend: all_to_all_single: output is {output.dtype} "
                             f"but input is {input.dtype}")
        in_rows = self._split_rows("input", input, input_split_sizes)
        out_rows = self._split_rows("output", output, output_split_sizes)
        if len(set(in_rows)) == 1 and in_rows == out_rows and input.numel() == output.numel():
            src = call.source(input, "input", reduce=False)
            dst = call.target(output, "output", reduce=False)
            self._issue(call, "all_to_all", dst, src)
            return _Work(self, call, [output])
        if input.is_cuda:
            raise _unsupported("all_to_all_single with unequal splits of CUDA tensors")
        # Unequal splits: rank j gets input's rows of split j, each pair's rows as one message.
        flat_in = input.detach().contiguous().reshape(-1)
        out = output.detach()
        staged = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
        if staged is not out:
            call.finish.append(lambda: out.copy_(staged))
        flat_out = staged.reshape(-1)
        ins = [call.source(part, f"input split {j}", reduce=False)
               for j, part in enumerate(_split_flat(flat_in, input, in_rows))]
        outs = [call.target(part, f"output split {i}", reduce=False)
                for i, part in enumerate(_split_flat(flat_out, output, out_rows))]
        self._all_to_all_uneven(call, outs, ins)
        return _Work(self, call, [output])

    alltoall_base = all_to_all_single

    def _split_rows(self, name, t, splits):
        """The rows of `t` (its first dimension) that go to / come from each rank."""
        size = self.size()
        rows = t.shape[0] if t.dim() > 0 else 1
        if not splits:
            if rows % size != 0:
                raise ValueError(f"shardline backend: all_to_all_single: {name} has {rows} "
                                 f"rows, not a multiple of the {size} ranks (give "
                                 f"{name}_split_sizes)")
            return [rows // size] * size
        splits = [int(s) for s in splits]
        if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(f"shardline backend: all_to_all_single: {name}_split_sizes "
                             f"{splits} must be {size} sizes >= 0 adding up to {name}'s {rows} "
                             "rows")
        return splits

    def alltoall(self, outputs, inputs, opts=None):
        call = _Call("alltoall")
        size = self.size()
        if len(outputs) != size or len(inputs) != size:
            raise ValueError(f"shardline backend: alltoall: {len(outputs)} outputs and "
                             f"{len(inputs)} inputs for {size} ranks")
        first = inputs[0]
        for name, ts in (("input", inputs), ("output", outputs)):
            for j, t in enumerate(ts):
                _check_tensor(t, f"{name} {j}")
                if t.dtype != first.dtype:
                    raise ValueError(f"shardline backend: alltoall: {name} {j} is {t.dtype} "
                                     f"but input 0 is {first.dtype}")
        if any(t.numel() != first.numel() for t in list(inputs) + list(outputs)):
            if first.is_cuda:
                raise _unsupported("alltoall with unequal sizes of CUDA tensors")
            ins = [call.source(t, f"input {j}", reduce=False) for j, t in enumerate(inputs)]
            outs = [call.target(t, f"output {i}", reduce=False) for i, t in enumerate(outputs)]
            self._all_to_all_uneven(call, outs, ins)
            return _Work(self, call, list(outputs))
        flat_in = torch.cat([t.detach().reshape(-1) for t in inputs])
        flat_out = torch.empty_like(flat_in)
        src = call.source(flat_in, "inputs", reduce=False)
        dst = call.target(flat_out, "outputs", reduce=False)
        self._issue(call, "all_to_all", dst, src)
        call.finish.append(_copy_chunks(flat_out, outputs))
        return _Work(self, call, list(outputs))

    def barrier(self, opts=None):
        call = _Call("barrier")
        self._issue(call, "barrier")
        return _Work(self, call, [])


def _split_flat(flat, t, rows):
    """`flat` (t's elements, contiguous) cut into parts of `rows` rows of t each."""
    per_row = t.numel() // (t.shape[0] if t.dim() > 0 else 1) if t.numel() else 0
    parts, at = [], 0
    for r in rows:
        parts.append(flat[at:at + r * per_row])
        at += r * per_row
    return parts
