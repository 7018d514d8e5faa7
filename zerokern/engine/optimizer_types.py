"""DeepSpeed's `optimizer` section -> the zerokern optimizer and its settings (engine/config.py
validates it at parse time, engine/engine.py builds the optimizer from it)."""

from __future__ import annotations

from typing import Any, Dict

from ..rules.muon_orthogonalize import NS_METHODS
from .config_values import ConfigError, _bool, _num, _unknown

OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode",
                    "bias_correction", "amsgrad")

# [Note: optimizer types] DeepSpeed's config "optimizer.type" (case-insensitive, as
# DeepSpeed's engine lower-cases it) -> the zerokern optimizer built for it: Adam/AdamW ->
# ZeroAdamW, Lion -> ZeroLion with DeepSpeed's Lion defaults (deepspeed/ops/lion FusedLion and
# DeepSpeedCPULion: lr 1e-3, betas (0.9, 0.999), weight_decay 0 - not lion-pytorch's 1e-4 and
# (0.9, 0.99)), Muon -> ZeroMuon with DeepSpeed's MuonWithAuxAdam defaults (Muon half: lr
# 0.02, momentum 0.95, weight_decay 0; Adam half: lr 3e-4, betas (0.9, 0.95), eps 1e-10,
# weight_decay 0; `lr`/`weight_decay` set both halves, `muon_lr`/`adam_lr` one) and its update
# (Nesterov, lr scaled by sqrt(max(1, rows/cols)): torch's adjust_lr_fn="original"). ns_method
# is DeepSpeed's: "gram" (its default: Gram Newton-Schulz, fp16 on CUDA, fp32 elsewhere) or
# "standard" (the quintic in bf16, torch.optim.Muon's bits); both are zerokern's
# (zerokern.rules.muon_orthogonalize [Note: Newton-Schulz methods]), so a DeepSpeed Muon config
# runs unchanged; any other method is a ValueError naming the key. Any other type is a
# ValueError naming it: never a silent AdamW.
OPTIMIZER_TYPES = ("adam", "adamw", "lion", "muon")
LION_PARAMS = ("lr", "betas", "weight_decay")
MUON_PARAMS = ("lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "betas", "eps",
               "ns_method")


def optimizer_kind(opt_cfg: Dict[str, Any]) -> str:
    """The zerokern optimizer a config's optimizer section builds: "adamw", "lion" or "muon".

    Args:
        opt_cfg: the config's {"type", "params"} optimizer section.

    Returns:
        "adamw" (DeepSpeed types Adam and AdamW), "lion" (Lion) or "muon" (Muon).

    Raises:
        ValueError: any other type, naming config key optimizer.type.
    """
    t = str(opt_cfg["type"]).lower()
    if t not in OPTIMIZER_TYPES:
        raise ConfigError(f"config key optimizer.type {opt_cfg['type']!r} is not supported: "
                         "zerokern has Adam and AdamW (ZeroAdamW), Lion (ZeroLion) and Muon "
                         "(ZeroMuon)")
    return t if t in ("lion", "muon") else "adamw"


def _muon_settings(p: Dict[str, Any]) -> Dict[str, Any]:
    """DeepSpeed's Muon params -> ZeroMuon's keyword arguments ([Note: optimizer types])."""
    _unknown(p, set(MUON_PARAMS), "optimizer.params.")
    ns_method = p.get("ns_method", "gram")  # DeepSpeed 0.19's default
    if ns_method not in NS_METHODS:
        raise ConfigError(f"config key optimizer.params.ns_method must be one of {NS_METHODS} "
                         f"(DeepSpeed's Newton-Schulz methods; default 'gram'), got "
                         f"{ns_method!r}")
    lr, wd = p.get("lr"), p.get("weight_decay")

    def num(key, default):
        return _num(f"optimizer.params.{key}", default)

    return {"lr": num("muon_lr", p.get("muon_lr", 0.02 if lr is None else lr)),
            "momentum": num("momentum", p.get("momentum", 0.95)),
            "weight_decay": num("weight_decay", 0.0 if wd is None else wd),
            "nesterov": True, "adjust_lr_fn": "original", "ns_method": ns_method,
            "adamw_lr": num("adam_lr", p.get("adam_lr", 3e-4 if lr is None else lr)),
            "adamw_betas": _betas(p, (0.9, 0.95)),
            "adamw_eps": num("eps", p.get("eps", 1e-10)),
            "adamw_weight_decay": num("weight_decay", 0.0 if wd is None else wd)}


def _betas(p: Dict[str, Any], default) -> tuple:
    betas = p.get("betas", default)
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
        raise ConfigError(f"config key optimizer.params.betas must be a pair, got {betas!r}")
    return tuple(float(b) for b in betas)


def optimizer_settings(opt_cfg: Dict[str, Any]) -> Dict[str, Any]:
    """DeepSpeed's optimizer config -> the keyword arguments of its zerokern optimizer
    (`optimizer_kind`: ZeroAdamW for Adam/AdamW, ZeroLion for Lion, ZeroMuon for Muon).

    DeepSpeed: type "Adam" is AdamW unless adam_w_mode is false (L2); "AdamW" always
    decoupled. weight_decay defaults to 0 (FusedAdam / DeepSpeedCPUAdam), or with
    torch_adam to torch's default (AdamW 0.01, Adam 0). Lion: lr, betas, weight_decay with
    DeepSpeed's defaults; Muon: [Note: optimizer types].

    Args:
        opt_cfg: the config's {"type", "params"} optimizer section.

    Returns:
        The optimizer's keyword arguments (lr, betas, ...).

    Raises:
        ValueError: an unsupported type or params key, or a bad value, naming the key.
    """
    p = opt_cfg.get("params", {})
    if optimizer_kind(opt_cfg) == "muon":
        return _muon_settings(p)
    if optimizer_kind(opt_cfg) == "lion":
        _unknown(p, set(LION_PARAMS), "optimizer.params.")
        return {"lr": _num("optimizer.params.lr", p.get("lr", 1e-3)),
                "betas": _betas(p, (0.9, 0.999)),
                "weight_decay": _num("optimizer.params.weight_decay",
                                     p.get("weight_decay", 0.0))}
    t = str(opt_cfg["type"]).lower()
    _unknown(p, set(OPTIMIZER_PARAMS), "optimizer.params.")
    torch_adam = _bool("optimizer.params.torch_adam", p.get("torch_adam", False))
    adam_w_mode = _bool("optimizer.params.adam_w_mode", p.get("adam_w_mode", True))
    if not _bool("optimizer.params.bias_correction", p.get("bias_correction", True)):
        raise ConfigError("config key optimizer.params.bias_correction=false is not supported")
    if _bool("optimizer.params.amsgrad", p.get("amsgrad", False)):
        raise ConfigError("config key optimizer.params.amsgrad=true is not supported")
    adamw = True if t == "adamw" else adam_w_mode
    wd_default = (0.01 if adamw else 0.0) if torch_adam else 0.0
    return {"lr": _num("optimizer.params.lr", p.get("lr", 1e-3)),
            "betas": _betas(p, (0.9, 0.999)),
            "eps": _num("optimizer.params.eps", p.get("eps", 1e-8)),
            "weight_decay": _num("optimizer.params.weight_decay",
                                 p.get("weight_decay", wd_default)),
            "adamw": adamw}
