"""Triton backend of `adamw8bit_step_` (kernels/adamw8bit.py): one program per ROWS blocks of
128 elements, GPU-compiled on CUDA tensors and interpreted on CPU tensors under
TRITON_INTERPRET=1 (tests).

[Note: the Triton 8-bit step]
- The step's fp32 scalars are quant8.step_scalars' (torch ops on the device: float64, rounded
  once; no host sync) packed into one small device tensor, so the kernel and the reference use
  the very same scalars and a new lr never recompiles.
- FP fusion is OFF for this kernel (unlike adam's [Note: fp fusion pinned]): the 8-bit step's
  contract is bit-for-bit the reference (each product rounded), and a contracted b1*m + (1-b1)*g
  could move m by an ulp and so flip a quantization code. sqrt is `sqrt_rn` and every division
  `div_rn` (IEEE, as torch's): a plain `/` lowers to the approximate div.full.f32 on NVIDIA GPUs
  (the interpreter's numpy `/` is IEEE, so only the sm_90 PTX check sees it:
  tests/kernels/test_triton_compile.py, every kernel).
- Dequantize is a gather from the 256-entry code map; the nearest code is a branch-free binary
  search over the 255 midpoints (8 gathers): the count of midpoints strictly below the value,
  a NaN counting as above all (255), as torch.bucketize(right=False) gives the reference
  (csrc/cpu/adamw8bit_cpu.h [Note: branchless nearest code]).
- 16-bit cast-back: triton_kernels' explicit round-to-nearest-even on the interpreter (which
  truncates), the hardware conversion on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant8 import BLOCK, code_map, midpoints, step_scalars
from .triton_kernels import _advance_step_kernel, _cast_bits_rne, _on_device

ROWS_GPU = 8          # 8 blocks = 1024 elements per program (4 warps)
ROWS_INTERP = 256     # the interpreter runs programs one by one: few, large programs


@triton.jit
def _nearest(x, mids_ptr):
    """Count of the 255 sorted midpoints strictly below x (0..255; NaN: 255), by binary search."""
    pos = tl.zeros(x.shape, dtype=tl.int32)
    for s in tl.static_range(8):
        step = 128 >> s
        cand = pos + step
        mid = tl.load(mids_ptr + cand - 1)
        pos = tl.where((mid < x) | (x != x), cand, pos)
    return pos


@triton.jit
def _absmax_nan(x):
    """Each row's max |x|, NaN when the row holds one, as torch's amax (tl.max may drop it)."""
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    return tl.where(has_nan, float("nan"), tl.max(tl.abs(x), axis=1))


@triton.jit
def _q8_step_kernel(master_ptr, mq_ptr, ma_ptr, vq_ptr, va_ptr, grad_ptr, out_ptr, nb, sc_ptr,
                    skip_ptr, code_s_ptr, code_u_ptr, mid_s_ptr, mid_u_ptr,
                    HAS_OUT: tl.constexpr, OUT_IS_BF16: tl.constexpr,
                    EXPLICIT_RNE: tl.constexpr, ROWS: tl.constexpr, QB: tl.constexpr):
    if tl.load(skip_ptr) != 0:  # skipped: nothing written
        return
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < nb
    offs = rows[:, None] * QB + tl.arange(0, QB)[None, :]
    mask = rmask[:, None] & (offs >= 0)
    step_size = tl.load(sc_ptr + 0)
    rsqrt_bc2 = tl.load(sc_ptr + 1)
    decay = tl.load(sc_ptr + 2)
    b1 = tl.load(sc_ptr + 3)
    omb1 = tl.load(sc_ptr + 4)
    b2 = tl.load(sc_ptr + 5)
    omb2 = tl.load(sc_ptr + 6)
    eps = tl.load(sc_ptr + 7)
    gs = tl.load(sc_ptr + 8)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * gs
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    mq = tl.load(mq_ptr + offs, mask=mask, other=0).to(tl.int32)
    vq = tl.load(vq_ptr + offs, mask=mask, other=0).to(tl.int32)
    am = tl.load(ma_ptr + rows, mask=rmask, other=0.0)
    av = tl.load(va_ptr + rows, mask=rmask, other=0.0)
    m = tl.load(code_s_ptr + mq) * am[:, None]
    v = tl.load(code_u_ptr + vq) * av[:, None]
    p = p * decay
    m = b1 * m + omb1 * g
    v = b2 * v + omb2 * (g * g)
    p = p - step_size * tl.div_rn(m, tl.sqrt_rn(v) * rsqrt_bc2 + eps)
    m_max = _absmax_nan(m)
    v_max = _absmax_nan(v)
    m_safe = tl.where(m_max > 0, m_max, 1.0)
    v_safe = tl.where(v_max > 0, v_max, 1.0)
    new_mq = _nearest(tl.div_rn(m, m_safe[:, None]), mid_s_ptr)
    new_vq = _nearest(tl.div_rn(v, v_safe[:, None]), mid_u_ptr)
    tl.store(master_ptr + offs, p, mask=mask)
    tl.store(mq_ptr + offs, new_mq.to(tl.uint8), mask=mask)
    tl.store(vq_ptr + offs, new_vq.to(tl.uint8), mask=mask)
    tl.store(ma_ptr + rows, m_max, mask=rmask)
    tl.store(va_ptr + rows, v_max, mask=rmask)
    if HAS_OUT:
        if EXPLICIT_RNE:
            tl.store(out_ptr + offs, _cast_bits_rne(p, OUT_IS_BF16), mask=mask)
        else:
            tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)


def adamw8bit_step_(master, m_q, m_absmax, v_q, v_absmax, grad, param_out, *, lr, beta1,
                    beta2, eps, weight_decay, step, grad_scale, found_inf) -> None:
    dev = master.device
    on_cpu = dev.type == "cpu"
    nb = master.numel() // BLOCK
    with _on_device(dev):
        if nb:
            s = step_scalars(step, lr, beta1, beta2, eps, weight_decay, dev)
            sc = torch.stack([s["step_size"], s["rsqrt_bc2"], s["decay"], s["b1"], s["omb1"],
                              s["b2"], s["omb2"], s["eps"],
                              grad_scale.reshape(()).to(torch.float32)])
            skip = found_inf.reshape(1) if found_inf.dtype != torch.bool else \
                found_inf.reshape(1).to(torch.int8)
            explicit = on_cpu  # the interpreter truncates fp32->bf16: round in the kernel
            out = master if param_out is None else (param_out.view(torch.int16) if explicit
                                                    else param_out)
            rows = min(ROWS_INTERP, triton.next_power_of_2(nb)) if on_cpu else ROWS_GPU
            _q8_step_kernel[(triton.cdiv(nb, rows),)](
                master, m_q, m_absmax, v_q, v_absmax, grad, out, nb, sc, skip,
                code_map(True, dev), code_map(False, dev), midpoints(True, dev),
                midpoints(False, dev), HAS_OUT=param_out is not None,
                OUT_IS_BF16=param_out is not None and param_out.dtype == torch.bfloat16,
                EXPLICIT_RNE=explicit, ROWS=rows, QB=BLOCK, num_warps=1 if on_cpu else 4,
                enable_fp_fusion=False)
        _advance_step_kernel[(1,)](step, found_inf, num_warps=1, enable_fp_fusion=False)
