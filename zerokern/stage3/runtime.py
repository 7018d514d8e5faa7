"""Stage 3 at run time: gather units around their forward and backward, reduce-scatter grads.

Forward (module hooks on every unit):
    pre-hook   gather the unit and the units it depends on (ties); prefetch the next unit of
               the last forward's order (async, so it overlaps this unit's compute)
    post-hook  free them again (reference counted: the root stays gathered around its
               children, and with grad enabled until its backward); with grad enabled, hook
               the unit's outputs for backward
Backward:
    output hook   (fires when the grad of the unit's output is ready, before any of the unit's
                  backward runs) re-gather the unit and prefetch the one before it
    grad hooks    copy each param's grad into the unit's staging buffer; once every param of
                  the unit has its grad the unit is freed and reduce-scattered into the grad
                  shard (accumulating over micro-batches, DESIGN §2)
    end           flush: every unit not yet reduced is reduced (params without a grad count
                  as zero) and freed; in-flight reductions are waited for

[Note: stage-3 collective order]
Every rank must issue the same collectives in the same order. Gathers follow the module calls
and the autograd graph, which are the same on every rank as long as every rank runs the same
model code (as FSDP also requires). Reduce-scatters go in one static order derived from the
forward order (reverse, root last), like stage 2's buckets: a unit whose params got no grad on
one rank only (data-dependent) cannot reorder anything; it just waits for the flush.

Activation checkpointing (non-reentrant): the recompute runs the unit's forward inside
backward, after the output hook gathered it; the hooks see `in_backward` and neither free nor
prefetch there.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List

import torch

from ..grad_sync import MAX_IN_FLIGHT
from ..sharded_grads import ShardedGrads
from .sharded_flat import ShardedFlat
from .units import Unit


def _tensors(obj, out: list) -> list:
    """Tensors in a (nested) module output: tensor, tuple/list, dict (HF ModelOutput too)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors(x, out)
    return out


