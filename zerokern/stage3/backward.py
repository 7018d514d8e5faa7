"""Stage 3's backward half: re-gather units as backward reaches them, reduce-scatter their
grads (DESIGN §2). The rules and their reasons are in [Note: stage-3 collective order] in
runtime.py; `Stage3Runtime` (runtime.py) adds the forward half and the bookkeeping this uses
(`_gather`, `_reach`, `_release`, `_free`, the schedules and counters).
"""

from __future__ import annotations

import torch

from zerokern.grads.grad_sync import MAX_IN_FLIGHT, TrainingState
from zerokern.grads.sharded_grads import ShardedGrads
from zerokern.layout.dtensor_params import local as local_of
from zerokern.state import huge_pages

from . import param_offload
from .units import Unit

# [Note: reduce-scatter windows] (rule 4 of [Note: stage-3 collective order], issue 24 item 3)
# When a unit's backward is over (rule 3) differs between ranks, so it must not decide where a
# reduce-scatter goes between the gathers, only what it carries. The unit at position j of the
# reversed schedule is reduce-scattered in a window: after gather step j + WINDOW_OPENS is
# launched and before gather step j + 3 is (gather steps are launched in the schedule's order
# on every rank, as a prefetch or when the cursor moves; for the last units and the root the
# window opens after the last step). Inside its window a unit goes as soon as its backward is
# over here. In a model whose units run in schedule order it always is: step j + 2 is the
# prefetch taken when the cursor reaches unit j + 1, whose output grad is unit j's input grad,
# and its AccumulateGrads run before that hook; so does its input-grad hook, since the cursor
# moves in a node pre-hook that runs after the tensor's hooks ([Note: the cursor hook runs
# last on its tensor] in runtime.py). Measured late units (test_stage3_users' models, N = 2,
# 4 steps) with the cursor on a tensor hook: WINDOW_OPENS = 1: 4 for the "stall" model (a
# block's param unused on one rank), 11 for DynLM (dropped blocks, branches, MoE experts as
# units); 2: 0 and 6; 3: 0 and 0. With the node pre-hook: 0 and 0 for 1 and 2. 2 keeps one
# unit of slack at no cost for models in schedule order (their reduce-scatters go at the
# same moment with 1 or 2). If the window closes first on a rank (a unit called out
# of schedule order; one called with no input that requires grad whose params go partly
# unused), that rank sends zeros in the window and keeps the unit's grads: the unit is late.
# At the end of every synced backward the ranks agree on the late units (a gloo all-reduce of
# one flag per unit over the world: comm/host_agree.py, no device sync) and reduce-scatter
# each again in the static order, the late ranks sending what they kept and the others zeros:
# the sums are exact. Cost: that host all-reduce per backward (0.7 ms median on 2 quiet gloo
# ranks, 0.25% of the 20m GPT's stage-3 iteration), one extra reduce-scatter per
# late unit (`late_units` counts them), and a unit's reduce-scatter may wait from its last
# AccumulateGrad to the next unit's output hook (no compute runs between the two).
WINDOW_OPENS = 2


