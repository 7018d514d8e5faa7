"""ZeroAdafactor: the ZeRO engine (optimizer.ZeroOptimizer) with the Adafactor rule
(zerokern.rules.adafactor), equal to `torch.optim.Adafactor` within fp32 rounding at every
stage; its state is per matrix, on each param's owner rank (rows + cols + 1 fp32 per >= 2-D
param, n + 1 per 1-D param of n: zerokern.rules [Note: state kinds and the owner protocol])."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Union

import torch

from zerokern.core.optimizer import ZeroOptimizer
from zerokern.geometry.dtensor_params import is_dtensor
from zerokern.options.doc import ENGINE_ARGS
from zerokern.rules.adafactor import ADAFACTOR


class ZeroAdafactor(ZeroOptimizer):
    __doc__ = """Adafactor with ZeRO sharding: `torch.optim.Adafactor` (lr, beta2_decay, eps,
    d, weight_decay, maximize), each param's factored second moment (row and column statistics
    over its last two dims; a 1-D param's full variance) and its update computed whole on one
    owner rank of the shard group (zerokern.rules.adafactor [Note: Adafactor over flat pieces:
    the owner protocol]). offload=None, "cpu" or "nvme" (the master
    in the files; the per-matrix states, rows + columns per matrix, on the host), master="fp32"
    or "compact".

    Args:
        params_or_model: params or param-group dicts (stages 0-2), or an nn.Module.
        lr: torch's lr (default 1e-2): the cap of the relative step size rho_t and the weight
            decay's coefficient; per group.
        beta2_decay: (default -0.8) beta2_t = 1 - t^beta2_decay; per group.
        eps: (eps1, eps2), default (None, 1e-3); eps1=None is the fp32 epsilon (the master's
            dtype); per group.
        d: the update clipping threshold (default 1.0); per group.
        weight_decay: decoupled, times lr (default 0.0); per group.
        maximize: (default False) per group.""" + ENGINE_ARGS

    def __init__(
        self,
        params_or_model: Union[torch.nn.Module, Iterable],
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps=(None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        maximize: bool = False,
        stage: int = 2,
        precision: str = "bf16",
        loss_scale: Any = "dynamic",
        max_grad_norm: Optional[float] = None,
        offload: Optional[str] = None,
        bucket_mb: float = 25.0,
        reduce_dtype: Optional[torch.dtype] = None,
        process_group=None,
        backend: str = "auto",
        *,
        param_groups: Optional[List[Dict[str, Any]]] = None,
        units=None,
        offload_path=None,
        free_grads: bool = False,
        offload_params: Optional[str] = None,
        master: str = "fp32",
        mesh=None,
        hpz: bool = False,
        quantized_weights: bool = False,
        quantized_gradients: Union[bool, str] = False,
        keep_for_backward_mb: float = 0.0,
        broadcast_params: bool = True,
        activation_checkpointing: Optional[str] = None,
    ) -> None:
        if not isinstance(eps, (tuple, list)):
            raise ValueError(f"eps must be a pair (eps1 >= 0 or None, eps2 >= 0), got {eps!r}")
        params_or_model = _refuse_tp(params_or_model, param_groups)
        super().__init__(params_or_model, ADAFACTOR,
                         dict(lr=lr, beta2_decay=beta2_decay, eps=tuple(eps), d=d,
                              weight_decay=weight_decay, maximize=maximize),
                         stage, precision, loss_scale, max_grad_norm, offload, bucket_mb,
                         reduce_dtype, process_group, backend, param_groups=param_groups,
                         units=units, offload_path=offload_path, free_grads=free_grads,
                         offload_params=offload_params, master=master, mesh=mesh, hpz=hpz,
                         quantized_weights=quantized_weights,
                         quantized_gradients=quantized_gradients,
                         keep_for_backward_mb=keep_for_backward_mb,
                         broadcast_params=broadcast_params,
                         activation_checkpointing=activation_checkpointing)


def _refuse_tp(params_or_model, param_groups):
    """A DTensor (tensor-parallel) param holds only this rank's tp shard: its row and column
    statistics and RMS would be the shard's, not the param's (silently wrong), so it is a
    ValueError, before any change (as ZeroMuon refuses one in a Muon group). Returns
    params_or_model (an iterator read into a list, for the engine)."""
    if isinstance(params_or_model, torch.Tensor):
        return params_or_model  # (the engine's own TypeError)
    if isinstance(params_or_model, torch.nn.Module):
        groups = param_groups or [{"params": list(params_or_model.parameters())}]
    else:
        params_or_model = list(params_or_model)
        groups = params_or_model if param_groups is None else param_groups
    for g in groups:
        ps = g["params"] if isinstance(g, dict) else [g]
        ps = [ps] if isinstance(ps, torch.Tensor) else ps
        for p in ps:
            if is_dtensor(p) and p.requires_grad:
                raise ValueError("params_or_model: a DTensor (tensor-parallel) param takes "
                                 "Adafactor, whose row/column statistics and RMS need the "
                                 "whole param, but this rank holds only its tp shard; "
                                 "ZeroAdafactor does not support tensor parallelism")
    return params_or_model
