"""`ReplicaJob`: an HSDP job whose replicas run as separate launcher jobs; a replica that dies
is restarted by its own launcher and takes the training state from a live replica, while the
live replicas keep theirs in memory (issue 39, torchft's idea).

[Note: a replaced replica joins]
The pieces: the replica quorum (comm/quorum.py [Note: a replica quorum]) forms the process
groups of every epoch; `recover_from_replica` (replica.py) copies one replica's state to the
others. `ReplicaJob.join` runs at a replica's first start and on every live rank after a
failure:

1. a live rank (after a failure) takes a view of its model and optimizer (the tensors a
   checkpoint load writes, replica.py `_state_tensors`) before anything else: no collective;
2. `Quorum.form()`: the old groups are destroyed, the next epoch's formed (the live ranks
   wait there for the replaced replica's new processes);
3. `build(mesh)` makes a new model and optimizer (and whatever else the caller keeps: the LR
   scheduler) on the new mesh, on every rank: a zerokern optimizer's construction agrees over
   its groups, so the live ranks build too; a live rank then copies its old state into the
   new objects, bytes for bytes (the layouts are checked equal: the same crc as replica.py's),
   and drops the old ones;
4. every rank says over the new world whether it holds state (fresh: a new process) and its
   optimizer's step count; the source is the replica whose ranks all hold state at the
   highest step count (see below); `recover_from_replica(source)` copies its state and its
   `client_state` (the data position) to every other replica, crc-verified.

[Note: build's other objects]
build's objects after the model and the optimizer (an LR scheduler, anything with
state_dict() and load_state_dict()) are new at every join too. A live rank loads its old
objects' state into them; the replicas that take the source's state take these objects' state
from it as well (with client_state, over recover_from_replica). Before, a LambdaLR built there
began its schedule again at the join: the step after it ran with the LR of step 1, on every
replica, silently (the optimizer's LR was carried, the scheduler's count not;
tests/checkpoint/test_replica_join.py). Objects without a state are left as built. A
scheduler made outside build still drives the old optimizer: keep it in build.

[Note: the step's agreement comes first]
A replica is lost in the middle of a step. Its peers see it in a collective with it: a
backward's replicate all-reduce or the step's agreement over the world (found_inf, the norm),
all of which come before any update of the masters (core/optimizer.py `step`: `_prepare`, then
the update). So a live rank that caught the failure has not updated, and redoes the step with
the same data after the join: the run equals the one never interrupted, bit for bit. Except in
one window: a rank that dies after sending its last part of the agreement's all-reduce may let
some peers complete it (they update: one step further) while others fail. A replica whose
ranks disagree on the step count is torn and is not a source; replicas that are whole but one
step apart take the one ahead (its update used the full agreement). If no replica is whole,
`join` raises on every rank: restart from the last checkpoint.

What is refused (ValueError from `join`, every rank): stage 3 with frozen params (sharded
with their unit: whole only through a collective of the old groups), offload="nvme" or
offload_params, tensor or pipeline parallel params, hpZ and the quantized collectives (tested:
stages 2 and 3, HSDP). At stage 3 a live rank's buffers may still be gathered when the step
failed: its shards, which a gather does not change, are what it carries. Memory: while a live
rank copies, it holds the old and the new model and optimizer (twice its model states, for the
copy's duration).
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..comm import liveness
from ..comm.errors import RankAborted
from ..comm.quorum import Quorum
from .collective import Collective
from .replica import _layout_crc, _state_tensors, recover_from_replica
from .views import model_extras, optimizer_view


def _state_of(obj) -> Optional[dict]:
    """A copy of the state of one of build's other objects (an LR scheduler: anything with
    state_dict() and load_state_dict()), None for the others ([Note: build's other
    objects])."""
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict",
                                                                        None)):
        return copy.deepcopy(obj.state_dict())
    return None


def _load_states(objs: Sequence[Any], states: Sequence[Optional[dict]]) -> None:
    for obj, state in zip(objs, states):
        if state is not None:
            obj.load_state_dict(state)


class ReplicaJobError(RuntimeError):
    """No live replica holds a whole state after a failure: restart from the last
    checkpoint."""


def _stepcount(view) -> int:
    """The highest optimizer step count this rank holds (one host read)."""
    counts = [int(c.value.max()) for c in view.steps if c.value.numel()]
    return max(counts, default=0)


def _snapshot(model, opt, between_steps: bool = True) -> Tuple[Any, list, list]:
    view = optimizer_view(model, opt, between_steps=between_steps)
    extras = model_extras(model, view)
    return view, extras, _state_tensors(view, extras)


def _refusal(opt) -> Optional[str]:
    if opt.stage == 3 and getattr(opt.grad_sync, "frozen", None):
        return ("stage 3 with frozen params (they are sharded with their unit, and whole only "
                "through a collective of the old groups)")
    if getattr(opt, "offload", None) == "nvme" or getattr(opt, "param_homes", None) is not None:
        return "offload='nvme' or offload_params"
    if opt.plan.has_model_parallel:
        return "tensor or pipeline parallel params"
    if opt.comm.hpz is not None or opt.comm.qwz or opt.comm.qgz_bits is not None:
        return "hpZ or the quantized collectives"
    if opt.comm.replicate is None:
        return "an optimizer without the quorum's (replicate, shard) mesh"
    return None


class ReplicaJob:
    """One replica's side of an HSDP job whose replicas restart on their own ([Note: a
    replaced replica joins]).

    Args:
        quorum: this rank's `comm.quorum.Quorum`.
        build: `build(mesh) -> (model, opt, *rest)`: a new model and zerokern optimizer on
            `mesh` (and anything else to keep, such as an LR scheduler), the same on every
            rank; called at every join.
    """

    def __init__(self, quorum: Quorum, build: Callable[[Any], Sequence[Any]]) -> None:
        if not isinstance(quorum, Quorum):
            raise TypeError(f"quorum must be a zerokern.comm.quorum.Quorum, got "
                            f"{type(quorum).__name__}")
        if not callable(build):
            raise TypeError(f"build must be callable, got {type(build).__name__}")
        self.quorum, self.build = quorum, build
        self.joins: List[Dict[str, Any]] = []  # one report per join

    def survivable(self, error: BaseException) -> bool:
        """Whether `error` is a failure of another replica this rank can survive by `join`:
        a peer's loss or abort (RankAborted, PeerLost, a closed connection) not naming a rank
        of this rank's own replica (then this replica is the one that failed: raise, and its
        launcher restarts it).

        Args:
            error: what the training step raised.
        """
        if not (isinstance(error, RankAborted) or liveness.is_connection_error(error)):
            return False
        origin = getattr(error, "origin", None)
        q = self.quorum
        mine = range(q.replica * q.shards, (q.replica + 1) * q.shards)
        return origin is None or origin < 0 or origin not in mine

    def recover(self, objects: Sequence[Any], error: BaseException, client_state: Any = None
                ) -> Tuple[Tuple[Any, ...], Any]:
        """After a training step raised `error`: `join` again if it is survivable (and again
        while a join itself fails survivably: a replica lost while the epoch formed), else
        raise `error`.

        Args:
            objects: what the last join returned (model, opt, *rest).
            error: what the step raised.
            client_state: this rank's loop state at the failed step (the data position).

        Returns:
            As `join`.
        """
        while True:
            if not self.survivable(error):
                raise error
            try:
                return self.join(objects, client_state)
            except Exception as e:  # noqa: BLE001 - judged by survivable() above
                error = e

    def join(self, objects: Optional[Sequence[Any]] = None, client_state: Any = None
             ) -> Tuple[Tuple[Any, ...], Any]:
        """Form the next epoch, build, and take the state of a live replica. Collective over
        every rank of every replica.

        Args:
            objects: None in a new process; after a failure, what the last join returned
                (model, opt, *rest): their state is carried into the new objects.
            client_state: this rank's picklable loop state (the data position); the
                source replica's is returned to every rank.

        Returns:
            ((model, opt, *rest), client_state): the new objects, and the source replica's
            client_state (None when no replica held state: the job's first start).

        Raises:
            ValueError: an optimizer of a kind this does not re-build (module Note).
            ReplicaJobError: no replica holds a whole state (restart from the checkpoint).
        """
        t0 = time.perf_counter()
        old = None
        if objects is not None:
            model, opt = objects[0], objects[1]
            why = _refusal(opt)
            if why is not None:
                raise ValueError(f"ReplicaJob: {why} is not supported")
            # local views, before the old groups go; a stage-3 buffer may still be gathered
            # (the failure came mid-step): its shards are what is read
            old = _snapshot(model, opt, between_steps=False)
            old_rest = [_state_of(o) for o in objects[2:]]
        mesh = self.quorum.form()
        formed = time.perf_counter()
        new = tuple(self.build(mesh))
        if len(new) < 2:
            raise TypeError("build(mesh) must return (model, opt, *rest)")
        model, opt = new[0], new[1]
        world = Collective(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
        why = _refusal(opt)
        err = None if why is None else ValueError(f"ReplicaJob: {why} is not supported")
        if objects is not None and len(new) != len(objects):  # (agreed: no rank waits alone)
            err = ValueError(f"ReplicaJob: build(mesh) returned {len(new)} objects, the last "
                             f"join's {len(objects)} (the same build on every join)")
        world.agree(err)
        view, extras, tensors = _snapshot(model, opt)
        copied = 0
        if old is not None:
            copied = self._carry(old, (view, extras, tensors), opt)
            _load_states(new[2:], old_rest)
        built = time.perf_counter()
        q = self.quorum
        held = old is not None
        seen = world.all_gather((q.replica, held, _stepcount(view) if held else -1))
        source, receivers = self._source(seen)
        report = {"epoch": q.epoch, "source": source, "receivers": receivers,
                  "form_s": formed - t0, "build_s": built - formed, "carried_bytes": copied}
        if receivers:  # (the first start too: every replica takes replica 0's, equal or not)
            mine = {"client": client_state, "rest": [_state_of(o) for o in new[2:]]}
            rec = recover_from_replica(model, opt, source=0 if source is None else source,
                                       client_state=mine)
            client_state = rec["client_state"]["client"]
            if rec["received"]:  # the source's scheduler (and the like) with its state
                _load_states(new[2:], rec["client_state"]["rest"])
            report.update(transfer_s=rec["seconds"], verify_s=rec["verify_seconds"],
                          bytes=rec["bytes"], received=rec["received"])
        report["seconds"] = time.perf_counter() - t0
        self.joins.append(report)
        return new, client_state

    @staticmethod
    def _source(seen: List[Tuple[int, bool, int]]) -> Tuple[Optional[int], List[int]]:
        """(the source replica, or None when none holds state; the replicas that take the
        source's state: those without state, torn or behind)."""
        by: Dict[int, List[Tuple[bool, int]]] = {}
        for rep, held, steps in seen:
            by.setdefault(rep, []).append((held, steps))
        whole = {r: v[0][1] for r, v in by.items()
                 if all(h for h, _ in v) and len({s for _, s in v}) == 1}
        fresh = sorted(r for r, v in by.items() if not any(h for h, _ in v))
        if not whole:
            if len(fresh) == len(by):  # the job's first start: nobody holds state
                return None, fresh
            raise ReplicaJobError(
                "ReplicaJob: no replica holds a whole state after the failure (a replica's "
                "ranks are at different step counts: "
                f"{ {r: [s for _, s in v] for r, v in sorted(by.items())} }); restart the job "
                "from its last checkpoint")
        top = max(whole.values())
        behind = sorted(r for r in by if r not in whole or whole[r] != top)
        return min(r for r, s in whole.items() if s == top), behind

    @staticmethod
    @torch.no_grad()
    def _carry(old, new, opt) -> int:
        """Copy a live rank's old state into its new objects (same layout, checked)."""
        (oview, oextras, otensors), (nview, nextras, ntensors) = old, new
        if _layout_crc(oview, oextras, otensors) != _layout_crc(nview, nextras, ntensors):
            raise ValueError("ReplicaJob: build(mesh) made a model or optimizer of another "
                             "layout than the last join's (the same build on every join)")
        for a, b in zip(otensors, ntensors):
            b.copy_(a)
        for rebuild in nview.after_load:
            rebuild()
        for g, saved in zip(nview.param_groups, oview.param_groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        nview.scaler.load_state_dict(oview.scaler.state_dict())
        opt.state_loaded()
        return sum(t.numel() * t.element_size() for t in ntensors)
