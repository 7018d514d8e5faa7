"""`load(path, model, opt)`: at any world size and stage, straight from the saved shards.

[Note: load is all-or-nothing]
Phase 1, per rank, writing nothing: read and check the metadata; match every param by name
(aliases included), shape and param group; check buffers and frozen params; plan the copies
(for each element range this rank holds, the saved segments and byte offsets that hold it);
check that every needed file exists with its recorded size; verify the crc of every block the
plan touches; check that the step counters and the loss scaler can take the saved values.
Then all ranks agree (`Collective.agree`): if any rank failed, every rank raises and nothing
was written anywhere. Phase 2 copies from the same, verified, bytes.

Values loaded:
- fp32 master and the rule's states: bitwise the saved ones (fp32 in every precision); a
  checkpoint of another optimizer rule (e.g. ZeroAdamW's loaded into a ZeroLion) is a
  CheckpointError naming both, before anything is written;
- model-dtype params: `master.to(dtype)` (round to nearest even), what the optimizer keeps
  after every step; at precision fp32 the param buffer is the master;
- step counters, hyperparameters of each param group (lr, betas, eps, weight_decay, adamw and
  any other key, e.g. a scheduler's `initial_lr`; the scheduler's own state is the user's to
  save), and the loss-scaler state;
- buffers and frozen params of the model (copied with a cast if the model's dtype differs);
  frozen params the checkpoint left out (format.py [Note: excluded frozen params]) keep the
  model's values, with `strict=False` only.
A checkpoint saved at another precision loads too (the masters are fp32 in every precision).
The loss scaler is then left as the loading optimizer built it, with a warning, when the
scaler kinds differ (fp16 dynamic vs bf16/fp32 static): its state does not carry over.
Gradients are not part of a checkpoint and are left alone; call `opt.zero_grad()`.
"""

from __future__ import annotations

import bisect
import io
import os
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .collective import Collective
from .format import (
    CLIENT,
    EXTRA,
    LEGACY_RULE,
    META,
    PARTS_META,
    BlockVerifier,
    CheckpointError,
    ModelMismatchError,
    as_tensor,
    decode_value,
    dtype_from_name,
    dtype_name,
    find_checkpoint,
    fingerprint,
    legacy_sections,
    read_meta,
    read_span,
)
from .parts import missing_error, placements, read_parts_meta
from .views import (
    OptimizerView,
    is_frozen_param,
    model_extras,
    optimizer_view,
    whole_frozen_params,
)
from .writer import check_path


