"""Params frozen or unfrozen after ZeroAdamW was built: trained as torch would, or refused.

[Note: a param frozen mid-training]
torch.optim.AdamW updates only params whose `p.grad` is not None. A param the user freezes
mid-training (`p.requires_grad_(False)`, `module.requires_grad_(False)`, peft's
`disable_adapter_layers()`) gets no gradient, so after `zero_grad()` its grad is None and torch
leaves it, its optimizer state and step count untouched. Our update runs over flat pieces
(bucket by bucket, several params per kernel call), so such a param would keep moving by
momentum and weight decay (issue 21, item 1: 1.5e-2 after 3 steps at betas 0.5/0.6). Here the
step saves the state of every such param (master, the rule's states and the param values in
this rank's state range) before the update and writes it back right after its bucket's update,
before the bucket is published (stages 1-2 all-gather it), so every rank's copy is the old one.
Cost: one copy of a frozen param's state per step, on the device, no host read.

Which params: `requires_grad` False *and* `p.grad` None at step(). Both are host state. The
rank-local "no gradient in this backward" (a param unused in one step while trainable) is not
a reason: that keeps the promise of tests/grads/test_unused_params.py (a missing gradient counts
as zero on that rank, the same on every stage and rank), while `requires_grad` is the same on
every rank of a data-parallel model (a param frozen on one rank only would make DDP itself
diverge). A frozen param with a grad left (`zero_grad(set_to_none=False)`, or frozen between
backward and step) is updated with it, as torch does.

Unfrozen again (peft's `enable_adapter_layers()`), it trains as torch's does: torch keeps one
step count per param, so the bias correction of a param that skipped L steps uses t - L, while
ours keeps one counter per bucket. So a param that skipped steps keeps its own lag (a device
counter: steps that really ran, an inf/NaN step skips nothing), and every step after, its
region is updated again from its saved state with step t - L (the kernel on copies; about the
cost of its own update, only for such params). The lag is not in optimizer checkpoints
(state_dict, zerokern.checkpoint): `state_dict()` refuses to save while a lag exists.
A frozen param with its state elsewhere (offload="cpu"/"nvme", master="compact"), where the
update does not run in place on the device: a clear error instead of a wrong step.

[Note: a param no rank used]
torch's AdamW also skips a trainable param whose grad is None, which is what
DistributedDataParallel(find_unused_parameters=True) leaves on every rank for a param no rank
used in the step (an MoE expert that got no tokens anywhere); a param some rank used gets DDP's
average, zeros counted for the others. Which params no rank used is known on the device only:
each rank sets one flag per param, 1 where it got a gradient since zero_grad() (`p.grad` not
None, host state), into the step's stats tensor (optimizer.py `_set_used_flags`: filled on the
device run by run, no host->device copy), and the agreement all-reduce that sums found_inf and
sumsq sums them too (at stage 0 with tp / an mpu, which have no such all-reduce over the dp
ranks, the flags alone are all-reduced). A flag summed to 0: no rank used the param.
The params that may be skipped are those without a gradient on this rank (host state; a param
no rank used is one of them on every rank). For them the step works as for a frozen param
above, with the restore selected on the device: saved before the update, and after it
`torch.where(unused, saved, updated)`. A rule that counts steps gives each such param a lag
(a device counter, + 1 on a step that really runs where the flag says unused), and the param
is from then on updated again from its saved state with step t - lag (bitwise the bucket's
update where the lag is 0), so when it is used again its bias correction is torch's. A lag is
kept for every param that once had no gradient on this rank (whether it lags is on the
device); `check_savable` reads them on the host at save time and refuses only a lag > 0.
Where the state is not updated in place on the device, see the next Note (offload) and
[Note: a param no rank used, compact]; per-block states (8-bit): [Note: a param no rank used,
8-bit].

[Note: a param no rank used, on the host]
offload="cpu"/"nvme": the update runs on the host, after the step's one blocking wait for its
[grad_scale, found_inf] (state/offload.py [Note: the one blocking wait]). The used flags travel
in the same pinned copy (`CopyPipeline._ship_scalars`), so once the host has waited it knows
which params no rank used, in host memory: `HostUnused.plan_` (once per step, at the first
piece) takes them and adds 1 to the host lag of each such param of a rule that counts steps on
a step that runs. Then, per chunk that the cpu kernel updates (in pinned memory or in an NVMe
pool set, before the set is written behind and before its params are copied to the device),
`HostUnused.update_`: the regions of params no rank used are saved before the kernel and
written back after it (master and states, a per-block state's whole blocks as in [Note: a
param no rank used, 8-bit]; the 16-bit param cast again from the restored master,
bitwise the value the device holds, as the kernel's cast-back is `.to(dtype)`), and a used
param whose lag is > 0 is updated again from its saved state with step t - lag. A phased rule's
passes (Muon: `map_piece_`) restore the regions of the states they name the same way (Muon
counts no steps). With offload_params the params' home is the host tensor the kernel writes
(or the NVMe staging), so the same restore covers it. The lags are host ints, checked by
`check_savable` with the device ones.

[Note: a param no rank used, compact]
master="compact" (bf16, state on the device): the step is the device path above, with the
master's region read and written as fp32 through its compact form (`_CompactRegion`: expand
the 8-aligned span around the region, since the tie bits are packed 8 to a byte; write back by
compacting the span and casting it into the bf16 params), so the master stays compact (it is
never expanded, which `master` would do) and the params, low halves and tie bits of a skipped
param are bit for bit what they were; `torch.where` with the device flag selects as above, no
host read. offload_params with offload=None is the device path too (the update's master and
param views are the fetched device shard, stored home after the skip's restore, since the
restore runs before the piece is published); with offload="cpu"/"nvme" the host path.

[Note: a param no rank used, 8-bit]
8-bit AdamW's moments are uint8 codes with one fp32 absmax per 128-element block. Packed back
to back, a block would be shared with the neighbouring params: a neighbour's update changes
the block's absmax, so a skipped param's codes could not stay as they were. Its buffers are
therefore laid out with block-aligned slots (partition.py [Note: block-aligned slots]): each
param starts at a multiple of 128, so every block belongs to one param (its elements, then
zeros of the gap after it). The skip is then the one above, on whole blocks: a skipped or
redone param's region is its elements and the gap after them up to the next block boundary
(`_region`, in a piece or a host chunk, both of which start on a block boundary), and the
states are cut for it per block (`_state_views`, `_cut`): its codes and absmax are saved and
written back bit for bit (with its master and 16-bit params), and a param that lags is updated
again on its own blocks alone with step t - lag, which is exactly the per-param blockwise
8-bit AdamW that torch-style skipping gives (tests/optimizer/test_unused_in_step_8bit.py: bit
for bit a per-param reference at N <= 2, every stage, offload "cpu"/"nvme", offload_params,
master="compact"). The gap elements hold zero grads, masters and moments, whose codes are the
zero code, so saving and restoring them changes nothing. A param frozen mid-training is still
refused with a per-block rule (`begin`).

[Note: a param frozen at construction]
Params frozen when ZeroAdamW was built are not in its buffers (DESIGN §2). torch's AdamW,
given the same params (the whole model, or a list that includes them), would start training
one the user unfreezes; we cannot add it to the flat buffers, so unfreezing it is refused with
an error naming it (at the next forward with the model given, backward or step), before
anything changes (issue 21, item 2). A param not given to ZeroAdamW at all is not ours, as it
is not torch's optimizer's: its grads accumulate in p.grad as torch's and nothing updates it.
"""

