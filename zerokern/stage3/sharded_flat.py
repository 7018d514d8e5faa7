"""One (unit, param group) buffer at stage 3: only this rank's shard is resident (DESIGN §2).

Shapes (E = layout.padded_numel, S = E / world_size; one bucket per buffer, so rank r's shard
is the DESIGN layout `[r·S, (r+1)·S)` of the unit's flat buffer):
    param_shard (S,)  model dtype   the resident param shard (the master itself at fp32)
    full        (E,)  model dtype   the gathered unit; its storage is resized to 0 when freed
    master      (S,)  fp32          None at fp32
    rule states (S,)  fp32 each     the optimizer rule's (zerokern.rules), by name
    steps       (1,)  int64
With `param_format="fp8"` (kernels/param_codec.py [Note: FP8 params with an agreed scale]) a
trainable buffer stores `param_shard` as FP8 codes and `param_scales` (n_params,) fp32, the
same on every rank; the gather all-gathers the 1-byte codes (half of bf16's bytes) into
`codes_full` (E,) and decodes them into `full` (the model dtype) when it lands, and
`publish_piece` encodes the new master after each step (`store_piece`, collective).
A frozen buffer (trainable=False: the unit's requires_grad=False params, e.g. a LoRA base model)
has only `param_shard` and `full`: it is gathered and freed with its unit and cast to the precision
like the others, but holds no master, moments or step (None), and gets no grad shard.

[Note: freeing by storage resize]
The params are views into `full` while the unit is gathered and 0-element tensors otherwise
(p.data swapped), so stray use of a freed param fails loudly on shape. `full` keeps one storage
for its lifetime, resized to 0 bytes when freed and back when gathered, instead of a new tensor
per gather: autograd may save non-leaf views of a param (`weight.t()` in F.linear), which point
at that storage, so the backward re-gather refills exactly the memory they read. Dropping the
reference instead would keep every unit's full buffer alive until backward, through those
saved views, and bound nothing.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import List

import torch

from zerokern.geometry.dtensor_params import local_shape, set_local_
from zerokern.geometry.partition import make_layout, one_bucket_numel
from zerokern.layout.shard_buffer import ShardBuffer
from zerokern.layout.stages import pattern
from zerokern.stage3 import gather_stream
from zerokern.state import huge_pages


def unit_layout(shapes, world_size: int, slot_align: int = 1):
    """A stage-3 buffer's layout: one bucket holding every slot (slot_align: the group rule's,
    partition.py [Note: block-aligned slots])."""
    end = 0
    for s in shapes:
        end = -(-end // slot_align) * slot_align + math.prod(s)
    return make_layout(shapes, world_size, one_bucket_numel(end, world_size), slot_align)


class Residency(Enum):
    """Where a unit's params are (three states, so not a pair of flags)."""

    SHARD = "shard"          # only this rank's shard; the params are empty tensors
    GATHERING = "gathering"  # an all-gather into `full` is in flight (`handle`)
    GATHERED = "gathered"    # `full` holds the unit; the params view it


