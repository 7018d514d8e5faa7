"""Fused optimizer kernels over flat shard buffers (DESIGN §3, §6).

    adam_step_(master, exp_avg, exp_avg_sq, grad, param_out=None, *, lr, beta1, beta2, eps,
               weight_decay, adamw=True, step, grad_scale, found_inf, backend="auto")
    grad_stats_(grad, found_inf, sumsq, *, backend="auto")
    available_backends() -> list[str]

Calls on tensors off the CPU, on fake tensors and under torch.compile go through the custom ops
torch.ops.zerokern.* (custom_ops.py [Note: kernels as custom ops]), whose fake impls run under
FakeTensorMode; real CPU tensors call the backend directly.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import (
    custom_ops,  # noqa: F401 - registers torch.ops.zerokern ([Note: kernels as custom ops])
    reference,
)
from .build import BuildError, load_op
from .dispatch import available_backends, backend_status, resolve
from .op_routing import hyper_args, use_op
from .validate import Scalar, check_adam_args, check_backend, check_grad_stats_args

__all__ = ["adam_step_", "grad_stats_", "available_backends", "backend_status", "BuildError",
           "load_op"]


def _triton():
    # Imported on first use: TRITON_INTERPRET is read when the kernels are decorated.
    from . import triton_kernels

    return triton_kernels


def adam_step_(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: Optional[torch.Tensor] = None,
    *,
    lr: Scalar,
    beta1: Scalar,
    beta2: Scalar,
    eps: Scalar,
    weight_decay: Scalar,
    adamw: bool = True,
    step: torch.Tensor,
    grad_scale: torch.Tensor,
    found_inf: torch.Tensor,
    backend: str = "auto",
) -> None:
    """One fused AdamW (or Adam + L2) step over a flat shard, in place (DESIGN §3).

    Args:
        master: fp32, contiguous, n elements (any shape; treated as flat); updated in place.
        exp_avg: fp32, contiguous, n elements: Adam's m; updated in place.
        exp_avg_sq: fp32, contiguous, n elements: Adam's v; updated in place.
        grad: fp32, fp16 or bf16, n elements; multiplied by `grad_scale` before use.
        param_out: None, or fp16/bf16 with n elements: receives the updated master rounded to
            nearest even (bitwise equal to `master.to(dtype)`).
        lr: float or 0-d tensor (changing it never recompiles anything); the same holds
            for beta1, beta2, eps and weight_decay.
        beta1: Adam's beta1, float or 0-d tensor.
        beta2: Adam's beta2, float or 0-d tensor (bias corrections in float64).
        eps: added to sqrt(v_hat), float or 0-d tensor.
        weight_decay: float or 0-d tensor; decoupled (adamw=True) or L2 (adamw=False).
        adamw: True for decoupled weight decay, False for Adam with L2 (grad += wd * p).
        step: 0-d int64/int32/float32/float64 device tensor: steps taken so far; incremented.
        grad_scale: 0-d fp32 device tensor, e.g. 1 / (loss_scale * world_size) * clip_coef.
        found_inf: 0-d bool or fp32 device tensor; if set, nothing at all changes (bitwise),
            `step` included.
        backend: "auto" | "triton" | "cuda" | "cpu" | "reference".

    Raises:
        TypeError: a tensor of the wrong dtype, device or layout, naming the argument, before
            anything is written.
        ValueError: mismatched sizes, an unknown backend, or a backend that cannot run on
            these tensors, naming the argument, before anything is written.
        BuildError: a native backend (cpu, cuda) cannot be built.
    """
    check_backend(backend)
    check_adam_args(master, exp_avg, exp_avg_sq, grad, param_out, lr=lr, beta1=beta1,
                    beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw, step=step,
                    grad_scale=grad_scale, found_inf=found_inf)
    kind = resolve(backend, master.device)
    if use_op(master):  # [Note: kernels as custom ops] (custom_ops.py)
        hyper, hyper_t = hyper_args((lr, beta1, beta2, eps, weight_decay))
        torch.ops.zerokern.adam_step_(master, exp_avg, exp_avg_sq, grad, param_out, hyper,
                                      hyper_t, adamw, step, grad_scale, found_inf, kind)
        return
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
              step=step, grad_scale=grad_scale, found_inf=found_inf)
    if kind == "reference":
        reference.adam_step_(master, exp_avg, exp_avg_sq, grad, param_out, **kw)
    elif kind == "triton":
        _triton().adam_step_(master, exp_avg, exp_avg_sq, grad, param_out, **kw)
    else:
        from . import native

        native.adam_step_(kind, master, exp_avg, exp_avg_sq, grad, param_out, **kw)


def grad_stats_(grad: torch.Tensor, found_inf: torch.Tensor, sumsq: torch.Tensor, *,
                backend: str = "auto") -> None:
    """One read of `grad`: found_inf |= any non-finite; sumsq += sum(float32(grad)^2).

    Args:
        grad: contiguous fp32/fp16/bf16 tensor (any shape; treated as flat).
        found_inf: 0-d bool or fp32 tensor on grad's device; only ever set, never cleared.
        sumsq: 0-d fp32 or fp64 tensor on grad's device; accumulated into. The reduction is
            deterministic (per-block partials, then one ordered sum; no contended atomics).
        backend: as for `adam_step_`.

    Raises:
        TypeError: a tensor of the wrong dtype, device or layout, naming the argument.
        ValueError: an unknown backend, naming it.
        BuildError: a native backend cannot be built.
    """
    check_backend(backend)
    check_grad_stats_args(grad, found_inf, sumsq)
    kind = resolve(backend, grad.device)
    if use_op(grad):  # [Note: kernels as custom ops] (custom_ops.py)
        torch.ops.zerokern.grad_stats_(grad, found_inf, sumsq, kind)
        return
    if kind == "reference":
        reference.grad_stats_(grad, found_inf, sumsq)
    elif kind == "triton":
        _triton().grad_stats_(grad.reshape(-1), found_inf, sumsq)
    else:
        from . import native

        native.grad_stats_(kind, grad.reshape(-1), found_inf, sumsq)
