"""Issue 40: the fused CPU compact-master AdamW op (csrc/cpu/compact_adam_cpu.cpp; Note: fused
compact step on the CPU, in state/compact_master.py) is bit for bit the chain it replaces:
compact_expand -> the cpu adam_step (param_out = the params) -> compact_store (+ its NaN flag),
on every instruction set this CPU has (op.force_isa: avx512, avx2, scalar).

Fresh random data per case. Masters drawn to hit every branch of the bit logic (random values,
exact ties at both parities of the high half, low halves 0x7FFF / 0x8001, +-0), and every one
of the 2^16 low halves under several high halves; sizes 8 (one tie byte), 24 (n % 16 == 8: the
AVX-512 path's one-byte tail), 1016, 4104, 32776 and 278024 (several work items and threads,
odd tails); AdamW and Adam-L2 with weight decay; fp32, bf16 and fp16 grads; grad_scale 0.5; two
steps in a row; 1 and 2 threads. Compared bitwise: low halves, tie bytes, bf16 params, m, v, the
step and the NaN flag. A skipped step (found_inf) writes nothing, step included, and still
flags a NaN master, as the chain does; an inf grad makes a NaN master: the flag set in both.
ZeroAdamW(master="compact", backend="cpu") takes the op and equals master="fp32" bit for bit.
Negative control: the op fed tie bytes with one bit dropped must differ from the chain.
"""

from __future__ import annotations

import pytest
import torch

from zerokern import kernels
from zerokern.state import compact_master as C

from .test_compact_triton_step import _masters  # the same tie-heavy masters

HYPER = dict(lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)  # exaggerated
HIGHS = [0x0000, 0x8000, 0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x0001, 0x4120]
SIZES = [8, 24, 1016, 4104, 32776, 278024]



def _every_low_half() -> torch.Tensor:
    """Every low half under each high half of HIGHS (shuffled), 8 x 2^16 masters."""
    lo = torch.arange(65536, dtype=torch.int64)
    bits = torch.cat([(h << 16) | lo for h in HIGHS])
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return bits.view(torch.float32)[torch.randperm(bits.numel())].contiguous()


def _state(x: torch.Tensor, grad_dtype=torch.bfloat16):
    n = x.numel()
    low = torch.empty(n, dtype=torch.int16)
    ties = torch.empty(n // 8, dtype=torch.uint8)
    C.compact_(low, ties, x)
    assert ties.any() or n < 64
    grad = torch.randn(n) * torch.logspace(-4, 1, n)[torch.randperm(n)]
    return dict(low=low, ties=ties, param=x.to(torch.bfloat16),
                m=torch.randn(n) * 0.1, v=torch.rand(n) * 0.01, grad=grad.to(grad_dtype),
                step=torch.tensor(6, dtype=torch.int64), nan=torch.zeros((), dtype=torch.bool))


def _clone(s):
    return {k: v.clone() for k, v in s.items()}


def _chain(s, adamw, grad_scale, found_inf, hyper):
    x = C.expand_(torch.empty(s["low"].numel()), s["low"], s["ties"], s["param"])
    kernels.adam_step_(x, s["m"], s["v"], s["grad"], s["param"], adamw=adamw, step=s["step"],
                       grad_scale=grad_scale, found_inf=found_inf, backend="cpu", **hyper)
    C.compact_(s["low"], s["ties"], x, s["nan"])


def _fused(s, adamw, grad_scale, found_inf, hyper):
    C.compact_adam_step_(s["low"], s["ties"], s["param"], s["m"], s["v"], s["grad"], s["nan"],
                         adamw=adamw, step=s["step"], grad_scale=grad_scale,
                         found_inf=found_inf, **hyper)


def _bitwise_diff(a, b):
    return [k for k in a if not torch.equal(a[k].view(-1).view(torch.uint8),
                                            b[k].view(-1).view(torch.uint8))]


def _no(flag=False):
    return torch.tensor(flag)


@pytest.fixture
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32, torch.float16],
                         ids=["gbf16", "gf32", "gf16"])
def test_fused_equals_chain_bitwise(cpu_isa, threads, n, adamw, grad_dtype):
    s = _state(_masters(n), grad_dtype)
    ref, got = _clone(s), _clone(s)
    gs = torch.tensor(0.5)
    for _ in range(2):  # two steps: the second starts from a compacted result
        _chain(ref, adamw, gs, _no(), HYPER)
        _fused(got, adamw, gs, _no(), HYPER)
    assert _bitwise_diff(ref, got) == []
    assert int(got["step"]) == 8 and not bool(got["nan"])
    assert not torch.equal(got["param"], s["param"])  # it did update


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
def test_every_low_half_and_tie_bitwise(cpu_isa, adamw):
    s = _state(_every_low_half())
    ref, got = _clone(s), _clone(s)
    hyper = dict(HYPER, lr=1e-4)  # small steps: many masters stay next to their tie
    _chain(ref, adamw, torch.tensor(1.0), _no(), hyper)
    _fused(got, adamw, torch.tensor(1.0), _no(), hyper)
    assert _bitwise_diff(ref, got) == []
    # a tie bit under each odd high half (0x3F81, 0xBF81, 0x0001), and new ties after the step
    assert int(C.unpack_ties(s["ties"]).sum()) == 3 and C.unpack_ties(got["ties"]).any()


