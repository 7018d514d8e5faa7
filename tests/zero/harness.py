"""Run a function on N gloo ranks (CPU processes) and bring each rank's result back to pytest.

    results = spawn(fn, world_size, *args)     # [rank 0 result, rank 1 result, ...]
    results = cached(fn, world_size, *args)    # the same, memoised: many tests, one spawn

`fn(rank, world_size, *args)` must be a module-level function (it is pickled by name). It runs
after `init_process_group("gloo")`, with `torch.set_num_threads(1)` (2 cores, up to 4 ranks).
A rank that raises sends its traceback back and `spawn` raises `RankFailure` with it; a rank
still running after `timeout` seconds (or `GRACE` seconds after another rank failed, which
usually means it waits in a collective its peer will never join) is killed, and that is a
failure too. Nothing can hang the suite.

Ranks are forked from a forkserver that has torch and zerokern imported already, which makes a
process group cost ~1 s instead of ~3 s. The rendezvous TCPStore lives in the pytest process on
a port the OS picked (no free-port race).

Sub-cases: a worker runs many cases per spawn with `run_cases`, which records each case's result
or traceback (and saves them as it goes, so a later hang still reports what ran). Tests then read
one case each with `case()`.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.distributed as dist

TIMEOUT = 180.0  # s per spawn; the slowest (4 ranks, parity) takes 20-50 s on 2 busy cores
GRACE = 10.0  # s the other ranks get to finish after one rank failed
PG_TIMEOUT = 60.0  # s gloo waits in a collective before raising (a mismatch, not a hang)

_CTX = mp.get_context("forkserver")
# torch._dynamo: imported by the first optimizer.step() (1.5 s per rank otherwise).
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "zerokern", "pytest"])

_out_path = None  # this rank's result file (set in the child)
_partial: Dict[str, Any] = {}
TIMINGS: Dict[str, float] = {}  # child: seconds per sub-case (run_cases), for profiling


class RankFailure(AssertionError):
    """A rank raised, crashed or timed out; the message holds every rank's traceback."""


def _save(obj: Any) -> None:
    tmp = _out_path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, _out_path)


def _rank_main(
    rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple
) -> None:
    global _out_path
    _out_path = os.path.join(out_dir, f"rank{rank}.pt")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT),
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT),
        )
        result = fn(rank, world_size, *args)
        _save({"ok": result})
    except BaseException:  # noqa: BLE001 - everything goes back to pytest
        _save({"error": traceback.format_exc(), "partial": dict(_partial)})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _read(path: str):
    try:
        return torch.load(path, weights_only=False)
    except FileNotFoundError:
        return None


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
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return per-rank results."""
    _prebuild()
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        None,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT),
    )
    with tempfile.TemporaryDirectory(prefix="zk_ranks_") as out_dir:
        procs = [
            _CTX.Process(
                target=_rank_main, daemon=True, args=(r, world_size, store.port, out_dir, fn, args)
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        start, failed_at, why, seen = time.monotonic(), None, "", set()
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            for r, p in enumerate(procs):  # a rank that exited: did it fail?
                if p.exitcode is not None and r not in seen:
                    seen.add(r)
                    out = _read(os.path.join(out_dir, f"rank{r}.pt")) or {}
                    if failed_at is None and (p.exitcode != 0 or "ok" not in out):
                        failed_at = now
            if now - start > timeout:
                why = f"timed out after {timeout:.0f} s"
                break
            if failed_at is not None and now - failed_at > GRACE:
                why = f"killed {GRACE:.0f} s after another rank failed"
                break
            time.sleep(0.02)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        outs = [_read(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size)]
    del store
    errors = []
    for r, (p, out) in enumerate(zip(procs, outs)):
        if out is None:
            errors.append(f"--- rank {r}: no result (exit code {p.exitcode}; {why or 'crashed'})")
        elif "error" in out:
            errors.append(
                f"--- rank {r} raised:\n{out['error']}"
                f"cases done: {list(out['partial'])}; "
                f"errors: {_case_errors(out['partial'])}"
            )
        elif "partial" in out:  # written by run_cases before the rank was killed
            errors.append(
                f"--- rank {r}: {why}; cases done: {list(out['partial'])}; "
                f"errors: {_case_errors(out['partial'])}"
            )
    if errors:
        raise RankFailure(f"{fn.__name__} on {world_size} rank(s) failed:\n" + "\n".join(errors))
    return [out["ok"] for out in outs]


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
        _save({"partial": dict(_partial)})
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