from __future__ import annotations

import functools
import weakref
from typing import Dict, List, Optional, Tuple

import torch


class GroupParamsWatch:
    """[Note: a group's params edited] torch's optimizers read `group["params"]` at every
    step, so fine-tuning code unfreezes a layer and appends its params to a group (or swaps one
    for another in the list). Our buffers were laid out at construction, and a group's list is
    its buffer's own (FlatGroup.params): an appended param was not trained, and the next
    backward or zero_grad() raised an IndexError from inside the grad bookkeeping; a param
    swapped in place was silently never trained. So each group's list is compared with the
    construction's by identity, at every backward (its first hook), zero_grad() and step():
    one pass over the params (~30 us per 1000), and any change is a clear error before
    anything changes. The groups are read from the optimizer each time (a load_state_dict may
    give it new group dicts, holding the same lists)."""

    def __init__(self, opt) -> None:
        self._opt = weakref.ref(opt)
        self.params = [tuple(g["params"]) for g in opt.param_groups]

    def check(self, where: str) -> None:
        opt = self._opt()
        if opt is None or getattr(getattr(opt, "grad_sync", None), "detached", False):
            return  # a newer optimizer took the params over: not ours to watch
        groups, ref = opt.param_groups, self.params
        cls = type(opt).__name__
        if len(groups) != len(ref):
            raise RuntimeError(
                f"zerokern ({where}): {cls}'s param_groups has {len(groups)} groups, "
                f"{len(ref)} when it was built. The flat buffers are laid out once: build a "
                "new optimizer over the groups you want (zerokern.checkpoint carries the "
                "state over)")
        for gi, (group, ps0) in enumerate(zip(groups, ref)):
            ps = group.get("params")
            if not isinstance(ps, (list, tuple)) or len(ps) != len(ps0) \
                    or any(a is not b for a, b in zip(ps, ps0)):
                n = len(ps) if isinstance(ps, (list, tuple)) else type(ps).__name__
                raise RuntimeError(
                    f"zerokern ({where}): the params of param group {gi} were changed after "
                    f"{cls} was built ({len(ps0)} params then, {n} now: a param appended, "
                    "removed or swapped in the list). The flat buffers are laid out once, so "
                    "an added param would not be trained (torch's AdamW would train it). Put "
                    "the list back, or build the optimizer after changing which params train "
                    "(zerokern.checkpoint carries the state over)")


