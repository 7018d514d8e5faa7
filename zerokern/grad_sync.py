"""Gradient paths per stage: where grads accumulate and when they are reduced (DESIGN §2).

- FullGrads (stages 0 and 1): `p.grad` are views into one full flat grad buffer, so autograd
  accumulates straight into it. At `step()` each bucket is all-reduced (stage 0) or
  reduce-scattered (stage 1) into a grad shard that lives only for the step.
- BucketedGrads (stage 2): a post-accumulate-grad hook copies each grad into its bucket's staging
  buffer and drops `p.grad`; a full bucket is reduce-scattered at once (async, so it overlaps the
  rest of backward) into this rank's grad shard. Only the shard and a few staging buckets are
  held. Its shard accumulation is ShardedGrads, which stage 3's Stage3Sync shares.

[Note: collective order]
Every rank must issue the same collectives in the same order or NCCL/gloo hang. Buckets are
therefore launched in one fixed order; a bucket that fills early waits for its turn, and the
end-of-backward callback flushes what is left, so params without a grad on some rank cannot
reorder anything. The order is static, so no rank needs to tell another (learning it from a
backward, as DDP's bucket rebuild does, would need a broadcast and a host read of its result).
Buckets go in descending order of where they start *within their own group*, as a fraction of
the group: within a group that is reverse param order, the order grads arrive in; across groups
it interleaves them by depth. Groups are typically split by kind (weights / biases and norms),
each spanning the whole model, so layer i's buckets sit near i/L in every group. A bucket that
spans many layers (a small group of biases) starts near 0 and goes last: launched first, it
would hold every other bucket back until backward ends.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch.autograd import Variable

from .comm import Comm
from .flat_group import FlatGroup

# At most this many stage-2 reduce-scatters in flight before the oldest is waited for: two
# overlap communication with the next bucket's backward; more only hold staging memory.
MAX_IN_FLIGHT = 2


class GradSync:
    """Base: hook bookkeeping shared by all stages."""

    def __init__(self, groups: List[FlatGroup], comm: Comm, reduce_dtype: torch.dtype) -> None:
        self.groups = groups
        self.comm = comm
        self.reduce_dtype = reduce_dtype
        self.micro_steps = 0          # backward passes in this window (host int, no sync)
        self._consumed = False        # step() ran: the next backward opens a new window
        self.detached = False         # another ZeroAdamW took these params over
        self._callback_queued = False
        self._hooks = []
        # A weak reference: the hook lives in the param's grad accumulator (C++), where the
        # garbage collector cannot see a cycle back to this object, so `del opt, model` would
        # never free the optimizer's buffers.
        ref = weakref.ref(self)
        for gi, g in enumerate(groups):
            for i, p in enumerate(g.params):
                p._zerokern_sync = self  # marks the param as owned (see ZeroAdamW's check)
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda p, gi=gi, i=i: ref() is not None and ref()._on_grad(gi, i, p)))

    def _on_grad(self, gi: int, i: int, p: torch.Tensor) -> None:
        if p.grad is not None and p.grad.layout != torch.strided:
            raise TypeError(f"zerokern: param {i} of param group {gi} got a {p.grad.layout} "
                            "gradient; sparse gradients are not supported (use dense "
                            "embeddings, e.g. nn.Embedding(sparse=False))")
        self._begin_backward()
        self.on_grad(gi, i, p)

    def _begin_backward(self) -> None:
        """Called from any hook inside a backward: the first call queues end_backward."""
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_backward)
            if self._consumed:  # first backward after a step(): a new averaging window
                self._consumed = False
                self.micro_steps = 0
                self.new_window()

    def _end_backward(self) -> None:
        self._callback_queued = False
        self.end_backward()
        self.micro_steps += 1

    def detach(self) -> None:
        """Remove the hooks; the owning optimizer can no longer step (params were taken over)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.detached = True

    def consumed(self) -> None:
        """Called by step(): these grads were used; the next backward opens a new window."""
        self._consumed = True

    # stage behaviour -----------------------------------------------------------------------
    def on_grad(self, gi: int, i: int, p: torch.Tensor) -> None: ...
    def new_window(self) -> None: ...
    def end_backward(self) -> None: ...
    def reduce(self):
        """Called at step(): yields (group, bucket) as each bucket's reduced (summed) grads
        are ready in grad_piece(), so the caller can work on one while others are in flight."""
        for gi, g in enumerate(self.groups):
            for k in range(g.layout.n_buckets):
                yield gi, k
    def grad_piece(self, gi: int, k: int) -> torch.Tensor: ...
    def release(self) -> None:
        """Called after the update: drop per-step buffers."""
    def zero_grad(self) -> None:
        self.micro_steps = 0
        self._consumed = False
    def held(self) -> Dict[str, List[torch.Tensor]]:
        return {}


