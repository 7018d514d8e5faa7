"""A kill in the middle of an NVMe state write, on request (the chaos run's "mid-write" kind).

[Note: a kill mid-write on request]
The chaos supervisor (zerokern/bench/chaos.py) kills ranks from outside, but an NVMe state
write of the tiny GPT lasts microseconds: no poll from another process can land in it. So the
rank kills itself, at the supervisor's request. With $ZEROKERN_CHAOS_DIR set (and only then:
unset, `install` reads os.environ once and returns; nothing else runs), `zerokern train`
installs on its NVMe offloader
- a commit hook (after each committed step, on the main thread) that reads the request file
  <dir>/mid-write.json, once per step: {"attempt": torchrun restart count, "rank": the
  victim's world rank, "after_step": N, "nth": k}. A request for this attempt and rank with N
  at most the steps done arms the kill;
- the offloader's fault_hook (state/aligned_io.py pwrite_full calls it in the writer threads
  before each chunk write of a step) that, once armed, counts the writes and at the k-th
  (k = "nth", from 0) records a "mid-write" event (the file, the offset, the step being
  written) and SIGKILLs its own process.
The dying write never starts; the step's other writes may be done or in flight (up to
`queue_depth` x files in flight): the step's other half is torn, which is the case to prove.
The commit that would flip it never comes, and the next attempt resumes from the latest
committed checkpoint (the state files are scratch: config.py [Note: the NVMe state of zerokern
train]).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Optional

from . import events

CHAOS_ENV = "ZEROKERN_CHAOS_DIR"
REQUEST = "mid-write.json"


def install(opt, rank: int, step: int) -> None:
    """Arm `opt`'s NVMe offloader for a requested kill ([Note: a kill mid-write on request]);
    nothing without $ZEROKERN_CHAOS_DIR or without offload="nvme".

    Args:
        opt: the ZeroAdamW optimizer.
        rank: this process's world rank.
        step: the steps already done (the resumed step; the commits count on from it).
    """
    d = os.environ.get(CHAOS_ENV)
    off = getattr(opt, "offloader", None)
    if not d or getattr(off, "offload", None) != "nvme":
        return
    _MidWrite(off, d, rank, step)


class _MidWrite:
    def __init__(self, off, d: str, rank: int, step: int) -> None:
        self.path = os.path.join(d, REQUEST)
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.rank = rank
        self.step = step          # steps committed
        self.nth: Optional[int] = None  # armed: the write (from 0) that kills
        self.writes = 0
        self.lock = threading.Lock()
        off.commit_hooks.append(self.committed)
        off.fault_hook = self.write

    def committed(self) -> None:
        self.step += 1
        if self.nth is not None:
            return
        try:
            with open(self.path) as f:
                req = json.load(f)
        except (OSError, ValueError):  # none yet (or being replaced: next step)
            return
        if req.get("attempt") == self.attempt and req.get("rank") == self.rank and \
                req.get("after_step", 0) <= self.step:
            self.nth = int(req.get("nth", 0))

    def write(self, path: str, offset: int) -> None:
        if self.nth is None:
            return
        with self.lock:
            k = self.writes
            self.writes += 1
        if k == self.nth:
            events.record("mid-write", rank=self.rank, step=self.step + 1,
                          file=os.path.basename(path), offset=offset, nth=k)
            os.kill(os.getpid(), signal.SIGKILL)
