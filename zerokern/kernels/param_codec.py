"""The param codec: how the model's params are stored, given the fp32 master (issue 35).

One object per optimizer says, for every buffer it builds:
    storage_dtype   what the resident params are held in (stage 3: the param shard)
    compute_dtype   what the model computes with (the gathered params at stage 3)
    has_master      whether an fp32 master is kept apart (False at fp32: the params are it)
    fused           whether the step kernels write the cast-back in their one pass
and does the cast-back wherever a kernel cannot: `cast_` (16-bit: `out.copy_(master)`,
round to nearest even, bitwise `master.to(dtype)`), and for a scaled format `encode_` (master
-> stored codes, with a scale agreed across ranks) and `decode_` (codes -> compute dtype).

[Note: the cast-back is the codec's]
The fused kernels (adam_step_, lion_step_, adamw8bit_step_ on every backend) write the
16-bit param in the pass that updates the master (DESIGN §3, 28n bytes): they take a
`param_out` and round to its dtype (fp16/bf16, `FUSED_DTYPES`). Which tensor they are handed is
the codec's answer (`kernel_out`): the params' own piece where the format is fused, None where
the params are the master (fp32) or where the format is one the kernels cannot write. A format
outside `FUSED_DTYPES` (FP8) is then an `encode_` pass after the update instead, and no kernel,
rule or placement changes: they pass on what `kernel_out` gave them. Every other place that
casts a master into params (a phased rule's pass, a rolled-back NVMe step, a skipped param's
restore) calls `cast_`, so the rounding is defined once.

[Note: FP8 params with an agreed scale]
`Float8Codec` stores params as torch.float8_e4m3fn (4 exponent bits, 3 mantissa bits, finite
range +-448) with one fp32 scale per param (per tensor, torchao's float8 "tensorwise"
scaling). The scale is a function of the whole param's fp32 master:
    amax  = max |master| over the param       (over every rank's part: agreed, MAX)
    scale = amax / 448  (1 where amax is 0)    (fp32 division: correctly rounded)
    code  = e4m3(clamp(fp32(master / scale), -448, 448))   (round to nearest even)
    value = compute_dtype(fp32(code * scale))
A param straddles the shards of several ranks (partition.py), and each holds part of its
master: the per-param amax is reduced with MAX over the data-parallel world (the optimizer's
`plan.agree_`, handed in as `agree`), so every rank derives the same scale and a gathered
param decodes to one value everywhere (HSDP's replicas hold the same shard, so the MAX over
them changes nothing). A scale from a rank's own part only would decode that rank's piece of a
param on another scale than its neighbour's: tests/kernels/test_param_codec.py shows the
decoded params then differ from the spec. Cost per step: one extra read of the master
(amax), one read and a 1-byte write (encode), one all-reduce of n_params floats per buffer.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Tuple

import torch

from .validate import OUT_DTYPES

FUSED_DTYPES = OUT_DTYPES  # what the step kernels can write as param_out (fp16, bf16)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0

# (slot, a, b): param slot `slot` covers elements [a, b) of a piece (layout.overlaps, local)
Spans = Iterable[Tuple[int, int, int]]
Agree = Callable[[torch.Tensor], torch.Tensor]  # MAX in place over the ranks, returns it


class ParamCodec:
    """The 16-bit (or fp32) cast-back: params stored in `storage_dtype`, computed with as
    they are ([Note: the cast-back is the codec's]).

    Args:
        storage_dtype: torch.float32, torch.bfloat16 or torch.float16.
    """

    scaled = False  # the codes need per-param scales (encode_/decode_)

    def __init__(self, storage_dtype: torch.dtype) -> None:
        if storage_dtype not in (torch.float32, *FUSED_DTYPES):
            raise ValueError(f"ParamCodec: storage_dtype must be torch.float32, bfloat16 or "
                             f"float16, got {storage_dtype!r}")
        self.storage_dtype = storage_dtype
        self.compute_dtype = storage_dtype
        # decided once: kernel_out runs per piece on the step path
        self._kernel_writes = self.has_master and self.fused

    @property
    def name(self) -> str:
        return str(self.storage_dtype).replace("torch.", "")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"

    @property
    def has_master(self) -> bool:
        """An fp32 master apart from the params (not at fp32: the params are the master)."""
        return self.storage_dtype != torch.float32

    @property
    def fused(self) -> bool:
        """The step kernels write the cast-back in their pass (`kernel_out`)."""
        return self.storage_dtype in FUSED_DTYPES

    def kernel_out(self, params: torch.Tensor) -> Optional[torch.Tensor]:
        """The `param_out` to hand a step kernel whose master piece matches `params` (the
        resident params of the same elements): `params` where the kernel writes the cast-back,
        None where there is none to write (fp32) or the codec writes it after (`encode_`)."""
        return params if self._kernel_writes else None

    def cast_(self, out: torch.Tensor, master: torch.Tensor, non_blocking: bool = False) -> None:
        """The cast-back outside a kernel: `out` (storage dtype) = `master` (fp32) rounded to
        nearest even, bitwise `master.to(dtype)` (DESIGN §3); a pinned host master is copied
        without a host wait with `non_blocking`."""
        out.copy_(master, non_blocking=non_blocking)

    def storage_bytes(self, numel: int) -> int:
        """Bytes of `numel` stored params."""
        return numel * self.storage_dtype.itemsize


class Float8Codec(ParamCodec):
    """FP8 params (torch.float8_e4m3fn) with one fp32 scale per param agreed across the ranks
    ([Note: FP8 params with an agreed scale]); computed with in `compute_dtype`. The kernels do
    not write FP8: `kernel_out` is None and the owner of the params calls `encode_` after the
    update.

    Args:
        compute_dtype: torch.bfloat16 or torch.float16: the gathered params' dtype.
        agree: reduces a (n_params,) fp32 tensor in place with MAX over the ranks that hold
            parts of the same params (the optimizer's `plan.agree_`); None: one rank.
    """

    scaled = True

    def __init__(self, compute_dtype: torch.dtype, agree: Optional[Agree] = None) -> None:
        if compute_dtype not in FUSED_DTYPES:
            raise ValueError(f"Float8Codec: compute_dtype must be torch.bfloat16 or float16, "
                             f"got {compute_dtype!r}")
        self.storage_dtype = FP8_DTYPE
        self.compute_dtype = compute_dtype
        self.agree = agree
        self._kernel_writes = False  # the kernels write no FP8: encode_ after the update

    @property
    def name(self) -> str:
        return "fp8"

    @property
    def fused(self) -> bool:
        return False

    def cast_(self, out, master, non_blocking: bool = False) -> None:
        """Nothing here: FP8 codes need the scale agreed over the whole param, so the owner
        of the params encodes each piece once at publish (`encode_`, collective), after every
        writer of the master (the kernel, a phased rule's pass, a skipped param's restore)."""

    # -- encode: master -> codes, after the update ----------------------------------------------
    def amax_(self, master: torch.Tensor, spans: Spans, amax: torch.Tensor) -> torch.Tensor:
        """amax[i] = max |master[a:b]| for each span (i, a, b) of a piece: the slots of one
        contiguous piece are consecutive, so one fused reduction fills amax[i0:i1]. The slots
        without elements here keep 0. Returns amax ((n_slots,) fp32)."""
        spans = [(i, a, b) for i, a, b in spans if b > a]
        amax.zero_()
        if spans:
            i0 = spans[0][0]
            norms = torch._foreach_norm([master[a:b] for _, a, b in spans], float("inf"))
            amax[i0:i0 + len(spans)].copy_(torch.stack(norms))
        return amax

    @staticmethod
    def scales_(amax: torch.Tensor) -> torch.Tensor:
        """In place: the agreed amax -> the scale, amax / 448 (1 where amax is 0)."""
        return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax), out=amax)

    def encode_(self, master: torch.Tensor, out: torch.Tensor, spans: Spans,
                scales: torch.Tensor, agree: bool = True) -> torch.Tensor:
        """Write `out` (FP8, the piece's stored params) from `master` (fp32, same elements)
        with per-param scales agreed across the ranks: `scales` ((n_slots,) fp32, every slot
        of the buffer, on every rank) is overwritten with the new scales. Collective when
        agree (every rank calls it, in the same order, for the same buffer). Elements outside
        the spans (padding) are left as they are. Returns scales."""
        spans = list(spans)
        self.amax_(master, spans, scales)
        if agree and self.agree is not None:
            self.agree(scales)
        self.scales_(scales)
        for i, a, b in spans:
            if b > a:
                q = torch.div(master[a:b], scales[i]).clamp_(-FP8_MAX, FP8_MAX)
                out[a:b].copy_(q)  # round to nearest even (torch's cast)
        return scales

    # -- decode: codes -> compute dtype, where the params are used ------------------------------
    def decode_(self, codes: torch.Tensor, out: torch.Tensor, spans: Spans,
                scales: torch.Tensor) -> torch.Tensor:
        """out[a:b] = compute_dtype(fp32(codes[a:b]) * scales[i]) for each span; returns out."""
        for i, a, b in spans:
            if b > a:
                out[a:b].copy_(codes[a:b].float().mul_(scales[i]))
        return out

    def storage_bytes(self, numel: int) -> int:
        return numel  # one byte each (the scales: 4 bytes per param, apart)


PARAM_FORMATS = (None, "fp8")


def check_param_format(param_format, dtype: torch.dtype, stage: int, **others) -> None:
    """`param_format=` of an optimizer: None (the params in the precision's dtype) or "fp8"
    (stage 3's param shards stored and all-gathered as FP8 with agreed per-param scales,
    decoded to the precision's 16-bit dtype at the gather). Raised on every rank before any
    change.

    Args:
        param_format: the argument.
        dtype: the precision's param dtype.
        stage: the ZeRO stage.
        others: the options FP8 params do not combine with, by argument name, each with the
            value that is allowed (the first) and the given one, e.g.
            offload=(None, offload).

    Raises:
        TypeError / ValueError: naming `param_format` and the argument in the way.
    """
    if param_format is not None and not isinstance(param_format, str):
        raise TypeError(f"param_format must be None or 'fp8', got "
                        f"{type(param_format).__name__}")
    if param_format not in PARAM_FORMATS:
        raise ValueError(f"param_format must be None or 'fp8', got {param_format!r}")
    if param_format is None:
        return
    if stage != 3:
        raise ValueError(f"param_format='fp8' stores stage 3's param shards as FP8 and decodes "
                         f"them at the gather; stage={stage} keeps whole params in the model "
                         "dtype (use stage=3)")
    if dtype not in FUSED_DTYPES:
        raise ValueError(f"param_format='fp8' decodes to a 16-bit compute dtype: use "
                         f"precision='bf16' or 'fp16' (got params of {dtype})")
    for name, (allowed, given) in others.items():
        if given != allowed:
            raise ValueError(f"param_format='fp8' does not combine with {name}={given!r} "
                             f"(use {name}={allowed!r})")


def make_param_codec(dtype: torch.dtype, param_format=None,
                     agree: Optional[Agree] = None) -> ParamCodec:
    """The optimizer's codec: `ParamCodec(dtype)` (None), or `Float8Codec(dtype, agree)`
    ("fp8", checked by `check_param_format`)."""
    if param_format == "fp8":
        return Float8Codec(dtype, agree)
    return ParamCodec(dtype)
