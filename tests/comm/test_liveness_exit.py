"""[Note: the watcher at exit] (zerokern/comm/liveness.py): the liveness thread is a daemon that
does store operations every beat; a process that finalized while one was in flight aborted
("terminate called without an active exception"). An atexit handler stops and joins it."""

from __future__ import annotations

import time

from torch.distributed import TCPStore

from zerokern.comm import liveness


def test_the_watcher_is_stopped_and_joined_at_exit(monkeypatch):
    handlers = []
    monkeypatch.setattr(liveness.atexit, "register", handlers.append)
    monkeypatch.setattr(liveness, "JOIN_WAIT_S", 0.05)  # no peer joins this one-process test
    store = TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    w = liveness.Liveness(store, 0, 2)
    time.sleep(2 * liveness.BEAT_S)
    # negative control: a daemon thread beating; nothing else would end it before finalization
    assert w._thread.is_alive() and w._thread.daemon
    assert handlers == [w.stop_and_join]
    t0 = time.monotonic()
    handlers[0]()  # what atexit runs
    assert not w._thread.is_alive()
    assert time.monotonic() - t0 < liveness.EXIT_JOIN_S
    handlers[0]()  # twice (a stopped watcher): a no-op
