"""The engine's user-facing extras (loss scaling entry points, no_sync, zero_grad, clipping,
reports, gathered params): a mixin of optimizer.ZeroOptimizer, apart to keep each module to
one concern and under ~400 lines."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Dict

import torch

from zerokern.accounting.memory import memory_report

from .optimizer_args import check_clip


class OptimizerApiMixin:
    """Needs the engine's scaler, grad_sync, comm, flat_groups, placement, pattern."""

    @property
    def loss_scale(self) -> torch.Tensor:
        """0-d device tensor: the loss scale used by the last/next backward."""
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the loss scale, for `opt.scale_loss(loss).backward()`."""
        return self.grad_sync.mark_scaled_loss(loss * self.scaler.scale)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Loss-scaled backward. With fp16 (or an explicit loss_scale) every backward must go
        through the scale (this, or scale_loss); plain loss.backward() is fine otherwise."""
        self.scale_loss(loss).backward(**kwargs)

    @contextmanager
    def no_sync(self):
        """As DDP's no_sync(): backward passes inside accumulate locally, with no
        communication; the first backward outside reduces everything (or step() does). Stage 2
        holds a full local grad accumulator meanwhile (Ψ elements of reduce_dtype)."""
        gs = self.grad_sync
        old, gs.sync = gs.sync, False
        try:
            yield
        finally:
            gs.sync = old

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: p.grad becomes None (set_to_none=True) or zeros; the accumulated
        gradient (and every shard of it) is cleared."""
        self.grad_sync.zero_grad(set_to_none)
        self._clip_next = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over every rank's shard (a 0-d device tensor, no host sync);
        the coming step() clips to max_norm, as torch.nn.utils.clip_grad_norm_ would with
        DDP's gradients (coefficient max_norm / (norm + 1e-6), at most 1). Call after the last
        backward and before step(), as FSDP's clip_grad_norm_."""
        check_clip(max_norm, norm_type)
        self._check_ready()
        self._prepare()
        norm = self.grad_norm if norm_type == 2 else self._other_norm(float(norm_type))
        self._clip_next = (float(max_norm), norm)
        return norm.clone()

    def _other_norm(self, p: float) -> torch.Tensor:
        gs = self.grad_sync
        parts = [gs.grad_piece(gi, k).float() for gi, g in enumerate(self.flat_groups)
                 for k in range(g.layout.n_buckets)]
        if p == math.inf:
            acc = torch.stack([t.abs().max() for t in parts if t.numel()]).max()
            op = torch.distributed.ReduceOp.MAX
        else:
            acc = torch.stack([t.abs().pow(p).sum() for t in parts]).sum()
            op = torch.distributed.ReduceOp.SUM
        if not self.pattern.grads_averaged:
            self.comm.all_reduce_(acc, op=op)
        return (acc if p == math.inf else acc.pow(1.0 / p)) * self._unscale

    @property
    def offloader(self):
        """The offload placement (offload.Offloader / offload_nvme.NvmeOffloader), None
        without offload: for benchmarks and tests that tune its chunking."""
        return None if self.offload is None else self.placement

    # ---- introspection ---------------------------------------------------------------------

    def memory_report(self) -> Dict[str, Any]:
        """Bytes held per category on this rank, with the DESIGN §4 formula beside them."""
        return memory_report(self)

    def comm_stats(self, reset: bool = False) -> Dict[str, Any]:
        """Bytes sent per collective type by this rank since the last reset."""
        out = self.comm.stats.as_dict()
        if reset:
            self.comm.stats.reset()
        return out

    def reset_comm_stats(self) -> None:
        self.comm.stats.reset()

    @contextmanager
    def gathered_params(self, modify: bool = False):
        """Full params inside the block (stage 3 gathers every unit, then re-shards; at
        stages 0-2 they are always resident and this does nothing). Collective at stage 3.

        modify=True: changes made to the params inside are kept (each rank takes its piece
        back into its shard and fp32 master); otherwise they are discarded at stage 3.
        """
        if not self.pattern.shards_params:
            yield
            return
        self.grad_sync.gather_all()
        try:
            yield
        finally:
            self.grad_sync.release_all(write_back=modify)
