"""Gradient paths per stage: where grads accumulate and when they are reduced (DESIGN §2).

Semantics are torch's and DDP's at every stage: gradients SUM over the backward passes since
`zero_grad()` (also across a `step()` without `zero_grad()`) and are AVERAGED over ranks.
Backward passes inside `opt.no_sync()` accumulate locally with no communication, as DDP's.

This module is the base every stage shares (hooks, the backward bookkeeping, what p.grad shows,
the fixed launch order); the stages are:
- FullGrads (stages 0 and 1, full_grads.py): a full grad buffer that p.grad views, each bucket
  reduced during backward (stage 0 all-reduce: p.grad is DDP's gradient; stage 1
  reduce-scatter into a shard).
- BucketedGrads (stage 2, sharded_grads.py): each grad held by reference in its bucket (where
  the shared-memory exchange reads it in place: comm/pieces.py [Note: grads read where they
  lie]) or copied into its bucket's staging buffer, a full bucket reduce-scattered at once into
  this rank's grad shard; p.grad released.
- Stage3Runtime (stage 3, stage3/runtime.py): the same shard accumulation (ShardedGrads), per
  unit, inside the runtime that gathers, frees and prefetches the units' params.

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

import enum
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.autograd import Variable

from zerokern.comm import Comm
from zerokern.geometry.dtensor_params import is_dtensor, like_param, local
from zerokern.grads.released_grad import ReleasedGrad
from zerokern.grads.weak_hook import weak_hook
from zerokern.layout.flat_group import FlatGroup

# At most this many stage-2 reduce-scatters in flight before the oldest is waited for: two
# overlap communication with the next bucket's backward; more only hold staging memory.
MAX_IN_FLIGHT = 2


def launch_order(groups) -> List[Tuple[int, int]]:
    """(group, bucket) in the fixed launch order of [Note: collective order]."""
    key = [(g.layout.bucket_range(k)[0] / max(g.layout.numel, 1), gi, k)
           for gi, g in enumerate(groups) for k in range(g.layout.n_buckets)]
    return [(gi, k) for _, gi, k in sorted(key, reverse=True)]


class TrainingState(enum.Enum):
    """[Note: one lifecycle state] Where the model's pass is, in one value (FSDP2 keeps its
    `TrainingState` the same way), instead of a flag per question:
    - IDLE: between backward passes (a forward, the step, zero_grad);
    - PRE_BACKWARD: a backward began (its first hook ran: the scaled loss's, or a param's
      gradient) and its end is queued; stage 3 has not reached a unit yet;
    - BACKWARD: stage 3's backward cursor reached a unit (stage3/runtime.py): params are
      gathered for backward, and a forward now is an activation checkpoint's recompute.
    The backward's end callback returns it to IDLE."""

    IDLE = "idle"
    PRE_BACKWARD = "pre_backward"
    BACKWARD = "backward"


def _released(grad: Optional[torch.Tensor]) -> bool:
    """Whether p.grad is our placeholder for a gradient held only reduced and sharded."""
    return grad is not None and isinstance(local(grad) if is_dtensor(grad) else grad,
                                           ReleasedGrad)


