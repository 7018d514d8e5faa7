"""Triton backend: fused AdamW step and grad statistics over flat shard buffers.

On CUDA tensors these are compiled GPU kernels; on CPU tensors they run under the Triton
interpreter (TRITON_INTERPRET=1, which must be set before this module is imported), for tests.

Every per-step value (lr, step, grad_scale, found_inf) is a runtime argument or a device load,
never a constexpr, so changing it never recompiles (DESIGN §6). Constexprs are only the layout
switches: adamw, whether there is a param_out, where hyperparameters come from, the block size.

[Note: launch plan] (issue 14)
- (2) Triton launches on the *current* device and stream, not the tensors' device: every launch
  runs under `_on_device(t.device)` (torch.cuda.device), so params on cuda:1 with cuda:0 current
  launch on cuda:1, on cuda:1's current stream.
- (3) The fp64 bias corrections and step size (~300 fp64 ops with the 40-step pow) are computed
  once per launch by a one-program prologue, `_adam_scalars_kernel`, into a 16-float device
  buffer that every program of `_adam_step_kernel` reads (11 L2-resident loads). The per-element
  kernel has no fp64 at all; on 1/64-rate fp64 GPUs (L4, A10, consumer cards) the per-program
  set-up used to cost more than the kernel's memory time.
- (7) Triton specialises pointers on 16-byte alignment and n on divisibility by 16; if either
  fails, the whole launch compiles to scalar loads (78-128 registers). `_segments` splits a call
  into an aligned body (every pointer 16-byte aligned, length a multiple of 16: the vector
  variant) and a head/tail of < 16 elements each, launched separately with a 16-element block.
- (6) A hyperparameter given as a CPU tensor is read on the host (a host read of host memory,
  no sync) and passed like a float: no blocking host-to-device copy per bucket. Under CUDA-graph
  capture it is therefore frozen at capture time; a CUDA tensor lr is read on the device.
"""

from __future__ import annotations

import functools
import os
import struct
from typing import List, Tuple

import torch
import triton
import triton.language as tl

from zerokern.platform.device import handle

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# GPU block: 2048 elements over 8 warps = 8 fp32 per thread = two 128-bit loads per array, enough
# bytes in flight per SM to saturate HBM; fewer warps idle the load units, more cost registers.
BLOCK_GPU = 2048
NUM_WARPS_GPU = 8
# The interpreter runs programs one after another in numpy: large blocks make it fast on the
# small test sizes (a 278011-element step drops from minutes to about a second).
BLOCK_INTERP_MAX = 1 << 16
# [Note: fp fusion pinned] (issue 24, item 8) Every launch passes enable_fp_fusion: FMA
# contraction on (a*b+c rounded once), the setting the fp32 bounds and the sm_90 static checks
# were measured with. Left to TRITON_DEFAULT_FP_FUSION, Triton 3.9 warns once per rank and 3.10
# changes the default; the kernels' numerics must not move with the Triton release.
FP_FUSION = True
# grad_stats_ stage 1 never uses more programs than this, so stage 2 is a single block.
MAX_PARTIALS = 1024
# (7) Vector granularity: Triton's divisibility specialisation is 16 (bytes for pointers,
# units for integers). Head and tail segments are shorter than this and use this block.
ALIGN = 16
BLOCK_EDGE = 16

# (3) The per-launch fp32 scalar buffer written by _adam_scalars_kernel: [0] lr/bc1,
# [1] 1/sqrt(bc2), [2] 1 - lr*wd, [3] b1, [4] 1-b1, [5] b2, [6] 1-b2, [7] eps, [8] wd,
# [9] grad_scale, [10] skip (found_inf != 0).
SC_LEN = 16  # 64 bytes: one L2 sector pair, and 16-byte aligned from the caching allocator


@triton.jit
def _split_f64(hi, lo):
    """A float64 rebuilt from two float32 halves (Triton scalar arguments are float32)."""
    return tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)


@triton.jit
def _pow_f64(base, e):
    """base**e in float64 for an integer e >= 0, by squaring: exact to a few ulps, no libdevice."""
    r = base * 0.0 + 1.0
    for _ in tl.static_range(40):  # e < 2^40 steps: beyond any training run
        r = tl.where((e & 1) == 1, r * base, r)
        base = base * base
        e = e >> 1
    return r


