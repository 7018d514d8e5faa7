"""The one place the checkpoint code reads the optimizer's buffers: `optimizer_view(model, opt)`.

Everything else in zerokern.checkpoint sees only an `OptimizerView`: per unique trainable param
its name, aliases, full shape and param group, and, per contiguous element range this rank
holds, writable views into the fp32 master, the optimizer rule's states (zerokern.rules, by
name) and the model-dtype param.
One builder, `_buffer_view`, for every buffer (shard_buffer.ShardBuffer: FlatGroup at stages
0-2, ShardedFlat at stage 3), asking the buffer which ranges it holds. Wherever the placement
keeps the state (device, host with offload="cpu" (an fp32 master at every precision there),
files mapped with "nvme"), the master and the states have the same layout, so the views point
at the state where it lives.

Element ranges are in each param's own flattened coordinates, never in a flat buffer's, so a
checkpoint does not depend on bucket sizes, padding, world size or stage.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from zerokern.core.optimizer import ZeroOptimizer

from . import block_states
from .format import section_dtypes, sections
from .parts import JobLayout, job_layout


@dataclass(frozen=True)
class ParamSpec:
    """One unique trainable param: `name` is its first key in `model.state_dict()`."""

    name: str
    aliases: Tuple[str, ...]  # further state_dict keys of the same Parameter (tied weights)
    shape: Tuple[int, ...]
    group: int  # index into opt.param_groups

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class StatePiece:
    """Optimizer state of elements [lo, hi) of flattened param `param`; views of shape (hi-lo,)."""

    param: int
    lo: int
    hi: int
    master: torch.Tensor  # fp32; at precision fp32 a view of the param buffer itself
    # its buffer's rule's states by name, fp32, in the rule's order (with a rule per param
    # group, a subset of the file's sections: format.py [Note: sparse sections])
    states: Dict[str, torch.Tensor]

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Section name -> view, in file order (format.sections)."""
        return {"master": self.master, **self.states}

    def __getattr__(self, name: str) -> torch.Tensor:
        # a rule state by its name (`getattr(piece, name)`)
        states = self.__dict__.get("states")
        if states is not None and name in states:
            return states[name]
        raise AttributeError(f"StatePiece has no attribute {name!r}")


@dataclass
class ValuePiece:
    """Model-dtype param values of elements [lo, hi) held on this rank: a (hi-lo,) view."""

    param: int
    lo: int
    hi: int
    value: torch.Tensor


@dataclass
class StepCounter:
    """A step counter (0-d int64 view) and the params whose elements it governs, on any rank."""

    value: torch.Tensor
    params: Tuple[int, ...]


@dataclass
class OptimizerView:
    stage: int
    precision: str
    dtype: torch.dtype  # model dtype of the params
    world_size: int  # the layout: the shard group's size and this rank's place in it
    rank: int
    # Agreement: save and load agree over every rank of the job (parts.py `job_layout`: the
    # data-parallel world, and the tp and pp ranks that hold the model's other parts); HSDP
    # replicas hold the same shard and only replica 0 writes it.
    world_group: Any  # torch.distributed process group, or None at world size 1 without one
    world_rank: int
    world_world_size: int
    writes: bool  # this rank writes its shard's file (replica 0; always without replicas)
    params: List[ParamSpec]
    param_tensors: List[torch.Tensor]  # the Parameters, same order (to tell them from extras)
    held: List[StatePiece]  # all state this rank holds: a load fills every piece
    owned: List[StatePiece]  # this rank's share, a partition over ranks: a save writes these
    values: List[ValuePiece]  # model-dtype values held here: a load writes master.to(dtype)
    steps: List[StepCounter]
    param_groups: List[Dict[str, Any]]  # opt.param_groups, live (hyperparameters)
    scaler: Any  # zerokern.core.loss_scale.LossScaler
    rule: str  # the optimizer rule's name (zerokern.rules), e.g. "adamw"
    sections: Tuple[str, ...]  # the rank file's sections, in order (format.sections)
    section_dtypes: Dict[str, str]  # section -> element dtype name (format.section_dtypes)
    group_rules: Tuple[str, ...] = ()  # each param group's rule name (a rule per group)
    layout: List[Dict[str, Any]] = field(default_factory=list)  # informational, for metadata
    # after a load wrote the held pieces: per-block states rebuilt (block_states.py)
    after_load: List[Any] = field(default_factory=list)
    # per-matrix states held here, on their owner (zerokern.rules [Note: state kinds and the
    # owner protocol]): (param index, state name, shaped view); a save writes them, a load
    # fills them (format.py [Note: per-matrix states])
    matrix: List[Tuple[int, str, torch.Tensor]] = field(default_factory=list)
    # the job and this rank's part of it (parts.py [Note: a checkpoint in parts])
    job: Optional[JobLayout] = None

    @property
    def lead(self) -> bool:
        """This rank writes its part's extras and metadata (dp rank 0)."""
        return self.job.lead if self.job is not None else self.world_rank == 0


