"""Stages 0 and 1: a full flat grad buffer, reduced bucket by bucket during backward.

`p.grad` are views into the buffer, so autograd accumulates straight into it. Outside
`no_sync()` each bucket is reduced as soon as its grads are in (async, in the fixed order of
grad_sync's [Note: collective order], overlapping the rest of backward, as DDP does): stage 0
all-reduces it in place (each grad divided by N on its way in, then SUM, as DDP does), so
`p.grad` is DDP's gradient;
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

[Note: stage 0 divides as DDP does]
DDP divides by N while it copies a fresh grad into its bucket (one `mul_out` pass) and divides
in place only a grad that was accumulated into the bucket view (`div_`); zerokern did SUM, then
a separate `/ N` pass over every bucket on landing: a read and a write of the whole buffer per
step that DDP does not make. Now a fresh grad is multiplied by 1/N as it is copied into its view
(`on_grad`, outside no_sync() only), a view that holds a sum (no_sync() accumulation, an
assigned p.grad) is divided over its part of the bucket just before the bucket is reduced
(`_zero_stale`), and the landing does nothing: DDP's order of operations, so p.grad equals DDP's
up to the order gloo adds the N terms. `_divided` says which params were divided on the way in;
it is reset at every backward and once a reduction lands, so a reduction relaunched without a
backward divides everything again. 16-bit grads keep SUM, then / N on landing (and the
cast-copy mode on its wide copy): an fp16 sum that overflows is then inf at stage 0 too, so
found_inf and the skipped steps are the same at every stage (test_mixed_precision's fp16
reference failed with the division first: a step skipped at stages 1-3 was taken at
stage 0). The time saved: [Note: stage 0 reads 1/N for its stats] below, both changes together.

[Note: stage 0 reads 1/N for its stats]
Every stage-0 rank holds the whole averaged buffer, and each read all of it for found_inf and
sumsq (93 MB per step on the 20m GPT): N times the reading of stages 1-3. Now each rank reads
only its piece of every bucket (`stats_piece`, the stage-1 piece of the same layout) and the
two numbers are all-reduced over the world group as at stages 1-3 (HSDP replicas counted once):
a 2-float all-reduce instead of (N-1)/N of a pass. Tensor/model-parallel stats keep reading the
whole bucket (their element positions are per bucket). With the division above, on the 20m
GPT, 2 gloo ranks, fp32, `zerokern bench --step` before (3df7160) and after, 3 alternated runs
each on the quiet 2-core VM: stage 0 went from 1.080x to 1.027x DDP + fused AdamW (medians;
after: 1.03, 0.99, 1.09), 257 ms against 267
(benchmarks/results/step-20m-n2-fp32-issue20-stage0-before-after.md). Stages 1-2 did not change
and moved 1.014 -> 1.006 and 1.084 -> 1.044: this machine's drift between runs is that large.

[Note: no per-step memset]
zero_grad() does not zero the buffer: it marks every param's view *stale* (its values are not
this step's). The next backward then hands each stale param to autograd with p.grad = None, so
autograd's fresh grad is copied into the view (`on_grad`), as DDP's gradient_as_bucket_view
copies it into its bucket; a param already holding a sum since zero_grad keeps p.grad = view
and autograd adds into it. A stale param that got no gradient by the time its bucket is reduced
is zeroed then, over its part of that bucket only (a missing gradient counts as zero), and once
a reduction has launched every bucket nothing is stale. The padding is never written by a grad
and reduces to zero, so it stays zero from the allocation on. So the buffer itself needs no
memset either: a freed buffer's mapping reused from the lazy pool (state/huge_pages.py
`maybe_zeros`) keeps its old bytes, every view starts stale, and only its padding is zeroed
(bench --engine r5: stage 1 overhead 0.22 -> 0.16 of DeepSpeed's, fp32, CPU time). On the 20m
GPT (fp32, one rank, CPU time, benchmarks/results/step-20m-n2-fp32-issue20-grads-cpu-time.md)
zero_grad() took 3.4-3.7 ms at stages 0-1 and takes 0.1 ms now, of a ~200 ms iteration; stage 1
also zeroed the buffer again when grads changed after its in-place reduction.
`set_to_none=False` still zeroes, since the user then sees p.grad as zeros.
"""