@triton.jit
def _cast_bits_rne(p, OUT_IS_BF16: tl.constexpr):
    """fp32 -> 16-bit bit pattern, round-to-nearest-even, matching torch's CPU conversion bit for
    bit (the interpreter truncates fp32->bf16 and numpy keeps signalling-NaN payloads)."""
    bits = p.to(tl.uint32, bitcast=True)
    is_nan = p != p
    if OUT_IS_BF16:
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(is_nan, 0xFFFF, r)  # torch CPU writes every NaN as 0xFFFF
    else:
        r = p.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)  # IEEE RNE for non-NaN
        quiet = ((bits >> 16) & 0x8000) | 0x7E00 | ((bits >> 13) & 0x3FF)  # F16C NaN rule
        r = tl.where(is_nan, quiet, r)
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _adam_scalars_kernel(
    sc_ptr, lr_hi, lr_lo, b1_hi, b1_lo, b2_hi, b2_lo, eps_hi, eps_lo, wd_hi, wd_lo,
    hp_ptr, step_ptr, grad_scale_ptr, found_inf_ptr, HP_FROM_PTR: tl.constexpr,
):
    """(3) One program per launch: the float64 set-up of DESIGN §3, rounded once to float32."""
    if HP_FROM_PTR:
        lr = tl.load(hp_ptr + 0)
        b1 = tl.load(hp_ptr + 1)
        b2 = tl.load(hp_ptr + 2)
        eps = tl.load(hp_ptr + 3)
        wd = tl.load(hp_ptr + 4)
    else:
        lr = _split_f64(lr_hi, lr_lo)
        b1 = _split_f64(b1_hi, b1_lo)
        b2 = _split_f64(b2_hi, b2_lo)
        eps = _split_f64(eps_hi, eps_lo)
        wd = _split_f64(wd_hi, wd_lo)
    t = tl.load(step_ptr).to(tl.int64) + 1
    bc1 = 1.0 - _pow_f64(b1, t)
    bc2 = 1.0 - _pow_f64(b2, t)
    tl.store(sc_ptr + 0, (lr / bc1).to(tl.float32))
    tl.store(sc_ptr + 1, (1.0 / tl.sqrt(bc2)).to(tl.float32))
    tl.store(sc_ptr + 2, (1.0 - lr * wd).to(tl.float32))
    tl.store(sc_ptr + 3, b1.to(tl.float32))
    tl.store(sc_ptr + 4, (1.0 - b1).to(tl.float32))
    tl.store(sc_ptr + 5, b2.to(tl.float32))
    tl.store(sc_ptr + 6, (1.0 - b2).to(tl.float32))
    tl.store(sc_ptr + 7, eps.to(tl.float32))
    tl.store(sc_ptr + 8, wd.to(tl.float32))
    tl.store(sc_ptr + 9, tl.load(grad_scale_ptr).to(tl.float32))
    # found_inf is bool or fp32; a NaN flag counts as set (!= 0), as in every backend.
    tl.store(sc_ptr + 10, (tl.load(found_inf_ptr) != 0).to(tl.float32))


@triton.jit
def _adam_step_kernel(
    master_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_ptr, out_ptr, n, sc_ptr,
    ADAMW: tl.constexpr, HAS_OUT: tl.constexpr, OUT_IS_BF16: tl.constexpr,
    EXPLICIT_RNE: tl.constexpr, BLOCK: tl.constexpr,
):
    """One fused pass: unscale, weight decay, moments, bias-corrected update, 16-bit cast-back."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # A skipped step writes nothing (DESIGN §3). An early return, not a mask term: a runtime
    # bound in the mask hides n's divisibility by 16 and costs the 128-bit loads.
    if tl.load(sc_ptr + 10) != 0:
        return
    mask = offs < n
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
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
    if ADAMW:
        p = p * decay
    else:
        g = g + wd * p
    m = b1 * m + omb1 * g
    v = b2 * v + omb2 * (g * g)
    # sqrt_rn/div_rn: IEEE results; plain sqrt and / lower to approximations on NVIDIA GPUs.
    denom = tl.sqrt_rn(v) * rsqrt_bc2 + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(master_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    if HAS_OUT:
        if EXPLICIT_RNE:
            tl.store(out_ptr + offs, _cast_bits_rne(p, OUT_IS_BF16), mask=mask)
        else:
            # cvt.rn: the same bits as torch CUDA's .to(dtype).
            tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _advance_step_kernel(step_ptr, found_inf_ptr):
    """step += 1 unless found_inf: a separate launch, after the prologue has read step."""
    keep = tl.load(found_inf_ptr) == 0
    s = tl.load(step_ptr)
    tl.store(step_ptr, tl.where(keep, s + 1, s))


@triton.jit
def _grad_stats_partial_kernel(grad_ptr, partial_ptr, flag_ptr, n, iters, BLOCK: tl.constexpr):
    """Stage 1: each program reduces a grid-stride slice to one fp32 partial and one inf flag."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, iters):
        offs = (i * nprog + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        g = tl.load(grad_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc += g * g
        bad |= ((g != g) | (tl.abs(g) == float("inf"))).to(tl.int32)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))
    tl.store(flag_ptr + pid, tl.max(bad, axis=0))


