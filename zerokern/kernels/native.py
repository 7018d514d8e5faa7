"""Wrappers around the native ops (csrc/cpu, csrc/cuda), built on first use by `build`."""

from __future__ import annotations

import torch

from .build import load_op


def _hyper_args(hyper, device: torch.device):
    """Hyperparameters as doubles, plus (for CUDA tensors) a float64 device tensor of them.

    CPU tensors are read on the host (no sync: they live there). If any hyperparameter is a CUDA
    tensor, all five travel in one float64 device tensor that the kernel reads; floats are
    filled on the device, not copied from the host.
    """
    if not any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in hyper):
        return [float(x) for x in hyper], None
    hp = torch.stack([x.to(device, torch.float64) if isinstance(x, torch.Tensor)
                      else torch.full((), float(x), dtype=torch.float64, device=device)
                      for x in hyper])
    return [0.0] * 5, hp


def adam_step_(backend: str, master, exp_avg, exp_avg_sq, grad, param_out, *, lr, beta1, beta2,
               eps, weight_decay, adamw, step, grad_scale, found_inf) -> None:
    op = load_op(backend)
    floats, hp = _hyper_args((lr, beta1, beta2, eps, weight_decay), master.device)
    args = (master, exp_avg, exp_avg_sq, grad, param_out, *floats, adamw, step, grad_scale,
            found_inf)
    if backend == "cuda":
        op.adam_step(*args, hp)
    else:
        op.adam_step(*args)


def grad_stats_(backend: str, grad, found_inf, sumsq) -> None:
    load_op(backend).grad_stats(grad, found_inf, sumsq)
