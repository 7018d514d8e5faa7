"""adamw8bit_step_ (zerokern.kernels.adamw8bit) on every backend runnable here.

References: the reference backend (the spec in torch ops: every other backend must equal it bit
for bit, kernels/adamw8bit.py [Note: the 8-bit step, bit for bit]) and an independent float64
model of the 8-bit step (test_quant8._spec: float64 arithmetic, per-block loops, nearest code by
brute-force argmin). Fresh random data per test; negative control: lr x 1.01 is caught; a skipped
step is a bitwise no-op; a piece that cuts a block is refused.
"""

from __future__ import annotations

import pytest
import torch

from zerokern.kernels.adamw8bit import adamw8bit_step_
from zerokern.kernels.quant8 import BLOCK, quantize
from zerokern.rules import cut_states

from .test_quant8 import _spec

DTYPES = [(torch.float32, None), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]


def _state(n):
    p = torch.randn(n)
    mq, ma = quantize(torch.randn(n) * torch.logspace(-5, 0, n)[torch.randperm(n)], True)
    vq, va = quantize(torch.rand(n) * torch.logspace(-8, 0, n)[torch.randperm(n)], False)
    return [p, mq, ma, vq, va]


def _run(backend, state, grads, out, flags, lr=1e-3, step0=3):
    state = [t.clone() for t in state]
    out = None if out is None else out.clone()
    step = torch.tensor(step0)
    for g, f in zip(grads, flags):
        adamw8bit_step_(*state, g, out, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.05, step=step, grad_scale=torch.tensor(0.5),
                        found_inf=torch.tensor(f), backend=backend)
    return state, out, step


@pytest.mark.parametrize("dtypes", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_every_backend_equals_the_reference_bitwise(backend, dtypes):
    gdt, odt = dtypes
    n = BLOCK * 53
    state = _state(n)
    grads = [(torch.randn(n) * torch.logspace(-4, 1, n)[torch.randperm(n)]).to(gdt)
             for _ in range(3)]
    out = None if odt is None else torch.randn(n).to(odt)
    flags = [False, True, False]  # the middle step is skipped
    want = _run("reference", state, grads, out, flags)
    got = _run(backend, state, grads, out, flags)
    names = ["master", "m_q", "m_absmax", "v_q", "v_absmax"]
    for name, a, b in zip(names, want[0], got[0]):
        assert torch.equal(a, b), name
    if out is not None:
        assert torch.equal(want[1], got[1])
        assert torch.equal(got[1], got[0][0].to(odt))
    assert int(got[2]) == int(want[2]) == 5
    # and the moments really moved (codes and scales changed)
    assert not torch.equal(got[0][1], state[1]) and not torch.equal(got[0][4], state[4])


@pytest.mark.parametrize("lr_scale, ok", [(1.0, True), (1.01, False)])
def test_equals_the_float64_spec_lr_off_by_one_percent_is_caught(backend, lr_scale, ok):
    n, steps = 8 * BLOCK, 5
    p0 = torch.randn(n)
    grads = [torch.randn(n) for _ in range(steps)]
    want = _spec(p0, torch.zeros(n), torch.zeros(n), grads, 1e-2, 0.9, 0.99, 1e-8, 0.01)
    p = p0.clone()
    mq, ma = quantize(torch.zeros(n), True)
    vq, va = quantize(torch.zeros(n), False)
    step = torch.zeros((), dtype=torch.int64)
    for g in grads:
        adamw8bit_step_(p, mq, ma, vq, va, g, lr=1e-2 * lr_scale, beta1=0.9, beta2=0.99,
                        eps=1e-8, weight_decay=0.01, step=step, grad_scale=torch.tensor(1.0),
                        found_inf=torch.tensor(False), backend=backend)
    rel = ((p.double() - want).norm() / want.norm()).item()
    assert (rel <= 1e-6) == ok, rel


def test_blocks_are_independent_so_pieces_equal_the_whole(backend):
    """What ZeRO relies on: the step over a piece of whole blocks is the step over the whole."""
    n = BLOCK * 12
    state = _state(n)
    g = torch.randn(n)
    whole, _, _ = _run(backend, state, [g], None, [False])
    cut = 5 * BLOCK
    parts = []
    for lo, hi in ((0, cut), (cut, n)):
        piece = [state[0][lo:hi], state[1][lo:hi], state[2][lo // BLOCK:hi // BLOCK],
                 state[3][lo:hi], state[4][lo // BLOCK:hi // BLOCK]]
        parts.append(_run(backend, piece, [g[lo:hi]], None, [False])[0])
    for i in range(5):
        assert torch.equal(whole[i], torch.cat([parts[0][i], parts[1][i]]))


def test_a_piece_that_cuts_a_block_is_refused():
    states = {"exp_avg": torch.zeros(512, dtype=torch.uint8), "exp_avg_absmax": torch.zeros(4)}
    blocks = {"exp_avg_absmax": BLOCK}
    m, a = cut_states(states, blocks, 128, 384)
    assert m.numel() == 256 and a.numel() == 2
    with pytest.raises(ValueError, match="cut its 128-element blocks"):
        cut_states(states, blocks, 64, 384)
    p, mq, ma, vq, va = _state(BLOCK * 2)
    with pytest.raises(ValueError, match="multiple of 128"):
        adamw8bit_step_(p[:200], mq[:200], ma, vq[:200], va, torch.randn(200), lr=1e-3,
                        beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                        step=torch.tensor(0), grad_scale=torch.tensor(1.0),
                        found_inf=torch.tensor(False), backend="reference")


@pytest.mark.parametrize("bad, match", [
    (dict(m_q=torch.zeros(256)), "m_q"),
    (dict(v_absmax=torch.zeros(3)), "v_absmax"),
    (dict(lr=-1.0), "lr"),
    (dict(eps=0.0), "eps"),
])
def test_bad_arguments_are_named(bad, match):
    p, mq, ma, vq, va = _state(BLOCK * 2)
    kw = dict(master=p, m_q=mq, m_absmax=ma, v_q=vq, v_absmax=va, grad=torch.randn(256),
              lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
              step=torch.tensor(0), grad_scale=torch.tensor(1.0),
              found_inf=torch.tensor(False), backend="reference")
    kw.update(bad)
    before = p.clone()
    with pytest.raises((TypeError, ValueError), match=match):
        adamw8bit_step_(**kw)
    assert torch.equal(p, before)


@pytest.mark.gpu
def test_compiled_triton_equals_the_reference_on_cuda():
    """The compiled Triton kernel on CUDA tensors (the `gpu` run): bitwise the reference on the
    same device (the CUDA C++ kernel: tests/gpu/test_gpu_adamw8bit.py)."""
    dev = torch.device("cuda")
    n = BLOCK * 1031
    state = [t.to(dev) for t in _state(n)]
    grads = [torch.randn(n, device=dev).bfloat16() for _ in range(3)]
    out = torch.randn(n, device=dev).bfloat16()
    flags = [False, True, False]

    def run(backend):
        st = [t.clone() for t in state]
        o, step = out.clone(), torch.tensor(3, device=dev)
        for g, f in zip(grads, flags):
            adamw8bit_step_(*st, g, o, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.05, step=step,
                            grad_scale=torch.tensor(0.5, device=dev),
                            found_inf=torch.tensor(f, device=dev), backend=backend)
        return st, o, step

    want, got = run("reference"), run("triton")
    for a, b in zip(want[0], got[0]):
        assert torch.equal(a, b)
    assert torch.equal(want[1], got[1]) and int(got[2]) == 5