class SavedIndex:
    """Where each saved param's elements are: per param, sorted (lo, hi, file, elem_off)."""

    def __init__(self, meta: Dict[str, Any]) -> None:
        self.meta = meta
        self.params = meta["params"]
        self.by_name: Dict[str, int] = {}
        for j, p in enumerate(self.params):
            for n in [p["name"], *p["aliases"]]:
                self.by_name[n] = j
        segs = defaultdict(list)
        for fname, info in meta["files"].items():
            for j, lo, hi, off in info.get("segments", ()):
                segs[j].append((lo, hi, fname, off))
        self.segments = {j: sorted(s) for j, s in segs.items()}
        # format.py [Note: per-matrix states]: (param, state) -> (file, byte offset, shape)
        self.matrix: Dict[Tuple[int, str], Tuple[str, int, List[int]]] = {
            (j, name): (fname, off, shape) for fname, info in meta["files"].items()
            for j, name, off, shape in info.get("matrix", ())}
        self._starts = {j: [s[0] for s in v] for j, v in self.segments.items()}
        self._seg_starts: Dict[str, List[int]] = {}  # per file: its segments' elem_off

    def sources(self, j: int, lo: int, hi: int) -> List[Tuple[str, int, int, int]]:
        """(file, saved elem offset, dest offset from lo, count) covering [lo, hi) of param j."""
        segs, starts = self.segments.get(j, []), self._starts.get(j, [])
        out, at = [], lo
        k = max(bisect.bisect_right(starts, lo) - 1, 0)
        while at < hi and k < len(segs):
            slo, shi, fname, off = segs[k]
            if slo <= at < shi:
                n = min(hi, shi) - at
                out.append((fname, off + at - slo, at - lo, n))
                at += n
            elif slo > at:
                break
            k += 1
        if at < hi:
            raise CheckpointError(f"{META}: elements [{at}, {hi}) of param "
                                  f"{self.params[j]['name']!r} are in no rank file")
        return out

    def matrix_source(self, j: int, name: str, shape) -> Tuple[str, int]:
        """(file, byte offset) of param j's per-matrix state `name`, saved whole by its owner
        at any world size (format.py [Note: per-matrix states])."""
        got = self.matrix.get((j, name))
        pname = self.params[j]["name"]
        if got is None:
            raise CheckpointError(f"{META}: no per-matrix state {name!r} of param {pname!r} in "
                                  "any rank file")
        if list(got[2]) != list(shape):
            raise CheckpointError(f"{META}: per-matrix state {name!r} of param {pname!r} has "
                                  f"shape {got[2]}, the optimizer's {list(shape)}")
        return got[0], got[1]

    def dtype(self, section: str) -> torch.dtype:
        """A section's element dtype (fp32 where the metadata names none: every checkpoint
        written before 8-bit states)."""
        return dtype_from_name(self.meta.get("section_dtypes", {}).get(section, "float32"))

    def byte_range(self, fname: str, section: str, elem_off: int, n: int) -> Tuple[int, int]:
        """Bytes of elements [elem_off, elem_off + n) (a segment's coordinates) of `section`
        (format.py [Note: sparse sections]: mapped through `section_offsets` where given)."""
        info = self.meta["files"][fname]
        sparse = info.get("section_offsets", {}).get(section)
        if sparse is not None:
            segs = info["segments"]
            starts = self._seg_starts.get(fname)
            if starts is None:
                starts = self._seg_starts[fname] = [x[3] for x in segs]
            s = bisect.bisect_right(starts, elem_off) - 1
            if s < 0 or sparse[s] < 0:
                name = self.params[segs[max(s, 0)][0]]["name"]
                raise CheckpointError(f"{META}: {fname} holds no {section!r} for elements at "
                                      f"{elem_off} (param {name!r})")
            elem_off = sparse[s] + elem_off - segs[s][3]
        size = self.dtype(section).itemsize
        lo = info["sections"][section] + elem_off * size
        return lo, lo + n * size


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _saved_names(meta: Dict[str, Any]) -> List[str]:
    """A part's names a loading job must cover: its params, buffers and excluded params."""
    return [x["name"] for key in ("params", "extras", "excluded_frozen")
            for x in meta.get(key, ())]


def _cover(lo: int, hi: int, pieces):
    """Split [lo, hi) into (a, b, master view of [a, b) or None) by sorted held pieces."""
    at = lo
    for plo, phi, master in pieces:
        a, b = max(plo, at), min(phi, hi)
        if a >= b:
            continue
        if at < a:
            yield at, a, None
        yield a, b, master[a - plo:b - plo]
        at = b
    if at < hi:
        yield at, hi, None


def load(path, model: nn.Module, opt, *, strict: bool = True) -> Dict[str, Any]:
    """Load a checkpoint into model and opt (collective: every rank calls).

    Works at any world size, stage and precision. Each rank memory-maps and reads only the
    byte ranges it holds; nothing is converted offline.

    Args:
        path: checkpoint directory written by `zerokern.checkpoint.save`, the same on every
            rank.
        model: the nn.Module `opt` was built on (same names and shapes as the saved one), or
            the list of one rank's pipeline stage modules under one optimizer. Params are
            matched by name: a pipelined or tensor-parallel checkpoint (parts.py [Note: a
            checkpoint in parts]) loads at any other pipeline and tp layout, each rank reading
            its params from the stage that holds them.
        opt: the zerokern.ZeroAdamW; any world size, stage, precision or offload.
        strict: True: the checkpoint must hold every tensor of the model. False: frozen
            params that a save with `exclude_frozen_parameters=True` left out keep the
            model's current values (DeepSpeed's `load_module_strict=False`); the model must
            still have each of them, frozen (requires_grad=False) and of the saved shape, and
            a warning names those whose values differ from the ones saved. Everything else
            must match either way (the optimizer state loads with the model).

    Returns:
        {"path", "world_size", "stage", "precision", "step", "parts", "excluded_frozen",
        "client_state"} of the checkpoint read (world_size, stage, precision: its first
        part's; parts: its part directories, [] for a checkpoint of one part; excluded_frozen:
        the names of the frozen params it left out, [] for most; client_state: what
        `save(client_state=...)` stored, or None).

    Raises:
        TypeError: bad argument types. ValueError: bad argument values.
        CheckpointError: (a ValueError) on every rank, with nothing modified; its kinds
            ChecksumError (names the file), MissingFileError, VersionError and
            ModelMismatchError (names the param; also strict=True on a checkpoint that left
            frozen params out, and a param left out as frozen that is trainable here or has
            another shape; a param of the model the checkpoint lacks, and a param or buffer
            of the checkpoint no rank of the loading job holds, by name).
    """
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
    from .async_save import wait  # (async_save imports writer, not reader: no circle)

    wait()  # a pending async save commits (or raises) first
    with whole_frozen_params(opt, write_back=True):  # stage 3 (collective)
        return _load(path, model, opt, strict)


