"""`save(path, model, opt)`: every rank writes its share; rank 0 writes metadata and commits.

[Note: atomic replace]
1. Rank 0 creates `<path>.tmp-<nonce>/` (nonce shared with every rank).
2. Each rank writes and fsyncs `rankNNNNN.bin` (rank 0 also `extra.bin`); they send rank 0
   their segment index and block checksums.
3. Rank 0 writes `meta.json` last and fsyncs it and the directory: the tmp directory is now a
   complete checkpoint.
4. Commit. No previous checkpoint: `rename(tmp, path)`. Otherwise `renameat2(tmp, path,
   RENAME_EXCHANGE)` swaps the two directories in one atomic step (Linux >= 3.15 on ext4, xfs,
   btrfs, tmpfs), and the old one, now at the tmp name, is deleted. At every instant `path`
   is either the complete old or the complete new checkpoint.
   Fallback where the exchange is unsupported (other OS/filesystems): rename `path` to
   `<path>.old-<nonce>`, then `tmp` to `path`, then delete the backup. A crash between the two
   renames leaves no `path`; `load` and `consolidate` then read the backup, with a warning
   (format.find_checkpoint), and the next save deletes it.
   A `latest` pointer file would also work but makes `path` something other than a checkpoint
   directory; the exchange keeps `path` itself the checkpoint.
5. Every rank learns the outcome (`Collective.agree`): all return or all raise.
A job of several parts (pipeline stages, tp ranks: parts.py [Note: a checkpoint in parts])
writes each part into `tmp/<part>/` (its dp rank 0 writes the part's metadata), and job rank 0
writes `tmp/parts.json` before the commit: one exchange replaces every part at once.
"Rank" here is the rank in the job (every data-parallel rank, and every stage and tp rank of a
model-parallel job, agrees); the rank files are named by the shard rank, and with HSDP
replicas (comm/groups.py) only replica 0 of each shard writes one: the others hold the same
shard.
A crash before step 4 leaves the previous checkpoint untouched plus a stale tmp directory,
which the next successful save to the same path deletes.
"""

from __future__ import annotations

import ctypes
import errno
import io
import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from zerokern.version import __version__

from .collective import Collective
from .format import (
    BLOCK_BYTES,
    CLIENT,
    EXTRA,
    EXTRA_ALIGN,
    FORMAT,
    META,
    PARTS_META,
    VERSION,
    CheckpointError,
    DataFile,
    dtype_name,
    encode_value,
    fingerprint,
    is_checkpoint_dir,
    rank_file,
    write_meta,
)
from .parts import check_extras, check_parts, placements, write_parts_meta
from .views import (
    OptimizerView,
    is_frozen_param,
    model_extras,
    model_items,
    optimizer_view,
    whole_frozen_params,
)

# Test hooks (tests/checkpoint/test_checkpoint.py): pause at a point of the save, so a test can kill
# the writer there ("files_written": rank files done, no metadata yet; "old_moved": between
# the two renames of the fallback), and force the fallback commit.
PAUSE_ENV = "ZEROKERN_CHECKPOINT_TEST_PAUSE"  # "<point>=<seconds>"
NO_EXCHANGE_ENV = "ZEROKERN_CHECKPOINT_NO_EXCHANGE"  # "1": commit with two renames


def _pause(point: str) -> None:
    spec = os.environ.get(PAUSE_ENV, "")
    name, _, secs = spec.partition("=")
    if name == point:
        print(f"zerokern.checkpoint: paused at {point}", file=sys.stderr, flush=True)
        time.sleep(float(secs))


def check_path(path) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not path:
        raise ValueError("path must not be empty")
    return os.path.abspath(path)


def save_now(path, model: nn.Module, opt, exclude_frozen_parameters: bool = False,
             client_state: Optional[Dict[str, Any]] = None,
             on_commit: Optional[Callable[[], None]] = None) -> str:
    """The synchronous save (saving.py `save` checked the arguments and waited for a pending
    async save): the collective start, then write and commit; the path written."""
    # stage 3 (collective): the frozen params stay whole until they are written (the job's
    # extras are views of them; written after the gather is released they were the freed
    # buffers' bytes: a stage-3 checkpoint without its frozen values, caught by
    # tests/engine/test_exclude_frozen.py)
    with whole_frozen_params(opt):
        job = prepare(path, model, opt, exclude_frozen_parameters, client_state)
        job.on_commit = on_commit
        return write_and_commit(job)


