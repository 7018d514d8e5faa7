"""The 8-bit AdamW rule (`ZeroAdamW(..., state_bits=8)`): m and v as one byte per element plus
one fp32 absmax per block of 128 (kernels/quant8.py [Note: 8-bit moments]), and the fused
`kernels.adamw8bit.adamw8bit_step_` (reference / cpu / triton / cuda).

[Note: 8-bit states in the engine]
Four states, in this order: `exp_avg` (uint8 codes of m, signed map), `exp_avg_absmax` (fp32,
one per 128 elements), `exp_avg_sq` (uint8 codes of v, unsigned map), `exp_avg_sq_absmax`.
K = 4 (the fp32 master) + 1 + 1 + 4/128 + 4/128 = 6.0625 bytes per param element (AdamW: 12).
The quantization blocks are the 128-element blocks of each flat buffer's own coordinates,
whose slots are block-aligned for this rule (partition.py [Note: block-aligned slots]): each
param's blocks start at its first element and hold no other param, as a per-param blockwise
quantization (bitsandbytes' AdamW8bit). Every piece of a bucket is a whole number of blocks,
so a rank quantizes its piece alone and ZeRO at any stage and world size runs exactly the
single-process update of the same buffer, bit for bit (tests/rules/test_adamw8bit.py), a
param no rank used is skipped on its own blocks (frozen_slots.py [Note: a param no rank used,
8-bit]) and a checkpoint moves between stages 0-2 and 3 with its blocks unchanged. Padding
elements (the tail and the gaps after params: zero grads, zero master) stay zero and never
raise a block's absmax. A new state is all zero bytes: any code
times absmax 0 dequantizes to (+-)0, which the first step treats as zero moments.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from zerokern.kernels.adamw8bit import adamw8bit_step_
from zerokern.kernels.quant8 import BLOCK, prepare_maps
from zerokern.rules import Rule, StateSpec
from zerokern.rules.adamw import AdamWRule

_U8 = torch.uint8
_SCALE = 4.0 / BLOCK


class AdamW8bitRule(Rule):
    name = "adamw8bit"
    states = (StateSpec("exp_avg", _U8, 1.0),
              StateSpec("exp_avg_absmax", torch.float32, _SCALE, block=BLOCK,
                        scales="exp_avg", signed=True),
              StateSpec("exp_avg_sq", _U8, 1.0),
              StateSpec("exp_avg_sq_absmax", torch.float32, _SCALE, block=BLOCK,
                        scales="exp_avg_sq", signed=False))
    defaults = dict(AdamWRule.defaults)

    def check_group(self, group: Dict[str, Any], where: str = "") -> None:
        """The group's checks (AdamW's, and no adamw=False); for a group of params (the
        engine's construction) the code maps on their device and the host's, so that no step
        copies a lookup table (kernels/quant8.py [Note: the maps are made at construction];
        the state is on the params' device, or on the host with offload)."""
        AdamWRule.check_group(self, group, where)
        if not group.get("adamw", True):
            sfx = f" (in {where})" if where else ""
            raise ValueError(f"adamw=False (Adam with L2) is not offered with state_bits=8"
                             f"{sfx}: the 8-bit rule is decoupled AdamW, as bitsandbytes' "
                             "AdamW8bit")
        params = group.get("params")
        first = next(iter(params), None) if isinstance(params, (list, tuple)) else None
        if isinstance(first, torch.Tensor) and first.device.type != "meta":
            for dev in dict.fromkeys((first.device, torch.device("cpu"))):
                prepare_maps(dev)

    def hyper(self, group: Dict[str, Any]) -> Dict[str, Any]:
        b1, b2 = group["betas"]
        return dict(lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                    weight_decay=group["weight_decay"])

    def step_(self, master, states, grad, param_out, *, step, grad_scale, found_inf, backend,
              **hyper) -> None:
        m_q, m_absmax, v_q, v_absmax = states
        adamw8bit_step_(master, m_q, m_absmax, v_q, v_absmax, grad, param_out, step=step,
                        grad_scale=grad_scale, found_inf=found_inf, backend=backend, **hyper)


ADAMW8BIT = AdamW8bitRule()


def adamw_rule_for_bits(state_bits) -> Rule:
    """ZeroAdamW's rule for `state_bits`: 32 the fp32 AdamW rule, 8 this one.

    Raises:
        ValueError: anything else, naming state_bits.
    """
    if type(state_bits) is not int or state_bits not in (32, 8):
        raise ValueError(f"state_bits must be 32 (fp32 moments) or 8 (8-bit block-quantized "
                         f"moments), got {state_bits!r}")
    from zerokern.rules.adamw import ADAMW

    return ADAMW if state_bits == 32 else ADAMW8BIT
