"""`latest(root)`: the newest complete checkpoint among root's sub-directories.

[Note: latest]
A candidate is each sub-directory `root/<name>` (the checkpoint itself, or `root/<name>/<subdir>`
for the engine's `<tag>/zero` layout). Complete means, by the format's own markers
(format.py [Note: checkpoint format, version 1]): meta.json present with a valid crc line and a
known version, every file it lists present with its recorded size, and every file named in
`require` present. An interrupted save leaves `<name>.tmp-<nonce>` (never committed) or, with
the two-rename fallback, `<name>.old-<nonce>`: both are skipped. Newest: the largest optimizer
step in the metadata, then the latest meta.json mtime. With `verify` (the default) the newest
complete one has every block's crc checked before it is returned (a flipped byte the sizes
cannot see); one that fails is skipped like the rest, and the next is checked. Each skipped
candidate is named in one warning, with the reason.
"""

from __future__ import annotations

import os
import warnings
from typing import List, Optional, Sequence, Tuple

from .format import BlockVerifier, read_meta
from .parts import index_file, part_dirs


def _complete(ckdir: str, require: Sequence[str]) -> Tuple[int, float]:
    """(step, mtime) of a complete checkpoint; raises with the reason otherwise."""
    step = 0
    for d in part_dirs(ckdir):  # a checkpoint in parts: each stage's (parts.py)
        meta = read_meta(d)
        files = BlockVerifier(d, meta["files"], meta["block_bytes"])
        for name in sorted(meta["files"]):
            files.check_present(name)
        step = max([step] + [p["step"] for p in meta["params"]])
    parent = os.path.dirname(ckdir)
    for name in require:
        if not os.path.exists(os.path.join(parent, name)):
            raise FileNotFoundError(f"{os.path.join(parent, name)}: missing")
    return step, os.path.getmtime(index_file(ckdir))


def _verify_all(ckdir: str) -> None:
    for d in part_dirs(ckdir):
        meta = read_meta(d)
        files = BlockVerifier(d, meta["files"], meta["block_bytes"])
        for name in sorted(meta["files"]):
            files.verify_all(name)


def latest(root, *, subdir: Optional[str] = None, require: Sequence[str] = (),
           verify: bool = True, only: Optional[Sequence[str]] = None) -> Optional[str]:
    """The newest complete checkpoint directly under `root` ([Note: latest]), or None.

    Not collective: every rank may call it (it reads only).

    Args:
        root: a directory holding checkpoints as sub-directories (`zerokern train
            --save-dir`, the engine's save_dir).
        subdir: the checkpoint inside each sub-directory (the engine's "zero"); None: the
            sub-directory itself.
        require: further files each sub-directory must hold (relative to it).
        verify: check every block crc of the one returned (it reads the whole checkpoint
            once); False: sizes and the metadata's crc only.
        only: consider these sub-directory names only (the engine's check of the tag its
            `latest` file names).

    Returns:
        The sub-directory `root/<name>` (not `<subdir>` inside it), or None when there is no
        complete checkpoint (or no `root`). Skipped candidates are named in a warning.
    """
    root = os.fspath(root)
    try:
        names = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return None
    skipped: List[str] = []
    good: List[Tuple[Tuple[int, float], str, str]] = []
    for name in names:
        d = os.path.join(root, name)
        if not os.path.isdir(d) or name.startswith(".") or (only is not None
                                                            and name not in only):
            continue
        if ".tmp-" in name or ".old-" in name:
            skipped.append(f"{d} (an interrupted save's leftover)")
            continue
        ckdir = os.path.join(d, subdir) if subdir else d
        try:
            good.append((_complete(ckdir, require), d, ckdir))
        except Exception as e:  # noqa: BLE001 - any reason: skipped and named
            skipped.append(f"{d} ({type(e).__name__}: {e})")
    found = None
    for _, d, ckdir in sorted(good, reverse=True):
        if verify:
            try:
                _verify_all(ckdir)
            except Exception as e:  # noqa: BLE001
                skipped.append(f"{d} ({type(e).__name__}: {e})")
                continue
        found = d
        break
    if skipped:
        warnings.warn(f"zerokern.checkpoint.latest({root}): skipped {len(skipped)} incomplete "
                      f"or corrupt checkpoint(s): " + "; ".join(skipped), stacklevel=2)
    return found
