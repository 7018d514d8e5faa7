"""activation_checkpointing="offload": the backward prefetch of the host copies one unit ahead
(zerokern/stage3/activation_policy.py [Note: offload's backward prefetch], issue 37).

On this CPU-only machine the copy stream does not exist; `copy_on_cpu=True` makes the pack
hook copy every saved tensor into a fresh host tensor, so the pack / prefetch / unpack path runs
with real copies, and `trace` records the order of the hooks. Checked: the prefetch for the
unit before is issued at the next unit's backward start, before the first unpack of its saved
tensors; every unpack is served by a prefetched tensor; at most two units hold prefetched
tensors (the running one and the next); a prefetch no backward used is dropped; the losses and
grads are bitwise those of no policy, with and without the prefetch. The CUDA stream calls
(CopyStream) are not run here: no GPU was lent to this work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.stage3.test_activation_policy import Net
from zerokern.stage3.activation_policy import apply_policy


def _grads(policy=None, steps: int = 2, layers: int = 3, **kw):
    torch.manual_seed(0)
    model = Net(layers=layers)
    pol = apply_policy(model, policy, **kw) if policy else None
    if pol is not None:
        pol.trace = []
        _count_holding(pol)
    torch.manual_seed(7)  # dropout
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 64, (2, 16), generator=g)
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        losses.append(loss.detach().clone())
    return losses, [p.grad.clone() for p in model.parameters()], pol


def _first(trace, what, idx):
    return next(i for i, e in enumerate(trace) if e == (what, idx))


def test_prefetch_is_issued_before_the_unpack_one_unit_ahead():
    _, _, pol = _grads("offload", steps=1, copy_on_cpu=True)
    tr = pol.trace
    calls = sorted({c for _, c in tr})
    assert calls == [0, 1, 2]
    for c in calls:
        # each unit's saved tensors were prefetched before its first unpack
        assert _first(tr, "prefetch", c) < _first(tr, "unpack", c)
    for c in (1, 2):
        # the unit before is prefetched at this unit's backward start, before this unit's
        # own unpacks ran (so its copies overlap this unit's backward)
        b = _first(tr, "backward", c)
        assert b < _first(tr, "prefetch", c - 1) < _first(tr, "unpack", c)
    # the last unit (the first backward) prefetches itself and the one before, in that order
    assert [e for e in tr if e[0] == "prefetch"] == [("prefetch", 2), ("prefetch", 1),
                                                     ("prefetch", 0)]
    unpacks = sum(1 for e in tr if e[0] == "unpack")
    assert unpacks > 0 and pol.prefetch_hits == unpacks  # every unpack from the prefetch
    assert max(pol._test_holding) <= 2 and 2 in pol._test_holding


def _count_holding(pol):
    """After each prefetch: the calls holding prefetched tensors not yet unpacked."""
    pol._test_holding = []
    orig = pol._prefetch

    def prefetch(call):
        orig(call)
        held = [r() for r in pol._ahead if r() is not None]
        pol._test_holding.append(sum(
            any(p() is not None and p().ready is not None for p in c.packed) for c in held))
    pol._prefetch = prefetch


def test_bitwise_same_losses_and_grads():
    ref_l, ref_g, _ = _grads(None)
    for kw in (dict(copy_on_cpu=True), dict(copy_on_cpu=True, prefetch=False), {}):
        l, g, pol = _grads("offload", **kw)
        assert all(torch.equal(a, b) for a, b in zip(ref_l, l)), kw
        assert all(torch.equal(a, b) for a, b in zip(ref_g, g)), kw
        if kw.get("prefetch") is False:
            assert pol.prefetches == 0 and pol.prefetch_hits == 0
        else:
            assert pol.prefetch_hits > 0


def test_a_prefetch_no_backward_uses_is_dropped():
    """Unit 1's output does not reach the loss: its saved tensors, prefetched at unit 2's
    backward, are dropped at unit 0's (one unit ahead, never more)."""
    torch.manual_seed(0)
    model = Net(layers=3)
    pol = apply_policy(model, "offload", copy_on_cpu=True)
    pol.trace = []
    idx = torch.randint(0, 64, (2, 16))
    x = model.emb(idx)
    x0 = model.blocks[0](x)
    unused = model.blocks[1](x0)  # its backward never runs
    y = model.blocks[2](x0)
    held = [p for r in pol._last().prev().packed if (p := r()) is not None]  # unit 1's
    assert held
    model.head(y).sum().backward()
    tr = pol.trace
    assert ("prefetch", 1) in tr and ("unpack", 1) not in tr
    assert all(p.ready is None for p in held)  # dropped at unit 0's backward start
    assert _first(tr, "prefetch", 1) < _first(tr, "backward", 0)
    del unused
