"""Muon over a flat buffer, phase by phase (muon_pieces + orthogonalize), against torch.optim.Muon.

Single process: matrices packed into one flat buffer (the layout ZeroAdamW uses, padding and
bucket cuts included), three steps of momentum -> orthogonalize -> apply, compared with
torch.optim.Muon on the same params and grads: bitwise (the same ops in the same order).
A skipped step (found_inf) changes nothing. Negative control: lr x 1.01 is caught.
"""

from __future__ import annotations

import pytest
import torch

from zerokern.geometry.partition import ALIGN, make_layout
from zerokern.rules.muon_orthogonalize import ShardedOrthogonalizer
from zerokern.rules.muon_pieces import apply_, momentum_

SHAPES = [(40, 24), (96, 33), (130, 8), (12, 70)]


def _segments(layout):
    return [(s.offset, s.offset + s.numel, (s.shape[0], s.numel // s.shape[0]))
            for s in layout.slots]


def _run(hyper, lr_scale=1.0, steps=3, skip_at=None):
    torch.manual_seed(7)
    params = [torch.randn(s) for s in SHAPES]
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(steps)]
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.Muon(ref, **hyper)
    layout = make_layout(SHAPES, 1, 2 * ALIGN)
    master = torch.zeros(layout.padded_numel)
    for s, p in zip(layout.slots, params):
        master[s.offset:s.offset + s.numel] = p.reshape(-1)
    buf = torch.zeros_like(master)
    orth = ShardedOrthogonalizer(layout, 0, 1, False, range(len(SHAPES)), None,
                                 hyper.get("ns_coefficients", (3.4445, -4.7750, 2.0315)),
                                 hyper.get("ns_steps", 5), hyper.get("eps", 1e-7))
    for t in range(steps):
        skip = skip_at == t
        if not skip:
            for p, g in zip(ref, grads[t]):
                p.grad = g.clone()
            opt.step()
        flat_g = torch.zeros_like(master)
        for s, g in zip(layout.slots, grads[t]):
            flat_g[s.offset:s.offset + s.numel] = g.reshape(-1)
        if skip:
            flat_g[3] = float("inf")
        found_inf = torch.tensor(skip)
        upd = momentum_(buf, flat_g, momentum=hyper.get("momentum", 0.95),
                        nesterov=hyper.get("nesterov", True), found_inf=found_inf)
        orth.orthogonalize_(upd)
        apply_(master, upd, _segments(layout), lr=hyper["lr"] * lr_scale,
               weight_decay=hyper.get("weight_decay", 0.1),
               adjust_lr_fn=hyper.get("adjust_lr_fn"), found_inf=found_inf)
    got = [master[s.offset:s.offset + s.numel].view(s.shape) for s in layout.slots]
    want_buf = [opt.state[p]["momentum_buffer"] for p in ref]
    got_buf = [buf[s.offset:s.offset + s.numel].view(s.shape) for s in layout.slots]
    return got, [p.detach() for p in ref], got_buf, want_buf


HYPERS = [dict(lr=0.02), dict(lr=0.05, momentum=0.9, nesterov=False, weight_decay=0.01),
          dict(lr=0.01, adjust_lr_fn="match_rms_adamw", ns_steps=3)]


@pytest.mark.parametrize("hyper", HYPERS, ids=["default", "plain-momentum", "moonlight"])
def test_flat_muon_equals_torch_muon(hyper):
    got, want, got_buf, want_buf = _run(hyper)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for g, w in zip(got_buf, want_buf):
        assert torch.equal(g, w)


def test_a_skipped_step_changes_nothing():
    got, want, got_buf, want_buf = _run(HYPERS[0], skip_at=1)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for g, w in zip(got_buf, want_buf):
        assert torch.equal(g, w)


def test_negative_control_lr_off_by_one_percent_is_caught():
    got, want, _, _ = _run(HYPERS[0], lr_scale=1.01)
    assert not all(torch.equal(g, w) for g, w in zip(got, want))
    rel = max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want))
    assert rel > 1e-4