class Stage3Sync(ShardedGrads):
    stage = 3

    def __init__(self, flats: List[ShardedFlat], units: List[Unit], comm,
                 reduce_dtype: torch.dtype, model: torch.nn.Module) -> None:
        self.units = units
        self.model = model
        self.unit_flats: Dict[int, List[int]] = defaultdict(list)
        for fi, f in enumerate(flats):
            self.unit_flats[f.unit_index].append(fi)
        # Units that own params or use other units' params take part; the root always does.
        self.active_units = [u for u in units if u.is_root or self.unit_flats[u.index]
                             or u.deps]
        self._pool: Dict[int, List[torch.Tensor]] = defaultdict(list)
        self.staging_allocated = 0
        self.fwd_order: List[int] = []       # units (not the root) in the last forward's order
        self._recording: List[int] = []
        self._fwd_pos = 0
        self._refs: Dict[int, int] = defaultdict(int)   # forward reference counts per unit
        self.in_backward = False
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.prefetch_hits = 0   # gathers already in flight (prefetched) when a unit needed them
        self._param_ids = [id(p) for p in model.parameters()]
        self._rs_order: List[int] = self._static_order()
        super().__init__(flats, comm, reduce_dtype)
        for u in self.active_units:
            self._hooks.append(u.module.register_forward_pre_hook(
                lambda m, args, u=u: self._pre_forward(u)))
            self._hooks.append(u.module.register_forward_hook(
                lambda m, args, out, u=u: self._post_forward(u, out)))
        self._reset_backward()

    # ---- bookkeeping -------------------------------------------------------------------------
    def _static_order(self) -> List[int]:
        """Reduce-scatter order: the last forward reversed (first call of each unit), then the
        units it did not see, the root last (its embedding's grad comes at the very end)."""
        seen, order = set(), []
        for u in self.fwd_order:
            if u not in seen:
                seen.add(u)
                order.append(u)
        rest = [u.index for u in self.active_units if u.index not in seen and not u.is_root]
        out = list(reversed(order)) + sorted(rest, reverse=True) + [0]
        return [u for u in out if self.unit_flats[u]]

    def _reset_backward(self) -> None:
        self._pending = {u: sum(len(self.groups[fi].params) for fi in fis)
                         for u, fis in self.unit_flats.items()}
        self._arrived = [[False] * len(g.params) for g in self.groups]
        self._staging: Dict[int, torch.Tensor] = {}
        self._bwd_gathered: set = set()
        self._next = 0

    def _need(self, u: Unit) -> List[int]:
        return [u.index] + sorted(u.deps)

    def _gather(self, unit_ids: List[int], wait: bool = True) -> None:
        launched = set()
        for ui in unit_ids:  # launch every all-gather first, then wait: they overlap
            for fi in self.unit_flats[ui]:
                f = self.groups[fi]
                if not f.gathered and f.handle is None:
                    launched.add(fi)
                    f.start_gather(self.comm)
                    self.live_bytes += f.full_bytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        if wait:
            for ui in unit_ids:
                for fi in self.unit_flats[ui]:
                    self.prefetch_hits += self.groups[fi].handle is not None and \
                        fi not in launched
                    self.groups[fi].finish_gather()

    def _free(self, ui: int) -> None:
        for fi in self.unit_flats[ui]:
            f = self.groups[fi]
            if f.gathered or f.handle is not None:
                f.free()
                self.live_bytes -= f.full_bytes

    def _free_unreferenced(self, keep=()) -> None:
        for u in self.active_units:
            if self._refs[u.index] == 0 and u.index not in keep:
                self._free(u.index)

    # ---- forward -----------------------------------------------------------------------------
    def _check_structure(self) -> None:
        ids = [id(p) for p in self.model.parameters()]
        if ids != self._param_ids:
            raise ValueError("zerokern stage 3: the model's parameters changed after ZeroAdamW "
                             "wrapped it (a module replaced or added, or a parameter created "
                             "after wrapping); build the model completely, then create the "
                             "optimizer")

    def _pre_forward(self, u: Unit) -> None:
        if self.in_backward:  # checkpoint recompute: the output hook gathered it already
            self._gather(self._need(u))
            return
        if u.is_root:
            self._check_structure()
            self._recording, self._fwd_pos = [], 0
        else:
            self._recording.append(u.index)
        need = self._need(u)
        for ui in need:
            self._refs[ui] += 1
        self._gather(need)
        if not u.is_root:
            pos = self._fwd_pos
            self._fwd_pos += 1
            if pos + 1 < len(self.fwd_order) and self.fwd_order[pos] == u.index:
                nxt = self.units[self.fwd_order[pos + 1]]
                self._gather(self._need(nxt), wait=False)  # prefetch
        elif self.fwd_order:
            self._gather(self._need(self.units[self.fwd_order[0]]), wait=False)

    def _post_forward(self, u: Unit, out) -> None:
        if self.in_backward:
            return
        # [Note: the root stays gathered for backward] With grad enabled the root's backward
        # comes first and needs it again at once; keeping it costs no peak memory (the root
        # is gathered through every forward and backward anyway) and saves its re-gather,
        # as FSDP2 does. Freed by the end of backward, or by step()/an eval forward.
        keep = set(self._need(u)) if u.is_root and torch.is_grad_enabled() else set()
        for ui in self._need(u):
            self._refs[ui] -= 1
            if self._refs[ui] == 0 and ui not in keep:
                self._free(ui)
        if torch.is_grad_enabled():
            for t in _tensors(out, []):
                if t.requires_grad:
                    t.register_hook(lambda grad, u=u: self._pre_backward(u))
        if u.is_root:
            if self._recording != self.fwd_order:
                self.fwd_order = self._recording
                self._rs_order = self._static_order()
            self._free_unreferenced(keep)  # prefetches the forward did not use

    # ---- backward ----------------------------------------------------------------------------
    def _pre_backward(self, u: Unit) -> None:
        self._begin_backward()
        self.in_backward = True
        if u.index in self._bwd_gathered:
            return
        self._bwd_gathered.add(u.index)
        self._gather(self._need(u))
        # Prefetch the unit whose backward comes next: the one called before u in forward.
        order = self.fwd_order
        if u.is_root:
            prev = order[-1] if order else None
        else:
            first = order.index(u.index) if u.index in order else 0
            prev = order[first - 1] if first > 0 else None
        if prev is not None and prev not in self._bwd_gathered:
            self._gather(self._need(self.units[prev]), wait=False)

    def _acquire(self, fi: int) -> torch.Tensor:
        if fi not in self._staging:
            L = self.groups[fi].layout
            pool = self._pool[L.padded_numel]
            if pool:
                buf = pool.pop()
            else:
                buf = torch.empty(L.padded_numel, dtype=self.reduce_dtype,
                                  device=self.groups[fi].device)
                self.staging_allocated += 1
            buf[L.numel:].zero_()  # padding; param regions are overwritten by their grads
            self._staging[fi] = buf
        return self._staging[fi]

    def on_grad(self, gi, i, p) -> None:
        f = self.groups[gi]
        if self._arrived[gi][i]:
            raise RuntimeError(
                "zerokern stage 3: a parameter's gradient arrived twice in one backward "
                "(reentrant checkpointing?); use torch.utils.checkpoint(..., "
                "use_reentrant=False)")
        s = f.layout.slots[i]
        self._acquire(gi)[s.offset:s.offset + s.numel].copy_(p.grad.reshape(-1))
        self._arrived[gi][i] = True
        p.grad = None
        ui = f.unit_index
        self._pending[ui] -= 1
        if self._pending[ui] == 0:
            self._free(ui)  # every use of its params has run (their grads are all in)
            self._launch_ready(flush=False)

    def _launch_ready(self, flush: bool) -> None:
        while self._next < len(self._rs_order):
            ui = self._rs_order[self._next]
            if not flush and self._pending[ui] > 0:
                return
            for fi in self.unit_flats[ui]:
                f = self.groups[fi]
                staging = self._acquire(fi)
                if self._pending[ui] > 0:  # flushed: params without a grad count as zero
                    for i, s in enumerate(f.layout.slots):
                        if not self._arrived[fi][i]:
                            staging[s.offset:s.offset + s.numel].zero_()
                while len(self._in_flight) >= MAX_IN_FLIGHT:
                    self._complete_oldest()
                self._reduce_async(fi, staging, self.grad_shards[fi])
            self._free(ui)
            self._next += 1

    def _recycle(self, staging: torch.Tensor) -> None:
        self._pool[staging.numel()].append(staging)

    def end_backward(self) -> None:
        self._launch_ready(flush=True)
        self._drain()
        self.in_backward = False
        self._free_unreferenced()
        self._reset_backward()

    # ---- step / zero_grad / reports ----------------------------------------------------------
    def reduce(self):
        self._free_unreferenced()  # a root kept by a forward that had no backward
        for fi in range(len(self.groups)):
            yield fi, 0

    def held(self):
        return {"grads": list(self.grad_shards),
                "buckets": [b for bufs in self._pool.values() for b in bufs]
                + list(self._staging.values())}

    def gather_all(self) -> None:
        for u in self.active_units:
            self._refs[u.index] += 1
        self._gather([u.index for u in self.active_units])

    def release_all(self, write_back: bool) -> None:
        for u in self.active_units:
            self._refs[u.index] -= 1
        if write_back:
            for f in self.groups:
                f.write_back_()
        self._free_unreferenced()

    def live_bound(self) -> int:
        """Bytes of full params that can be gathered at once: the root and its dependencies,
        plus two other units with theirs (the running one and the prefetched one)."""
        def unit_bytes(ui: int) -> int:
            return sum(self.groups[fi].full_bytes for fi in self.unit_flats[ui])

        root = self.units[0]
        base = sum(unit_bytes(ui) for ui in self._need(root))
        others = sorted((sum(unit_bytes(ui) for ui in self._need(u) if ui not in
                             self._need(root))
                         for u in self.active_units if not u.is_root), reverse=True)
        return base + sum(others[:2])

    def detach(self) -> None:
        super().detach()
        self.gather_all()  # the params are left whole (views of full buffers) for the new owner