class UnfreezeWatch:
    """Params frozen when ZeroAdamW was built (the model's, or those given): refused once they
    require grad ([Note: a param frozen at construction]), at the model's forward (a pre-hook
    that runs first: at stage 3 before any gather), backward and step()."""

    def __init__(self, opt, model: Optional[torch.nn.Module], param_groups) -> None:
        self._opt = weakref.ref(opt)  # a newer ZeroAdamW that took the params over: not ours
        params = model.parameters() if model is not None else \
            [p for g in param_groups for p in g["params"]]
        seen, self.frozen = set(), []
        for p in params:
            if isinstance(p, torch.Tensor) and not p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.frozen.append(weakref.ref(p))
        self._model = None if model is None else weakref.ref(model)
        self._hook = None
        if model is not None and self.frozen:
            self._hook = model.register_forward_pre_hook(
                functools.partial(_check_before_forward, weakref.ref(self)), prepend=True)

    def names(self) -> Dict[int, str]:
        model = None if self._model is None else self._model()
        if model is None:
            return {}
        return {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}

    def check(self, where: str) -> None:
        back = [p for p in (r() for r in self.frozen) if p is not None and p.requires_grad]
        if not back:
            return
        opt = self._opt()
        if opt is None or getattr(getattr(opt, "grad_sync", None), "detached", False):
            return  # replaced by an optimizer built after the unfreeze: its params now
        names = self.names()
        shown = [names.get(id(p), f"a param of shape {tuple(p.shape)}") for p in back]
        raise RuntimeError(
            f"zerokern ({where}): {shown[:5]} {'was' if len(back) == 1 else 'were'} frozen "
            "(requires_grad=False) when ZeroAdamW was built and now require grad. ZeroAdamW "
            "lays out the trainable params once (frozen ones hold no optimizer state), so it "
            "cannot start training them; torch's AdamW would. Set requires_grad as it will be "
            "for training before building ZeroAdamW (a param frozen at first and unfrozen "
            "later: build it trainable and freeze it after; it is then skipped as torch skips "
            "it), or build a new ZeroAdamW after unfreezing")


def _check_before_forward(ref, module, args) -> None:
    """The model's forward pre-hook (returns None: anything else would replace the input)."""
    watch = ref()
    if watch is not None:
        watch.check("forward")