def model_items(model) -> List[Tuple[str, Any]]:
    """(key, tensor) of `model.state_dict(keep_vars=True)`; for a list of modules (one rank's
    pipeline stages under one optimizer, each keeping the whole model's names: parts.py
    [Note: a checkpoint in parts]) the items of each in turn, a key in several (a buffer of
    the root on each stage) once per module."""
    if isinstance(model, (list, tuple)):
        return [kv for m in model for kv in m.state_dict(keep_vars=True).items()]
    return list(model.state_dict(keep_vars=True).items())


def check_model(model) -> None:
    """TypeError unless model is an nn.Module or a non-empty list of them."""
    parts = model if isinstance(model, (list, tuple)) else [model]
    if not parts or not all(isinstance(m, nn.Module) for m in parts):
        raise TypeError("model must be a torch.nn.Module (or a list of one rank's pipeline "
                        f"stage modules), got {type(model).__name__}")


def state_dict_keys(model) -> Dict[int, List[str]]:
    """id(tensor) -> its keys in model.state_dict(), in order (several when tied)."""
    out: Dict[int, List[str]] = {}
    for k, t in model_items(model):
        names = out.setdefault(id(t), [])
        if k not in names:
            names.append(k)
    return out


def optimizer_view(model: nn.Module, opt: ZeroOptimizer, *,
                   between_steps: bool = True) -> OptimizerView:
    """Describe what `opt` holds on this rank, named after `model`'s state_dict keys.
    `between_steps=False`: a stage-3 buffer may be gathered (a step that failed mid-way:
    replica_join.py reads its shards, which a gather does not change).

    Raises:
        TypeError: model is not an nn.Module or opt not a zerokern optimizer.
        ValueError: opt optimizes a param that `model` does not have.
    """
    check_model(model)
    if not isinstance(opt, ZeroOptimizer):
        raise TypeError(f"opt must be a zerokern.ZeroAdamW (or another zerokern optimizer), "
                        f"got {type(opt).__name__}")
    if opt.grad_sync.detached:
        raise ValueError("opt no longer owns its params: a newer ZeroAdamW was created on the "
                         "same model; checkpoint that one")
    keys = state_dict_keys(model)
    job = job_layout(opt)
    view = OptimizerView(
        stage=opt.stage, precision=opt.precision, dtype=opt.dtype,
        world_size=opt.comm.shard.world_size, rank=opt.comm.shard.rank,
        world_group=job.group, world_rank=job.rank, world_world_size=job.world_size,
        writes=opt.comm.replicate is None or opt.comm.replicate.rank == 0,
        params=[], param_tensors=[], held=[], owned=[], values=[], steps=[],
        param_groups=opt.param_groups, scaler=opt.scaler, rule=opt.rule.name,
        sections=sections(opt.rule), section_dtypes=section_dtypes(opt.rule),
        group_rules=tuple(r.name for r in getattr(opt, "rules", [opt.rule] * len(
            opt.param_groups))), job=job)
    plans = getattr(opt, "_plans", {})
    for gi, g in enumerate(opt.flat_groups):
        if between_steps:
            g.check_between_steps()  # stage 3: not inside gathered_params() or a forward
        base = len(view.params)
        _buffer_view(view, keys, g)
        states = getattr(plans.get(gi), "states", None)  # a phased rule's matrix states
        if states is not None:
            view.matrix += [(base + i, name, t) for i, name, t in states.items()]
    return view


def _specs(view: OptimizerView, keys: Dict[int, List[str]], gi: int, g) -> int:
    """Append g's params to view.params; returns the index of the first."""
    base = len(view.params)
    for i, (p, s) in enumerate(zip(g.params, g.layout.slots)):
        names = keys.get(id(p))
        if not names:
            raise ValueError(f"opt holds a param that model does not have (param {i} of param "
                             f"group {gi}, shape {tuple(s.shape)}): pass the model the "
                             "optimizer was built on")
        view.params.append(ParamSpec(names[0], tuple(names[1:]), tuple(s.shape), gi))
        view.param_tensors.append(p)
    return base


