"""Stage 3 at run time: gather units around their forward and backward, reduce-scatter grads.

Forward (module hooks on every unit):
    pre-hook   gather the unit (and, first, any unit of the schedule this rank skipped) and
               the units it depends on (ties); prefetch the next unit of the schedule (async,
               so it overlaps this unit's compute)
    post-hook  free them again (reference counted: the root stays gathered around its
               children, and with grad enabled until its backward); with grad enabled, hook
               the unit's outputs (pre-backward) and inputs (post-backward)
Backward:
    output hook   (fires when the grad of the unit's output is ready, before any of the unit's
                  backward runs) re-gather the unit, as the forward did, and prefetch the next
    grad hooks    hold each param's grad by reference for the unit's reduce-scatter where
                  the shared-memory exchange reads it in place (comm/pieces.py), else copy it
                  into the unit's staging buffer; once the unit is
                  done (every param has its grad, or the grad of its input is ready: params
                  without one were not used) it is freed and reduce-scattered, in the static
                  order, into the grad shard (accumulating over backward passes, DESIGN §2)
    end           flush: gather what the schedule has not reached (units this rank did not
                  use), reduce what is left (params without a grad count as zero), wait

[Note: stage-3 collective order]
Every rank must issue the same collectives in the same order, also when ranks use different
params in a step (a branch inside a unit, a unit skipped on one rank, MoE routing). Four rules
make the order independent of which params a rank used:
1. Gathers follow a static schedule, not the calls. The schedule is the units in module
   registration order (the same on every rank). Each forward gathers every unit of it once,
   in that order: a unit's pre-hook first gathers (and at once frees) the units before it
   that this rank skipped, and the root's post-hook gathers those skipped at the end. Backward
   does the same over the reversed schedule (output hooks and checkpoint recomputes move the
   cursor; the end of backward gathers the rest). A skipped unit thus costs this rank one
   gather that its peers need, and nothing else. Frees in forward are reference counted on
   the calls, so whether a unit is gathered when the schedule reaches it is the same on every
   rank. A unit called again after the schedule passed it (a block used twice) is gathered
   again if freed: that is consistent only if every rank calls it again, as with FSDP.
2. Reduce-scatters go in one static order (the reversed schedule, the root last) on a process
   group of their own (Comm.split), so gloo's ring threads and NCCL's streams run the two
   concurrently. On a GPU the gathers are issued from a stream of their own, so no gather
   waits (through the compute stream) for a reduce-scatter ([Note: stage-3 gather stream] in
   gather_stream.py).
3. A unit's backward is over on this rank once all its params have grads, or the grad of its
   inputs has been computed (FSDP2's post-backward: autograd runs a param's AccumulateGrad,
   which has the highest priority, as soon as it is ready, so a param without a grad by then
   was not used), or the schedule passed it without its backward running (not used on this
   rank). Unused params count as zero. (An input that is a leaf signals at the end of the
   backward instead: [Note: a leaf input]; calls from several graphs alive at once:
   [Note: graphs alive across backwards].) Without this a unit with one param unused on a rank
   would be late there (rule 4) at every step.
4. The two orders interleave the same way on every rank (issue 24, item 3: NCCL asks for one
   order across communicators): each unit is reduce-scattered in a window between two gathers
   of the reversed schedule, carrying this rank's grads if its backward is over (rule 3), else
   zeros, the grads following in a catch-up at the end of backward that every rank joins
   ([Note: reduce-scatter windows] below).
A param whose grad arrives after its unit was reduced (a param outside its unit's input
path) raises a RuntimeError naming the fix. ZEROKERN_DEBUG_COLLECTIVES=1 checks the whole
record across ranks at every step(), in issue order over both groups (comm/debug.py).

Activation checkpointing (non-reentrant): the recompute runs the unit's forward inside
backward, after the output hook gathered it; the hooks see `in_backward` and neither free nor
prefetch there. HF's reentrant checkpointing has no output hooks (its first forward runs under
no_grad): the recompute's pre-hook moves the backward cursor instead.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from zerokern.comm.fingerprint import differ_across_ranks, fingerprint
from zerokern.comm.host_agree import HostAgreement
from zerokern.comm.pieces import Pieces, held_tensors
from zerokern.geometry.dtensor_params import local as local_of
from zerokern.grads.grad_sync import MAX_IN_FLIGHT, TrainingState
from zerokern.grads.sharded_grads import ShardedGrads
from zerokern.grads.weak_hook import weak_hook
from zerokern.state import huge_pages

from . import guards, param_offload
from .ds_schedule import Stage3Keys, deepspeed_keep, prefetch_units
from .generate_sync import sync_generate
from .hpz import HpzSecondary
from .sharded_flat import ShardedFlat
from .units import Unit, kept_for_backward, live_units_bound
from .units import tensors_in as _tensors

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


class Stage3Runtime(ShardedGrads):
    """Stage 3's runtime: gathers, frees and prefetches the units' params around forward and
    backward, and reduce-scatters their grads into the shards (the GradSync of stage 3)."""

    stage = 3

    def __init__(self, flats: List[ShardedFlat], units: List[Unit], comm,
                 reduce_dtype: torch.dtype, model: torch.nn.Module,
                 frozen: List[ShardedFlat] = (), keep_for_backward_bytes: float = 0) -> None:
        self.units = units
        self.frozen = list(frozen)
        self.unit_flats: Dict[int, List[int]] = defaultdict(list)   # trainable, by index
        for fi, f in enumerate(flats):
            self.unit_flats[f.unit_index].append(fi)
        self.unit_bufs: Dict[int, List[ShardedFlat]] = defaultdict(list)  # trainable + frozen
        for f in list(flats) + self.frozen:
            self.unit_bufs[f.unit_index].append(f)
        # Units that hold params or use other units' params take part; the root always does.
        self.active_units = [u for u in units if u.is_root or self.unit_bufs[u.index]
                             or u.deps]
        self._pool: Dict[int, List[torch.Tensor]] = defaultdict(list)
        self._local = None  # no_sync() accumulators ([Note: stage 3 under no_sync])
        self.staging_allocated = 0
        # The gather schedule ([Note: stage-3 collective order], rule 1): registration order.
        self.schedule: List[int] = [u.index for u in self.active_units if not u.is_root]
        self._fpos = {ui: k for k, ui in enumerate(self.schedule)}
        self._bsched = list(reversed(self.schedule))
        self._bpos = {ui: k for k, ui in enumerate(self._bsched)}
        self._held_deps = {d for u in self.active_units for d in u.deps}
        self._set_kept(kept_for_backward(  # [Note: kept units] in units.py
            self.schedule, lambda ui: self._need(self.units[ui]),
            lambda ui: sum(f.full_bytes for f in self._bufs(ui)), keep_for_backward_bytes))
        self._own_kept = self.kept_units  # keep_for_backward_mb's (use_schedule(None))
        self._prefetch_numel = None  # DeepSpeed's prefetch bucket (use_schedule), elements
        self.fwd_order: List[int] = []       # units (not the root) in the last forward's order
        self._recording: List[int] = []
        self._fcur = 0
        self._refs: Dict[int, int] = defaultdict(int)   # forward reference counts per unit
        # units whose forward began and has not ended, and the calls (rule 3) this forward
        # counted: what a forward that raised leaves behind ([Note: a forward that raised])
        self._fwd_open: List[int] = []
        self._fwd_calls: List[int] = []
        # grad-enabled calls per unit whose backward is still to come (rule 3)
        self._calls: Dict[int, int] = defaultdict(int)
        self._unsignalled: set = set()   # units called with no input that requires grad
        self._deferred: List[Unit] = []  # calls over, signalled by a leaf input (applied later)
        self._unit_of = {id(u.module): u.index for u in self.active_units}
        self._fwd_grad = False  # the root's forward runs with grad (a backward follows)
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.prefetch_hits = 0   # gathers already in flight (prefetched) when a unit needed them
        # Rule 2: reduce-scatters in the reversed schedule, the root last, on their own group.
        self._rs_order: List[int] = [u for u in self._bsched + [0] if self.unit_flats[u]]
        comm.enable_debug_log()  # ZEROKERN_DEBUG_COLLECTIVES=1: checked in reduce()
        self.hpz = None if comm.hpz is None else HpzSecondary(comm.hpz)  # stage3/hpz.py
        super().__init__(flats, comm, reduce_dtype, rs_comm=comm.split())
        self._agree = HostAgreement(comm.world)  # rule 4's catch-up, over every rank
        self.late_units = 0  # units reduced late and caught up, since construction (rule 4)
        self.guard = guards.ModelGuard(self, model)
        for u in self.active_units:
            self._hooks.append(u.module.register_forward_pre_hook(
                weak_hook(self, "_pre_forward_hook"), with_kwargs=True))
            self._hooks.append(u.module.register_forward_hook(
                weak_hook(self, "_post_forward_hook")))
        self._hooks += self.guard.hooks
        # generate() with synced_gpus on at world_size > 1 ([Note] in generate_sync.py)
        self._hooks += sync_generate(model, comm.world.world_size, self)
        self._reset_backward()

    def _set_kept(self, kept: List[int]) -> None:
        self.kept_units = kept
        kept = set(kept)  # where the schedule's kept end starts (_prefetch_ahead)
        self._kept_from = next((j for j in range(len(self.schedule))
                                if all(ui in kept for ui in self.schedule[j:])),
                               len(self.schedule))

    def _numel(self, ui: int) -> int:
        return sum(f.layout.padded_numel for f in self._bufs(ui))

    def _in_flight_or_gathered(self, ui: int) -> bool:
        return all(f.gathered or f.handle is not None for f in self._bufs(ui))

    def use_schedule(self, keys: Optional[Stage3Keys]) -> None:
        """DeepSpeed's four stage-3 keys ([Note: DeepSpeed's stage-3 keys] in ds_schedule.py):
        the units kept for the backward and the forward's prefetch budget, in place of
        keep_for_backward_mb's (None: back to those). Call between steps, on every rank."""
        if keys is None:
            self._set_kept(self._own_kept)
            self._prefetch_numel = None
            return

        def persistent(ui: int) -> bool:
            return all(s.numel <= keys.param_persistence_threshold
                       for f in self._bufs(ui) for s in f.layout.slots)

        kept = deepspeed_keep(self.schedule, 0, self._numel, persistent, keys)
        self._set_kept(list(dict.fromkeys(uj for ui in kept for uj in self._need(self.units[ui]))))
        self._prefetch_numel = keys.prefetch_numel

    # ---- bookkeeping -------------------------------------------------------------------------
    def _reset_backward(self) -> None:
        self._pending = {u: sum(len(self.groups[fi].params) for fi in fis)
                         for u, fis in self.unit_flats.items()}
        self._arrived = [[False] * len(g.params) for g in self.groups]
        self._staging: Dict[int, torch.Tensor] = {}
        self._done: set = set()       # units whose backward is over on this rank (rule 3)
        self._reduced: set = set()
        self._late: set = set()       # units whose window closed before their backward was over
        self._gstep = 0               # gather steps of the reversed schedule launched (rule 4)
        self._passing: set = set()    # unused units the cursor is passing (_skip_backward)
        self._bcur = 0
        self._next = 0

    def _need(self, u: Unit) -> List[int]:
        return [u.index] + sorted(u.deps)

    def _bufs(self, ui: int) -> List[ShardedFlat]:
        return self.unit_bufs[ui]

    def _label(self, f: ShardedFlat) -> str:
        return (f"unit {f.unit_index} group {f.group_index}" if f.trainable
                else f"unit {f.unit_index} frozen")

    def _gather(self, unit_ids: List[int], wait: bool = True, exact: bool = False) -> None:
        """exact: between steps (gather_all) the params come whole and exact, also with qwZ
        ([Note: qwZ keeps the own piece exact] in comm/quantized.py)."""
        launched = set()
        for ui in unit_ids:  # launch every all-gather first, then wait: they overlap
            for f in self._bufs(ui):
                if exact and f.quantized:  # (quantized: gathered or in flight)
                    self._drop(f)  # held from a forward with quantized pieces: re-gather
                if not f.gathered and f.handle is None:
                    launched.add(id(f))  # hpZ: from the node's secondary while valid
                    route = None if self.hpz is None else self.hpz.route(f)
                    comm, src = route if route is not None else (self.comm.shard, None)
                    # qwZ: the primary gathers of forward and backward (the secondary's
                    # node gather rebuilds the forward's values as they are)
                    q = self.comm.gather_quantized_ if (self.comm.qwz and not exact
                                                        and route is None) else None
                    try:
                        f.start_gather(comm, self._label(f), src, q)
                    except Exception as e:  # a param file read on this rank (comm/abort.py)
                        self.comm.signal_failure(e)
                        raise
                    self.live_bytes += f.full_bytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        if wait:
            for ui in unit_ids:
                for f in self._bufs(ui):
                    self.prefetch_hits += f.handle is not None and id(f) not in launched
                    f.finish_gather()

    def _free(self, ui: int) -> None:
        for f in self._bufs(ui):
            if f.gathered or f.handle is not None:
                if self.hpz is not None and not self.in_backward:  # [Note: hpZ secondary]
                    self.hpz.keep(f)
                self._drop(f)

    def _drop(self, f: ShardedFlat) -> None:
        f.free()
        self.live_bytes -= f.full_bytes

    def _free_unreferenced(self, keep=()) -> None:
        for u in self.active_units:
            if self._refs[u.index] == 0 and u.index not in keep:
                self._free(u.index)

    def _reach(self, sched: List[int], cur: int, pos: int, free_skipped: bool = True) -> None:
        """Gather sched[cur:pos + 1] in order (rule 1). The ones before pos were skipped by
        this rank so far: with free_skipped, free them once their gather landed (unless
        referenced); else keep them for a backward still to come."""
        for ui in sched[cur:pos + 1]:
            self._gather(self._need(self.units[ui]), wait=False)
        for ui in sched[cur:pos]:
            self._gather(self._need(self.units[ui]))
            if free_skipped:
                self._release(ui)

    def _release(self, ui: int) -> None:
        """Free unit ui and its deps if nothing references them (deps of other units are held
        until the end of backward: whether they are gathered must not depend on the data)."""
        keep = self.kept_units if self._fwd_grad and not self.in_backward else ()
        for uj in self._need(self.units[ui]):
            if self._refs[uj] == 0 and uj not in self._held_deps and uj not in keep:
                self._free(uj)

    # ---- forward -----------------------------------------------------------------------------
    def _prefetch_ahead(self) -> List[int]:
        """The next unit of the schedule; once the rest of it is kept units, in a grad-enabled
        forward, all of it ([Note: kept units]; a unit kept only as another's dep does not
        count; not with param offload, whose gathers read)."""
        if self._prefetch_numel is not None:  # DeepSpeed's bucket (use_schedule)
            budget = self._prefetch_numel if not param_offload.has_homes(self) else \
                min(self._prefetch_numel, 1)
            return prefetch_units(self.schedule, self._fcur, self._numel,
                                  self._in_flight_or_gathered, budget)
        if not self._fwd_grad or self._fcur < self._kept_from or param_offload.has_homes(self):
            return [self.schedule[self._fcur]]
        return self.schedule[self._fcur:]

    def _unit_index(self, module):
        """module's unit, or None for a module of a copy of the model: it shares the model's
        hooks and holds its own full params (guards.py [Note: a copy of a stage-3 model])."""
        ui = self._unit_of.get(id(module))
        if ui is None and any(id(p) in self.guard.where for p in module.parameters()):
            raise RuntimeError(f"zerokern stage 3: a {type(module).__name__} holding sharded "
                               "params is not one of the model's units (changed after "
                               "ZeroAdamW wrapped the model?)")
        return ui

    def _pre_forward_hook(self, module, args, kwargs):
        ui = self._unit_index(module)
        if ui is not None:
            self._pre_forward(self.units[ui], args, kwargs)

    def _post_forward_hook(self, module, args, out):
        ui = self._unit_index(module)
        if ui is not None:
            self._post_forward(self.units[ui], out)

    def _pre_forward(self, u: Unit, args=(), kwargs=None) -> None:
        if self.in_backward:  # checkpoint recompute: gathered by the output hook, or here
            self._bwd_reach(u)
            self._gather(self._need(u))
            return
        if u.is_root or not self._refs[0]:  # a forward starts (param offload's read-ahead)
            param_offload.new_pass(self)
            self._hpz_invalidate()
        if u.is_root:
            self.finish_aborted_forward()
            self.guard.check_forward()
            self._recording, self._fcur = [], 0
            self._fwd_grad = torch.is_grad_enabled()
        else:
            self._recording.append(u.index)
        need = self._need(u)
        for ui in need:
            self._refs[ui] += 1
        self._fwd_open.append(u.index)
        pos = self._fpos.get(u.index, -1)
        if pos >= self._fcur:
            self._reach(self.schedule, self._fcur, pos)
            self._fcur = pos + 1
        self._gather(need)
        if self._fcur < len(self.schedule):  # prefetch the next unit of the schedule
            for ui in self._prefetch_ahead():
                self._gather(self._need(self.units[ui]), wait=False)
            param_offload.read_ahead(self, self.schedule, self._fcur + 1)  # (nvme: its read)
        if torch.is_grad_enabled() and not u.is_root:  # rule 3: post-backward on the inputs
            ins = [t for t in _tensors((args, kwargs or {}), []) if t.requires_grad]
            if ins:
                self._calls[u.index] += 1
                self._fwd_calls.append(u.index)
                left = [len(ins)]
                # [Note: a leaf input] A leaf's hook runs in its AccumulateGrad, which has the
                # params' priority: it may run before the AccumulateGrad of a param whose grad
                # the same node computed (a LayerNorm on a pipeline stage's input, a leaf
                # torch's stage makes), so it does not say that the unit's backward is over
                # then. Such a call's signal is applied at the end of its backward instead
                # (_deferred): in that backward the unit is done by its grads or the flush,
                # and a later backward (micro-batches) sees the call over.
                leaf = any(t.grad_fn is None for t in ins)
                hook = weak_hook(self, "_input_grad")
                for t in ins:
                    t.register_hook(lambda g, u=u, left=left, leaf=leaf: hook(u, left, leaf))
            else:  # no signal from this call: the unit is done by its grads or the flush
                self._unsignalled.add(u.index)

    def _post_forward(self, u: Unit, out) -> None:
        if self.in_backward:
            return
        # [Note: the root stays gathered for backward] With grad enabled the root's backward
        # comes first and needs it again at once; keeping it costs no peak memory (the root
        # is gathered through every forward and backward anyway) and saves its re-gather,
        # as FSDP2 does. Freed by the end of backward, or by step()/an eval forward.
        # The last unit of the schedule is kept too (torchtitan sets FSDP2's
        # reshard_after_forward=False on the last block for the same reason): its backward
        # follows the root's at once, so the backward would re-gather it while the root's
        # head runs. Peak: root + last unit at the end of forward, root + last + the
        # prefetched one at the start of backward, both within live_bound(). It saves one
        # unit's all-gather per step (the 20m GPT: 1 of 6 blocks' backward re-gathers).
        # Every rank keeps it, whether it called the unit or reached it as skipped (below),
        # so whether backward gathers it does not depend on the data (rule 1).
        # (the root's grad mode decides, not this call's: the same on every rank)
        # Under DeepSpeed's stage-3 keys (use_schedule) the kept units are theirs, and may
        # leave out the root and the last unit ([Note: DeepSpeed's stage-3 keys]).
        keep = set(self.kept_units) if self._fwd_grad else set()
        self._fwd_open.remove(u.index)
        for ui in self._need(u):
            self._refs[ui] -= 1
            if self._refs[ui] == 0 and ui not in keep:
                self._free(ui)
        if torch.is_grad_enabled():
            # [Note: the cursor hook runs last on its tensor] The backward cursor moves in a
            # pre-hook of the output's grad_fn, not a hook on the output tensor: the engine
            # runs a node's tensor hooks first, and the next unit's input-grad hooks (rule 3)
            # sit on this very tensor. As a tensor hook (registered first, so run first) the
            # cursor moved before the next unit knew its backward was over, so the window that
            # move closed found it not over: late (rule 4). Measured on test_stage3_users'
            # DynLM at N=2 over 4 steps: 6 late units before, 0 after.
            hook = weak_hook(self, "_pre_backward")
            seen = set()
            for t in _tensors(out, []):
                if not t.requires_grad:
                    continue
                fn = t.grad_fn
                if fn is None:  # a leaf returned as is: its own hook
                    t.register_hook(lambda grad, u=u: hook(u))
                elif id(fn) not in seen:
                    seen.add(id(fn))
                    fn.register_prehook(lambda grads, u=u: hook(u))
        if u.is_root:
            self._fwd_calls = []  # (the forward ended: its calls' backward is to come)
            self.fwd_order = self._recording
            if self._fcur < len(self.schedule):  # units this rank skipped at the end
                self._reach(self.schedule, self._fcur, len(self.schedule) - 1)
                if not keep:
                    self._release(self.schedule[-1])
                self._fcur = len(self.schedule)
            self._free_unreferenced(keep)  # prefetches the forward did not use

    def finish_aborted_forward(self) -> None:
        """[Note: a forward that raised] A forward that raised (an error in the model, out of
        memory) never ran the post-forward hooks of the units it was in: their reference
        counts stayed up, so those units stayed gathered through the next step() and the
        next forward used their params as they were before that step, silently (measured:
        a caught forward error at stage 3 trained to other params, 1 and 2 ranks). Called
        where a new forward begins, at zero_grad() and at step(): undo what that forward
        counted (its references, and its calls whose backward will never come) and free what
        nothing references. No collective: its gathers landed or are dropped as prefetches.
        A forward that is running (a unit's own forward hook) is never cut short: every
        caller runs outside a forward.
        With several ranks this rank raises instead (posted first, so the others raise
        RankAborted within a poll, comm/abort.py): a rank whose forward went on issued the
        gathers of the units after the failure, and this rank's next forward would pair its
        first gathers with those, units of the same size exchanging each other's params
        without a mismatch to see."""
        if not self._fwd_open:
            return
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            error = RuntimeError(
                "zerokern stage 3: a forward raised before it finished (an error in the model "
                "or a hook, or out of memory), after it had gathered some units' params with "
                "the other ranks; the ranks' gathers are out of step, so this process group "
                "cannot go on: restart from the last checkpoint (`zerokern train` and "
                "`torchrun --max-restarts` restart the ranks)")
            self.comm.signal_failure(error)
            raise error
        open_units, self._fwd_open = self._fwd_open, []
        for ui in open_units:
            for uj in self._need(self.units[ui]):
                self._refs[uj] -= 1
        for ui in self._fwd_calls:
            self._calls[ui] = max(0, self._calls[ui] - 1)
        self._fwd_calls = []
        self._free_unreferenced()

    # ---- backward: re-gather units as backward reaches them, reduce-scatter their grads ----
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

    def _input_grad(self, u: Unit, left: list, leaf: bool = False) -> None:
        left[0] -= 1
        if left[0] == 0 and leaf:  # [Note: a leaf input]: at the end of this backward
            self._deferred.append(u)
        elif left[0] == 0:
            self._call_over(u)

    def _call_over(self, u: Unit) -> None:
        if self._calls[u.index] > 0:  # (0: a call forgotten by a synced end)
            # this call's backward is over; the unit's when all calls' are
            # [Note: graphs alive across backwards] Several forwards' graphs can be alive at
            # once (a pipeline schedule: micro-batch 1's forward before micro-batch 0's
            # backward, all but the last backward under no_sync()). The counts of calls whose
            # backward is to come are kept across backwards under no_sync() (a call counted
            # there may belong to a later backward) and dropped at the end of a synced one
            # (it ends the accumulation: a call not backwarded by then never will be). So in
            # the synced backward a unit is over when its last micro-batch's call is, not
            # when the first one's is (which once left a count of -1 there, or a unit passed
            # as unused, at 0, before its backward ran).
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
        return huge_pages.zeros(L.padded_numel, self.reduce_dtype, self.groups[fi].device,
                                reuse=True)

    def _no_pieces(self, fi: int) -> Pieces:
        """Unit buffer fi's elements as Pieces with none put yet (all zeros)."""
        return Pieces(self.groups[fi].layout.padded_numel, self.reduce_dtype,
                      self.groups[fi].device)

    def _acquire(self, fi: int):
        """Unit buffer fi's staging: where the reduce-scatter reads Pieces ([Note: grads read
        where they lie] in comm/pieces.py), Pieces that hold its grads by reference (or, after
        backward passes under no_sync(), the local accumulator, which the grads are added into
        in place): the unit's grads live until its reduce-scatter lands, as its staging buffer
        would; else a pooled buffer."""
        if fi not in self._staging:
            if getattr(self.rs_comm, "reads_pieces", False):
                ref = self._no_pieces(fi)
                local = None if self._local is None else self._local[fi]
                if local is not None:
                    ref.put(0, local, watch=False)  # ours, added into in place
                self._staging[fi] = ref
                return ref
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
        else:
            local = None if self._local is None else self._local[gi]
            staging, sl = self._acquire(gi), slice(s.offset, s.offset + s.numel)
            if isinstance(staging, Pieces):
                if local is None:
                    staging.put(s.offset, grad)
                else:  # the Pieces read local: local + grad, the bits of grad + local
                    local[sl].add_(grad)
            elif local is None:
                staging[sl].copy_(grad)
            else:
                torch.add(grad, local[sl], out=staging[sl])
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
                                               self.groups[fi].device, reuse=True)
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
            local = None if self._local is None else self._local[fi]
            staging = self._acquire(fi)
            if self._pending[ui] > 0 and not isinstance(staging, Pieces):
                # params without a grad count as zero (Pieces read them as zeros, or as the
                # local accumulator they read)
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
            if getattr(self.rs_comm, "reads_pieces", False):  # Pieces with none: all zeros,
                # no buffer ([Note: grads read where they lie] in comm/pieces.py)
                buf = self._no_pieces(fi)
            else:
                buf = self._pooled(fi).zero_()
            self._staging[key] = buf
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

    def _recycle(self, staging) -> None:
        if not isinstance(staging, Pieces):  # (Pieces: dropped, and their grads with them)
            self._pool[staging.numel()].append(staging)

    def end_backward(self) -> None:
        deferred, self._deferred = self._deferred, []
        for u in deferred:  # [Note: a leaf input] (every AccumulateGrad has run by now)
            self._call_over(u)
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
        if self.sync:  # [Note: graphs alive across backwards]
            self._calls.clear()
            self._unsignalled.clear()
        self._reset_backward()
        self._raise_if_changed_in_place()
        self._hpz_invalidate()  # (after the frees above, which keep secondaries)

    def forget_calls(self) -> None:
        """Forget the grad-enabled calls whose backward is still to come: their graphs were
        dropped (torch's pipeline shape inference runs a forward with grad and, on a first
        stage, no backward). Kept, one would hold the unit's count above zero through the
        next synced backward, which then reduces the unit late if a param of it is unused
        ([Note: graphs alive across backwards]). Between backwards; no collective."""
        self._calls.clear()
        self._unsignalled.clear()
        self._deferred = []

    # ---- between steps: every unit whole (gathered_params, checkpoints, generate) ----------
    def gather_all(self) -> None:
        self.guard.check_writes("gathered_params()")  # [Note: a write to a sharded param]
        param_offload.new_pass(self)
        self._hpz_invalidate()
        for u in self.active_units:
            self._refs[u.index] += 1
        self._gather([u.index for u in self.active_units], exact=True)

    def _writes_agree(self, write_back: bool) -> None:
        """[Note: a write on some ranks only] gathered_params(modify=True) takes each rank's own
        piece of the gathered params back into its shard (sharded_flat.write_back_). A change
        made on some ranks only (`if rank == 0: nn.init.normal_(w)`, DeepSpeed's
        GatheredParameters(modifier_rank=0) habit, which broadcasts rank 0's values) or to
        different values on different ranks (an init with per-rank seeds) would leave a model
        that is a mix of the ranks' values, silently. So at the block's end the ranks agree
        which units any of them wrote ([Note: a write to a sharded param]: the version
        counters) and compare those units' gathered values by fingerprint (comm/fingerprint.py):
        two host all-reduces over the data-parallel world, and one pass over the written units.
        If they differ, every rank raises and nothing is taken back. A load_state_dict inside
        the block writes each rank's piece into its shard at once, with or without modify, so
        it counts as a write here in both."""
        world = self.comm.world
        if world.world_size <= 1:
            return
        bufs = list(self.groups) + self.frozen

        def agree_max(t):
            world.agree_(t, dist.ReduceOp.MAX, "gathered_params writes")

        wrote = torch.tensor([1 if f.loaded_while_gathered or (write_back and f.unseen_writes())
                              else 0 for f in bufs], dtype=torch.int64)
        agree_max(wrote)
        cand = [i for i, w in enumerate(wrote.tolist()) if w]
        if not cand:
            return
        # the params' values, not the whole buffer: its padding is not written by every
        # gather (an FP8 unit decodes its params' spans only) and may differ across ranks
        params = [p for i in cand for p in bufs[i].params]
        views = [v for i in cand for v in bufs[i].views]
        differ = differ_across_ranks([fingerprint(v) for v in views], agree_max)
        if differ:
            name = self.guard.param_name(params[differ[0]])
            block = f"gathered_params(modify={write_back})"
            raise RuntimeError(
                f"zerokern stage 3 ({block}): params of a unit (first "
                f"'{name}') were changed inside the block on some ranks only, or to different "
                f"values on different ranks (of {world.world_size}); each rank takes back only "
                "its own piece, so the model would be a mix of the ranks' values. Make the same "
                "change on every rank (an init: seed it alike; or load one state dict with "
                "model.load_state_dict on every rank); nothing was taken back")

    def see_param_writes(self) -> None:
        for f in list(self.groups) + self.frozen:
            f.see_writes()

    def release_all(self, write_back: bool, check: bool = False) -> None:
        """The end of gathered_params() (check=True, collective then) and of the internal
        gathers (check=False): raise where the params were changed inside on some ranks only
        (before anything is taken back: [Note: a write on some ranks only]), or written
        without write_back (after the release: [Note: a write to a sharded param])."""
        if check:
            try:
                self._writes_agree(write_back)
            except RuntimeError:
                for f in list(self.groups) + self.frozen:
                    f.pending_loads = []  # nothing is taken back
                self.release_all(write_back=False)
                raise
        written = [f.params[w[0]] for f in list(self.groups) + self.frozen
                   for w in [f.unseen_writes()] if w] if check and not write_back else []
        for u in self.active_units:
            self._refs[u.index] -= 1
        if write_back:
            for f in list(self.groups) + self.frozen:
                f.apply_pending_loads()  # (exact fp32 masters of a load; a later write wins)
                f.write_back_()
        self._free_unreferenced()
        if written:  # [Note: a write to a sharded param]
            self.guard.raise_write("gathered_params()", written[0], inside_block=True)

    @contextmanager
    def frozen_whole(self, write_back: bool = False):
        """Between steps: the frozen params whole inside the block (collective), e.g. for a
        checkpoint's extras; write_back: keep changes made inside (on a normal exit only)."""
        param_offload.new_pass(self)
        self._hpz_invalidate()
        for f in self.frozen:
            if f.quantized:  # left from a forward with qwZ pieces: exact here
                self._drop(f)
            f.start_gather(self.comm.shard, self._label(f))
        for f in self.frozen:
            f.finish_gather()
        ok = False
        try:
            yield
            ok = True
        finally:
            for f in self.frozen:
                if ok and write_back:
                    f.write_back_()
                f.free()

    @property
    def all_gathered(self) -> bool:
        return all(f.gathered for f in list(self.groups) + self.frozen)

    # ---- step / zero_grad / reports ----------------------------------------------------------
    def reduced_buckets(self):
        self.guard.check_step()
        self._free_unreferenced()  # a root kept by a forward that had no backward
        if self._local is not None and any(t is not None for t in self._local):
            # Backward passes under no_sync() only: reduce their accumulators now, in the
            # static order (every rank holds one per buffer, zeros where no grad came).
            for ui in self._rs_order:
                for fi in self.unit_flats[ui]:
                    buf = self._local_buf(fi)
                    self._staging[fi] = buf
                    while len(self._in_flight) >= MAX_IN_FLIGHT:
                        self._complete_oldest()
                    self._reduce_async(fi, buf, self.grad_shards[fi])
            self._drain()
            self._local = None
        self.comm.check_collectives("step()")  # ZEROKERN_DEBUG_COLLECTIVES=1 only
        for fi in range(len(self.groups)):
            yield fi, 0

    def check_collectives(self) -> None:
        """Checked in reduce(), after the flush of what ran under no_sync()."""

    def held(self):
        local = [t for t in (self._local or []) if t is not None]  # no_sync() accumulators
        return {"grads": self.held_grads(),
                "buckets": [b for bufs in self._pool.values() for b in bufs]
                + [t for b in self._staging.values() for t in held_tensors(b)] + local,
                "hpz": [] if self.hpz is None else self.hpz.held()}

    def clear_all(self) -> None:
        super().clear_all()
        self._local = None

    def clear_some(self, params) -> None:
        super().clear_some(params)
        for gi, i in params:
            if self._local is not None and self._local[gi] is not None:
                s = self.groups[gi].layout.slots[i]
                self._local[gi][s.offset:s.offset + s.numel].zero_()

    def _hpz_invalidate(self) -> None:
        if self.hpz is not None:  # the params may change from here ([Note: hpZ secondary])
            self.hpz.invalidate()

    def live_bound(self) -> int:
        """Bytes of full params that can be gathered at once: the root and its dependencies,
        plus two other units with theirs (the running one and the prefetched one), or the
        kept units ([Note: kept units]) and one unit prefetched beside them."""
        def unit_bytes(ui: int) -> int:
            return sum(f.full_bytes for f in self._bufs(ui))

        others = [self._need(u) for u in self.active_units if not u.is_root]
        bound = live_units_bound(self._need(self.units[0]), others, self.kept_units, unit_bytes,
                                 sorted(self._held_deps))
        if self._prefetch_numel is None:
            return bound
        # DeepSpeed's prefetch bucket (use_schedule): up to `ahead` units launched beyond the
        # running one, on top (a loose bound: they may be kept units counted above already)
        ahead = max((len(prefetch_units(self.schedule, j, self._numel, lambda ui: False,
                                        self._prefetch_numel))
                     for j in range(len(self.schedule))), default=0)
        sizes = sorted((sum(unit_bytes(uj) for uj in n) for n in others), reverse=True)
        return bound + sum(sizes[:ahead + 1])

    def detach(self) -> None:
        super().detach()
        self.gather_all()  # the params are left whole (views of full buffers) for the new owner
