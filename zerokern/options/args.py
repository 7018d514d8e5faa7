"""ZeroAdamW's argument checks: everything is validated before the model is touched (DESIGN §1,
errors on bad input)."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Dict, List

import torch

# [Note: the one precision table]
# `precision=` names the dtype of the model's params and grads (DESIGN §1); master, m and v are
# fp32 at every precision. Every module that takes a precision name (the optimizer, the loss
# scaler, the formula and the exact estimate, consolidate, the engine config, the CLIs) reads
# this table and validates with `check_precision`, so a fourth precision is one line here.
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FLOAT_DTYPES = tuple(PRECISIONS.values())
STAGES = (0, 1, 2, 3)
OFFLOADS = (None, "cpu", "nvme")
MASTERS = ("fp32", "compact")


def check_precision(precision) -> torch.dtype:
    """The dtype of `precision` ("fp32" | "bf16" | "fp16"); ValueError naming it otherwise."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


def elem_size(precision: str) -> int:
    """Bytes per element of the params and grads at `precision`."""
    return check_precision(precision).itemsize


def check_stage(stage) -> int:
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ValueError(f"stage must be one of 0, 1, 2, 3, got {stage!r}")
    return stage


def check_offload(offload, stage: int) -> None:
    """offload is None, "cpu" or "nvme", and not at stage 0."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be None, 'cpu' or 'nvme', got {offload!r}")
    if offload is not None and stage == 0:
        raise ValueError(f"offload={offload!r} needs stage 1, 2 or 3 (stage 0 keeps the full "
                         "optimizer state on every rank; offloading it saves nothing that "
                         "stage 1 would not)")


def check_master(master, precision: str, offload, stage: int) -> None:
    """master is "fp32" or "compact"; "compact" needs bf16 on the device at stages 0-2."""
    if master not in MASTERS:
        raise ValueError(f"master must be one of {MASTERS}, got {master!r}")
    if master != "compact":
        return
    if precision != "bf16":
        raise ValueError(f"master='compact' needs precision='bf16' (got {precision!r}): it "
                         "keeps the fp32 master as its low 16 bits under the bf16 param, "
                         "which is the master's high half only for bf16 (fp32 has no separate "
                         "master; fp16 is not the top half of an fp32)")
    if offload is not None:
        raise ValueError(f"master='compact' cannot be combined with offload={offload!r}: the "
                         "offloaded master lives in host memory or files, away from the "
                         "device params it would be rebuilt from; use master='fp32'")
    if stage == 3:
        raise ValueError("master='compact' supports stages 0-2 (stage 3's param shards come "
                         "and go with their unit); use master='fp32' at stage 3")


# The AdamW rule's hyperparameter check lives with the rule (zerokern.rules.adamw); re-exported.
from zerokern.rules.adamw import check_hyper  # noqa: E402,F401


def check_distributed_env(process_group) -> None:
    """A launcher's WORLD_SIZE > 1 without a process group would silently train one model per
    rank (world size 1 each)."""
    import torch.distributed as dist

    ws = os.environ.get("WORLD_SIZE", "1")
    if process_group is None and not (dist.is_available() and dist.is_initialized()) and \
            ws.isdigit() and int(ws) > 1:
        raise RuntimeError(
            f"zerokern: WORLD_SIZE={ws} is set (a torchrun/launcher job) but torch.distributed "
            "is not initialized, so every rank would train its own model. Call "
            "torch.distributed.init_process_group() before building ZeroAdamW")


def groups_of_model(model: torch.nn.Module, groups) -> List[Dict[str, Any]]:
    """param_groups over a model: every param must be the model's, and every trainable
    param of the model must be in a group."""
    if not isinstance(groups, (list, tuple)) or not groups or \
            not all(isinstance(g, dict) and "params" in g for g in groups):
        raise TypeError("param_groups must be a non-empty list of dicts with 'params'")
    mine = {id(p) for p in model.parameters()}
    listed = set()
    for gi, g in enumerate(groups):
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for p in ps:
            if id(p) not in mine:
                raise ValueError(f"param_groups[{gi}] holds a tensor that is not a "
                                 "parameter of the model")
            listed.add(id(p))
    missing = [n for n, p in model.named_parameters() if p.requires_grad
               and id(p) not in listed]
    if missing:
        raise ValueError(f"param_groups leaves out trainable params of the model: "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return [dict(g) for g in groups]

def frozen_params(param_groups, params_or_model, dtype: torch.dtype, stage: int) -> list:
    """Frozen float params to cast to `precision` (all of the model's, or those passed)."""
    if stage == 3:
        return []  # stage 3 shards and casts them with their unit
    if isinstance(params_or_model, torch.nn.Module):
        ps = list(params_or_model.parameters())
    else:
        ps = [p for g in param_groups for p in g["params"]]
    seen, out = set(), []
    for p in ps:
        if not p.requires_grad and id(p) not in seen and p.dtype in FLOAT_DTYPES \
                and p.dtype != dtype:
            seen.add(id(p))
            out.append(p)
    return out

def check_groups(param_groups, dtype: torch.dtype, rule, given_keys=None,
                 allowed_keys=()) -> List[List[torch.nn.Parameter]]:
    """rule: one Rule for every group, or a list of one per group. given_keys: per group, the
    keys its dict held before the defaults filled it (checked against its rule: zerokern.rules
    [Note: a rule's keys]); allowed_keys: group keys the optimizer itself reads."""
    seen, out, device = set(), [], None
    for gi, group in enumerate(param_groups):
        r = rule[gi] if isinstance(rule, list) else rule
        if given_keys is not None:
            r.check_group_keys(given_keys[gi], where=f"param group {gi}",
                               allowed=allowed_keys)
        r.check_group(group, where=f"param group {gi}")
        ps = []
        for p in group["params"]:
            if not p.requires_grad or id(p) in seen:
                continue  # frozen params are not optimized; a tied param is stored once
            seen.add(id(p))
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(f"params must be dense tensors; param group {gi} has "
                                 f"layout {p.layout}")
            if p.dtype not in FLOAT_DTYPES:
                raise TypeError(f"params must be fp32/bf16/fp16; param group {gi} has "
                                f"{p.dtype}")
            if dtype == torch.float32 and p.dtype != torch.float32:
                raise TypeError(f"precision='fp32' cannot hold a {p.dtype} param (param "
                                f"group {gi}); use precision='bf16'/'fp16' or cast the "
                                "model")
            if device is None:
                device = p.device
            elif p.device != device:
                raise ValueError(f"all params must be on one device; found {device} and "
                                 f"{p.device}")
            ps.append(p)
        out.append(ps)
    if not any(out):
        raise ValueError("params_or_model has no trainable parameters (requires_grad=True)")
    if not all(out):
        empty = [i for i, ps in enumerate(out) if not ps]
        raise ValueError(f"param groups {empty} have no trainable parameters")
    return out


def _named_params(params_or_model):
    """(name, param) of a model, a list/tuple of params or of group dicts; nothing for an
    iterator (it would be consumed here)."""
    if isinstance(params_or_model, torch.nn.Module):
        return list(params_or_model.named_parameters())
    out = []
    if isinstance(params_or_model, (list, tuple)):
        for i, x in enumerate(params_or_model):
            if isinstance(x, dict):
                ps = x.get("params", [])
                ps = [ps] if isinstance(ps, torch.Tensor) else ps
                if isinstance(ps, (list, tuple)):
                    out += [(f"param group {i}, param {j}", p) for j, p in enumerate(ps)]
            elif isinstance(x, torch.Tensor):
                out.append((f"param {i}", x))
    return out


def check_not_deepspeed_partitioned(params_or_model, where: str = "params_or_model") -> None:
    """[Note: DeepSpeed-partitioned params] A model built under `deepspeed.zero.Init` holds
    params DeepSpeed has partitioned: each param's data is this rank's flat 1-D shard (or
    empty), the layer's shape only in `ds_shape`, gathered by DeepSpeed's hooks. zerokern
    cannot shard or train those (they crashed inside F.linear: "mat2 must be a matrix"), so
    they are refused before anything changes, naming zero.Init and what to do instead.

    Raises:
        ValueError: a param with DeepSpeed's `ds_id` / `ds_status` attributes.
    """
    for name, p in _named_params(params_or_model):
        if hasattr(p, "ds_id") and hasattr(p, "ds_status"):
            raise ValueError(
                f"{where}: param {name} was built under deepspeed.zero.Init (DeepSpeed has "
                f"partitioned it: ds_status {getattr(p, 'ds_status', None)}, its data "
                f"{tuple(p.shape)} of the layer's {tuple(getattr(p, 'ds_shape', ()))}); "
                "zerokern cannot take DeepSpeed's partitions. Build the model without "
                "deepspeed.zero.Init: normally (zerokern's stage 3 shards it when the optimizer "
                "is built), or on the meta device, materialized with module.to_empty(device=) "
                "and its init before zerokern; nothing was changed")


def check_keep_for_backward(keep_for_backward_mb, stage: int) -> None:
    """ZeroAdamW(keep_for_backward_mb=): a number >= 0 (math.inf: every unit), stage 3 only."""
    if isinstance(keep_for_backward_mb, bool) or not isinstance(keep_for_backward_mb,
                                                                numbers.Real):
        raise TypeError(f"keep_for_backward_mb must be a number of MiB, got "
                        f"{type(keep_for_backward_mb).__name__}")
    if not keep_for_backward_mb >= 0:  # (NaN too)
        raise ValueError(f"keep_for_backward_mb must be >= 0 (math.inf: every unit), got "
                         f"{keep_for_backward_mb!r}")
    if keep_for_backward_mb and stage != 3:
        raise ValueError(f"keep_for_backward_mb applies to stage=3 only (got stage={stage})")


def check_arguments(params_or_model, *, stage, precision, rule, defaults, max_grad_norm,
                    offload, offload_path, bucket_mb, reduce_dtype, backend, units,
                    param_groups, process_group, free_grads=False, offload_params=None,
                    master="fp32", keep_for_backward_mb=0.0):
    """The engine's checks that come before its param groups exist (DESIGN §1: before the
    model is touched); `rule.check_group(defaults)` checks the rule's hyperparameters.
    Returns (the precision's dtype, offload_path checked, the params or group dicts to build
    the param groups from)."""
    check_stage(stage)
    check_not_deepspeed_partitioned(params_or_model)
    if stage == 3:
        if not isinstance(params_or_model, torch.nn.Module):
            raise ValueError("stage=3 needs the nn.Module (params_or_model=model), not bare "
                             "params: it partitions params per module unit")
    dtype = check_precision(precision)
    if offload_path is not None and offload != "nvme":
        raise ValueError(f"offload_path is for offload='nvme' only (got offload={offload!r})")
    check_offload(offload, stage)
    check_master(master, precision, offload, stage)
    if rule is not None:
        check_rule_support([rule], offload, master)
    if not isinstance(free_grads, bool):
        raise TypeError(f"free_grads must be a bool, got {type(free_grads).__name__}")
    if max_grad_norm is not None and not (isinstance(max_grad_norm, numbers.Real)
                                          and 0 < max_grad_norm < math.inf):
        raise ValueError(f"max_grad_norm must be None or a finite number > 0, "
                         f"got {max_grad_norm!r}")
    if not (isinstance(bucket_mb, numbers.Real) and bucket_mb > 0):
        raise ValueError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")
    if reduce_dtype is not None and reduce_dtype not in FLOAT_DTYPES:
        raise TypeError(f"reduce_dtype must be None or one of fp32/bf16/fp16, "
                        f"got {reduce_dtype!r}")
    from zerokern.kernels import validate

    validate.check_backend(backend)
    if units is not None and stage != 3:
        raise ValueError(f"units applies to stage=3 only (got stage={stage})")
    check_keep_for_backward(keep_for_backward_mb, stage)
    if param_groups is not None and not isinstance(params_or_model, torch.nn.Module):
        raise ValueError("param_groups is for a model (params_or_model=model); with bare "
                         "params pass the group dicts as params_or_model")
    if not isinstance(defaults, dict):
        raise TypeError(f"defaults must be a dict of the rule's hyperparameters, got "
                        f"{type(defaults).__name__}")
    if rule is not None:  # None: a rule per group, each group checked by its own
        rule.check_defaults(defaults)  # zerokern.rules [Note: a rule's keys]
        rule.check_group(defaults)
    check_distributed_env(process_group)
    check_offload_params(offload_params, stage, offload)
    if offload == "nvme":
        from zerokern.state.aligned_io import check_path

        offload_path = check_path(offload_path)  # missing / read-only: before any change
    if isinstance(params_or_model, torch.nn.Module):
        for name, mod in params_or_model.named_modules():
            if isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and mod.sparse:
                raise ValueError(f"params_or_model: {name or 'the model'} has sparse=True; "
                                 "sparse gradients are not supported, use sparse=False")
        params = (params_or_model.parameters() if param_groups is None
                  else groups_of_model(params_or_model, param_groups))
    else:
        params = params_or_model
    return dtype, offload_path, params


def check_clip(max_norm, norm_type) -> None:
    """clip_grad_norm_'s arguments, as torch.nn.utils.clip_grad_norm_ takes them."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or \
            not 0 < max_norm < math.inf:
        raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real) or \
            not norm_type > 0:
        raise ValueError(f"norm_type must be a number > 0 or inf, got {norm_type!r}")


OFFLOAD_PARAMS = ("cpu", "nvme")  # stage 3: where the param shards live between uses


def check_offload_params(offload_params, stage, offload, where: str = "offload_params") -> None:
    """ZeroAdamW's and the estimate's checks, before anything changes (DESIGN §1 errors)."""
    if offload_params is None:
        return
    if offload_params not in OFFLOAD_PARAMS:
        raise ValueError(f"{where} must be None, 'cpu' or 'nvme', got {offload_params!r}")
    if stage != 3:
        raise ValueError(f"{where}={offload_params!r} needs stage=3 (stages 0-2 keep the full "
                         f"params on every rank; got stage={stage!r})")
    if offload_params == "nvme" and offload != "nvme":
        raise ValueError(f"{where}='nvme' needs offload='nvme' (with offload_path=): the param "
                         "files are journaled with the optimizer state's files, so a failed "
                         "step changes neither; and params that do not fit in host RAM come "
                         f"with 6x that of optimizer state (got offload={offload!r})")


def check_rule_support(rules, offload, master) -> None:
    """Ask every group's rule whether it runs with `offload` and `master` (zerokern.rules
    [Note: what a rule supports]); a ValueError naming the argument and the rule otherwise,
    before anything changes."""
    for r in dict.fromkeys(rules):
        why = r.unsupported(offload=offload, master=master)
        if why is not None:
            arg, text = why
            raise ValueError(f"{arg}: {text}")
