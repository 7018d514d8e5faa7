"""Checkpoints of model-parallel jobs: one part per (pipeline stage, tp rank), read by name.

[Note: a checkpoint in parts]
A job whose ranks hold different params (pipeline stages: the plan's `pp` role, a world mesh
with a "pp" dim; tensor parallelism: DTensor params over the tp mesh) writes one ordinary
checkpoint (format.py) per model-parallel coordinate, a *part*, each written by that
coordinate's data-parallel group in its own coordinates, and one index:

    path/parts.json     {"format", "version", "pp_size", "tp_size",
                         "parts": [{"dir", "pp", "tp"}, ...],
                         "params": {name: {"shard": d | null, "shape": global shape}}}
    path/pp00000/       pipeline stage 0's checkpoint (tp: pp00000-tp00000, pp00000-tp00001,
    path/pp00001/       ...; tp alone: tp00000, tp00001)

Names. A param is named by its key in the stage module's `state_dict()`, which must be the
whole model's fully qualified name (torchtitan's convention: a stage module is the whole model
with the other stages' layers deleted, so `layers.5.attn.wq.weight` keeps its name on stage
1; a ModuleDict of layers keeps the numbers, a ModuleList renumbers them). Two pipeline stages
holding a trainable param of the same name are refused at save (ValueError naming it, before
anything is written): the usual cause is a `nn.Sequential` cut into stages that all start at
"0". Buffers and frozen params of the same name on several stages (a shared rotary table) are
saved by each stage and read from the first; so is a trainable param that every stage but the
first marks `ds_pipe_replicated` (DeepSpeed's TiedLayerSpec copies: equal after every step),
indexed once at the first stage (engine/pipeline_checkpoint.py).

Atomic. Every rank of the job (dp x tp x pp, `job_layout`) takes part in one save: the parts
are written into one `path.tmp-<nonce>/`, each part's dp rank 0 writes its metadata, then job
rank 0 writes parts.json and replaces `path` in one step (writer.py [Note: atomic replace]):
the whole checkpoint, every stage and tp rank, or the previous one, never a mix.

Loading by name, at any layout (reader.py): each rank's optimizer asks for its params by
name; a param is read from the part that holds it. Where the saved tp placement is the loader's
(the same tp size and shard dim, or unsharded on both sides) the bytes are read as they are
(bitwise); otherwise the full tensor of each state is put together from the tp parts (torch's
Shard is torch.chunk's split: a concatenation along the shard dim) and the loader's chunk
taken from it. The checkpoint's params and buffers must be covered by the loading job as a
whole (an all-gather of the names each rank loaded), and each loader param must be in the
checkpoint: a ModelMismatchError naming the names otherwise, on every rank, before anything
is written. A checkpoint written before parts.json existed (`tp.json` + `tpNNNNN/`, each tp
rank committed on its own) is read as a parts checkpoint of tp parts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from zerokern.geometry.dtensor_params import is_dtensor

from .format import LEGACY_TP_META, META, PARTS_META, CheckpointError, ModelMismatchError

PARTS_FORMAT = "zerokern-parts-checkpoint"
PARTS_VERSION = 1
LEGACY_TP_FORMAT = "zerokern-tp-checkpoint"

# one process group per set of job ranks (groups are never destroyed)
_JOB_GROUPS: Dict[tuple, Any] = {}


def part_name(pp: int, pp_size: int, tp: int, tp_size: int) -> str:
    """The directory of the part at (pipeline stage pp, tp rank tp); "" for a job of one part
    (the checkpoint is then the plain format, no parts.json)."""
    bits = ([f"pp{pp:05d}"] if pp_size > 1 else []) + ([f"tp{tp:05d}"] if tp_size > 1 else [])
    return "-".join(bits)


@dataclass(frozen=True)
class JobLayout:
    """The ranks a checkpoint is collective over and this rank's part.

    group/rank/world_size: every rank of the job (the dp group x tp x pp); pp/tp: this rank's
    stage and tp rank; lead: this rank writes its part's extras and metadata (dp rank 0);
    complete: False when the optimizer's roles span fewer ranks than the default process group
    and the plan knows no pipeline stages (a save refuses: the other ranks may be stages
    writing the same files)."""

    group: Any
    rank: int
    world_size: int
    pp: int
    pp_size: int
    tp: int
    tp_size: int
    lead: bool
    complete: bool = True

    @property
    def part(self) -> str:
        return part_name(self.pp, self.pp_size, self.tp, self.tp_size)

    @property
    def model_parallel(self) -> bool:
        return self.pp_size > 1 or self.tp_size > 1


def job_layout(opt) -> JobLayout:
    """The job of `opt` from its plan (comm/plan.py [Note: one parallel plan]): its dp world,
    the tp group (DTensor params) and the pp group (a world mesh's "pp" dim). WORLD when they
    make up the whole job (no collective); otherwise the union of their ranks, gathered over the
    tp and pp groups and made into a group once."""
    dp = opt.comm.world
    tp = opt.tp.comm if getattr(opt, "tp", None) is not None else None
    plan = getattr(opt, "plan", None)
    # a world mesh's "pp" dim, or the stages a PipelineEngine set for checkpoints only
    # (engine/pipeline_checkpoint.py: its norm agrees over the grid's group instead)
    pp = getattr(plan, "pp", None) or getattr(opt, "checkpoint_pp", None)
    lead = dp.rank == 0
    coords = dict(pp=0 if pp is None else pp.rank, pp_size=1 if pp is None else pp.world_size,
                  tp=0 if tp is None else tp.rank, tp_size=1 if tp is None else tp.world_size)
    size = dp.world_size * coords["pp_size"] * coords["tp_size"]
    inited = dist.is_available() and dist.is_initialized()
    complete = not inited or pp is not None or size >= dist.get_world_size()
    if tp is None and pp is None:
        return JobLayout(dp.group if dp.world_size > 1 else None, dp.rank, dp.world_size,
                         lead=lead, complete=complete, **coords)
    if size == dist.get_world_size():
        return JobLayout(dist.group.WORLD, dist.get_rank(), size, lead=lead, **coords)
    ranks = sorted(dist.get_process_group_ranks(dp.group)) if dp.world_size > 1 else \
        [dist.get_rank()]
    for c in (tp, pp):
        if c is not None and c.world_size > 1:
            seen: List[Any] = [None] * c.world_size
            dist.all_gather_object(seen, ranks, group=c.group)
            ranks = sorted({r for rs in seen for r in rs})
    key = tuple(ranks)
    if key not in _JOB_GROUPS:
        _JOB_GROUPS[key] = dist.new_group(ranks, use_local_synchronization=True)
    return JobLayout(_JOB_GROUPS[key], ranks.index(dist.get_rank()), len(ranks), lead=lead,
                     complete=complete, **coords)


def placements(view) -> Dict[str, Dict[str, Any]]:
    """name (and alias) -> {"shard": tp shard dim or None, "shape": global shape} of every
    trainable param of the view."""
    out = {}
    for spec, p in zip(view.params, view.param_tensors):
        shard, shape = None, list(spec.shape)  # (a freed stage-3 param's own shape is 0)
        if is_dtensor(p):  # a DTensor's shape is the global one, freed or not
            dims = [pl.dim for pl in p.placements if pl.is_shard()]
            shard, shape = (dims[0] if dims else None), list(p.shape)
        pl = {"shard": shard, "shape": shape}
        if getattr(p, "ds_pipe_replicated", False):  # a TiedLayerSpec's copy on a later stage
            pl["replica"] = True  # check_parts: the first stage holding it saves it
        for name in (spec.name, *spec.aliases):
            out[name] = pl
    return out


def check_extras(view, extras) -> None:
    """Model tensors the optimizer does not hold are saved whole: not DTensors."""
    bad = [name for name, _, t in extras if is_dtensor(t)]
    if bad:
        raise ValueError(f"model: zerokern.checkpoint saves the DTensors the optimizer holds; "
                         f"{bad[:3]} (buffers or frozen params) are DTensors too")


def check_parts(described: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The parts.json body from every rank's description (saving.prepare's all-gather: part,
    pp, tp, and the part lead's placements); ValueError naming a trainable param held by two
    pipeline stages, or a stage whose tp ranks hold other names."""
    parts: Dict[str, Dict[str, Any]] = {}
    params: Dict[str, Dict[str, Any]] = {}
    stage_of: Dict[str, int] = {}
    names_of_stage: Dict[int, Dict[int, frozenset]] = {}
    for d in described:
        if d["placements"] is None:
            continue
        parts[d["part"]] = {"dir": d["part"], "pp": d["pp"], "tp": d["tp"]}
        names_of_stage.setdefault(d["pp"], {})[d["tp"]] = frozenset(d["placements"])
        for name, pl in d["placements"].items():
            s = stage_of.setdefault(name, d["pp"])
            if s != d["pp"] and (pl.get("replica") or params[name].get("replica")):
                # DeepSpeed's tied weight (TiedLayerSpec) on several stages, equal after every
                # step: indexed at the stage that does not mark it a replica, read from there
                if pl.get("replica"):
                    continue
                stage_of[name] = d["pp"]
            elif s != d["pp"]:
                raise ValueError(
                    f"model: param {name!r} is trainable on pipeline stages {s} and {d['pp']}: "
                    "a checkpoint names params by their state_dict keys, which must be the "
                    "whole model's names, each held by one stage (build each stage from the "
                    "whole model by deleting the other stages' layers, torchtitan's way, not "
                    "by renumbering them); nothing was written")
            params[name] = pl
    for s, by_tp in names_of_stage.items():
        if len(set(by_tp.values())) > 1:
            raise ValueError(f"model: the tp ranks of pipeline stage {s} hold params of "
                             "other names; every tp rank of a stage holds the same params")
    d0 = described[0]
    return {"format": PARTS_FORMAT, "version": PARTS_VERSION, "pp_size": d0["pp_size"],
            "tp_size": d0["tp_size"],
            "parts": [parts[k] for k in sorted(parts)], "params": params}


def write_parts_meta(dirpath: str, body: Dict[str, Any]) -> None:
    fn = os.path.join(dirpath, PARTS_META)
    with open(fn, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_parts_meta(top: str) -> Optional[Dict[str, Any]]:
    """The parts index of a checkpoint directory (parts.json, or a legacy tp.json read as tp
    parts), or None for a checkpoint of one part (meta.json at the top)."""
    fn = os.path.join(top, PARTS_META)
    if os.path.isfile(fn):
        with open(fn) as f:
            try:
                meta = json.load(f)
            except ValueError:
                raise CheckpointError(f"{fn}: not valid JSON (the index is corrupt)") from None
        if meta.get("format") != PARTS_FORMAT or meta.get("version") != PARTS_VERSION:
            raise CheckpointError(f"{fn}: not a zerokern parts index this version reads "
                                  f"(format {meta.get('format')!r}, version "
                                  f"{meta.get('version')!r})")
        return meta
    fn = os.path.join(top, LEGACY_TP_META)
    if not os.path.isfile(fn):
        return None
    with open(fn) as f:
        meta = json.load(f)
    if meta.get("format") != LEGACY_TP_FORMAT:
        raise CheckpointError(f"{fn}: not a zerokern tensor-parallel checkpoint index")
    n = meta["tp_size"]
    return {"format": PARTS_FORMAT, "version": PARTS_VERSION, "pp_size": 1, "tp_size": n,
            "parts": [{"dir": f"tp{t:05d}", "pp": 0, "tp": t} for t in range(n)],
            "params": meta["params"]}


def index_file(top: str) -> str:
    """The file that marks `top` complete: parts.json of a checkpoint in parts (written last,
    by the commit), else meta.json."""
    fn = os.path.join(top, PARTS_META)
    return fn if os.path.isfile(fn) else os.path.join(top, META)


def part_dirs(top: str) -> List[str]:
    """The checkpoint directories (each with its meta.json) that make up `top`."""
    meta = read_parts_meta(top)
    if meta is None:
        return [top]
    return [os.path.join(top, p["dir"]) for p in meta["parts"]]


def consolidate_parts(top: str, meta: Dict[str, Any], read_one) -> Dict[str, Any]:
    """The full state dict of a checkpoint in parts: read_one(dir) per part (the plain
    consolidate), stage by stage; a tp-sharded param's local tensors joined along its shard dim
    (tp rank order: torch's Shard is torch.chunk's split); a buffer on several stages taken from
    the first."""
    import torch

    stages: Dict[int, List[Dict[str, Any]]] = {}
    for p in meta["parts"]:
        stages.setdefault(p["pp"], []).append(p)
    out: Dict[str, Any] = {}
    for s in sorted(stages):
        parts = sorted(stages[s], key=lambda p: p["tp"])
        dicts = [read_one(os.path.join(top, p["dir"])) for p in parts]
        for key, t in dicts[0].items():
            if key in out:
                continue
            spec = meta["params"].get(key)
            if spec is not None and spec["shard"] is not None and len(dicts) > 1:
                t = torch.cat([d[key] for d in dicts], dim=spec["shard"])
            if spec is not None and list(t.shape) != list(spec["shape"]):
                raise CheckpointError(f"{top}: param {key!r} joins to shape {list(t.shape)}, "
                                      f"expected {spec['shape']}")
            out[key] = t
    return out


def missing_error(where: str, missing: List[str], unused: List[str]) -> ModelMismatchError:
    """The error naming params a load cannot match (in no part / covered by no rank)."""
    def names(xs):
        return f"{xs[:8]}{' ...' if len(xs) > 8 else ''} ({len(xs)})"
    bits = []
    if missing:
        bits.append(f"params of this model not in the checkpoint: {names(missing)}")
    if unused:
        bits.append(f"checkpoint params and buffers no rank of this job loads: {names(unused)}")
    return ModelMismatchError(f"{where}: the checkpoint holds another model (or other stages' "
                              f"params): " + "; ".join(bits) + "; nothing was loaded")


__all__ = ["PARTS_META", "JobLayout", "job_layout", "part_name", "placements", "check_parts",
           "read_parts_meta", "write_parts_meta", "part_dirs", "index_file",
           "consolidate_parts", "missing_error"]