def _load(path, model: nn.Module, opt, strict: bool = True) -> Dict[str, Any]:
    path = check_path(path)
    view = optimizer_view(model, opt)
    extras = model_extras(model, view, every=True)
    coll = Collective(view.world_group, view.world_rank, view.world_world_size)
    err, plan = None, None
    try:
        plan = _Plan(path, view, extras, strict)
    except (KeyError, IndexError) as e:  # a crc-valid file this code cannot follow
        err = CheckpointError(f"{os.path.join(path, META)}: malformed metadata ({e!r})")
    except Exception as e:  # noqa: BLE001 - every rank must hear of it
        err = e
    coll.agree(err)
    if not plan.local_cover:  # parts.py [Note: a checkpoint in parts]: the job covers it
        loaded = set().union(*map(set, coll.all_gather(sorted(plan.used))))
        unused = sorted(plan.saved_names - loaded)
        if unused:  # the same on every rank: all raise, nothing written
            raise missing_error(plan.dir, [], unused)
    if plan.warning:
        warnings.warn(plan.warning, stacklevel=2)
    plan.apply()
    if hasattr(opt, "state_loaded"):
        opt.state_loaded()  # the loaded masters define the state (model_sync.py)
    m = plan.meta
    return {"path": plan.dir, "world_size": m["world_size"], "stage": m["stage"],
            "precision": m["precision"],
            "step": max((p["step"] for part in plan.saved.parts
                         for p in part.meta["params"]), default=0),
            "parts": [part.name for part in plan.saved.parts if part.name],
            "excluded_frozen": plan.excluded_names,
            "client_state": plan.client_state}


class SavedPart:
    """One part of a checkpoint (parts.py [Note: a checkpoint in parts]): its directory,
    metadata and index; the whole checkpoint of one part has name ""."""

    def __init__(self, top: str, entry: Optional[Dict[str, Any]]) -> None:
        self.name = entry["dir"] if entry else ""
        self.pp, self.tp = (entry["pp"], entry["tp"]) if entry else (0, 0)
        self.dir = os.path.join(top, self.name) if self.name else top
        self.meta = read_meta(self.dir)
        self.index = SavedIndex(self.meta)

    def fname(self, f: str) -> str:
        """A file of this part, relative to the checkpoint's top directory."""
        return os.path.join(self.name, f) if self.name else f


class Saved:
    """A checkpoint as a whole: its parts, and where each name is."""

    def __init__(self, path: str) -> None:
        self.dir, self.warning = find_checkpoint(path)
        pm = read_parts_meta(self.dir)
        self.parts = [SavedPart(self.dir, e) for e in pm["parts"]] if pm else \
            [SavedPart(self.dir, None)]
        self.tp_size = pm["tp_size"] if pm else 1
        self.layout: Dict[str, Dict[str, Any]] = pm["params"] if pm else {}
        self.files = {part.fname(f): info for part in self.parts
                      for f, info in part.meta["files"].items()}
        self.block_bytes = self.parts[0].meta["block_bytes"]
        if any(part.meta["block_bytes"] != self.block_bytes for part in self.parts):
            raise CheckpointError(f"{self.dir}: its parts have other block sizes")
        self.by_name: Dict[str, List[Tuple[SavedPart, int]]] = {}
        for part in self.parts:
            for n, j in part.index.by_name.items():
                self.by_name.setdefault(n, []).append((part, j))


