"""One param group's flat buffers: params as views, fp32 master and Adam moments (DESIGN §2).

Shapes (E = layout.padded_numel, S = layout.shard_numel):
    flat        (E,)  model dtype   params are views into it, all stages (0-2)
    master      (S,)  fp32          own shard; (E,) at stage 0; None at fp32 (flat is the master)
    exp_avg     (S,)  fp32          (E,) at stage 0
    exp_avg_sq  (S,)  fp32          (E,) at stage 0
    steps       (B,)  int64         one counter per bucket: each bucket is its own adam_step_
                                    call, and every call advances the step it is given
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .partition import FlatLayout, bucket_numel_for, make_layout


class FlatGroup:
    def __init__(self, params: List[torch.nn.Parameter], dtype: torch.dtype, world_size: int,
                 rank: int, stage: int, bucket_bytes: float) -> None:
        self.params = params
        self.dtype = dtype
        self.rank = rank
        self.stage = stage
        self.device = params[0].device
        self.layout: FlatLayout = make_layout(
            [tuple(p.shape) for p in params], world_size,
            bucket_numel_for(bucket_bytes, torch.empty((), dtype=dtype).element_size(),
                             world_size))
        L = self.layout
        state_numel = L.padded_numel if stage == 0 else L.shard_numel
        fp32 = torch.float32
        # fp32 masters are taken from the original values, before the cast (issue 3).
        self.master: Optional[torch.Tensor] = None
        if dtype != fp32:
            self.master = torch.zeros(state_numel, dtype=fp32, device=self.device)
            for k in range(L.n_buckets):
                lo, hi = self._state_range(k)
                self._gather_params_(self.master[self.state_slice(k)], lo, hi)
        self.flat = torch.zeros(L.padded_numel, dtype=dtype, device=self.device)
        for p, s in zip(params, L.slots):
            self.flat[s.offset:s.offset + s.numel].copy_(p.detach().reshape(-1))
        for p, s in zip(params, L.slots):
            p.data = self.flat[s.offset:s.offset + s.numel].view(s.shape)
        self.exp_avg = torch.zeros(state_numel, dtype=fp32, device=self.device)
        self.exp_avg_sq = torch.zeros(state_numel, dtype=fp32, device=self.device)
        self.steps = torch.zeros(L.n_buckets, dtype=torch.int64, device=self.device)

    # -- coordinates -------------------------------------------------------------------------
    def _state_range(self, k: int):
        """Flat range whose optimizer state this rank holds for bucket k."""
        return self.layout.bucket_range(k) if self.stage == 0 else \
            self.layout.piece_range(k, self.rank)

    def state_slice(self, k: int) -> slice:
        """Bucket k's part of the state buffers (master, exp_avg, exp_avg_sq)."""
        if self.stage == 0:
            return slice(*self.layout.bucket_range(k))
        off = self.layout.shard_offset(k)
        return slice(off, off + self.layout.piece_numel(k))

    def _gather_params_(self, out: torch.Tensor, lo: int, hi: int) -> None:
        """Copy the (original, pre-cast) param values of flat range [lo, hi) into out."""
        for i, a, b in self.layout.overlaps(lo, hi):
            s = self.layout.slots[i]
            src = self.params[i].detach().reshape(-1)[a - s.offset:b - s.offset]
            out[a - lo:b - lo].copy_(src)

    # -- per-bucket views handed to the kernels ----------------------------------------------
    def master_piece(self, k: int) -> torch.Tensor:
        if self.master is not None:
            return self.master[self.state_slice(k)]
        return self.flat[slice(*self._state_range(k))]  # fp32: the flat buffer is the master

    def param_out_piece(self, k: int) -> Optional[torch.Tensor]:
        return None if self.master is None else self.flat[slice(*self._state_range(k))]

    def moments(self, k: int):
        sl = self.state_slice(k)
        return self.exp_avg[sl], self.exp_avg_sq[sl]

    def bucket(self, buf: torch.Tensor, k: int) -> torch.Tensor:
        return buf[slice(*self.layout.bucket_range(k))]

    def piece(self, buf: torch.Tensor, k: int) -> torch.Tensor:
        return buf[slice(*self.layout.piece_range(k, self.rank))]

    def publish_piece(self, comm, k: int):
        """After bucket k's update: all-gather this rank's new piece into every rank's params
        (stages 1-2, async, in place: it overlaps bucket k+1's update); stage 0 updated the
        whole bucket itself. Returns the handle, or None."""
        if self.stage == 0:
            return None
        return comm.all_gather_(self.bucket(self.flat, k), self.piece(self.flat, k),
                                async_op=True, label=f"group {self.group_index} bucket {k}")

    def state_tensors(self) -> dict:
        out = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "steps": self.steps}
        if self.master is not None:
            out["master"] = self.master
        return out

    # -- following the model (model_sync.py) ---------------------------------------------------
    def to_(self, device: torch.device) -> None:
        """Move every buffer to device (the params are re-viewed by adopt_params_)."""
        for name in ("flat", "master", "exp_avg", "exp_avg_sq", "steps"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        self.device = torch.device(device)

    def adopt_params_(self) -> None:
        """Take each param's current values into the flat buffer and view it again."""
        base, es = self.flat.data_ptr(), self.flat.element_size()
        for p, s in zip(self.params, self.layout.slots):
            if p.data_ptr() != base + s.offset * es or p.device != self.device:
                view = self.flat[s.offset:s.offset + s.numel]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(s.shape)
