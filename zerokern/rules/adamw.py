"""The AdamW rule (DESIGN §3): two fp32 moments, `exp_avg` (m) and `exp_avg_sq` (v), and the
fused `kernels.adam_step_` (reference / cpu / triton / cuda). ZeroAdamW is the engine plus this
rule (zerokern.rules [Note: a rule and the engine])."""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict

import torch

from zerokern import kernels
from zerokern.rules import Rule, StateSpec


def check_hyper(lr, betas, eps, weight_decay, where: str = "") -> None:
    sfx = f" (in {where})" if where else ""
    if isinstance(lr, bool) or not isinstance(lr, (numbers.Real, torch.Tensor)) \
            or (not isinstance(lr, torch.Tensor) and not (0.0 <= lr < math.inf)):
        raise ValueError(f"lr must be a finite number >= 0{sfx}, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(isinstance(b, numbers.Real) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas must be a pair of numbers in [0, 1){sfx}, got {betas!r}")
    if not (isinstance(eps, numbers.Real) and 0.0 < eps < math.inf):
        raise ValueError(f"eps must be a finite number > 0{sfx}, got {eps!r}")
    if not (isinstance(weight_decay, numbers.Real) and 0.0 <= weight_decay < math.inf):
        raise ValueError(f"weight_decay must be a finite number >= 0{sfx}, got {weight_decay!r}")


class AdamWRule(Rule):
    name = "adamw"
    states = (StateSpec("exp_avg"), StateSpec("exp_avg_sq"))
    defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, adamw=True)

    def check_group(self, group: Dict[str, Any], where: str = "") -> None:
        check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                    where=where)
        if not isinstance(group.get("adamw", True), bool):
            raise TypeError(f"adamw must be a bool, got {type(group['adamw']).__name__}")

    def hyper(self, group: Dict[str, Any]) -> Dict[str, Any]:
        b1, b2 = group["betas"]
        return dict(lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                    weight_decay=group["weight_decay"], adamw=group["adamw"])

    def step_(self, master, states, grad, param_out, *, step, grad_scale, found_inf, backend,
              **hyper) -> None:
        exp_avg, exp_avg_sq = states
        kernels.adam_step_(master, exp_avg, exp_avg_sq, grad, param_out, step=step,
                           grad_scale=grad_scale, found_inf=found_inf, backend=backend,
                           **hyper)


ADAMW = AdamWRule()
