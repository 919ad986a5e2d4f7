"""shardline.torch.elastic: fully_shard over replica groups that may drop out and rejoin
(collectives/elastic/elastic_group.h, issue 33).

    elastic = shardline.torch.elastic()          # joins from shardline-launch --max-restarts N
    for block in model.blocks:                   #   --shard-size S (a replica group: S ranks)
        fully_shard(block, mesh=elastic)
    fully_shard(model, mesh=elastic)
    opt = torch.optim.AdamW(model.parameters())
    elastic.step_committed(lambda step: loader.advance())   # optional: the data follows commits
    while elastic.committed_steps < total_steps:
        with elastic.step(model, opt) as step:   # step.index: the step to train
            loss = loss_fn(model(batch(step.index))); loss.backward()
            opt.step(); opt.zero_grad()

Each `with elastic.step(...)` block is one round of the elastic protocol:
  * entering arrives at the round and waits for its quorum. When the round has new
    communicators (round.rebuilt: after a failure, or when a replica group joins), every root's
    Scheduler is rebuilt over the round's shard and replicate groups, on new streams, with the
    master shards copied over and the parameters re-pointed at them (the optimizer's state is
    keyed by the same nn.Parameter objects). When replica groups join, a live replica sends
    them the master shards and the optimizer's state and hyperparameters (transfer_state).
    Every step starts from zero gradients.
  * optimizer.step() votes for the round's commit and steps only if every member voted ok;
    if the round aborted (a rank died, a collective failed) it returns without stepping, and
    the block ends normally. A shardline.Error raised inside the block (the collective that met
    the dead rank) votes against the commit and is swallowed when the round aborted. Any other
    exception votes against it too and propagates (a bug is not retried).
  * leaving votes for the commit if optimizer.step() did not (a block without an optimizer
    step), and on a commit calls the step_committed callbacks with the step's index.
  * the loop above then runs the next round: the same step.index after an abort (step.redo is
    True), the next one after a commit. Derive the step's data from step.index, or advance the
    data in a step_committed callback, and no batch is skipped or repeated.
A rank whose replica group lost a rank is left out of the next round: entering the block raises
shardline.RemoteError (code ABORTED); the process should exit (the launcher restarts the group,
which joins again at a round boundary).
"""

import ast
import functools
import types

import torch

import shardline

from . import _fsdp_state
from ._fsdp_param_group import _place

__all__ = ["Elastic", "ElasticStep", "elastic"]


def elastic(*, timeout=None, round_timeout=None, name="elastic", max_consecutive_aborts=8):
    """Joins the elastic job this process was launched into (shardline-launch --max-restarts N
    --shard-size S, or any launcher that sets the same variables: RANK, WORLD_SIZE,
    MASTER_ADDR/MASTER_PORT of a store hosted outside the ranks, SHARDLINE_SHARD_SIZE,
    SHARDLINE_RESTART_COUNT) and returns the Elastic object to pass as fully_shard's mesh.
    timeout bounds the join (None: SHARDLINE_TIMEOUT_S); round_timeout bounds the rounds'
    communicators and how long a round waits for a silent rank; after max_consecutive_aborts
    aborted rounds in a row the step raises instead of being tried again."""
    return Elastic(shardline.ElasticGroup(timeout=timeout, round_timeout=round_timeout,
                                          name=name,
                                          max_consecutive_aborts=max_consecutive_aborts))


class ElasticStep:
    """One round of the training loop (Elastic.step): what it trains and how it ended."""

    def __init__(self, elastic, model, optimizer, timeout):
        self._elastic = elastic
        self._model = model
        self._optimizer = optimizer
        self._timeout = timeout
        self.index = None      # the step to train (committed steps before this round)
        self.round = None      # the protocol's round number
        self.replicas = None   # the member replica groups of the round
        self.joiners = None    # the replica groups that joined in this round
        self.redo = False      # this step was tried before and aborted
        self.committed = None  # None until the vote; then whether the round committed
        self.stepped = False   # optimizer.step() ran (on a commit)

    def __enter__(self):
        e = self._elastic
        if e._open is not None:
            raise RuntimeError("elastic.step: a step is already open (steps do not nest)")
        e._open = self
        try:
            e._begin(self)
        except BaseException:
            e._open = None
            e._round = None
            raise
        return self

    def __exit__(self, kind, value, traceback):
        e = self._elastic
        try:
            if self.committed is None:
                e._vote(self, value)
            if self.committed:
                if value is None:
                    e._tried = None
                    for callback in list(e._callbacks):
                        callback(self.index)
                return False
            # Aborted: the next round redoes the step. The error that came of the failure (a
            # collective that met the dead rank) is the failure's, not the program's.
            return value is not None and _is_shardline_error(value)
        finally:
            e._open = None
            e._round = None

    def __repr__(self):
        state = {None: "open", True: "committed", False: "aborted"}[self.committed]
        return (f"<shardline.torch.ElasticStep {self.index} round {self.round} replicas "
                f"{self.replicas} {state}>")


