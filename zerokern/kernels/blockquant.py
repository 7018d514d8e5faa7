"""Block-quantized communication payloads (ZeRO++'s qwZ / qgZ): int8 and int4 with fp32 scales.

[Note: block quantization for collectives]
A quantized all-gather (qwZ) or reduction (qgZ) sends, per block of `block` elements, the
integer codes and one fp32 scale; the receiver dequantizes and, for gradients, reduces in fp32.
The exact arithmetic is the contract every backend meets bit for bit (reference here, Triton
in triton_blockquant.py), so ranks that dequantize the same bytes get the same values:
    scale = absmax / Q                      (fp32; Q = 127 for int8, 7 for int4)
    code  = clamp(rne(x / scale), -Q, Q)    (IEEE division, round half to even)
    x'    = code · scale                    (fp32, then round-to-nearest-even to the out dtype)
An all-zero block has scale 0 and codes 0. The error is at most scale / 2 = absmax / (2Q) per
element (absmax/254 for int8, absmax/14 for int4), tested against a float64 evaluation.
Blocks divide partition.ALIGN = 128 (block in {32, 64, 128}) so they never straddle a rank's
piece: each rank quantizes its own piece, and its own piece can stay exact where it is kept.
int4 packs two codes per byte, low nibble first, two's complement.
Bytes on the wire per element: int8 1 + 4/block, int4 0.5 + 4/block (block 128: 1.03 and
0.53, against 2 for bf16: 1.94x and 3.76x fewer).
"""

from __future__ import annotations

from typing import Tuple

import torch

from .op_routing import use_op
from .validate import BITS_Q, check_blockquant


def wire_bytes(numel: int, block: int = 128, bits: int = 8) -> int:
    """Bytes a quantized payload of `numel` elements takes: codes plus fp32 scales."""
    return numel * bits // 8 + (numel // block) * 4


