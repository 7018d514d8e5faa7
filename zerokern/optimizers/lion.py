"""ZeroLion: the ZeRO engine (optimizer.ZeroOptimizer) with the Lion rule (zerokern.rules.lion),
equal to lion-pytorch's `Lion(params, lr, betas, weight_decay)` at every stage, precision and
placement, with one fp32 state tensor (K = 8 bytes/param with the master)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Union

import torch

from zerokern.core.optimizer import ZeroOptimizer
from zerokern.options.doc import ENGINE_ARGS
from zerokern.rules.lion import LION


class ZeroLion(ZeroOptimizer):
    __doc__ = """Lion with ZeRO sharding: lion-pytorch's `Lion` (lr, betas, weight_decay; the
    update is `p -= lr * sign(beta1*m + (1-beta1)*g)` after `p *= 1 - lr*wd`, then
    `m = beta2*m + (1-beta2)*g`), on the engine's stages, precisions, placements and meshes.

    Args:
        params_or_model: params or param-group dicts (stages 0-2), or an nn.Module.
        lr: as lion_pytorch.Lion (default 1e-4); per group where given in a group.
        betas: (beta1, beta2) as lion_pytorch.Lion (default (0.9, 0.99)); per group.
        weight_decay: decoupled, as lion_pytorch.Lion (default 0.0); per group.""" + ENGINE_ARGS

    def __init__(
        self,
        params_or_model: Union[torch.nn.Module, Iterable],
        lr: float = 1e-4,
        betas=(0.9, 0.99),
        weight_decay: float = 0.0,
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
        if not isinstance(betas, (tuple, list)):
            raise ValueError(f"betas must be a pair of numbers in [0, 1], got {betas!r}")
        super().__init__(params_or_model, LION,
                         dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay),
                         stage, precision, loss_scale, max_grad_norm, offload, bucket_mb,
                         reduce_dtype, process_group, backend, param_groups=param_groups,
                         units=units, offload_path=offload_path, free_grads=free_grads,
                         offload_params=offload_params, master=master, mesh=mesh, hpz=hpz,
                         quantized_weights=quantized_weights,
                         quantized_gradients=quantized_gradients,
                         keep_for_backward_mb=keep_for_backward_mb,
                         broadcast_params=broadcast_params,
                         activation_checkpointing=activation_checkpointing)
