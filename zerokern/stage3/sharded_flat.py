"""One (unit, param group) buffer at stage 3: only this rank's shard is resident (DESIGN §2).

Shapes (E = layout.padded_numel, S = E / world_size; one bucket per buffer, so rank r's shard
is the DESIGN layout `[r·S, (r+1)·S)` of the unit's flat buffer):
    flat        (S,)  model dtype   the resident param shard (the master itself at fp32)
    full        (E,)  model dtype   the gathered unit; its storage is resized to 0 when freed
    master      (S,)  fp32          None at fp32
    exp_avg     (S,)  fp32
    exp_avg_sq  (S,)  fp32
    steps       (1,)  int64
A frozen buffer (trainable=False: the unit's requires_grad=False params, e.g. a LoRA base model)
has only `flat` and `full`: it is gathered and freed with its unit and cast to the precision
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

from typing import List, Optional

import torch

from ..partition import FlatLayout, make_layout, round_up


class ShardedFlat:
    def __init__(self, params: List[torch.nn.Parameter], dtype: torch.dtype, world_size: int,
                 rank: int, group_index: int, unit_index: int, trainable: bool = True) -> None:
        self.params = params
        self.trainable = trainable
        self.dtype = dtype
        self.rank = rank
        self.stage = 3
        self.group_index = group_index
        self.unit_index = unit_index
        self.device = params[0].device
        numel = sum(p.numel() for p in params)
        unit = world_size * 128
        one_bucket = max(round_up(max(numel, 1), unit), unit)
        self.layout: FlatLayout = make_layout([tuple(p.shape) for p in params], world_size,
                                              one_bucket)
        L = self.layout
        S = L.shard_numel
        lo, hi = L.piece_range(0, rank)
        fp32 = torch.float32
        self.master: Optional[torch.Tensor] = None
        if dtype != fp32 and trainable:  # fp32 masters from the original values, before the cast
            self.master = torch.zeros(S, dtype=fp32, device=self.device)
            self._copy_params_(self.master, lo, hi)
        self.flat = torch.zeros(S, dtype=dtype, device=self.device)
        self._copy_params_(self.flat, lo, hi)
        self.full = torch.zeros(L.padded_numel, dtype=dtype, device=self.device)
        self.views = [self.full[s.offset:s.offset + s.numel].view(s.shape) for s in L.slots]
        self._empty = torch.empty(0, dtype=dtype, device=self.device)
        self._full_bytes = self.full.untyped_storage().nbytes()
        self.exp_avg = self.exp_avg_sq = self.steps = None
        if trainable:
            self.exp_avg = torch.zeros(S, dtype=fp32, device=self.device)
            self.exp_avg_sq = torch.zeros(S, dtype=fp32, device=self.device)
            self.steps = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.gathered = True   # full is allocated (freed just below)
        self.handle = None     # an all-gather in flight into full
        self.free()

    def _copy_params_(self, out: torch.Tensor, lo: int, hi: int) -> None:
        for i, a, b in self.layout.overlaps(lo, hi):
            s = self.layout.slots[i]
            out[a - lo:b - lo].copy_(self.params[i].detach().reshape(-1)[a - s.offset:b - s.offset])

    # -- gather / free -----------------------------------------------------------------------
    @property
    def full_bytes(self) -> int:
        return self._full_bytes

    def start_gather(self, comm, label=None) -> None:
        """Allocate full and launch the all-gather of every rank's shard into it (async)."""
        if self.gathered or self.handle is not None:
            return
        self.full.untyped_storage().resize_(self._full_bytes)
        self.handle = comm.all_gather_(self.full, self.flat, async_op=True, label=label)

    def finish_gather(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
            self.gathered = True
            for p, v in zip(self.params, self.views):
                p.data = v

    def free(self) -> None:
        if self.handle is not None:  # a prefetch nobody used: let it land before freeing
            self.handle.wait()
            self.handle = None
        for p in self.params:
            p.data = self._empty
        if not self.full.untyped_storage().resizable():
            # Exported while gathered (t.numpy(), as checkpoint and safetensors writers do,
            # marks the storage fixed-size): leave it to its holders and take a new one.
            L = self.layout
            self.full = torch.empty(L.padded_numel, dtype=self.dtype, device=self.device)
            self.views = [self.full[s.offset:s.offset + s.numel].view(s.shape) for s in L.slots]
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def write_back_(self) -> None:
        """After the user changed gathered params: take this rank's piece back into the shard.
        The fp32 master takes the new value only where the 16-bit param changed, so the
        params left alone keep their full-precision masters."""
        piece = self.full[slice(*self.layout.piece_range(0, self.rank))]
        if self.master is not None:
            changed = piece != self.flat
            master = self.master.to(piece.device)
            self.master.copy_(torch.where(changed, piece.float(), master))
        self.flat.copy_(piece)

    # -- the interface step() and the reports use (same names as FlatGroup) --------------------
    def state_slice(self, k: int) -> slice:
        return slice(0, self.layout.shard_numel)

    def master_piece(self, k: int) -> torch.Tensor:
        return self.master if self.master is not None else self.flat

    def param_out_piece(self, k: int) -> Optional[torch.Tensor]:
        return None if self.master is None else self.flat

    def moments(self, k: int):
        return self.exp_avg, self.exp_avg_sq

    def publish_piece(self, comm, k: int):
        """Stage 3 keeps only the shard: the next gather brings the update to every rank."""
        return None

    def state_tensors(self) -> dict:
        # The param shard too: at stage 3 the model's own state_dict has no values to give.
        out = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "steps": self.steps,
               "params": self.flat}
        if self.master is not None:
            out["master"] = self.master
        return out
