"""Per-block optimizer states in checkpoints (8-bit AdamW's absmax: zerokern.rules [Note:
per-element and per-block states]).

[Note: block states in a checkpoint]
A checkpoint addresses state per param element (format.py: segments of one param's elements),
so every section has one element per param element. A per-block state (one fp32 absmax per 128
elements of a buffer) is written *expanded*: each element carries its block's absmax (4 bytes
per element; 8-bit AdamW's checkpoint is then 4 + 1 + 4 + 1 + 4 = 14 bytes per param element
against AdamW's 12: the codes and scales are stored as they are, never re-quantized, which is
what makes a resume exact). The codes (uint8) are per element already.
On load, each of the loader's blocks takes its elements' loaded scales:
- all the block's param elements carry the same scale (the same block in the saving layout):
  the block's absmax is that scale and the codes are the saved ones, bit for bit: the resumed
  run is the uninterrupted one. The slots of a per-block rule's buffers are block-aligned
  (partition.py [Note: block-aligned slots]): every block holds one param's elements, and a
  param's blocks start at its first element in every buffer, so this is always so between
  any world sizes and stages (stage 3's per-unit buffers against stages 0-2's per-group
  ones) and param groups;
- otherwise (a checkpoint saved with slots packed back to back, before the alignment, whose
  blocks straddled params): the block is re-quantized from the dequantized saved values
  (code x its own saved scale), one more rounding of at most half a code gap x absmax
  (kernels/quant8.py's bound), documented and tested.
Padding elements (the tail and the gaps of aligned slots) hold 0: the zero code.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

from zerokern.kernels.adamw8bit import quantize_blocks
from zerokern.kernels.quant8 import code_map


def expanded(g, k: int, lo: int, hi: int) -> Dict[str, torch.Tensor]:
    """Per-element copies of the block states for flat range [lo, hi) (block-aligned, held by
    this rank in bucket k): element i carries its block's value."""
    out = {}
    blocks = getattr(g.state, "blocks", {})
    if not blocks:
        return out
    st = g.state_slice(k).start + lo - g.state_range(k)[0]
    for name, b in blocks.items():
        t = g.rule_states[name]
        idx = (torch.arange(st, st + hi - lo, device=t.device) // b)
        out[name] = t[idx].clone()
    return out


def fixup(g, k: int, lo: int, hi: int, temps: Dict[str, torch.Tensor]) -> Callable[[], None]:
    """After a load wrote the codes and the per-element scales `temps` of flat range [lo, hi):
    set each block's absmax (exact) or re-quantize the block (module Note)."""
    def run() -> None:
        s0 = g.state_slice(k).start + lo - g.state_range(k)[0]
        real = torch.zeros(hi - lo, dtype=torch.bool, device=g.device)  # param elements
        for _, a, b in g.layout.overlaps(lo, hi):  # (not the tail, nor the gaps of aligned
            real[a - lo:b - lo] = True             # slots: partition.py)
        for name, scales in temps.items():
            code_name, signed = g.state.scaled[name]  # the rule's StateSpec.scales
            b = g.state.blocks[name]
            codes = g.rule_states[code_name][s0:s0 + hi - lo]
            absmax = g.rule_states[name][s0 // b:(s0 + hi - lo) // b]
            cmap = code_map(signed, codes.device)
            zero_code = quantize_blocks(torch.zeros(b, device=codes.device), signed)[0][0]
            sc = scales.view(-1, b)
            r = real.view(-1, b)
            big = torch.where(r, sc, torch.full_like(sc, -float("inf"))).amax(dim=1)
            small = torch.where(r, sc, torch.full_like(sc, float("inf"))).amin(dim=1)
            any_real = r.any(dim=1)
            exact = (big == small) | ~any_real
            vals = torch.where(real, cmap[codes.long()] * scales, torch.zeros_like(scales))
            codes.copy_(torch.where(real, codes, zero_code))
            absmax.copy_(torch.where(any_real, big, torch.zeros_like(big)).clamp_min(0))
            moved = (~exact).nonzero().flatten().tolist()
            for j in moved:  # re-quantize the blocks whose membership changed
                q, a = quantize_blocks(vals[j * b:(j + 1) * b].contiguous(), signed)
                codes[j * b:(j + 1) * b] = q
                absmax[j] = a[0]
    return run
