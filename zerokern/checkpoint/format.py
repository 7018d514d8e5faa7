"""The checkpoint directory format: names, the metadata file, checksums, errors, raw reads.

[Note: checkpoint format, version 1]
A checkpoint is a directory:

    meta.json          JSON body + a last line "#crc32=XXXXXXXX" over the body's bytes
    rank00000.bin      rank 0's share of the optimizer state (raw little-endian; fp32, or
                       uint8 codes per "section_dtypes" (8-bit AdamW, block_states.py))
    rank00001.bin      ...one file per rank of the saving job
    extra.bin          model tensors the optimizer does not hold (buffers, frozen params)
    client_state.pt    only with save(client_state=...): rank 0's dict (torch.save), listed in
                       "files" with its block crcs like the others (the train job's step, RNG
                       and loss curve, the engine's counters), so it commits with the rest

[Note: excluded frozen params]
Saved with `exclude_frozen_parameters=True` (DeepSpeed's LoRA checkpoints), the frozen params
(Parameters with requires_grad=False that the optimizer does not hold) are not in extra.bin:
the metadata's "excluded_frozen" lists each (name, aliases, shape, dtype, crc32 of its bytes at
save, `fingerprint`). A load keeps the model's own values for them only when asked to
(`strict=False`, DeepSpeed's load_module_strict=False), after checking that the model still has
them, frozen, with the saved shapes (a ModelMismatchError naming the param otherwise), and warns
where their values differ from the saved crc; `consolidate` leaves them out and warns. A
checkpoint without the key (written before it existed) excluded nothing.

A rank file has one section per state tensor, `master` then the optimizer rule's states in its
order (zerokern.rules; the on-disk names are the rule's: see `sections(rule)` and
`legacy_sections()`),
named in the metadata with the rule (`"rule"`, `"sections"`), each the concatenation of
the same segments in the same order. A segment is one contiguous element range [lo, hi) of one
flattened param, listed in the metadata as `[param, lo, hi, elem_off]` (elem_off: where it
starts inside each section). The segments of all rank files cover every param exactly once,
so the total is one copy of the state at any stage (at stage 0 rank r writes the canonical
r-th piece of every bucket). A loader at any world size and stage maps its own element ranges
onto segments and reads just those bytes: no conversion step.

[Note: sparse sections]
With a rule per param group (ZeroMuon: Muon's one momentum state, AdamW's two moments) the
sections are the union of the rules' states (`sections(MixedRules)`), and a
segment is written only into the sections of its param group's rule: no zeros for the states
a param does not have. Such a section's segments then start elsewhere than `elem_off`: the rank
file lists them in `section_offsets[name]` (one per segment, -1 where the segment has none).
The metadata names each param group's rule (`group_rules`); a load checks them group by group,
so one rule's state is never read into another's group. Sections of one-rule checkpoints are
dense, as before (no `section_offsets`).

[Note: per-matrix states]
A rule's per-matrix states (zerokern.rules [Note: state kinds and the owner protocol]:
Adafactor's row_var, col_var, variance, step) are whole per param, on its owner: the owner's
rank file holds each after its sections, listed in its "matrix" as `[param, state name, byte
offset, shape]` (fp32). A loader at any world size and stage reads, for each param it owns
there, its states from whichever file holds them (`SavedIndex.matrix_source`): the owners of
the saving job do not matter.

Checksums: crc32 per BLOCK_BYTES block of every data file (zlib.crc32, 3.7 GB/s measured on
this 2-core host, vs 0.8 GB/s blake2b), so a reader verifies exactly the blocks it touches
(at most one block of slack at each end of a range) without reading whole files. The list of
block crcs is the file's checksum; `verify()` checks every block of every file.
The metadata carries its own crc in its last line, so a flipped byte there is caught before
anything in it is trusted.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

FORMAT = "zerokern-checkpoint"
VERSION = 1
META = "meta.json"
EXTRA = "extra.bin"
PARTS_META = "parts.json"  # a checkpoint in parts (parts.py [Note: a checkpoint in parts])
LEGACY_TP_META = "tp.json"  # its tp-only predecessor (each tp part committed on its own)
CLIENT = "client_state.pt"  # save(client_state=...): torch.save bytes, rank 0's, checksummed
# A checkpoint without a "rule" entry (written before rules existed) holds ZeroAdamW's
# sections (`legacy_sections()`); every other one names its rule and sections (`sections`).
LEGACY_RULE = "adamw"


def sections(rule) -> tuple:
    """A rule's sections in file order: the fp32 master, then its states."""
    return ("master", *rule.state_names)


