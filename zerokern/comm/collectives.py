"""Collectives as thin wrappers over torch.distributed, counting the bytes each rank sends.

Bytes follow the ring algorithms (DESIGN §5), applied to the tensors really passed, padding
included: all-reduce sends 2(N-1)/N of the buffer, reduce-scatter (N-1)/N of its input,
all-gather (N-1)/N of its output. With one rank, or no process group at all, every op is a local
copy or a no-op and nothing is counted as sent.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from typing import Optional

import torch
import torch.distributed as dist

from .abort import AbortChannel, Waiting, forget_channels
from .debug import CollectiveLog
from .debug import enabled as _debug_enabled
from .exit_guard import guard_gloo_exit
from .pieces import contiguous
from .ring import FutureWork, RingRunner

# One extra group per parent group for stage 3's reduce-scatters ([Note: stage-3 collective
# order] in stage3/runtime.py), made once and shared by every optimizer on that group: groups
# are never destroyed, so one per optimizer would leak connections.
_SPLIT_GROUPS: dict = {}
_CHANNELS: dict = {}  # process group -> AbortChannel (abort.py)
_RINGS: dict = {}  # process group -> RingRunner ([Note: one ring per process group])


def forget_groups() -> None:
    """Drop the groups made and cached here (split groups, abort channels): after
    `dist.destroy_process_group()`, before a new default group (comm/quorum.py)."""
    _SPLIT_GROUPS.clear()
    _CHANNELS.clear()
    for ring in _RINGS.values():
        ring.close()
    _RINGS.clear()
    forget_channels()


def waiting_in(group, what: str):
    """A context for a blocking collective of torch's on `group` (None: the default group)
    that takes part in the ranks' position compare (abort.Waiting; [Note: ranks stuck in
    different collectives]); a no-op context where no optimizer's channel serves the group.
    Its `poll` (None for the no-op) is called while the collective waits."""
    if dist.is_available() and dist.is_initialized():
        group = group if group is not None else dist.group.WORLD
        if group in _CHANNELS:
            return Waiting(_CHANNELS[group], group, what)
    return contextlib.nullcontext()


def _ring_of(group, rank: int, world_size: int) -> RingRunner:
    """[Note: one ring per process group]
    The gloo ring runs a group's collectives on one background thread, in the order they are
    submitted. Each optimizer had a ring of its own, so two optimizers on one process group (a
    second optimizer for some params, a generator and a discriminator) sent their buckets in
    whatever order their two threads reached the wire: the ranks paired one optimizer's
    bucket with the other's, "the ranks issued different collectives" at best, a collective
    timeout at stages 1-2 (tests/optimizer/test_two_optimizers.py, N = 2 and 3). Every
    optimizer on a group now submits to the group's one ring, so its collectives run in
    program order, the same on every rank, as the group's abort channel counts them."""
    if group not in _RINGS:
        _RINGS[group] = RingRunner(group, rank, world_size)
    return _RINGS[group]

# torch 2.13 renamed the flat-tensor collectives (*_single); older torch has only *_tensor.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class _CopyOnWait:
    """A handle whose wait() also copies the result to where the caller wanted it."""

    def __init__(self, handle, tmp: torch.Tensor, out: torch.Tensor) -> None:
        self._h, self._tmp, self._out = handle, tmp, out

    def wait(self) -> bool:
        if self._tmp is not None:
            self._h.wait()
            self._out.copy_(self._tmp)
            self._tmp = None
        return True

    def is_completed(self) -> bool:
        return self._tmp is None