class FullGrads(GradSync):
    """Stages 0 and 1: full grad buffer, reduced at step()."""

    def __init__(self, groups, comm, reduce_dtype, stage: int) -> None:
        self.stage = stage
        self._in_place_reduced = False  # stage 0 all-reduced the grad buffer itself
        self.grads = [torch.zeros_like(g.flat) for g in groups]  # (E,) model dtype
        self._views = [[buf[s.offset:s.offset + s.numel].view(s.shape) for s in g.layout.slots]
                       for g, buf in zip(groups, self.grads)]
        self._reduced: List[Optional[torch.Tensor]] = [None] * len(groups)
        super().__init__(groups, comm, reduce_dtype)
        self._attach()

    def _attach(self) -> None:
        for g, views in zip(self.groups, self._views):
            for p, v in zip(g.params, views):
                p.grad = v

    def on_grad(self, gi, i, p) -> None:
        view = self._views[gi][i]
        if p.grad is not view:  # grads were set to None (e.g. model.zero_grad()): re-adopt
            view.copy_(p.grad)
            p.grad = view

    def reduce(self):
        if self._in_place_reduced:  # a second step() on the same grads: already summed
            yield from GradSync.reduce(self)
            return
        handles = []
        for gi, (g, buf) in enumerate(zip(self.groups, self.grads)):
            src = buf if buf.dtype == self.reduce_dtype else buf.to(self.reduce_dtype)
            if self.stage == 0:
                self._in_place_reduced = src is buf
                out = src  # all-reduce in place
                for k in range(g.layout.n_buckets):
                    handles.append((gi, k, self.comm.all_reduce_(g.bucket(out, k),
                                                                 async_op=True)))
            else:
                # gloo corrupts an in-place reduce-scatter (output aliasing the input), so the
                # result goes to a shard buffer that lives only for this step.
                out = torch.empty(g.layout.shard_numel, dtype=self.reduce_dtype, device=g.device)
                for k in range(g.layout.n_buckets):
                    handles.append((gi, k, self.comm.reduce_scatter_(
                        out[g.state_slice(k)], g.bucket(src, k), async_op=True,
                        inp_is_scratch=src is not buf)))  # a converted copy may be scratch
            self._reduced[gi] = out
        for gi, k, h in handles:  # in launch order: bucket k is ready while k+1 is in flight
            h.wait()
            yield gi, k

    def grad_piece(self, gi, k) -> torch.Tensor:
        g, out = self.groups[gi], self._reduced[gi]
        return g.bucket(out, k) if self.stage == 0 else out[g.state_slice(k)]

    def release(self) -> None:
        if not self._in_place_reduced:
            self._reduced = [None] * len(self.groups)

    def end_backward(self) -> None:
        self._in_place_reduced = False  # new grads were added: they need reducing again
        self._reduced = [None] * len(self.groups)

    def zero_grad(self) -> None:
        super().zero_grad()
        self._in_place_reduced = False
        for buf in self.grads:
            buf.zero_()
        self._attach()

    def held(self):
        return {"grads": list(self.grads)}