from __future__ import annotations

from enum import Enum
from typing import List, Optional

import torch

from zerokern.geometry.dtensor_params import like_param
from zerokern.grads.grad_sync import GradSync, Schedule
from zerokern.state import huge_pages


class Reduction(Enum):
    """How a FullGrads buffer is reduced, fixed at construction (the stage's pattern and the
    dtypes decide it)."""
    ALL_REDUCE = "all_reduce"              # stage 0: in the buffer itself, SUM then / N
    ALL_REDUCE_WIDE = "all_reduce_wide"    # stage 0, grads not in reduce_dtype: a cast copy
    SCATTER_IN_PLACE = "scatter_in_place"  # stage 1: [Note: stage 1 reduces in place]
    SCATTER_TO_SHARD = "scatter_to_shard"  # stage 1, grads not in reduce_dtype: into a shard

    @property
    def scatters(self) -> bool:
        return self in (Reduction.SCATTER_IN_PLACE, Reduction.SCATTER_TO_SHARD)


class Held(Enum):
    """What the buffer holds now."""
    LOCAL = "local"        # local sums since zero_grad (stale views aside), not reduced
    REDUCING = "reducing"  # buckets launched, not all landed (in place: being consumed)
    REDUCED = "reduced"    # reduced: the buffer (stage 0), this rank's pieces (in place) or
                           # the grad shard; a second step() reuses it


