"""`lion_step_`: the fused Lion step (Chen et al. 2023, "Symbolic Discovery of Optimization
Algorithms"; numerics as lion-pytorch's `Lion`) over a flat shard, on every backend.

Per element, with g = float32(grad) * grad_scale (DESIGN §3's contract: found_inf skips
bitwise, step included; param_out bitwise `master.to(dtype)`):

    if found_inf: return
    p = p * (1 - lr*wd)                       # decoupled weight decay, scalar rounded once
    c = beta1*m + (1-beta1)*g                 # the interpolation whose sign is the update
    p = p - lr * sign(c)                      # torch.sign: sign(+-0) = sign(NaN) = +0
    m = beta2*m + (1-beta2)*g
    param_out = round-to-nearest-even(p)

Scalars are formed in float64 and rounded once to float32, as adam_step_ does; there is no bias
correction, so `step` only counts (it still advances, for checkpoints and schedules).
Backends: reference (torch ops, below: the spec), cpu (csrc/cpu/lion_cpu.cpp), triton
(triton_lion.py), cuda (csrc/cuda/lion.cu).
"""

from __future__ import annotations

from typing import Optional

import torch

from .dispatch import resolve
from .op_routing import hyper_args, use_op
from .reference import _f64, advance_step_
from .validate import (
    FOUND_INF_DTYPES,
    GRAD_DTYPES,
    OUT_DTYPES,
    STEP_DTYPES,
    Scalar,
    check_backend,
    check_buffer,
    check_hyper,
    check_no_overlap,
    check_scalar_tensor,
)


def check_lion_args(master, exp_avg, grad, param_out, *, lr, beta1, beta2, weight_decay, step,
                    grad_scale, found_inf) -> None:
    """Validate `lion_step_` arguments. Raises TypeError/ValueError naming the argument."""
    check_buffer("master", master, (torch.float32,), None, None)
    dev, n = master.device, master.numel()
    check_buffer("exp_avg", exp_avg, (torch.float32,), dev, n)
    check_buffer("grad", grad, GRAD_DTYPES, dev, n)
    bufs = {"master": master, "exp_avg": exp_avg, "grad": grad}
    if param_out is not None:
        check_buffer("param_out", param_out, OUT_DTYPES, dev, n)
        bufs["param_out"] = param_out
    check_no_overlap(bufs)
    check_scalar_tensor("step", step, STEP_DTYPES, dev)
    check_scalar_tensor("grad_scale", grad_scale, (torch.float32,), dev)
    check_scalar_tensor("found_inf", found_inf, FOUND_INF_DTYPES, dev)
    inf = float("inf")
    check_hyper("lr", lr, dev, 0.0, inf, hi_open=True)
    check_hyper("beta1", beta1, dev, 0.0, 1.0)
    check_hyper("beta2", beta2, dev, 0.0, 1.0)
    check_hyper("weight_decay", weight_decay, dev, 0.0, inf, hi_open=True)


def lion_step_(master: torch.Tensor, exp_avg: torch.Tensor, grad: torch.Tensor,
               param_out: Optional[torch.Tensor] = None, *, lr: Scalar, beta1: Scalar,
               beta2: Scalar, weight_decay: Scalar, step: torch.Tensor,
               grad_scale: torch.Tensor, found_inf: torch.Tensor,
               backend: str = "auto") -> None:
    """One fused Lion step over a flat shard, in place (module docstring).

    Args:
        master, exp_avg: fp32, contiguous, n elements each; updated in place.
        grad: fp32, fp16 or bf16, n elements; multiplied by `grad_scale` before use.
        param_out: None, or fp16/bf16 with n elements: receives `master.to(dtype)`.
        lr, beta1, beta2, weight_decay: floats or 0-d tensors (never recompile).
        step: 0-d int64/int32/float32/float64 device tensor; incremented unless skipped.
        grad_scale: 0-d fp32 device tensor. found_inf: 0-d bool or fp32; set: nothing changes.
        backend: "auto" | "triton" | "cuda" | "cpu" | "reference".
    """
    check_backend(backend)
    check_lion_args(master, exp_avg, grad, param_out, lr=lr, beta1=beta1, beta2=beta2,
                    weight_decay=weight_decay, step=step, grad_scale=grad_scale,
                    found_inf=found_inf)
    kind = resolve(backend, master.device)
    if use_op(master):  # [Note: kernels as custom ops] (custom_ops.py)
        hyper, hyper_t = hyper_args((lr, beta1, beta2, weight_decay))
        torch.ops.zerokern.lion_step_(master, exp_avg, grad, param_out, hyper, hyper_t, step,
                                      grad_scale, found_inf, kind)
        return
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, step=step,
              grad_scale=grad_scale, found_inf=found_inf)
    if kind == "reference":
        reference_lion_step_(master, exp_avg, grad, param_out, **kw)
    elif kind == "triton":
        from . import triton_lion

        triton_lion.lion_step_(master, exp_avg, grad, param_out, **kw)
    else:
        _native_lion_step_(kind, master, exp_avg, grad, param_out, **kw)


def reference_lion_step_(master, exp_avg, grad, param_out, *, lr, beta1, beta2, weight_decay,
                         step, grad_scale, found_inf) -> None:
    """The executable spec in torch ops: never syncs (the skip is a torch.where)."""
    dev = master.device
    f32 = torch.float32
    skip = found_inf if found_inf.dtype == torch.bool else found_inf != 0
    lr64, wd64 = _f64(lr, dev), _f64(weight_decay, dev)
    b1_64, b2_64 = _f64(beta1, dev), _f64(beta2, dev)
    decay = (1 - lr64 * wd64).to(f32)
    lr32 = lr64.to(f32)
    b1, b2 = b1_64.to(f32), b2_64.to(f32)
    omb1, omb2 = (1 - b1_64).to(f32), (1 - b2_64).to(f32)
    g = grad.to(f32) * grad_scale
    p = master * decay
    c = b1 * exp_avg + omb1 * g
    p = p - lr32 * torch.sign(c)
    m = b2 * exp_avg + omb2 * g
    master.copy_(torch.where(skip, master, p))
    exp_avg.copy_(torch.where(skip, exp_avg, m))
    if param_out is not None:
        param_out.copy_(torch.where(skip, param_out, p.to(param_out.dtype)))
    advance_step_(step, skip)


def _native_lion_step_(backend: str, master, exp_avg, grad, param_out, *, lr, beta1, beta2,
                       weight_decay, step, grad_scale, found_inf) -> None:
    from .build import load_op
    from .native import _hyper_args

    op = load_op(backend)
    # _hyper_args packs five hyperparameters (adam's layout); Lion uses four, the fifth is 0.
    floats, hp = _hyper_args((lr, beta1, beta2, weight_decay, 0.0), master.device)
    args = (master, exp_avg, grad, param_out, *floats[:4], step, grad_scale, found_inf)
    if backend == "cuda":
        op.lion_step(*args, hp)
    else:
        op.lion_step(*args)
