"""The Lion rule (issue 23): one fp32 state, `exp_avg` (lion-pytorch's name for its momentum),
and the fused `kernels.lion.lion_step_` (reference / cpu / triton / cuda). K = 8 bytes per
param with the fp32 master (4 + 4), against AdamW's 12. ZeroLion is the engine plus this rule
(zerokern.rules [Note: a rule and the engine])."""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict

import torch

from zerokern.rules import Rule, StateSpec


class LionRule(Rule):
    name = "lion"
    states = (StateSpec("exp_avg"),)
    defaults = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)

    def check_group(self, group: Dict[str, Any], where: str = "") -> None:
        sfx = f" (in {where})" if where else ""
        lr, betas, wd = group["lr"], group["betas"], group["weight_decay"]
        if isinstance(lr, bool) or not isinstance(lr, (numbers.Real, torch.Tensor)) \
                or (not isinstance(lr, torch.Tensor) and not (0.0 <= lr < math.inf)):
            raise ValueError(f"lr must be a finite number >= 0{sfx}, got {lr!r}")
        # lion-pytorch asserts 0 <= beta <= 1 for both
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(isinstance(b, numbers.Real) and not isinstance(b, bool)
                        and 0.0 <= b <= 1.0 for b in betas)):
            raise ValueError(f"betas must be a pair of numbers in [0, 1]{sfx}, got {betas!r}")
        if isinstance(wd, bool) or not (isinstance(wd, numbers.Real) and 0.0 <= wd < math.inf):
            raise ValueError(f"weight_decay must be a finite number >= 0{sfx}, got {wd!r}")

    def hyper(self, group: Dict[str, Any]) -> Dict[str, Any]:
        b1, b2 = group["betas"]
        return dict(lr=group["lr"], beta1=b1, beta2=b2, weight_decay=group["weight_decay"])

    def step_(self, master, states, grad, param_out, *, step, grad_scale, found_inf, backend,
              **hyper) -> None:
        from zerokern.kernels.lion import lion_step_

        (exp_avg,) = states
        lion_step_(master, exp_avg, grad, param_out, step=step, grad_scale=grad_scale,
                   found_inf=found_inf, backend=backend, **hyper)


LION = LionRule()