class GradSync:
    """Base: hooks, backward bookkeeping and the p.grad state shared by all stages."""

    stage = -1

    def __init__(self, groups: List[FlatGroup], comm: Comm, reduce_dtype: torch.dtype) -> None:
        self.groups = groups
        self.comm = comm
        self.reduce_dtype = reduce_dtype
        self.micro_steps = 0          # backward passes since zero_grad (host int, no sync)
        self.generation = 0           # bumped by every backward and zero_grad (stale stats)
        self.sync = True              # False inside no_sync(): accumulate locally
        self.require_scaled = False   # set by the optimizer: fp16 needs opt.backward(loss)
        self.unscaled_backward = False  # a backward since zero_grad skipped the loss scale
        # the model's watchers (core/model_sync.py ModelWatch, core/frozen_slots.py
        # UnfreezeWatch): `check(where)` at the start of every backward, so what the user did
        # to the params is followed before any gradient lands; the hook calls them, never the
        # optimizer
        self.watchers: tuple = ()
        self.detached = False         # another ZeroAdamW took these params over
        self.free_on_zero = False     # zero_grad(set_to_none=True) frees the grad memory
        self.state = TrainingState.IDLE  # [Note: one lifecycle state]
        self._got: List[List[bool]] = [[False] * len(g.params) for g in groups]  # this backward
        self._exposed: List[List[Optional[torch.Tensor]]] = [[None] * len(g.params)
                                                             for g in groups]
        self._versions: List[List[Optional[int]]] = [[None] * len(g.params) for g in groups]
        self._hooks = []
        # (group, index, param, our post-accumulate hook's id): [Note: the user's
        # post-accumulate hooks run first]
        self._last_hooks: List[Tuple[int, int, torch.Tensor, int]] = []
        # [Note: weak, eager hooks] (weak_hook.py)
        begin, on_grad = weak_hook(self, "begin_from_hook"), weak_hook(self, "_on_grad")
        ref = weakref.ref(self)
        for gi, g in enumerate(groups):
            for i, p in enumerate(g.params):
                p._zerokern_sync = ref  # marks the param as owned (see ZeroAdamW's check)
                self._hooks.append(p.register_hook(lambda grad: begin(False)))
                h = p.register_post_accumulate_grad_hook(lambda p, gi=gi, i=i: on_grad(gi, i, p))
                self._hooks.append(h)
                self._last_hooks.append((gi, i, p, h.id))

    # ---- backward bookkeeping ---------------------------------------------------------------
    def mark_scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Hook the scaled loss: its grad is the first thing a backward computes."""
        if loss.requires_grad:
            begin = weak_hook(self, "begin_from_hook")
            loss.register_hook(lambda g: begin(True))
        return loss

    def begin_from_hook(self, scaled: bool) -> None:
        if self.state is TrainingState.IDLE and not self.detached:
            self._begin_backward(scaled)

    def _begin_backward(self, scaled: bool = False, in_post_hook: bool = False) -> None:
        """First hook of a backward: queue its end, follow the user's p.grad changes."""
        if self.state is not TrainingState.IDLE:
            return
        for w in self.watchers:
            w.check("backward")
        if not in_post_hook:  # (torch is iterating a param's post hooks: leave them be)
            self._run_after_user_hooks()
        if self.require_scaled and not scaled:
            self.unscaled_backward = True
        self.state = TrainingState.PRE_BACKWARD
        Variable._execution_engine.queue_callback(self._end_backward)
        self.generation += 1
        try:
            self._adopt_user_grads()
        except RuntimeError as e:  # a p.grad assigned on this rank only, maybe (comm/abort.py)
            self.comm.signal_failure(e)
            raise
        self._got = [[False] * len(g.params) for g in self.groups]
        self.begin_backward()

    def _run_after_user_hooks(self) -> None:
        """[Note: the user's post-accumulate hooks run first]
        A hook the user registers with p.register_post_accumulate_grad_hook after the wrap
        would run after ours, which takes the gradient (stages 2-3: p.grad is None after it),
        divides it (stage 0) and may launch its bucket's reduction: a hook that scaled the
        gradient changed one already reduced, racing the collective or, at stage 1, in a
        consumed buffer (a wrong step without a word, test_user_semantics); one that read it
        read the reduced or divided one. DDP reduces from a hook on the AccumulateGrad node,
        which runs after all of them, so they see and change this rank's gradient (the sum
        since zero_grad under no_sync()). Here our hook is moved to the end of each param's
        hooks at the start of every backward, before any gradient lands: torch runs them in
        the dict's insertion order, so it is popped and put back (OrderedDict.move_to_end
        leaves the dict's own order as it was). Only params with another hook are touched; the
        walk over the params costs 66 us per backward for 1000 params (the 2-core VM).

        A gradient held only reduced and sharded (p.grad a ReleasedGrad: stages 2-3, and stage
        1 after a backward outside no_sync()) is no full gradient: a backward that adds to it
        (accumulation) would show the hook this backward's gradient only, where torch and DDP
        show the sum, and a hook that scales it would act on another number (stage 1, N = 1,
        two backward passes: 1e-2 off). That is refused here, on this rank before anything
        lands (the peers raise in their next collective: comm/abort.py)."""
        held = []
        for gi, i, p, hid in self._last_hooks:
            hooks = p._post_accumulate_grad_hooks
            if len(hooks) > 1 and hid in hooks:
                if _released(p.grad):
                    held.append((gi, i))
                if next(reversed(hooks)) != hid:
                    hooks[hid] = hooks.pop(hid)
        if held:
            gi, i = held[0]
            error = RuntimeError(
                f"zerokern stage {self.stage}: param {i} of param group {gi} has a hook from "
                "p.register_post_accumulate_grad_hook, and this backward adds to its gradient "
                "held since zero_grad() (accumulation), which exists only reduced and sharded "
                "(stages 2-3, and stage 1 after a backward outside no_sync()): the hook would "
                "see this backward's gradient only, where torch and DDP show the sum "
                f"({len(held)} such param(s)). Use one backward per step (opt.zero_grad() "
                "after each step), accumulate under opt.no_sync() at stage 0 or 1, or use "
                "p.register_hook (it sees each backward's gradient, the same at every stage "
                "and under DDP)")
            self.comm.signal_failure(error)
            raise error

    def _end_backward(self) -> None:
        self.end_backward()
        self.state = TrainingState.IDLE
        self.micro_steps += 1
        self._expose()

    def _on_grad(self, gi: int, i: int, p: torch.Tensor) -> None:
        if self.detached:  # another ZeroAdamW took the params over
            return
        if p.grad is not None and p.grad.layout != torch.strided:
            raise TypeError(f"zerokern: param {i} of param group {gi} got a {p.grad.layout} "
                            "gradient; sparse gradients are not supported (use dense "
                            "embeddings, e.g. nn.Embedding(sparse=False))")
        if is_dtensor(p) and p.grad is not None and (
                not is_dtensor(p.grad) or tuple(p.grad.placements) != tuple(p.placements)):
            # [Note: a DTensor param is its local tensor]: a Partial() grad is summed over tp
            # here, so the local tensor every stage reads is this rank's part of the gradient
            if not is_dtensor(p.grad):
                raise TypeError(f"zerokern: param {i} of param group {gi} is a DTensor but got "
                                "a plain-tensor gradient")
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        self._begin_backward(in_post_hook=True)
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
        self._clear_user_cleared(cleared)

    def _clear_user_cleared(self, cleared: List[Tuple[int, int]]) -> None:
        """The user set these p.grad to None: clear what we accumulated for them."""
        if cleared:
            if len(cleared) == sum(e is not None for row in self._exposed for e in row):
                self.clear_all()  # model.zero_grad(): every grad we showed was cleared
            else:
                self.clear_some(cleared)
            for gi, i in cleared:
                self._exposed[gi][i] = None

    def check_unchanged_since_backward(self) -> None:
        """Before a step: raise if the user cleared or replaced a p.grad since the last
        backward (or zero_grad). torch would step with the change (or skip a cleared param);
        here the gradients were reduced during backward, so the step would silently ignore
        it. In-place edits of a p.grad we showed are not changes (stage 0: it views the
        reduced buffer)."""
        changed = [(gi, i, "cleared" if p.grad is None else "replaced")
                   for gi, g in enumerate(self.groups) for i, p in enumerate(g.params)
                   if p.grad is not self._exposed[gi][i]]
        if changed:
            gi, i, how = changed[0]
            raise RuntimeError(
                f"ZeroAdamW: p.grad of param {i} in param group {gi} was {how} after the last "
                f"backward ({len(changed)} param(s) in all). The gradients were already "
                "reduced during backward (at stages 1-3 each rank holds only its shard), so "
                "the step would ignore the change. Set or clear p.grad before backward (it "
                "then sums as in torch), scale the loss, or clip with opt.clip_grad_norm_; "
                "opt.zero_grad() starts over")

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
        self.see_grad_edits()

    def see_grad_edits(self) -> None:
        """[Note: an edit of a loss-scaled p.grad] The exposed grads' version counters now (a
        view shares its buffer's), so that `edited_grad` finds the user's in-place changes
        since: after each backward, and after the step's own preparation."""
        self._versions = [[None if t is None else t._version for t in row]
                          for row in self._exposed]

    def edited_grad(self) -> Optional[Tuple[int, int]]:
        """(group, index) of an exposed p.grad changed in place since `see_grad_edits`."""
        for gi, row in enumerate(self._exposed):
            for i, t in enumerate(row):
                if t is not None and t._version != self._versions[gi][i]:
                    return gi, i
        return None

    def detach(self) -> None:
        """Remove the hooks; the owning optimizer can no longer step (params were taken over)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._last_hooks = []
        self.detached = True

    def finish_aborted_backward(self, where: str) -> None:
        """[Note: a backward that raised] A backward that raised before its end (an error in
        the model or a hook, out of memory) never ran its queued end: the state is not IDLE,
        and buckets, stage 3's units and the staging of that backward are half done. Before,
        the next backward took it for the same one ("a parameter's gradient arrived twice ...
        reentrant checkpointing?"), or step() saw no backward, or stage 3's ranks issued
        different collectives. Called by zero_grad() and step():
        - one process (nothing is exchanged with a peer): the backward's end is run now, so its
          reductions finish locally, and zero_grad() then drops the partial gradients, as
          torch's optimizer lets a loop that caught the error go on; step() without that
          zero_grad() raises (its gradients would be partial);
        - several ranks: they may have stopped at different points of their exchanges, so no
          rank can finish its own alone; this rank raises, and posts the error first so the
          others raise too instead of waiting in a collective it will not join (comm/abort.py).
        """
        if torch._C._current_graph_task_id() != -1:
            return  # (called from inside a running backward, e.g. a hook: not an aborted one)
        self.finish_aborted_forward()
        if self.state is TrainingState.IDLE:
            return
        alone = not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1
        if alone and where == "zero_grad()":
            self._end_backward()  # (its reductions are local copies at world size 1)
            return
        if alone:
            why = ("its gradients are partial: call zero_grad() before the next backward "
                   "(and step()), as after any failed backward")
        else:
            why = ("the ranks may have stopped at different points of their gradient exchange, "
                   "so this process group cannot go on: restart from the last checkpoint "
                   "(`zerokern train` and `torchrun --max-restarts` restart the ranks)")
        error = RuntimeError(f"zerokern: {where} after a backward that raised before it "
                             f"finished (an error in the model or a hook, or out of memory): {why}")
        self.comm.signal_failure(error)
        raise error

    def see_param_writes(self) -> None:
        """Stage 3 ([Note: a write to a sharded param] in stage3/sharded_flat.py): a load
        replaced the params' values, so writes to them before it are not lost writes."""

    def finish_aborted_forward(self) -> None:
        """Stage 3 ([Note: a forward that raised] in stage3/runtime.py): what a forward that
        raised left gathered; other stages gather nothing in forward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.finish_aborted_backward("zero_grad()")
        self.micro_steps = 0
        self.generation += 1
        self.unscaled_backward = False
        self.clear_all()
        for gi, g in enumerate(self.groups):
            for i, p in enumerate(g.params):
                p.grad = None if set_to_none else self.zeroed_grad(gi, i)
                self._exposed[gi][i] = p.grad
        if set_to_none and self.free_on_zero:
            self.free()

    def readopt(self) -> None:
        """The params were re-viewed (model_sync.py): show our grads on them again.

        A move carries p.grad along (Module._apply moves it too), so a p.grad that is None
        now while we had shown one was cleared by the user before the move (`model.zero_grad()`
        then `model.to(...)`, what a second `ZeroAccelerator.prepare` does): that clear is
        taken first, or the next backward would add the old gradient (issue 21, item 3)."""
        self._clear_user_cleared([(gi, i) for gi, g in enumerate(self.groups)
                                  for i, p in enumerate(g.params)
                                  if p.grad is None and self._exposed[gi][i] is not None])
        self.renew_views()
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

    def renew_views(self) -> None:
        """After a move: grad views the user saw may have been re-pointed (see FullGrads)."""

    def free(self) -> None:
        """zero_grad(set_to_none=True) with free_grads: drop the grad buffers (p.grad is None
        everywhere); the next backward allocates them again."""

    def released(self, gi: int, i: int) -> ReleasedGrad:
        p = self.groups[gi].params[i]  # a DTensor param shows a DTensor of released grads
        return like_param(p, ReleasedGrad(local(p), self.stage))

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
    def reduced_buckets(self):
        """Called at step(): yields (group, bucket) as each bucket's reduced grads are ready in
        grad_piece(), so the caller can work on one while others are in flight. Stages 0-2
        normally reduced everything during backward and only wait here; what ran under
        no_sync() alone is reduced now (the name says what the caller gets, not that it
        reduces: at stages 2-3 it usually does not)."""
        for gi, g in enumerate(self.groups):
            for k in range(g.layout.n_buckets):
                yield gi, k
    def check_collectives(self) -> None:
        """ZEROKERN_DEBUG_COLLECTIVES=1: every rank issued the same collectives so far."""
        self.comm.check_collectives("step()")
    def grad_piece(self, gi: int, k: int) -> torch.Tensor: ...
    def stats_piece(self, gi: int, k: int) -> torch.Tensor:
        """The part of bucket k's reduced grads this rank's found_inf/sumsq read: its grad
        piece, or at stage 0 (every rank holds the whole average) 1/N of it (full_grads.py)."""
        return self.grad_piece(gi, k)
    def after_step(self) -> None:
        """Called after the update: drop per-step buffers."""
    def held(self) -> Dict[str, List[torch.Tensor]]:
        return {}


class Schedule:
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
