"""The CPU 8-bit AdamW op's nearest-code choice at its hardest inputs, on every ISA, bit for bit
against the reference (csrc/cpu/adamw8bit_cpu.h [Note: bucketed nearest code], issue 40).

beta1 = beta2 = 0 and grad_scale 1 make the new moments m = g and v = g * g exactly, so the
values the quantizer sees are chosen here:
- m / absmax exactly on every signed midpoint (a tie: the lower code), one float either side,
  with absmax 1 (x' = x) and with absmaxes where RN(1/s) * m differs from m / s;
- m / absmax a hair from the halfway point between a midpoint and the next float, where the
  kernel's one-rounding test is one ulp from the other answer;
- v / absmax exactly on the unsigned midpoints reachable as RN(g * g);
- denormal grads (absmax below 2^-64: the division-and-search blocks), absmaxes just inside and
  outside [2^-64, 2^64], all-zero blocks (absmax 0), -0.0.
Negative control: the same data with ties sent to the upper code (bucketize right=True) differs
from the op in hundreds of codes, so these blocks do reach the ties.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from zerokern.kernels.quant8 import BLOCK, midpoints

from .test_adamw8bit_cpu_isa import _assert_same, _run

HYPER = dict(lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0)


def _step(backend, state, g):
    from zerokern.kernels.adamw8bit import adamw8bit_step_

    state = [t.clone() for t in state]
    step = torch.tensor(0)
    adamw8bit_step_(*state, g, None, **HYPER, step=step, grad_scale=torch.tensor(1.0),
                    found_inf=torch.tensor(False), backend=backend)
    return state, None, step


def _blocks(rows):
    """Blocks of BLOCK grads from lists (each padded with its own first value)."""
    out = []
    for r in rows:
        r = list(r)[:BLOCK]
        out.append(r + [r[0]] * (BLOCK - len(r)))
    return np.asarray(out, dtype=np.float32).reshape(-1)


def _signed_ties(scale: float):
    """Blocks whose m / absmax is exactly each signed midpoint (and its neighbours), absmax =
    `scale` (element 0)."""
    mids = midpoints(True, "cpu").numpy()
    s = np.float32(scale)
    vals = []
    for mid in np.concatenate([mids, np.nextafter(mids, np.float32(2)),
                               np.nextafter(mids, np.float32(-2))]):
        g = np.float32(mid * s)
        up, down, cands = g, g, [g]
        for _ in range(4):  # an m with RN(m / s) == mid lies within a few floats of mid * s
            up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(-np.inf))
            cands += [up, down]
        for cand in cands:
            if abs(cand) <= s and np.float32(cand / s) == mid:
                vals.append(cand)
                break
    per = BLOCK - 1
    return [[s] + vals[i:i + per] for i in range(0, len(vals), per)], len(vals)


def _unsigned_ties():
    """Blocks whose v / absmax (absmax 1: g = 1 at element 0) is exactly an unsigned midpoint,
    for every midpoint some g has RN(g * g) equal to."""
    mids = midpoints(False, "cpu").numpy()
    vals = []
    for mid in mids:
        g = np.float32(np.sqrt(np.float64(mid)))
        for _ in range(8):
            if np.float32(g * g) == mid:
                vals.append(g)
                break
            g = np.nextafter(g, np.float32(np.inf) if np.float32(g * g) < mid else np.float32(0))
    per = BLOCK - 1
    return [[np.float32(1.0)] + vals[i:i + per] for i in range(0, len(vals), per)], len(vals)


def _near_halfway(count: int = 127):
    """Blocks whose m / s lies a hair (2^-49 relative) from the halfway point h = mid + E between
    a positive signed midpoint and the next float: the kernel's test compares t = RN(m - mid*s)
    with E*s, and here t is E*s +- one ulp of it, the closest the two can be (adamw8bit_cpu.h
    [Note: bucketed nearest code]). With h = H * 2^k (H odd, 25 bits) and s's mantissa S =
    +-1 / H mod 2^25, H * S = 2^25 * M -+ 1 and m = M * 2^j. Returns the blocks and how many
    have |t - E*s| = one ulp of E*s (float64 is exact for m - mid*s here)."""
    mids = midpoints(True, "cpu").numpy()
    rows, hits = [], 0
    for mid in mids[mids > 1e-3][-count:]:
        mant, exp = np.frexp(np.float64(mid))           # mid = mant * 2^exp, mant in [0.5, 1)
        mi = int(mant * 2**24)                          # 24-bit integer mantissa
        big_h = 2 * mi + 1                              # h = big_h * 2^(exp - 25)
        big_s = pow(big_h, -1, 2**25)
        if big_s >= 2**24:
            big_s = 2**25 - big_s
        rest = big_h * big_s % 2**25                    # 1 or 2^25 - 1
        big_m = (big_h * big_s - (rest if rest == 1 else rest - 2**25)) // 2**25
        if big_m >= 2**24:
            continue
        s = np.float32(math.ldexp(big_s, -24))          # exact: big_s < 2^24
        m = np.float32(math.ldexp(big_m, int(exp) - 24))  # h * s = m -+ 2^(exp - 49)
        if not (0 < m <= s) or float(m) != math.ldexp(big_m, int(exp) - 24):
            continue
        e = (np.nextafter(mid, np.float32(2)) - mid) / 2
        t = np.float32(np.float64(m) - np.float64(mid) * np.float64(s))
        d = np.float32(e * s)
        hits += int(t in (np.nextafter(d, np.float32(1)), np.nextafter(d, np.float32(0))))
        rows.append([s, m, -m])
    return rows, hits


def _tie_state():
    rows = []
    # the last two absmaxes are outside the fast range [2^-64, 2^64]: division and search
    for scale in (1.0, 0.37, 3.0e-7, 2.0 ** -60, 7.3e15, 2.0 ** -70, 1e20):
        r, k = _signed_ties(scale)
        # ~17% of the quotients skip a float when s is not a power of two: no m reaches them
        assert k >= 3 * 255 * 0.8, f"scale {scale}: only {k} signed ties built"
        rows += r
    r, k = _near_halfway()
    assert k >= 50, f"only {k} blocks one ulp from the halfway test"  # 60 (S >= 2^23)
    rows += r
    r, k = _unsigned_ties()
    assert k >= 120, f"only {k} of 255 unsigned ties reachable as RN(g*g)"  # 134 here
    rows += r
    rng = np.random.default_rng(40)
    rows.append(rng.standard_normal(BLOCK) * 1e-40)            # denormal m: absmax < 2^-64
    rows.append(rng.standard_normal(BLOCK) * 2.0 ** -63)       # absmax just above 2^-64
    rows.append(rng.standard_normal(BLOCK) * 2.0 ** -66)       # just below
    rows.append(rng.standard_normal(BLOCK) * 1e18)             # absmax (m) above 2^64: v inf-free
    rows.append(np.zeros(BLOCK))                               # absmax 0
    rows.append(np.full(BLOCK, -0.0))                          # -0.0: codes of 0
    g = torch.from_numpy(_blocks(rows))
    n = g.numel()
    # Old state is irrelevant with betas 0 (0 * old): random codes, positive absmaxes.
    state = [torch.randn(n), torch.randint(0, 256, (n,), dtype=torch.uint8), torch.rand(n // BLOCK),
             torch.randint(0, 256, (n,), dtype=torch.uint8), torch.rand(n // BLOCK)]
    return state, g


def test_ties_denormals_and_zeros_equal_the_reference_bitwise(cpu_isa):
    state, g = _tie_state()
    want = _step("reference", state, g)
    got = _step("cpu", state, g)
    _assert_same(want, got)


def test_negative_control_ties_to_the_upper_code_differ():
    """The check above can fail: ties decided the other way change hundreds of m codes."""
    state, g = _tie_state()
    got = _step("cpu", state, g)[0]
    blocks = g.view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    upper = torch.bucketize(blocks / safe[:, None], midpoints(True, "cpu"), right=True)
    lower = torch.bucketize(blocks / safe[:, None], midpoints(True, "cpu"), right=False)
    assert torch.equal(lower.to(torch.uint8).view(-1), got[1])
    assert int((upper.to(torch.uint8).view(-1) != got[1]).sum()) > 1000


@pytest.mark.parametrize("blocks", [1, 7, 1031])
def test_random_steps_equal_the_reference_across_absmax_decades(cpu_isa, blocks):
    """Default betas over blocks whose absmax spans 1e-24 .. 1e19 (both sides of 2^-64)."""
    n = BLOCK * blocks
    scale = torch.logspace(-24, 19, blocks)[torch.randperm(blocks)].repeat_interleave(BLOCK)
    state = [torch.randn(n), torch.randint(0, 256, (n,), dtype=torch.uint8),
             torch.rand(blocks) * scale[::BLOCK], torch.randint(0, 256, (n,), dtype=torch.uint8),
             torch.rand(blocks) * scale[::BLOCK] ** 2]
    grads = [torch.randn(n) * scale, torch.randn(n) * scale]
    want = _run("reference", state, grads, None, [False, False])
    _assert_same(want, _run("cpu", state, grads, None, [False, False]))