@triton.jit
def _grad_stats_final_kernel(partial_ptr, flag_ptr, nparts, found_inf_ptr, sumsq_ptr,
                             PBLOCK: tl.constexpr):
    """Stage 2: one program sums the partials in float64 in a fixed order; no atomics."""
    offs = tl.arange(0, PBLOCK)
    mask = offs < nparts
    s = tl.sum(tl.load(partial_ptr + offs, mask=mask, other=0.0).to(tl.float64), axis=0)
    f = tl.max(tl.load(flag_ptr + offs, mask=mask, other=0), axis=0)
    old = tl.load(sumsq_ptr)
    tl.store(sumsq_ptr, (old.to(tl.float64) + s).to(sumsq_ptr.dtype.element_ty))
    fi = tl.load(found_inf_ptr)
    tl.store(found_inf_ptr, ((fi != 0) | (f > 0)).to(found_inf_ptr.dtype.element_ty))


# ------------------------------------------------------------------ host side ----------------

def _hi_lo(x: float):
    """Split a double into float32 hi + lo so the kernel can rebuild ~48 bits of it."""
    return (hi := _f32(x)), _f32(x - hi)


def _f32(x: float) -> float:
    """x rounded to float32 (to nearest; +-inf past float32's range, as torch's cast)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return float(torch.tensor(x, dtype=torch.float32))


@functools.lru_cache(maxsize=256)
def _split_args(hyper: tuple) -> tuple:
    """[Note: launch arguments cached] (issue 24, item 8) The 10 float32 halves of the five
    float hyperparameters. They were two CPU tensors each per call (10 tensors, ~31 us per
    adam_step_ measured); now plain float packing, cached on the values (a buffer's hypers
    rarely change between steps; a scheduler's new lr is one more entry)."""
    return tuple(h for x in hyper for h in _hi_lo(float(x)))


def _block(n: int, on_cpu: bool) -> int:
    if on_cpu:  # interpreter
        return max(1024, min(triton.next_power_of_2(n), BLOCK_INTERP_MAX))
    return BLOCK_GPU


def _num_warps(on_cpu: bool) -> int:
    return 1 if on_cpu else NUM_WARPS_GPU


def _on_device(dev: torch.device):
    """(2) Make the tensors' device current for the launch (its current stream with it)."""
    return handle(dev).device_context(dev)


def _segments(n: int, tensors) -> List[Tuple[int, int, bool]]:
    """(7) [(start, length, vector)]: an aligned body plus head/tail pieces shorter than 16.

    The body starts at the first element h < 8 where every tensor's address is 16-byte aligned
    and has a length that is a multiple of 16, so Triton compiles it with 128-bit accesses. When
    no such h exists (views misaligned against each other) one scalar launch covers everything.
    """
    h = next((h for h in range(8)
              if all((t.data_ptr() + h * t.element_size()) % ALIGN == 0 for t in tensors)), None)
    if h is None:
        return [(0, n, False)] if n else []
    if n - h < ALIGN:  # too short for a body: two edge pieces of < 16
        return [(s, ln, False) for s, ln in ((0, h), (h, n - h)) if ln]
    nb = (n - h) // ALIGN * ALIGN
    segs = [(0, h, False)] if h else []
    segs.append((h, nb, True))
    if h + nb < n:
        segs.append((h + nb, n - h - nb, False))
    return segs


def _hyper(x, dev: torch.device):
    """(6) A CPU tensor is read on the host like a float; a device tensor stays on the device."""
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        return float(x)
    return x


def adam_step_(master, exp_avg, exp_avg_sq, grad, param_out, *, lr, beta1, beta2, eps,
               weight_decay, adamw, step, grad_scale, found_inf) -> None:
    n = master.numel()
    dev = master.device
    on_cpu = dev.type == "cpu"
    with _on_device(dev):
        if n:
            sc = adam_scalars(dev, (lr, beta1, beta2, eps, weight_decay), step, grad_scale,
                              found_inf)
            _adam_launches(master, exp_avg, exp_avg_sq, grad, param_out, n, sc, adamw, on_cpu)
        _advance_step_kernel[(1,)](step, found_inf, num_warps=1, enable_fp_fusion=FP_FUSION)


def adam_scalars(dev: torch.device, hyper, step, grad_scale, found_inf) -> torch.Tensor:
    """(3) The (SC_LEN,) fp32 scalar buffer of one launch, written by the prologue kernel on
    dev's current stream (also the fused compact step's, compact_triton.py)."""
    hyper = [_hyper(x, dev) for x in hyper]
    hp_from_ptr = any(isinstance(x, torch.Tensor) for x in hyper)
    if hp_from_ptr:
        # Device tensors are read on the device; floats are filled there, not copied.
        hp = torch.stack([x.to(dev, torch.float64) if isinstance(x, torch.Tensor)
                          else torch.full((), x, dtype=torch.float64, device=dev)
                          for x in hyper])
        split = _ZEROS10
    else:
        hp = step  # unused pointer placeholder
        split = _split_args(tuple(float(x) for x in hyper))
    sc = torch.empty(SC_LEN, dtype=torch.float32, device=dev)
    _adam_scalars_kernel[(1,)](sc, *split, hp, step, grad_scale, found_inf,
                               HP_FROM_PTR=hp_from_ptr, num_warps=1, enable_fp_fusion=FP_FUSION)
    return sc


_ZEROS10 = (0.0,) * 10


def _adam_launches(master, exp_avg, exp_avg_sq, grad, param_out, n, sc, adamw, on_cpu):
    explicit = on_cpu  # the interpreter truncates fp32->bf16: round in the kernel
    out = master if param_out is None else (param_out.view(torch.int16) if explicit
                                            else param_out)
    arrays = [master, exp_avg, exp_avg_sq, grad, out]
    const = dict(ADAMW=adamw, HAS_OUT=param_out is not None,
                 OUT_IS_BF16=param_out is not None and param_out.dtype == torch.bfloat16,
                 EXPLICIT_RNE=explicit)
    for start, length, vector in _segments(n, arrays):
        a = arrays if length == n else [t[start:start + length] for t in arrays]
        block = _block(length, on_cpu) if vector or length >= ALIGN else BLOCK_EDGE
        warps = _num_warps(on_cpu) if block > BLOCK_EDGE else 1
        _adam_step_kernel[(triton.cdiv(length, block),)](*a, length, sc, BLOCK=block,
                                                         num_warps=warps,
                                                         enable_fp_fusion=FP_FUSION, **const)


def grad_stats_(grad, found_inf, sumsq) -> None:
    n = grad.numel()
    if n == 0:
        return
    on_cpu = grad.device.type == "cpu"
    segs = _segments(n, [grad])
    # (7) The body gets up to MAX_PARTIALS programs; each edge piece one more partial slot, so
    # the reduction order stays fixed by n and the alignment alone (deterministic).
    plan = []
    for start, length, vector in segs:
        block = _block(length, on_cpu) if vector or length >= ALIGN else BLOCK_EDGE
        nprog = min(triton.cdiv(length, block), MAX_PARTIALS)
        plan.append((start, length, block, nprog, triton.cdiv(triton.cdiv(length, block), nprog)))
    total = sum(p[3] for p in plan)
    with _on_device(grad.device):
        partial = torch.empty(total, dtype=torch.float32, device=grad.device)
        flags = torch.empty(total, dtype=torch.int32, device=grad.device)
        slot = 0
        for start, length, block, nprog, iters in plan:
            g = grad if length == n else grad[start:start + length]
            warps = _num_warps(on_cpu) if block > BLOCK_EDGE else 1
            _grad_stats_partial_kernel[(nprog,)](g, partial[slot:], flags[slot:], length, iters,
                                                 BLOCK=block, num_warps=warps,
                                                 enable_fp_fusion=FP_FUSION)
            slot += nprog
        _grad_stats_final_kernel[(1,)](partial, flags, total, found_inf, sumsq,
                                       PBLOCK=max(triton.next_power_of_2(total), 16),
                                       num_warps=_num_warps(on_cpu),
                                       enable_fp_fusion=FP_FUSION)
