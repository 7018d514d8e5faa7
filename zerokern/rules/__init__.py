"""The optimizer-rule interface: what one optimizer (AdamW, Lion, ...) declares to the ZeRO engine.

[Note: a rule and the engine]
The engine (optimizer.ZeroOptimizer) owns everything that does not depend on the update:
the layout, the stages, the grads and their reduction, the loss scale and clipping, the fp32
master, where the state lives (placement.py, offload.py, offload_nvme.py), checkpoints and the
accounting. A rule owns the rest:
- `states`: its per-element state tensors (`StateSpec`: name, dtype, bytes per element,
  whether it shards like the param). Every placement allocates `master` plus these; the
  checkpoint writes one section per name (after `master`); `memory_report`, `estimate` and the
  formula count them by name, so K = 4 (the fp32 master) + sum of their bytes per element.
- `step_`: the update over one flat piece (master, the states in declared order, the grad, the
  16-bit param out, the device step counter, grad_scale and found_inf), which dispatches to a
  kernel per backend (reference / cpu / triton / cuda); the contract of DESIGN §3 holds for
  every rule: skipped bitwise on found_inf (step included), cast-back bitwise `.to(dtype)`.
- `defaults` and `check_group`: the hyperparameters of a param group and their checks, and
  `hyper(group)`: the keyword arguments `step_` takes from a group.
A rule is stateless (a plain object); several optimizers may share one.
The indirection costs one Python call per bucket: AdamW through `ADAMW.step_(...,
**ADAMW.hyper(group))` against `kernels.adam_step_` called directly, n = 128, cpu backend,
interleaved 7 x 2000 calls on the shared 2-core VM (load ~20): medians 349 vs 338 us per
call, minima 174 vs 206 us, i.e. within the noise of the kernel call's own argument checks.

[Note: a rule per param group]
An engine holds one rule per param group (`ZeroOptimizer(rule=[...])`; ZeroMuon: Muon for the
matrices' groups, AdamW for the rest). Each buffer belongs to one group (`buffer.group_index`)
and so has one rule: the placement allocates that rule's states for it (`Placement.rule_for`),
the reports count them by name, a checkpoint section holds only the buffers that have it
(checkpoint/format.py). Where one name must stand for the optimizer (reports, checkpoint
metadata), `combine(rules)` gives the rule itself when every group has the same one (so
ZeroAdamW and ZeroLion are unchanged), else a `MixedRules` whose states are the union by name
in first-seen order and whose name joins the rules' names ("muon+adamw").
A rule whose update needs more than one piece at a time sets `phased = True` and provides a
group step instead of `step_` (zerokern.rules.muon: momentum per piece, Newton-Schulz on whole
matrices across ranks, then the update per piece); the engine runs it per buffer.

Only states that shard like the param (one element per param element) are supported by the
placements today: a rule declaring another kind raises at construction (placement checks
`check_rule`), never a silent mis-layout. Every state is fp32 (4 bytes) today for the same
reason: the checkpoint format and the NVMe files store 4-byte elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

import torch


@dataclass(frozen=True)
class StateSpec:
    """One per-element state tensor of a rule."""

    name: str                           # a checkpoint section and a report category
    dtype: torch.dtype = torch.float32
    bytes_per_elem: float = 4.0         # bytes per state element (the formula's K term)
    sharded: bool = True                # one element per param element, sharded like the param


class Rule:
    """Base of the optimizer rules. Subclasses set `name`, `states`, `defaults` and implement
    `check_group`, `hyper` and `step_`."""

    name: str = ""
    states: Tuple[StateSpec, ...] = ()
    defaults: Dict[str, Any] = {}
    # True: the update is not per piece; the engine runs the rule's group step over a whole
    # buffer ([Note: a rule per param group]), and `step_` is not used.
    phased: bool = False
    # False: the update ignores the step count (frozen_slots.py need not re-run it for a
    # param whose count lags).
    counts_steps: bool = True

    @property
    def state_names(self) -> Tuple[str, ...]:
        return tuple(s.name for s in self.states)

    @property
    def k_bytes(self) -> float:
        """Bytes of rule state per param element (without the master)."""
        return float(sum(s.bytes_per_elem for s in self.states))

    def check_group(self, group: Dict[str, Any], where: str = "") -> None:
        """ValueError/TypeError naming a bad hyperparameter of `group` (before any change)."""
        raise NotImplementedError

    def hyper(self, group: Dict[str, Any]) -> Dict[str, Any]:
        """The keyword arguments of `step_` taken from a param group."""
        raise NotImplementedError

    def step_(self, master: torch.Tensor, states, grad: torch.Tensor,
              param_out: Optional[torch.Tensor], *, step: torch.Tensor,
              grad_scale: torch.Tensor, found_inf: torch.Tensor, backend: str,
              **hyper) -> None:
        """One fused update of a flat piece, in place (DESIGN §3 contract for every rule)."""
        raise NotImplementedError


def check_rule(rule) -> Rule:
    """The rule an engine is built with: a Rule whose states the placements can hold."""
    if not isinstance(rule, Rule):
        raise TypeError(f"rule must be a zerokern.rules.Rule, got {type(rule).__name__}")
    names = rule.state_names
    if not names or len(set(names)) != len(names) or "master" in names or "steps" in names \
            or "params" in names:
        raise ValueError(f"rule {rule.name!r}: state names must be unique, non-empty and not "
                         f"'master', 'steps' or 'params', got {names}")
    for s in rule.states:
        if not s.sharded or s.dtype != torch.float32 or s.bytes_per_elem != 4:
            raise ValueError(f"rule {rule.name!r}: state {s.name!r} must be fp32 and shard like "
                             "the param (4 bytes per element): the placements, NVMe files and "
                             "checkpoint sections hold only those (zerokern.rules Note)")
    return rule


class RuleState:
    """One buffer's optimizer state, wherever a placement keeps it: `master` ((S,) fp32, or
    None where the params are the master), `states` (name -> (S,) tensor, in the rule's order)
    and `steps` ((n_buckets,) int64). A rule's state is read by name: `st.states[name]`, or
    as an attribute (`getattr(st, name)`) for the names the rule declares."""

    master: Optional[torch.Tensor]
    states: Dict[str, torch.Tensor]
    steps: torch.Tensor

    def __getattr__(self, name: str):
        states = self.__dict__.get("states")
        if states is not None and name in states:
            return states[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def device_tensors(self) -> Dict[str, torch.Tensor]:
        """Category -> tensor of what it holds on the device (memory_report)."""
        out = {} if self.master is None else {"master": self.master}
        out.update(self.states)
        return out

    def device_buffers(self, padding: int) -> Iterator[Tuple[str, torch.Tensor, int]]:
        """(category, tensor, padding elements) of every device tensor it holds."""
        for cat, t in self.device_tensors().items():
            yield cat, t, padding


class MixedRules(Rule):
    """The optimizer-wide view of several rules ([Note: a rule per param group]): the union
    of their states by name, a joined name. It updates nothing: each buffer runs its own."""

    def __init__(self, rules) -> None:
        self.rules = tuple(dict.fromkeys(rules))  # distinct, in first-seen order
        self.name = "+".join(r.name for r in self.rules)
        seen: Dict[str, StateSpec] = {}
        for r in self.rules:
            for s in r.states:
                seen.setdefault(s.name, s)
        self.states = tuple(seen.values())

    def check_group(self, group, where: str = "") -> None:
        raise NotImplementedError("MixedRules checks no group: each group has its own rule")

    def hyper(self, group):
        raise NotImplementedError("MixedRules has no hyperparameters: each group has its rule")


def combine(rules) -> Rule:
    """One rule standing for per-group `rules` (reports, checkpoint metadata): the rule itself
    when all are the same, else their MixedRules."""
    rules = list(rules)
    if not rules:
        raise ValueError("combine() needs at least one rule")
    if all(r is rules[0] for r in rules):
        return rules[0]
    return MixedRules(rules)


def adamw_rule():
    """The default rule (ZeroAdamW's), for callers that build buffers without an optimizer."""
    from zerokern.rules.adamw import ADAMW

    return ADAMW


def rule_by_name(name: str) -> Rule:
    """The built-in rules by name ("adamw", "lion", "muon"): estimate's and the CLI's
    `optimizer=` (the "muon" rule alone: ZeroMuon's AdamW params are the estimate's to add)."""
    from zerokern.rules.adamw import ADAMW
    from zerokern.rules.lion import LION
    from zerokern.rules.muon import MUON

    rules = {"adamw": ADAMW, "lion": LION, "muon": MUON}
    if isinstance(name, Rule):
        return check_rule(name)
    if name not in rules:
        raise ValueError(f"optimizer must be one of {tuple(rules)} (or a zerokern.rules.Rule), "
                         f"got {name!r}")
    return rules[name]