def section_dtypes(rule) -> dict:
    """Section -> dtype name of its elements: fp32, or uint8 codes (8-bit AdamW); a per-block
    state is stored expanded, one element per param element (block_states.py)."""
    return {"master": "float32", **{s.name: dtype_name(s.dtype) for s in rule.states}}


def legacy_sections() -> tuple:
    """The sections of a checkpoint written before rules existed: the AdamW rule's."""
    from zerokern.rules.registry import rule_by_name

    return sections(rule_by_name(LEGACY_RULE))


# 1 MiB: a load touches at most 2 MiB more than it needs per contiguous range, and a 1.3 GB
# state needs 1300 crcs (10 kB of JSON).
BLOCK_BYTES = 1 << 20
EXTRA_ALIGN = 64  # bytes; every extra tensor starts aligned, so raw views are aligned too


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.bin"


# ---- errors --------------------------------------------------------------------------------------
class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file or the param."""


class ChecksumError(CheckpointError):
    """Bytes on disk do not match the checksum recorded when they were written."""


class MissingFileError(FileNotFoundError, CheckpointError):
    """A file of the checkpoint (or the checkpoint itself) does not exist."""


class VersionError(CheckpointError):
    """The checkpoint was written in a format version this zerokern does not read."""


class ModelMismatchError(CheckpointError):
    """The checkpoint holds another model: names, shapes or param groups differ."""


# ---- dtypes and hyperparameters ------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"{META}: unknown dtype {name!r}")
    return dt


def encode_value(v: Any, where: str) -> Any:
    """A param_group value as JSON: tuples and 0-d tensors are tagged so they come back as such."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tuple):
        return {"__tuple__": [encode_value(x, where) for x in v]}
    if isinstance(v, list):
        return [encode_value(x, where) for x in v]
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return {"__tensor__": v.item(), "dtype": dtype_name(v.dtype), "shape": list(v.shape)}
    raise TypeError(f"{where} = {v!r} cannot be stored in a checkpoint (allowed: numbers, "
                    "strings, None, tuples/lists of those, one-element tensors)")


def decode_value(v: Any, like: Any = None) -> Any:
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if isinstance(v, dict) and "__tuple__" in v:
        return tuple(decode_value(x) for x in v["__tuple__"])
    if isinstance(v, dict) and "__tensor__" in v:
        dev = like.device if isinstance(like, torch.Tensor) else "cpu"
        return torch.tensor(v["__tensor__"], dtype=dtype_from_name(v["dtype"]),
                            device=dev).reshape(v["shape"])
    return v