class ShardedGrads(GradSync):
    """Stages 2 and 3: staged grads are reduce-scattered during backward (async) into one grad
    shard per buffer. Accumulation (DESIGN §2): the first backward of a window writes the shard,
    later ones add to it. Subclasses decide what is staged when, and keep `_staging`."""

    def __init__(self, groups, comm, reduce_dtype) -> None:
        self.grad_shards = [torch.zeros(g.layout.shard_numel, dtype=reduce_dtype, device=g.device)
                            for g in groups]  # (S,) reduce dtype
        self._fresh = True            # first backward since zero_grad: write the shard directly
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
        """End of a backward: every reduction has landed; the next backward accumulates."""
        while self._in_flight:
            self._complete_oldest()
        self._fresh = False

    def grad_piece(self, gi, k) -> torch.Tensor:
        return self.grad_shards[gi][self.groups[gi].state_slice(k)]

    def new_window(self) -> None:
        # After step() the shard was consumed (as in DeepSpeed): overwrite, do not accumulate.
        self._fresh = True

    def zero_grad(self) -> None:
        super().zero_grad()
        self._fresh = True  # every shard piece is overwritten by the next backward's flush


class BucketedGrads(ShardedGrads):
    """Stage 2: bucketed reduce-scatter during backward into a grad shard."""

    def __init__(self, groups, comm, reduce_dtype) -> None:
        self._overlaps = [[g.layout.overlaps(*g.layout.bucket_range(k))
                           for k in range(g.layout.n_buckets)] for g in groups]
        self._overlap_count = [[len(ov) for ov in per_group] for per_group in self._overlaps]
        # Fixed launch order (see the Note): latest relative start first.
        key = [(g.layout.bucket_range(k)[0] / max(g.layout.numel, 1), gi, k)
               for gi, g in enumerate(groups) for k in range(g.layout.n_buckets)]
        self.order: List[Tuple[int, int]] = [(gi, k) for _, gi, k in sorted(key, reverse=True)]
        self.bucket_numel = max(g.layout.bucket_numel for g in groups)
        self._pool: List[torch.Tensor] = []
        self.staging_allocated = 0    # staging buffers ever allocated (bounded, see MAX_IN_FLIGHT)
        super().__init__(groups, comm, reduce_dtype)
        self._reset_backward()

    def _reset_backward(self) -> None:
        self._pending = [list(c) for c in self._overlap_count]
        self._arrived = [[False] * len(g.params) for g in self.groups]
        self._staging: Dict[Tuple[int, int], torch.Tensor] = {}
        self._next = 0                # index into self.order of the next bucket to launch

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
        if self._arrived[gi][i]:
            raise RuntimeError(
                "zerokern stage 2: a parameter's gradient arrived twice in one backward "
                "(reentrant checkpointing?); use torch.utils.checkpoint(..., "
                "use_reentrant=False) or stage=1")
        flat_grad = p.grad.reshape(-1)
        # Descending, the launch order within a group: a param spanning several buckets fills
        # and launches them one by one, so staging stays bounded whatever the param size.
        for k in reversed(g.layout.buckets_of_slot(i)):
            lo, hi = g.layout.bucket_range(k)
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            self._acquire(gi, k)[a - lo:b - lo].copy_(flat_grad[a - s.offset:b - s.offset])
            self._pending[gi][k] -= 1
            if self._pending[gi][k] == 0:
                self._launch_ready(flush=False)
        self._arrived[gi][i] = True
        p.grad = None
        self._launch_ready(flush=False)

    def _launch_ready(self, flush: bool) -> None:
        while self._next < len(self.order):
            gi, k = self.order[self._next]
            if not flush and self._pending[gi][k] > 0:
                return
            g = self.groups[gi]
            staging = self._acquire(gi, k)
            if self._pending[gi][k] > 0:  # flushed with params that got no grad: they are 0
                lo = g.layout.bucket_range(k)[0]
                for i, a, b in self._overlaps[gi][k]:
                    if not self._arrived[gi][i]:
                        staging[a - lo:b - lo].zero_()
            self._reduce_async((gi, k), staging, self.grad_shards[gi][g.state_slice(k)])
            self._next += 1

    def _recycle(self, staging: torch.Tensor) -> None:
        self._pool.append(staging._base)

    def end_backward(self) -> None:
        self._launch_ready(flush=True)
        self._drain()
        self._reset_backward()

    def held(self):
        return {"grads": list(self.grad_shards), "buckets": list(self._pool)}
