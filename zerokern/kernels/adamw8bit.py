"""`adamw8bit_step_`: the fused AdamW step with 8-bit block-quantized moments, every backend.

[Note: the 8-bit step, bit for bit]
quant8.py [Note: 8-bit moments] gives the scheme; this is its exact arithmetic, which every
backend (reference below, cpu csrc/cpu/adamw8bit_cpu.cpp, triton triton_adamw8bit.py, cuda
csrc/cuda/adamw8bit.cu with adamw8bit_math.cuh) follows
operation by operation, so they agree bit for bit. Per block of BLOCK = 128 elements, with the
scalars of kernels/reference.py's AdamW (formed in float64, rounded once to float32: decay =
1 - lr*wd, b1, 1-b1, b2, 1-b2, step_size = lr / (1 - b1^t), rsqrt_bc2 = 1/sqrt(1 - b2^t), eps):

    if found_inf: nothing changes, step included (DESIGN §3)
    g  = float32(grad) * grad_scale
    m  = code_s[m_q] * m_absmax[block];  v = code_u[v_q] * v_absmax[block]     (dequantize)
    p  = p * decay                                             (decoupled weight decay)
    m  = b1*m + (1-b1)*g;   v = b2*v + (1-b2)*(g*g)           (each product rounded: no FMA)
    p  = p - step_size * (m / (sqrt(v) * rsqrt_bc2 + eps))    (the new, unquantized m and v)
    m_absmax[block] = max |m| over the block; m_q = nearest code of m / m_absmax (division;
        an all-zero block: absmax 0 and m / 1); the nearest code is the count of the map's 255
        fp32 midpoints (c[i] + c[i+1]) / 2 strictly below the value (ties to the lower code);
        v likewise with the unsigned map. A NaN moment (a NaN/inf grad with found_inf unset):
        the block's absmax is NaN (torch's amax propagates it), the divisor 1, and a NaN's code
        255 (bucketize puts NaN above every midpoint); every backend does the same
    param_out = round-to-nearest-even(p)

Every operation is IEEE-rounded fp32 (add, mul, div, sqrt), so the only freedom a backend has
is the order of the max (exact in any order). torch's fp32 `sqrt` on the CPU is not correctly
rounded (Sleef, 1 ulp off for 17% of 10M random floats here), so the reference takes the
square root in float64 and rounds once (0 mismatches against IEEE fp32 sqrt in the same 10M);
the C++ kernel uses std::sqrt, Triton `sqrt_rn`, CUDA `__fsqrt_rn` (and `__fmul_rn` & co.
throughout, so nvcc contracts nothing into an FMA). The AdamW (L2, adamw=False) variant is not
offered: the 8-bit rule is decoupled AdamW (bitsandbytes' AdamW8bit), and ZeroAdamW refuses
adamw=False with state_bits=8.
"""

from __future__ import annotations

from typing import Optional

import torch

from .dispatch import resolve
from .op_routing import hyper_args, use_op
from .quant8 import BLOCK, code_map, midpoints, step_scalars
from .reference import advance_step_
from .validate import (
    FOUND_INF_DTYPES,
    GRAD_DTYPES,
    OUT_DTYPES,
    STEP_DTYPES,
    Scalar,
    check_backend,
    check_buffer,
    check_hyper,
    check_no_overlap,
    check_scalar_tensor,
)


