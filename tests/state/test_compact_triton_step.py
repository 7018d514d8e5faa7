"""Issue 24, item 4: the fused Triton compact-master step (kernels/compact_triton.py) is bit for
bit the unfused chain it replaces: the CPU op's expand_ -> the Triton adam_step_ -> the CPU op's
compact_ (+ its NaN flag), under TRITON_INTERPRET=1 on CPU tensors.

Masters are drawn to hit every branch of the bit logic: random values, exact ties (low half
0x8000) at both parities of the high half, low halves just above and below 0x8000, +-0 and
negatives; sizes 8 (one tie byte), 1016, 4104 and 278016 (several programs, a partial last
program). Compared bitwise: low halves, tie bytes, bf16 params, m, v, the step and the NaN flag.
Also: a skipped step (found_inf) changes nothing, step included; a NaN lr sets the NaN flag in
both; AdamW and Adam-L2; fp32 and bf16 grads; ZeroAdamW(master="compact", backend="triton")
takes the fused path. Negative control: the fused step fed tie bytes with one bit flipped must
differ from the reference, so the comparison can fail.
The compiled sm_90 kernel's static checks are tests/kernels/test_compact_triton_compile.py;
the GPU run is tests/gpu/test_gpu.py::test_compact_master_fused_step_on_cuda (-m gpu).
"""

from __future__ import annotations

import pytest
import torch

from zerokern.kernels import compact_triton as CT
from zerokern.kernels import triton_kernels as tk
from zerokern.state import compact_master as C

HYPER = dict(lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)  # exaggerated


def _masters(n: int) -> torch.Tensor:
    x = torch.randn(n) * 3
    bits = x.view(torch.int32)
    k = torch.arange(n)
    lo = bits & 0xFFFF
    lo = torch.where(k % 5 == 0, torch.full_like(lo, 0x8000), lo)   # exact ties
    lo = torch.where(k % 7 == 1, torch.full_like(lo, 0x8001), lo)
    lo = torch.where(k % 11 == 2, torch.full_like(lo, 0x7FFF), lo)
    bits = (bits & ~0xFFFF) | lo
    bits = torch.where(k % 13 == 3, bits ^ 0x10000, bits)           # flip the high parity
    x = bits.view(torch.float32).clone()
    x[k % 97 == 4] = 0.0
    x[k % 89 == 5] = -0.0
    return x


def _state(n: int, grad_dtype):
    x = _masters(n)
    low = torch.empty(n, dtype=torch.int16)
    ties = torch.empty(n // 8, dtype=torch.uint8)
    C.compact_(low, ties, x)
    assert ties.any() or n < 64
    return dict(low=low, ties=ties, param=x.to(torch.bfloat16),
                m=torch.randn(n) * 0.1, v=torch.rand(n) * 0.01,
                grad=torch.randn(n).to(grad_dtype), step=torch.tensor(6, dtype=torch.int64),
                nan=torch.zeros((), dtype=torch.bool))


def _clone(s):
    return {k: v.clone() for k, v in s.items()}


def _unfused(s, adamw, grad_scale, found_inf, hyper):
    n = s["low"].numel()
    x = C.expand_(torch.empty(n), s["low"], s["ties"], s["param"])
    tk.adam_step_(x, s["m"], s["v"], s["grad"], s["param"], adamw=adamw, step=s["step"],
                  grad_scale=grad_scale, found_inf=found_inf, **hyper)
    C.compact_(s["low"], s["ties"], x, s["nan"])


def _fused(s, adamw, grad_scale, found_inf, hyper):
    CT.compact_adam_step_(s["low"], s["ties"], s["param"], s["m"], s["v"], s["grad"], s["nan"],
                          adamw=adamw, step=s["step"], grad_scale=grad_scale,
                          found_inf=found_inf, **hyper)


def _bitwise_diff(a, b):
    return [k for k in a if not torch.equal(a[k].view(-1).view(torch.uint8),
                                            b[k].view(-1).view(torch.uint8))]


@pytest.fixture(autouse=True)
def _cpu_op(cpu_op):  # the CPU op is the reference's expand/compact
    return cpu_op


@pytest.mark.parametrize("n", [8, 1016, 4104, 278016])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32], ids=["gbf16", "gf32"])
def test_fused_equals_unfused_bitwise(n, adamw, grad_dtype):
    s = _state(n, grad_dtype)
    ref, got = _clone(s), _clone(s)
    gs = torch.tensor(0.5)
    fi = torch.zeros((), dtype=torch.bool)
    for _ in range(2):  # two steps: the second starts from a compacted result
        _unfused(ref, adamw, gs, fi, HYPER)
        _fused(got, adamw, gs, fi, HYPER)
    assert _bitwise_diff(ref, got) == []
    assert int(got["step"]) == 8 and not bool(got["nan"])
    assert not torch.equal(got["param"], s["param"])  # it did update