@dataclass
class SaveJob:
    """A save after its collective start (`prepare`): the tmp directory exists, and what
    `write_and_commit` writes is fixed. An async save stages copies into it (async_save.py)."""

    top: str  # the path returned, and committed
    path: str  # this rank's part's checkpoint directory (top itself for a job of one part)
    tmp: str  # top's tmp directory (the whole job's)
    nonce: str
    view: OptimizerView
    extras: List[Tuple[str, Tuple[str, ...], torch.Tensor]]  # written to extra.bin
    excluded: List[Dict[str, Any]]  # frozen params left out (crc of their values at save)
    keys: List[str]  # model.state_dict() keys
    client: Optional[bytes]  # torch.save of client_state (first part's lead only)
    coll: Collective  # over the job (every rank of every part)
    lead: bool  # this part's dp rank 0: extras and metadata
    # lead, after the commit, inside the agreement (engine: its `latest` file)
    on_commit: Optional[Callable[[], None]] = None
    error: Optional[BaseException] = None  # failed before writing: joins the agreement as such
    part: str = ""  # parts.py [Note: a checkpoint in parts]: this rank's part directory
    parts_meta: Optional[Dict[str, Any]] = None  # parts.json (job of several parts)

    @property
    def part_tmp(self) -> str:
        """Where this rank writes its files."""
        return os.path.join(self.tmp, self.part) if self.part else self.tmp

    @property
    def committer(self) -> bool:
        """Job rank 0: creates the tmp directory, writes parts.json, commits."""
        return self.coll.rank == 0


def prepare(path, model: nn.Module, opt, exclude_frozen: bool = False,
            client_state: Optional[Dict[str, Any]] = None) -> SaveJob:
    """Steps 1 of [Note: atomic replace] (collective): checks, the shared nonce, the tmp dir."""
    skip = getattr(opt, "_frozen_skip", None)  # params frozen mid-training (frozen_slots.py)
    if skip is not None:
        skip.check_savable("zerokern.checkpoint.save")
    top = check_path(path)
    view = optimizer_view(model, opt)
    job = view.job
    if not job.complete:  # every rank of this dp group alike: no collective waits on it
        raise ValueError(
            f"opt: its data-parallel group ({view.world_world_size} ranks) is not the whole "
            f"job ({dist.get_world_size()} ranks) and it knows no pipeline stages: the other "
            "ranks' stages would write the same files. Build each stage's ZeroAdamW with "
            "mesh=world_mesh (the mesh with its 'pp' dim, comm/mesh.py [Note: a world mesh]) "
            "so the checkpoint holds every stage; nothing was written")
    extras = model_extras(model, view)
    check_extras(view, extras)
    # exclude_frozen_parameters: frozen params listed in the metadata, their values not written
    excluded = [x for x in extras if exclude_frozen and is_frozen_param(x[2])]
    extras = [x for x in extras if not (exclude_frozen and is_frozen_param(x[2]))]
    coll = Collective(view.world_group, view.world_rank, view.world_world_size)
    lead = view.lead  # this part's extras and metadata

    described = coll.all_gather({"path": top, "part": job.part, "pp": job.pp, "tp": job.tp,
                                 "pp_size": job.pp_size, "tp_size": job.tp_size,
                                 "placements": placements(view) if lead else None})
    paths = [d["path"] for d in described]
    if len(set(paths)) != 1:
        raise ValueError(f"path must be the same on every rank, got {paths}")
    parts_meta = check_parts(described) if job.model_parallel else None  # ValueError
    nonce = coll.from_rank0(secrets.token_hex(6))
    tmp = f"{top}.tmp-{nonce}"
    err: Optional[BaseException] = None
    client = None
    first = parts_meta["parts"][0]["dir"] if parts_meta else ""
    if lead and job.part == first:
        try:
            if client_state is not None:
                buf = io.BytesIO()
                torch.save(client_state, buf)
                client = buf.getvalue()
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            err = e
    if coll.rank == 0:
        try:
            _preflight(top)
            os.makedirs(tmp)
            for p in (parts_meta or {}).get("parts", ()):
                os.makedirs(os.path.join(tmp, p["dir"]))
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            err = err or e
    coll.agree(err)
    part_path = os.path.join(top, job.part) if job.part else top
    return SaveJob(top, part_path, tmp, nonce, view, extras,
                   [{"name": name, "aliases": list(aliases), "shape": list(t.shape),
                     "dtype": dtype_name(t.dtype), "crc32": fingerprint(t)}
                    for name, aliases, t in excluded] if lead else [],
                   list(dict.fromkeys(k for k, _ in model_items(model))), client, coll, lead,
                   part=job.part, parts_meta=parts_meta)


