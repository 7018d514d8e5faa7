"""8-bit block-quantized AdamW state (zerokern/kernels/quant8.py).

References: bitsandbytes' dynamic map and its AdamW8bit (runs on the CPU here), a brute-force
nearest-code search, and torch's fp32 AdamW. The error bound of the Note is checked on fresh
random data; a skipped step is a bitwise no-op; negative control: lr x 1.01 is caught.
"""

from __future__ import annotations

import bitsandbytes as bnb  # the 8-bit reference (in the test extra)
import pytest
import torch

from zerokern.kernels.quant8 import BLOCK, adamw8bit_step_, dequantize, dynamic_map, quantize


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_is_bitsandbytes_map(signed):
    import bitsandbytes.functional as F
    ours = dynamic_map(signed)
    theirs = F.create_dynamic_map(signed=signed).float()
    assert ours.shape == (256,)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [BLOCK, 7 * BLOCK])
def test_quantize_picks_the_nearest_code_within_the_bound(signed, n):
    torch.manual_seed(n + signed)
    # values over 8 decades, blocks with very different scales, one all-zero block
    x = torch.randn(n) * torch.logspace(-6, 2, n)[torch.randperm(n)]
    x = x if signed else x.abs()
    x[:BLOCK] = 0.0 if n > BLOCK else x[:BLOCK]
    q, absmax = quantize(x, signed)
    codes = dynamic_map(signed)
    normed = (x.view(-1, BLOCK) / absmax.clamp(min=1e-30)[:, None]).view(-1)
    brute = (normed[:, None] - codes[None, :]).abs().argmin(dim=1)
    # the nearest code: equal to brute force except exact ties (distance equal both ways)
    dist_ours = (codes[q.long()] - normed).abs()
    dist_best = (codes[brute] - normed).abs()
    assert torch.all(dist_ours <= dist_best + 1e-7)
    back = dequantize(q, absmax, signed)
    gaps = torch.diff(codes)
    # half the local gap around each normalised value, times the block's absmax
    j = torch.bucketize(normed.clamp(codes[0], codes[-1]), codes).clamp(1, 255)
    bound = gaps[j - 1] / 2 * absmax.repeat_interleave(BLOCK)
    assert torch.all((back - x).abs() <= bound * (1 + 1e-5) + 1e-30)
    if n > BLOCK:
        assert torch.equal(back[:BLOCK], torch.zeros(BLOCK))


