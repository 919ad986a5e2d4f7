"""The shardline c10d backend's point-to-point operations (private), and the ops built on them
that move only what they must: send, recv and recv_anysource (torch's send, recv, isend, irecv
and batch_isend_irecv); reduce (a reduce-scatter, then each rank's reduced shard to the root);
gather and scatter (only the root's share moves); all-to-all with unequal splits; and
monitored_barrier, naming the ranks that did not arrive.

Streams. reduce, gather, scatter and all-to-all are collectives to torch (every rank calls them,
in the same order), so they run on the group's stream in call order like the other collectives.
A user's sends and receives are not: sends run on the group's send stream (a send never waits
for its receive: collectives/communicator.h), and each receive on the stream of its source (from
any source: a stream of their own), so a receive waiting for its message holds back neither the
collectives nor the receives from other ranks, and receives from one rank stay in call order.

Tags. A user's tag t travels as t mod 2^32; the ops above use tags from 2^32 on, one per kind,
so they never take a user's message."""

import datetime
import threading

import torch

from .. import _core
from .._core import Error
from ._backend_calls import _Call, _check_tensor, _reduce_op
from ._backend_work import _WAIT_MARGIN_S, _Work

_USER_TAG_MASK = (1 << 32) - 1
_TAG_GATHER = (1 << 32) + 1
_TAG_SCATTER = (1 << 32) + 2
_TAG_REDUCE = (1 << 32) + 3
_TAG_ALL_TO_ALL = (1 << 32) + 4
_TAG_BARRIER_ARRIVE = (1 << 32) + 5
_TAG_BARRIER_RELEASE = (1 << 32) + 6


def _seconds(timeout):
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


