"""8-bit optimizer state: block-wise dynamic quantization and the 8-bit AdamW update (reference).

[Note: 8-bit moments]
AdamW's m and v are held as one byte per element plus one fp32 absmax per block of
`BLOCK` = 128 elements (1 + 4/128 = 1.03 bytes instead of 4), the scheme of Dettmers et al.
("8-bit Optimizers via Block-wise Quantization", bitsandbytes' AdamW8bit):
- a value x of block b is stored as the index of the code nearest to x / absmax_b in a
  *dynamic* map: 256 codes spread over decades (10^-6 .. 1), finer near 1 in each decade, so
  small moments keep their relative precision (a linear map would flush them to 0);
- m is signed (the signed map), v is non-negative (the unsigned map: one more bit of fraction);
- the step dequantizes m and v, runs the fp32 AdamW update (DESIGN §3) with them, and the
  *new* fp32 m and v update the param before they are requantized with the block's new
  absmax, so quantization error enters the next step's moments, never this step's update
  directly.
Blocks are 128 elements because a rank's piece of a bucket is a multiple of partition.ALIGN
= 128 elements: a block never straddles two ranks' pieces, so each rank quantizes its own
state alone and a checkpoint can re-block exactly when the world size changes
(bitsandbytes uses 256; the test compares the two on the same problem).

Error bound (documented, tested): dequantize(quantize(x)) differs from x by at most half the
gap between the two codes around x / absmax, times absmax. In relative terms, for a value
within the top decade of its block's absmax (x / absmax in (0.1, 1]): at most 6.2% for m
(signed map) and 3.3% for v (unsigned); one decade lower 11% and 6.2%; two decades lower 18%
and 11% (worst case over the map's gaps, measured from `dynamic_map`). The update itself uses
the unquantized new m and v, and 40 steps stay within 0.5% (relative) of fp32 AdamW's params,
as close as bitsandbytes' AdamW8bit on the same problem (tests/kernels/test_quant8.py).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .reference import _f64, bias_corrections

BLOCK = 128
# 7 decades for the signed map's 7 non-sign bits (bitsandbytes' max_exponent_bits = 7).
DECADES = 7


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 codes of the dynamic map, sorted ascending, in [-1, 1] (signed) or [0, 1].

    Decade i (i = 0..6) holds magnitudes 10^(i-6) · c for c the midpoints of [0.1, 1] cut into
    2^i (signed) or 2^(i+1) (unsigned) equal parts; then 0 and 1. Signed: 127 magnitudes each
    sign + 0 + 1 = 256; unsigned: 254 + 0 + 1 = 256.
    """
    codes = [0.0, 1.0]
    for i in range(DECADES):
        parts = 2 ** i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, parts + 1, dtype=torch.float32)
        mids = ((edges[:-1] + edges[1:]) / 2.0).tolist()
        scale = 10.0 ** (i - (DECADES - 1))
        codes += [scale * c for c in mids]
        if signed:
            codes += [-scale * c for c in mids]
    out = torch.tensor(sorted(codes), dtype=torch.float32)
    assert out.numel() == 256, out.numel()
    return out


# [Note: the maps are made at construction] The maps (and their midpoints, below) per device,
# made once. They are built on the host and copied to the device, a blocking host->device copy
# from pageable memory: an optimizer makes them when it is built (`prepare_maps`, from the
# 8-bit rule's group set-up, rules/adamw8bit.py), so its steps only look them up. A kernel
# called directly on a device without them makes them at that first call, and so does the
# first step after model.to(another device) (stages 0-2 follow a moved model).
_MAPS = {}


def code_map(signed: bool, device: torch.device) -> torch.Tensor:
    """The 256 codes of `dynamic_map(signed)` on `device` (made there once)."""
    key = (signed, str(device))
    if key not in _MAPS:
        _MAPS[key] = dynamic_map(signed).to(device)
    return _MAPS[key]


def prepare_maps(device: torch.device) -> None:
    """Make both code maps and their midpoints on `device` now, not in a step (Note above)."""
    for signed in (True, False):
        midpoints(signed, device)


def _midpoints(codes: torch.Tensor) -> torch.Tensor:
    return (codes[1:] + codes[:-1]) / 2