# ---- metadata ------------------------------------------------------------------------------------
def write_meta(dirpath: str, body: Dict[str, Any]) -> None:
    """Write meta.json (body + crc line) and fsync it."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    with open(os.path.join(dirpath, META), "wb") as f:
        f.write(text)
        f.write(b"\n#crc32=%08x\n" % zlib.crc32(text))
        f.flush()
        os.fsync(f.fileno())


def read_meta(dirpath: str) -> Dict[str, Any]:
    """Read and check meta.json: its crc, then the format name and version."""
    fn = os.path.join(dirpath, META)
    try:
        with open(fn, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise MissingFileError(f"{fn}: no such file; {dirpath} is not a zerokern "
                               "checkpoint") from None
    body, sep, trailer = raw.rstrip(b"\n").rpartition(b"\n#crc32=")
    try:
        ok = bool(sep) and int(trailer, 16) == zlib.crc32(body)
    except ValueError:
        ok = False
    if not ok:
        raise ChecksumError(f"{fn}: checksum mismatch (the metadata file is corrupt or "
                            "truncated)")
    meta = json.loads(body)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{fn}: not a zerokern checkpoint (format "
                              f"{meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version") != VERSION:
        raise VersionError(f"{fn}: unknown checkpoint format version {meta.get('version')!r}; "
                           f"this zerokern reads version {VERSION} (upgrade zerokern)")
    return meta


# ---- checksums -----------------------------------------------------------------------------------
class BlockCrc:
    """Running crc32 of each BLOCK_BYTES block of a byte stream."""

    def __init__(self, block: int = BLOCK_BYTES) -> None:
        self.block, self.crcs, self.nbytes = block, [], 0
        self._crc, self._fill = 0, 0

    def update(self, data) -> None:
        mv = memoryview(data).cast("B")
        i, n = 0, len(mv)
        while i < n:
            take = min(n - i, self.block - self._fill)
            self._crc = zlib.crc32(mv[i:i + take], self._crc)
            self._fill += take
            i += take
            if self._fill == self.block:
                self.crcs.append(self._crc)
                self._crc, self._fill = 0, 0
        self.nbytes += n

    def finish(self) -> List[int]:
        if self._fill:
            self.crcs.append(self._crc)
            self._crc, self._fill = 0, 0
        return self.crcs


class DataFile:
    """A data file being written: raw bytes, block crcs as they pass, fsync on close."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._f = open(path, "wb")
        self._crc = BlockCrc()

    @property
    def nbytes(self) -> int:
        return self._crc.nbytes

    def write(self, t: torch.Tensor) -> None:
        b = tensor_bytes(t)
        self._f.write(b)
        self._crc.update(b)

    def pad_to(self, align: int) -> None:
        n = -self.nbytes % align
        if n:
            z = bytes(n)
            self._f.write(z)
            self._crc.update(z)

    def close(self) -> Dict[str, Any]:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return {"bytes": self.nbytes, "blocks": self._crc.finish()}


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of t (host copy only if it lives on a device), as a uint8 array."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def fingerprint(t: torch.Tensor) -> int:
    """crc32 of t's raw bytes, read 64 MiB at a time (one host copy of that much at most): how a
    frozen param left out of a checkpoint (exclude_frozen_parameters) is recognised at load."""
    flat = t.detach().reshape(-1)
    step = max(1, (64 << 20) // max(flat.element_size(), 1))
    crc = 0
    for i in range(0, flat.numel(), step):
        crc = zlib.crc32(tensor_bytes(flat[i:i + step]), crc)
    return crc


# ---- reads ---------------------------------------------------------------------------------------
def read_span(path: str, offset: int, nbytes: int) -> np.ndarray:
    """Bytes [offset, offset + nbytes) of a file, memory-mapped (nothing else is read).

    mode "c" (a private mapping): torch.from_numpy needs a writable array, and private pages
    cost nothing until written (never, here). The mapping is dropped with the array, so the
    pages a long load touches do not pile up in the process's resident set.
    """
    return np.memmap(path, dtype=np.uint8, mode="c", offset=offset, shape=(nbytes,))


def as_tensor(span: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(span).view(dtype)


class BlockVerifier:
    """Checks the recorded crc of each block a reader touches, once per block."""

    SPAN = 64 << 20  # map at most 64 MiB at a time while checking (bounded resident set)

    def __init__(self, dirpath: str, files: Dict[str, Dict[str, Any]],
                 block: int = BLOCK_BYTES) -> None:
        self.dirpath, self.files, self.block = dirpath, files, block
        self._done: Dict[str, set] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.dirpath, name)

    def check_present(self, name: str) -> None:
        fn, info = self.path(name), self.files.get(name)
        if info is None:
            raise CheckpointError(f"{os.path.join(self.dirpath, META)}: no entry for {name}")
        try:
            size = os.path.getsize(fn)
        except FileNotFoundError:
            raise MissingFileError(f"{fn}: missing (the checkpoint lists it, "
                                   f"{info['bytes']} bytes)") from None
        if size != info["bytes"]:
            raise ChecksumError(f"{fn}: size {size} bytes, the checkpoint recorded "
                                f"{info['bytes']} (truncated or overwritten)")

    def verify(self, name: str, ranges: Iterable[Tuple[int, int]]) -> None:
        """Verify every block overlapping the byte ranges [lo, hi) of file `name`."""
        blocks = set()
        for lo, hi in ranges:
            if hi > lo:
                blocks.update(range(lo // self.block, (hi - 1) // self.block + 1))
        self._verify_blocks(name, sorted(blocks - self._done.setdefault(name, set())))

    def verify_all(self, name: str) -> None:
        self.check_present(name)
        self.verify(name, [(0, self.files[name]["bytes"])])

    def _verify_blocks(self, name: str, blocks: Sequence[int]) -> None:
        if not blocks:
            return
        info, fn, B = self.files[name], self.path(name), self.block
        crcs, size = info["blocks"], info["bytes"]
        if len(crcs) != -(-size // B):
            raise ChecksumError(f"{fn}: the metadata lists {len(crcs)} block checksums for "
                                f"{size} bytes")
        runs: List[List[int]] = []
        for b in blocks:  # consecutive blocks map together, up to SPAN bytes
            if runs and b == runs[-1][-1] + 1 and len(runs[-1]) * B < self.SPAN:
                runs[-1].append(b)
            else:
                runs.append([b])
        for run in runs:
            lo, hi = run[0] * B, min((run[-1] + 1) * B, size)
            span = read_span(fn, lo, hi - lo)
            for b in run:
                a = b * B - lo
                if zlib.crc32(span[a:a + B]) != crcs[b]:
                    raise ChecksumError(f"{fn}: checksum mismatch in bytes [{b * B}, "
                                        f"{min((b + 1) * B, size)}) (block {b}); the file "
                                        "is corrupt")
            del span
            self._done[name].update(run)


def is_checkpoint_dir(path: str) -> bool:
    """`path` holds a zerokern checkpoint's top-level marker: meta.json (one part),
    parts.json, or a legacy tp.json."""
    return any(os.path.isfile(os.path.join(path, m)) for m in (META, PARTS_META, LEGACY_TP_META))


def find_checkpoint(path: str) -> Tuple[str, Optional[str]]:
    """The directory to read for `path`, and a warning if it is a recovered backup.

    See writer.py [Note: atomic replace]: only the fallback (two renames) can leave `path`
    missing with the previous checkpoint at `<path>.old-<nonce>`.
    """
    if is_checkpoint_dir(path):
        return path, None
    if os.path.isdir(path):
        raise MissingFileError(f"{os.path.join(path, META)}: no such file; {path} is not a "
                               "zerokern checkpoint")
    parent, base = os.path.split(os.path.abspath(path))
    try:
        siblings = os.listdir(parent)
    except FileNotFoundError:
        siblings = []
    olds = [os.path.join(parent, s) for s in siblings if s.startswith(base + ".old-")
            and is_checkpoint_dir(os.path.join(parent, s))]
    if olds:
        old = max(olds, key=os.path.getmtime)
        return old, (f"zerokern.checkpoint: {path} is missing (a save was interrupted while "
                     f"replacing it); reading the previous checkpoint from {old}")
    tmps = [s for s in siblings if s.startswith(base + ".tmp-")]
    hint = f" (an interrupted save left {tmps[0]}, which is incomplete)" if tmps else ""
    raise MissingFileError(f"{path}: no such checkpoint{hint}")