class FullGrads(GradSync):
    """Stages 0 and 1: a full grad buffer, reduced bucket by bucket during backward."""

    def __init__(self, groups, comm, reduce_dtype, stage: int) -> None:
        self.stage = stage
        same = all(g.flat.dtype == reduce_dtype for g in groups)
        # Stage 0 all-reduces in place (every rank holds every bucket's state and updates it
        # from DDP's average: its pattern's grads_averaged); stage 1 reduce-scatters.
        if groups[0].pattern.grads_averaged:
            self.mode = Reduction.ALL_REDUCE if same else Reduction.ALL_REDUCE_WIDE
        else:
            self.mode = Reduction.SCATTER_IN_PLACE if same else Reduction.SCATTER_TO_SHARD
        # [Note: stage 0 divides as DDP does]: fp32 grads only; a 16-bit sum keeps SUM, / N
        self._divide_first = self.mode is Reduction.ALL_REDUCE and all(
            g.flat.dtype == torch.float32 for g in groups)
        self.held_now = Held.LOCAL
        self.grads: Optional[List[torch.Tensor]] = None  # (E,) model dtype; None: freed
        self._views: List[List[torch.Tensor]] = []
        self._stale: List[List[bool]] = []  # per param: [Note: no per-step memset]
        # per param, stage 0 in place: its view already holds grad / N ([Note: stage 0
        # divides as DDP does]); reset at every backward
        self._divided: List[List[bool]] = [[False] * len(g.params) for g in groups]
        self._alloc(groups)
        self._sched = Schedule(groups)
        self._handles: List[tuple] = []
        # per group, only in its mode, from the reducing backward to the step:
        self._shard: List[Optional[torch.Tensor]] = [None] * len(groups)  # (S,) TO_SHARD
        self._wide: List[Optional[torch.Tensor]] = [None] * len(groups)   # (E,) WIDE
        # (S,) SCATTER_IN_PLACE: reduced pieces set aside before the buffer changes
        self._carry: List[Optional[torch.Tensor]] = [None] * len(groups)
        super().__init__(groups, comm, reduce_dtype)

    @property
    def _consumed(self) -> bool:
        """The buffer was reduce-scattered into itself: only this rank's pieces mean anything."""
        return self.mode is Reduction.SCATTER_IN_PLACE and self.held_now is not Held.LOCAL

    # -- the buffer ------------------------------------------------------------------------------
    def _alloc(self, groups=None, bufs=None) -> None:
        groups = groups or self.groups
        if bufs is None:
            # every view stale: each is written by its grad or zeroed before it is read, so a
            # reused mapping's old bytes need no memset; only the padding, which no grad
            # writes, is zeroed ([Note: no per-step memset]). Copying a grad in also beats
            # adding into fresh pages.
            bufs = []
            for g in groups:
                buf, zero = huge_pages.maybe_zeros(g.flat.numel(), g.flat.dtype,
                                                   g.flat.device, reuse=True)
                if not zero:
                    g.zero_padding_(buf, 0)
                bufs.append(buf)
            self._mark_stale(groups)
        self.grads = bufs
        # a DTensor param's p.grad is a DTensor over its view (dtensor_params.py)
        self._views = [[like_param(p, buf[s.offset:s.offset + s.numel].view(s.shape))
                        for p, s in zip(g.params, g.layout.slots)]
                       for g, buf in zip(groups, self.grads)]

    def _mark_stale(self, groups=None) -> None:
        self._stale = [[True] * len(g.params) for g in groups or self.groups]

    def _zero_stale(self, gi: int, k: int) -> None:
        """Before bucket k is reduced: the stale params in it got no grad; they count as 0.
        Stage 0 in place: a param's sum not divided while copied in is divided now."""
        stale, buf = self._stale[gi], self.grads[gi]
        n = self.comm.world.world_size
        divide = self._divide_first and n > 1
        for i, a, b in self._sched.overlaps[gi][k]:
            if stale[i]:
                buf[a:b].zero_()
            elif divide and not self._divided[gi][i]:
                buf[a:b].div_(n)

    def _ensure(self) -> None:
        if self.grads is None:  # freed by zero_grad (free_grads=True): zeros again
            self._alloc()

    def free(self) -> None:
        self.grads, self._views = None, []
        self._shard = [None] * len(self.groups)
        self._wide = [None] * len(self.groups)
        self._carry = [None] * len(self.groups)
        self.held_now = Held.LOCAL

    def _set_reduced_aside(self) -> None:
        """The grads are about to change after an in-place reduction: keep the reduced pieces
        in `_carry` and start local accumulation over ([Note: stage 1 reduces in place]; the
        buffer's partial sums become stale, [Note: no per-step memset])."""
        if not self._consumed:
            return
        for gi, (g, buf) in enumerate(zip(self.groups, self.grads)):
            carry = huge_pages.zeros(g.state_numel, buf.dtype, buf.device, reuse=True)
            for k in range(g.layout.n_buckets):
                carry[g.state_slice(k)].copy_(g.piece(buf, k))
            self._carry[gi] = carry
        self._mark_stale()
        self.held_now = Held.LOCAL

    def _zero_carried(self, params) -> None:
        for gi, i in params:
            if self._carry[gi] is not None:
                for lo, hi in self.groups[gi].state_spans(i):
                    self._carry[gi][lo:hi].zero_()

    # -- p.grad ----------------------------------------------------------------------------------
    def exposed_grad(self, gi, i):
        if self.mode.scatters and self.held_now is Held.REDUCED:
            return self.released(gi, i)
        # Stale here: shown before, no grad since (a no_sync() backward after stage 1's set
        # aside): its local sum is zero, as the memset left it.
        return self.zeroed_grad(gi, i)

    def zeroed_grad(self, gi, i):
        self._ensure()
        if self._stale[gi][i]:  # zero_grad(set_to_none=False): the user sees zeros
            self._views[gi][i].zero_()
            self._stale[gi][i] = False
        return self._views[gi][i]

    def renew_views(self) -> None:
        """Module._apply re-points a moved param's grad in place (`p.grad.data = moved`): the
        p.grad views we handed out then hold a copy, and backward would accumulate into it,
        not into the buffer (stage 0 moved the params by a stale gradient). New views over the
        same buffer (its values are the grads' values) are shown instead."""
        if self.grads is not None:
            self._alloc(bufs=self.grads)  # given buffers: the stale flags are kept

    def to_(self, device) -> None:
        if self.grads is not None:
            self._alloc(bufs=[b.to(device) for b in self.grads])
        self._carry = [None if c is None else c.to(device) for c in self._carry]
        self._shard = [None] * len(self.groups)
        if not self._consumed:  # else the reduced pieces moved with the buffer
            self.held_now = Held.LOCAL

    def clear_all(self) -> None:
        self._mark_stale()  # [Note: no per-step memset]
        self._carry = [None] * len(self.groups)
        self.held_now = Held.LOCAL

    def clear_some(self, params) -> None:
        if self.grads is not None:
            self._set_reduced_aside()
            for gi, i in params:
                self._stale[gi][i] = True
            self._zero_carried(params)
        self.held_now = Held.LOCAL

    def adopt_foreign(self, params) -> None:
        self._ensure()
        self._set_reduced_aside()
        for gi, i in params:
            self._views[gi][i].copy_(self.groups[gi].params[i].grad)
            self._stale[gi][i] = False
        self._zero_carried(params)  # an assigned p.grad replaces what had accumulated
        self.held_now = Held.LOCAL

    # -- backward ----------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self._ensure()
        self._set_reduced_aside()
        # A stale view gets its grad copied in by on_grad (autograd hands over the grad it
        # computed); else autograd adds into the view in place ([Note: no per-step memset]).
        # Adding into fresh pages would read them first (a fault to map the zero page, another
        # on the write), and read 88 MiB more: on the 20m GPT, N=2, stage 1, free_grads=True, a
        # backward took 10,921 page faults with the add and 659 with the copy.
        for g, views, stale in zip(self.groups, self._views, self._stale):
            for p, v, st in zip(g.params, views, stale):
                p.grad = None if st else v
        self._divided = [[False] * len(g.params) for g in self.groups]
        self.held_now = Held.LOCAL
        self._sched.reset()

    def on_grad(self, gi, i, p) -> None:
        view = self._views[gi][i]
        if p.grad is not view:  # stale (p.grad was None), or autograd replaced it
            # (create_graph=True: it then holds the sum)
            n = self.comm.world.world_size
            if self.sync and self._divide_first and n > 1:
                # [Note: stage 0 divides as DDP does]: divided while copied in, one pass
                torch.mul(p.grad.detach(), 1.0 / n, out=view)
                self._divided[gi][i] = True
            else:
                view.copy_(p.grad)
            p.grad = view
            self._stale[gi][i] = False
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
        self._zero_stale(gi, k)
        b = g.bucket(buf, k)
        if not self.mode.scatters:
            src = b
            if self.mode is Reduction.ALL_REDUCE_WIDE:
                # Reduced in reduce_dtype into a buffer kept until the step, which updates
                # from it; p.grad gets the result rounded to the param dtype, as DDP's.
                if self._wide[gi] is None:
                    self._wide[gi] = huge_pages.zeros(buf.numel(), self.reduce_dtype,
                                                     buf.device, reuse=True)
                src = g.bucket(self._wide[gi], k)
                src.copy_(b)
            # fp32 in place: each param's part was divided by N before (DDP's order, [Note:
            # stage 0 divides as DDP does]); else SUM, then / N on landing.
            h = self.comm.all_reduce_grads_(src, async_op=True,
                                            label=f"group {gi} bucket {k}")
            self._handles.append((gi, k, h, b if src is not b else None,
                                  src if src is not b else None))
            return
        self.held_now = Held.REDUCING
        if self.mode is Reduction.SCATTER_IN_PLACE:  # [Note: stage 1 reduces in place]
            out, src = g.piece(buf, k), b
        else:  # a cast copy is the scratch; the result lives in a grad shard until the step
            src = b.to(self.reduce_dtype)
            if self._shard[gi] is None:
                self._shard[gi] = huge_pages.zeros(g.layout.shard_numel, self.reduce_dtype,
                                                  g.device, reuse=True)
            out = self._shard[gi][g.state_slice(k)]
        h = self.comm.reduce_grads_(out, src, async_op=True, label=f"group {gi} bucket {k}")
        self._handles.append((gi, k, h, None, None))

    def _wait_all(self):
        n = self.comm.world.world_size  # stage 0 averages over every data-parallel rank
        for gi, k, h, back, src in self._handles:
            h.wait()
            if not self.mode.scatters and not self._divide_first and n > 1:
                (src if src is not None else self.groups[gi].bucket(self.grads[gi], k)).div_(n)
            if back is not None:
                back.copy_(src)
            if self._carry[gi] is not None:  # set aside since the last in-place reduction
                g = self.groups[gi]
                g.piece(self.grads[gi], k).add_(self._carry[gi][g.state_slice(k)])
            yield gi, k
        self._handles = []
        self._carry = [None] * len(self.groups)
        self._mark_stale_none()
        # Reduced: a relaunch without a backward (p.grad assigned, then step) divides again
        self._divided = [[False] * len(g.params) for g in self.groups]

    def _mark_stale_none(self) -> None:
        """Every bucket was reduced: each view was written by its grad or zeroed."""
        self._stale = [[False] * len(g.params) for g in self.groups]

    def end_backward(self) -> None:
        if not self.sync:
            return
        for gk in self._sched.ready(flush=True):
            self._launch(*gk)
        for _ in self._wait_all():
            pass
        self.held_now = Held.REDUCED

    # -- step ----------------------------------------------------------------------------------
    def reduced_buckets(self):
        if self.held_now is Held.REDUCED:
            yield from GradSync.reduced_buckets(self)
            return
        # Only no_sync() backward passes (or a step() after a cleared reduction): reduce now.
        self._sched.reset()
        for gk in self._sched.ready(flush=True):
            self._launch(*gk)
        yield from self._wait_all()  # in launch order: k is ready while k+1 is in flight
        self.held_now = Held.REDUCED

    def grad_piece(self, gi, k) -> torch.Tensor:
        g, mode = self.groups[gi], self.mode
        if mode is Reduction.ALL_REDUCE:
            return g.bucket(self.grads[gi], k)
        if mode is Reduction.ALL_REDUCE_WIDE:
            return g.bucket(self._wide[gi], k)
        if mode is Reduction.SCATTER_IN_PLACE:
            return g.piece(self.grads[gi], k)
        return self._shard[gi][g.state_slice(k)]

    def stats_piece(self, gi, k) -> torch.Tensor:
        """[Note: stage 0 reads 1/N for its stats]"""
        if self.mode is Reduction.ALL_REDUCE:
            return self.groups[gi].piece(self.grads[gi], k)
        if self.mode is Reduction.ALL_REDUCE_WIDE:
            return self.groups[gi].piece(self._wide[gi], k)
        return self.grad_piece(gi, k)

    def after_step(self) -> None:
        # In place (and stage 0's own buffer) the reduced grads stay for a second step().
        if self.mode is Reduction.SCATTER_TO_SHARD:  # the shard lives until the step
            self._shard = [None] * len(self.groups)
            self.held_now = Held.LOCAL
        elif self.mode is Reduction.ALL_REDUCE_WIDE:  # a second step re-reduces p.grad
            self._wide = [None] * len(self.groups)
            self.held_now = Held.LOCAL

    def held(self):
        return {"grads": list(self.grads or ()),
                "buckets": [c for c in self._carry if c is not None]}
