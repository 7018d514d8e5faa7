"""When an entry point goes through torch.ops.zerokern, and the hyperparameters in the ops'
schema form: the routing helpers of [Note: kernels as custom ops] (custom_ops.py).

A module of its own, below both the ops (custom_ops.py) and the entry points that call them
(adamw8bit.py, lion.py, blockquant.py, the package's adam_step_ / grad_stats_): custom_ops
registers the ops with the entry points' implementations, so importing the helpers from it
made a loop (issue 35: no import loops).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling


def use_op(t: torch.Tensor) -> bool:
    """Whether an entry point routes its call on data `t` through torch.ops.zerokern (Note:
    routing): off the CPU, a tensor subclass (fake, functional), or under torch.compile."""
    return _is_compiling() or not t.is_cpu or type(t) is not _Tensor  # ~0.15 us


def hyper_args(values: Sequence) -> Tuple[List[float], List[Optional[torch.Tensor]]]:
    """(floats, tensors) for the schema's `float[] hyper, Tensor?[] hyper_t` (Note)."""
    floats, tensors = [], []
    for x in values:
        if isinstance(x, _Tensor):
            floats.append(0.0)
            tensors.append(x)
        else:
            floats.append(float(x))
            tensors.append(None)
    return floats, tensors


def rebuild(hyper: Sequence[float], hyper_t: Sequence[Optional[torch.Tensor]]) -> list:
    """The hyperparameters as the caller gave them (a float or a 0-d tensor each)."""
    return [f if t is None else t for f, t in zip(hyper, hyper_t)]
