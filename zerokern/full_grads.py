"""Stages 0 and 1: a full flat grad buffer, reduced bucket by bucket during backward.

`p.grad` are views into the buffer, so autograd accumulates straight into it. Outside
`no_sync()` each bucket is reduced as soon as its grads are in (async, in the fixed order of
grad_sync's [Note: collective order], overlapping the rest of backward, as DDP does): stage 0
all-reduces it in place (SUM, then / N on landing), so `p.grad` is exactly DDP's gradient;
stage 1 reduce-scatters it into a grad shard that lives until the step, and `p.grad` is
released. What ran under `no_sync()` only is reduced at `step()`.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .grad_sync import GradSync, Schedule


class FullGrads(GradSync):
    """Stages 0 and 1: a full grad buffer, reduced bucket by bucket during backward."""

    def __init__(self, groups, comm, reduce_dtype, stage: int) -> None:
        self.stage = stage
        # Stage 0 all-reduces in place (every rank holds every bucket's state: its pattern
        # replicates it); stage 1 reduce-scatters into this rank's grad shard.
        self.all_reduce = groups[0].pattern.replicated_state
        self.averaged = self.all_reduce
        self.grads: Optional[List[torch.Tensor]] = None  # (E,) model dtype; None: freed
        self._views: List[List[torch.Tensor]] = []
        self._alloc(groups)
        self._sched = Schedule(groups)
        self._handles: List[tuple] = []
        self._shard: List[Optional[torch.Tensor]] = [None] * len(groups)  # stage 1
        self._wide: List[Optional[torch.Tensor]] = [None] * len(groups)  # stage 0, see _launch
        self._reduced = False         # the buffer's contents are reduced (stage 0 in place)
        super().__init__(groups, comm, reduce_dtype)

    # -- the buffer ------------------------------------------------------------------------------
    def _alloc(self, groups=None, bufs=None) -> None:
        groups = groups or self.groups
        self.grads = bufs if bufs is not None else [torch.zeros_like(g.flat) for g in groups]
        self._views = [[buf[s.offset:s.offset + s.numel].view(s.shape) for s in g.layout.slots]
                       for g, buf in zip(groups, self.grads)]

    def _ensure(self) -> None:
        if self.grads is None:  # freed by zero_grad (free_grads=True): zeros again
            self._alloc()

    def free(self) -> None:
        self.grads, self._views = None, []
        self._shard = [None] * len(self.groups)
        self._wide = [None] * len(self.groups)
        self._reduced = False

    # -- p.grad ----------------------------------------------------------------------------------
    def exposed_grad(self, gi, i):
        if not self.all_reduce and self._reduced:
            return self.released(gi, i)
        return self._views[gi][i]

    def zeroed_grad(self, gi, i):
        self._ensure()
        return self._views[gi][i]

    def to_(self, device) -> None:
        if self.grads is not None:
            self._alloc(bufs=[b.to(device) for b in self.grads])
        self._shard = [None] * len(self.groups)
        self._reduced = False

    def clear_all(self) -> None:
        for buf in self.grads or ():
            buf.zero_()
        self._reduced = False

    def clear_some(self, params) -> None:
        if self.grads is not None:
            for gi, i in params:
                self._views[gi][i].zero_()
        self._reduced = False

    def adopt_foreign(self, params) -> None:
        self._ensure()
        for gi, i in params:
            self._views[gi][i].copy_(self.groups[gi].params[i].grad)
        self._reduced = False

    # -- backward ----------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self._ensure()
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
        if self.all_reduce:
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
            h = self.comm.all_reduce_(src, async_op=True, label=f"group {gi} bucket {k}")
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
                                      inp_is_scratch=src is not b, label=f"group {gi} bucket {k}")
        self._handles.append((gi, k, h, None, None))

    def _wait_all(self):
        n = self.comm.world_size
        for gi, k, h, back, src in self._handles:
            h.wait()
            if self.all_reduce and n > 1:
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
    def reduced_buckets(self):
        if self._reduced:
            yield from GradSync.reduced_buckets(self)
            return
        # Only no_sync() backward passes (or a step() after a cleared reduction): reduce now.
        self._sched.reset()
        for gk in self._sched.ready(flush=True):
            self._launch(*gk)
        yield from self._wait_all()  # in launch order: k is ready while k+1 is in flight
        self._reduced = True

    def grad_piece(self, gi, k) -> torch.Tensor:
        g = self.groups[gi]
        if self.all_reduce:
            return g.bucket(self.grads[gi] if self._wide[gi] is None else self._wide[gi], k)
        return self._shard[gi][g.state_slice(k)]

    def after_step(self) -> None:
        if not self.all_reduce:  # the shard lives from the reducing backward to the step
            self._shard = [None] * len(self.groups)
            self._reduced = False
        elif any(w is not None for w in self._wide):  # a second step re-reduces p.grad
            self._wide = [None] * len(self.groups)
            self._reduced = False

    def held(self):
        return {"grads": list(self.grads or ())}