def quantize(x: torch.Tensor, signed: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Block-wise quantization of a flat fp32 tensor.

    Args:
        x: (n,) fp32, n a multiple of BLOCK.
        signed: the signed map (m) or the unsigned one (v; x must be >= 0).

    Returns:
        codes (n,) uint8, the nearest code's index (ties to the lower code); absmax
        (n / BLOCK,) fp32 per block (0 for an all-zero block, whose codes are then the 0 code).
    """
    if x.ndim != 1 or x.numel() % BLOCK:
        raise ValueError(f"x must be 1-D with a multiple of {BLOCK} elements, got {tuple(x.shape)}")
    blocks = x.view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    normed = (blocks / safe[:, None]).clamp_(-1.0, 1.0)
    codes = code_map(signed, x.device)
    idx = torch.bucketize(normed, _midpoints(codes), right=False)
    return idx.to(torch.uint8).view(-1), absmax


def dequantize(q: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """(n,) fp32 values of codes `q` (uint8) with per-block `absmax`."""
    codes = code_map(signed, q.device)
    return (codes[q.long()].view(-1, BLOCK) * absmax[:, None]).view(-1)


def adamw8bit_step_(param: torch.Tensor, m_q: torch.Tensor, m_absmax: torch.Tensor,
                    v_q: torch.Tensor, v_absmax: torch.Tensor, grad: torch.Tensor,
                    param_out: Optional[torch.Tensor] = None, *, lr: float, beta1: float,
                    beta2: float, eps: float, weight_decay: float, step: torch.Tensor,
                    grad_scale: Optional[torch.Tensor] = None,
                    found_inf: Optional[torch.Tensor] = None) -> None:
    """One AdamW step with 8-bit block-quantized moments, in place (reference backend).

    Args:
        param: (n,) fp32 params or master, n a multiple of BLOCK.
        m_q, v_q: (n,) uint8 codes; m_absmax, v_absmax: (n / BLOCK,) fp32.
        grad: (n,) grads (any float dtype), times `grad_scale` if given.
        param_out: optional (n,) 16-bit tensor receiving round-to-nearest-even param.
        step: 0-d int64 device counter, incremented unless skipped.
        found_inf: 0-d bool; True: nothing changes, step included (DESIGN §3).
    """
    skip = found_inf if found_inf is not None else torch.zeros((), dtype=torch.bool,
                                                                device=param.device)
    g = grad.float() if grad_scale is None else grad.float() * grad_scale
    m = dequantize(m_q, m_absmax, True)
    v = dequantize(v_q, v_absmax, False)
    t = (step + 1).to(torch.float64)
    bc1 = (1 - beta1 ** t).to(torch.float32)
    bc2_sqrt = (1 - beta2 ** t).sqrt().to(torch.float32)
    p = param * (1 - lr * weight_decay)
    m = m.mul(beta1).add_(g, alpha=1 - beta1)
    v = v.mul(beta2).addcmul_(g, g, value=1 - beta2)
    p = p - (lr / bc1) * m / (v.sqrt() / bc2_sqrt + eps)
    mq, ma = quantize(m, True)
    vq, va = quantize(v, False)
    param.copy_(torch.where(skip, param, p))
    m_q.copy_(torch.where(skip, m_q, mq))
    m_absmax.copy_(torch.where(skip, m_absmax, ma))
    v_q.copy_(torch.where(skip, v_q, vq))
    v_absmax.copy_(torch.where(skip, v_absmax, va))
    step.add_((~skip).to(step.dtype))
    if param_out is not None:
        param_out.copy_(torch.where(skip, param_out, param.to(param_out.dtype)))


_MIDS: dict = {}


def midpoints(signed: bool, device: torch.device) -> torch.Tensor:
    """The 255 fp32 midpoints between consecutive codes of the map (ascending)."""
    key = (signed, str(device))
    if key not in _MIDS:
        c = code_map(signed, device)
        _MIDS[key] = (c[1:] + c[:-1]) / 2
    return _MIDS[key]


def step_scalars(step, lr, beta1, beta2, eps, weight_decay, dev):
    """The 8-bit AdamW step's fp32 scalars, formed in float64 and rounded once (as
    reference.adam_step_); the reference, cpu and triton backends all take them from here."""
    f32 = torch.float32
    bc1, bc2 = bias_corrections(step, beta1, beta2)
    lr64, wd64 = _f64(lr, dev), _f64(weight_decay, dev)
    b1_64, b2_64 = _f64(beta1, dev), _f64(beta2, dev)
    return dict(step_size=(lr64 / bc1).to(f32), rsqrt_bc2=bc2.rsqrt().to(f32),
                decay=(1 - lr64 * wd64).to(f32), b1=b1_64.to(f32), b2=b2_64.to(f32),
                omb1=(1 - b1_64).to(f32), omb2=(1 - b2_64).to(f32), eps=_f64(eps, dev).to(f32))
