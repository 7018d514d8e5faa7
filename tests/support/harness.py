"""Run a function on N gloo ranks (CPU processes) and bring each rank's result back to pytest.

    results = spawn(fn, world_size, *args)     # [rank 0 result, rank 1 result, ...]
    results = cached(fn, world_size, *args)    # the same, memoised: many tests, one spawn

`fn(rank, world_size, *args)` must be a module-level function (it is pickled by name). It runs
after `init_process_group("gloo")`, with `torch.set_num_threads(1)` (2 cores, up to 4 ranks).
A rank that raises sends its traceback back and `spawn` raises `RankFailure` with it; a rank
still running after `timeout` seconds (or `GRACE` seconds after another rank failed, which
usually means it waits in a collective its peer will never join) is killed, and that is a
failure too. Nothing can hang the suite.

The launcher is zerokern's own (`zerokern.tools.spawn.spawn_ranks`, as `zerokern train` and the
benchmarks use it); here ranks are forked from a forkserver that has torch and zerokern imported
already, which makes a process group cost ~1 s instead of ~3 s.

Sub-cases: a worker runs many cases per spawn with `run_cases`, which records each case's result
or traceback (and saves them as it goes, so a later hang still reports what ran). Tests then read
one case each with `case()`.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.distributed as dist

from zerokern.tools import spawn as zk_spawn

TIMEOUT = 180.0  # s per spawn; the slowest (4 ranks, parity) takes 20-50 s on 2 busy cores
GRACE = 10.0  # s the other ranks get to finish after one rank failed
PG_TIMEOUT = 60.0  # s gloo waits in a collective before raising (a mismatch, not a hang)

_CTX = mp.get_context("forkserver")
# torch._dynamo: imported by the first optimizer.step() (1.5 s per rank otherwise).
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "zerokern", "pytest"])

_partial: Dict[str, Any] = {}  # child: finished sub-cases (run_cases)
TIMINGS: Dict[str, float] = {}  # child: seconds per sub-case (run_cases), for profiling


def ws_params(*sizes: int, default=(2,)) -> list:
    """World sizes for `parametrize("ws", ...)`: those in `default` run in the default suite,
    the others under `-m slow`.

    [Note: world sizes in the default run]
    The default run (README's test command, <= 10 minutes on 2 cores) spawns each behaviour at
    the smallest world that shows it, N = 2 (two ranks that shard, reduce and may diverge); N = 1
    and N = 3 (one rank; an odd world whose shards do not divide) are the same code's edge
    cases and run in `-m slow`, which CI runs too. Measured (junit durations, default run at
    17bb75d, 2 loaded cores): the N = 1 and N = 3 groups cost about 430 s of 1620 s.
    """
    return [n if n in default else pytest.param(n, marks=pytest.mark.slow) for n in sizes]


class RankFailure(AssertionError):
    """A rank raised, crashed or timed out; the message holds every rank's traceback."""


_built = False


def _prebuild() -> None:
    """Build the CPU kernel once here, not concurrently in every rank (a failure is left for
    the ranks to report, with the build log, when they use backend="cpu")."""
    global _built
    if not _built:
        _built = True
        try:
            from zerokern import kernels

            kernels.load_op("cpu")
        except Exception:  # noqa: BLE001
            pass


def spawn(fn: Callable, world_size: int, *args, timeout: float = TIMEOUT) -> List[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return per-rank results
    (zerokern.tools.spawn.spawn_ranks, with this harness's forkserver, timeouts and one thread)."""
    _prebuild()
    try:
        return zk_spawn.spawn_ranks(fn, world_size, *args, threads=1, timeout=timeout,
                                    grace=GRACE, pg_timeout=PG_TIMEOUT, context=_CTX)
    except zk_spawn.RankFailure as e:
        errors = []
        for o in e.outcomes:
            done = o.partial or {}
            if o.error is not None:
                errors.append(f"--- rank {o.rank} raised:\n{o.error}cases done: {list(done)}; "
                              f"errors: {_case_errors(done)}")
            elif not o.ok and o.partial is not None:
                errors.append(f"--- rank {o.rank}: {e.why or 'crashed'}; cases done: "
                              f"{list(done)}; errors: {_case_errors(done)}")
            elif not o.ok:
                errors.append(f"--- rank {o.rank}: no result (exit code {o.exitcode}; "
                              f"{e.why or 'crashed'})")
        raise RankFailure(f"{fn.__name__} on {world_size} rank(s) failed:\n"
                          + "\n".join(errors)) from None


_CACHE: Dict[tuple, Any] = {}


def cached(fn: Callable, world_size: int, *args) -> List[Any]:
    """`spawn`, memoised on (fn, world_size, args): tests that read different cases share it."""
    key = (fn.__module__, fn.__name__, world_size, args)
    if key not in _CACHE:
        try:
            _CACHE[key] = spawn(fn, world_size, *args)
        except RankFailure as e:
            _CACHE[key] = e
    if isinstance(_CACHE[key], RankFailure):
        raise _CACHE[key]
    return _CACHE[key]


@pytest.fixture
def one_thread():
    """In-process tests run like a rank: one intra-op thread (2 busy cores make OpenMP spin)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- sub-cases ---------------------------------------------------------------------------------
class CaseError:
    """A sub-case that raised on a rank: its traceback, reported when a test reads the case."""

    def __init__(self, tb: str) -> None:
        self.tb = tb

    def __repr__(self) -> str:
        return f"CaseError({self.tb.strip().splitlines()[-1]!r})"


def _case_errors(results: dict) -> dict:
    return {k: v for k, v in results.items() if isinstance(v, CaseError)}


def fresh_rings() -> None:
    """The next optimizer (or GroupComm) on a process group gets a ring and shared-memory
    exchange of its own. Every optimizer on a group shares one ring ([Note: one ring per
    process group], comm/collectives.py), which decides its transport (ZEROKERN_SHM) at its
    first collective: a case that switches the transport in the same process, or breaks an
    exchange on purpose, drops the ring before (and after) it."""
    from zerokern.comm import collectives
    for ring in collectives._RINGS.values():
        ring.close()
    collectives._RINGS.clear()


def run_cases(cases: Dict[str, Callable[[], Any]]) -> Dict[str, Any]:
    """Child side: run each case, recording its return value or traceback (CaseError).

    Results are saved after every case, so a later hang or crash still reports the earlier
    cases (and the error that most likely caused it). A barrier after each case keeps the ranks
    in step; cases must issue the same collectives on every rank.
    """
    out: Dict[str, Any] = {}
    for name, thunk in cases.items():
        t0 = time.perf_counter()
        try:
            out[name] = thunk()
        except Exception:  # noqa: BLE001
            out[name] = CaseError(traceback.format_exc())
        TIMINGS[name] = time.perf_counter() - t0
        _partial[name] = out[name]
        zk_spawn.save_partial(_partial)
        if dist.is_initialized():
            dist.barrier()
    return out


def case(results: List[Dict[str, Any]], name: str) -> List[Any]:
    """Parent side: one case's per-rank values; fails the test with the rank's traceback."""
    vals = []
    for r, res in enumerate(results):
        if name not in res:
            pytest.fail(f"case {name!r} missing on rank {r}; cases: {sorted(res)}")
        v = res[name]
        if isinstance(v, CaseError):
            pytest.fail(f"case {name!r} raised on rank {r}:\n{v.tb}", pytrace=False)
        vals.append(v)
    return vals