def _is_shardline_error(error):
    while error is not None:
        if isinstance(error, shardline.Error):
            return True
        error = error.__cause__ or error.__context__
    return False


class Elastic:
    """An elastic job's rank as fully_shard's mesh (hybrid: replicate x shard, where the
    replicate dimension is the round's member replica groups). Made by elastic()."""

    _shardline_elastic = True  # fully_shard's mesh handling recognises it (_fsdp_init.py)

    def __init__(self, group):
        self.group = group
        self._round = None      # the current shardline.ElasticRound (inside a step)
        self._roots = []        # the _Roots over this object's rounds, in initialisation order
        self._callbacks = []
        self._open = None       # the open ElasticStep
        self._tried = None      # the index of the step that aborted last (for step.redo)

    # -- what the job looks like
    @property
    def shard_size(self):
        """Ranks per replica group (the shard dimension)."""
        return self.group.shard_size

    @property
    def replicas(self):
        """Replica groups at full strength."""
        return self.group.replicas

    @property
    def replica(self):
        return self.group.replica

    @property
    def shard(self):
        return self.group.shard

    @property
    def incarnation(self):
        """0 at launch; each restart of this rank's replica group adds one."""
        return self.group.incarnation

    @property
    def rank(self):
        """This rank in the job at full strength: replica * shard_size + shard."""
        return self.replica * self.shard_size + self.shard

    @property
    def size(self):
        """Ranks at full strength."""
        return self.replicas * self.shard_size

    @property
    def committed_steps(self):
        """Steps committed so far (the index the next step trains, unless it aborts)."""
        return self.group.committed_steps

    @property
    def recoveries(self):
        """[shardline.ElasticRecovery]: the failures this rank survived, and what each cost."""
        return self.group.recoveries

    def __repr__(self):
        return f"<shardline.torch.Elastic {self.group!r}>"

    # -- the loop
    def await_joiner(self, *, timeout=None):
        """Between steps: returns at once if the last step had every replica group; else blocks
        until a group that was not in it (a restarted one) is ready to join the next step, which
        it then does (say, to have the job whole again before a checkpoint). TimeoutError-like shardline error after `timeout`
        seconds (None: SHARDLINE_TIMEOUT_S)."""
        if self._open is not None:
            raise RuntimeError("await_joiner: inside a step; call it between steps")
        self.group.await_joiner(timeout=timeout)

    def step_committed(self, callback):
        """Calls callback(step_index) after each step that committed (at the end of its
        `with elastic.step(...)` block); returns callback, so it can decorate a function. Use
        it to advance a data loader only on commits."""
        if not callable(callback):
            raise TypeError(f"step_committed: callback must be callable, not "
                            f"{type(callback).__name__}")
        self._callbacks.append(callback)
        return callback

    def step(self, model, optimizer=None, *, timeout=None):
        """The context manager of one round (see the module's docstring). model: the root
        module, fully_shard'ed with mesh=this object; optimizer: the torch optimizer over its
        parameters, whose step() then only applies on a commit and whose state joining replica
        groups receive (None: no optimizer state to move; the block commits at its end).
        timeout: seconds that bound each wait of the protocol (None: four round timeouts;
        the protocol itself decides a round within a round timeout of silence, so this only
        ends a wait that would otherwise never end)."""
        from ._fully_shard import FSDPModule  # (_fully_shard imports _fsdp_state)

        if not isinstance(model, FSDPModule):
            raise TypeError(f"elastic.step: model must be a fully_shard'ed module, not "
                            f"{type(model).__name__}")
        st = model._shardline_state
        if st.mesh[0] is not self:
            raise ValueError("elastic.step: the model was fully_shard'ed over another mesh; "
                             "pass mesh=this Elastic object to fully_shard")
        if st.flat_param is not None:
            raise NotImplementedError("elastic.step: FullyShardedDataParallel's flat parameters "
                                      "(use_orig_params=False); use fully_shard")
        if optimizer is not None:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"elastic.step: optimizer must be a torch.optim.Optimizer or "
                                f"None, not {type(optimizer).__name__}")
            self._watch(optimizer)
        if timeout is None:
            timeout = 4 * self.group.round_timeout
        return ElasticStep(self, model, optimizer, timeout)

    # -- inside
    def _round_groups(self, root):
        """The current round's (shard, replicate) communicators, for `root`'s Scheduler
        (_fsdp_state._Root.make_scheduler)."""
        if self._round is None:
            raise RuntimeError(
                "fully_shard: a model sharded over shardline.torch.elastic() runs its forward "
                "inside `with elastic.step(model, optimizer):`, which provides the round's "
                "communicators")
        return self._round.shard, self._round.replicate

    def _begin(self, step):
        """Arrives at rounds until one is ready to train: its schedulers built, the joiners fed.
        A round that cannot be prepared (a rank died meanwhile) is voted down and the next one
        tried."""
        while True:
            round_ = self.group.begin_round(timeout=step._timeout)
            self._round = round_
            try:
                self._prepare(round_, step)
            except Exception as error:
                for root in self._roots:
                    _reset_root(root)
                if self.group.end_round(error, timeout=step._timeout):
                    raise RuntimeError("elastic.step: a round committed although this rank "
                                       "could not prepare it") from error
                if not _is_shardline_error(error):
                    raise
                continue
            step.index = round_.step
            step.round = round_.round
            step.replicas = list(round_.replicas)
            step.joiners = list(round_.joiners)
            step.redo = self._tried == round_.step
            self._tried = round_.step
            return

    def _prepare(self, round_, step):
        if round_.rebuilt:
            for root in self._roots:
                _rebuild(root)
        # A root's first round (the first step, or a restarted process's): its Scheduler over
        # this round's groups, before any state moves.
        root = _fsdp_state._init_outermost(step._model._shardline_state)
        if root not in self._roots:
            self._roots.append(root)  # rebuilt with every later rebuilt round
        for root in self._roots:
            _reset_root(root)
        if round_.joiners:
            self._transfer(round_, step)

    def _vote(self, step, error):
        committed = self.group.end_round(error, timeout=step._timeout)
        step.committed = committed
        if not committed:
            for root in self._roots:
                _reset_root(root)

    def _watch(self, optimizer):
        """Makes optimizer.step() vote first and step only on a commit (inside a step)."""
        owner = getattr(optimizer, "_shardline_elastic", None)
        if owner is self:
            return
        if owner is not None:
            raise ValueError("elastic.step: the optimizer steps for another Elastic object")
        original = optimizer.step

        @functools.wraps(original)
        def step(opt, *args, **kwargs):
            open_step = self._open
            if open_step is None or open_step._optimizer is not optimizer:
                return original(*args, **kwargs)
            if open_step.committed is None:
                self._vote(open_step, None)
            if not open_step.committed:
                return None  # the round aborted: the next one redoes the step
            if open_step.stepped:
                raise RuntimeError("elastic.step: optimizer.step() ran twice in one step")
            open_step.stepped = True
            return original(*args, **kwargs)

        # A bound method, as torch's LR schedulers expect when they wrap it in turn.
        optimizer.step = types.MethodType(step, optimizer)
        optimizer._shardline_elastic = self

    # -- state for joiners
    def _transfer(self, round_, step):
        """Moves the master shards and the optimizer's state from the donor replica to the
        joiners of this shard index: first the optimizer's layout (its state's keys, dtypes and
        shapes, and the groups' hyperparameters), which a joiner rebuilds its state from, then
        every tensor in place."""
        optimizer = step._optimizer
        timeout = step._timeout
        layout = _optimizer_layout(optimizer).encode()
        size = torch.tensor([len(layout)], dtype=torch.int64)
        self.group.transfer_state([size], timeout=timeout)
        if round_.joining:
            text = torch.zeros(int(size.item()), dtype=torch.uint8)
        else:
            text = torch.frombuffer(bytearray(layout), dtype=torch.uint8)
        self.group.transfer_state([text], timeout=timeout)
        if round_.joining:
            _apply_optimizer_layout(optimizer, bytes(text.numpy()).decode())
        pieces = [root.scheduler.master_shard(st.unit)
                  for root in self._roots for st in root.units]
        pieces += _optimizer_tensors(optimizer)
        self.group.transfer_state(pieces, timeout=timeout)


