"""`zerokern.checkpoint.save`: the arguments checked, a pending asynchronous save waited for,
then the synchronous save (writer.py) or an asynchronous one (async_save.py). Above both, so
that neither imports the other."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from torch import nn

from . import async_save as async_save_
from . import writer


def save(path, model: nn.Module, opt, *, exclude_frozen_parameters: bool = False,
         async_save: bool = False, client_state: Optional[Dict[str, Any]] = None,
         on_commit: Optional[Callable[[], None]] = None):
    """Save model and optimizer state to the directory `path` (collective: every rank calls).

    Args:
        path: checkpoint directory, the same on every rank (a shared filesystem across
            nodes). An existing checkpoint there is replaced atomically; an existing path
            that is not a zerokern checkpoint is refused. A job whose ranks hold different
            params (pipeline stages of a world mesh's "pp" dim, DTensor tp params) writes
            `path/parts.json` and one checkpoint per (stage, tp rank) under it, all committed
            atomically as one (checkpoint/parts.py [Note: a checkpoint in parts]); every rank
            of the job calls save.
        model: the nn.Module `opt` was built on, or the list of one rank's pipeline stage
            modules under one optimizer; names come from `model.state_dict()` (a pipeline
            stage's module keeps the whole model's names: parts.py).
        opt: the zerokern.ZeroAdamW.
        exclude_frozen_parameters: leave out the values of the model's frozen params
            (`requires_grad=False`, not held by the optimizer), as DeepSpeed's
            `save_checkpoint(..., exclude_frozen_parameters=True)` does (a LoRA checkpoint
            without its base weights). The metadata lists them (name, shape, dtype and a crc32
            of their values): `load(..., strict=False)` keeps the model's own values for them,
            `consolidate` leaves them out of its output and says so. Buffers and the
            optimizer's params are always saved.
        async_save: copy this rank's share into a staging buffer and write it in a background
            thread while training goes on (async_save.py [Note: asynchronous saves]); returns
            an `AsyncSave` handle at once. A save (either kind) or load first waits for a
            pending one.
        client_state: a picklable dict saved with the checkpoint (rank 0's; checksummed and
            committed with it) and returned by `load` as "client_state".
        on_commit: rank 0 calls it right after the commit, before the ranks' final agreement
            (its error fails the save on every rank; the checkpoint is committed then). The
            engine writes its `latest` file there.

    Returns:
        The absolute path written; with async_save, an `AsyncSave` (`wait()` returns the path).

    Raises:
        TypeError, ValueError: bad arguments, before anything is written.
        CheckpointError: the save failed on some rank; the previous checkpoint is intact.
        OSError: a file write failed (ENOSPC, EIO) on this rank; the previous checkpoint is
            intact. A pending async save's error is raised here, once, before this save starts.
    """
    if not isinstance(exclude_frozen_parameters, bool):
        raise TypeError("exclude_frozen_parameters must be a bool, got "
                        f"{type(exclude_frozen_parameters).__name__}")
    if not isinstance(async_save, bool):
        raise TypeError(f"async_save must be a bool, got {type(async_save).__name__}")
    if client_state is not None and not isinstance(client_state, dict):
        raise TypeError(f"client_state must be a dict or None, got "
                        f"{type(client_state).__name__}")
    async_save_.wait()  # a save starts only after the previous one committed (or failed)
    if async_save:
        return async_save_.start(path, model, opt, exclude_frozen_parameters, client_state,
                                 on_commit)
    return writer.save_now(path, model, opt, exclude_frozen_parameters, client_state, on_commit)
