"""grad_stats_: found_inf |= any non-finite; sumsq += sum(float32(grad)^2) (DESIGN §3).

Sizes are not multiples of any block size the backends use (CPU chunks of 16384 and vectors of
8/16 lanes, Triton blocks of 1024..65536 elements).
"""

from __future__ import annotations

import pytest
import torch

from zerokern import kernels as zk

from . import f64_reference as R

# One tolerance table for this file.
TOL = {
    # sumsq vs float64, relative. Each backend adds fp32 squares (each rounded once, u = 6e-8)
    # into fp32 partials and sums the partials in float64. The longest chain of fp32 additions
    # is ~270 on the CPU (16384-element chunks over 64 lanes, then a fixed tree), <= 32 for
    # Triton (iterations per lane + a log2(BLOCK) tree): worst cases 1.6e-5 and 2e-6, typical
    # (rounding errors of random sign) sqrt(270)*u = 1e-6. 1e-5 is 10x the typical error and
    # still 3 orders below a dropped or doubled block, a missing square, or an fp16 partial.
    "sumsq_rel": 1e-5,
}

# The interpreter's numpy warns on inf*0 and on squares past fp32's range: both are the data.
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

# [Note: the slow mark]: 278011 spans several CPU chunks and Triton blocks (45 cases, 11 s on 2
# loaded cores); it and 1_000_003 (about 1 s a case under the Triton interpreter, 18 cases) run
# in CI's -m slow pass
SIZES = [1, 127, 4097, *(pytest.param(n, marks=pytest.mark.slow) for n in (278011, 1_000_003))]
GRAD_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GRAD_IDS = ["f32", "f16", "bf16"]
# Non-finite values as raw bits per dtype: inf, -inf and a NaN with a payload (signalling).
NONFINITE = {
    torch.float32: {"inf": 0x7F800000, "-inf": 0xFF800000, "nan": 0x7FA5A5A5},
    torch.float16: {"inf": 0x7C00, "-inf": 0xFC00, "nan": 0xFD01},
    torch.bfloat16: {"inf": 0x7F80, "-inf": 0xFF80, "nan": 0x7F81},
}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def clean_grad(n: int, dtype) -> torch.Tensor:
    """Finite, nonzero gradients spanning 1e-4..10 (inside every dtype's normal range)."""
    return R.log_uniform(n, -4, 1).to(dtype)


def poke(grad: torch.Tensor, pos: int, pattern: int) -> None:
    """Write a raw bit pattern at grad[pos]."""
    width = 8 * grad.element_size()
    signed = pattern - (1 << width) if pattern >= 1 << (width - 1) else pattern
    grad.view(INT_VIEW[grad.dtype])[pos] = signed


def check_sumsq(sumsq: torch.Tensor, old: float, grad: torch.Tensor) -> None:
    want = old + R.sumsq_f64(grad)
    got = float(sumsq)
    rel = abs(got - want) / want
    assert rel <= TOL["sumsq_rel"], f"sumsq {got!r} vs float64 {want!r}: relative error {rel:.3g}"


def _flag(dtype, value=0.0):
    return torch.tensor(value, dtype=dtype) if dtype != torch.bool else torch.tensor(bool(value))


@pytest.mark.parametrize("kind", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=GRAD_IDS)
@pytest.mark.parametrize("n", SIZES)
def test_nonfinite_detected_anywhere(backend, n, dtype, kind):
    """At the first, a middle and the last index; found_inf as bool and as fp32."""
    grad = clean_grad(n, dtype)
    for flag_dtype in (torch.bool, torch.float32):
        found_inf = _flag(flag_dtype)
        zk.grad_stats_(grad, found_inf, torch.tensor(0.5), backend=backend)
        assert not found_inf.item(), "clean grads set found_inf"
    for pos in sorted({0, n // 2, n - 1}):
        g = grad.clone()
        poke(g, pos, NONFINITE[dtype][kind])
        for flag_dtype in (torch.bool, torch.float32):
            found_inf = _flag(flag_dtype)
            zk.grad_stats_(g, found_inf, torch.tensor(0.5), backend=backend)
            assert found_inf.item(), f"{kind} at [{pos}] of {n} missed (found_inf {flag_dtype})"
            assert found_inf.dtype == flag_dtype and found_inf.dim() == 0


@pytest.mark.parametrize("value", [True, 1.0, 2.5, -1.0])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=GRAD_IDS)
def test_found_inf_never_cleared(backend, dtype, value):
    """A flag already set (by another bucket or rank) stays set after clean grads."""
    grad = clean_grad(4097, dtype)
    found_inf = torch.tensor(value)
    sumsq = torch.tensor(3.0, dtype=torch.float64)
    zk.grad_stats_(grad, found_inf, sumsq, backend=backend)
    assert found_inf.item() != 0
    check_sumsq(sumsq, 3.0, grad)  # the norm is still accumulated


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=GRAD_IDS)
def test_largest_finite_values_are_not_overflow(backend, dtype):
    """The dtype's largest finite values (whose squares overflow fp32) are not infs."""
    grad = clean_grad(40961, dtype)
    big = torch.finfo(dtype).max
    grad[::997] = big
    grad[5::997] = -big
    for flag_dtype in (torch.bool, torch.float32):
        found_inf = _flag(flag_dtype)
        zk.grad_stats_(grad, found_inf, torch.tensor(0.0, dtype=torch.float64), backend=backend)
        assert not found_inf.item()


