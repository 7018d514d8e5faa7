"""Stages 0 and 1: a full flat grad buffer, reduced bucket by bucket during backward.

`p.grad` are views into the buffer, so autograd accumulates straight into it. Outside
`no_sync()` each bucket is reduced as soon as its grads are in (async, in the fixed order of
grad_sync's [Note: collective order], overlapping the rest of backward, as DDP does): stage 0
all-reduces it in place (SUM, then / N on landing), so `p.grad` is exactly DDP's gradient;
stage 1 reduce-scatters it (see the Note below), and `p.grad` is released. What ran under
`no_sync()` only is reduced at `step()`.

[Note: stage 1 reduces in place]
When the grads are in the reduce dtype (the default), each bucket is reduce-scattered *in
place*: the collective works in the bucket itself (gloo's ring uses it as its work buffer; NCCL
and world size 1 are in place by design) and leaves the reduced sum in this rank's piece of the
bucket, which the step reads. No grad shard (Ψ/N) and no ring scratch copy (one bucket, copied
per bucket): on the 20m GPT over 2 gloo ranks with free_grads=True those were 69 MiB of fresh
pages and a 92 MB copy per iteration. The rest of the buffer is left holding partial sums: the
buffer is *consumed*. p.grad is released then, so nobody reads it; a change to the grads without
zero_grad() (another backward, a p.grad cleared or assigned) first sets the reduced pieces aside
(`_carry`, one shard, only in that case) and zeroes the buffer, and the next reduction adds the
carry back onto this rank's pieces. The reduction is linear, so the sums are those of a buffer
kept whole (up to the order of the float adds). A second step() with no backward between reuses
the reduced pieces. Grads in another dtype than the reduce dtype are cast to a scratch copy per
bucket, reduced into a grad shard that lives until the step, and the buffer stays whole.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from zerokern.grads.grad_sync import GradSync, Schedule
from zerokern.state import huge_pages


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
        # Stage 1 in place ([Note: stage 1 reduces in place]): the buffer was reduce-scattered
        # into itself (only this rank's pieces are meaningful), and what was set aside.
        self.in_place = not self.all_reduce and all(g.flat.dtype == reduce_dtype for g in groups)
        self._consumed = False
        self._carry: List[Optional[torch.Tensor]] = [None] * len(groups)
        super().__init__(groups, comm, reduce_dtype)

    # -- the buffer ------------------------------------------------------------------------------
    def _alloc(self, groups=None, bufs=None) -> None:
        groups = groups or self.groups
        self.grads = bufs if bufs is not None else [huge_pages.zeros_like(g.flat) for g in groups]
        self._blank = bufs is None  # all zeros: the next backward copies its grads in
        self._views = [[buf[s.offset:s.offset + s.numel].view(s.shape) for s in g.layout.slots]
                       for g, buf in zip(groups, self.grads)]

    def _ensure(self) -> None:
        if self.grads is None:  # freed by zero_grad (free_grads=True): zeros again
            self._alloc()

    def free(self) -> None:
        self.grads, self._views = None, []
        self._shard = [None] * len(self.groups)
        self._wide = [None] * len(self.groups)
        self._carry = [None] * len(self.groups)
        self._reduced = self._consumed = False

    def _set_reduced_aside(self) -> None:
        """The grads are about to change after an in-place reduction: keep the reduced pieces
        in `_carry` and zero the buffer for local accumulation ([Note: stage 1 reduces in
        place])."""
        if not self._consumed:
            return
        for gi, (g, buf) in enumerate(zip(self.groups, self.grads)):
            carry = huge_pages.zeros(g.state_numel, buf.dtype, buf.device)
            for k in range(g.layout.n_buckets):
                carry[g.state_slice(k)].copy_(g.piece(buf, k))
            self._carry[gi] = carry
            buf.zero_()
        self._blank = True
        self._consumed = False

    def _zero_carried(self, params) -> None:
        for gi, i in params:
            if self._carry[gi] is not None:
                for lo, hi in self.groups[gi].state_spans(i):
                    self._carry[gi][lo:hi].zero_()

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
        self._carry = [None if c is None else c.to(device) for c in self._carry]
        self._shard = [None] * len(self.groups)
        if not self._consumed:  # else the reduced pieces moved with the buffer
            self._reduced = False

    def clear_all(self) -> None:
        for buf in self.grads or ():
            buf.zero_()
        self._blank = True
        self._carry = [None] * len(self.groups)
        self._reduced = self._consumed = False

    def clear_some(self, params) -> None:
        if self.grads is not None:
            self._set_reduced_aside()
            for gi, i in params:
                self._views[gi][i].zero_()
            self._zero_carried(params)
        self._reduced = False

    def adopt_foreign(self, params) -> None:
        self._ensure()
        self._set_reduced_aside()
        for gi, i in params:
            self._views[gi][i].copy_(self.groups[gi].params[i].grad)
        self._blank = False
        self._zero_carried(params)  # an assigned p.grad replaces what had accumulated
        self._reduced = False

    # -- backward ----------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self._ensure()
        self._set_reduced_aside()
        # A buffer of zeros gets each grad copied in by on_grad (autograd hands over the grad
        # it computed); else autograd adds into the views in place. Adding into fresh pages
        # reads them first (a fault to map the zero page, another on the write), and reads
        # 88 MiB more: on the 20m GPT, N=2, stage 1, free_grads=True, a backward took 10,921
        # page faults with the add and 659 with the copy.
        blank, self._blank = self._blank, False
        for g, views in zip(self.groups, self._views):
            for p, v in zip(g.params, views):
                p.grad = None if blank else v
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
                    self._wide[gi] = huge_pages.zeros(buf.numel(), self.reduce_dtype,
                                                     buf.device)
                src = g.bucket(self._wide[gi], k)
                src.copy_(b)
            # SUM, then / N on landing: p.grad is DDP's average, and an fp16 sum that
            # overflows is inf here too, so found_inf is the same at every stage.
            h = self.comm.all_reduce_(src, async_op=True, label=f"group {gi} bucket {k}")
            self._handles.append((gi, k, h, b if src is not b else None,
                                  src if src is not b else None))
            return
        if self.in_place:  # [Note: stage 1 reduces in place]
            self._consumed = True
            out, src = g.piece(buf, k), b
        else:  # a cast copy is the scratch; the result lives in a grad shard until the step
            src = b.to(self.reduce_dtype)
            if self._shard[gi] is None:
                self._shard[gi] = huge_pages.zeros(g.layout.shard_numel, self.reduce_dtype,
                                                  g.device)
            out = self._shard[gi][g.state_slice(k)]
        h = self.comm.reduce_scatter_(out, src, async_op=True, label=f"group {gi} bucket {k}")
        self._handles.append((gi, k, h, None, None))

    def _wait_all(self):
        n = self.comm.world_size
        for gi, k, h, back, src in self._handles:
            h.wait()
            if self.all_reduce and n > 1:
                (src if src is not None else self.groups[gi].bucket(self.grads[gi], k)).div_(n)
            if back is not None:
                back.copy_(src)
            if self._carry[gi] is not None:  # set aside since the last in-place reduction
                g = self.groups[gi]
                g.piece(self.grads[gi], k).add_(self._carry[gi][g.state_slice(k)])
            yield gi, k
        self._handles = []
        self._carry = [None] * len(self.groups)

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
        if self.in_place:
            return g.piece(self.grads[gi], k)
        return self._shard[gi][g.state_slice(k)]

    def after_step(self) -> None:
        if self.in_place:  # the reduced pieces stay in the buffer for a second step()
            return
        if not self.all_reduce:  # the shard lives from the reducing backward to the step
            self._shard = [None] * len(self.groups)
            self._reduced = False
        elif any(w is not None for w in self._wide):  # a second step re-reduces p.grad
            self._wide = [None] * len(self.groups)
            self._reduced = False

    def held(self):
        return {"grads": list(self.grads or ()),
                "buckets": [c for c in self._carry if c is not None]}