def _optimizer_params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def _optimizer_layout(optimizer):
    """The optimizer's hyperparameters and the layout of its state, as a Python literal."""
    if optimizer is None:
        return "None"
    groups = [{k: v for k, v in group.items() if k != "params"}
              for group in optimizer.param_groups]
    states = []
    for p in _optimizer_params(optimizer):
        entries = []
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if torch.is_tensor(value):
                entries.append((key, "tensor", str(value.dtype).removeprefix("torch."),
                                tuple(value.shape)))
            else:
                entries.append((key, "value", value))
        states.append(entries)
    text = repr({"groups": groups, "states": states})
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError) as error:
        raise NotImplementedError(
            "elastic: the optimizer's hyperparameters or state hold values other than numbers, "
            f"strings, tuples and tensors, which a joining replica cannot be sent: {text[:200]}"
        ) from error
    return text


def _apply_optimizer_layout(optimizer, text):
    """A joiner: the donor's hyperparameters, and state tensors of the donor's layout (their
    values arrive next)."""
    layout = ast.literal_eval(text)
    if optimizer is None or layout is None:
        if (optimizer is None) != (layout is None):
            raise ValueError("elastic: one replica passes an optimizer to elastic.step and "
                             "another does not")
        return
    params = _optimizer_params(optimizer)
    if (len(layout["groups"]) != len(optimizer.param_groups)
            or len(layout["states"]) != len(params)):
        raise ValueError(
            f"elastic: the donor's optimizer has {len(layout['groups'])} parameter groups and "
            f"{len(layout['states'])} parameters; this one {len(optimizer.param_groups)} and "
            f"{len(params)} (the same model and optimizer on every replica?)")
    for group, settings in zip(optimizer.param_groups, layout["groups"]):
        group.update(settings)
    for p, entries in zip(params, layout["states"]):
        state = {}
        for key, kind, *rest in entries:
            if kind == "tensor":
                dtype, shape = rest
                state[key] = torch.zeros(shape, dtype=getattr(torch, dtype))
            else:
                state[key] = rest[0]
        if state:
            optimizer.state[p] = state
        else:
            optimizer.state.pop(p, None)