class _PointToPoint:
    """The operations above, for the group classes (_backend.py), which supply rank(), size(),
    _comm, _label, _timeout_s, _issue and _named_error (_backend_collectives.py)."""

    def _p2p_stream(self, key):
        """The group's shardline stream `key` ("send", "recv from 3", "recv from any"), made on
        first use and kept until the group is shut down."""
        with self._p2p_lock:
            stream = self._p2p_streams.get(key)
            if stream is None:
                stream = _core.host_stream(f"{self._label} {key}")
                self._p2p_streams[key] = stream
            return stream

    def _one_tensor(self, collective, tensors):
        if len(tensors) != 1:
            raise ValueError(f"shardline backend: {collective} takes one tensor, got "
                             f"{len(tensors)}")
        return tensors[0]

    def _check_root(self, collective, root):
        if not 0 <= root < self.size():
            raise ValueError(f"shardline backend: {collective}: root {root} is not a rank of "
                             f"{self.size()}")

    # ---- send and receive ----------------------------------------------------------------------

    def send(self, tensors, dstRank, tag=0):  # noqa: N803 - torch's argument names
        call = _Call("send")
        t = self._one_tensor("send", tensors)
        src = call.source(t, "tensor", reduce=False)
        self._issue(call, "send", src, dstRank, tag & _USER_TAG_MASK,
                    self._p2p_stream("send"))
        return _Work(self, call, [t])

    def recv(self, tensors, srcRank, tag=0):  # noqa: N803
        return self._recv("recv", tensors, srcRank, tag, f"recv from {srcRank}")

    def recv_anysource(self, tensors, tag=0):
        return self._recv("recv_anysource", tensors, _core.ANY_SOURCE, tag, "recv from any")

    def _recv(self, collective, tensors, src_rank, tag, stream_key):
        call = _Call(collective)
        t = self._one_tensor(collective, tensors)
        dst = call.target(t, "tensor", reduce=False)
        self._issue(call, "recv", dst, src_rank, tag & _USER_TAG_MASK,
                    self._p2p_stream(stream_key))
        return _Work(self, call, [t], source=call.works[-1])

    # ---- reduce, gather, scatter ---------------------------------------------------------------

    def reduce(self, tensors, opts=None):
        """The root's tensor := the reduction; the other ranks' stay as they were. A
        reduce-scatter, then each rank's reduced shard to the root: a rank sends about one
        tensor's bytes, where an all-reduce would send twice that. A contiguous tensor whose size
        the ranks divide is reduced where it is (in place on the root, which receives the shards
        straight into it); any other goes through a padded copy."""
        opts = torch.distributed.ReduceOptions() if opts is None else opts
        call = _Call("reduce")
        root, size, me = opts.rootRank, self.size(), self.rank()
        self._check_root("reduce", root)
        t = self._one_tensor("reduce", tensors)
        op, factor = _reduce_op(opts.reduceOp, "reduce")
        source = call.source(t, "tensor", reduce=True)  # checks t; a copy if t is strided
        numel = source.numel()
        direct = factor is None and t.is_contiguous() and numel % size == 0
        if direct:
            flat = source.reshape(-1)
            chunk = numel // size
            reduced = flat  # the root's tensor itself
        else:
            chunk = -(-numel // size)
            flat = torch.zeros(chunk * size, dtype=source.dtype)
            flat[:numel].copy_(source.reshape(-1))
            if factor is not None:
                flat.mul_(factor)
            reduced = torch.empty(chunk * size, dtype=source.dtype) if me == root else None
        if me != root:
            shard = torch.empty(chunk, dtype=flat.dtype)
            self._issue(call, "reduce_scatter", shard, flat, op)
            self._issue(call, "send", shard, root, _TAG_REDUCE)
            return _Work(self, call, [t])
        # In place when direct: the root's shard is its block of its own tensor.
        self._issue(call, "reduce_scatter", reduced[root * chunk:(root + 1) * chunk],
                    flat, op)
        for r in range(size):
            if r != root:
                self._issue(call, "recv", reduced[r * chunk:(r + 1) * chunk], r,
                            _TAG_REDUCE)
        if not direct:
            call.finish.append(lambda: t.detach().copy_(reduced[:numel].view(t.shape)))
        return _Work(self, call, [t])

    def gather(self, output_tensors, input_tensors, opts=None):
        """The root's output_tensors[0][r] := rank r's input; only the inputs move, to the
        root."""
        opts = torch.distributed.GatherOptions() if opts is None else opts
        call = _Call("gather")
        root = opts.rootRank
        self._check_root("gather", root)
        t = self._one_tensor("gather", input_tensors)
        _check_tensor(t, "input")
        if self.rank() != root:
            src = call.source(t, "input", reduce=False)
            self._issue(call, "send", src, root, _TAG_GATHER)
            return _Work(self, call, output_tensors)
        outputs = self._one_tensor("gather's output lists", output_tensors)
        self._check_rank_list("gather", outputs, "output", t, "input", 0)
        for r, out in enumerate(outputs):
            if r == root:
                own = out.detach()
                call.finish.insert(0, lambda own=own: own.copy_(t.detach()))
                continue
            dst = call.target(out, f"output {r}", reduce=False)
            self._issue(call, "recv", dst, r, _TAG_GATHER)
        return _Work(self, call, output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """output_tensors[0] := the root's input_tensors[0][this rank]; only those move."""
        opts = torch.distributed.ScatterOptions() if opts is None else opts
        call = _Call("scatter")
        root = opts.rootRank
        self._check_root("scatter", root)
        out = self._one_tensor("scatter", output_tensors)
        _check_tensor(out, "output")
        if self.rank() != root:
            dst = call.target(out, "output", reduce=False)
            self._issue(call, "recv", dst, root, _TAG_SCATTER)
            return _Work(self, call, output_tensors)
        inputs = self._one_tensor("scatter's input lists", input_tensors)
        self._check_rank_list("scatter", inputs, "input", out, "output", 0)
        for r, t in enumerate(inputs):
            if r == root:
                call.finish.insert(0, lambda t=t: out.detach().copy_(t.detach()))
                continue
            src = call.source(t, f"input {r}", reduce=False)
            self._issue(call, "send", src, r, _TAG_SCATTER)
        return _Work(self, call, output_tensors)

    # ---- all-to-all with unequal splits --------------------------------------------------------

    def _all_to_all_uneven(self, call, outs, ins):
        """Rank j gets ins[j]; outs[i] comes from rank i (contiguous tensors, moved as they
        are): the sends first (they never wait), then the receives in rank order; this rank's
        own part is copied once they are done."""
        me = self.rank()
        for j, src in enumerate(ins):
            if j != me:
                self._issue(call, "send", src, j, _TAG_ALL_TO_ALL)
        for i, dst in enumerate(outs):
            if i != me:
                self._issue(call, "recv", dst, i, _TAG_ALL_TO_ALL)
        if outs[me].numel() != ins[me].numel():
            raise ValueError(f"shardline backend: {call.collective}: this rank sends itself "
                             f"{ins[me].numel()} elements but expects {outs[me].numel()}")
        call.finish.insert(0, lambda: outs[me].copy_(ins[me]))

    # ---- monitored barrier ---------------------------------------------------------------------

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """A barrier in which rank 0 waits for every other rank up to `timeout` and names the
        first one (in rank order; with wait_all_ranks, every one) that did not arrive, in gloo's
        words: "Rank 1 failed to pass monitoredBarrier in 100 ms". The other ranks then fail
        saying they reached it. A rank that misses the deadline aborts the group's
        communicator (as any failed receive does)."""
        timeout_s = self._timeout_s if timeout is None else _seconds(timeout)
        me, size = self.rank(), self.size()
        ms = int(timeout_s * 1000)
        if timeout_s <= 0:
            raise RuntimeError(f"Rank {me} timed out in monitoredBarrier after {ms} ms")
        if size == 1:
            return None
        token = torch.zeros(1, dtype=torch.uint8)
        if me != 0:
            try:
                self._comm.send(token, 0, _TAG_BARRIER_ARRIVE,
                                self._p2p_stream("send")).wait(timeout_s + _WAIT_MARGIN_S)
                release = torch.zeros(1, dtype=torch.uint8)
                self._comm.recv(release, 0, _TAG_BARRIER_RELEASE, self._p2p_stream("recv from 0"),
                                timeout_s).wait(timeout_s + _WAIT_MARGIN_S)
            except Error as e:
                raise RuntimeError(
                    f"Rank {me} successfully reached monitoredBarrier, but received errors while "
                    f"waiting for send/recv from rank 0. Please check rank 0 logs for faulty "
                    f"rank. ({e})") from None
            return None
        arrivals = []
        for r in range(1, size):
            buf = torch.zeros(1, dtype=torch.uint8)
            arrivals.append((r, self._comm.recv(buf, r, _TAG_BARRIER_ARRIVE,
                                                self._p2p_stream(f"recv from {r}"), timeout_s)))
        failed = []
        for r, work in arrivals:
            try:
                work.wait(timeout_s + _WAIT_MARGIN_S)
            except Error:
                failed.append(r)
                if not wait_all_ranks:
                    break
        if failed:
            if wait_all_ranks:
                ranks = ", ".join(str(r) for r in failed)
                raise RuntimeError(f"Ranks {ranks} failed to pass monitoredBarrier in {ms} ms")
            raise RuntimeError(f"Rank {failed[0]} failed to pass monitoredBarrier in {ms} ms")
        for r in range(1, size):
            self._comm.send(token, r, _TAG_BARRIER_RELEASE, self._p2p_stream("send"))
        return None

    def _close_p2p_streams(self):
        with self._p2p_lock:
            self._p2p_streams = {}


def _init_p2p(group):
    group._p2p_streams = {}
    group._p2p_lock = threading.Lock()
