"""Float64 model of DESIGN §3 for the kernel tests, and the random data and checks they share.

The model is written from the formula in DESIGN §3 alone and imports nothing from zerokern, so a
mistake shared by `zerokern.kernels.reference` and the kernels still shows up here.

Error model. An fp32 kernel rounds a few times per line of §3 (unit roundoff u = 2^-24 = 6e-8).
The contract (fp32 relative error <= 1e-6, about 17u) is applied per element to the *magnitude
of the terms each line sums*, not to the result: m = b1*m + (1-b1)*g can cancel to far below the
rounding error of its terms, and a bound relative to the result would fail correct code there.
`adam_f64` returns, for master, exp_avg and exp_avg_sq, the float64 result and that magnitude
(`scale`); a test's bound is tol["rel"] * scale + tol["floor"], with the numbers in the test
file's tolerance table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Dict

import torch

F64 = torch.float64

# ---------------------------------------------------------------------------------------------
# The float64 model
# ---------------------------------------------------------------------------------------------


def f64(x) -> float:
    """A hyperparameter (float or 0-d tensor) as a Python float (a double)."""
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def bias_corrections(t: int, beta1: float, beta2: float):
    """(1 - beta1^t, 1 - beta2^t) in double precision; t counts from 1."""
    return 1.0 - beta1**t, 1.0 - beta2**t


@dataclass
class Expected:
    """Float64 results of one step and the per-element magnitudes their errors scale with."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    scale: Dict[str, torch.Tensor]


def adam_f64(
    master,
    exp_avg,
    exp_avg_sq,
    grad,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    adamw: bool,
    t: int,
    grad_scale,
) -> Expected:
    """One step of DESIGN §3 in float64 on copies of the inputs (t = step + 1).

    Error scales (first order; every fp32 operation contributes at most ~u of its operands):
      g:      |g| (+ wd*|p| for Adam + L2, whose sum can cancel)
      m:      b1*|m| + (1-b1)*|g|
      v:      b2*v + (1-b2)*|g|^2
      master: |p*decay|                      the decayed parameter
            + step_size * scale_m / denom    an error in m carried through the update
            + upd * (1 + scale_v / (2 v) * sq / denom)
                                             the update's own roundings, and an error in v
                                             through sqrt (d sqrt(v) / sqrt(v) = dv / 2v)
    where denom = sqrt(v)/sqrt(bc2) + eps, sq = sqrt(v)/sqrt(bc2), upd = step_size*|m|/denom.
    """
    lr, b1, b2 = f64(lr), f64(beta1), f64(beta2)
    eps, wd, gs = f64(eps), f64(weight_decay), f64(grad_scale)
    p = master.to(F64)
    g = grad.to(F64) * gs
    g_mag = g.abs()
    if adamw:
        p = p * (1.0 - lr * wd)
    else:
        g = g + wd * p
        g_mag = g_mag + wd * p.abs()
    m0, v0 = exp_avg.to(F64), exp_avg_sq.to(F64)
    m = b1 * m0 + (1.0 - b1) * g
    v = b2 * v0 + (1.0 - b2) * g * g
    bc1, bc2 = bias_corrections(t, b1, b2)
    step_size = lr / bc1
    sq = v.sqrt() / math.sqrt(bc2)
    denom = sq + eps
    p_new = p - step_size * m / denom

    scale_m = b1 * m0.abs() + (1.0 - b1) * g_mag
    scale_v = b2 * v0.abs() + (1.0 - b2) * g_mag * g_mag
    upd = step_size * m.abs() / denom
    v_rel = scale_v / v.clamp_min(torch.finfo(F64).tiny)
    scale_p = p.abs() + step_size * scale_m / denom + upd * (1.0 + 0.5 * v_rel * sq / denom)
    return Expected(p_new, m, v, {"master": scale_p, "exp_avg": scale_m, "exp_avg_sq": scale_v})


def sumsq_f64(grad: torch.Tensor) -> float:
    """sum(float32(grad)^2), exactly enough: every fp32/fp16/bf16 value is exact in float64."""
    g = grad.reshape(-1).to(F64)
    return float((g * g).sum())


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def assert_within(
    name: str, got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, rel: float, floor: float
) -> float:
    """|got - want| <= rel*scale + floor elementwise (NaN fails); returns the worst err/bound."""
    got64 = got.reshape(-1).to(F64)
    want, scale = want.reshape(-1), scale.reshape(-1)
    err = (got64 - want).abs()
    bound = rel * scale + floor
    ratio = torch.where(err <= bound, err / bound, torch.full_like(err, math.inf))
    if ratio.numel() == 0:
        return 0.0
    worst = int(ratio.argmax())
    if math.isinf(float(ratio[worst])):
        nbad = int((~(err <= bound)).sum())
        raise AssertionError(
            f"{name}: {nbad}/{err.numel()} elements outside the bound {rel:g}*scale + {floor:g}; "
            f"worst at [{worst}]: got {float(got64[worst])!r} want {float(want[worst])!r} "
            f"|err| {float(err[worst]):.3e} bound {float(bound[worst]):.3e} "
            f"(err/bound {float(err[worst] / bound[worst]):.3g})"
        )
    return float(ratio[worst])


