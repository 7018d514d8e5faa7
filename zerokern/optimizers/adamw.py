"""ZeroAdamW: the ZeRO engine (optimizer.ZeroOptimizer) with the AdamW rule
(zerokern.rules.adamw), or with 8-bit moments (zerokern.rules.adamw8bit, state_bits=8): a
drop-in replacement for torch.optim.AdamW."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Union

import torch

from zerokern.core.optimizer import ZeroOptimizer
from zerokern.options.doc import ENGINE_ARGS, PARAM_FORMAT_ARG
from zerokern.rules.adamw import ADAMW
from zerokern.rules.adamw8bit import adamw_rule_for_bits


class ZeroAdamW(ZeroOptimizer):
    __doc__ = """AdamW with ZeRO sharding: a drop-in replacement for `torch.optim.AdamW` (the
    engine, ZeroOptimizer, with the AdamW rule, zerokern.rules.adamw).

    Args:
        params_or_model: params or param-group dicts (stages 0-2), or an nn.Module (any
            stage; required for stage 3).
        lr: learning rate, as torch.optim.AdamW; per group where a group gives it.
        betas: (beta1, beta2), as torch.optim.AdamW; per group where given.
        eps: added to the denominator, as torch.optim.AdamW; per group where given.
        weight_decay: decoupled (adamw=True) or L2 (adamw=False) weight decay; per group.
        adamw: True decoupled weight decay; False Adam with L2 (grad += wd * p).
        state_bits: (keyword) 32 (default): fp32 moments; 8: m and v block-quantized to one
            byte per element plus an fp32 absmax per 128 elements (bitsandbytes' AdamW8bit
            scheme; zerokern.rules.adamw8bit), 6.06 instead of 12 bytes of state per param
            element. Decoupled weight decay only (adamw=True); every offload (None, "cpu",
            "nvme": the codes and absmax in their own aligned files, bit for bit the device's
            update, tests/state/test_nvme_rules.py).""" + \
        ENGINE_ARGS + PARAM_FORMAT_ARG + """
    Gradients have torch's and DDP's semantics (see ZeroOptimizer).
    """

    def __init__(
        self,
        params_or_model: Union[torch.nn.Module, Iterable],
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        adamw: bool = True,
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
        state_bits: int = 32,
        quantized_weights: bool = False,
        quantized_gradients: Union[bool, str] = False,
        keep_for_backward_mb: float = 0.0,
        broadcast_params: bool = True,
        activation_checkpointing: Optional[str] = None,
        param_format: Optional[str] = None,
    ) -> None:
        if not isinstance(adamw, bool):
            raise TypeError(f"adamw must be a bool, got {type(adamw).__name__}")
        rule = ADAMW if state_bits == 32 and type(state_bits) is int \
            else adamw_rule_for_bits(state_bits)  # ValueError naming state_bits
        if not isinstance(betas, (tuple, list)):
            raise ValueError(f"betas must be a pair of numbers in [0, 1), got {betas!r}")
        super().__init__(params_or_model, rule,
                         dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                              adamw=adamw),
                         stage, precision, loss_scale, max_grad_norm, offload, bucket_mb,
                         reduce_dtype, process_group, backend, param_groups=param_groups,
                         units=units, offload_path=offload_path, free_grads=free_grads,
                         offload_params=offload_params, master=master, mesh=mesh, hpz=hpz,
                         quantized_weights=quantized_weights,
                         quantized_gradients=quantized_gradients,
                         keep_for_backward_mb=keep_for_backward_mb,
                         broadcast_params=broadcast_params,
                         activation_checkpointing=activation_checkpointing,
                         param_format=param_format)
        self.state_bits = state_bits
