"""The AdamW rule (DESIGN §3): two fp32 moments, `exp_avg` (m) and `exp_avg_sq` (v), and the
fused `kernels.adam_step_` (reference / cpu / triton / cuda). ZeroAdamW is the engine plus this
rule (zerokern.rule [Note: a rule and the engine])."""

from __future__ import annotations

from typing import Any, Dict

from . import kernels
from .optimizer_args import check_hyper
from .rule import Rule, StateSpec


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
