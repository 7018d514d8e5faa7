"""[Note: the gloo exit race] (zerokern/comm/exit_guard.py): the atexit wait that lets gloo's
worker threads finish releasing their work before Python finalizes.

The race itself is timing-bound (a crash at exit in 7 of 40 plain DDP runs under torchrun, 0 of
40 with the wait; examples/torch_loop.py 1 of 20 before, 0 of 40 after): these tests check the
mechanism, that it is registered by a gloo GroupComm, and what the wait waits for."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest

from zerokern.comm import exit_guard
from zerokern.tools.spawn import spawn_ranks

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _busy_named(name: bytes, seconds: float, started: threading.Event) -> None:
    libc = ctypes.CDLL(None)
    libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME: this thread's /proc comm
    started.set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


# The controls' threads outlast a wrong wait by far (1.5 s) and the bound sits between (1.0 s):
# a guard that waited on them takes >= 1.5 s, one that did not takes _FIRST_S plus however long
# the loaded machine keeps the main thread off the GIL (the control spins in Python). A bound of
# _FIRST_S + 0.1 failed under a full suite's load (2026-11-29) with the guard right.
_CONTROL_S = 1.5
_CONTROL_BOUND_S = 1.0


@linux
@pytest.mark.parametrize("name,waits", [(b"pt_gloo_runloop", True), (b"other_thread", False)])
def test_the_wait_lasts_while_a_gloo_worker_runs(name, waits):
    """A running thread named pt_gloo_runloop holds the wait until it stops (here 0.3 s);
    another busy thread (the control) does not: the first sleep (_FIRST_S) and done."""
    started = threading.Event()
    busy_s = 0.3 if waits else _CONTROL_S
    t = threading.Thread(target=_busy_named, args=(name, busy_s, started))
    t.start()
    started.wait()
    t0 = time.monotonic()
    exit_guard.let_gloo_workers_finish()
    took = time.monotonic() - t0
    t.join()
    if waits:
        assert 0.2 <= took <= exit_guard._MAX_S + 0.2, took
    else:
        assert took < _CONTROL_BOUND_S, took


def _waiting_named(name: bytes, timeout, started: threading.Event, release: threading.Event):
    libc = ctypes.CDLL(None)
    libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)
    started.set()
    release.wait(timeout)  # a futex wait with a timeout (timeout=None: without one)


@linux
@pytest.mark.parametrize("timed,waits", [(True, True), (False, False)])
def test_the_wait_lasts_while_a_gloo_worker_waits_with_a_timeout(timed, waits):
    """A pt_gloo_runloop thread blocked in a timed futex wait (what a worker waiting for the GIL
    in CPython's take_gil looks like, state S) holds the wait until it leaves (0.4 s here); a
    worker waiting on its queue without a timeout (idle; the control) does not. The first
    version, which looked for state R alone, ended after _FIRST_S in both cases: the CI abort
    of 2026-11-29 ([Note: the gloo exit race])."""
    started, release = threading.Event(), threading.Event()
    t = threading.Thread(target=_waiting_named,
                         args=(b"pt_gloo_runloop", 30.0 if timed else None, started, release))
    t.start()
    started.wait()
    time.sleep(0.05)  # into its wait
    timer = threading.Timer(0.4 if waits else _CONTROL_S, release.set)
    timer.start()
    t0 = time.monotonic()
    exit_guard.let_gloo_workers_finish()
    took = time.monotonic() - t0
    release.set()
    t.join()
    timer.cancel()
    if waits:
        assert 0.35 <= took <= exit_guard._MAX_S, took
    else:
        assert took < _CONTROL_BOUND_S, took


def test_no_gloo_thread_is_seen_in_a_plain_process():
    assert not exit_guard._gloo_workers_running()


def test_the_wait_is_registered_once(monkeypatch):
    calls = []
    monkeypatch.setattr(exit_guard.atexit, "register", calls.append)
    monkeypatch.setattr(exit_guard, "_registered", False)
    exit_guard.guard_gloo_exit()
    exit_guard.guard_gloo_exit()
    assert calls == [exit_guard.let_gloo_workers_finish]


def _rank(rank, world):
    import torch

    import zerokern as zk

    before = exit_guard._registered
    zk.ZeroAdamW(torch.nn.Linear(8, 8), stage=2, precision="fp32")
    return before, exit_guard._registered


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
def test_a_gloo_optimizer_registers_the_wait():
    assert spawn_ranks(_rank, 2, backend="gloo", timeout=120) == [(False, True)] * 2


def test_the_gloo_side_group_of_an_nccl_group_registers_the_wait(monkeypatch):
    """Stage 3's host agreement (comm/host_agree.py) makes a gloo group next to an NCCL group:
    that process uses gloo too, so it needs the wait (GPU checklist). One process, the NCCL
    group faked: what is checked is that making the side group registers the guard."""
    import types

    from zerokern.comm import host_agree

    calls, made = [], []
    monkeypatch.setattr(exit_guard.atexit, "register", calls.append)
    monkeypatch.setattr(exit_guard, "_registered", False)
    monkeypatch.setattr(host_agree, "_HOST_GROUPS", {})
    monkeypatch.setattr(host_agree.dist, "get_process_group_ranks", lambda g: [0, 1])
    monkeypatch.setattr(host_agree.dist, "new_group",
                        lambda ranks, **kw: made.append((ranks, kw)) or object())
    gc = types.SimpleNamespace(world_size=2, backend="nccl", group=object())
    host_agree.HostAgreement(gc)
    assert made == [([0, 1], {"backend": "gloo", "use_local_synchronization": True})]
    assert calls == [exit_guard.let_gloo_workers_finish]
    # a gloo main group makes no side group (its GroupComm registered the wait already)
    calls.clear()
    monkeypatch.setattr(exit_guard, "_registered", False)
    host_agree.HostAgreement(types.SimpleNamespace(world_size=2, backend="gloo", group=None))
    assert len(made) == 1 and calls == []