def _run(ours_lr_scale=1.0, steps=40, n=32 * BLOCK):
    torch.manual_seed(3)
    p0 = torch.randn(n)
    grads = [torch.randn(n) * (0.1 + torch.rand(n)) for _ in range(steps)]
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    ref = torch.nn.Parameter(p0.clone())
    fp32 = torch.optim.AdamW([ref], **hyper)
    theirs = torch.nn.Parameter(p0.clone())
    b8 = bnb.optim.AdamW8bit([theirs], min_8bit_size=0, **hyper)
    ours = p0.clone()
    mq = torch.zeros(n, dtype=torch.uint8)
    vq = torch.zeros(n, dtype=torch.uint8)
    ma = torch.zeros(n // BLOCK)
    va = torch.zeros(n // BLOCK)
    mq.fill_(int(torch.argmin(dynamic_map(True).abs())))  # the 0 code
    step = torch.zeros((), dtype=torch.int64)
    for g in grads:
        ref.grad = g.clone()
        theirs.grad = g.clone()
        fp32.step()
        b8.step()
        adamw8bit_step_(ours, mq, ma, vq, va, g, lr=hyper["lr"] * ours_lr_scale, beta1=0.9,
                        beta2=0.99, eps=1e-8, weight_decay=0.01, step=step)
    assert int(step) == steps
    return ours, theirs.detach(), ref.detach()


def test_close_to_fp32_adamw_as_bitsandbytes_is():
    ours, theirs, ref = _run()
    err_ours = ((ours - ref).norm() / (ref - ref.mean()).norm()).item()
    err_bnb = ((theirs - ref).norm() / (ref - ref.mean()).norm()).item()
    # 8-bit moments drift from fp32 AdamW; ours (128-element blocks) no more than
    # bitsandbytes' (256) by a margin, and both small.
    assert err_ours < 2 * err_bnb + 1e-4, (err_ours, err_bnb)
    assert err_ours < 5e-3, err_ours
    assert ((ours - theirs).norm() / theirs.norm()).item() < 5e-3


def _spec(p, m, v, grads, lr, beta1, beta2, eps, wd):
    """An independent model of the 8-bit step: float64 arithmetic, per-block loops, the nearest
    code by brute-force argmin; returns the params after all steps."""
    sm, sv = dynamic_map(True).double(), dynamic_map(False).double()
    p, m, v = p.double(), m.double(), v.double()
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p * (1 - lr * wd)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        bc1, bc2 = 1 - beta1 ** t, 1 - beta2 ** t
        p = p - (lr / bc1) * m / (v.sqrt() / bc2 ** 0.5 + eps)
        for x, codes in ((m, sm), (v, sv)):
            for b in range(x.numel() // BLOCK):
                blk = x[b * BLOCK:(b + 1) * BLOCK]
                amax = blk.abs().max()
                if amax > 0:
                    i = (blk[:, None] / amax - codes[None, :]).abs().argmin(dim=1)
                    blk.copy_(codes[i] * amax)
    return p


@pytest.mark.parametrize("lr_scale, ok", [(1.0, True), (1.01, False)])
def test_equals_a_float64_spec_and_lr_off_by_one_percent_is_caught(lr_scale, ok):
    torch.manual_seed(11)
    n, steps = 8 * BLOCK, 5
    p0 = torch.randn(n)
    grads = [torch.randn(n) for _ in range(steps)]
    want = _spec(p0, torch.zeros(n), torch.zeros(n), grads, 1e-2, 0.9, 0.99, 1e-8, 0.01)
    ours = p0.clone()
    mq, ma = quantize(torch.zeros(n), True)
    vq, va = quantize(torch.zeros(n), False)
    step = torch.zeros((), dtype=torch.int64)
    for g in grads:
        adamw8bit_step_(ours, mq, ma, vq, va, g, lr=1e-2 * lr_scale, beta1=0.9, beta2=0.99,
                        eps=1e-8, weight_decay=0.01, step=step)
    rel = ((ours.double() - want).norm() / want.norm()).item()
    assert (rel <= 1e-6) == ok, rel


def test_a_skipped_step_changes_nothing():
    torch.manual_seed(5)
    n = 4 * BLOCK
    p = torch.randn(n)
    mq, ma = quantize(torch.randn(n), True)
    vq, va = quantize(torch.rand(n), False)
    step = torch.tensor(3)
    out = torch.randn(n).bfloat16()
    before = [t.clone() for t in (p, mq, ma, vq, va, step, out)]
    g = torch.randn(n)
    g[7] = float("nan")
    adamw8bit_step_(p, mq, ma, vq, va, g, out, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.1, step=step, found_inf=torch.tensor(True))
    for a, b in zip(before, (p, mq, ma, vq, va, step, out)):
        assert torch.equal(a, b)
    adamw8bit_step_(p, mq, ma, vq, va, torch.randn(n), out, lr=1e-3, beta1=0.9, beta2=0.999,
                    eps=1e-8, weight_decay=0.1, step=step, found_inf=torch.tensor(False))
    assert int(step) == 4 and torch.equal(out, p.bfloat16())


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize(torch.randn(100), True)


def test_an_optimizer_makes_the_maps_at_construction_not_in_a_step(monkeypatch):
    """The code maps and midpoints exist on the state's device once ZeroAdamW(state_bits=8) is
    built, and a step makes none (on a GPU making one is a pageable host->device copy inside
    the step). Failed on the old code: the first step built them (dynamic_map called)."""
    import zerokern as zk
    from zerokern.kernels import quant8

    from ..support import models as M

    monkeypatch.setattr(quant8, "_MAPS", {})
    monkeypatch.setattr(quant8, "_MIDS", {})
    model = M.make_model()
    opt = zk.ZeroAdamW(model, lr=1e-3, state_bits=8, stage=2, precision="fp32",
                       backend="reference")
    cpu = str(torch.device("cpu"))
    assert set(quant8._MAPS) == {(True, cpu), (False, cpu)}
    assert set(quant8._MIDS) == {(True, cpu), (False, cpu)}

    def made_in_step(signed):
        raise AssertionError("a code map was made inside step()")

    monkeypatch.setattr(quant8, "dynamic_map", made_in_step)
    before = M.snapshot(model)
    M.train_zero(model, opt, 0, 1, 2)
    assert not M.bitwise_equal(M.snapshot(model), before)  # control: the steps ran
