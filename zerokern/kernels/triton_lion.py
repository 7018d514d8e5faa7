"""Triton backend of `lion_step_` (kernels/lion.py): one fused pass per element, GPU-compiled on
CUDA tensors and interpreted on CPU tensors under TRITON_INTERPRET=1 (tests).

It reuses triton_kernels.py's launch plan ([Note: launch plan] there: the tensors' device made
current, aligned body + short edges, CPU-tensor hyperparameters read on the host) and its
explicit round-to-nearest-even for the interpreter. The float64 set-up is tiny here (no bias
correction): a one-program prologue writes the fp32 scalars [1 - lr*wd, lr, b1, 1-b1, b2, 1-b2,
grad_scale, skip] to a device buffer, so every per-step value stays a runtime value (never a
constexpr: changing lr never recompiles) and a device-tensor lr is read on the device.

FP fusion is OFF for both Lion kernels (unlike adam's [Note: fp fusion pinned]; as the 8-bit
step's): the contract is the reference's rounding, each product rounded, then the sum
(csrc/cpu/lion_cpu.cpp [Note: Lion rounds every product]). Contracted, b1*m + (1-b1)*g became
fma.rn.f32 on sm_90: where the rounded products cancel to exactly 0 the fma returns one
product's rounding error, and sign() gives +-1 against the reference's 0 (a parameter moved by
lr; tests/kernels/test_lion_cancellation.py). The fp64 prologue's 1 - lr*wd likewise. The
interpreter (numpy) never fuses, so only the PTX shows it (tests/kernels/test_triton_compile.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import (
    ALIGN,
    BLOCK_EDGE,
    FP_FUSION,
    SC_LEN,
    _advance_step_kernel,
    _block,
    _cast_bits_rne,
    _hi_lo,
    _hyper,
    _num_warps,
    _on_device,
    _segments,
    _split_f64,
)

LION_FP_FUSION = False  # module docstring: every product rounded, as the reference


@triton.jit
def _lion_scalars_kernel(sc_ptr, lr_hi, lr_lo, b1_hi, b1_lo, b2_hi, b2_lo, wd_hi, wd_lo,
                         hp_ptr, grad_scale_ptr, found_inf_ptr, HP_FROM_PTR: tl.constexpr):
    """One program: the float64 scalars of the step, rounded once to float32."""
    if HP_FROM_PTR:
        lr = tl.load(hp_ptr + 0)
        b1 = tl.load(hp_ptr + 1)
        b2 = tl.load(hp_ptr + 2)
        wd = tl.load(hp_ptr + 3)
    else:
        lr = _split_f64(lr_hi, lr_lo)
        b1 = _split_f64(b1_hi, b1_lo)
        b2 = _split_f64(b2_hi, b2_lo)
        wd = _split_f64(wd_hi, wd_lo)
    tl.store(sc_ptr + 0, (1.0 - lr * wd).to(tl.float32))
    tl.store(sc_ptr + 1, lr.to(tl.float32))
    tl.store(sc_ptr + 2, b1.to(tl.float32))
    tl.store(sc_ptr + 3, (1.0 - b1).to(tl.float32))
    tl.store(sc_ptr + 4, b2.to(tl.float32))
    tl.store(sc_ptr + 5, (1.0 - b2).to(tl.float32))
    tl.store(sc_ptr + 6, tl.load(grad_scale_ptr).to(tl.float32))
    tl.store(sc_ptr + 7, (tl.load(found_inf_ptr) != 0).to(tl.float32))


@triton.jit
def _lion_step_kernel(master_ptr, exp_avg_ptr, grad_ptr, out_ptr, n, sc_ptr,
                      HAS_OUT: tl.constexpr, OUT_IS_BF16: tl.constexpr,
                      EXPLICIT_RNE: tl.constexpr, BLOCK: tl.constexpr):
    """Unscale, decay, sign of the interpolation, momentum, 16-bit cast-back: one pass."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if tl.load(sc_ptr + 7) != 0:  # skipped: nothing written (an early return, as adam's)
        return
    mask = offs < n
    decay = tl.load(sc_ptr + 0)
    lr = tl.load(sc_ptr + 1)
    b1 = tl.load(sc_ptr + 2)
    omb1 = tl.load(sc_ptr + 3)
    b2 = tl.load(sc_ptr + 4)
    omb2 = tl.load(sc_ptr + 5)
    gs = tl.load(sc_ptr + 6)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * gs
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    p = p * decay
    c = b1 * m + omb1 * g
    sgn = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))  # torch.sign: NaN and -0 give +0
    p = p - lr * sgn
    m = b2 * m + omb2 * g
    tl.store(master_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    if HAS_OUT:
        if EXPLICIT_RNE:
            tl.store(out_ptr + offs, _cast_bits_rne(p, OUT_IS_BF16), mask=mask)
        else:
            tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)


def lion_step_(master, exp_avg, grad, param_out, *, lr, beta1, beta2, weight_decay, step,
               grad_scale, found_inf) -> None:
    n = master.numel()
    dev = master.device
    on_cpu = dev.type == "cpu"
    hyper = [_hyper(x, dev) for x in (lr, beta1, beta2, weight_decay)]
    hp_from_ptr = any(isinstance(x, torch.Tensor) for x in hyper)
    with _on_device(dev):
        if n:
            if hp_from_ptr:
                hp = torch.stack([x.to(dev, torch.float64) if isinstance(x, torch.Tensor)
                                  else torch.full((), x, dtype=torch.float64, device=dev)
                                  for x in hyper])
                split = [0.0] * 8
            else:
                hp = step  # unused pointer placeholder
                split = [h for x in hyper for h in _hi_lo(float(x))]
            sc = torch.empty(SC_LEN, dtype=torch.float32, device=dev)
            _lion_scalars_kernel[(1,)](sc, *split, hp, grad_scale, found_inf,
                                       HP_FROM_PTR=hp_from_ptr, num_warps=1,
                                       enable_fp_fusion=LION_FP_FUSION)
            explicit = on_cpu  # the interpreter truncates fp32->bf16: round in the kernel
            out = master if param_out is None else (param_out.view(torch.int16) if explicit
                                                    else param_out)
            arrays = [master, exp_avg, grad, out]
            const = dict(HAS_OUT=param_out is not None,
                         OUT_IS_BF16=param_out is not None and param_out.dtype == torch.bfloat16,
                         EXPLICIT_RNE=explicit)
            for start, length, vector in _segments(n, arrays):
                a = arrays if length == n else [t[start:start + length] for t in arrays]
                block = _block(length, on_cpu) if vector or length >= ALIGN else BLOCK_EDGE
                warps = _num_warps(on_cpu) if block > BLOCK_EDGE else 1
                _lion_step_kernel[(triton.cdiv(length, block),)](
                    *a, length, sc, BLOCK=block, num_warps=warps,
                    enable_fp_fusion=LION_FP_FUSION, **const)
        _advance_step_kernel[(1,)](step, found_inf, num_warps=1, enable_fp_fusion=FP_FUSION)
