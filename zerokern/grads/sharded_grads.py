"""Stages 2 and 3: gradients reduce-scattered during backward into a grad shard.

ShardedGrads holds the shard accumulators and the async reduce-scatter with its landing; stage 2's
BucketedGrads (below) and stage 3's Stage3Runtime stage the grads their own way. Inside
`no_sync()` stage 2 accumulates into a full local buffer (Ψ elements of reduce_dtype, as FSDP2's
`set_requires_gradient_sync(False)`), folded into the next synced backward or reduced at step().
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from zerokern.comm.pieces import Pieces
from zerokern.geometry.dtensor_params import local as local_of
from zerokern.grads.grad_sync import MAX_IN_FLIGHT, GradSync, Schedule
from zerokern.state import huge_pages


class ShardedGrads(GradSync):
    """Stages 2 and 3: staged grads are reduce-scattered during backward (async) into one grad
    shard per buffer. Accumulation (DESIGN §2): the first reduction since zero_grad writes the
    shard, later ones add to it. Subclasses decide what is staged when, and keep `_staging`."""

    def __init__(self, groups, comm, reduce_dtype, rs_comm=None) -> None:
        # The reduce-scatters' group: comm, or stage 3's own ([Note: stage-3 collective order])
        self.rs_comm = comm if rs_comm is None else rs_comm
        self._grad_shards: Optional[List[torch.Tensor]] = [
            huge_pages.zeros(g.layout.shard_numel, reduce_dtype, g.device, reuse=True)
            for g in groups]  # (S,) reduce dtype; None: freed (free_grads=True)
        self._fresh = True            # first reduction since zero_grad: write the shard directly
        self._issued = False          # a reduce-scatter was issued since the last drain
        self._in_flight: List[tuple] = []
        self._changed_in_place: Optional[str] = None  # a held grad changed: raise at the end
        super().__init__(groups, comm, reduce_dtype)
        # [Note: grads read where they lie] (comm/pieces.py): the exchange set up now
        # (collective: every rank builds its optimizer alike), so the first backward reads its
        # grads in place too and no staging buffer is ever allocated where it can
        if all(g.device.type == "cpu" for g in groups) and \
                hasattr(self.rs_comm, "prepare_pieces"):
            self.rs_comm.prepare_pieces()

    @property
    def grad_shards(self) -> List[torch.Tensor]:
        if self._grad_shards is None:  # freed at zero_grad: the next reduction writes it
            self._grad_shards = [huge_pages.zeros(g.layout.shard_numel, self.reduce_dtype,
                                                  g.device, reuse=True) for g in self.groups]
        return self._grad_shards

    def held_grads(self) -> List[torch.Tensor]:
        return list(self._grad_shards or ())

    # zerokern.initialize keeps the staging pool between steps (engine/build.py [Note: the
    # engine keeps its staging]); free() then drops the grad shards only
    keep_staging = False

    def free(self) -> None:
        """The grad shards and the staging pool (a list, or stage 3's dict of lists)."""
        self._grad_shards = None
        if not self.keep_staging:
            self._pool.clear()

    def _reduce_async(self, key, staging: torch.Tensor, shard: torch.Tensor) -> None:
        """Reduce-scatter `staging` into `shard` (the first reduction since zero_grad writes it,
        later ones land in a scratch shard added on completion); `key` names the staging
        buffer: (group, bucket) at stage 2, the unit buffer's index at stage 3."""
        out = shard if self._fresh else huge_pages.zeros_like(shard, reuse=True)
        self._issued = True
        h = self.rs_comm.reduce_grads_(out, staging, async_op=True,
                                         label=self._reduce_label(key))
        self._in_flight.append((h, key, out if out is not shard else None, shard))

    def _reduce_label(self, key) -> str:
        return f"group {key[0]} bucket {key[1]}"

    def _complete_oldest(self) -> None:
        h, key, tmp, shard = self._in_flight.pop(0)
        h.wait()
        staging = self._staging.pop(key)
        if isinstance(staging, Pieces) and self._changed_in_place is None:
            # raised at the backward's end ([Note: grads read where they lie], comm/pieces.py)
            self._changed_in_place = staging.changed_in_place(self._reduce_label(key))
        if tmp is not None:
            shard.add_(tmp)
        self._recycle(staging)

    def _recycle(self, staging: torch.Tensor) -> None: ...

    def _raise_if_changed_in_place(self) -> None:
        """End of a backward, every reduce-scatter landed: raise if a grad read by reference
        was changed in place meanwhile ([Note: grads read where they lie])."""
        msg, self._changed_in_place = self._changed_in_place, None
        if msg is not None:
            error = RuntimeError(msg)
            # maybe on this rank only: posted, so the peers raise in their next collective, not
            # at the process group's timeout ([Note: an error only some ranks see], abort.py)
            self.rs_comm.signal_failure(error)
            raise error

    def _drain(self) -> None:
        """End of a reduction: every reduce-scatter has landed; the next one accumulates."""
        while self._in_flight:
            self._complete_oldest()
        if self._issued:  # (a backward under no_sync() reduced nothing: still fresh)
            self._fresh = False
            self._issued = False

    def grad_piece(self, gi, k) -> torch.Tensor:
        return self.grad_shards[gi][self.groups[gi].state_slice(k)]

    def to_(self, device) -> None:
        if self._grad_shards is not None:
            self._grad_shards = [t.to(device) for t in self._grad_shards]

    def begin_backward(self) -> None:
        for g in self.groups:  # our ReleasedGrad must not be accumulated into
            for p in g.params:
                p.grad = None

    def clear_all(self) -> None:
        self._fresh = True  # every shard piece is overwritten by the next reduction

    def clear_some(self, params) -> None:
        """Zero the cleared params' part of this rank's grad shard (and local accumulator)."""
        if self._fresh or self._grad_shards is None:
            return
        for gi, i in params:
            for lo, hi in self.groups[gi].state_spans(i):
                self.grad_shards[gi][lo:hi].zero_()


class BucketedGrads(ShardedGrads):
    """Stage 2: bucketed reduce-scatter during backward into a grad shard."""

    stage = 2

    def __init__(self, groups, comm, reduce_dtype) -> None:
        self._sched = Schedule(groups)
        self.bucket_numel = max(g.layout.bucket_numel for g in groups)
        self._pool: List[torch.Tensor] = []
        self.staging_allocated = 0    # staging buffers ever allocated (bounded, see MAX_IN_FLIGHT)
        self._local: Optional[List[torch.Tensor]] = None  # no_sync() accumulators, (E,) each
        super().__init__(groups, comm, reduce_dtype)
        self._staging: Dict[Tuple[int, int], torch.Tensor] = {}

    def _acquire(self, gi: int, k: int):
        """Bucket (gi, k)'s staging: where the reduce-scatter reads Pieces ([Note: grads read
        where they lie] in comm/pieces.py), Pieces that hold its grads by reference (or, after
        backward passes under no_sync(), the local accumulator's range, which the grads are
        added into in place); else a pooled buffer view. Either waits for the oldest
        reduce-scatter past MAX_IN_FLIGHT: the memory a bucket holds is bounded alike."""
        if (gi, k) not in self._staging:
            if getattr(self.rs_comm, "reads_pieces", False):
                while len(self._in_flight) >= MAX_IN_FLIGHT:
                    self._complete_oldest()
                L = self.groups[gi].layout
                lo, hi = L.bucket_range(k)
                ref = Pieces(hi - lo, self.reduce_dtype, self.groups[gi].device)
                if self._local is not None:
                    ref.put(0, self._local[gi][lo:hi], watch=False)  # ours, added into
                self._staging[(gi, k)] = ref
                return ref
            while len(self._in_flight) >= MAX_IN_FLIGHT and not self._pool:
                self._complete_oldest()
            if self._pool:
                buf = self._pool.pop()
            else:
                buf = huge_pages.zeros(self.bucket_numel, self.reduce_dtype,
                                       self.groups[gi].device, reuse=True)
                self.staging_allocated += 1
            L = self.groups[gi].layout
            lo, hi = L.bucket_range(k)
            view = buf[:hi - lo]
            # Not a full zero_(): every param region is overwritten by its grad (a whole pass
            # saved per step); padding (the tail, and the gaps of block-aligned slots) is
            # zeroed here, params with no grad at launch.
            self.groups[gi].zero_padding_(view, lo)
            self._staging[(gi, k)] = view
        return self._staging[(gi, k)]

    def on_grad(self, gi, i, p) -> None:
        g = self.groups[gi]
        s = g.layout.slots[i]
        flat_grad = local_of(p.grad).reshape(-1)  # a DTensor grad: its local part
        p.grad = None
        if not self.sync:  # no_sync(): local accumulation, no communication
            if self._local is None:
                self._local = [huge_pages.zeros(h.layout.padded_numel, self.reduce_dtype,
                                                h.device, reuse=True) for h in self.groups]
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
            staging = self._acquire(gi, k)
            if isinstance(staging, Pieces):
                if local is None:
                    staging.put(a - lo, flat_grad[a - s.offset:b - s.offset])
                else:  # the Pieces read local: local + grad, the bits of grad + local
                    local[a:b].add_(flat_grad[a - s.offset:b - s.offset])
            elif local is None:
                staging[a - lo:b - lo].copy_(flat_grad[a - s.offset:b - s.offset])
            else:
                dst = staging[a - lo:b - lo]
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
            if self._sched.pending[gi][k] > 0 and not isinstance(staging, Pieces):
                # flushed: params that got no grad here (Pieces read those as zeros, or
                # as the local accumulator they read)
                lo = g.layout.bucket_range(k)[0]
                for i, a, b in self._sched.overlaps[gi][k]:
                    if not self._sched.arrived[gi][i]:
                        if self._local is None:
                            staging[a - lo:b - lo].zero_()
                        else:
                            staging[a - lo:b - lo].copy_(self._local[gi][a:b])
            self._reduce_async((gi, k), staging, self.grad_shards[gi][g.state_slice(k)])

    def _recycle(self, staging) -> None:
        if not isinstance(staging, Pieces):  # (Pieces: dropped, and their grads with them)
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
        self._raise_if_changed_in_place()

    def reduced_buckets(self):
        if self._local is not None:  # backward passes under no_sync() only: reduce them now
            self._sched.reset()
            self._reduce_all()
        yield from GradSync.reduced_buckets(self)

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
        out = {"grads": self.held_grads(), "buckets": list(self._pool)}
        if self._local is not None:
            out["buckets"] += self._local
        return out
