"""One param group's flat buffer at stages 0-2: params as views, the whole buffer resident
(DESIGN §2). The coordinates and the state are `ShardBuffer`'s (shard_buffer.py).

Shapes (E = layout.padded_numel, S = state_numel: E at stage 0, else the shard):
    flat        (E,)  model dtype   params are views into it (the full buffer, every rank)
    master      (S,)  fp32          None at fp32 on the device (flat is the master)
    rule states (S,)  fp32 each     the optimizer rule's (zerokern.rules), by name
    steps       (B,)  int64         one counter per bucket
"""

from __future__ import annotations

from typing import List

import torch

from zerokern.geometry.dtensor_params import local, local_shape, set_local_
from zerokern.geometry.partition import bucket_numel_for, make_layout
from zerokern.layout.param_alias import own_storage_view
from zerokern.layout.shard_buffer import ShardBuffer
from zerokern.layout.stages import StagePattern, pattern
from zerokern.state import huge_pages


class FlatGroup(ShardBuffer):
    @staticmethod
    def layout_of(params: List[torch.nn.Parameter], dtype: torch.dtype, world_size: int,
                  bucket_bytes: float, slot_align: int = 1):
        """The buffer's layout (also asked before it exists: the NVMe free-space check).
        slot_align: `rules.slot_align(the group's rule)` (partition.py [Note: block-aligned
        slots])."""
        # DTensor params: their local shards ([Note: a DTensor param is its local tensor])
        return make_layout([local_shape(p) for p in params], world_size,
                           bucket_numel_for(bucket_bytes,
                                            torch.empty((), dtype=dtype).element_size(),
                                            world_size), slot_align)

    def __init__(self, params: List[torch.nn.Parameter], dtype: torch.dtype, world_size: int,
                 rank: int, stage, bucket_bytes: float, placement=None,
                 group_index: int = 0, slot_align: int = 1) -> None:
        pat = stage if isinstance(stage, StagePattern) else pattern(stage)
        layout = self.layout_of(params, dtype, world_size, bucket_bytes, slot_align)
        self._init_buffer(params, dtype, rank, pat, layout, group_index)
        if placement is None:
            from zerokern.state.placement import DevicePlacement

            placement = DevicePlacement()
        # fp32 masters are taken from the original values, before the cast (issue 3).
        self.state = placement.allocate(self)
        L = self.layout
        # page-aligned, like the grads and the state ([Note: streams at one page offset])
        self.flat = huge_pages.zeros(L.padded_numel, dtype, self.device)
        for p, s in zip(params, L.slots):
            self.flat[s.offset:s.offset + s.numel].copy_(local(p).detach().reshape(-1))
        for p, s in zip(params, L.slots):  # [Note: one storage per param] in layout/param_alias.py
            set_local_(p, own_storage_view(self.flat, s.offset, s.numel, s.shape))

    def param_values(self, lo: int, hi: int) -> torch.Tensor:
        return self.flat[lo:hi]

    # -- per-bucket views for the collectives --------------------------------------------------
    def bucket(self, buf: torch.Tensor, k: int) -> torch.Tensor:
        return buf[slice(*self.layout.bucket_range(k))]

    def piece(self, buf: torch.Tensor, k: int) -> torch.Tensor:
        return buf[slice(*self.layout.piece_range(k, self.rank))]

    def gather_piece(self, comm, k: int):
        """All-gather this rank's piece of bucket k into every rank's params (the publish of
        stages 1-2, ShardBuffer.publish_piece). Returns the async handle."""
        return comm.all_gather_(self.bucket(self.flat, k), self.piece(self.flat, k),
                                async_op=True, label=f"group {self.group_index} bucket {k}")

    # -- what the reports and the checkpoint see ----------------------------------------------
    def param_buffers(self):
        yield "params", self.flat, self.layout.padding

    def value_pieces(self):
        return [(i, s.offset, s.offset + s.numel) for i, s in enumerate(self.layout.slots)]

    # -- following the model (model_sync.py) ---------------------------------------------------
    def to_(self, device: torch.device) -> None:
        """Move every buffer to device (the params are re-viewed by adopt_params_)."""
        self.flat = self.flat.to(device)
        self.state.to_(device)
        self.device = torch.device(device)

    def adopt_params_(self) -> None:
        """Take each param's current values into the flat buffer and view it again."""
        base, es = self.flat.data_ptr(), self.flat.element_size()
        for p, s in zip(self.params, self.layout.slots):
            if local(p).data_ptr() != base + s.offset * es or p.device != self.device:
                self.flat[s.offset:s.offset + s.numel].copy_(local(p).detach().reshape(-1))
                set_local_(p, own_storage_view(self.flat, s.offset, s.numel, s.shape))


__all__ = ["FlatGroup"]
