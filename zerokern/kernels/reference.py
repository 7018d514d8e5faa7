"""Reference backend: the executable spec of DESIGN §3 in plain torch ops.

It runs on any device and never syncs with the host: the skip is a `torch.where`, not a Python
`if`, so a skipped step writes back the old bits (a bitwise no-op). It allocates temporaries and
makes several passes, so it is the spec, not the fast path.
"""

from __future__ import annotations

import torch


def _f64(x, device: torch.device) -> torch.Tensor:
    """A hyperparameter as a 0-d float64 tensor on `device` (a fill, never a host copy).

    A CPU tensor is read on the host (host memory: no sync) and filled, like a float: `.to()`
    would be a blocking host-to-device copy per call, i.e. per bucket per step (issue 14, 6).
    """
    if isinstance(x, torch.Tensor) and x.device.type == "cpu" and device.type != "cpu":
        return torch.full((), float(x), dtype=torch.float64, device=device)
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.float64)
    return torch.full((), float(x), dtype=torch.float64, device=device)


def bias_corrections(step: torch.Tensor, beta1, beta2):
    """(1 - beta1^t, 1 - beta2^t) for t = step + 1, as 0-d float64 device tensors.

    float64 because in float32 1 - 0.999^t loses 1e-5..1e-3 relative (DESIGN §3).
    """
    dev = step.device
    t = step.to(torch.float64) + 1
    return 1 - _f64(beta1, dev) ** t, 1 - _f64(beta2, dev) ** t


def advance_step_(step: torch.Tensor, skip: torch.Tensor) -> None:
    """step += 1 unless skip, on the device."""
    step.add_(skip.logical_not().to(step.dtype))


def adam_step_(master, exp_avg, exp_avg_sq, grad, param_out, *, lr, beta1, beta2, eps,
               weight_decay, adamw, step, grad_scale, found_inf) -> None:
    dev = master.device
    skip = found_inf if found_inf.dtype == torch.bool else found_inf != 0
    f32 = torch.float32
    bc1, bc2 = bias_corrections(step, beta1, beta2)
    lr64, wd64 = _f64(lr, dev), _f64(weight_decay, dev)
    b1_64, b2_64 = _f64(beta1, dev), _f64(beta2, dev)
    # Derived scalars are formed in float64, then rounded once to float32 like the kernels do.
    step_size = (lr64 / bc1).to(f32)
    rsqrt_bc2 = bc2.rsqrt().to(f32)
    decay = (1 - lr64 * wd64).to(f32)
    b1, b2 = b1_64.to(f32), b2_64.to(f32)
    omb1, omb2 = (1 - b1_64).to(f32), (1 - b2_64).to(f32)
    wd, eps32 = wd64.to(f32), _f64(eps, dev).to(f32)

    g = grad.to(f32) * grad_scale
    p = master
    if adamw:
        p = p * decay
    else:
        g = g + wd * p
    m = b1 * exp_avg + omb1 * g
    v = b2 * exp_avg_sq + omb2 * (g * g)
    denom = v.sqrt() * rsqrt_bc2 + eps32
    p = p - step_size * (m / denom)

    master.copy_(torch.where(skip, master, p))
    exp_avg.copy_(torch.where(skip, exp_avg, m))
    exp_avg_sq.copy_(torch.where(skip, exp_avg_sq, v))
    if param_out is not None:
        param_out.copy_(torch.where(skip, param_out, p.to(param_out.dtype)))
    advance_step_(step, skip)


def grad_stats_(grad, found_inf, sumsq) -> None:
    g = grad.to(torch.float32)
    bad = g.isfinite().logical_not().any()
    if found_inf.dtype == torch.bool:
        found_inf.logical_or_(bad)
    else:
        found_inf.copy_(torch.where(bad, torch.ones_like(found_inf), found_inf))
    # Deterministic: torch's reductions use a fixed tree for a given size and device.
    sumsq.add_((g * g).sum(dtype=torch.float64).to(sumsq.dtype))
