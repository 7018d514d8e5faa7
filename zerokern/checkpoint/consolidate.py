"""`consolidate(path)`: the full state dict that `model.load_state_dict(strict=True)` accepts.

Streams one tensor at a time from the rank files (memory-mapped, every block's crc checked as
it is read), so the peak above the output is one param's read mapping, and with
`out="x.safetensors"` the output is not held at all: each tensor is written as it is made.
Keys and their order are those of the saving model's `model.state_dict()`: tied aliases are
there (sharing one tensor in the returned dict, as in `model.state_dict()`; written twice in a
safetensors file, whose format has no aliases), and so are buffers and frozen params, saved
from rank 0, so strict loading works.

A checkpoint saved with `exclude_frozen_parameters=True` holds no values for its frozen params
(format.py [Note: excluded frozen params]): they are left out of the output, with a warning
naming them (DeepSpeed's zero_to_fp32 leaves them out silently), so the dict loads with
`strict=False` into a model that holds them (the base model of a LoRA run), and a safetensors
file lists them in its `__metadata__` ("excluded_frozen_parameters", a JSON list).

Params come from the fp32 masters (not the 16-bit params), cast to `dtype` (fp32 by default;
bf16/fp16 round to nearest even, bitwise what the optimizer's cast-back gives). Floating
buffers and frozen params are cast to `dtype` too; integer ones keep theirs.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from zerokern.options.args import FLOAT_DTYPES, PRECISIONS

from .format import (
    EXTRA,
    BlockVerifier,
    CheckpointError,
    as_tensor,
    dtype_from_name,
    find_checkpoint,
    read_meta,
    read_span,
    tensor_bytes,
)
from .parts import consolidate_parts, read_parts_meta
from .reader import SavedIndex
from .writer import check_path

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16",
              torch.float16: "F16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
FORMATS = ("pt", "safetensors")


def _out_dtype(dtype) -> torch.dtype:
    dt = PRECISIONS.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dt not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of torch.float32/bfloat16/float16 or "
                         f"{tuple(PRECISIONS)}, got {dtype!r}")
    return dt


class _Source:
    """A read-only checkpoint: metadata, index, checked reads."""

    def __init__(self, path) -> None:
        d, warning = find_checkpoint(check_path(path))
        if warning:
            warnings.warn(warning, stacklevel=3)
        self.dir = d
        self.meta = read_meta(d)
        self.index = SavedIndex(self.meta)
        self.files = BlockVerifier(d, self.meta["files"], self.meta["block_bytes"])
        for name in self.meta["files"]:
            self.files.check_present(name)
        extras = {}
        for e in self.meta["extras"]:
            for n in [e["name"], *e["aliases"]]:
                extras[n] = e
        self.extras = extras
        self.excluded = {}  # format.py [Note: excluded frozen params]
        for e in self.meta.get("excluded_frozen", ()):
            for n in [e["name"], *e["aliases"]]:
                self.excluded[n] = e

    def excluded_keys(self) -> List[str]:
        """The state_dict keys whose values the checkpoint left out, in state_dict order."""
        return [k for k in self.meta["state_dict_keys"] if k in self.excluded]

    def warn_excluded(self) -> None:
        keys = self.excluded_keys()
        if keys:
            warnings.warn(
                f"zerokern.checkpoint.consolidate: {self.dir} was saved with "
                f"exclude_frozen_parameters=True: {len(keys)} frozen param key(s) are not in "
                f"the output: {keys[:8]}{' ...' if len(keys) > 8 else ''}; load it with "
                "strict=False into a model that holds them", stacklevel=3)

    def entries(self, dtype: torch.dtype) -> List[Tuple[str, Tuple[int, ...], torch.dtype, Any]]:
        """(key, shape, output dtype, source) in state_dict order; source: param index or
        extra entry."""
        out = []
        for key in self.meta["state_dict_keys"]:
            if key in self.index.by_name:
                j = self.index.by_name[key]
                out.append((key, tuple(self.meta["params"][j]["shape"]), dtype, j))
            elif key in self.extras:
                e = self.extras[key]
                dt = dtype_from_name(e["dtype"])
                out.append((key, tuple(e["shape"]), dtype if dt.is_floating_point else dt, e))
            elif key in self.excluded:
                continue  # no values in the checkpoint (warn_excluded says so)
            else:
                raise CheckpointError(f"{self.dir}: state_dict key {key!r} is neither a param "
                                      "nor an extra of the checkpoint")
        return out

    def read(self, src, shape, dtype: torch.dtype, section: str = "master") -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        out = torch.empty(n, dtype=dtype)
        if isinstance(src, int):
            for fname, off, d0, cnt in self.index.sources(src, 0, n):
                lo, hi = self.index.byte_range(fname, section, off, cnt)
                self.files.verify(fname, [(lo, hi)])
                out[d0:d0 + cnt].copy_(as_tensor(read_span(self.files.path(fname), lo, hi - lo),
                                                 self.index.dtype(section)))
        else:
            dt = dtype_from_name(src["dtype"])
            nbytes = n * dt.itemsize
            if nbytes:
                lo = src["offset"]
                self.files.verify(EXTRA, [(lo, lo + nbytes)])
                out.copy_(as_tensor(read_span(self.files.path(EXTRA), lo, nbytes), dt))
        return out.reshape(shape)

    def tensors(self, dtype: torch.dtype) -> Iterator[Tuple[str, torch.Tensor]]:
        """(key, tensor) in state_dict order; an alias yields the tensor of its first key."""
        made: Dict[int, torch.Tensor] = {}
        for key, shape, dt, src in self.entries(dtype):
            ident = src if isinstance(src, int) else id(src)
            if ident not in made:
                made[ident] = self.read(src, shape, dt)
            yield key, made[ident]


def consolidate(path, out=None, *, dtype=torch.float32,
                fmt: Optional[str] = None) -> Union[Dict[str, torch.Tensor], str]:
    """Full state dict of a checkpoint, from its fp32 masters (no process group needed).

    Args:
        path: checkpoint directory written by `zerokern.checkpoint.save` (of a pipelined or
            tensor-parallel job too: every stage's params, the tp local tensors joined along
            their shard dims into the full ones, keyed by name; fmt "pt" only).
        out: None to return the dict; else a file to write (atomically, via `out.tmp`).
        dtype: output dtype of params (and floating buffers): fp32 (default), bf16 or fp16.
        fmt: "pt" (torch.save) or "safetensors"; default from out's suffix (.safetensors),
            else "pt". safetensors is written by zerokern itself (streamed; no extra needed
            to write it, `pip install zerokern[safetensors]` to read it with that library).

    Returns:
        The state dict {key: tensor (CPU)}, keys as `model.state_dict()`, or the path written.
        A checkpoint saved with `exclude_frozen_parameters=True` gives the keys of every tensor
        but those frozen params, with a warning naming them.

    Raises:
        CheckpointError: the checkpoint cannot be read; its kinds ChecksumError (names the
            file), MissingFileError and VersionError.
        ValueError: an unknown fmt or dtype.
    """
    dt = _out_dtype(dtype)
    if out is not None:
        out = check_path(out)
        if fmt is None:
            fmt = "safetensors" if out.endswith(".safetensors") else "pt"
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS} or None, got {fmt!r}")
    top, warning = find_checkpoint(check_path(path))
    parts_meta = read_parts_meta(top)
    if parts_meta is not None:  # parts.py [Note: a checkpoint in parts]
        if warning:
            warnings.warn(warning, stacklevel=2)
        if fmt == "safetensors":
            raise ValueError("fmt='safetensors' is not supported for a checkpoint in parts "
                             "(pipeline stages, tensor parallelism); write a .pt file "
                             "(fmt='pt')")

        def read_one(d):
            one = _Source(d)
            one.warn_excluded()
            return dict(one.tensors(dt))

        full = consolidate_parts(top, parts_meta, read_one)
        if out is None:
            return full
        torch.save(full, out + ".tmp")
        os.replace(out + ".tmp", out)
        return out
    src = _Source(path)
    src.warn_excluded()
    if out is None:
        return dict(src.tensors(dt))
    tmp = out + ".tmp"
    try:
        if fmt == "safetensors":
            _write_safetensors(tmp, src, dt)
        else:
            torch.save(dict(src.tensors(dt)), tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def _write_safetensors(fn: str, src: _Source, dtype: torch.dtype) -> None:
    """The safetensors layout: u64 header size, JSON header, raw little-endian data."""
    entries = src.entries(dtype)
    header: Dict[str, Any] = {"__metadata__": {"format": "pt", "source": "zerokern checkpoint"}}
    if src.excluded_keys():
        header["__metadata__"]["excluded_frozen_parameters"] = json.dumps(src.excluded_keys())
    off = 0
    for key, shape, dt, _ in entries:
        n = 1
        for d in shape:
            n *= d
        header[key] = {"dtype": _ST_DTYPES[dt], "shape": list(shape),
                       "data_offsets": [off, off + n * dt.itemsize]}
        off += n * dt.itemsize
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # the data starts 8-byte aligned
    with open(fn, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _key, shape, dt, s in entries:  # aliases are read again: one tensor held at a time
            f.write(tensor_bytes(src.read(s, shape, dt)))
        f.flush()
        os.fsync(f.fileno())


def verify(path) -> Dict[str, Any]:
    """Check every block of every file of a checkpoint against its crc (reads all of it).

    Args:
        path: checkpoint directory written by `zerokern.checkpoint.save`.

    Raises:
        ChecksumError: a block does not match its crc (names the file).
        MissingFileError: a rank file is missing.

    Returns:
        {"path", "files", "bytes"} of the checkpoint.
    """
    top, _ = find_checkpoint(check_path(path))
    parts_meta = read_parts_meta(top)
    if parts_meta is not None:  # every part's checkpoint
        got = [verify(os.path.join(top, p["dir"])) for p in parts_meta["parts"]]
        return {"path": top, "files": sum(g["files"] for g in got),
                "bytes": sum(g["bytes"] for g in got)}
    src = _Source(path)
    for name in sorted(src.meta["files"]):
        src.files.verify_all(name)
    return {"path": src.dir, "files": len(src.meta["files"]),
            "bytes": sum(f["bytes"] for f in src.meta["files"].values())}
