"""Stage 3 units: which module gathers which params (DESIGN §2, stage 3).

A unit is a submodule whose params are gathered together before it runs and freed after. The
default policy makes each child of every `nn.ModuleList` a unit (the transformer blocks, in
practice), and the root a unit for whatever is left (embeddings, final norm, head). A user
policy is a set/tuple of module classes, or a callable `policy(module) -> bool`; the root is
always a unit.

Each trainable param is *owned* by the innermost unit containing the first module that
registers it. A param reached again from another unit (a tie, e.g. an embedding used as the LM
head in a different unit) stays owned by the first unit, and the second unit records it as a
*dependency*: gathering the second unit gathers the owner too. Frozen (requires_grad=False)
floating-point params are owned the same way and sharded with their unit in a buffer of their
own (no grads, no optimizer state), as FSDP2 shards them: a LoRA model's base weights take 1/N
per rank. Frozen params of other dtypes (integer, e.g. quantised tables) cannot be cast to the
precision and stay resident (`persistent`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Set, Union

import torch
import torch.nn as nn


def tensors_in(obj, out: list) -> list:
    """Tensors in a (nested) module input or output: tensor, tuple/list, dict (HF ModelOutput
    too), and the `.val` of torch's selective-checkpoint cache entries (_VersionWrapper)."""
    obj = getattr(obj, "val", obj) if not isinstance(obj, torch.Tensor) else obj
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            tensors_in(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            tensors_in(x, out)
    return out

Policy = Union[None, type, Set[type], tuple, list, frozenset, Callable[[nn.Module], bool]]


@dataclass
class Unit:
    index: int
    name: str                                # module path ("" is the root)
    module: nn.Module
    params: List[nn.Parameter] = field(default_factory=list)   # owned, trainable, unique
    deps: Set[int] = field(default_factory=set)                # units whose params it uses
    frozen: List[nn.Parameter] = field(default_factory=list)      # owned, requires_grad=False
    persistent: List[nn.Parameter] = field(default_factory=list)  # frozen non-float: resident

    @property
    def is_root(self) -> bool:
        return self.name == ""


def _policy_fn(policy: Policy) -> Callable[[nn.Module], bool]:
    if policy is None:
        return lambda m: False  # ModuleList children are marked by the walk below
    if isinstance(policy, type):
        policy = (policy,)
    if isinstance(policy, (set, frozenset, tuple, list)):
        classes = tuple(policy)
        if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module)
                                  for c in classes):
            raise TypeError("units must be None, nn.Module classes, or a callable "
                            f"(module) -> bool; got {policy!r}")
        return lambda m: isinstance(m, classes)
    if callable(policy):
        return policy
    raise TypeError(f"units must be None, nn.Module classes, or a callable (module) -> bool; "
                    f"got {type(policy).__name__}")


def find_units(model: nn.Module, policy: Policy = None) -> List[Unit]:
    """Units in module pre-order (the root is unit 0), with owned params and dependencies."""
    is_unit = _policy_fn(policy)
    units: List[Unit] = [Unit(0, "", model)]
    owner: Dict[int, int] = {}
    seen_frozen: Set[int] = set()

    visited: Set[int] = set()

    def walk(mod: nn.Module, prefix: str, unit: Unit, parent_is_list: bool) -> None:
        if id(mod) in visited:  # a shared submodule: its first place owns its params; here
            for p in mod.parameters():  # the enclosing unit depends on their owners
                if owner.get(id(p), unit.index) != unit.index:
                    unit.deps.add(owner[id(p)])
            return
        visited.add(id(mod))
        if prefix and (is_unit(mod) if policy is not None else parent_is_list):
            unit = Unit(len(units), prefix, mod)
            units.append(unit)
        for p in mod._parameters.values():
            if p is None:
                continue
            if not p.requires_grad and not p.is_floating_point():
                if id(p) not in seen_frozen:
                    seen_frozen.add(id(p))
                    unit.persistent.append(p)
                continue
            if id(p) not in owner:
                owner[id(p)] = unit.index
                (unit.params if p.requires_grad else unit.frozen).append(p)
            elif owner[id(p)] != unit.index:
                unit.deps.add(owner[id(p)])
        is_list = isinstance(mod, nn.ModuleList)
        for name, child in mod._modules.items():
            if child is not None:
                walk(child, f"{prefix}.{name}" if prefix else name, unit, is_list)

    walk(model, "", units[0], False)
    return units


def describe(units: List[Unit]) -> List[dict]:
    """A printable summary: name, owned numel, dependencies."""
    return [{"unit": u.index, "name": u.name or "<root>",
             "numel": sum(p.numel() for p in u.params),
             "frozen_numel": sum(p.numel() for p in u.frozen), "deps": sorted(u.deps)}
            for u in units]


def kept_for_backward(schedule: List[int], need: Callable[[int], List[int]],
                      unit_bytes: Callable[[int], int], budget: float) -> List[int]:
    """[Note: kept units] The units a grad-enabled forward leaves gathered for its backward
    (Stage3Runtime, runtime.py; `need(ui)`: unit ui and the units it depends on): the root
    (index 0) and the last unit of the schedule, with their deps, always ([Note: the root
    stays gathered for backward]); then, with ZeroAdamW(keep_for_backward_mb=), whole units
    from the end of the schedule backwards (the first ones the backward needs) while their full
    bytes fit `budget`. Each saves its backward re-gather, (N-1)/N of its bytes per rank, and
    stays gathered from its forward to its backward: live_bound() counts them. Fixed at
    construction and the same on every rank (rule 1: whether a unit is gathered when the
    schedule reaches it must not depend on the data). Measured on the 20m GPT over 2 gloo
    ranks, fp32, paired in one process: every unit kept 0.919-0.940x the iteration of the
    default (root + last), the last two 0.996x. Once a forward reaches the kept units it
    launches all their gathers (Stage3Runtime._prefetch_ahead): 0.962-0.971x again with every
    unit kept (30-40 pairs; benchmarks/results/step-20m-n2-fp32-issue20-paired.md)."""
    kept = list(need(0))
    if schedule:
        kept += [ui for ui in need(schedule[-1]) if ui not in kept]
    used = 0
    for ui in reversed(schedule[:-1]):
        extra = [uj for uj in need(ui) if uj not in kept]
        cost = sum(unit_bytes(uj) for uj in extra)
        if used + cost > budget:
            break
        used += cost
        kept += extra
    return kept


def live_units_bound(root: List[int], others: List[List[int]], kept: List[int],
                     unit_bytes: Callable[[int], int], held: Sequence[int] = ()) -> int:
    """Bytes of full units gathered at once, at most (Stage3Runtime.live_bound): the root and
    its deps (`root`) and the units others depend on (`held`: kept from their first gather to
    the end of backward), plus two other units with theirs (`others`: each non-root unit's
    need; the running one and the prefetched one), or the kept units ([Note: kept units]) and
    one more beside them (a forward gathers every kept unit once it reaches them). (`held`
    was left out before 2026-11-26: a block tied to the last one peaked at 28672 bytes
    against a bound of 24576.)"""
    def need_bytes(need, skip) -> int:
        return sum(unit_bytes(ui) for ui in need if ui not in skip)

    always = set(root) | set(held)  # gathered whatever else runs
    two = sum(sorted((need_bytes(n, always) for n in others), reverse=True)[:2])
    kept_rest = [ui for ui in kept if ui not in always]
    beside = max((need_bytes(n, always | set(kept_rest)) for n in others), default=0)
    return need_bytes(always, ()) + max(two, need_bytes(kept_rest, ()) + beside)