def _buffer_view(view: OptimizerView, keys: Dict[int, List[str]], g) -> None:
    """One buffer (shard_buffer.py: a FlatGroup at stages 0-2, a ShardedFlat at stage 3; see
    partition.py [Note: bucket-major layout]), whatever its stage and placement.

    Per bucket k the buffer holds the state of flat range `g.state_range(k)` (the whole bucket
    at stage 0, this rank's piece otherwise) at `g.state_slice(k)` of master/m/v; this rank's
    share for a save is always its piece `piece_range(k, rank)`. At precision fp32 without
    offload `master` is None and the params (`g.param_values`) are the master. The values
    held are `g.value_pieces()`: every param at stages 0-2, the shard's part at stage 3.
    """
    L = g.layout
    base = _specs(view, keys, g.group_index, g)
    for i, a, b in g.value_pieces():
        off = L.slots[i].offset
        view.values.append(ValuePiece(base + i, a - off, b - off, g.param_values(a, b)))

    def pieces(k: int, lo: int, hi: int, held: bool = False) -> List[StatePiece]:
        out = []
        slo, st0 = g.state_range(k)[0], g.state_slice(k).start
        temps = block_states.expanded(g, k, lo, hi)  # per-block states, per element
        if held and temps:
            view.after_load.append(block_states.fixup(g, k, lo, hi, temps))
        for i, a, b in L.overlaps(lo, hi):
            st, n = st0 + a - slo, b - a
            master = g.param_values(a, b) if g.master is None else g.master[st:st + n]
            states = {nm: temps[nm][a - lo:b - lo] if nm in temps else t[st:st + n]
                      for nm, t in g.rule_states.items()}
            out.append(StatePiece(base + i, a - L.slots[i].offset, b - L.slots[i].offset,
                                  master, states))
        return out

    for k in range(L.n_buckets):
        view.steps.append(StepCounter(g.steps[k], tuple(base + i for i in g.step_params(k))))
        held = g.state_range(k)
        same = held == L.piece_range(k, g.rank)
        # the canonical share: r-th piece of bucket k
        mine = pieces(k, *L.piece_range(k, g.rank), held=same)
        view.owned += mine
        view.held += mine if same else pieces(k, *held, held=True)
    view.layout.append(g.layout_meta())


def model_extras(model, view: OptimizerView, every: bool = False
                 ) -> List[Tuple[str, Tuple[str, ...], torch.Tensor]]:
    """(name, aliases, tensor) for every state_dict tensor the optimizer does not hold:
    buffers and frozen params (also trainable params left out of the optimizer). A name that
    several modules of a list hold (the root's buffer on each stage): the first module's
    tensor, or with `every` (a load fills them all) each."""
    managed = {id(t) for t in view.param_tensors}
    out, seen, named = [], set(), set()
    keys = state_dict_keys(model)
    for k, t in model_items(model):
        if id(t) in managed or id(t) in seen or (k in named and not every):
            continue
        named.add(k)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"model.state_dict() entry {k!r} is a {type(t).__name__}, not a "
                            "tensor (get_extra_state): zerokern.checkpoint saves tensors only")
        seen.add(id(t))
        names = keys[id(t)]
        out.append((k, tuple(names[1:]), t))
    return out


def is_frozen_param(t: torch.Tensor) -> bool:
    """A model extra that exclude_frozen_parameters leaves out: a Parameter with
    requires_grad=False (DeepSpeed's test in `module_state_dict`); buffers are always saved."""
    return isinstance(t, nn.Parameter) and not t.requires_grad


@contextmanager
def whole_frozen_params(opt, write_back: bool = False):
    """Stage 3 shards frozen params with their unit (stage3/units.py); a checkpoint keeps them
    whole among the extras (extra.bin), so save and load see them gathered. Collective at
    stage 3; nothing at stages 0-2 or for a bad `opt` (the checks that follow report it)."""
    sync = getattr(opt, "grad_sync", None)
    pat = getattr(opt, "pattern", None)
    if pat is None or not pat.shards_params or not getattr(sync, "frozen", None) \
            or sync.detached:
        yield
        return
    with sync.frozen_whole(write_back):
        yield
