"""Params frozen or unfrozen after ZeroAdamW was built: trained as torch would, or refused.

[Note: a param frozen mid-training]
torch.optim.AdamW updates only params whose `p.grad` is not None. A param the user freezes
mid-training (`p.requires_grad_(False)`, `module.requires_grad_(False)`, peft's
`disable_adapter_layers()`) gets no gradient, so after `zero_grad()` its grad is None and torch
leaves it, its exp_avg, exp_avg_sq and step count untouched. Our update runs over flat pieces
(bucket by bucket, several params per kernel call), so such a param would keep moving by
momentum and weight decay (issue 21, item 1: 1.5e-2 after 3 steps at betas 0.5/0.6). Here the
step saves the state of every such param (master, exp_avg, exp_avg_sq and the param values in
this rank's state range) before the update and writes it back right after its bucket's update,
before the bucket is published (stages 1-2 all-gather it), so every rank's copy is the old one.
Cost: one copy of a frozen param's state per step, on the device, no host read.

Which params: `requires_grad` False *and* `p.grad` None at step(). Both are host state. The
rank-local "no gradient in this backward" (a param unused in one step while trainable) is not
a reason: that keeps the promise of tests/zero/test_unused_params.py (a missing gradient counts
as zero on that rank, the same on every stage and rank), while `requires_grad` is the same on
every rank of a data-parallel model (a param frozen on one rank only would make DDP itself
diverge). A frozen param with a grad left (`zero_grad(set_to_none=False)`, or frozen between
backward and step) is updated with it, as torch does.

Unfreezing again after skipped steps raises (before anything changes): torch keeps one step
count per param, so its bias correction for this param would lag the others by the steps
skipped, while ours keeps one counter per bucket. Likewise a frozen param with its state
elsewhere (offload="cpu"/"nvme", master="compact"), where the update does not run in place
on the device: a clear error instead of a wrong step.

[Note: a param frozen at construction]
Params frozen when ZeroAdamW was built are not in its buffers (DESIGN §2). torch's AdamW,
given the same params (the whole model, or a list that includes them), would start training
one the user unfreezes; we cannot add it to the flat buffers, so unfreezing it is refused with
an error naming it (at the next forward with the model given, backward or step), before
anything changes (issue 21, item 2). A param not given to ZeroAdamW at all is not ours, as it
is not torch's optimizer's: its grads accumulate in p.grad as torch's and nothing updates it.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

import torch


def param_names(model: Optional[torch.nn.Module]) -> Dict[int, str]:
    if model is None:
        return {}
    return {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}


def check_unfrozen(frozen, names: Dict[int, str], where: str) -> None:
    """Raise if a param that was frozen when ZeroAdamW was built now requires grad."""
    back = [p for p in (r() for r in frozen) if p is not None and p.requires_grad]
    if back:
        shown = [names.get(id(p), f"a param of shape {tuple(p.shape)}") for p in back]
        raise RuntimeError(
            f"zerokern ({where}): {shown[:5]} {'was' if len(back) == 1 else 'were'} frozen "
            "(requires_grad=False) when ZeroAdamW was built and now require grad. ZeroAdamW "
            "lays out the trainable params once (frozen ones hold no optimizer state), so it "
            "cannot start training them; torch's AdamW would. Set requires_grad as it will be "
            "for training before building ZeroAdamW (a param frozen at first and unfrozen "
            "later: build it trainable and freeze it after; it is then skipped as torch skips "
            "it), or build a new ZeroAdamW after unfreezing")


def frozen_refs(params) -> List[weakref.ref]:
    seen, out = set(), []
    for p in params:
        if isinstance(p, torch.Tensor) and not p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(weakref.ref(p))
    return out


class FrozenSkip:
    """Per step: the params to leave untouched ([Note: a param frozen mid-training])."""

    def __init__(self) -> None:
        self.skipped: Dict[Tuple[int, int], int] = {}   # (group, slot) -> steps skipped
        self._saved: Dict[Tuple[int, int], List[Tuple[torch.Tensor, torch.Tensor]]] = {}

    def check(self, opt, names) -> None:
        """Before a step: refuse a param unfrozen after it skipped steps."""
        back = [(gi, i) for (gi, i), n in self.skipped.items()
                if n and opt.flat_groups[gi].params[i].requires_grad]
        if back:
            gi, i = back[0]
            p = opt.flat_groups[gi].params[i]
            name = names().get(id(p), f"param {i} of param group {gi}")
            raise RuntimeError(
                f"zerokern: {name!r} was frozen for {self.skipped[(gi, i)]} step(s) and now "
                "requires grad again. torch's AdamW keeps one step count per param (its bias "
                "correction would lag the others' by the steps skipped); ZeroAdamW keeps one "
                "per bucket, so it cannot continue this param as torch would. Keep it frozen, "
                "or save with zerokern.checkpoint and build a new ZeroAdamW")

    def begin(self, opt) -> None:
        """Host: which params to skip this step; save their state (before any update)."""
        self._saved = {}
        skip = [(gi, i) for gi, g in enumerate(opt.flat_groups) for i, p in enumerate(g.params)
                if not p.requires_grad and p.grad is None]
        if not skip:
            return
        from .placement import DevicePlacement

        place = opt.placement
        if not isinstance(place, DevicePlacement) or place.master != "fp32" or \
                getattr(opt, "param_homes", None) is not None:
            gi, i = skip[0]
            raise RuntimeError(
                f"zerokern: param {i} of param group {gi} was frozen (requires_grad=False) "
                "after ZeroAdamW was built; skipping it in the step (as torch's AdamW skips a "
                "param with no grad) is supported with offload=None, offload_params=None and "
                f"master='fp32' (this optimizer: offload={opt.offload!r}, "
                f"master={getattr(opt, 'master', 'fp32')!r}). Freeze params before building "
                "ZeroAdamW, or save with zerokern.checkpoint and build a new one")
        for gi, i in skip:
            g = opt.flat_groups[gi]
            s = g.layout.slots[i]
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
                self._saved.setdefault((gi, k), []).extend((v, v.clone()) for v in views)
            self.skipped[(gi, i)] = self.skipped.get((gi, i), 0) + 1

    def restore_(self, gi: int, k: int) -> None:
        """Right after bucket k's update (before it is published): the saved values back."""
        for view, old in self._saved.pop((gi, k), ()):
            view.copy_(old)