def check_step(case: AdamCase, want: Expected, tol: dict) -> None:
    """master, exp_avg and exp_avg_sq of `case` against the float64 model."""
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert_within(
            name,
            getattr(case, name),
            getattr(want, name),
            want.scale[name],
            tol["rel"],
            tol["floor"],
        )


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a tensor (same size integer view), for exact comparisons."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def assert_bitwise(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-for-bit equality (NaN payloads and the sign of zero included)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype)
    gb, wb = bits(got).reshape(-1), bits(want).reshape(-1)
    diff = (gb != wb).nonzero()
    if diff.numel():
        i = int(diff[0])
        width = 2 * got.element_size()
        raise AssertionError(
            f"{name}: {diff.numel()}/{gb.numel()} elements differ bitwise; first at [{i}]: "
            f"got 0x{int(gb[i]) & ((1 << 4 * width) - 1):0{width}x} "
            f"want 0x{int(wb[i]) & ((1 << 4 * width) - 1):0{width}x} "
            f"(got {got.reshape(-1)[i].item()!r}, want {want.reshape(-1)[i].item()!r})"
        )


# ---------------------------------------------------------------------------------------------
# Random data (never zeros: magnitudes are log-uniform, signs random)
# ---------------------------------------------------------------------------------------------


def log_uniform(n: int, lo: float, hi: float, device="cpu", signed: bool = True) -> torch.Tensor:
    """fp32 values with |x| = 10^U(lo, hi): every element is nonzero and magnitudes spread over
    (hi - lo) decades, so both the decayed parameter and the update dominate somewhere."""
    mag = torch.pow(10.0, torch.empty(n, dtype=F64, device=device).uniform_(lo, hi))
    if signed:
        mag = torch.where(torch.rand(n, device=device) < 0.5, -mag, mag)
    return mag.to(torch.float32)


def default_grad_scale(grad_dtype: torch.dtype) -> float:
    """fp16: unscale a 1024 loss scale; bf16: a clip coefficient that is not a power of two (so
    the product rounds); fp32: 1."""
    return {torch.float16: 1.0 / 1024, torch.bfloat16: 0.7, torch.float32: 1.0}[grad_dtype]


@dataclass
class AdamCase:
    """The tensors of one `adam_step_` call."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    param_out: torch.Tensor | None
    step: torch.Tensor
    grad_scale: torch.Tensor
    found_inf: torch.Tensor

    def tensors(self) -> Dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }

    def snapshot(self) -> Dict[str, torch.Tensor]:
        return {k: t.clone() for k, t in self.tensors().items()}

    def clone(self) -> AdamCase:
        return AdamCase(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name).clone()
                for f in fields(self)
            }
        )

    def kwargs(self) -> dict:
        """The keyword tensors of adam_step_ (step, grad_scale, found_inf)."""
        return dict(step=self.step, grad_scale=self.grad_scale, found_inf=self.found_inf)

    def buffers(self) -> tuple:
        return (self.master, self.exp_avg, self.exp_avg_sq, self.grad, self.param_out)

    def new_grad_(self) -> None:
        """Fresh gradients for the next step (same dtype, same scale)."""
        self.grad.copy_(
            _grad_values(
                self.grad.numel(), self.grad.dtype, float(self.grad_scale), self.grad.device
            )
        )


def _grad_values(n, dtype, grad_scale, device):
    # The unscaled gradient spans 1e-4..1e-1; it is stored multiplied by 1/grad_scale (the loss
    # scale), so fp16 grads sit well inside fp16's normal range.
    return (log_uniform(n, -4, -1, device) / grad_scale).to(dtype)


def make_case(
    n: int,
    grad_dtype=torch.float32,
    out_dtype=None,
    *,
    step: int = 0,
    step_dtype=torch.int64,
    grad_scale: float | None = None,
    found_inf_dtype=torch.bool,
    device="cpu",
) -> AdamCase:
    """Random master/m/v/grad (never zeros) with a param_out already holding master's cast."""
    gs = default_grad_scale(grad_dtype) if grad_scale is None else grad_scale
    master = log_uniform(n, -4, 0, device)
    exp_avg = log_uniform(n, -4, -1, device)
    exp_avg_sq = log_uniform(n, -4, -1, device, signed=False) ** 2
    grad = _grad_values(n, grad_dtype, gs, device)
    param_out = None if out_dtype is None else master.to(out_dtype)
    return AdamCase(
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        param_out,
        torch.tensor(step, dtype=step_dtype, device=device),
        torch.tensor(gs, dtype=torch.float32, device=device),
        torch.zeros((), dtype=found_inf_dtype, device=device),
    )