def quantize(x: torch.Tensor, block: int = 128, bits: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of a flat tensor (reference backend).

    Args:
        x: (n,) fp32/bf16/fp16, n a multiple of `block`.
        block: elements per scale (32, 64 or 128).
        bits: 8 (int8 codes) or 4 (two codes per uint8).

    Returns:
        codes: (n,) int8, or (n/2,) uint8 packed for bits=4; scales: (n/block,) fp32.

    Raises:
        ValueError: bad bits, block or shape.
    """
    check_blockquant(x, block, bits)
    q = BITS_Q[bits]
    xb = x.float().view(-1, block)
    scale = xb.abs().amax(dim=1) / q
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(xb / safe[:, None]).clamp_(-q, q).to(torch.int8).view(-1)
    if bits == 4:
        codes = pack_int4(codes)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, block: int = 128, bits: int = 8,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(n,) values in `dtype` of codes and scales made by `quantize`."""
    c = unpack_int4(codes) if bits == 4 else codes
    return (c.float().view(-1, block) * scale[:, None]).view(-1).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(n,) int8 in [-8, 7] -> (n/2,) uint8, element 2i in the low nibble."""
    c = codes.to(torch.int16).view(-1, 2) & 0xF
    return (c[:, 0] | (c[:, 1] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(m,) uint8 -> (2m,) int8, sign-extended nibbles."""
    p = packed.to(torch.int16)
    lo, hi = p & 0xF, (p >> 4) & 0xF
    both = torch.stack([lo, hi], dim=1).view(-1)
    return torch.where(both > 7, both - 16, both).to(torch.int8)



class NativeCodec:
    """This contract on the CPU C++ kernel (csrc/cpu/blockquant_cpu.cpp), bitwise the
    reference on finite input ([Note: the CPU codec])."""

    def __init__(self, op) -> None:
        self.op = op

    def quantize(self, x: torch.Tensor, block: int = 128, bits: int = 8):
        """As `quantize` (the module function)."""
        check_blockquant(x, block, bits)
        if use_op(x):  # a fake tensor, or torch.compile tracing (custom_ops.py)
            return torch.ops.zerokern.blockquant_quantize(x, block, bits, "cpu")
        return self.quantize_now(x, block, bits)

    def quantize_now(self, x: torch.Tensor, block: int, bits: int):
        """The C++ kernel itself, on real CPU tensors (the op's real impl calls this)."""
        x = x.contiguous()
        n = x.numel()
        codes = torch.empty(n if bits == 8 else n // 2,
                            dtype=torch.int8 if bits == 8 else torch.uint8)
        scale = torch.empty(n // block, dtype=torch.float32)
        self.op.blockquant_quantize(x, codes, scale, block, bits)
        return codes, scale

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, block: int = 128,
                   bits: int = 8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """As `dequantize` (the module function)."""
        if use_op(codes):
            return torch.ops.zerokern.blockquant_dequantize(codes, scale, block, bits, dtype,
                                                            "cpu")
        return self.dequantize_now(codes, scale, block, bits, dtype)

    def dequantize_now(self, codes: torch.Tensor, scale: torch.Tensor, block: int, bits: int,
                       dtype: torch.dtype) -> torch.Tensor:
        """The C++ kernel itself, on real CPU tensors (the op's real impl calls this)."""
        out = torch.empty(scale.numel() * block, dtype=dtype)
        self.op.blockquant_dequantize(codes.contiguous(), scale.contiguous(), out, block, bits)
        return out


    # -- the collectives' CPU fast path ([Note: the CPU codec]; comm/quantized.py) ----------
    def quantize_into(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                      block: int = 128, bits: int = 8) -> None:
        """As `quantize`, written into `codes` (int8 or uint8 for bits=4: a payload's bytes)
        and `scale` (fp32) instead of new tensors: no allocation, no packing copy.

        Args:
            x: (n,) contiguous fp32/bf16/fp16 CPU tensor, n a multiple of `block`.
            codes: (n,) int8, or (n/2,) uint8 for bits=4 (either view of a uint8 payload).
            scale: (n/block,) fp32.
            block: elements per scale (32, 64 or 128).
            bits: 8 or 4.

        Raises:
            ValueError: bad bits, block or shape (RuntimeError from the kernel for a wrong
                output size or dtype).
        """
        check_blockquant(x, block, bits)
        if bits == 8 and codes.dtype == torch.uint8:
            codes = codes.view(torch.int8)
        self.op.blockquant_quantize(x, codes, scale, block, bits)

    def dequantize_into(self, codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                        block: int = 128, bits: int = 8) -> None:
        """out = `dequantize(codes, scale)` in out's dtype, written in place.

        Args:
            codes: int8 (or uint8 viewed as int8) codes, packed uint8 for bits=4.
            scale: (n/block,) fp32.
            out: (n,) contiguous fp32/bf16/fp16 CPU tensor.
            block: elements per scale.
            bits: 8 or 4.
        """
        self.op.blockquant_dequantize(codes, scale, out, block, bits)

    def dequantize_add_(self, codes: torch.Tensor, scale: torch.Tensor, acc: torch.Tensor,
                        block: int = 128, bits: int = 8) -> None:
        """acc += `dequantize(codes, scale)` (fp32; one fused pass, bitwise the two ops:
        qgZ's decode-and-sum).

        Args:
            codes: int8 (or uint8 viewed as int8) codes, packed uint8 for bits=4.
            scale: (n/block,) fp32.
            acc: (n,) contiguous fp32 CPU tensor.
            block: elements per scale.
            bits: 8 or 4.
        """
        self.op.blockquant_dequantize_add(codes, scale, acc, block, bits)


class OpCodec:
    """This contract through torch.ops.zerokern.blockquant_* on `backend`'s kernels (Triton
    on CUDA tensors): the op's fake impl runs under FakeTensorMode and torch.compile, the
    kernel otherwise ([Note: kernels as custom ops] in custom_ops.py)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def quantize(self, x: torch.Tensor, block: int = 128, bits: int = 8):
        """As `quantize` (the module function)."""
        check_blockquant(x, block, bits)
        return torch.ops.zerokern.blockquant_quantize(x, block, bits, self.backend)

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, block: int = 128,
                   bits: int = 8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """As `dequantize` (the module function)."""
        return torch.ops.zerokern.blockquant_dequantize(codes, scale, block, bits, dtype,
                                                        self.backend)


def codec_for(device: torch.device, backend: str = "auto"):
    """The backend of this contract for tensors on `device`, following the optimizer's kernel
    `backend` (kernels.dispatch.resolve): Triton (triton_blockquant) on CUDA, the C++ kernel
    for "cpu" (and "auto" on the CPU), this module's reference ops for "reference".

    [Note: the CPU codec] The C++ kernel is used on the CPU (both widths: one code path); the
    reference stays the spec the tests hold both to. First measured (1 thread, 2^20 fp32
    elements, load ~12): the portable kernel quantized int8 in 1.32 ms (the reference 1.20 ms)
    and dequantized in 0.27 ms; int4 1.34 / 0.25 ms against the reference's 2.14 / 11.2 ms
    (nibbles through int16 tensors and a stack). Issue 40 added the AVX-512 bodies
    (csrc/cpu/blockquant_cpu.cpp: codes by a product with the reciprocal, the IEEE division
    only near a rounding boundary) and the calls the collectives' CPU path makes without
    allocating or packing (`NativeCodec.quantize_into`, `dequantize_into`, `dequantize_add_`):
    against a copy of the same bytes on one core (bench_mesh.py --codec,
    benchmarks/results/mesh-quant-2x2-issue40-20261129.md), quantize int8 from fp32 runs at
    ~70% of the copy in cache and out of it (2^20: 0.29 ms), dequantize at ~90-110%, and the
    fused dequantize-add, which moves 9 bytes per element, in the time of a copy of ~4.
    Round 3 (the quantizer in groups of 16 blocks, int4 decode by a per-block table:
    [Note: the quantizer's instruction budget] in the C++ file) brought every (bits, input
    dtype, op) to >= 80% of the copy, int4 and bf16 input included (benchmarks/bench_codec.py,
    benchmarks/results/codec-cpu-issue40-20261129-r3.md: quantize 83-101%, dequantize
    80-108% at 2^20 and 2^24; before 45-74% and 58-105%).

    Args:
        device: where the tensors to quantize live.
        backend: the optimizer's kernel backend ("auto", "cpu", "reference", "triton",
            "cuda").

    Returns:
        an object with `quantize(x, block, bits)` and `dequantize(codes, scale, block, bits,
        dtype)`: on CUDA an `OpCodec` (the Triton kernels through torch.ops.zerokern).

    Raises:
        ValueError: a CUDA device without Triton.
    """
    import sys

    from .dispatch import resolve

    device = torch.device(device)
    if device.type == "cuda":
        try:
            from zerokern.kernels import triton_blockquant  # noqa: F401 (the op's kernels)
        except ImportError as e:
            raise ValueError("quantized collectives on CUDA tensors need Triton "
                             f"(zerokern.kernels.triton_blockquant): {e}") from e
        return OpCodec("triton")
    if device.type == "cpu" and resolve(backend, device) == "cpu":
        from .build import load_op

        return NativeCodec(load_op("cpu"))
    return sys.modules[__name__]
