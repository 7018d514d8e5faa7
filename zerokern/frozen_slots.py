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
Where the state is not updated in place on the device (offload, master="compact",
offload_params) or a rule keeps per-block state (8-bit), such a param still counts as a zero
gradient (docs/concepts/stages.md says so).

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

    def lagging(self) -> bool:
        """Some param skipped steps (its own step count lags its bucket's)."""
        return bool(self._lag)

    def check_savable(self, where: str) -> None:
        """The lags are not in optimizer checkpoints: refuse to save one that would resume
        those params with the bucket's step count (a silently different bias correction)."""
        # a lag starts for every param without a gradient on this rank: the ones that lag
        # (a host read: saving is not on the step path)
        lagging = [key for key, lag in self._lag.items() if int(lag) != 0]
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
                     if p.requires_grad and p.grad is None
                     and not _has_blocks(_rule_of(opt, gi))}
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
            for k in g.layout.buckets_of_slot(i):
                lo, hi = g.state_range(k)
                a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a >= b:
                    continue
                views = [g.master_piece(k)[a - lo:b - lo], *(t[a - lo:b - lo]
                                                             for t in g.moments(k))]
                out = g.param_out_piece(k)
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
                view.copy_(torch.where(flag, old, view))
        redo = self._redo.pop((gi, k), ())
        if not redo:
            return
        g = opt.flat_groups[gi]
        states_all = g.moments(k)  # the rule's states, in its order
        out_all = g.param_out_piece(k)
        for a, b, lag, flag in redo:
            views = [g.master_piece(k)[a:b], *(t[a:b] for t in states_all)]
            if out_all is not None:
                views.append(out_all[a:b])
            work = [t.clone() for t in views]
            n_states = len(states_all)
            _rule_of(opt, gi).step_(work[0], work[1:1 + n_states], grad[a:b].clone(),
                           work[1 + n_states] if out_all is not None else None,
                           step=self._steps[(gi, k)] - lag, grad_scale=grad_scale,
                           found_inf=found, backend=opt.backend, **hyper)
            for t, w in zip(views, work):  # t holds the saved state here
                t.copy_(w if flag is None else torch.where(flag, t, w))


def _in_place(opt) -> bool:
    """The state is updated in place on the device (no offload, fp32 master, no param homes):
    where a param no rank used is skipped ([Note: a param no rank used])."""
    from zerokern.state.placement import DevicePlacement

    place = opt.placement
    return isinstance(place, DevicePlacement) and place.master == "fp32" and \
        getattr(opt, "param_homes", None) is None


def _has_blocks(rule) -> bool:
    return any(s.block != 1 for s in rule.states)


def _rule_of(opt, gi: int):
    """The rule of buffer gi (zerokern.rules [Note: a rule per param group])."""
    rules = getattr(opt, "rules", None)
    return opt.rule if rules is None else rules[opt.flat_groups[gi].group_index]
