"""The engine's checkpoints, the helpers: tags, `latest`, the directory checks. The methods
(DeepSpeed's `save_checkpoint` / `load_checkpoint` / `save_16bit_model` over
`zerokern.checkpoint`) are ZeroEngine's own, in engine.py (issue 35: one class in one module,
not a mixin spread by size).

[Note: checkpoint tags] A zerokern checkpoint is one directory that every rank writes
collectively (`zerokern.checkpoint.save`), so all ranks must write under the same tag. Before
anything is written the ranks exchange (save_dir is valid, tag) once (`all_gather_object`, a
few bytes), so that every rank takes the same decision:
- a save_dir that is None or "" on any rank: ValueError on every rank (DeepSpeed 0.19 raises
  ValueError for it too; before, zerokern wrote into the current directory or raised TypeError);
  load_checkpoint's load_dir the same (before: "" read the current directory's `latest`);
- tags that differ: `checkpoint.tag_validation` decides as in DeepSpeed -- "Fail" raises on
  every rank; "Warn" (DeepSpeed's default) warns; "Ignore" says nothing. Under Warn and Ignore
  DeepSpeed writes each rank's files under that rank's tag, which leaves no loadable
  checkpoint; zerokern writes under rank 0's tag instead (the warning says so), the one choice
  that leaves a checkpoint that loads.

[Note: engine checkpoint layout] `save_dir/<tag>/zero/` is a zerokern checkpoint whose
client_state holds the engine's counters, scheduler state and the caller's client_state, so
they commit atomically with the model and optimizer (before, rank 0 wrote
`<tag>/engine_state.pt` beside it, after the commit: a crash in between left a checkpoint
without its counters; such older checkpoints still load). `save_dir/latest` is rewritten
(tmp + rename) by rank 0 right after the commit, inside the save's agreement, so it never
names an uncommitted tag. load_checkpoint without a tag reads `latest` as DeepSpeed does and
falls back to scanning (zerokern.checkpoint.latest) when the file is missing or names a tag
that is not a complete checkpoint.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

from .. import checkpoint as zk_checkpoint

log = logging.getLogger("zerokern.engine")
_ENGINE_STATE = "engine_state.pt"  # the engine state of checkpoints written before it
_ENGINE_KEY = "zerokern.engine"  # moved into the checkpoint's client_state
_ZERO_DIR = "zero"


def _latest_tag(load_dir: str) -> Optional[str]:
    """[Note: engine checkpoint layout]: the tag `load_dir/latest` names if that checkpoint
    is complete, else the newest complete one (zerokern.checkpoint.latest), else None."""
    latest = os.path.join(load_dir, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            tag = f.read().strip()
        try:
            found = zk_checkpoint.latest(load_dir, subdir=_ZERO_DIR, verify=False,
                                         only=[tag]) if tag else None
        except Exception:  # noqa: BLE001 - the scan below says why
            found = None
        if found is not None:
            return tag
        log.warning("load_checkpoint: %s names %r, which is not a complete checkpoint; "
                    "scanning %s for the newest complete one", latest, tag, load_dir)
    found = zk_checkpoint.latest(load_dir, subdir=_ZERO_DIR)
    return None if found is None else os.path.basename(found)


def _dir_error(d, what: str = "save_checkpoint: save_dir") -> Optional[Tuple[str, str]]:
    """(exception name, message), or None for a usable directory argument."""
    if d is None or (isinstance(d, str) and d == ""):
        return "ValueError", f"{what} must be a non-empty path, got {d!r}"
    if not isinstance(d, (str, os.PathLike)):
        return "TypeError", f"{what} must be a path (str), got {type(d).__name__}"
    return None


def _raise_first(seen, errors_at: int = 0) -> None:
    """Every rank raises the first rank's error (the same on all, so none waits)."""
    errors = [(r, item[errors_at]) for r, item in enumerate(seen) if item[errors_at] is not None]
    if errors:
        r, (kind, e) = errors[0]
        raise {"TypeError": TypeError, "ValueError": ValueError}[kind](
            f"{e} (on rank {r}); nothing done")
