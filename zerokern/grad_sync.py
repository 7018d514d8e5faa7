"""Gradient paths per stage: where grads accumulate and when they are reduced (DESIGN §2).

Semantics are torch's and DDP's at every stage: gradients SUM over the backward passes since
`zero_grad()` (also across a `step()` without `zero_grad()`) and are AVERAGED over ranks.
Backward passes inside `opt.no_sync()` accumulate locally with no communication, as DDP's.

- FullGrads (stages 0 and 1): `p.grad` are views into one full flat grad buffer, so autograd
  accumulates straight into it. Outside `no_sync()` each bucket is reduced during backward as
  soon as its grads are in (async, overlapping the rest of backward, as DDP does): stage 0
  all-reduces it in place, pre-divided by N, so `p.grad` is exactly DDP's gradient; stage 1
  reduce-scatters it into a grad shard and `p.grad` is released (see released_grad.py). Grads
  left unreduced (only `no_sync()` backward passes) are reduced at `step()`.
- BucketedGrads (stage 2): a post-accumulate-grad hook copies each grad into its bucket's staging
  buffer and drops `p.grad`; a full bucket is reduce-scattered at once (async) into this rank's
  grad shard. Inside `no_sync()` grads go to a full local accumulator instead (Ψ elements, as
  FSDP2's `set_requires_gradient_sync(False)`), folded into the next synced backward.
  Its shard accumulation is ShardedGrads, which stage 3's Stage3Sync shares.

[Note: collective order]
Every rank must issue the same collectives in the same order or NCCL/gloo hang. Buckets are
therefore launched in one fixed order; a bucket that fills early waits for its turn, and the
end-of-backward callback flushes what is left, so params without a grad on some rank cannot
reorder anything. The order is static, so no rank needs to tell another (learning it from a
backward, as DDP's bucket rebuild does, would need a broadcast and a host read of its result).
Buckets go in descending order of where they start *within their own group*, as a fraction of
the group: within a group that is reverse param order, the order grads arrive in; across groups
it interleaves them by depth. A bucket that spans many layers (a small group of biases) starts
near 0 and goes last: launched first, it would hold every other bucket back until backward ends.

[Note: p.grad the user sees]
After a backward `p.grad` is DDP's gradient (stage 0), the local accumulation inside `no_sync()`
(stages 0-1, as DDP), a ReleasedGrad (stages 1-3 once reduced: any use raises), or None where
the param got no gradient since `zero_grad(set_to_none=True)`. At the start of every backward
the params are checked: a `p.grad` the user cleared (`model.zero_grad()`, `p.grad = None`)
clears that param's accumulated gradient here too, as it would in torch.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch.autograd import Variable

from .comm import Comm
from .flat_group import FlatGroup
from .released_grad import ReleasedGrad

# At most this many stage-2 reduce-scatters in flight before the oldest is waited for: two
# overlap communication with the next bucket's backward; more only hold staging memory.
MAX_IN_FLIGHT = 2


def launch_order(groups) -> List[Tuple[int, int]]:
    """(group, bucket) in the fixed launch order of [Note: collective order]."""
    key = [(g.layout.bucket_range(k)[0] / max(g.layout.numel, 1), gi, k)
           for gi, g in enumerate(groups) for k in range(g.layout.n_buckets)]
    return [(gi, k) for _, gi, k in sorted(key, reverse=True)]


class GradSync:
    """Base: hooks, backward bookkeeping and the p.grad state shared by all stages."""

    stage = -1
    averaged = False  # the reduced grads are already divided by N (stage 0); else summed

    def __init__(self, groups: List[FlatGroup], comm: Comm, reduce_dtype: torch.dtype) -> None:
        self.groups = groups
        self.comm = comm
        self.reduce_dtype = reduce_dtype
        self.micro_steps = 0          # backward passes since zero_grad (host int, no sync)
        self.generation = 0           # bumped by every backward and zero_grad (stale stats)
        self.sync = True              # False inside no_sync(): accumulate locally
        self.require_scaled = False   # set by the optimizer: fp16 needs opt.backward(loss)
        self.unscaled_backward = False  # a backward since zero_grad skipped the loss scale
        self.before_backward = None   # callback (the optimizer follows the model there)
        self.detached = False         # another ZeroAdamW took these params over
        self._in_backward = False
        self._got: List[List[bool]] = [[False] * len(g.params) for g in groups]  # this backward
        self._exposed: List[List[Optional[torch.Tensor]]] = [[None] * len(g.params)
                                                             for g in groups]
        self._hooks = []
        ref = weakref.ref(self)  # hooks live in C++: a strong ref would be an uncollectable cycle
        for gi, g in enumerate(groups):
            for i, p in enumerate(g.params):
                p._zerokern_sync = ref  # marks the param as owned (see ZeroAdamW's check)
                self._hooks.append(p.register_hook(
                    lambda grad, ref=ref: _call(ref, "begin_from_hook", False)))
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda p, gi=gi, i=i, ref=ref: _call(ref, "_on_grad", gi, i, p)))

    # ---- backward bookkeeping ---------------------------------------------------------------
    def mark_scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Hook the scaled loss: its grad is the first thing a backward computes."""
        if loss.requires_grad:
            ref = weakref.ref(self)
            loss.register_hook(lambda g: _call(ref, "begin_from_hook", True))
        return loss

    def begin_from_hook(self, scaled: bool) -> None:
        if not self._in_backward:
            self._begin_backward(scaled)

    def _begin_backward(self, scaled: bool = False) -> None:
        """First hook of a backward: queue its end, follow the user's p.grad changes."""
        if self._in_backward:
            return
        if self.require_scaled and not scaled:
            self.unscaled_backward = True
        if self.before_backward is not None:
            self.before_backward()
        self._in_backward = True
        Variable._execution_engine.queue_callback(self._end_backward)
        self.generation += 1
        self._adopt_user_grads()
        self._got = [[False] * len(g.params) for g in self.groups]
        self.begin_backward()

    def _end_backward(self) -> None:
        self.end_backward()
        self._in_backward = False
        self.micro_steps += 1
        self._expose()

    def _on_grad(self, gi: int, i: int, p: torch.Tensor) -> None:
        if p.grad is not None and p.grad.layout != torch.strided:
            raise TypeError(f"zerokern: param {i} of param group {gi} got a {p.grad.layout} "
                            "gradient; sparse gradients are not supported (use dense "
                            "embeddings, e.g. nn.Embedding(sparse=False))")
        self._begin_backward()
        self._got[gi][i] = True
        self.on_grad(gi, i, p)

    def _adopt_user_grads(self) -> None:
        """Compare each p.grad with what we left there; act on what the user changed."""
        cleared, foreign = [], []
        for gi, g in enumerate(self.groups):
            for i, p in enumerate(g.params):
                mine, cur = self._exposed[gi][i], p.grad
                if cur is mine:
                    continue
                if cur is None:
                    cleared.append((gi, i))
                else:
                    foreign.append((gi, i))
        if foreign:
            self.adopt_foreign(foreign)
        if cleared:
            if len(cleared) == sum(e is not None for row in self._exposed for e in row):
                self.clear_all()  # model.zero_grad(): every grad we showed was cleared
            else:
                self.clear_some(cleared)
            for gi, i in cleared:
                self._exposed[gi][i] = None

    def has_grads(self) -> bool:
        """False when every p.grad we showed was cleared by the user since the backward."""
        return any(self.groups[gi].params[i].grad is not None
                   for gi, row in enumerate(self._exposed) for i, e in enumerate(row)
                   if e is not None)

    def _expose(self) -> None:
        for gi, g in enumerate(self.groups):
            for i, p in enumerate(g.params):
                if self._exposed[gi][i] is None and not self._got[gi][i]:
                    p.grad = None  # no gradient since zero_grad(set_to_none=True), as torch
                else:
                    p.grad = self.exposed_grad(gi, i)
                self._exposed[gi][i] = p.grad

    def detach(self) -> None:
        """Remove the hooks; the owning optimizer can no longer step (params were taken over)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.detached = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.micro_steps = 0
        self.generation += 1
        self.unscaled_backward = False
        self.clear_all()
        for gi, g in enumerate(self.groups):
            for i, p in enumerate(g.params):
                p.grad = None if set_to_none else self.zeroed_grad(gi, i)
                self._exposed[gi][i] = p.grad

    def readopt(self) -> None:
        """The params were re-viewed (model_sync.py): show our grads on them again."""
        for gi, g in enumerate(self.groups):
            for i, p in enumerate(g.params):
                mine = self._exposed[gi][i]
                if mine is None:
                    p.grad = None
                else:
                    p.grad = self.released(gi, i) if type(mine) is ReleasedGrad \
                        else self.zeroed_grad(gi, i)
                self._exposed[gi][i] = p.grad

    def to_(self, device) -> None: ...

    def released(self, gi: int, i: int) -> ReleasedGrad:
        return ReleasedGrad(self.groups[gi].params[i], self.stage)

    # ---- stage behaviour ----------------------------------------------------------------------
    def begin_backward(self) -> None: ...
    def on_grad(self, gi: int, i: int, p: torch.Tensor) -> None: ...
    def end_backward(self) -> None: ...
    def exposed_grad(self, gi: int, i: int) -> torch.Tensor:
        """What p.grad shows after a backward for a param that has a gradient."""
        return self.released(gi, i)
    def zeroed_grad(self, gi: int, i: int) -> torch.Tensor:
        return self.released(gi, i)
    def clear_all(self) -> None: ...
    def clear_some(self, params: List[Tuple[int, int]]) -> None: ...
    def adopt_foreign(self, params: List[Tuple[int, int]]) -> None:
        gi, i = params[0]
        raise RuntimeError(f"zerokern stage {self.stage}: p.grad of param {i} in param group "
                           f"{gi} was replaced by another tensor; at this stage gradients are "
                           "sharded across ranks and cannot be assigned. Clear them with "
                           "opt.zero_grad() and let backward produce them")
    def reduce(self):
        """Called at step(): yields (group, bucket) as each bucket's reduced grads are ready in
        grad_piece(), so the caller can work on one while others are in flight."""
        for gi, g in enumerate(self.groups):
            for k in range(g.layout.n_buckets):
                yield gi, k
    def grad_piece(self, gi: int, k: int) -> torch.Tensor: ...
    def after_step(self) -> None:
        """Called after the update: drop per-step buffers."""
    def held(self) -> Dict[str, List[torch.Tensor]]:
        return {}


def _call(ref, name: str, *args):
    obj = ref()
    if obj is not None and not obj.detached:
        getattr(obj, name)(*args)


class _Schedule:
    """Which buckets are complete in this backward, launched in the fixed order."""

    def __init__(self, groups) -> None:
        self.groups = groups
        self.order = launch_order(groups)
        self.overlaps = [[g.layout.overlaps(*g.layout.bucket_range(k))
                          for k in range(g.layout.n_buckets)] for g in groups]
        self.reset()

    def reset(self) -> None:
        self.pending = [[len(ov) for ov in per_group] for per_group in self.overlaps]
        self.arrived = [[False] * len(g.params) for g in self.groups]
        self.next = 0

    def arrive(self, gi: int, i: int) -> None:
        self.arrived[gi][i] = True
        for k in self.groups[gi].layout.buckets_of_slot(i):
            self.pending[gi][k] -= 1

    def ready(self, flush: bool):
        """Yield (gi, k) to launch now, in order; with flush, every bucket left."""
        while self.next < len(self.order):
            gi, k = self.order[self.next]
            if not flush and self.pending[gi][k] > 0:
                return
            self.next += 1
            yield gi, k

    def launched(self, gi: int, i: int) -> bool:
        done = set(self.order[:self.next])
        return any((gi, k) in done for k in self.groups[gi].layout.buckets_of_slot(i))


class FullGrads(GradSync):
    """Stages 0 and 1: a full grad buffer, reduced bucket by bucket during backward."""

    def __init__(self, groups, comm, reduce_dtype, stage: int) -> None:
        self.stage = stage
        self.averaged = stage == 0
        self.grads = [torch.zeros_like(g.flat) for g in groups]  # (E,) model dtype
        self._views = [[buf[s.offset:s.offset + s.numel].view(s.shape) for s in g.layout.slots]
                       for g, buf in zip(groups, self.grads)]
        self._sched = _Schedule(groups)
        self._handles: List[tuple] = []
        self._shard: List[Optional[torch.Tensor]] = [None] * len(groups)  # stage 1
        self._wide: List[Optional[torch.Tensor]] = [None] * len(groups)  # stage 0, see _launch
        self._reduced = False         # the buffer's contents are reduced (stage 0 in place)
        super().__init__(groups, comm, reduce_dtype)

    # -- p.grad ----------------------------------------------------------------------------------
    def exposed_grad(self, gi, i):
        if self.stage == 1 and self._reduced:
            return self.released(gi, i)
        return self._views[gi][i]

    def zeroed_grad(self, gi, i):
        return self._views[gi][i]

    def to_(self, device) -> None:
        self.grads = [b.to(device) for b in self.grads]
        self._views = [[buf[s.offset:s.offset + s.numel].view(s.shape) for s in g.layout.slots]
                       for g, buf in zip(self.groups, self.grads)]
        self._shard = [None] * len(self.groups)
        self._reduced = False

    def clear_all(self) -> None:
        for buf in self.grads:
            buf.zero_()
        self._reduced = False

    def clear_some(self, params) -> None:
        for gi, i in params:
            self._views[gi][i].zero_()
        self._reduced = False

    def adopt_foreign(self, params) -> None:
        for gi, i in params:
            self._views[gi][i].copy_(self.groups[gi].params[i].grad)
        self._reduced = False

    # -- backward ----------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        for g, views in zip(self.groups, self._views):
            for p, v in zip(g.params, views):
                p.grad = v  # autograd accumulates in place
        self._reduced = False
        self._sched.reset()

    def on_grad(self, gi, i, p) -> None:
        view = self._views[gi][i]
        if p.grad is not view:  # autograd replaced it (create_graph=True): keep the sum
            view.copy_(p.grad)
            p.grad = view
        if not self.sync:
            return
        if self._sched.arrived[gi][i] and self._sched.launched(gi, i):
            raise RuntimeError(
                f"zerokern stage {self.stage}: a parameter's gradient arrived twice in one "
                "backward after its bucket was reduced (reentrant checkpointing?); use "
                "torch.utils.checkpoint(..., use_reentrant=False)")
        self._sched.arrive(gi, i)
        for gk in self._sched.ready(flush=False):
            self._launch(*gk)

    def _launch(self, gi: int, k: int) -> None:
        g, buf = self.groups[gi], self.grads[gi]
        b = g.bucket(buf, k)
        if self.stage == 0:
            src = b
            if b.dtype != self.reduce_dtype:
                # Reduced in reduce_dtype into a buffer kept until the step, which updates
                # from it; p.grad gets the result rounded to the param dtype, as DDP's.
                if self._wide[gi] is None:
                    self._wide[gi] = torch.empty(buf.numel(), dtype=self.reduce_dtype,
                                                 device=buf.device)
                src = g.bucket(self._wide[gi], k)
                src.copy_(b)
            # SUM, then / N on landing: p.grad is DDP's average, and an fp16 sum that
            # overflows is inf here too, so found_inf is the same at every stage.
            h = self.comm.all_reduce_(src, async_op=True)
            self._handles.append((gi, k, h, b if src is not b else None,
                                  src if src is not b else None))
            return
        src = b if b.dtype == self.reduce_dtype else b.to(self.reduce_dtype)
        if self._shard[gi] is None:
            self._shard[gi] = torch.empty(g.layout.shard_numel, dtype=self.reduce_dtype,
                                          device=g.device)
        # gloo corrupts an in-place reduce-scatter (output aliasing the input), so the result
        # goes to a shard buffer that lives until the step.
        h = self.comm.reduce_scatter_(self._shard[gi][g.state_slice(k)], src, async_op=True,
                                      inp_is_scratch=src is not b)
        self._handles.append((gi, k, h, None, None))

    def _wait_all(self):
        n = self.comm.world_size
        for gi, k, h, back, src in self._handles:
            h.wait()
            if self.stage == 0 and n > 1:
                (src if src is not None else self.groups[gi].bucket(self.grads[gi], k)).div_(n)
            if back is not None:
                back.copy_(src)
            yield gi, k
        self._handles = []

    def end_backward(self) -> None:
        if not self.sync:
            return
        for gk in self._sched.ready(flush=True):
            self._launch(*gk)
        for _ in self._wait_all():
            pass
        self._reduced = True

    # -- step ----------------------------------------------------------------------------------
    def reduce(self):
        if self._reduced:
            yield from GradSync.reduce(self)
            return
        # Only no_sync() backward passes (or a step() after a cleared reduction): reduce now.
        self._sched.reset()
        for gk in self._sched.ready(flush=True):
            self._launch(*gk)
        yield from self._wait_all()  # in launch order: k is ready while k+1 is in flight
        self._reduced = True

    def grad_piece(self, gi, k) -> torch.Tensor:
        g = self.groups[gi]
        if self.stage == 0:
            return g.bucket(self.grads[gi] if self._wide[gi] is None else self._wide[gi], k)
        return self._shard[gi][g.state_slice(k)]

    def after_step(self) -> None:
        if self.stage == 1:  # the shard lives from the reducing backward to the step
            self._shard = [None] * len(self.groups)
            self._reduced = False
        elif any(w is not None for w in self._wide):  # a second step re-reduces p.grad
            self._wide = [None] * len(self.groups)
            self._reduced = False

    def held(self):
        return {"grads": list(self.grads)}


class ShardedGrads(GradSync):
    """Stages 2 and 3: staged grads are reduce-scattered during backward (async) into one grad
    shard per buffer. Accumulation (DESIGN §2): the first reduction since zero_grad writes the
    shard, later ones add to it. Subclasses decide what is staged when, and keep `_staging`."""

    def __init__(self, groups, comm, reduce_dtype) -> None:
        self.grad_shards = [torch.zeros(g.layout.shard_numel, dtype=reduce_dtype, device=g.device)
                            for g in groups]  # (S,) reduce dtype
        self._fresh = True            # first reduction since zero_grad: write the shard directly
        self._in_flight: List[tuple] = []
        super().__init__(groups, comm, reduce_dtype)

    def _reduce_async(self, key, staging: torch.Tensor, shard: torch.Tensor) -> None:
        out = shard if self._fresh else torch.empty_like(shard)
        h = self.comm.reduce_scatter_(out, staging, async_op=True, inp_is_scratch=True)
        self._in_flight.append((h, key, out if out is not shard else None, shard))

    def _complete_oldest(self) -> None:
        h, key, tmp, shard = self._in_flight.pop(0)
        h.wait()
        if tmp is not None:
            shard.add_(tmp)
        self._recycle(self._staging.pop(key))

    def _recycle(self, staging: torch.Tensor) -> None: ...

    def _drain(self) -> None:
        """End of a reduction: every reduce-scatter has landed; the next one accumulates."""
        while self._in_flight:
            self._complete_oldest()
        self._fresh = False

    def grad_piece(self, gi, k) -> torch.Tensor:
        return self.grad_shards[gi][self.groups[gi].state_slice(k)]

    def to_(self, device) -> None:
        self.grad_shards = [t.to(device) for t in self.grad_shards]

    def begin_backward(self) -> None:
        for g in self.groups:  # our ReleasedGrad must not be accumulated into
            for p in g.params:
                p.grad = None

    def clear_all(self) -> None:
        self._fresh = True  # every shard piece is overwritten by the next reduction

    def clear_some(self, params) -> None:
        """Zero the cleared params' part of this rank's grad shard (and local accumulator)."""
        if self._fresh:
            return
        for gi, i in params:
            g = self.groups[gi]
            L, s = g.layout, g.layout.slots[i]
            for k in range(L.n_buckets):
                lo, hi = L.piece_range(k, g.rank)
                a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < b:
                    off = g.state_slice(k).start
                    self.grad_shards[gi][off + a - lo:off + b - lo].zero_()


class BucketedGrads(ShardedGrads):
    """Stage 2: bucketed reduce-scatter during backward into a grad shard."""

    stage = 2

    def __init__(self, groups, comm, reduce_dtype) -> None:
        self._sched = _Schedule(groups)
        self.bucket_numel = max(g.layout.bucket_numel for g in groups)
        self._pool: List[torch.Tensor] = []
        self.staging_allocated = 0    # staging buffers ever allocated (bounded, see MAX_IN_FLIGHT)
        self._local: Optional[List[torch.Tensor]] = None  # no_sync() accumulators, (E,) each
        super().__init__(groups, comm, reduce_dtype)
        self._staging: Dict[Tuple[int, int], torch.Tensor] = {}

    def _acquire(self, gi: int, k: int) -> torch.Tensor:
        if (gi, k) not in self._staging:
            while len(self._in_flight) >= MAX_IN_FLIGHT and not self._pool:
                self._complete_oldest()
            if self._pool:
                buf = self._pool.pop()
            else:
                buf = torch.empty(self.bucket_numel, dtype=self.reduce_dtype,
                                  device=self.groups[gi].device)
                self.staging_allocated += 1
            L = self.groups[gi].layout
            lo, hi = L.bucket_range(k)
            view = buf[:hi - lo]
            # Not a full zero_(): every param region is overwritten by its grad (a whole pass
            # saved per step); padding is zeroed here, params with no grad at launch.
            view[max(L.numel - lo, 0):].zero_()
            self._staging[(gi, k)] = view
        return self._staging[(gi, k)]

    def on_grad(self, gi, i, p) -> None:
        g = self.groups[gi]
        s = g.layout.slots[i]
        flat_grad = p.grad.reshape(-1)
        p.grad = None
        if not self.sync:  # no_sync(): local accumulation, no communication
            if self._local is None:
                self._local = [torch.zeros(h.layout.padded_numel, dtype=self.reduce_dtype,
                                           device=h.device) for h in self.groups]
            self._local[gi][s.offset:s.offset + s.numel].add_(flat_grad)
            return
        if self._sched.arrived[gi][i]:
            raise RuntimeError(
                "zerokern stage 2: a parameter's gradient arrived twice in one backward "
                "(reentrant checkpointing?); use torch.utils.checkpoint(..., "
                "use_reentrant=False) or stage=1")
        local = None if self._local is None else self._local[gi]
        # Descending, the launch order within a group: a param spanning several buckets fills
        # and launches them one by one, so staging stays bounded whatever the param size.
        for k in reversed(g.layout.buckets_of_slot(i)):
            lo, hi = g.layout.bucket_range(k)
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            dst = self._acquire(gi, k)[a - lo:b - lo]
            if local is None:
                dst.copy_(flat_grad[a - s.offset:b - s.offset])
            else:
                torch.add(flat_grad[a - s.offset:b - s.offset], local[a:b], out=dst)
            self._sched.pending[gi][k] -= 1
            if self._sched.pending[gi][k] == 0:
                self._launch_ready(flush=False)
        self._sched.arrived[gi][i] = True
        self._launch_ready(flush=False)

    def _launch_ready(self, flush: bool) -> None:
        for gi, k in self._sched.ready(flush):
            g = self.groups[gi]
            staging = self._acquire(gi, k)
            if self._sched.pending[gi][k] > 0:  # flushed: params that got no grad here
                lo = g.layout.bucket_range(k)[0]
                for i, a, b in self._sched.overlaps[gi][k]:
                    if not self._sched.arrived[gi][i]:
                        if self._local is None:
                            staging[a - lo:b - lo].zero_()
                        else:
                            staging[a - lo:b - lo].copy_(self._local[gi][a:b])
            self._reduce_async((gi, k), staging, self.grad_shards[gi][g.state_slice(k)])

    def _recycle(self, staging: torch.Tensor) -> None:
        self._pool.append(staging._base)

    def _reduce_all(self) -> None:
        self._launch_ready(flush=True)
        self._drain()
        self._sched.reset()
        self._local = None

    def end_backward(self) -> None:
        if self.sync:
            self._reduce_all()
        else:
            self._sched.reset()

    def reduce(self):
        if self._local is not None:  # backward passes under no_sync() only: reduce them now
            self._sched.reset()
            self._reduce_all()
        yield from GradSync.reduce(self)

    def clear_all(self) -> None:
        super().clear_all()
        self._local = None

    def to_(self, device) -> None:
        super().to_(device)
        self._pool, self._staging = [], {}
        if self._local is not None:
            self._local = [t.to(device) for t in self._local]

    def clear_some(self, params) -> None:
        super().clear_some(params)
        if self._local is not None:
            for gi, i in params:
                s = self.groups[gi].layout.slots[i]
                self._local[gi][s.offset:s.offset + s.numel].zero_()

    def held(self):
        out = {"grads": list(self.grad_shards), "buckets": list(self._pool)}
        if self._local is not None:
            out["buckets"] += self._local
        return out