def write_and_commit(job: SaveJob) -> str:
    """Steps 2-5 of [Note: atomic replace] (collective over `job.coll`, the whole job)."""
    view, tmp, coll, lead = job.view, job.part_tmp, job.coll, job.lead
    try:
        if job.error is not None:
            raise job.error
        # HSDP: a replica other than 0 holds the same shard as replica 0 and writes nothing
        info: Any = _write_rank(tmp, view) if view.writes else {"replica": True}
        if lead:
            info["extra"] = _write_extras(tmp, job.extras)
            info["excluded"] = job.excluded
            if job.client is not None:
                f = DataFile(os.path.join(tmp, CLIENT))
                f.write(torch.frombuffer(bytearray(job.client), dtype=torch.uint8))
                info["client"] = f.close()
        info["part"] = job.part
        _pause("files_written")
    except Exception as e:  # noqa: BLE001
        info = e
    # a rank that failed sends its reason: the others' error names it (ENOSPC on rank 1)
    infos = coll.all_gather({"failed": f"{type(info).__name__}: {info}"}
                            if isinstance(info, BaseException) else info)
    failed = {r: x["failed"] for r, x in enumerate(infos) if "failed" in x}
    err = info if isinstance(info, BaseException) else None
    part_err: Optional[BaseException] = None
    if lead and not failed:  # this part's metadata, from its ranks' infos
        try:
            mine = [x for x in infos if x.get("part") == job.part]
            files = [x for x in mine if "segments" in x]
            own = next(x for x in mine if "extra" in x)  # the lead's
            meta = _metadata(view, job.keys, job.extras, files, own["extra"], own["excluded"])
            if "client" in own:
                meta["files"][CLIENT] = own["client"]
            if job.part:
                meta["part"] = {"dir": job.part, "pp": view.job.pp, "tp": view.job.tp}
            write_meta(tmp, meta)
            _fsync_dir(tmp)
        except Exception as e:  # noqa: BLE001
            part_err = e
    if job.parts_meta is not None:  # every part's lead says how its metadata went
        outcome = coll.all_gather(None if part_err is None else
                                  f"{type(part_err).__name__}: {part_err}")
        failed.update({r: m for r, m in enumerate(outcome) if m is not None})
    elif part_err is not None:
        failed[coll.rank] = f"{type(part_err).__name__}: {part_err}"
    if job.committer:
        try:
            if failed:
                shutil.rmtree(job.tmp, ignore_errors=True)
                why = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
                raise CheckpointError(f"{job.top}: rank(s) {sorted(failed)} failed to write "
                                      f"their part ({why}); the previous checkpoint is intact")
            if job.parts_meta is not None:
                write_parts_meta(job.tmp, job.parts_meta)
                _fsync_dir(job.tmp)
            _commit(job.tmp, job.top, job.nonce)
            if job.on_commit is not None:
                job.on_commit()
        except Exception as e:  # noqa: BLE001
            if err is None:
                err = part_err or e
            shutil.rmtree(job.tmp, ignore_errors=True)
    elif err is None and part_err is not None:
        err = part_err
    coll.agree(err)
    return job.top


def _preflight(path: str) -> None:
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise ValueError(f"path {path} exists and is not a directory")
        if not is_checkpoint_dir(path):
            raise ValueError(f"path {path} exists and is not a zerokern checkpoint (no {META} "
                             f"or {PARTS_META}); refusing to replace it")
    os.makedirs(os.path.dirname(path), exist_ok=True)


def _write_rank(tmp: str, view: OptimizerView) -> Dict[str, Any]:
    """This rank's file: one section per state tensor (view.sections: the master, then the
    rule's states), each the `owned` pieces in order."""
    f = DataFile(os.path.join(tmp, rank_file(view.rank)))
    segments, elem = [], 0
    for p in view.owned:
        segments.append([p.param, p.lo, p.hi, elem])
        elem += p.hi - p.lo
    sections, sparse = {}, {}
    for key in view.sections:
        sections[key] = f.nbytes
        at, offs = 0, []
        for p in view.owned:  # a piece whose rule has no such state: not written
            t = p.tensors().get(key)
            offs.append(-1 if t is None else at)
            if t is not None:
                f.write(t)
                at += p.hi - p.lo
        if any(o != seg[3] for o, seg in zip(offs, segments)):
            sparse[key] = offs  # format.py [Note: sparse sections]
    matrix = []  # format.py [Note: per-matrix states]: the states this rank owns, whole
    for j, name, t in view.matrix:
        matrix.append([j, name, f.nbytes, list(t.shape)])
        f.write(t)
    out = f.close()
    # Step counts, read on the host once per counter (a checkpoint may sync; a step may not).
    steps: Dict[int, int] = {}
    for c in view.steps:
        v = int(c.value)
        for i in c.params:
            if steps.setdefault(i, v) != v:
                raise CheckpointError(f"param {view.params[i].name!r} is governed by step "
                                      f"counters holding {steps[i]} and {v}")
    info = {"rank": view.rank, "segments": segments, "sections": sections, "steps": steps,
            **out}
    if sparse:
        info["section_offsets"] = sparse
    if matrix:
        info["matrix"] = matrix
    return info