class Stage3Backward(ShardedGrads):
    @property
    def in_backward(self) -> bool:
        """Stage 3's backward has reached a unit ([Note: one lifecycle state])."""
        return self.state is TrainingState.BACKWARD

    def replay_output_grad(self, u: Unit) -> None:
        """u's output hook outside autograd (accounting/estimate.py's replay, which calls
        end_backward itself: there is no backward-end callback to queue)."""
        if self.state is TrainingState.IDLE:
            self.state = TrainingState.PRE_BACKWARD
        self._pre_backward(u)

    def _pre_backward(self, u: Unit) -> None:
        """The grad of u's output is ready: u's backward is about to run."""
        self._bwd_reach(u)

    def _bwd_reach(self, u: Unit) -> None:
        """Move the backward cursor to u (rule 1): gather it, and first the units of the
        reversed schedule this rank skipped (their backward is over here: rule 3)."""
        if not self.in_backward:  # a backward starts (param offload's read-ahead)
            param_offload.new_pass(self)
        self._begin_backward()
        self.state = TrainingState.BACKWARD
        if u.is_root:
            self._gather(self._need(u))
        else:
            pos = self._bpos.get(u.index, -1)
            if pos >= self._bcur:
                self._skip_backward(pos)
            self._gather(self._need(u))
        if self._bcur < len(self._bsched):  # prefetch the next unit of the reversed schedule
            self._gather_steps(self._bcur)
            param_offload.read_ahead(self, self._bsched, self._bcur + 1)  # (nvme: its read)

    def _skip_backward(self, pos: int) -> None:
        """Move the backward cursor to pos. A unit passed over that the forward did not call
        (with grad) on this rank is unused here: gathered for its peers, freed, done (rule 3);
        one it did call (out of schedule order) stays gathered for its backward to come."""
        unused = [ui for ui in self._bsched[self._bcur:pos]
                  if self._calls[ui] == 0 and ui not in self._unsignalled]
        # Over here already (rule 3): a window that closes during these gather steps carries
        # their zeros as a reduced unit, not as a late one; they are freed below, once their
        # gathers have landed (not by _reduce_unit: a freed unit's gather would be re-issued).
        self._passing = set(unused)
        self._gather_steps(pos)
        self._reach(self._bsched, self._bcur, pos, free_skipped=False)
        self._bcur = pos + 1
        self._passing = set()
        for ui in unused:
            self._release(ui)
            self._unit_done(ui)

    def _gather_steps(self, upto: int) -> None:
        """Launch the gathers of the reversed schedule up to position `upto` in order, each
        after the reduce-scatters whose window it closes (rule 4), opening the next windows."""
        for k in range(self._gstep, upto + 1):
            self._close_windows(k - WINDOW_OPENS - 1)
            self._gather(self._need(self.units[self._bsched[k]]), wait=False)
            self._gstep = k + 1
            self._launch_ready(flush=False)

    def _input_grad(self, u: Unit, left: list) -> None:
        left[0] -= 1
        if left[0] == 0:  # this call's backward is over; the unit's when all calls' are
            self._calls[u.index] -= 1
            if self._calls[u.index] == 0:
                if u.index not in self._unsignalled:
                    self._unit_done(u.index)
                self._maybe_free(u.index)

    def _maybe_free(self, ui: int) -> None:
        """Free a unit whose backward no longer needs it: its trainable params have all their
        grads (every op that saved one of them has run) and, if it holds frozen params (which
        get no grad to tell), the grads of its inputs have been computed."""
        if self._refs[ui] or ui in self._held_deps:
            return
        if self._pending.get(ui, 0) > 0 and ui not in self._done:  # (done: the rest unused)
            return
        if self._calls[ui] > 0 and any(not f.trainable for f in self._bufs(ui)):
            return
        self._free(ui)

    def _unit_done(self, ui: int) -> None:
        """u's backward is over on this rank: params still without a grad were not used."""
        if ui in self._done or not self.unit_flats[ui]:
            return
        self._done.add(ui)
        self._launch_ready(flush=False)

    def _pooled(self, fi: int) -> torch.Tensor:
        """A staging buffer for unit buffer fi from the pool (or a new one), contents stale."""
        L = self.groups[fi].layout
        pool = self._pool[L.padded_numel]
        if pool:
            return pool.pop()
        self.staging_allocated += 1
        return huge_pages.zeros(L.padded_numel, self.reduce_dtype, self.groups[fi].device)

    def _acquire(self, fi: int) -> torch.Tensor:
        if fi not in self._staging:
            buf = self._pooled(fi)
            self.groups[fi].zero_padding_(buf, 0)  # padding (gaps too); params get grads
            self._staging[fi] = buf
        return self._staging[fi]

    def on_grad(self, gi, i, p) -> None:
        f = self.groups[gi]
        ui = f.unit_index
        if self._arrived[gi][i]:
            raise RuntimeError(
                "zerokern stage 3: a parameter's gradient arrived twice in one backward "
                "(reentrant checkpointing?); use torch.utils.checkpoint(..., "
                "use_reentrant=False)")
        if ui in self._reduced:
            raise RuntimeError(
                f"zerokern stage 3: param {i} of unit {self.units[ui].name or '<root>'!r} got "
                "its gradient after the unit's backward was over (the grad of the unit's "
                "inputs was already computed), so its unit was already reduced: the param is "
                "used outside the path from the unit's inputs to its outputs. Make the module "
                "that uses it a unit of its own (units=...) or move the param into the module "
                "that uses it")
        s = f.layout.slots[i]
        grad = local_of(p.grad).reshape(-1)  # a DTensor grad: its local part
        if not self.sync:  # no_sync(): a full local accumulator per buffer, no reduce-scatter
            self._local_buf(gi)[s.offset:s.offset + s.numel].add_(grad)
        elif self._local is not None and self._local[gi] is not None:
            torch.add(grad, self._local[gi][s.offset:s.offset + s.numel],
                      out=self._acquire(gi)[s.offset:s.offset + s.numel])
        else:
            self._acquire(gi)[s.offset:s.offset + s.numel].copy_(grad)
        self._arrived[gi][i] = True
        p.grad = None
        self._pending[ui] -= 1
        if self._pending[ui] == 0:
            self._done.add(ui)
            self._maybe_free(ui)
            self._launch_ready(flush=False)

    def _local_buf(self, fi: int) -> torch.Tensor:
        """[Note: stage 3 under no_sync] As FSDP2's set_requires_gradient_sync(False): grads
        accumulate unsharded, one full buffer per (unit, group) in reduce_dtype (the Ψ elements
        of a replicated gradient, on top of the shards), and are folded into the next synced
        backward's staging (or reduced from there at step()). The gathers still run."""
        if self._local is None:
            self._local = [None] * len(self.groups)
        if self._local[fi] is None:
            L = self.groups[fi].layout
            self._local[fi] = huge_pages.zeros(L.padded_numel, self.reduce_dtype,
                                               self.groups[fi].device)
        return self._local[fi]

    # ---- rule 4: reduce-scatter windows -----------------------------------------------------
    def _rs_pos(self, ui: int) -> int:
        """The unit's position in the reversed schedule (the root: after all of them)."""
        return self._bpos.get(ui, len(self._bsched))

    def _window_open(self, ui: int) -> bool:
        """Gather step pos + WINDOW_OPENS was launched (or the schedule's last one was)."""
        return self._gstep > min(self._rs_pos(ui) + WINDOW_OPENS, len(self._bsched) - 1)

    def _ready(self, ui: int) -> bool:
        return self._pending[ui] == 0 or ui in self._done or ui in self._passing

    def _launch_ready(self, flush: bool) -> None:
        """Reduce-scatter, in the static order, the units whose window is open and whose
        backward is over on this rank (flush: every unit left, at the end of backward)."""
        if not self.sync:
            return
        while self._next < len(self._rs_order):
            ui = self._rs_order[self._next]
            if not flush and not (self._window_open(ui) and self._ready(ui)):
                return
            self._reduce_unit(ui, flush)
            self._next += 1

    def _close_windows(self, upto: int) -> None:
        """Before the gather that closes their windows: the units at positions <= upto go now,
        reduced if their backward is over on this rank, else late (rule 4)."""
        if not self.sync:
            return
        while self._next < len(self._rs_order):
            ui = self._rs_order[self._next]
            if self._rs_pos(ui) > upto:
                return
            if self._ready(ui):
                self._reduce_unit(ui, flush=False)
            else:
                self._reduce_zeros(ui)
                self._late.add(ui)
            self._next += 1

    def _reduce_unit(self, ui: int, flush: bool) -> None:
        """Reduce-scatter this rank's grads of unit ui into the shards."""
        for fi in self.unit_flats[ui]:
            f = self.groups[fi]
            staging = self._acquire(fi)
            local = None if self._local is None else self._local[fi]
            if self._pending[ui] > 0:  # params without a grad count as zero
                for i, s in enumerate(f.layout.slots):
                    if not self._arrived[fi][i]:
                        sl = slice(s.offset, s.offset + s.numel)
                        if local is None:
                            staging[sl].zero_()
                        else:  # ...plus what no_sync() accumulated for them
                            staging[sl].copy_(local[sl])
            if local is not None:
                self._local[fi] = None
            while len(self._in_flight) >= MAX_IN_FLIGHT:
                self._complete_oldest()
            self._reduce_async(fi, staging, self.grad_shards[fi])
        self._reduced.add(ui)
        if not flush and ui not in self._passing:  # (a unit passed is freed by _skip_backward)
            self._maybe_free(ui)

    def _reduce_zeros(self, ui: int) -> None:
        """Unit ui's reduce-scatter with zeros for this rank's part (a late unit here, or a
        peer's late unit in the catch-up): the same collectives, labels and shapes as a real
        one, so the order stays the same on every rank."""
        for fi in self.unit_flats[ui]:
            key = (fi, "zeros")
            buf = self._staging[key] = self._pooled(fi).zero_()
            while len(self._in_flight) >= MAX_IN_FLIGHT:
                self._complete_oldest()
            self._reduce_async(key, buf, self.grad_shards[fi])

    def _catch_up(self) -> None:
        """End of a synced backward, after every window: the ranks agree on the units any of
        them reduced late, then reduce those again in the static order, each rank sending its
        held-back grads where it was late and zeros where it was not (rule 4)."""
        late = self._agree.any_set([ui in self._late for ui in self._rs_order],
                                   label="stage-3 late units")
        units = [ui for ui, x in zip(self._rs_order, late) if x]
        if not units:
            return
        self._drain()  # (the window's reduction landed: the catch-up adds to the shards)
        for ui in units:
            if ui in self._late:
                self._reduce_unit(ui, flush=True)
            else:
                self._reduce_zeros(ui)
        self.late_units += len(units)

    def _reduce_label(self, key) -> str:
        return self._label(self.groups[key[0] if isinstance(key, tuple) else key])

    def _recycle(self, staging: torch.Tensor) -> None:
        self._pool[staging.numel()].append(staging)

    def end_backward(self) -> None:
        if self._bcur < len(self._bsched):  # units this rank did not reach: their gathers,
            # through _gather_steps as when the cursor passes units (rule 4: the windows order
            # these gathers against the reduce-scatters as on the ranks that reached them; a
            # plain _reach here issued them back to back, and the fake-CUDA run at world 8 saw
            # a rank that skipped the first two of six blocks swap a gather and a
            # reduce-scatter against its peers: tests/gpu_control)
            last = len(self._bsched) - 1
            self._skip_backward(last)
            tail = self._bsched[-1]
            self._release(tail)
            if self._calls[tail] == 0 and tail not in self._unsignalled:
                self._unit_done(tail)
            self._bcur = len(self._bsched)
        self._launch_ready(flush=True)  # (not under no_sync(): nothing is reduced then)
        if self.sync:
            self._catch_up()
        self._drain()
        self.state = TrainingState.PRE_BACKWARD  # IDLE once the queued end has run
        self._free_unreferenced()
        self._calls.clear()
        self._unsignalled.clear()
        self._reset_backward()
        self._hpz_invalidate()  # (after the frees above, which keep secondaries)