class _Done:
    """Handle of an op that already completed (world size 1)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


KINDS = ("all_reduce", "reduce_scatter", "all_gather")


class CommStats:
    """Bytes sent and calls made per collective since the last reset, per collective kind and
    per mesh dim (the group it ran on: "shard", "replicate" or "world", comm/groups.py)."""

    def __init__(self) -> None:
        self.bytes: Counter = Counter()   # (dim, kind) -> bytes
        self.calls: Counter = Counter()   # (dim, kind) -> calls

    def add(self, kind: str, nbytes: int, dim: str = "shard") -> None:
        self.bytes[(dim, kind)] += nbytes
        self.calls[(dim, kind)] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def as_dict(self) -> dict:
        """{kind: bytes, "total", "calls": {kind: n}, "dims": {dim: {kind: bytes, "total"}}}:
        the kinds summed over the dims (as before meshes), and each dim on its own."""
        dims = sorted({d for d, _ in self.bytes} | {d for d, _ in self.calls})
        out = {k: int(sum(self.bytes[(d, k)] for d in dims)) for k in KINDS}
        out["total"] = sum(out.values())
        out["calls"] = {k: int(sum(self.calls[(d, k)] for d in dims)) for k in KINDS}
        per = {}
        for d in dims:
            per[d] = {k: int(self.bytes[(d, k)]) for k in KINDS}
            per[d]["total"] = sum(per[d].values())
        out["dims"] = per
        return out


class GroupComm:
    """One process group's collectives (world size 1 without init_process_group); a ZeroAdamW
    holds one per role in its `Comm` (comm/groups.py). `dim` names the role in comm_stats()
    ("shard", "replicate", "world")."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None,
                 _parent: Optional[GroupComm] = None, dim: str = "shard",
                 stats: Optional[CommStats] = None, tag: Optional[str] = None) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError("process_group must be a torch.distributed.ProcessGroup or None, "
                            f"got {type(process_group).__name__}")
        if dist.is_available() and dist.is_initialized():
            self.group = process_group or dist.group.WORLD
            self.world_size = dist.get_world_size(self.group)
            self.rank = dist.get_rank(self.group)
        elif process_group is not None:
            raise ValueError("process_group given but torch.distributed is not initialized")
        else:
            self.group, self.world_size, self.rank = None, 1, 0
        self.dim = dim
        self.stats = _parent.stats if _parent is not None else stats or CommStats()
        # One failure channel per process group, shared by every optimizer on it and its split
        # group: its count of collectives is in program order, the same on every rank (abort.py)
        self.abort = None
        if _parent is not None:
            self.abort = _parent.abort
        elif self.world_size > 1:
            if self.group not in _CHANNELS:
                _CHANNELS[self.group] = AbortChannel(self.group, self.rank)
            self.abort = _CHANNELS[self.group]
        self.tag = tag or ("main" if _parent is None else "reduce-scatter")
        # ZEROKERN_DEBUG_COLLECTIVES=1: one log shared with the Comms split from this one,
        # started by the optimizer that checks it at every step() (enable_debug_log), so a
        # log nobody checks never grows.
        self.log = _parent.log if _parent is not None else None
        # gloo: reduce-scatter and all-gather as rings over send/recv ([Note: gloo collectives]),
        # for CPU tensors only ([Note: the ring is for CPU tensors], _ring_for).
        self.ring = None
        self.backend = dist.get_backend(self.group) if self.world_size > 1 else None
        if self.world_size > 1 and self.backend == "gloo":
            guard_gloo_exit()  # [Note: the gloo exit race] in exit_guard.py
            if os.environ.get("ZEROKERN_GLOO_RING", "1") != "0":
                self.ring = _ring_of(self.group, self.rank, self.world_size)
                self.abort.watch_ring(self.ring)

    def split(self) -> GroupComm:
        """A Comm over a second process group with the same ranks (the same group object for
        every optimizer on this group), sharing this one's stats and debug log. World size 1:
        a Comm that only copies."""
        if self.world_size == 1:  # this very group (not None: that means WORLD when
            # torch.distributed is initialized, a 1-rank process group in a bigger job)
            return GroupComm(self.group, _parent=self, dim=self.dim)
        key = self.group
        if key not in _SPLIT_GROUPS:
            ranks = dist.get_process_group_ranks(self.group)
            # use_local_synchronization: only these ranks take part in creating it (a
            # subgroup's optimizer must not need the other ranks of WORLD).
            _SPLIT_GROUPS[key] = dist.new_group(ranks, backend=dist.get_backend(self.group),
                                                use_local_synchronization=True)
        return GroupComm(_SPLIT_GROUPS[key], _parent=self, dim=self.dim)

    def enable_debug_log(self) -> None:
        """Record every collective if ZEROKERN_DEBUG_COLLECTIVES=1 (call before split())."""
        if self.log is None and _debug_enabled():
            self.log = CollectiveLog()

    def check_collectives(self, where: str = "step()") -> None:
        """ZEROKERN_DEBUG_COLLECTIVES=1: raise on every rank if the ranks issued different
        collectives since the last check (a no-op when the mode is off)."""
        if self.log is not None:
            self.log.check(self.group, where)

    def account(self, kind: str, t: torch.Tensor, label: Optional[str]) -> None:
        """Count (and, in debug mode, record) a collective on this group that another group's
        ring thread runs (comm/groups.py's HSDP all-reduce)."""
        self._record(kind, t, label)
        nbytes = t.numel() * t.element_size()
        self.stats.add(kind, int((2 if kind == "all_reduce" else 1) * self._frac() * nbytes),
                       self.dim)

    def _record(self, kind: str, t: torch.Tensor, label: Optional[str]) -> None:
        if self.log is not None:
            self.log.add(self.tag, kind, t, label)

    def _frac(self) -> float:
        return (self.world_size - 1) / self.world_size

    def _ring_for(self, t: torch.Tensor):
        """The ring for a CPU tensor, else None after the ring's queue drained.

        [Note: the ring is for CPU tensors] (issue 24, item 1) The ring sends with
        batch_isend_irecv, and gloo's TCP transport reads a CUDA tensor's address as a host
        pointer (a crash), while gloo's own collectives copy CUDA tensors through the host
        correctly. So CUDA tensors on a gloo group take torch's collective, on the caller's
        thread and stream. Before one does, whatever the ring thread still runs is waited for,
        so this rank's collectives keep one order (a no-op unless CPU and CUDA tensors mix on
        one group: a CUDA-tensor optimizer never queues anything on the ring)."""
        if self.ring is None:
            return None
        if t.device.type == "cpu":
            return self.ring
        self.ring.drain()
        return None

    def _on_ring(self, async_op: bool, fn, *args):
        """Run fn on the ring thread (one order for every collective); a handle if async."""
        i = self.abort.next_index()
        h = FutureWork(self.ring.submit(fn, *args, index=i), self.abort, i)
        if async_op:
            return h
        h.wait()
        return _Done()

    def _issue(self, async_op: bool, fn, *args, **kw):
        """A torch.distributed collective, counted for abort.py. Its wait is torch's: a gloo
        Work's is_completed() was seen never to turn True for the reduce-scatter (a hang when
        polled), so only the ring path (gloo's default) watches for the peers' failures."""
        self.abort.next_index()
        return fn(*args, async_op=async_op, **kw) or _Done()

    def signal_failure(self, error: BaseException) -> None:
        """This rank raises `error`, which its peers may not see: post it for them first."""
        if self.abort is not None:
            self.abort.signal(error)

    @staticmethod
    def _local(out: torch.Tensor, inp: torch.Tensor):
        """World size 1: the collective is a copy (or nothing, in place)."""
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return _Done()

    def agree_(self, t: torch.Tensor, op, label: str, host_group=None) -> None:
        """All-reduce a small CPU tensor of host facts over this group's ranks, on this group
        (gloo) or on `host_group` (a gloo group over the same ranks): recorded in debug mode,
        not counted in comm_stats, which counts the data path ([Note: agreeing on host facts]
        in host_agree.py). Blocking."""
        if self.world_size == 1:
            return
        self._record("all_reduce", t, label)
        if host_group is not None:
            self.abort.next_index()
            dist.all_reduce(t, op=op, group=host_group)
        elif self._ring_for(t) is not None:
            self._on_ring(False, dist.all_reduce, t, op, self.group)
        else:
            self._issue(False, dist.all_reduce, t, op=op, group=self.group)

    def all_reduce_(self, t: torch.Tensor, op=None, async_op: bool = False,
                    label: Optional[str] = None):
        if self.world_size == 1:
            return _Done()
        self._record("all_reduce", t, label)
        self.stats.add("all_reduce", int(2 * self._frac() * t.numel() * t.element_size()),
                       self.dim)
        op = op or dist.ReduceOp.SUM
        if self._ring_for(t) is not None:
            return self._on_ring(async_op, self.ring.all_reduce, t, op)
        return self._issue(async_op, dist.all_reduce, t, op=op, group=self.group)

    def reduce_scatter_(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False,
                        label: Optional[str] = None):
        """out (n) = sum over ranks of inp[rank*n:(rank+1)*n]; inp has world_size*n elements.

        inp is consumed: the gloo ring works in it, so afterwards it holds partial sums (every
        caller reduces a buffer it no longer needs). out may be inp's own chunk,
        inp[rank*n:(rank+1)*n]: the reduction in place (stage 1, full_grads.py). label: names
        the buffer in the ZEROKERN_DEBUG_COLLECTIVES record.
        """
        if self.world_size == 1:
            return self._local(out, contiguous(inp))
        self._record("reduce_scatter", inp, label)
        self.stats.add("reduce_scatter", int(self._frac() * inp.numel() * inp.element_size()),
                       self.dim)
        if self._ring_for(inp) is not None:  # (it reads Pieces: [Note: grads read where they
            # lie])
            return self._on_ring(async_op, self.ring.reduce_scatter, out, inp)
        inp = contiguous(inp)
        if self.backend == "gloo" and _overlaps(out, inp):
            # gloo's own reduce-scatter corrupts an output that aliases its input (NCCL's is in
            # place by design): reduce into a temporary, copied to out when waited for.
            tmp = torch.empty_like(out)
            h = self._issue(async_op, _reduce_scatter, tmp, inp, group=self.group)
            return _CopyOnWait(h, tmp, out)
        return self._issue(async_op, _reduce_scatter, out, inp, group=self.group)

    def all_gather_(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False,
                    label: Optional[str] = None):
        """out[rank*n:(rank+1)*n] = inp of each rank; inp may be that slice of out (in place)."""
        if self.world_size == 1:
            return self._local(out, inp)
        self._record("all_gather", out, label)
        self.stats.add("all_gather", int(self._frac() * out.numel() * out.element_size()),
                       self.dim)
        if self._ring_for(out) is not None:
            # The copy of inp stays here, on the caller's thread: sending straight from inp
            # and copying it on the ring thread while the transfer ran measured slower at
            # stage 3 (20m GPT, 2 ranks, benchmarks/step_paired_ab.py, 3 x 16-24 alternated
            # pairs: 1.014-1.035x), though it took 46 MB of copy_ per forward off the main thread
            n = inp.numel()
            self._local(out[self.rank * n:(self.rank + 1) * n], inp)
            return self._on_ring(async_op, self.ring.all_gather, out)
        return self._issue(async_op, _all_gather, out, inp, group=self.group)
