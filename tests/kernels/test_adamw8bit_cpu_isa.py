"""The CPU 8-bit AdamW op on every instruction set this CPU has (op.force_isa: avx512, avx2,
scalar) against the reference backend, bit for bit (kernels/adamw8bit.py [Note: the 8-bit step,
bit for bit]; csrc/cpu/adamw8bit_cpu.h [Note: branchless nearest code]).

Fresh random data per case; sizes 1, 3, 64 and 1031 blocks; fp32/bf16/fp16 grads with
param_out none/bf16/fp16; edge values (NaN, +-inf, -0.0, values exactly on a midpoint, an
all-zero block); a skipped step. Negative control: lr x 1.01 on the cpu op is caught.
"""

from __future__ import annotations

import pytest
import torch

from zerokern.kernels.adamw8bit import adamw8bit_step_
from zerokern.kernels.quant8 import BLOCK, midpoints, quantize

GRADS = [torch.float32, torch.bfloat16, torch.float16]
OUTS = [None, torch.bfloat16, torch.float16]


def _state(n):
    p = torch.randn(n)
    mq, ma = quantize(torch.randn(n) * torch.logspace(-5, 0, n)[torch.randperm(n)], True)
    vq, va = quantize(torch.rand(n) * torch.logspace(-8, 0, n)[torch.randperm(n)], False)
    return [p, mq, ma, vq, va]


def _run(backend, state, grads, out, flags, lr=1e-3):
    state = [t.clone() for t in state]
    out = None if out is None else out.clone()
    step = torch.tensor(3)
    for g, f in zip(grads, flags):
        adamw8bit_step_(*state, g, out, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.05, step=step, grad_scale=torch.tensor(0.5),
                        found_inf=torch.tensor(f), backend=backend)
    return state, out, step


def _bits(t):
    """Exact bit patterns (NaN payloads included), so NaN == NaN only when the bits agree."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8) \
        if t.dtype == torch.uint8 else t.view(torch.int16)


def _assert_same(want, got):
    names = ["master", "m_q", "m_absmax", "v_q", "v_absmax"]
    for name, a, b in zip(names, want[0], got[0]):
        bad = (_bits(a) != _bits(b)).nonzero()
        assert bad.numel() == 0, f"{name}: {bad.numel()} differ, first at {bad[:4].flatten()}"
    if want[1] is not None:
        assert torch.equal(_bits(want[1]), _bits(got[1])), "param_out"
    assert int(got[2]) == int(want[2])


def _grads(n, gdt, k=2):
    return [(torch.randn(n) * torch.logspace(-4, 1, n)[torch.randperm(n)]).to(gdt)
            for _ in range(k)]


@pytest.mark.parametrize("blocks", [1, 3, 64, 1031])
def test_each_isa_equals_the_reference_bitwise_across_sizes(cpu_isa, blocks):
    n = BLOCK * blocks
    state = _state(n)
    grads = _grads(n, torch.float32)
    flags = [False, False]
    want = _run("reference", state, grads, None, flags)
    _assert_same(want, _run("cpu", state, grads, None, flags))


@pytest.mark.parametrize("gdt", GRADS, ids=["g32", "gbf16", "gfp16"])
@pytest.mark.parametrize("odt", OUTS, ids=["none", "obf16", "ofp16"])
def test_each_isa_grad_and_out_dtypes_with_a_skipped_step(cpu_isa, gdt, odt):
    n = BLOCK * 5
    state = _state(n)
    grads = _grads(n, gdt, 3)
    out = None if odt is None else torch.randn(n).to(odt)
    flags = [False, True, False]  # the middle step is skipped: nothing may change
    want = _run("reference", state, grads, out, flags)
    got = _run("cpu", state, grads, out, flags)
    _assert_same(want, got)
    assert int(got[2]) == 5
    skipped = _run("cpu", state, grads[:1], out, [True])
    for a, b in zip(state, skipped[0]):
        assert torch.equal(_bits(a), _bits(b))


def _edge_case():
    """NaN, +-inf and -0.0 grads (each in its own block, so the other blocks stay finite),
    moments that land exactly on a midpoint, an all-zero block (absmax 0)."""
    nb = 8
    n = BLOCK * nb
    state = _state(n)
    g = torch.randn(n) * 1e-2
    g[0 * BLOCK + 5] = float("nan")
    g[1 * BLOCK + 7] = float("inf")
    g[2 * BLOCK + 9] = float("-inf")
    g[3 * BLOCK:4 * BLOCK:2] = -0.0
    zs = torch.zeros(BLOCK)
    for b in (4, 5):  # zero moments in: m = (1-b1) * g, v = (1-b2) * g * g
        state[1][b * BLOCK:(b + 1) * BLOCK] = quantize(zs, True)[0]
        state[2][b] = 0.0
        state[3][b * BLOCK:(b + 1) * BLOCK] = quantize(zs, False)[0]
        state[4][b] = 0.0
    g[4 * BLOCK:5 * BLOCK] = 0.0  # block 4: m = v = 0 (absmax 0, codes of 0 / 1)
    # block 5: m / absmax on a midpoint exactly for most elements (absmax reached at j = 0)
    s_mid = midpoints(True, "cpu")
    gs = torch.ones(BLOCK)
    gs[1:] = s_mid[torch.randint(0, 255, (BLOCK - 1,))]
    g[5 * BLOCK:6 * BLOCK] = gs / 0.5  # grad_scale 0.5 in _run: exact
    m5 = torch.tensor(0.1, dtype=torch.float32) * gs  # (1-b1) rounded to fp32, times g
    assert torch.isin(m5 / m5.abs().max(), s_mid).sum() > BLOCK // 2, "lost the midpoint hits"
    return state, [g]


def test_each_isa_edge_values(cpu_isa):
    state, grads = _edge_case()
    want = _run("reference", state, grads, None, [False])
    _assert_same(want, _run("cpu", state, grads, None, [False]))
    assert torch.isnan(want[0][2][0]) and torch.isnan(want[0][4][0])  # NaN reaches the absmax
    assert int(want[0][1][5]) == 255  # a NaN's code: torch.bucketize puts it above every midpoint
    zero_code = torch.bucketize(torch.zeros(1), midpoints(True, "cpu"))
    assert int(want[0][1][4 * BLOCK]) == int(zero_code)  # an all-zero block: codes of 0
    # a second step reads the NaN/inf absmax and the 255 codes back
    grads2 = [torch.randn(state[0].numel())]
    _assert_same(_run("reference", want[0], grads2, None, [False]),
                 _run("cpu", want[0], grads2, None, [False]))


def test_every_host_backend_edge_values(backend):
    """The same edge values on the Triton interpreter (and the cpu op at its best ISA)."""
    state, grads = _edge_case()
    _assert_same(_run("reference", state, grads, None, [False]),
                 _run(backend, state, grads, None, [False]))


def test_lr_off_by_one_percent_is_caught(cpu_isa):
    n = BLOCK * 16
    state = _state(n)
    grads = _grads(n, torch.float32)
    want = _run("reference", state, grads, None, [False, False])
    got = _run("cpu", state, grads, None, [False, False], lr=1e-3 * 1.01)
    assert not torch.equal(want[0][0], got[0][0])
