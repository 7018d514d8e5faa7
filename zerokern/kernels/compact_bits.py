"""The bit operations of `master="compact"` (zerokern/compact_master.py [Note: the compact
master]): compact an fp32 master into its low halves and tie bits, expand it back from them and
the bf16 params, verify a master rounds to its params. One pass each way on the CPU
(csrc/cpu/compact_cpu.cpp); torch ops elsewhere (and where the op cannot be built), the same
bits (tests/state/test_compact_master.py checks both).
"""

from __future__ import annotations

from typing import Optional

import torch

from .build import load_op

TIE = -32768  # int16 view of the low half 0x8000
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def tie_bytes(n: int) -> int:
    """Bytes of the tie bitmap for n state elements (n is a multiple of 8: 128-aligned)."""
    return n // 8


_BITS_ON = {}  # device -> _BITS there (copied once, not per chunk)


def _bits(device) -> torch.Tensor:
    if device.type == "cpu":
        return _BITS
    if device not in _BITS_ON:
        _BITS_ON[device] = _BITS.to(device)
    return _BITS_ON[device]


def unpack_ties(ties: torch.Tensor) -> torch.Tensor:
    """(n/8,) uint8 -> (n,) bool, bit j of byte i is element 8i + j."""
    return (ties.unsqueeze(1) & _bits(ties.device)).ne(0).view(-1)


def _native(t: torch.Tensor):
    """The CPU op module (csrc/cpu/compact_cpu.cpp: one pass each way), or None: on another
    device, or if it cannot be built, the torch version below does the same, bit for bit."""
    global _OPS
    if t.device.type != "cpu":
        return None
    if _OPS is None:
        try:
            _OPS = load_op("cpu")
        except Exception:  # noqa: BLE001 (a build failure: the torch path is exact too)
            _OPS = False
    return _OPS or None


_OPS = None


def compact_(low: torch.Tensor, ties: torch.Tensor, master: torch.Tensor,
             nan: Optional[torch.Tensor] = None) -> None:
    """Write master's (n,) fp32 low halves into low (n,) int16 and its tie carries into ties
    (n/8,) uint8; nan (0-d bool), if given, |= any NaN in master."""
    op = _native(master)
    if op is not None:
        if nan is None:
            nan = torch.zeros((), dtype=torch.bool)
        op.compact_store(low, ties, master, nan)
        return
    compact_torch_(low, ties, master)
    if nan is not None:
        nan |= torch.isnan(master).any()


def compact_torch_(low: torch.Tensor, ties: torch.Tensor, master: torch.Tensor) -> None:
    pair = master.view(torch.int16).view(-1, 2)
    low.copy_(pair[:, 0])
    tie = low.eq(TIE) & (pair[:, 1] & 1).bool()
    torch.sum(tie.view(-1, 8).to(torch.uint8) * _bits(master.device), 1, dtype=torch.uint8,
              out=ties)


def expand_(out: torch.Tensor, low: torch.Tensor, ties: torch.Tensor,
            param: torch.Tensor) -> torch.Tensor:
    """out (n,) fp32 = the master whose low half is low, tie bits ties and bf16 value param."""
    op = _native(out)
    if op is not None:
        op.compact_expand(out, low, ties, param)
        return out
    return expand_torch_(out, low, ties, param)


def expand_torch_(out: torch.Tensor, low: torch.Tensor, ties: torch.Tensor,
                  param: torch.Tensor) -> torch.Tensor:
    carry = low.lt(0)
    carry ^= low.eq(TIE)          # l in (0x8000, 0xFFFF]
    carry |= unpack_ties(ties)    # l == 0x8000 and hi odd (set only there)
    pair = out.view(torch.int16).view(-1, 2)
    pair[:, 0].copy_(low)
    torch.sub(param.view(torch.int16), carry.to(torch.int16), out=pair[:, 1])
    return out


def verify(master: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """0-d device bool: master (fp32) has no NaN and rounds to param (bf16) bit for bit, so its
    compaction expands back to it exactly."""
    ok = master.to(torch.bfloat16).view(torch.int16).eq(param.view(torch.int16)).all()
    return ok & ~torch.isnan(master).any()


def compact_adam_step_(low: torch.Tensor, ties: torch.Tensor, param: torch.Tensor,
                       exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                       nan: torch.Tensor, *, lr, beta1, beta2, eps, weight_decay, adamw: bool,
                       step: torch.Tensor, grad_scale: torch.Tensor,
                       found_inf: torch.Tensor) -> None:
    """The compact master's AdamW step in one CPU pass (csrc/cpu/compact_adam_cpu.cpp; Note:
    fused compact step on the CPU, in state/compact_master.py): bit for bit expand_ -> the cpu
    adam_step_ with param_out = param -> compact_(..., nan).

    low (n,) int16, ties (n/8,) uint8, param (n,) bf16, exp_avg / exp_avg_sq (n,) fp32 are
    updated in place; grad (n,) fp32/fp16/bf16; nan a 0-d bool set if a new master is NaN; n a
    multiple of 8. lr, betas, eps, weight_decay (floats or 0-d CPU tensors), step, grad_scale
    and found_inf as `kernels.adam_step_` (a skipped step writes nothing, step included, and
    still reports a NaN master in nan, as the chain's compact_ does).
    """
    n = low.numel()
    if n % 8 or ties.numel() != n // 8 or param.dtype != torch.bfloat16 or param.numel() != n:
        raise ValueError(f"compact step: low ({low.numel()}), ties ({ties.numel()}) and bf16 "
                         f"param ({param.numel()}, {param.dtype}) do not describe one master "
                         "of n = 8k elements")
    op = _native(low)
    if op is None:
        raise ValueError("compact_adam_step_: needs CPU tensors and the cpu op (the chunked "
                         "path, CompactState.update_piece, serves the other cases)")
    op.compact_adam_step(low, ties, param, exp_avg, exp_avg_sq, grad, nan, float(lr),
                         float(beta1), float(beta2), float(eps), float(weight_decay), adamw,
                         step, grad_scale, found_inf)