def _write_extras(tmp: str, extras) -> Dict[str, Any]:
    f = DataFile(os.path.join(tmp, EXTRA))
    index = []
    for name, aliases, t in extras:
        f.pad_to(EXTRA_ALIGN)
        index.append({"name": name, "aliases": list(aliases), "shape": list(t.shape),
                      "dtype": dtype_name(t.dtype), "offset": f.nbytes,
                      "param": isinstance(t, nn.Parameter)})
        f.write(t)
    return {"index": index, **f.close()}


def _metadata(view: OptimizerView, keys: List[str], extras, infos: List[Dict[str, Any]],
              extra: Dict[str, Any], excluded: List[Dict[str, Any]]):
    """infos: the rank files' (one per shard); extra: the lead's extras file; excluded: the
    frozen params left out (exclude_frozen_parameters), values not written."""
    steps: Dict[int, int] = {}
    for info in infos:
        for i, v in info["steps"].items():
            if steps.setdefault(int(i), v) != v:
                raise CheckpointError(f"param {view.params[int(i)].name!r} has step {v} on "
                                      f"rank {info['rank']} and {steps[int(i)]} on another")
    params = [{"name": p.name, "aliases": list(p.aliases), "shape": list(p.shape),
               "dtype": dtype_name(view.dtype), "group": p.group, "step": steps.get(i, 0)}
              for i, p in enumerate(view.params)]
    _check_cover(view, infos)
    files = {rank_file(x["rank"]): {k: x[k] for k in ("rank", "bytes", "blocks", "segments",
                                                      "sections", "section_offsets",
                                                      "matrix")
                                    if k in x} for x in infos}
    files[EXTRA] = {"bytes": extra["bytes"], "blocks": extra["blocks"]}
    groups = [{k: encode_value(v, f"param_groups[{gi}][{k!r}]") for k, v in g.items()
               if k != "params"} for gi, g in enumerate(view.param_groups)]
    scaler = {k: (v.item() if isinstance(v, torch.Tensor) else v)
              for k, v in view.scaler.state_dict().items()}
    return {
        "format": FORMAT, "version": VERSION, "block_bytes": BLOCK_BYTES,
        "zerokern_version": __version__, "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "world_size": view.world_size, "stage": view.stage, "precision": view.precision,
        "param_dtype": dtype_name(view.dtype), "state_dtype": "float32",
        "rule": view.rule, "sections": list(view.sections),
        "section_dtypes": view.section_dtypes,
        "group_rules": list(view.group_rules),
        "params": params, "layout": view.layout, "param_groups": groups,
        "loss_scaler": scaler, "extras": extra["index"], "files": files,
        "excluded_frozen": excluded,
        "state_dict_keys": list(keys),
    }


def _check_cover(view: OptimizerView, infos) -> None:
    """The segments of all ranks cover every param exactly once, and each per-matrix state is
    in one rank file (guards the adapter)."""
    owners: Dict[tuple, int] = {}
    for x in infos:
        for j, name, _, _ in x.get("matrix", ()):
            if owners.setdefault((j, name), x["rank"]) != x["rank"]:
                raise CheckpointError(f"internal: per-matrix state {name!r} of param "
                                      f"{view.params[j].name!r} saved by two ranks")
    by_param: Dict[int, list] = {}
    for x in infos:
        for i, lo, hi, _ in x["segments"]:
            by_param.setdefault(i, []).append((lo, hi))
    for i, p in enumerate(view.params):
        at = 0
        for lo, hi in sorted(by_param.get(i, [])):
            if lo != at:
                break
            at = hi
        if at != p.numel or sum(hi - lo for lo, hi in by_param.get(i, [])) != p.numel:
            raise CheckpointError(f"internal: the ranks' shards do not cover param {p.name!r} "
                                  "exactly once")


# ---- commit --------------------------------------------------------------------------------------
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swap directories a and b (renameat2 RENAME_EXCHANGE); False if unsupported."""
    if os.environ.get(NO_EXCHANGE_ENV) == "1" or not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False  # glibc < 2.28
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(e, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(e)}")


def _commit(tmp: str, path: str, nonce: str) -> None:
    parent, base = os.path.split(path)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        _fsync_dir(parent)
        shutil.rmtree(tmp)  # the previous checkpoint, swapped out
    else:
        old = f"{path}.old-{nonce}"
        os.rename(path, old)
        _fsync_dir(parent)
        _pause("old_moved")
        os.rename(tmp, path)
        _fsync_dir(parent)
        shutil.rmtree(old)
    _fsync_dir(parent)
    for s in os.listdir(parent):  # leftovers of interrupted saves to this path
        if s.startswith((base + ".tmp-", base + ".old-")):
            shutil.rmtree(os.path.join(parent, s), ignore_errors=True)


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