def test_random_tie_bits_expand_alike(cpu_isa):
    """Tie bits set anywhere (not only at low half 0x8000): the op expands them as the chain's
    compact_expand does, so the results still agree."""
    s = _state(_masters(4104))
    s["ties"] = torch.randint(0, 256, s["ties"].shape, dtype=torch.uint8)
    ref, got = _clone(s), _clone(s)
    _chain(ref, True, torch.tensor(2.0), _no(), HYPER)
    _fused(got, True, torch.tensor(2.0), _no(), HYPER)
    assert _bitwise_diff(ref, got) == []


@pytest.mark.parametrize("found_inf", [torch.tensor(True), torch.tensor(1.0)], ids=["bool", "f32"])
def test_skipped_step_writes_nothing_and_still_flags_a_nan_master(cpu_isa, found_inf):
    s = _state(_masters(4104))
    ref, got = _clone(s), _clone(s)
    _chain(ref, True, torch.tensor(1.0), found_inf, HYPER)
    _fused(got, True, torch.tensor(1.0), found_inf, HYPER)
    assert _bitwise_diff(s, got) == [] and _bitwise_diff(ref, got) == []
    # a NaN master (param 0x7FC0 over low half 0x0001, no tie bit: as compact_ would store
    # it): the chain's compact_ flags it on a skipped step too; the op does the same and still
    # writes nothing
    s["param"].view(torch.int16)[100] = 0x7FC0
    s["low"][100] = 1
    s["ties"][100 // 8] &= ~(1 << (100 % 8))
    ref, got = _clone(s), _clone(s)
    _chain(ref, True, torch.tensor(1.0), found_inf, HYPER)
    _fused(got, True, torch.tensor(1.0), found_inf, HYPER)
    assert bool(ref["nan"]) and bool(got["nan"])
    assert _bitwise_diff(dict(s, nan=got["nan"]), got) == []
    assert _bitwise_diff(ref, got) == []


@pytest.mark.parametrize("n", [24, 32776])
def test_nan_master_sets_the_flag_as_the_chain_does(cpu_isa, n):
    s = _state(_masters(n))
    s["grad"][n - 3] = float("inf")  # m / denom = inf / inf: a NaN master (not skipped)
    ref, got = _clone(s), _clone(s)
    _chain(ref, True, torch.tensor(1.0), _no(), HYPER)
    _fused(got, True, torch.tensor(1.0), _no(), HYPER)
    assert bool(ref["nan"]) and bool(got["nan"])
    assert _bitwise_diff(ref, got) == []  # NaN params as 0xFFFF in both


def test_negative_control_a_dropped_tie_bit_is_seen(cpu_isa):
    s = _state(_masters(1016))
    ref, got = _clone(s), _clone(s)
    i = int(torch.nonzero(s["ties"])[0])
    got["ties"][i] ^= got["ties"][i] & -got["ties"][i]  # drop one set tie bit
    _chain(ref, True, torch.tensor(1.0), _no(), HYPER)
    _fused(got, True, torch.tensor(1.0), _no(), HYPER)
    assert _bitwise_diff(ref, got) != []


def test_bad_shapes_raise_before_anything_changes(cpu_op):
    s = _state(_masters(16))
    got = _clone(s)
    with pytest.raises(ValueError, match="ties"):
        C.compact_adam_step_(got["low"], got["ties"][:1], got["param"], got["m"], got["v"],
                             got["grad"], got["nan"], adamw=True, step=got["step"],
                             grad_scale=torch.tensor(1.0), found_inf=_no(), **HYPER)
    with pytest.raises(RuntimeError, match="exp_avg"):
        C.compact_adam_step_(got["low"], got["ties"], got["param"], got["m"][:8], got["v"],
                             got["grad"], got["nan"], adamw=True, step=got["step"],
                             grad_scale=torch.tensor(1.0), found_inf=_no(), **HYPER)
    assert _bitwise_diff(s, got) == []


def _models():
    torch.manual_seed(0)
    mk = lambda: torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Linear(40, 8))  # noqa: E731
    model = mk().to(torch.bfloat16)
    twins = [mk().to(torch.bfloat16) for _ in range(2)]
    for t in twins:
        t.load_state_dict(model.state_dict())
    return [model, *twins]


def test_optimizer_takes_the_fused_op_and_matches_the_chain_and_fp32(cpu_op, monkeypatch):
    import zerokern as zk

    calls = []
    real = C.compact_adam_step_
    monkeypatch.setattr(C, "compact_adam_step_", lambda *a, **k: (calls.append(1), real(*a, **k)))
    models = _models()
    opts = [zk.ZeroAdamW(m, stage=1, precision="bf16", master=mm, backend="cpu", lr=1e-2)
            for m, mm in zip(models, ("compact", "compact", "fp32"))]
    for _ in range(4):
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        for i, (m, o) in enumerate(zip(models, opts)):
            monkeypatch.setattr(C, "FUSED_CPU", i != 1)  # model 1: the chunked chain
            o.backward(m(x).float().square().mean())
            o.step()
            o.zero_grad()
    assert calls  # the fused op ran
    for a, b, c in zip(*(m.parameters() for m in models)):  # the same master, bit for bit
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert torch.equal(a.view(torch.int16), c.view(torch.int16))