class ShardedFlat(ShardBuffer):
    def __init__(self, params: List[torch.nn.Parameter], dtype: torch.dtype, world_size: int,
                 rank: int, group_index: int, unit_index: int, trainable: bool = True,
                 placement=None, slot_align: int = 1) -> None:
        shapes = [local_shape(p) for p in params]  # DTensor params: their local shards
        layout = unit_layout(shapes, world_size, slot_align)
        self._init_buffer(params, dtype, rank, pattern(3), layout, group_index)
        self.trainable = trainable
        self.unit_index = unit_index
        L = self.layout
        lo, hi = L.piece_range(0, rank)
        if trainable:  # fp32 masters from the original values, before the cast
            if placement is None:
                from zerokern.state.placement import DevicePlacement

                placement = DevicePlacement()
            self.state = placement.allocate(self)
        # (S,) the resident param shard, flat range [lo, hi) of the unit (the master at fp32;
        # FP8 codes with a scaled codec), page-aligned, like the grad shards and the state
        # ([Note: streams at one page offset])
        codec = self.codec  # the placement's (allocate), else this dtype's
        self.param_shard = huge_pages.zeros(L.shard_numel, codec.storage_dtype, self.device)
        self.param_scales = None  # (n_params,) fp32, agreed: a scaled codec's
        self.codes_full = None    # (E,) uint8 while a scaled gather is in flight
        if codec.scaled:
            self.param_scales = torch.ones(len(L.slots), dtype=torch.float32,
                                           device=self.device)
            self.encode_params_()  # collective: every rank builds its buffers in one order
        else:
            self.copy_params_(self.param_shard, lo, hi)
        self.full = torch.zeros(L.padded_numel, dtype=dtype, device=self.device)
        self.views = [self.full[s.offset:s.offset + s.numel].view(s.shape) for s in L.slots]
        self._empty = torch.empty(0, dtype=dtype, device=self.device)
        self._full_bytes = self.full.untyped_storage().nbytes()
        self.residency = Residency.GATHERED  # full is allocated (freed just below)
        self.handle = None  # the all-gather in flight into full (GATHERING)
        # (slot, full value) of a model.load_state_dict while gathered, taken into the shard
        # when the unit is freed, unless the load is dropped ([Note: a write on some ranks
        # only] in runtime.py)
        self.pending_loads: List = []
        self.loaded_while_gathered = False
        self.free()

    @property
    def gathered(self) -> bool:
        return self.residency is Residency.GATHERED

    # -- gather / free -----------------------------------------------------------------------
    @property
    def full_bytes(self) -> int:
        return self._full_bytes

    def start_gather(self, comm, label=None, src=None, quantized=None) -> None:
        """Allocate full and launch the all-gather of every rank's shard into it (async); on a
        GPU on the gather stream ([Note: stage-3 gather stream]). src: hpZ's secondary piece,
        gathered over the node group (stage3/hpz.py). quantized: qwZ, Comm.gather_quantized_
        (the others' pieces int8-quantized, this rank's exact: comm/quantized.py)."""
        if self.residency is not Residency.SHARD:
            return
        gs = self._gather_stream()
        if gs is None:
            self._launch(comm, label, src, quantized)
        else:  # (the source is fetched on the gather stream: offload_params' H2D copy)
            with gs.context():
                self._launch(comm, label, src, quantized)
            self._landed = (gs, gs.record())
        self.residency = Residency.GATHERING

    def _launch(self, comm, label, src, quantized) -> None:
        self.full.untyped_storage().resize_(self._full_bytes)
        src = self._gather_source() if src is None else src
        self.quantized = quantized is not None
        if self.quantized:
            self.handle = quantized(self.full, src, label)
        elif self.param_scales is not None:  # FP8 codes: decoded into full at finish_gather
            self.codes_full = torch.empty(self.layout.padded_numel, dtype=torch.uint8,
                                          device=self.device)
            self.handle = comm.all_gather_(self.codes_full, src.view(torch.uint8),
                                           async_op=True, label=label)
        else:
            self.handle = comm.all_gather_(self.full, src, async_op=True, label=label)

    def _decode_gathered(self) -> None:
        """A scaled codec's gather landed: every param of `full` from its codes and scale."""
        if self.codes_full is None:
            return
        codes = self.codes_full.view(self.codec.storage_dtype)
        self.codec.decode_(codes, self.full, [(i, s.offset, s.offset + s.numel)
                                              for i, s in enumerate(self.layout.slots)],
                           self.param_scales)
        gs = self._gather_stream()
        if gs is not None:  # made on the gather stream, read here by the compute stream
            gs.used_by_compute(self.codes_full)
        self.codes_full = None

    # -- the scaled codec's encode (kernels/param_codec.py) -----------------------------------
    def _local_spans(self):
        lo, hi = self.layout.piece_range(0, self.rank)
        return [(i, a - lo, b - lo) for i, a, b in self.layout.overlaps(lo, hi)]

    def encode_params_(self) -> None:
        """The shard's codes from the fp32 master, with the per-param scales agreed across
        the ranks (collective: MAX of each param's amax through the codec's `agree`)."""
        self.codec.encode_(self.master_piece(0), self.param_shard, self._local_spans(),
                           self.param_scales)

    def store_piece(self, k: int) -> None:
        """After the update (and every other writer of the master): a scaled codec encodes
        the new master into the shard ([Note: the cast-back is the codec's])."""
        if self.param_scales is not None:
            self.encode_params_()

    def _gather_stream(self):
        return gather_stream.for_device(self.full.device)

    def _gather_source(self) -> torch.Tensor:
        return self.param_shard

    def _compute_waits_gather(self) -> None:
        landed = getattr(self, "_landed", None)
        if landed is not None:
            landed[0].compute_waits(landed[1])
            self._landed = None

    def finish_gather(self) -> None:
        if self.residency is Residency.GATHERING:
            self._compute_waits_gather()
            self.handle.wait()
            self.handle = None
            self._decode_gathered()
            self.residency = Residency.GATHERED
            for p, v in zip(self.params, self.views):
                set_local_(p, v)

    def free(self) -> None:
        self.apply_pending_loads()
        if self.residency is Residency.GATHERING:  # a prefetch nobody used: let it land
            self._compute_waits_gather()
            self.handle.wait()
            self.handle = None
            self.codes_full = None
        gs = self._gather_stream()
        if gs is not None and self.full.untyped_storage().nbytes():
            gs.used_by_compute(self.full)
        for p in self.params:
            set_local_(p, self._empty)
        self.see_writes()
        self.loaded_while_gathered = False
        if not self.full.untyped_storage().resizable():
            # Exported while gathered (t.numpy(), as checkpoint and safetensors writers do,
            # marks the storage fixed-size): leave it to its holders and take a new one.
            L = self.layout
            self.full = torch.empty(L.padded_numel, dtype=self.dtype, device=self.device)
            self.views = [self.full[s.offset:s.offset + s.numel].view(s.shape) for s in L.slots]
        self.full.untyped_storage().resize_(0)
        self.residency = Residency.SHARD
        self.quantized = False

    # [Note: a write to a sharded param] Between steps a param is a 0-element tensor
    # (freeing by storage resize above), so an in-place write to it (`p.clamp_()` for weight
    # clipping, `nn.init.*`, `p.fill_()`, `model.apply(init)`) does nothing, without a word: the
    # next forward gathers the old values. Every in-place op on p bumps p._version, a host
    # counter that the swaps of p.data here never move, so the counters taken when a param is
    # freed tell a write since then (guards.py raises at the next forward, step() and
    # gathered_params()). `p.data.clamp_()` is not seen: .data has a counter of its own, as it
    # escapes autograd (stages 0-2 have the same limit, core/model_sync.py).
    def see_writes(self, i=None) -> None:
        """Take the params' (or param i's) version counters as seen: no write since."""
        if i is None:
            self._versions = [p._version for p in self.params]
        else:
            self._versions[i] = self.params[i]._version

    def unseen_writes(self) -> List[int]:
        """The params written in place since see_writes (their indices)."""
        return [i for i, p in enumerate(self.params) if p._version != self._versions[i]]

    def apply_pending_loads(self) -> None:
        """Take the loads made while gathered into the shard (before a write-back, so that a
        write after the load inside the block wins where it changed a value)."""
        for i, value in self.pending_loads:
            self.load_piece_(i, value)
        self.pending_loads = []

    @torch.no_grad()
    def load_piece_(self, i: int, value: torch.Tensor) -> None:
        """Param i's full value (a loaded state dict's): this rank's piece into the shard
        (rounded to the model dtype, as the cast-back) and the full fp32 value into the
        master."""
        L = self.layout
        lo, hi = L.piece_range(0, self.rank)
        off = L.slots[i].offset
        flat_value = value.detach().reshape(-1)
        for j, a, b in L.overlaps(lo, hi):
            if j != i:
                continue
            src = flat_value[a - off:b - off].to(self.device)
            self.param_shard[a - lo:b - lo].copy_(src)  # round to nearest even
            if self.master is not None:
                self.master[a - lo:b - lo].copy_(src)  # the full fp32 value

    def write_back_(self) -> None:
        """After the user changed gathered params: take this rank's piece back into the shard.
        The fp32 master takes the new value only where the 16-bit param changed, so the
        params left alone keep their full-precision masters."""
        piece = self.full[slice(*self.layout.piece_range(0, self.rank))]
        if self.param_scales is not None:  # FP8: against the decoded codes, then re-encoded
            held = self.param_values(*self.layout.piece_range(0, self.rank))
            self.master.copy_(torch.where(piece != held, piece.float(), self.master))
            self.encode_params_()  # collective: every rank writes back every buffer
            return
        if self.master is not None:
            changed = piece != self.param_shard
            master = self.master.to(piece.device)
            self.master.copy_(torch.where(changed, piece.float(), master))
        self.param_shard.copy_(piece)

    # -- what ShardBuffer asks (the coordinates and the state are its own) --------------------
    def param_values(self, lo: int, hi: int) -> torch.Tensor:
        """The shard's values of flat [lo, hi): a view; with a scaled codec a decoded copy
        (the model dtype: what the forward sees), written only through the master."""
        base = self.layout.piece_range(0, self.rank)[0]
        if self.param_scales is None:
            return self.param_shard[lo - base:hi - base]
        out = torch.zeros(hi - lo, dtype=self.dtype, device=self.device)
        spans = [(i, a - lo, b - lo) for i, a, b in self.layout.overlaps(lo, hi)]
        return self.codec.decode_(self.param_shard[lo - base:hi - base], out, spans,
                                  self.param_scales)

    def param_out_piece(self, k: int):
        if self.param_scales is not None:
            return None  # the kernel writes no FP8: store_piece encodes after the update
        return super().param_out_piece(k)

    def params_loaded_(self) -> None:
        """The masters were replaced (a checkpoint load): a scaled codec re-encodes them
        (collective)."""
        if self.param_scales is not None:
            self.encode_params_()

    def _extra_state(self) -> dict:
        # The param shard too: at stage 3 the model's own state_dict has no values to give.
        if self.param_scales is not None:
            return {"params": self.param_shard, "param_scales": self.param_scales}
        return {"params": self.param_shard}

    def param_buffers(self):
        # the resident shard (frozen: the unit's requires_grad=False params), and the full
        # unit while it is gathered
        yield ("params" if self.trainable else "frozen"), self.param_shard, self.state_padding
        yield "live_units", self.full, self.layout.padding

    def value_pieces(self):
        return self.layout.overlaps(*self.layout.piece_range(0, self.rank))

    def step_params(self, k: int):
        return tuple(range(len(self.params)))

    def layout_meta(self) -> dict:
        return {**super().layout_meta(), "unit": self.unit_index}

    def check_between_steps(self) -> None:
        if self.residency is not Residency.SHARD:
            raise ValueError("opt has gathered stage-3 params (inside gathered_params() or "
                             "a forward): save or load between steps")