def _optimizer_tensors(optimizer):
    if optimizer is None:
        return []
    out = []
    for p in _optimizer_params(optimizer):
        for _, value in sorted(optimizer.state.get(p, {}).items()):
            if torch.is_tensor(value):
                if value.device.type != "cpu" or not value.is_contiguous():
                    raise NotImplementedError("elastic: optimizer state that is not a contiguous "
                                              "CPU tensor cannot be sent to a joining replica")
                out.append(value)
    return out


def _reset_root(root):
    """Ends whatever a failed step left open in `root` without touching its scheduler (whose
    communicators may be gone): the modules hold their sharded parameters again, the hooks'
    state is cleared, and the gradients are dropped (the next step starts from zero)."""
    if root.saved_hooks is not None:
        root.saved_hooks.__exit__(None, None, None)
        root.saved_hooks = None
    for st in root.units:
        _place(st, st.params)
        for p in st.params:
            p.grad = None
    root.in_forward = False
    root.clear_step()  # a stale hook of the failed step's graph is recognised as such


def _rebuild(root):
    """A new Scheduler for `root` over the current round's groups (new streams: an aborted
    round poisons every stream that waited on it), the master shards copied over from the old
    one and the parameters pointed at them."""
    if root.scheduler is not None:
        # Kept on the root until a new scheduler holds them (its creation may fail: a member
        # died meanwhile, and the next round tries again).
        root.elastic_kept = [root.scheduler.master_shard(st.unit).clone() for st in root.units]
        for st in root.units:
            for p in st.params:
                p.grad = None
                p.data = torch.empty(0, dtype=p.dtype)
        root.scheduler = None
    root.make_scheduler(root.elastic)
    root.register_units()
    s = root.scheduler
    for st, master_values in zip(root.units, root.elastic_kept):
        master = s.master_shard(st.unit)
        master.copy_(master_values)
        for p, (offset, length) in zip(st.params, st.slices):
            p.data = master[offset:offset + length]
    root.elastic_kept = None
    if root.root_state.limit_all_gathers:
        s.set_budget(0, max(2, s.minimum_budget_units))
