"""A test optimizer rule, SGD with momentum (torch.optim.SGD(momentum=mu, weight_decay=wd),
dampening 0, no Nesterov): one state tensor, written only against the public rule interface
(zerokern.rules), to prove the seam: it runs through every placement, stage, a resharding
checkpoint, memory_report and estimate with no line of zerokern naming it.

It lives in tests, not in zerokern: it is not an optimizer zerokern offers (it has no fused
kernels, only torch ops for every backend), and a rule written outside the package is the
stronger proof that a third party needs nothing inside it.
"""

from __future__ import annotations

import math
import numbers

import torch

from zerokern.rules import Rule, StateSpec


class SGDMomentum(Rule):
    name = "sgd_momentum"
    states = (StateSpec("momentum_buffer"),)
    defaults = dict(lr=1e-2, momentum=0.9, weight_decay=0.0)

    def check_group(self, group, where: str = "") -> None:
        for key in ("lr", "momentum", "weight_decay"):
            v = group[key]
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or \
                    not 0.0 <= v < math.inf:
                raise ValueError(f"{key} must be a finite number >= 0 ({where}), got {v!r}")

    def hyper(self, group):
        return dict(lr=group["lr"], momentum=group["momentum"],
                    weight_decay=group["weight_decay"])

    def step_(self, master, states, grad, param_out, *, step, grad_scale, found_inf, backend,
              lr, momentum, weight_decay) -> None:
        """torch.optim.SGD's update in fp32 torch ops (the same on every backend); skipped
        bitwise on found_inf, step included (DESIGN §3's contract)."""
        (buf,) = states
        skip = found_inf if found_inf.dtype == torch.bool else found_inf != 0
        g = grad.float() * grad_scale
        g = g + weight_decay * master
        new_buf = momentum * buf + g  # first step: buf is 0, so this is g (torch clones g)
        p = master - lr * new_buf
        master.copy_(torch.where(skip, master, p))
        buf.copy_(torch.where(skip, buf, new_buf))
        if param_out is not None:
            param_out.copy_(torch.where(skip, param_out, p.to(param_out.dtype)))
        step.add_(skip.logical_not().to(step.dtype))


SGD = SGDMomentum()
