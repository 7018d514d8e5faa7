"""The closed-form memory per rank: DESIGN §4's formula and the ZeRO paper's (DeepSpeed's).

`estimate_memory` is the public `zerokern.estimate_memory`: 2Ψ + 2Ψ + KΨ and their shards,
from a parameter count alone, with K = 4 (the fp32 master) + the optimizer rule's state bytes
per element (zerokern.rules): 12 for AdamW (m, v), 8 for Lion (one momentum). It is a formula, not a
measurement: `memory.memory_report` measures the buffers an optimizer holds, and
`estimate.estimate` predicts that measurement exactly by building zerokern's own buffers on `meta`;
both report this formula beside them.
"""

from __future__ import annotations

from typing import Dict, Optional

from zerokern.layout.stages import pattern
from zerokern.options.args import MASTERS, OFFLOADS, elem_size

# ZeRO paper / DeepSpeed estimator: fp32 master + m + v per param (mixed-precision Adam).
K_DEEPSPEED = 12


def estimate_memory(num_params: int, world_size: int, stage: int, precision: str = "bf16",
                    offload: Optional[str] = None, reduce_bytes: Optional[int] = None,
                    master: str = "fp32", optimizer="adamw",
                    param_format: Optional[str] = None) -> Dict[str, int]:
    """DESIGN §4 bytes per rank for `num_params` (Ψ) params over `world_size` (N) ranks.

    Args:
        num_params: Ψ, a positive int (write `7_000_000_000`, not `7e9`).
        world_size: N, the number of data-parallel ranks (a positive int).
        stage: ZeRO stage, 0-3.
        precision: "fp32" | "bf16" | "fp16": the dtype of params and grads.
        offload: None, "cpu" or "nvme": where the master and the rule's state live.
        reduce_bytes: bytes per gradient element communicated and held; default the
            precision's element size.
        master: "fp32" or "compact" (bf16: the master in 2.125 bytes per element).
        optimizer: "adamw", "lion" or a zerokern.rules.Rule: which states there are; or a
            dict {rule or name: number of params} summing to num_params, for a rule per
            param group (ZeroMuon: `{"muon": matrices, "adamw": the rest}`; K = 8 bytes per
            Muon param, 12 per AdamW one).
        param_format: None, or "fp8" (stage 3): the param shard in 1 byte per element
            (zerokern.kernels.param_codec).

    Raises:
        ValueError: an argument out of range, naming it.

    Returns params, grads, master, one entry per state of the rule (`optimizer`: "adamw",
    "lion" or a zerokern.rules.Rule; named as the rule names them), optimizer (master + states),
    total; with
    offload="cpu" the optimizer column is reported as host bytes and left out of `total`; with
    offload="nvme" it is reported as `disk` bytes, twice (offload_nvme's two halves: a step
    writes the half it does not read), and `host` is 0 (the bounded I/O pool is not a term).
    master="compact" (bf16 on the device, zerokern.state.compact_master): the master is 2 bytes of
    low half + 1/8 byte of tie bit per state element instead of 4.
    """
    if not isinstance(num_params, int) or num_params < 1:
        raise ValueError(f"num_params must be a positive int, got {num_params!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    # {rule: its params}: a rule per param group (ZeroMuon), each state counted over the
    # params of the rules that have it
    shares = _shares(optimizer, num_params)
    P = pattern(stage)
    e = elem_size(precision)
    if offload not in OFFLOADS:  # (the formula also answers "what would stage 0 offload")
        raise ValueError(f"offload must be None, 'cpu' or 'nvme', got {offload!r}")
    if master not in MASTERS:
        raise ValueError(f"master must be one of {MASTERS}, got {master!r}")
    psi, n = num_params, world_size
    g = reduce_bytes or e
    state = psi if P.replicated_state else psi / n
    per_state: Dict[str, float] = {}
    for rule, share in shares.items():
        for st in rule.states:
            per_state[st.name] = per_state.get(st.name, 0) + st.bytes_per_elem * (
                share if P.replicated_state else share / n)
    if param_format not in (None, "fp8") or (param_format and not P.shards_params):
        raise ValueError(f"param_format must be None, or 'fp8' at stage 3, got "
                         f"{param_format!r} (stage {stage})")
    pe = 1 if param_format == "fp8" else e  # the stored params' bytes per element
    out = {
        "params": pe * (psi / n if P.shards_params else psi),
        "grads": g * psi / n if P.shards_grads else g * psi,
        # offload keeps an fp32 master on the host at every precision (the device params
        # are only the working copy); without offload fp32 params are the master
        "master": 0 if precision == "fp32" and not offload
        else (2 + 1 / 8) * state if master == "compact" else 4 * state,
        **per_state,
    }
    out["optimizer"] = out["master"] + sum(out[k] for k in per_state)
    out = {k: int(round(v)) for k, v in out.items()}
    out["total"] = out["params"] + out["grads"] + (0 if offload else out["optimizer"])
    out["host"] = out["optimizer"] if offload == "cpu" else 0
    out["disk"] = 2 * out["optimizer"] if offload == "nvme" else 0
    return out


def _shares(optimizer, num_params: int) -> dict:
    """{rule: Ψ_rule}: `optimizer` a name or Rule (all Ψ), or a dict {name or Rule: params}
    summing to Ψ (a rule per param group)."""
    from zerokern.rules.registry import rule_by_name

    if not isinstance(optimizer, dict):
        return {rule_by_name(optimizer): num_params}
    out: Dict[object, int] = {}
    for k, v in optimizer.items():
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"optimizer: params per rule must be ints >= 0, got {v!r}")
        r = rule_by_name(k)
        out[r] = out.get(r, 0) + v
    if sum(out.values()) != num_params:
        raise ValueError(f"optimizer: the params per rule sum to {sum(out.values())}, not "
                         f"num_params={num_params}")
    return out


def deepspeed_formula(num_params: int, world_size: int, stage: int,
                      offload: Optional[str] = None) -> Dict[str, int]:
    """The ZeRO paper / DeepSpeed figures: 16-bit params and grads, K = 12 bytes of optimizer
    state per param, each term divided by N once its stage shards it."""
    psi, n = num_params, world_size
    out = {"params": 2 * psi / (n if stage >= 3 else 1),
           "grads": 2 * psi / (n if stage >= 2 else 1),
           "optimizer": K_DEEPSPEED * psi / (n if stage >= 1 else 1)}
    out = {k: int(round(v)) for k, v in out.items()}
    out["total"] = out["params"] + out["grads"] + (0 if offload else out["optimizer"])
    return out