def test_skipped_step_changes_nothing_and_nan_is_flagged():
    s = _state(4104, torch.bfloat16)
    got = _clone(s)
    _fused(got, True, torch.tensor(1.0), torch.ones((), dtype=torch.bool), HYPER)
    assert _bitwise_diff(s, got) == []
    ref, got = _clone(s), _clone(s)
    bad = dict(HYPER, lr=float("nan"))
    _unfused(ref, True, torch.tensor(1.0), torch.zeros((), dtype=torch.bool), bad)
    _fused(got, True, torch.tensor(1.0), torch.zeros((), dtype=torch.bool), bad)
    assert bool(ref["nan"]) and bool(got["nan"])
    # (the interpreter's unfused path also rounds by integer arithmetic: same NaN param bits;
    # compiled, cvt.rn writes another NaN pattern there: [Note: fused compact step])
    assert _bitwise_diff(ref, got) == []


def test_negative_control_a_flipped_tie_bit_is_seen():
    s = _state(1016, torch.bfloat16)
    ref, got = _clone(s), _clone(s)
    i = int(torch.nonzero(s["ties"])[0])
    got["ties"][i] ^= got["ties"][i] & -got["ties"][i]  # drop one set tie bit
    _unfused(ref, True, torch.tensor(1.0), torch.zeros((), dtype=torch.bool), HYPER)
    _fused(got, True, torch.tensor(1.0), torch.zeros((), dtype=torch.bool), HYPER)
    assert _bitwise_diff(ref, got) != []


def test_bad_shapes_raise_before_anything_changes():
    s = _state(16, torch.bfloat16)
    got = _clone(s)
    with pytest.raises(ValueError, match="ties"):
        CT.compact_adam_step_(got["low"], got["ties"][:1], got["param"], got["m"], got["v"],
                              got["grad"], got["nan"], adamw=True, step=got["step"],
                              grad_scale=torch.tensor(1.0),
                              found_inf=torch.zeros((), dtype=torch.bool), **HYPER)
    assert _bitwise_diff(s, got) == []


def test_optimizer_takes_the_fused_path(monkeypatch):
    import zerokern as zk

    calls = []
    real = CT.compact_adam_step_
    monkeypatch.setattr(CT, "compact_adam_step_", lambda *a, **k: (calls.append(1), real(*a, **k)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8)).to(torch.bfloat16)
    twin = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8)).to(torch.bfloat16)
    twin.load_state_dict(model.state_dict())
    opts = [zk.ZeroAdamW(m, stage=1, precision="bf16", master=mm, backend="triton", lr=1e-2)
            for m, mm in ((model, "compact"), (twin, "fp32"))]
    for _ in range(3):
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        for m, o in zip((model, twin), opts):
            o.backward(m(x).float().square().mean())
            o.step()
            o.zero_grad()
    assert calls  # the fused kernel ran
    for a, b in zip(model.parameters(), twin.parameters()):  # the same master, bit for bit
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