def check_adamw8bit_args(master, m_q, m_absmax, v_q, v_absmax, grad, param_out, *, lr, beta1,
                         beta2, eps, weight_decay, step, grad_scale, found_inf) -> None:
    """Validate `adamw8bit_step_` arguments. Raises TypeError/ValueError naming the argument."""
    check_buffer("master", master, (torch.float32,), None, None)
    dev, n = master.device, master.numel()
    if n % BLOCK:
        raise ValueError(f"master must have a multiple of {BLOCK} elements (whole quantization "
                         f"blocks), got {n}")
    for name, t, dts, k in (("m_q", m_q, (torch.uint8,), n), ("v_q", v_q, (torch.uint8,), n),
                            ("m_absmax", m_absmax, (torch.float32,), n // BLOCK),
                            ("v_absmax", v_absmax, (torch.float32,), n // BLOCK),
                            ("grad", grad, GRAD_DTYPES, n)):
        check_buffer(name, t, dts, dev, k)
    bufs = {"master": master, "m_q": m_q, "m_absmax": m_absmax, "v_q": v_q,
            "v_absmax": v_absmax, "grad": grad}
    if param_out is not None:
        check_buffer("param_out", param_out, OUT_DTYPES, dev, n)
        bufs["param_out"] = param_out
    check_no_overlap(bufs)
    check_scalar_tensor("step", step, STEP_DTYPES, dev)
    check_scalar_tensor("grad_scale", grad_scale, (torch.float32,), dev)
    check_scalar_tensor("found_inf", found_inf, FOUND_INF_DTYPES, dev)
    inf = float("inf")
    check_hyper("lr", lr, dev, 0.0, inf, hi_open=True)
    check_hyper("beta1", beta1, dev, 0.0, 1.0)
    check_hyper("beta2", beta2, dev, 0.0, 1.0)
    check_hyper("eps", eps, dev, 0.0, inf, lo_open=True, hi_open=True)
    check_hyper("weight_decay", weight_decay, dev, 0.0, inf, hi_open=True)


def adamw8bit_step_(master: torch.Tensor, m_q: torch.Tensor, m_absmax: torch.Tensor,
                    v_q: torch.Tensor, v_absmax: torch.Tensor, grad: torch.Tensor,
                    param_out: Optional[torch.Tensor] = None, *, lr: Scalar, beta1: Scalar,
                    beta2: Scalar, eps: Scalar, weight_decay: Scalar, step: torch.Tensor,
                    grad_scale: torch.Tensor, found_inf: torch.Tensor,
                    backend: str = "auto") -> None:
    """One fused AdamW step with 8-bit moments over a flat piece, in place (module Note).

    Args:
        master: fp32, contiguous, n elements (n a multiple of 128); updated in place.
        m_q, v_q: uint8 codes, n elements (signed map for m, unsigned for v).
        m_absmax, v_absmax: fp32, n / 128 elements: each block's scale.
        grad: fp32, fp16 or bf16, n elements; multiplied by `grad_scale` before use.
        param_out: None, or fp16/bf16 with n elements: receives `master.to(dtype)`.
        lr, beta1, beta2, eps, weight_decay: floats or 0-d tensors.
        step: 0-d int64/int32/float32/float64 device tensor; incremented unless skipped.
        grad_scale: 0-d fp32 device tensor. found_inf: 0-d bool or fp32; set: nothing changes.
        backend: "auto" | "triton" | "cuda" | "cpu" | "reference" ("auto" on CUDA tensors:
            triton, or cuda where Triton is not installed; every backend gives the same bits).

    Raises:
        TypeError, ValueError: a bad argument (named), before anything changes.
    """
    check_backend(backend)
    check_adamw8bit_args(master, m_q, m_absmax, v_q, v_absmax, grad, param_out, lr=lr,
                         beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                         step=step, grad_scale=grad_scale, found_inf=found_inf)
    kind = resolve(backend, master.device)
    args = (master, m_q, m_absmax, v_q, v_absmax, grad, param_out)
    if use_op(master):  # [Note: kernels as custom ops] (custom_ops.py)
        hyper, hyper_t = hyper_args((lr, beta1, beta2, eps, weight_decay))
        torch.ops.zerokern.adamw8bit_step_(*args, hyper, hyper_t, step, grad_scale, found_inf,
                                           kind)
        return
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
              grad_scale=grad_scale, found_inf=found_inf)
    if kind == "reference":
        reference_adamw8bit_step_(*args, **kw)
    elif kind == "triton":
        from . import triton_adamw8bit

        triton_adamw8bit.adamw8bit_step_(*args, **kw)
    else:
        _native_adamw8bit_step_(kind, *args, **kw)


def quantize_blocks(x: torch.Tensor, signed: bool):
    """(codes uint8, absmax fp32 per block) of a flat fp32 `x` (module Note: the nearest code
    by counting midpoints below, ties to the lower code)."""
    blocks = x.view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    idx = torch.bucketize(blocks / safe[:, None], midpoints(signed, x.device), right=False)
    return idx.to(torch.uint8).view(-1), absmax


def reference_adamw8bit_step_(master, m_q, m_absmax, v_q, v_absmax, grad, param_out, *, lr,
                              beta1, beta2, eps, weight_decay, step, grad_scale,
                              found_inf) -> None:
    """The executable spec in torch ops (never syncs: the skip is a torch.where)."""
    dev = master.device
    skip = found_inf if found_inf.dtype == torch.bool else found_inf != 0
    s = step_scalars(step, lr, beta1, beta2, eps, weight_decay, dev)
    g = grad.to(torch.float32) * grad_scale
    m = (code_map(True, dev)[m_q.long()].view(-1, BLOCK) * m_absmax[:, None]).view(-1)
    v = (code_map(False, dev)[v_q.long()].view(-1, BLOCK) * v_absmax[:, None]).view(-1)
    p = master * s["decay"]
    m = s["b1"] * m + s["omb1"] * g
    v = s["b2"] * v + s["omb2"] * (g * g)
    root = v.double().sqrt().float()  # IEEE sqrt (torch's fp32 sqrt is not: module Note)
    p = p - s["step_size"] * (m / (root * s["rsqrt_bc2"] + s["eps"]))
    mq, ma = quantize_blocks(m, True)
    vq, va = quantize_blocks(v, False)
    for dst, new in ((master, p), (m_q, mq), (m_absmax, ma), (v_q, vq), (v_absmax, va)):
        dst.copy_(torch.where(skip, dst, new))
    if param_out is not None:
        param_out.copy_(torch.where(skip, param_out, p.to(param_out.dtype)))
    advance_step_(step, skip)


def _native_adamw8bit_step_(backend, master, m_q, m_absmax, v_q, v_absmax, grad, param_out, *,
                            lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                            found_inf) -> None:
    """The cpu (csrc/cpu/adamw8bit_cpu.cpp) or cuda (csrc/cuda/adamw8bit.cu) op; the maps are
    the reference's own fp32 tensors on the params' device, so every backend reads the same
    codes and midpoints. CUDA-tensor hyperparameters travel as one float64 device tensor (hp)."""
    from .build import load_op
    from .native import _hyper_args

    dev = master.device
    floats, hp = _hyper_args((lr, beta1, beta2, eps, weight_decay), dev)
    args = (master, m_q, m_absmax, v_q, v_absmax, grad, param_out, *floats, step, grad_scale,
            found_inf, code_map(True, dev), code_map(False, dev), midpoints(True, dev),
            midpoints(False, dev))
    if backend == "cuda":
        load_op("cuda").adamw8bit_step(*args, hp)
    else:
        load_op("cpu").adamw8bit_step(*args)
