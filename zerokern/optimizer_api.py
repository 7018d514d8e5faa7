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
        """The loss times the loss scale, for `opt.scale_loss(loss).backward()`.

        Args:
            loss: the 0-d loss tensor.

        Returns:
            loss * loss_scale (the same graph), marked as scaled for `step()`.
        """
        return self.grad_sync.mark_scaled_loss(loss * self.scaler.scale)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Loss-scaled backward. With fp16 (or an explicit loss_scale) every backward must go
        through the scale (this, or scale_loss); plain loss.backward() is fine otherwise.

        Args:
            loss: the 0-d loss tensor (divide it by the number of micro-batches when
                accumulating, as with DDP).
            **kwargs: passed to `torch.Tensor.backward` (e.g. retain_graph).
        """
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
        gradient (and every shard of it) is cleared.

        Args:
            set_to_none: True (torch's default): `p.grad` becomes None; with
                free_grads=True the gradient memory is freed too. False: zeros.
        """
        self.grad_sync.zero_grad(set_to_none)
        self._clip_next = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over every rank's shard (a 0-d device tensor, no host sync);
        the coming step() clips to max_norm, as torch.nn.utils.clip_grad_norm_ would with
        DDP's gradients (coefficient max_norm / (norm + 1e-6), at most 1). Call after the last
        backward and before step(), as FSDP's clip_grad_norm_.

        Args:
            max_norm: the largest norm the step's gradient may have (> 0).
            norm_type: 2.0 (default), any p > 0, or math.inf.

        Returns:
            The global norm of the (unclipped, unscaled) gradient: a 0-d fp32 tensor on the
            param device, the same on every rank.

        Raises:
            ValueError: max_norm or norm_type out of range.
            RuntimeError: no backward since the last step (nothing to clip).
        """
        check_clip(max_norm, norm_type)
        self._check_ready()
        self._prepare()
        norm = self.grad_norm if norm_type == 2 else self._other_norm(float(norm_type))
        self._clip_next = (float(max_norm), norm)
        return norm.clone()

    def _other_norm(self, p: float) -> torch.Tensor:
        tp = getattr(self, "tp", None)
        if tp is not None and p != math.inf:  # (tp-replicated elements would count tp times)
            raise ValueError(f"norm_type={p} is not supported with tensor parallelism (DTensor "
                             "params); use norm_type=2 or inf")
        gs, mp = self.grad_sync, self.model_parallel
        parts = [t.float() for gi, g in enumerate(self.flat_groups)
                 for k in range(g.layout.n_buckets)
                 for t in ([gs.grad_piece(gi, k)] if mp is None
                           else mp.counted(gs.grad_piece(gi, k), gi, k))]
        if p == math.inf:
            zero = torch.zeros((), dtype=torch.float32, device=self._stats.device)
            acc = torch.stack([t.abs().max() for t in parts if t.numel()] or [zero]).max()
            op = torch.distributed.ReduceOp.MAX
        else:
            acc = torch.stack([t.abs().pow(p).sum() for t in parts]).sum()
            op = torch.distributed.ReduceOp.SUM
        averaged = self.pattern.grads_averaged
        if not averaged and p != math.inf:
            self.comm.count_once_(acc)  # HSDP: replicas hold the same shard
        # over dp where each rank read a shard, and over the model-parallel ranks (the tp
        # shards, an mpu's slices): [Note: one parallel plan] (comm/plan.py)
        self.plan.agree_(acc, op=op, dp=not averaged)
        return (acc if p == math.inf else acc.pow(1.0 / p)) * self._unscale

    @property
    def offloader(self):
        """The offload placement (offload.Offloader / offload_nvme.NvmeOffloader), None
        without offload: for benchmarks and tests that tune its chunking."""
        return None if self.offload is None else self.placement

    # ---- introspection ---------------------------------------------------------------------

    def memory_report(self) -> Dict[str, Any]:
        """Bytes held per category on this rank, with the DESIGN §4 formula beside them.

        Returns:
            A dict: `measured` (bytes per device category: params, grads, buckets, master,
            one per state of the rule (by its name), padding, and at stage 3 frozen and live_units),
            `measured_total`, `formula`, `formula_total`, `allowed_slack`; with offload
            `host_measured` / `disk_measured` and their totals, `host_pinned_total`,
            `host_pageable_total`; at stage 3 `peak_live_units` and `live_units_bound`;
            `comm_buffers` (this rank's shared-memory segments for CPU collectives between
            ranks on one host: a transport buffer, not a model state); and num_params,
            world_size, stage, precision. Equal to `zerokern estimate`.
        """
        return memory_report(self)

    def comm_stats(self, reset: bool = False) -> Dict[str, Any]:
        """Bytes sent per collective type by this rank since the last reset.

        Args:
            reset: also reset the counters after reading them.

        Returns:
            A dict per collective type (all_reduce, reduce_scatter, all_gather) with the bytes
            sent and the number of calls; `dims`: the same per group ("shard", "replicate",
            "world", "hpz"); on a 2-D mesh `nodes`: {"intra_node", "inter_node"} bytes, dim 1
            of the mesh being a node (zerokern.accounting.mesh.node_split).
        """
        from .accounting.mesh import node_split

        out = self.comm.stats.as_dict()
        split = node_split(out["dims"], self.comm.dims)
        if split is not None:
            out["nodes"] = split
        if reset:
            self.comm.stats.reset()
        return out

    def reset_comm_stats(self) -> None:
        """Zero the counters `comm_stats()` reads."""
        self.comm.stats.reset()

    @contextmanager
    def gathered_params(self, modify: bool = False):
        """Full params inside the block (stage 3 gathers every unit, then re-shards; at
        stages 0-2 they are always resident and this does nothing). Collective at stage 3.

        Args:
            modify: True: changes made to the params inside are kept (each rank takes its
                piece back into its shard and fp32 master); False: discarded at stage 3.
        """
        if not self.pattern.shards_params:
            yield
            return
        self.grad_sync.gather_all()
        try:
            yield
        finally:
            self.grad_sync.release_all(write_back=modify)