def expected_step(case: AdamCase, hp: dict) -> Expected:
    """The float64 model applied to `case` as it is now (t = case.step + 1)."""
    return adam_f64(
        case.master,
        case.exp_avg,
        case.exp_avg_sq,
        case.grad,
        t=int(case.step.item()) + 1,
        grad_scale=case.grad_scale,
        **hp,
    )


# ---------------------------------------------------------------------------------------------
# Special values for the cast-back (fp32 bit patterns)
# ---------------------------------------------------------------------------------------------


def from_bits(patterns) -> torch.Tensor:
    """fp32 values from unsigned 32-bit patterns."""
    b = torch.tensor([p & 0xFFFFFFFF for p in patterns], dtype=torch.int64)
    return (b - ((b >> 31) << 32)).to(torch.int32).view(torch.float32)


def special_values(out_dtype: torch.dtype) -> torch.Tensor:
    """fp32 values where a 16-bit cast is easy to get wrong, for `out_dtype`.

    Ties (exactly halfway between two 16-bit values, with an even and an odd lower neighbour),
    one fp32 ulp either side of a tie, subnormals of the 16-bit format and fp32 subnormals, +-0,
    +-inf, NaNs with assorted payloads (quiet, signalling, negative), and the overflow boundary.
    """
    nans = [
        0x7FC00000,
        0xFFC00000,
        0x7F800001,
        0xFF800001,
        0x7FA5A5A5,
        0x7FBFFFFF,
        0x7FC01234,
        0xFFE00400,
        0x7FFFFFFF,
        0xFFFFFFFF,
        0x7F802000,
        0x7FF0000F,
    ]
    common = [
        0x00000000,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x3F800000,
        0xBF800000,
        0x00000001,
        0x80000001,
        0x007FFFFF,
        0x00400000,
        0x00008000,
        0x00018000,
        0x00800000,
        0x7F7FFFFF,
        0xFF7FFFFF,
    ] + nans
    pats = list(common)
    if out_dtype == torch.float16:
        # Ties in the normal range: 1 + k*2^-11 for odd k sits halfway between 1 + (k-1)/2 * 2^-10
        # and the next half; (k-1)/2 even -> rounds down, odd -> rounds up.
        f16 = [1 + k * 2.0**-11 for k in (1, 3, 5, 7, 1023, 2045, 2047)]
        f16 += [-x for x in f16]
        # Subnormal fp16 (multiples of 2^-24), their ties, and the underflow-to-zero boundary.
        f16 += [k * 2.0**-24 for k in (1, 2, 3, 511, 1023, 1024)]
        f16 += [(k + 0.5) * 2.0**-24 for k in (0, 1, 2, 3, 1022, 1023)]
        f16 += [0.25 * 2.0**-24, 0.75 * 2.0**-24, -0.5 * 2.0**-24, -1.5 * 2.0**-24]
        f16 += [2.0**-14, 2.0**-14 - 2.0**-25, 2.0**-14 - 2.0**-26]
        # Around the largest fp16 (65504); 65520 is the tie with the next power, -> inf.
        f16 += [
            65504.0,
            65519.0,
            65519.99,
            65520.0,
            65520.01,
            65535.0,
            65536.0,
            1e10,
            -65504.0,
            -65519.99,
            -65520.0,
            65488.0,
            65512.0,
            65496.0,
        ]
        vals = f16
    else:
        # Ties in bf16: the low 16 bits exactly 0x8000, lower neighbour even (bit 16 = 0) or odd.
        ties = [
            0x3F808000,
            0x3F818000,
            0xBF808000,
            0xBF818000,
            0x40490000 | 0x8000,
            0x7F7E8000,
            0x00808000,
            0x00818000,
            0x00008000,
            0x00018000,
            0x80018000,
        ]
        pats += ties + [x + 1 for x in ties] + [x - 1 for x in ties]
        # Around the largest bf16 (0x7F7F = 3.3895e38): 0x7F7F8000 is a tie with an odd lower
        # neighbour -> inf; one ulp below stays finite.
        pats += [0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0xFF7F8000, 0xFF7F7FFF]
        # fp32 subnormals (the bf16 subnormal range) and the smallest normals.
        pats += [
            0x00000002,
            0x00007FFF,
            0x00010000,
            0x0001FFFF,
            0x807FFFFF,
            0x007F8000,
            0x007FC000,
            0x0080FFFF,
        ]
        vals = []
    x = torch.cat([from_bits(pats), torch.tensor(vals, dtype=torch.float32)])
    # Plus random bit patterns (every exponent, some NaNs and infs among them).
    rnd = torch.randint(0, 2**32, (257,), dtype=torch.int64).tolist()
    return torch.cat([x, from_bits(rnd)])


def spread(values: torch.Tensor, n: int) -> torch.Tensor:
    """`values` repeated in random order to n elements, so every special value lands both in a
    vector body and in a scalar tail at several offsets of the kernels' lane widths."""
    reps = -(-n // values.numel())
    x = values.repeat(reps)[:n]
    return x[torch.randperm(n)]