@pytest.mark.parametrize("sumsq_dtype", [torch.float32, torch.float64], ids=["ss32", "ss64"])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=GRAD_IDS)
@pytest.mark.parametrize("n", SIZES)
def test_sumsq_matches_f64(backend, n, dtype, sumsq_dtype):
    grad = clean_grad(n, dtype)
    old = float(torch.empty((), dtype=sumsq_dtype).uniform_(0.5, 2.0))  # accumulated into
    sumsq = torch.tensor(old, dtype=sumsq_dtype)
    found_inf = torch.tensor(False)
    zk.grad_stats_(grad, found_inf, sumsq, backend=backend)
    assert sumsq.dtype == sumsq_dtype and not found_inf.item()
    check_sumsq(sumsq, old, grad)
    # A second call accumulates again (a second bucket of the same shard).
    grad2 = clean_grad(n, dtype)
    before = float(sumsq)
    zk.grad_stats_(grad2, found_inf, sumsq, backend=backend)
    check_sumsq(sumsq, before, grad2)


def test_any_shape_is_flat(backend):
    """A 2-D contiguous grad is reduced like its flat view; an empty grad changes nothing."""
    grad = clean_grad(37 * 113, torch.bfloat16)
    s_flat, s_2d = torch.tensor(1.0), torch.tensor(1.0)
    zk.grad_stats_(grad, torch.tensor(False), s_flat, backend=backend)
    zk.grad_stats_(grad.view(37, 113), torch.tensor(False), s_2d, backend=backend)
    R.assert_bitwise("sumsq", s_2d, s_flat)
    sumsq, found_inf = torch.tensor(1.25), torch.tensor(0.0)
    zk.grad_stats_(torch.empty(0, dtype=torch.float16), found_inf, sumsq, backend=backend)
    assert sumsq.item() == 1.25 and found_inf.item() == 0.0


@pytest.mark.parametrize("sumsq_dtype", [torch.float32, torch.float64], ids=["ss32", "ss64"])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=GRAD_IDS)
def test_deterministic(backend, dtype, sumsq_dtype):
    """The same grads give the same bits every time (two-stage reduction, no atomics)."""
    grad = clean_grad(1_000_003, dtype)
    results = []
    for _ in range(3):
        sumsq = torch.tensor(0.25, dtype=sumsq_dtype)
        zk.grad_stats_(grad, torch.tensor(False), sumsq, backend=backend)
        results.append(sumsq)
    for r in results[1:]:
        R.assert_bitwise("sumsq", r, results[0])


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=GRAD_IDS)
def test_cpu_thread_count_does_not_change_bits(cpu_op, dtype):
    """The CPU reduction uses fixed chunks, so 1 and 2 threads give the same bits."""
    grad = clean_grad(1_000_003, dtype)
    saved = torch.get_num_threads()
    out = {}
    try:
        for threads in (1, 2, saved):
            torch.set_num_threads(threads)
            sumsq = torch.tensor(0.0, dtype=torch.float64)
            zk.grad_stats_(grad, torch.tensor(False), sumsq, backend="cpu")
            out[threads] = sumsq
    finally:
        torch.set_num_threads(saved)
    R.assert_bitwise("sumsq (2 threads vs 1)", out[2], out[1])
    R.assert_bitwise(f"sumsq ({saved} threads vs 1)", out[saved], out[1])
    check_sumsq(out[1], 0.0, grad)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=GRAD_IDS)
def test_cpu_every_isa(cpu_isa, dtype):
    """Each CPU instruction-set path: sums within tolerance and non-finite values caught at
    vector-lane, vector-body, chunk and tail boundaries."""
    n = 40961  # 2 chunks of 16384 + a partial chunk ending in a 1-element tail
    grad = clean_grad(n, dtype)
    sumsq = torch.tensor(0.0, dtype=torch.float64)
    zk.grad_stats_(grad, torch.tensor(False), sumsq, backend="cpu")
    check_sumsq(sumsq, 0.0, grad)
    for pos in (0, 7, 8, 15, 16, 63, 64, 16383, 16384, 32767, 40959, 40960):
        for kind in ("inf", "nan"):
            g = grad.clone()
            poke(g, pos, NONFINITE[dtype][kind])
            found_inf = torch.tensor(False)
            zk.grad_stats_(g, found_inf, torch.tensor(0.0), backend="cpu")
            assert found_inf.item(), f"{cpu_isa}: {kind} at [{pos}] missed"


def test_negative_control_check_sumsq_catches_a_dropped_element():
    grad = clean_grad(127, torch.float32)
    grad[-1] = 1.0  # a square that matters next to 126 others of <= 100
    wrong = torch.tensor(R.sumsq_f64(grad[:-1]))
    with pytest.raises(AssertionError, match="sumsq"):
        check_sumsq(wrong, 0.0, grad)
    twice = torch.tensor(R.sumsq_f64(grad) + 1.0)  # the last element counted twice
    with pytest.raises(AssertionError, match="sumsq"):
        check_sumsq(twice, 0.0, grad)
    check_sumsq(torch.tensor(R.sumsq_f64(grad)), 0.0, grad)  # and the right sum passes
