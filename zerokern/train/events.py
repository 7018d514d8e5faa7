"""A rank's event log for a supervisor that kills ranks on purpose (benchmarks/chaos.py).

With $ZEROKERN_TRAIN_EVENTS set to a directory, every rank process of `zerokern train` appends
one JSON line per event to `<dir>/pid<PID>.jsonl`: "start" (its rank, world size and torchrun
restart count, once the process group is up), "step" (a step done: the steps recomputed after
a restart are the ones logged twice), and "lost" (the rank raised RankAborted/PeerLost: the
time it knew, and the rank it names). Times are `time.time()` (the supervisor's clock, same
host). Unset: nothing is written, and nothing costs more than reading os.environ once.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

EVENTS_ENV = "ZEROKERN_TRAIN_EVENTS"

_path: list = [None]  # [file path] once opened, [False] when disabled


def _file() -> Optional[str]:
    if _path[0] is None:
        d = os.environ.get(EVENTS_ENV, "")
        if d:
            os.makedirs(d, exist_ok=True)
        _path[0] = os.path.join(d, f"pid{os.getpid()}.jsonl") if d else False
    return _path[0] or None


def record(kind: str, **fields: Any) -> None:
    """Append {"t", "pid", "event": kind, **fields} (one line, flushed: the process may be
    SIGKILLed right after)."""
    path = _file()
    if path is None:
        return
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "event": kind, **fields})
    with open(path, "a") as f:
        f.write(line + "\n")
