"""The 16-bit cast-back of adam_step_: param_out is bitwise master.to(dtype) (DESIGN §3).

torch's own CPU conversion is the oracle (round to nearest even; fp16 NaNs keep the sign and the
top payload bits, bf16 NaNs all become 0xFFFF). A few hand-computed bit patterns check that the
oracle itself rounds as IEEE says, and two wrong roundings are shown to differ on the data.
"""

from __future__ import annotations

import pytest
import torch

from zerokern import kernels as zk

from . import f64_reference as R

# One tolerance table for this file: the cast-back has no tolerance.
TOL = {
    # param_out must equal master.to(dtype) bit for bit (DESIGN §3 "cast-back bitwise equal"),
    # NaN payloads and the sign of zero included; compared through .view(torch.int16).
    "param_out_bits": 0,
}

# The interpreter's numpy warns on inf*0 and on fp32->fp16 overflow: both are the data here.
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

OUT_DTYPES = [torch.float16, torch.bfloat16]
OUT_IDS = ["f16", "bf16"]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True)
# lr = 0 and no weight decay: p - 0 * update, so master keeps its value (and the special values
# reach the cast unchanged, apart from -0 turning +0 where the update is negative and NaNs
# being quieted; the comparison is with master after the step, so that is allowed).
HP_FROZEN = dict(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)


def _call(backend, case, hp):
    zk.adam_step_(*case.buffers(), **hp, **case.kwargs(), backend=backend)


def _assert_cast(case: R.AdamCase) -> None:
    assert TOL["param_out_bits"] == 0
    R.assert_bitwise("param_out", case.param_out, case.master.to(case.param_out.dtype))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "gbf16"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=OUT_IDS)
@pytest.mark.parametrize("n", [1, 127, 4097, 278011])
def test_param_out_bitwise_after_real_steps(backend, n, out_dtype, grad_dtype):
    case = R.make_case(n, grad_dtype, out_dtype)
    for _ in range(2):
        master_before = case.master.clone()
        _call(backend, case, HP)
        assert not torch.equal(case.master, master_before)  # a real step moved master
        _assert_cast(case)
        case.new_grad_()


def _special_case(n: int, out_dtype, grad_dtype=torch.float32) -> R.AdamCase:
    case = R.make_case(n, grad_dtype, out_dtype)
    case.master.copy_(R.spread(R.special_values(out_dtype), n))
    case.param_out.view(torch.int16).fill_(0x7D01)  # poison: a NaN pattern torch never writes
    return case


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=OUT_IDS)
@pytest.mark.parametrize("n", [331 * 3 + 13, 4097])
def test_special_values(backend, n, out_dtype):
    """Ties (even and odd), subnormals, +-0, +-inf, NaN payloads, the overflow boundary."""
    case = _special_case(n, out_dtype)
    finite = case.master.isfinite() & (case.master != 0)
    master_before = case.master.clone()
    _call(backend, case, HP_FROZEN)
    # lr = 0 really left every finite nonzero value alone.
    R.assert_bitwise("master (lr=0)", case.master[finite], master_before[finite])
    _assert_cast(case)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=OUT_IDS)
def test_special_values_cpu_every_isa(cpu_isa, out_dtype):
    """The vector conversions (F16C, AVX-512 bf16 rounding) and the scalar tails agree."""
    for n in (5, 331 * 4 + 29, 40961):
        case = _special_case(n, out_dtype, grad_dtype=torch.float16)
        _call("cpu", case, HP_FROZEN)
        _assert_cast(case)