class FrozenSkip:
    """Per step: the params to leave untouched, and those to update with their own step count
    ([Note: a param frozen mid-training])."""

    def __init__(self) -> None:
        self._lag: Dict[Tuple[int, int], torch.Tensor] = {}  # (group, slot) -> 0-d int64
        self._saved: Dict[Tuple[int, int], List[Tuple[torch.Tensor, torch.Tensor]]] = {}
        self._redo: Dict[Tuple[int, int], List[Tuple[int, int, torch.Tensor]]] = {}
        self._steps: Dict[Tuple[int, int], torch.Tensor] = {}
        self.host: Optional[HostUnused] = None  # offload placements (optimizer.py)

    def lagging(self) -> bool:
        """Some param skipped steps (its own step count lags its bucket's)."""
        return bool(self._lag) or (self.host is not None and bool(self.host.lag))

    def check_savable(self, where: str) -> None:
        """The lags are not in optimizer checkpoints: refuse to save one that would resume
        those params with the bucket's step count (a silently different bias correction)."""
        # a lag starts for every param without a gradient on this rank: the ones that lag
        # (a host read: saving is not on the step path)
        lagging = [key for key, lag in self._lag.items() if int(lag) != 0]
        host = getattr(self, "host", None)  # offload: host lags ([Note: ... on the host])
        if host is not None:
            lagging += host.lagging()
        if lagging:
            raise RuntimeError(
                f"zerokern: {where} cannot save this optimizer: {len(lagging)} param(s) "
                "were frozen for some steps (or used by no rank in some steps) after it was "
                "built, so their "
                "own step count lags "
                "their bucket's (frozen_slots.py), which the checkpoint format does not hold. "
                "Save before freezing params mid-training")

    def begin(self, opt, found: torch.Tensor, unused: Optional[torch.Tensor] = None) -> None:
        """Host: which params to skip this step, which to redo with their own step count;
        save their state (before any update). found: the step's found_inf (device); unused:
        a device bool per param (opt._flag_index), True where no rank used it ([Note: a param
        no rank used])."""
        self._saved, self._redo, self._steps = {}, {}, {}
        skip = [(gi, i) for gi, g in enumerate(opt.flat_groups) for i, p in enumerate(g.params)
                if not p.requires_grad and p.grad is None]
        # trainable, no gradient on this rank: skipped where no rank used it (a device flag)
        maybe = {}
        if unused is not None and _in_place(opt):
            maybe = {(gi, i): unused[opt._flag_index[(gi, i)]]
                     for gi, g in enumerate(opt.flat_groups) for i, p in enumerate(g.params)
                     if p.requires_grad and p.grad is None}
        skip_set = set(skip)
        redo = [(gi, i) for (gi, i) in self._lag if (gi, i) not in skip_set]
        redo += [key for key in maybe if key not in self._lag and key not in skip_set
                 and _rule_of(opt, key[0]).counts_steps]  # its lag starts below
        redo_set = set(redo)
        if not skip and not redo and not maybe:
            return
        from zerokern.rules import has_block_states
        from zerokern.state.placement import DevicePlacement

        place = opt.placement
        if skip and has_block_states(opt.rule):  # a param's range may cut a block
            gi, i = skip[0]
            raise RuntimeError(
                f"zerokern: param {i} of param group {gi} was frozen (requires_grad=False) "
                f"after the optimizer was built; the {opt.rule.name!r} rule keeps per-block "
                "state shared by neighbouring params (zerokern.rules [Note: per-element and "
                "per-block states]), so one param cannot be skipped alone. Freeze params "
                "before building the optimizer")
        if skip and (not isinstance(place, DevicePlacement) or place.master != "fp32" or
                     getattr(opt, "param_homes", None) is not None):
            gi, i = skip[0]
            raise RuntimeError(
                f"zerokern: param {i} of param group {gi} was frozen (requires_grad=False) "
                "after ZeroAdamW was built; skipping it in the step (as torch's AdamW skips a "
                "param with no grad) is supported with offload=None, offload_params=None and "
                f"master='fp32' (this optimizer: offload={opt.offload!r}, "
                f"master={getattr(opt, 'master', 'fp32')!r}). Freeze params before building "
                "ZeroAdamW, or save with zerokern.checkpoint and build a new one")
        for key in skip + redo + [key for key in maybe if key not in redo_set]:
            gi, i = key
            g = opt.flat_groups[gi]
            s = g.layout.slots[i]
            # a frozen param: restored; redone: restored, then its own update (selected with
            # its flag where it may be unused); only maybe unused: selected with its flag
            restore = key in skip_set or key in redo_set
            flag = None if key in skip_set else maybe.get(key)
            cst = _compact_state(g)
            for k in g.layout.buckets_of_slot(i):
                lo, hi = g.state_range(k)
                a, b = _region(g.layout, s, lo, hi)
                if a >= b:
                    continue
                if cst is not None:  # [Note: a param no rank used, compact]
                    views = [_CompactRegion(cst, g, k, a - lo, b - lo),
                             *_state_views(g, k, a - lo, b - lo)]
                else:
                    views = [_master_piece(g, k)[a - lo:b - lo],
                             *_state_views(g, k, a - lo, b - lo)]
                    out = _param_out_piece(g, k)
                    if out is not None:
                        views.append(out[a - lo:b - lo])
                self._saved.setdefault((gi, k), []).extend(
                    (v, v.clone(), None if restore else flag) for v in views)
                if key in redo_set:
                    lag = self._lag.get(key)
                    if lag is None:
                        lag = self._lag[key] = torch.zeros((), dtype=torch.int64,
                                                           device=found.device)
                    self._redo.setdefault((gi, k), []).append((a - lo, b - lo, lag, flag))
                    self._steps[(gi, k)] = g.steps[k].clone()
        for key in skip:  # a step that really runs (no inf/NaN) is one this param misses
            if not _rule_of(opt, key[0]).counts_steps:
                continue  # (Muon: its update ignores the count, nothing to redo)
            lag = self._lag.get(key)
            if lag is None:
                lag = self._lag[key] = torch.zeros((), dtype=torch.int64, device=found.device)
            lag.add_((found == 0).to(torch.int64))
        for key, flag in maybe.items():  # ...and one a param no rank used misses
            if key in self._lag:
                self._lag[key].add_(((found == 0) & flag).to(torch.int64))

    def after_update_(self, opt, gi: int, k: int, grad: torch.Tensor, hyper: dict,
                      grad_scale: torch.Tensor, found: torch.Tensor) -> None:
        """Right after bucket k's update (before it is published): the skipped params' state
        back (a param that may be unused: where its flag says no rank used it); a param whose
        step count lags updated again from its saved state with its own count (the rule's
        kernel on copies: a region of a bucket need not be aligned for it), kept where it was
        used."""
        for view, old, flag in self._saved.pop((gi, k), ()):
            if flag is None:
                view.copy_(old)
            else:
                view.copy_(torch.where(flag, old, _value(view)))
        redo = self._redo.pop((gi, k), ())
        if not redo:
            return
        g = opt.flat_groups[gi]
        cst = _compact_state(g)
        out_all = None if cst is not None else _param_out_piece(g, k)
        for a, b, lag, flag in redo:
            master = _CompactRegion(cst, g, k, a, b) if cst is not None else \
                _master_piece(g, k)[a:b]
            states = _state_views(g, k, a, b)  # the rule's states, in its order
            views = [master, *states]
            if out_all is not None:
                views.append(out_all[a:b])
            work = [t.clone() for t in views]
            n_states = len(states)
            _rule_of(opt, gi).step_(work[0], work[1:1 + n_states], grad[a:b].clone(),
                           work[1 + n_states] if out_all is not None else None,
                           step=self._steps[(gi, k)] - lag, grad_scale=grad_scale,
                           found_inf=found, backend=opt.backend, **hyper)
            for t, w in zip(views, work):  # t holds the saved state here
                t.copy_(w if flag is None else torch.where(flag, _value(t), w))


