"""Building the zerokern optimizer for a model from what a DeepSpeed/Accelerate script hands
over: `model_parameters` (params or group dicts) or an already built torch Adam/AdamW (->
ZeroAdamW) or lion-pytorch Lion (-> ZeroLion)."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from zerokern.core.optimizer import ZeroOptimizer
from zerokern.optimizers.adamw import ZeroAdamW
from zerokern.optimizers.lion import ZeroLion

_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "adamw", "initial_lr")


def groups_for_model(model: torch.nn.Module, model_parameters, defaults: Dict[str, Any]):
    """param_groups for ZeroAdamW(model, param_groups=...), or None for one group of all.

    model_parameters: None, an iterable of params, or of group dicts (DeepSpeed accepts both).
    Every trainable param of the model must be in a group (ZeroAdamW lays out the model)."""
    if model_parameters is None:
        return None
    items = list(model_parameters)
    if not items:
        raise ValueError("model_parameters is empty")
    if all(isinstance(x, dict) for x in items):
        groups = [dict(g) for g in items]
    elif all(isinstance(x, torch.Tensor) for x in items):
        groups = [{"params": items}]
    else:
        raise TypeError("model_parameters must hold params or param-group dicts, not a mix")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    given = {id(p) for g in groups for p in (g["params"] if not isinstance(g["params"],
                                                                          torch.Tensor)
                                             else [g["params"]])}
    if len(groups) == 1 and set(groups[0]) == {"params"} and given == trainable:
        return None
    missing = trainable - given
    if missing:
        raise ValueError(f"model_parameters leaves out {len(missing)} trainable param(s) of the "
                         "model; ZeroAdamW lays out every trainable param: freeze them "
                         "(requires_grad=False) or list them (DeepSpeed would leave them "
                         "untrained with their gradients computed; docs/guides/deepspeed.md "
                         "'model_parameters that leave out trainable params')")
    return groups


_BNB_LION = ("Lion", "Lion32bit", "PagedLion", "PagedLion32bit", "Lion8bit", "PagedLion8bit")


def _is_lion(optimizer) -> bool:
    """lion-pytorch's Lion, or bitsandbytes' Lion with 32-bit state (what Trainer builds for
    optim="lion_32bit"): the same update as ZeroLion's. bitsandbytes' 8-bit Lion is a
    ValueError: its quantized momentum is not ZeroLion's fp32 one."""
    name, lib = type(optimizer).__name__, type(optimizer).__module__.split(".")[0]
    if lib == "lion_pytorch" and name == "Lion":
        return True
    if lib == "bitsandbytes" and name in _BNB_LION:
        bits = getattr(getattr(optimizer, "args", None), "optim_bits", 32)
        if bits != 32:
            raise ValueError(f"optimizer {name} keeps 8-bit Lion state; ZeroLion keeps fp32 "
                             "state only: use 32-bit Lion (optim='lion_32bit')")
        return True
    return False


_BNB_ADAMW = ("AdamW", "AdamW8bit", "AdamW32bit", "PagedAdamW", "PagedAdamW8bit",
              "PagedAdamW32bit")


def _bnb_adamw_bits(optimizer):
    """8 or 32 for bitsandbytes' AdamW (what Trainer builds for optim="adamw_8bit" /
    "adamw_bnb_8bit"), else None. Its 8-bit state becomes ZeroAdamW(state_bits=8): the same
    dynamic map and absmax blocks, but every param quantized (bitsandbytes keeps params under
    its min_8bit_size, 4096 elements, in 32 bits), so the two differ within the 8-bit bounds
    (docs: optimizer rules, 8-bit AdamW moments)."""
    name, lib = type(optimizer).__name__, type(optimizer).__module__.split(".")[0]
    if lib != "bitsandbytes" or name not in _BNB_ADAMW:
        return None
    return getattr(getattr(optimizer, "args", None), "optim_bits", 32)