# Hand-computed expectations: (fp32 bit pattern, fp16 bits, bf16 bits).
KNOWN = [
    (0x3F800000, 0x3C00, 0x3F80),  # 1.0
    (0x3F801000, 0x3C00, 0x3F80),  # 1 + 2^-11: fp16 tie, even neighbour 0x3C00 -> down
    (0x3F803000, 0x3C02, 0x3F80),  # 1 + 3*2^-11: fp16 tie, odd neighbour 0x3C01 -> up
    (0x3F808000, 0x3C04, 0x3F80),  # bf16 tie, even neighbour 0x3F80 -> down
    (0x3F818000, 0x3C0C, 0x3F82),  # bf16 tie, odd neighbour 0x3F81 -> up
    (0x477FE000, 0x7BFF, 0x4780),  # 65504 = fp16 max (bf16: 65536)
    (0x477FEFFF, 0x7BFF, 0x4780),  # 65519.99: just below the fp16 overflow tie
    (0x477FF000, 0x7C00, 0x4780),  # 65520: tie with 65536, odd 0x7BFF -> inf
    (0x33000000, 0x0000, 0x3300),  # 2^-25: half the smallest fp16 subnormal, tie -> 0 (even)
    (0x33000001, 0x0001, 0x3300),  # just above it -> smallest subnormal 2^-24
    (0x33C00000, 0x0002, 0x33C0),  # 1.5 * 2^-24: tie between subnormals 1 and 2 -> 2 (even)
    (0x7F7F8000, 0x7C00, 0x7F80),  # bf16 tie above bf16 max, odd 0x7F7F -> inf
    (0x7F7F7FFF, 0x7C00, 0x7F7F),  # just below that tie -> bf16 max
    (0x80000000, 0x8000, 0x8000),  # -0
    (0x00008000, 0x0000, 0x0000),  # fp32 subnormal, bf16 tie with even 0x0000 -> 0
    (0x00018000, 0x0000, 0x0002),  # fp32 subnormal, bf16 tie with odd 0x0001 -> 0x0002
    (0xFF800000, 0xFC00, 0xFF80),  # -inf
    (0x7FC00000, 0x7E00, 0xFFFF),  # quiet NaN (torch CPU writes every bf16 NaN as 0xFFFF)
    (0xFFA5A5A5, 0xFF2D, 0xFFFF),  # negative NaN: fp16 keeps sign + top payload, quiets it
]


def test_oracle_rounds_as_ieee():
    """torch's .to(dtype) (the oracle) gives the hand-computed bits for these inputs."""
    x = R.from_bits([k[0] for k in KNOWN])
    for col, dt in ((1, torch.float16), (2, torch.bfloat16)):
        got = [v & 0xFFFF for v in x.to(dt).view(torch.int16).tolist()]
        want = [k[col] for k in KNOWN]
        bad = [(hex(k[0]), hex(g), hex(w)) for k, g, w in zip(KNOWN, got, want) if g != w]
        assert not bad, f"{dt}: (input, torch, expected) {bad}"


def test_negative_control_wrong_roundings_differ():
    """Truncation and round-half-away-from-zero give other bits on the special values, so the
    bitwise check would catch a kernel using either."""
    x = R.special_values(torch.bfloat16)
    x = x[~x.isnan()]
    b = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rne = x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    trunc = b >> 16
    half_away = (b + 0x8000) >> 16
    assert (trunc != rne).any() and (half_away != rne).any()
    y = R.special_values(torch.float16)
    y = y[~y.isnan()]
    rne16 = y.to(torch.float16)
    # fp16 truncation: where RNE rounded away from zero, the next 16-bit value toward zero
    # (sign-magnitude: one less in the raw bits, for either sign).
    up = rne16.float().abs() > y.abs()
    trunc16 = torch.where(up, rne16.view(torch.int16) - 1, rne16.view(torch.int16))
    assert (trunc16 != rne16.view(torch.int16)).any()


@pytest.mark.parametrize("backend", ["reference", "cpu"], indirect=True)
def test_negative_control_poison_would_show(backend):
    """The poison in param_out is overwritten by a real step (the no-op tests rely on it)."""
    case = _special_case(4097, torch.bfloat16)
    poisoned = case.param_out.clone()
    _call(backend, case, HP_FROZEN)
    assert (R.bits(case.param_out) != R.bits(poisoned)).float().mean() > 0.9
