"""The compact-master step fused into one Triton kernel: expand -> AdamW -> compact + NaN flag.

[Note: fused compact step] (issue 24, item 4)
master="compact" (compact_master.py [Note: the compact master]) keeps a bf16 run's fp32 master
as its low halves (int16) and tie bits (uint8, one per element) beside the bf16 params. Unfused
on a GPU, each 2^20-element chunk ran expand (5 torch ops), the Adam kernel (3 launches) and
compact (~7 ops plus the NaN test): ~23 launches and full-size temporaries per chunk. Here one
program reads low, the tie byte, the bf16 param, m, v and the grad once, rebuilds the master in
registers, applies DESIGN §3's update and writes low, ties, param, m and v: 2 + 1/8 + 2 + 8 + 2
(grad) bytes read and 2 + 1/8 + 2 + 8 written per element, 24.25 B against ~60 B of the unfused
chain, and no scratch buffer.
- Layout: a [BLOCK/8, 8] tile, so each row is one tie byte's 8 elements: the tie byte is
  loaded once per row and the new one is a row sum of shifted bits (no byte-level races
  between programs: a program owns whole bytes, BLOCK is a multiple of 8, and so is n).
- The per-launch fp64 set-up is `triton_kernels._adam_scalars_kernel` (shared): no fp64 in
  this kernel, checked on its sm_90 PTX (tests/kernels/test_compact_triton.py).
- Rounding: the new param is RNE by integer arithmetic on the bits (`_cast_bits_rne`), which
  is what the compaction's exactness proof assumes, on the GPU and in the interpreter alike.
  (A NaN master writes param 0xFFFF here and 0x7FFF through cvt.rn unfused; either way the NaN
  flag raises at finish(): its bits are gone.)
- Skipped step (found_inf): nothing is written; the NaN flag still reports a NaN in the
  expanded master, as the unfused chain's compact_ did.
- NaN flag: a program that meets a NaN stores 1 into the 0-d flag; every writer writes the
  same value, so the order does not matter (no read-modify-write, no atomics).
Bitwise equal to the CPU ops' chain (expand_ -> the triton adam_step_ -> compact_) under
TRITON_INTERPRET=1: tests/state/test_compact_triton_step.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_kernels as tk

# 2048 elements over 8 warps: 8 per thread, two 128-bit accesses per fp32 array (m, v), one
# per 16-bit array, as the Adam kernel (triton_kernels.BLOCK_GPU). A multiple of 8 (tie bytes).
BLOCK_GPU = 2048
NUM_WARPS_GPU = 8


@triton.jit
def _compact_adam_kernel(
    low_ptr, ties_ptr, param_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_ptr, nan_ptr, n, sc_ptr,
    ADAMW: tl.constexpr, BLOCK: tl.constexpr,
):
    """One fused pass over a compact master: expand, AdamW (DESIGN §3), compact, NaN flag."""
    ROWS: tl.constexpr = BLOCK // 8
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)           # tie byte index
    k = tl.arange(0, 8)
    offs = rows[:, None] * 8 + k[None, :]                           # [ROWS, 8] elements
    rmask = rows < n // 8
    mask = offs < n
    lo = tl.load(low_ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
    b = tl.load(param_ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
    tb = tl.load(ties_ptr + rows, mask=rmask, other=0).to(tl.uint32)
    tie = (tb[:, None] >> k[None, :].to(tl.uint32)) & 1
    carry = (lo + tie + 0x7FFF) >> 16
    bits = ((b - carry) << 16) | lo
    p = bits.to(tl.float32, bitcast=True)
    if tl.load(sc_ptr + 10) != 0:  # skipped step: write nothing, still report a NaN master
        bad = tl.max(tl.max(((bits & 0x7FFFFFFF) > 0x7F800000).to(tl.int32), axis=1), axis=0)
        tl.store(nan_ptr, 1, mask=bad > 0)
        return
    step_size = tl.load(sc_ptr + 0)
    rsqrt_bc2 = tl.load(sc_ptr + 1)
    decay = tl.load(sc_ptr + 2)
    b1 = tl.load(sc_ptr + 3)
    omb1 = tl.load(sc_ptr + 4)
    b2 = tl.load(sc_ptr + 5)
    omb2 = tl.load(sc_ptr + 6)
    eps = tl.load(sc_ptr + 7)
    wd = tl.load(sc_ptr + 8)
    gs = tl.load(sc_ptr + 9)

    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * gs
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
    if ADAMW:
        p = p * decay
    else:
        g = g + wd * p
    m = b1 * m + omb1 * g
    v = b2 * v + omb2 * (g * g)
    denom = tl.sqrt_rn(v) * rsqrt_bc2 + eps   # IEEE sqrt and division, as the Adam kernel
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    tl.store(param_ptr + offs, tk._cast_bits_rne(p, True), mask=mask)
    nbits = p.to(tl.uint32, bitcast=True)
    nlo = nbits & 0xFFFF
    tl.store(low_ptr + offs, nlo.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    ntie = ((nlo == 0x8000).to(tl.uint32) & ((nbits >> 16) & 1)) << k[None, :].to(tl.uint32)
    tl.store(ties_ptr + rows, tl.sum(ntie, axis=1).to(tl.uint8), mask=rmask)
    bad = tl.max(tl.max(((nbits & 0x7FFFFFFF) > 0x7F800000).to(tl.int32), axis=1), axis=0)
    tl.store(nan_ptr, 1, mask=bad > 0)


def _block(n: int, on_cpu: bool) -> int:
    if on_cpu:  # the interpreter: big blocks, few programs (as triton_kernels._block)
        return max(1024, min(triton.next_power_of_2(n), tk.BLOCK_INTERP_MAX))
    return BLOCK_GPU


def compact_adam_step_(low, ties, param, exp_avg, exp_avg_sq, grad, nan, *, lr, beta1, beta2,
                       eps, weight_decay, adamw, step, grad_scale, found_inf) -> None:
    """The compact master's step, one kernel (plus the shared scalar prologue and step += 1).

    low (n,) int16, ties (n/8,) uint8, param (n,) bf16, exp_avg / exp_avg_sq (n,) fp32 are
    updated in place; grad (n,) fp32/fp16/bf16; nan a 0-d bool set if the new master has a NaN.
    n is a multiple of 8. step, grad_scale, found_inf as `kernels.adam_step_`.
    """
    n = low.numel()
    if n % 8 or ties.numel() != n // 8 or param.dtype != torch.bfloat16 or param.numel() != n:
        raise ValueError(f"compact step: low ({low.numel()}), ties ({ties.numel()}) and bf16 "
                         f"param ({param.numel()}, {param.dtype}) do not describe one master "
                         "of n = 8k elements")
    dev = low.device
    on_cpu = dev.type == "cpu"
    with tk._on_device(dev):
        if n:
            sc = tk.adam_scalars(dev, (lr, beta1, beta2, eps, weight_decay), step, grad_scale,
                                 found_inf)
            block = _block(n, on_cpu)
            _compact_adam_kernel[(triton.cdiv(n, block),)](
                low, ties, param.view(torch.int16), exp_avg, exp_avg_sq, grad,
                nan.view(torch.uint8), n, sc, ADAMW=adamw, BLOCK=block,
                num_warps=1 if on_cpu else NUM_WARPS_GPU, enable_fp_fusion=tk.FP_FUSION)
        tk._advance_step_kernel[(1,)](step, found_inf, num_warps=1,
                                      enable_fp_fusion=tk.FP_FUSION)