@dataclass
class _Source:
    """Where a loader param's state is read from: `parts` [(part, saved index)], one when the
    bytes are read as they are (direct), the tp parts in tp order when the full tensor is put
    together (saved tp shard dim `shard`, each part's local shape `local`) and the loader's
    tp chunk (`out`: (dim, tp size, tp rank), or None: the whole) taken from it."""

    parts: List[Tuple[SavedPart, int]]
    gather: bool = False
    shard: Optional[int] = None
    local: Tuple[int, ...] = ()
    out: Optional[Tuple[int, int, int]] = None


class _Plan:
    """Phase 1 of [Note: load is all-or-nothing]: everything checked, nothing written."""

    def __init__(self, path: str, view: OptimizerView, extras, strict: bool = True) -> None:
        self.view, self.strict = view, strict
        self.saved = saved = Saved(path)
        self.dir, self.warning = saved.dir, saved.warning
        self.meta = saved.parts[0].meta  # (the scaler; what load returns)
        # one part read by a job of one part: today's checks, all local (the names and the
        # buffers of the model and the checkpoint are the same sets); otherwise the job as a
        # whole must cover the checkpoint (_load)
        job = view.job
        self.local_cover = len(saved.parts) == 1 and (job is None or not job.model_parallel)
        self.used: set = set()  # saved names this rank loads (params, buffers, excluded)
        self.saved_names = {n for part in saved.parts for n in _saved_names(part.meta)}
        # format.py [Note: excluded frozen params]: name or alias -> entry
        self.excluded: Dict[str, Dict[str, Any]] = {}
        for part in saved.parts:
            for e in part.meta.get("excluded_frozen", ()):
                for n in [e["name"], *e["aliases"]]:
                    self.excluded.setdefault(n, e)
        self.excluded_names = list(dict.fromkeys(
            e["name"] for part in saved.parts for e in part.meta.get("excluded_frozen", ())))
        for part in saved.parts:
            self._check_rule(part)
        self.files = BlockVerifier(saved.dir, saved.files, saved.block_bytes)
        self.match = self._match_params()
        # copies: (dest view, dest offset, file, byte offset, count, saved dtype)
        self.copies: List[Tuple[torch.Tensor, int, str, int, int, torch.dtype]] = []
        # gathers: (dest view, loader param, section, lo, hi) from a put-together full tensor
        self.gathers: List[Tuple[torch.Tensor, int, str, int, int]] = []
        self.gather_reads: Dict[Tuple[int, str], List[list]] = {}
        for p in view.held:
            for key, dest in p.tensors().items():
                self._read_into(dest, p.param, key, p.lo, p.hi)
        for i, name, t in view.matrix:  # the per-matrix states this rank owns here
            src = self.match[i]
            if src.gather:
                raise CheckpointError(f"{self.dir}: per-matrix state {name!r} of param "
                                      f"{view.params[i].name!r} cannot move to another tp "
                                      "layout; load it at the tp size it was saved with")
            part, j = src.parts[0]
            fname, lo = part.index.matrix_source(j, name, t.shape)
            self.copies.append((t.view(-1), 0, part.fname(fname), lo, t.numel(),
                                torch.float32))
        # Model-dtype values: cast from the master this rank just loaded where it holds it
        # (at stage 0 all of it: 4 of 16 bytes/param not read again; at fp32 the same memory,
        # nothing to do), else read the saved master.
        # casts: (dest view, loaded master view of the same elements), after the copies
        self.casts: List[Tuple[torch.Tensor, torch.Tensor]] = []
        held = defaultdict(list)
        for p in view.held:
            held[p.param].append((p.lo, p.hi, p.master))
        for v in view.values:
            for a, b, master in _cover(v.lo, v.hi, sorted(held[v.param], key=lambda x: x[0])):
                dest = v.value[a - v.lo:b - v.lo]
                if master is not None:
                    if dest.data_ptr() != master.data_ptr():
                        self.casts.append((dest, master))
                    continue
                self._read_into(dest, v.param, "master", a, b)
        self.gathers.sort(key=lambda g: (g[1], g[2]))  # one full tensor at a time (apply)
        self.steps = self._plan_steps()
        self.groups = self._plan_groups()
        self.scaler_state = self._plan_scaler()
        self.extras = self._plan_extras(extras)
        # Files present with their recorded sizes, then the crc of every block read.
        ranges = defaultdict(list)
        for _, _, fname, lo, n, dt in self.copies:
            ranges[fname].append((lo, lo + n * dt.itemsize))
        for reads in self.gather_reads.values():
            for part_reads in reads:
                for fname, lo, _, n, dt in part_reads:
                    ranges[fname].append((lo, lo + n * dt.itemsize))
        for _, _, fname, lo, nbytes in self.extras:
            ranges[fname].append((lo, lo + nbytes))
        for fname in sorted(ranges):
            self.files.check_present(fname)
        for fname in sorted(ranges):
            self.files.verify(fname, ranges[fname])
        self.client_state = None  # save(client_state=...): read whole, every block checked
        client = next((part.fname(CLIENT) for part in saved.parts
                       if CLIENT in part.meta["files"]), None)
        if client is not None:
            self.files.verify_all(client)
            raw = read_span(self.files.path(client), 0, saved.files[client]["bytes"])
            self.client_state = torch.load(io.BytesIO(raw.tobytes()), weights_only=False)

    def _reads(self, part: SavedPart, j: int, key: str, lo: int, hi: int) -> list:
        """(file, byte offset, dest offset, count, dtype) of elements [lo, hi) of section
        `key` of saved param j of `part`."""
        out = []
        for fname, off, d0, n in part.index.sources(j, lo, hi):
            blo, _ = part.index.byte_range(fname, key, off, n)
            out.append((part.fname(fname), blo, d0, n, part.index.dtype(key)))
        return out

    def _read_into(self, dest: torch.Tensor, i: int, key: str, lo: int, hi: int) -> None:
        """Plan the read of elements [lo, hi) of loader param i's section `key` into dest."""
        src = self.match[i]
        if not src.gather:
            part, j = src.parts[0]
            for fname, blo, d0, n, dt in self._reads(part, j, key, lo, hi):
                self.copies.append((dest, d0, fname, blo, n, dt))
            return
        self.gathers.append((dest, i, key, lo, hi))
        if (i, key) not in self.gather_reads:
            n = _numel(src.local)
            self.gather_reads[(i, key)] = [self._reads(part, j, key, 0, n)
                                           for part, j in src.parts]

    def _full(self, i: int, key: str) -> torch.Tensor:
        """Loader param i's section `key`, flat in its own (local) coordinates, put together
        from the saved tp parts (parts.py [Note: a checkpoint in parts])."""
        src, path = self.match[i], self.files.path
        pieces = []
        for part_reads in self.gather_reads[(i, key)]:
            t = None
            for fname, blo, d0, n, dt in part_reads:
                if t is None:
                    t = torch.empty(_numel(src.local), dtype=dt)
                t[d0:d0 + n].copy_(as_tensor(read_span(path(fname), blo, n * dt.itemsize), dt))
            pieces.append(t.view(src.local))
        full = torch.cat(pieces, dim=src.shard) if len(pieces) > 1 else pieces[0]
        if src.out is not None:
            d, n, r = src.out
            full = torch.chunk(full, n, dim=d)[r]
        return full.reshape(-1)

    def _check_rule(self, part: SavedPart) -> None:
        """The saved state is this optimizer rule's (a checkpoint written before rules
        existed holds ZeroAdamW's sections)."""
        fn = os.path.join(part.dir, META)
        meta = part.meta
        saved = meta.get("rule", LEGACY_RULE)
        secs = tuple(meta.get("sections", legacy_sections()))
        groups, mine = meta.get("group_rules"), list(self.view.group_rules)
        # (another number of groups is a ModelMismatchError, _match_params)
        if groups is not None and len(groups) == len(mine) and list(groups) != mine:
            gi = next(i for i, (a, b) in enumerate(zip(groups, mine)) if a != b)
            raise CheckpointError(
                f"{fn}: param group {gi} holds the state of rule {groups[gi]!r} in the "
                f"checkpoint; here it is optimized by rule {mine[gi]!r} (saved {list(groups)}, "
                f"here {mine}): load it into an optimizer with the same rule per group, or "
                "load the model weights alone with zerokern.checkpoint.consolidate")
        if saved != self.view.rule or secs != tuple(self.view.sections):
            raise CheckpointError(
                f"{fn}: the checkpoint holds the optimizer state of rule {saved!r} (sections "
                f"{list(secs)}); this optimizer's rule is {self.view.rule!r} (sections "
                f"{list(self.view.sections)}): load it into the optimizer it was saved from, "
                "or load the model weights alone with zerokern.checkpoint.consolidate")

    def _match_params(self) -> List[_Source]:
        view, saved = self.view, self.saved
        fn = os.path.join(self.dir, META if len(saved.parts) == 1 else PARTS_META)
        for part in saved.parts:
            if len(part.meta["param_groups"]) != len(view.param_groups):
                raise ModelMismatchError(
                    f"{os.path.join(part.dir, META)}: {len(part.meta['param_groups'])} param "
                    f"groups saved, the optimizer has {len(view.param_groups)}")
        here = placements(view)
        tp = view.job.tp if view.job is not None else 0
        tp_size = view.job.tp_size if view.job is not None else 1
        match: List[_Source] = []
        missing = []
        for p in view.params:
            names = (p.name, *p.aliases)
            found = next((saved.by_name[n] for n in names if n in saved.by_name), None)
            if found is None and any(n in self.excluded for n in names):
                raise ModelMismatchError(
                    f"{fn}: param {p.name!r} was frozen when the checkpoint was saved with "
                    "exclude_frozen_parameters=True, so its values and optimizer state are not "
                    "in it; here it is trainable: freeze it (requires_grad=False) before "
                    "building the optimizer, or load a checkpoint saved with "
                    "exclude_frozen_parameters=False")
            if found is None:
                missing.append(p.name)
                match.append(_Source([]))
                continue
            part0, j0 = found[0]
            s = part0.meta["params"][j0]
            self.used.add(s["name"])
            lay = saved.layout.get(s["name"], {"shard": None, "shape": s["shape"]})
            want = here[p.name]
            if list(lay["shape"]) != list(want["shape"]):
                raise ModelMismatchError(f"{fn}: param {p.name!r} has shape "
                                         f"{tuple(lay['shape'])} in the checkpoint, "
                                         f"{tuple(want['shape'])} in the model")
            if s["group"] != p.group:
                raise ModelMismatchError(f"{fn}: param {p.name!r} is in param group "
                                         f"{s['group']} in the checkpoint, {p.group} here")
            saved_shard, mine = lay["shard"], want["shard"]
            if saved_shard is None and mine is None:
                match.append(_Source([found[0]]))
            elif saved_shard == mine and saved.tp_size == tp_size:  # the same tp layout
                src = next(((part, j) for part, j in found if part.tp == tp), None)
                if src is None:
                    raise CheckpointError(f"{fn}: param {p.name!r}: no part of tp rank {tp}")
                match.append(_Source([src]))
            else:  # another tp layout: the full tensor from the tp parts, then this chunk
                by_tp = sorted(found, key=lambda x: x[0].tp) if saved_shard is not None \
                    else [found[0]]
                if saved_shard is not None and [x[0].tp for x in by_tp] != \
                        list(range(saved.tp_size)):
                    raise CheckpointError(f"{fn}: param {p.name!r} is not in every tp part "
                                          f"(tp ranks {[x[0].tp for x in by_tp]})")
                local = tuple(by_tp[0][0].meta["params"][by_tp[0][1]]["shape"])
                match.append(_Source(by_tp, True, saved_shard, local,
                                     None if mine is None else (mine, tp_size, tp)))
        unused = []
        if self.local_cover:
            got = {id(m.parts[0][0].meta["params"][m.parts[0][1]]) for m in match if m.parts}
            unused = [q["name"] for q in self.meta["params"] if id(q) not in got]
        if missing or unused:
            if self.local_cover:  # one part, one job: the message of a plain checkpoint
                raise ModelMismatchError(
                    f"{fn}: the checkpoint holds another model: params not in the checkpoint: "
                    f"{missing[:8]}{' ...' if len(missing) > 8 else ''}; checkpoint params not "
                    f"optimized here: {unused[:8]}")
            raise missing_error(fn, missing, [])
        return match

    def _plan_steps(self) -> List[Tuple[torch.Tensor, int]]:
        out = []
        for c in self.view.steps:
            vals = {self._saved_param(i)["step"] for i in c.params}
            if len(vals) > 1:
                names = [self.view.params[i].name for i in c.params]
                raise CheckpointError(f"{os.path.join(self.dir, META)}: params {names} share "
                                      f"one step counter here but have steps {sorted(vals)} "
                                      "in the checkpoint")
            if vals:
                out.append((c.value, vals.pop()))
        return out

    def _saved_param(self, i: int) -> Dict[str, Any]:
        part, j = self.match[i].parts[0]
        return part.meta["params"][j]

    def _plan_groups(self) -> List[Dict[str, Any]]:
        """Each param group's saved hyperparameters: from the parts its params come from,
        which must agree (pipeline stages saved with other lr are not one group here)."""
        sources: Dict[int, Dict[str, SavedPart]] = defaultdict(dict)
        for i, p in enumerate(self.view.params):
            part = self.match[i].parts[0][0]
            sources[p.group].setdefault(part.name, part)
        out = []
        for gi, g in enumerate(self.view.param_groups):
            parts = list(sources[gi].values()) or [self.saved.parts[0]]
            saved = parts[0].meta["param_groups"][gi]
            for other in parts[1:]:
                if other.meta["param_groups"][gi] != saved:
                    raise CheckpointError(
                        f"{self.dir}: param group {gi} has other hyperparameters in part "
                        f"{other.name!r} ({other.meta['param_groups'][gi]}) than in part "
                        f"{parts[0].name!r} ({saved}); here they are one group")
            out.append({k: decode_value(v, g.get(k)) for k, v in saved.items()})
        return out

    def _plan_scaler(self) -> Optional[Dict[str, Any]]:
        saved, scaler = self.meta["loss_scaler"], self.view.scaler
        mine = scaler.state_dict()
        if saved.get("kind") != mine["kind"]:
            if self.meta["precision"] == self.view.precision:
                raise CheckpointError(
                    f"{os.path.join(self.dir, META)}: the checkpoint has a {saved.get('kind')} "
                    f"loss scaler, this optimizer a {mine['kind']} one at the same precision "
                    f"{self.view.precision!r}; build it with the same loss_scale")
            self.warning = ((self.warning + "; ") if self.warning else "") + (
                f"zerokern.checkpoint: saved at precision {self.meta['precision']!r} with a "
                f"{saved.get('kind')} loss scaler, loading at {self.view.precision!r} with a "
                f"{mine['kind']} one: the loss-scaler state is not loaded")
            return None
        state = {"kind": mine["kind"]}
        for k, t in mine.items():
            if isinstance(t, torch.Tensor):
                if k not in saved:
                    raise CheckpointError(f"{os.path.join(self.dir, META)}: loss_scaler has "
                                          f"no {k!r}")
                state[k] = torch.tensor(saved[k], dtype=t.dtype)
        return state

    def _plan_extras(self, extras) -> List[Tuple[torch.Tensor, torch.dtype, str, int, int]]:
        """(model tensor, saved dtype, file, byte offset, bytes) per buffer / frozen param."""
        fn = os.path.join(self.dir, META)
        saved, where = {}, {}
        for part in self.saved.parts:  # a buffer on several stages: the first part's
            for e in part.meta["extras"]:
                for n in [e["name"], *e["aliases"]]:
                    if n not in saved:
                        saved[n], where[n] = e, part
        out, used, kept = [], set(), []
        for name, aliases, t in extras:
            e = next((saved[n] for n in (name, *aliases) if n in saved), None)
            x = next((self.excluded[n] for n in (name, *aliases) if n in self.excluded), None)
            if e is None and x is not None:
                self._check_excluded(name, t, x)
                used.add(x["name"])
                kept.append((name, t, x))
                continue
            if e is None:
                raise ModelMismatchError(f"{fn}: the checkpoint holds another model: "
                                         f"buffer/frozen param {name!r} is not in it")
            if tuple(e["shape"]) != tuple(t.shape):
                raise ModelMismatchError(f"{fn}: {name!r} has shape {tuple(e['shape'])} in the "
                                         f"checkpoint, {tuple(t.shape)} in the model")
            dt = dtype_from_name(e["dtype"])
            if dt.is_floating_point != t.dtype.is_floating_point:
                raise ModelMismatchError(f"{fn}: {name!r} is {dt} in the checkpoint, "
                                         f"{t.dtype} in the model")
            used.add(e["name"])
            out.append((t, dt, where[e["name"]].fname(EXTRA), e["offset"],
                        t.numel() * dt.itemsize))
        self.used |= used
        unused = [e["name"] for e in self.meta["extras"] if e["name"] not in used]
        if unused and self.local_cover:
            raise ModelMismatchError(f"{fn}: the checkpoint holds another model: buffers/"
                                     f"frozen params not in the model: {unused[:8]}")
        gone = [e["name"] for e in self.meta.get("excluded_frozen", ()) if e["name"] not in used]
        if gone and self.local_cover:
            raise ModelMismatchError(f"{fn}: the checkpoint holds another model: frozen params "
                                     f"it left out (exclude_frozen_parameters=True) are not in "
                                     f"the model: {gone[:8]}")
        if kept and self.strict:
            names = [n for n, _, _ in kept]
            raise ModelMismatchError(
                f"{fn}: the checkpoint was saved with exclude_frozen_parameters=True and holds "
                f"no values for the frozen params {names[:8]}{' ...' if len(names) > 8 else ''}"
                f" ({len(names)}); load it with strict=False (engine.load_checkpoint(..., "
                "load_module_strict=False), as DeepSpeed needs too) to keep the model's current "
                "values for them")
        differ = [n for n, t, x in kept
                  if dtype_name(t.dtype) != x["dtype"] or fingerprint(t) != x["crc32"]]
        if differ:
            self.warning = ((self.warning + "; ") if self.warning else "") + (
                f"zerokern.checkpoint: {len(differ)} frozen param(s) that the checkpoint left "
                f"out (exclude_frozen_parameters=True) differ here from their values at save "
                f"(crc32 or dtype): {differ[:8]}{' ...' if len(differ) > 8 else ''}; they keep "
                "the model's current values (as DeepSpeed does)")
        return out

    def _check_excluded(self, name: str, t: torch.Tensor, x: Dict[str, Any]) -> None:
        """A model tensor whose values the checkpoint left out: still a frozen param, of the
        saved shape (it keeps its values; nothing else would give it any)."""
        fn = os.path.join(self.dir, META)
        if not is_frozen_param(t):
            what = ("a trainable param not held by the optimizer"
                    if isinstance(t, nn.Parameter) else "a buffer")
            raise ModelMismatchError(
                f"{fn}: {name!r} was a frozen param left out of the checkpoint "
                f"(exclude_frozen_parameters=True); here it is {what}, which needs values the "
                "checkpoint does not hold")
        if tuple(x["shape"]) != tuple(t.shape):
            raise ModelMismatchError(
                f"{fn}: frozen param {name!r} was left out of the checkpoint "
                f"(exclude_frozen_parameters=True) with shape {tuple(x['shape'])}; the model's "
                f"has shape {tuple(t.shape)}")

    # ---- phase 2 ------------------------------------------------------------------------------
    @torch.no_grad()
    def apply(self) -> None:
        path = self.files.path
        for dest, d0, fname, lo, n, dt in self.copies:
            src = as_tensor(read_span(path(fname), lo, n * dt.itemsize), dt)
            dest[d0:d0 + n].copy_(src)  # a cast for 16-bit params: round to nearest even
            del src
        for rebuild in self.view.after_load:  # per-block states (block_states.py)
            rebuild()
        full: Dict[Tuple[int, str], torch.Tensor] = {}  # one at a time (sorted by param)
        for dest, i, key, lo, hi in self.gathers:
            if (i, key) not in full:
                full.clear()
                full[(i, key)] = self._full(i, key)
            dest.copy_(full[(i, key)][lo:hi])
        full.clear()
        for dest, master in self.casts:
            dest.copy_(master)  # round to nearest even, as the optimizer's cast-back
        for t, dt, fname, lo, nbytes in self.extras:
            if nbytes:
                src = as_tensor(read_span(path(fname), lo, nbytes), dt).reshape(t.shape)
                t.detach().copy_(src)
        for counter, v in self.steps:
            counter.fill_(v)
        for g, saved in zip(self.view.param_groups, self.groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        if self.scaler_state is not None:
            self.view.scaler.load_state_dict(self.scaler_state)