class HostUnused:
    """Params no rank used, skipped where the host runs the update ([Note: a param no rank
    used, on the host]). Made by the optimizer for an offload placement (`place.unused`)."""

    def __init__(self, opt) -> None:
        self.buffers = opt.flat_groups
        self.index = dict(opt._flag_index)  # (gi, i) -> flag position
        self.counts = [_rule_of(opt, gi).counts_steps for gi in range(len(self.buffers))]
        # each state's block, in the rule's order (8-bit AdamW's absmax: 128)
        self.blocks = [[st.block for st in _rule_of(opt, gi).states]
                       for gi in range(len(self.buffers))]
        self.lag: Dict[Tuple[int, int], int] = {}
        self.unused: set = set()

    def plan_(self, flags, ran: bool) -> None:
        """This step's params no rank used, from the flags' host copy (after the wait); ran:
        the step runs (no inf/NaN)."""
        self.unused = {key for key, j in self.index.items() if flags[j] == 0}
        if not ran:
            return
        for key in self.unused:
            if self.counts[key[0]]:
                self.lag[key] = self.lag.get(key, 0) + 1

    def lagging(self) -> List[Tuple[int, int]]:
        return [key for key, lag in self.lag.items() if lag]

    def regions(self, gi: int, f_lo: int, n: int) -> List[Tuple[int, int, int, bool]]:
        """(a, b, lag, unused) for chunk elements [a, b) (flat f_lo + a .. f_lo + b) of params
        no rank used, or used with a lag > 0 (with block-aligned slots, the gap after the
        param too: whole blocks, [Note: a param no rank used, 8-bit])."""
        out = []
        if not self.unused and not self.lag:
            return out
        L = self.buffers[gi].layout
        for i, a, b in L.overlaps(f_lo, f_lo + n):
            a, b = _region(L, L.slots[i], f_lo, f_lo + n)
            key = (gi, i)
            if key in self.unused:
                out.append((a - f_lo, b - f_lo, 0, True))
            elif self.lag.get(key):
                out.append((a - f_lo, b - f_lo, self.lag[key], False))
        return out

    def update_(self, gi: int, f_lo: int, master: torch.Tensor, states: List[torch.Tensor],
                grad: torch.Tensor, param_out: Optional[torch.Tensor], step: torch.Tensor,
                run) -> torch.Tensor:
        """One chunk's update `run(master, states, grad, param_out, step) -> new step` (the
        cpu kernel), with the params no rank used left as they were and lagging ones redone
        with their own count. Returns the chunk's new step."""
        regions = self.regions(gi, f_lo, master.numel())
        blocks = self.blocks[gi]
        saved = [(a, b, lag, unused, [master[a:b].clone(), *(_cut(t, a, b, blk).clone()
                                                              for t, blk in zip(states, blocks))])
                 for a, b, lag, unused in regions]
        new_step = run(master, states, grad, param_out, step)
        for a, b, lag, unused, old in saved:
            if unused:
                master[a:b].copy_(old[0])
                for t, o, blk in zip(states, old[1:], blocks):
                    _cut(t, a, b, blk).copy_(o)
                if param_out is not None:  # RNE: what the device holds
                    self.buffers[gi].codec.cast_(param_out[a:b], master[a:b])
                continue
            work = [o.clone() for o in old]
            pout = None if param_out is None else torch.empty_like(param_out[a:b])
            run(work[0], work[1:], grad[a:b].clone(), pout, step - lag)
            master[a:b].copy_(work[0])
            for t, w, blk in zip(states, work[1:], blocks):
                _cut(t, a, b, blk).copy_(w)
            if pout is not None:
                param_out[a:b].copy_(pout)
        return new_step

    def map_(self, gi: int, f_lo: int, views: List[torch.Tensor], fn) -> None:
        """A phased rule's pass `fn()` over a chunk whose views (per-element states or the
        master, chunk elements from 0) start at flat f_lo: the regions of params no rank used
        written back after it (a phased rule counts no steps: Muon)."""
        regions = [(a, b) for a, b, _, unused in self.regions(gi, f_lo, views[0].numel())
                   if unused]
        saved = [(a, b, [v[a:b].clone() for v in views]) for a, b in regions]
        fn()
        for a, b, old in saved:
            for v, o in zip(views, old):
                v[a:b].copy_(o)


