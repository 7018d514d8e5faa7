"""Checkpoints of tensor-parallel models (DTensor params, ZeroAdamW over the dp mesh).

[Note: a TP checkpoint is one checkpoint per tp rank]
With tensor parallelism each rank's optimizer holds its *local* tp shards, sharded over its dp
group (comm/tp.py). A checkpoint of it is therefore one ordinary checkpoint per tp coordinate,
each written by that coordinate's dp group in the local shards' coordinates:

    path/tp.json        {"format", "tp_size", "params": {state_dict key: {"shard": d | null,
                         "shape": global shape}}}: how the local tensors make the full ones
    path/tp00000/       the checkpoint of tp rank 0's shards (format.py, any dp size)
    path/tp00001/       ...

So dp is resharded on load exactly as without tp (any dp size, stage, precision), while the tp
size and the placements must stay as saved (checked against tp.json: a CheckpointError naming
the param otherwise). `consolidate(path)` reads every tp rank's checkpoint and joins each
param's local tensors along its shard dim (tp rank order: torch's Shard is torch.chunk's
split), so the result is the full model's state dict. Each tp rank's directory is replaced
atomically (writer.py [Note: atomic replace]); the set of them is not one atomic unit.
Model tensors the optimizer does not hold (buffers, frozen params) must not be DTensors (a
ValueError before anything is written).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

import torch

from zerokern.layout.dtensor_params import is_dtensor

from .format import META, CheckpointError, MissingFileError, ModelMismatchError

TP_META = "tp.json"
TP_FORMAT = "zerokern-tp-checkpoint"


def tp_dir(top: str, tp_rank: int) -> str:
    """The checkpoint directory of tp rank `tp_rank` under a TP checkpoint `top`."""
    return os.path.join(top, f"tp{tp_rank:05d}")


def read_tp_meta(top: str) -> Optional[Dict[str, Any]]:
    """tp.json of a TP checkpoint, or None when `top` is not one."""
    fn = os.path.join(top, TP_META)
    if not os.path.isfile(fn):
        return None
    with open(fn) as f:
        meta = json.load(f)
    if meta.get("format") != TP_FORMAT:
        raise CheckpointError(f"{fn}: not a zerokern tensor-parallel checkpoint index")
    return meta


def _placements(view) -> Dict[str, Dict[str, Any]]:
    out = {}
    for spec, p in zip(view.params, view.param_tensors):
        shard, shape = None, list(spec.shape)  # (a freed stage-3 param's own shape is 0)
        if is_dtensor(p):  # a DTensor's shape is the global one, freed or not
            dims = [pl.dim for pl in p.placements if pl.is_shard()]
            shard, shape = (dims[0] if dims else None), list(p.shape)
        for name in (spec.name, *spec.aliases):
            out[name] = {"shard": shard, "shape": shape}
    return out


def save_dir(top: str, view, extras, opt) -> str:
    """Before a save: this rank's directory (top itself without tp). With tp, checks the
    extras, creates `top` and writes tp.json (dp rank 0 of every tp rank, the same bytes,
    atomically)."""
    tp = getattr(opt, "tp", None)
    if tp is None:
        return top
    bad = [name for name, _, t in extras if is_dtensor(t)]
    if bad:
        raise ValueError(f"model: zerokern.checkpoint saves the DTensors the optimizer holds; "
                         f"{bad[:3]} (buffers or frozen params) are DTensors too")
    if os.path.isfile(os.path.join(top, META)):
        raise ValueError(f"path {top!r} holds a checkpoint of a model without tensor "
                         "parallelism; save a tensor-parallel model elsewhere")
    os.makedirs(top, exist_ok=True)
    if view.world_rank == 0:
        body = {"format": TP_FORMAT, "tp_size": tp.comm.world_size,
                "params": _placements(view)}
        fn = os.path.join(top, TP_META)
        tmp = f"{fn}.tmp{tp.comm.rank}"
        with open(tmp, "w") as f:
            json.dump(body, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, fn)
    return tp_dir(top, tp.comm.rank)


def load_dir(top: str, view, opt) -> str:
    """Before a load: this rank's directory, after checking the tp size and placements against
    tp.json (the same check on every rank: all raise alike)."""
    tp = getattr(opt, "tp", None)
    meta = read_tp_meta(top)
    if tp is None:
        if meta is not None:
            raise CheckpointError(
                f"{top}: a tensor-parallel checkpoint (tp size {meta['tp_size']}); load it "
                "into the same tensor-parallel model (ZeroAdamW(mesh=world_mesh['dp'])), or "
                "zerokern.checkpoint.consolidate it into a full state dict")
        return top
    if meta is None:
        raise MissingFileError(f"{top}: no {TP_META}: not a checkpoint of a tensor-parallel "
                               "model (consolidate it and load the full tensors instead)")
    if meta["tp_size"] != tp.comm.world_size:
        raise CheckpointError(f"{top}: saved with tp size {meta['tp_size']}, loading with "
                              f"{tp.comm.world_size}: the tp size must stay as saved (dp may "
                              "change)")
    now = _placements(view)
    for name, want in now.items():
        got = meta["params"].get(name)
        if got is None or got["shard"] != want["shard"] or got["shape"] != want["shape"]:
            raise ModelMismatchError(f"{top}: param {name!r} is {want} now but was saved as "
                                     f"{got} (tp placement and global shape must match)")
    return tp_dir(top, tp.comm.rank)


def consolidate_tp(top: str, meta: Dict[str, Any], read_one) -> Dict[str, torch.Tensor]:
    """The full state dict of a TP checkpoint: read_one(dir) per tp rank (the plain
    consolidate), each param's local tensors joined along its shard dim."""
    parts = [read_one(tp_dir(top, r)) for r in range(meta["tp_size"])]
    out: Dict[str, torch.Tensor] = {}
    for key, t in parts[0].items():
        spec = meta["params"].get(key)
        if spec is not None and spec["shard"] is not None:
            t = torch.cat([p[key] for p in parts], dim=spec["shard"])
        if spec is not None and list(t.shape) != spec["shape"]:
            raise CheckpointError(f"{top}: param {key!r} joins to shape {list(t.shape)}, "
                                  f"expected {spec['shape']}")
        out[key] = t
    return out


__all__ = ["TP_META", "tp_dir", "read_tp_meta", "save_dir", "load_dir", "consolidate_tp"]