def _lion_from(optimizer, model, zero_kwargs) -> ZeroLion:
    """Lion (`_is_lion`) -> ZeroLion with its groups (lr, betas, weight_decay)."""
    groups = []
    for gi, g in enumerate(optimizer.param_groups):
        if g.get("decoupled_weight_decay") or g.get("cautious_factor", 0.0):
            raise ValueError(f"optimizer param group {gi}: lion-pytorch's "
                             "decoupled_weight_decay / cautious_factor are not implemented by "
                             "ZeroLion")
        out = {"params": list(g["params"]), "lr": g["lr"], "betas": tuple(g["betas"]),
               "weight_decay": g["weight_decay"]}
        if "initial_lr" in g:
            out["initial_lr"] = g["initial_lr"]
        if out["params"] and any(p.requires_grad for p in out["params"]):
            groups.append(out)
    d = optimizer.defaults
    return ZeroLion(model, lr=float(d["lr"]), betas=tuple(d["betas"]),
                    weight_decay=d["weight_decay"],
                    param_groups=groups_for_model(model, groups, {}) or None, **zero_kwargs)


def zero_from_torch(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                    **zero_kwargs) -> ZeroOptimizer:
    """The zerokern optimizer with `optimizer`'s param groups and hyperparameters, fresh (no
    step taken): torch Adam/AdamW -> ZeroAdamW, bitsandbytes AdamW (8-bit: state_bits=8) ->
    ZeroAdamW, Lion (lion-pytorch, bitsandbytes 32-bit) -> ZeroLion; a zerokern
    optimizer is returned as it is. zero_kwargs: stage, precision, loss_scale, ... of the
    engine. Any other optimizer is a TypeError naming its class."""
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer
    lion = _is_lion(optimizer)
    bits = _bnb_adamw_bits(optimizer)
    if bits is not None:
        zero_kwargs = {**zero_kwargs, "state_bits": bits}
    elif not lion and not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"zerokern replaces torch.optim.Adam/AdamW (ZeroAdamW) and Lion "
                        f"(lion_pytorch or bitsandbytes, 32-bit: ZeroLion); got "
                        f"{type(optimizer).__name__}")
    if any(optimizer.state.values()):
        raise ValueError("optimizer has already taken steps; hand it over before training")
    if lion:
        return _lion_from(optimizer, model, zero_kwargs)
    adamw = isinstance(optimizer, torch.optim.AdamW) or bits is not None or \
        bool(optimizer.defaults.get("decoupled_weight_decay", False))
    groups: List[Dict[str, Any]] = []
    for gi, g in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if g.get(flag):
                raise ValueError(f"optimizer param group {gi} has {flag}=True, which ZeroAdamW "
                                 "does not implement")
        lr = g["lr"]
        out = {"params": list(g["params"]), "adamw": adamw,
               "lr": float(lr) if isinstance(lr, torch.Tensor) else lr,
               "betas": tuple(g["betas"]), "eps": g["eps"], "weight_decay": g["weight_decay"]}
        if "initial_lr" in g:
            out["initial_lr"] = g["initial_lr"]
        if out["params"] and any(p.requires_grad for p in out["params"]):
            groups.append(out)  # an empty group (e.g. no no-decay params) has nothing to do
    d = optimizer.defaults
    zk = ZeroAdamW(model, lr=float(d["lr"]), betas=tuple(d["betas"]), eps=d["eps"],
                   weight_decay=d["weight_decay"], adamw=adamw,
                   param_groups=groups_for_model(model, groups, {}) or None, **zero_kwargs)
    return zk


def rebind_scheduler(scheduler, old, new) -> None:
    """A torch LR scheduler built on `old` drives `new` (same groups, in order)."""
    if scheduler is None or getattr(scheduler, "optimizer", None) is not old:
        return
    scheduler.optimizer = new
    for g_old, g_new in zip(old.param_groups, new.param_groups):
        for k in ("lr", "initial_lr"):
            if k in g_old:
                g_new[k] = g_old[k]
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [g["lr"] for g in new.param_groups]
    _track_step(new)


def _track_step(opt) -> None:
    """What torch's LRScheduler does to the optimizer it is built on: mark opt.step calls, so
    the scheduler does not warn that it stepped first (weak reference: no cycle)."""
    import functools
    import weakref

    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    ref, step = weakref.ref(opt), type(opt).step

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        o = ref()
        o._opt_called = True
        return step(o, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    opt.step = wrapper