def _value(view):
    """A view's values (a _CompactRegion's expanded into a new fp32 tensor)."""
    return view if isinstance(view, torch.Tensor) else view.clone()


def _compact_state(g):
    """g's CompactState while its master is compact (not expanded), else None."""
    from zerokern.state.compact_master import CompactState

    st = g.state
    return st if isinstance(st, CompactState) and not st.expanded else None


def _master_piece(g, k: int) -> torch.Tensor:
    """Bucket k's master for the step, without an outside access of a compact master (whose
    `master` would expand it and keep it expanded: compact_master.py)."""
    from zerokern.state.compact_master import CompactState

    if isinstance(g.state, CompactState):
        return g.state.expanded_piece(g, k)
    return g.master_piece(k)


def _param_out_piece(g, k: int):
    from zerokern.state.compact_master import CompactState

    if isinstance(g.state, CompactState):
        return g.param_values(*g.state_range(k))
    return g.param_out_piece(k)


class _CompactRegion:
    """Piece elements [a, b) of bucket k's compact master, read and written as fp32
    ([Note: a param no rank used, compact]): `clone()` expands them (a fresh fp32
    tensor), `copy_(m)` writes m's low halves, tie bits and bf16 values back. The tie bits are
    packed 8 to a byte, so both work on the 8-aligned span around [a, b) (the piece starts at a
    multiple of 128): its other elements are expanded and compacted back unchanged (exact,
    compact_master.py [Note: the compact master])."""

    def __init__(self, st, g, k: int, a: int, b: int) -> None:
        self.st, self.g, self.k, self.a, self.b = st, g, k, a, b
        self.a8, self.b8 = a // 8 * 8, -(-b // 8) * 8
        self.s0 = g.state_slice(k).start

    def _span(self):
        from zerokern.state.compact_master import expand_

        lo, hi = self.s0 + self.a8, self.s0 + self.b8
        param = self.g.param_values(*self.g.state_range(self.k))[self.a8:self.b8]
        out = torch.empty(self.b8 - self.a8, dtype=torch.float32, device=param.device)
        expand_(out, self.st.low[lo:hi], self.st.ties[lo // 8:hi // 8], param)
        return out

    def clone(self) -> torch.Tensor:
        return self._span()[self.a - self.a8:self.b - self.a8].clone()

    def copy_(self, m: torch.Tensor) -> None:
        from zerokern.state.compact_master import compact_

        span = self._span()
        span[self.a - self.a8:self.b - self.a8].copy_(m)
        lo, hi = self.s0 + self.a8, self.s0 + self.b8
        compact_(self.st.low[lo:hi], self.st.ties[lo // 8:hi // 8], span)
        self.g.param_values(*self.g.state_range(self.k))[self.a8:self.b8].copy_(span)


def _cut(t: torch.Tensor, a: int, b: int, block: int = 1) -> torch.Tensor:
    """A state's part for elements [a, b) (whole blocks of a per-block state)."""
    return t[a // block:b // block]


def _region(L, s, lo: int, hi: int) -> Tuple[int, int]:
    """The flat range of slot s inside [lo, hi) that its skip saves and restores: its
    elements, and with block-aligned slots the gap after them, so that a per-block state's
    region is whole blocks, all the param's own ([Note: a param no rank used, 8-bit])."""
    a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
    if a < b and L.slot_align != 1:
        b = min(hi, -(-b // L.slot_align) * L.slot_align)
    return a, b


def _state_views(g, k: int, a: int, b: int) -> List[torch.Tensor]:
    """The rule's states (in its order) for elements [a, b) of bucket k's piece (whole
    blocks of a per-block state; ValueError if it cuts one)."""
    s0 = g.state_slice(k).start
    return g.state.views(slice(s0 + a, s0 + b))


def _in_place(opt) -> bool:
    """The state is updated in place on the device (no offload, fp32 master, no param homes):
    where a param no rank used is skipped ([Note: a param no rank used])."""
    from zerokern.state.placement import DevicePlacement

    place = opt.placement
    return isinstance(place, DevicePlacement)


def _rule_of(opt, gi: int):
    """The rule of buffer gi (zerokern.rules [Note: a rule per param group])."""
    rules = getattr(opt, "rules", None)
    return opt.rule if rules is None else rules[opt.flat_groups[gi].group_index]
