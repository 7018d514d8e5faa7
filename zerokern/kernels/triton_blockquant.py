"""Triton kernels of blockquant.py's contract (int8 / int4 codes, fp32 scale per block).

One program quantizes ROWS blocks as a (ROWS, BLOCK) tile: the row's absmax, the scale, the
codes, in one read of x and one write of codes + scales (the byte floor: 2-4 B read, 1 or 0.5 B
+ 4/BLOCK B written per element). int4 loads the even and odd elements as two (ROWS, BLOCK/2)
tiles so each pair packs into one byte without a shuffle.
Exactness (blockquant [Note: block quantization for collectives]): IEEE division (div_rn: a
plain `/` lowers to an approximation on NVIDIA GPUs), round half to even written out with
floor (no libdevice rint: the interpreter has none; the operands come from a division, so
nothing can be contracted into an FMA), and the cast-back rounded explicitly (the interpreter
truncates fp32 -> bf16 casts, DESIGN §3).
Offsets are int64 (the block index is cast before it is multiplied by the block size: a
quantized bucket can pass 2^31 elements), and each launch runs under the tensors' device
(triton_kernels [Note: launch plan] (2)). FP fusion is pinned off ([Note: fp fusion pinned]
there): left to Triton 3.9's default it contracted _rne's r - 2*floor(r/2) into an FMA (exact
there, the same bits), and the code must not move with the default, which 3.10 changes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zerokern.kernels.triton_kernels import _cast_bits_rne, _on_device
from zerokern.kernels.validate import BITS_Q, check_blockquant

ROWS = 16  # blocks per program: 16 x 128 fp32 = 8 KiB of x per program
FP_FUSION = False


@triton.jit
def _rne(y):
    """Round half to even, exactly, for |y| < 2^22."""
    r = tl.floor(y)
    frac = y - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _codes(x, scale, Q: tl.constexpr):
    safe = tl.where(scale > 0.0, scale, 1.0)
    c = _rne(tl.div_rn(x, safe[:, None]))
    return tl.minimum(tl.maximum(c, -Q), Q).to(tl.int8)


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scale_ptr, nblocks, BLOCK: tl.constexpr,
                     ROWS_: tl.constexpr, Q: tl.constexpr, PACK4: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS_ + tl.arange(0, ROWS_)
    rmask = rows < nblocks
    if PACK4:
        j = tl.arange(0, BLOCK // 2)
        base = rows[:, None] * BLOCK + 2 * j[None, :]
        ev = tl.load(x_ptr + base, mask=rmask[:, None], other=0.0).to(tl.float32)
        od = tl.load(x_ptr + base + 1, mask=rmask[:, None], other=0.0).to(tl.float32)
        absmax = tl.maximum(tl.max(tl.abs(ev), axis=1), tl.max(tl.abs(od), axis=1))
        scale = tl.div_rn(absmax, Q * 1.0)
        lo = _codes(ev, scale, Q).to(tl.int32) & 0xF
        hi = _codes(od, scale, Q).to(tl.int32) & 0xF
        out = rows[:, None] * (BLOCK // 2) + j[None, :]
        tl.store(codes_ptr + out, (lo | (hi << 4)).to(tl.uint8), mask=rmask[:, None])
    else:
        k = tl.arange(0, BLOCK)
        offs = rows[:, None] * BLOCK + k[None, :]
        x = tl.load(x_ptr + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
        absmax = tl.max(tl.abs(x), axis=1)
        scale = tl.div_rn(absmax, Q * 1.0)
        tl.store(codes_ptr + offs, _codes(x, scale, Q), mask=rmask[:, None])
    tl.store(scale_ptr + rows, scale, mask=rmask)


@triton.jit
def _dequantize_kernel(codes_ptr, scale_ptr, out_ptr, nblocks, BLOCK: tl.constexpr,
                       ROWS_: tl.constexpr, PACK4: tl.constexpr, OUT_KIND: tl.constexpr):
    # OUT_KIND: 0 fp32, 1 bf16, 2 fp16
    rows = tl.program_id(0).to(tl.int64) * ROWS_ + tl.arange(0, ROWS_)
    rmask = rows < nblocks
    scale = tl.load(scale_ptr + rows, mask=rmask, other=0.0)
    k = tl.arange(0, BLOCK)
    offs = rows[:, None] * BLOCK + k[None, :]
    if PACK4:
        byte = tl.load(codes_ptr + offs // 2, mask=rmask[:, None], other=0).to(tl.int32)
        nib = tl.where((k[None, :] % 2) == 0, byte & 0xF, (byte >> 4) & 0xF)
        c = tl.where(nib > 7, nib - 16, nib).to(tl.float32)
    else:
        c = tl.load(codes_ptr + offs, mask=rmask[:, None], other=0).to(tl.float32)
    v = c * scale[:, None]
    if OUT_KIND == 0:
        tl.store(out_ptr + offs, v, mask=rmask[:, None])
    else:
        tl.store(out_ptr + offs, _cast_bits_rne(v, OUT_KIND == 1), mask=rmask[:, None])


def quantize(x: torch.Tensor, block: int = 128, bits: int = 8):
    """blockquant.quantize on the Triton backend (CUDA tensors, or CPU under the interpreter)."""
    check_blockquant(x, block, bits)
    nblocks = x.numel() // block
    codes = torch.empty(x.numel() // 2 if bits == 4 else x.numel(),
                        dtype=torch.uint8 if bits == 4 else torch.int8, device=x.device)
    scale = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    with _on_device(x.device):
        _quantize_kernel[(triton.cdiv(nblocks, ROWS),)](x, codes, scale, nblocks, BLOCK=block,
                                                        ROWS_=ROWS, Q=BITS_Q[bits],
                                                        PACK4=bits == 4,
                                                        enable_fp_fusion=FP_FUSION)
    return codes, scale


_OUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def dequantize(codes: torch.Tensor, scale: torch.Tensor, block: int = 128, bits: int = 8,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blockquant.dequantize on the Triton backend."""
    if dtype not in _OUT:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    n = scale.numel() * block
    out = torch.empty(n, dtype=dtype, device=codes.device)
    # 16-bit outputs are written as the int16 bit patterns _cast_bits_rne makes
    dst = out if dtype == torch.float32 else out.view(torch.int16)
    with _on_device(codes.device):
        _dequantize_kernel[(triton.cdiv(scale.numel(), ROWS),)](codes, scale, dst, scale.numel(),
                                                                BLOCK=block, ROWS_=ROWS,
                                                                PACK4=bits == 4,
                                                                OUT_KIND=_OUT[dtype],
                                                                enable_fp_fusion=FP_FUSION)
    return out
