"""The one multi-rank launcher: `fn(rank, world_size, *args)` on N child processes in a process
group, each rank's result brought back, and never a hang.

Used by `zerokern train` (train/launch.py), `zerokern bench --step`, the checkpoint benchmark
(benchmarks/bench_checkpoint.py) and the test harness (tests/support/harness.py).

[Note: no hangs]
A rank that raises records its traceback in a result file and exits non-zero. The parent polls
the ranks; once one has failed, the others get `grace` seconds to finish (they usually raise
too, e.g. every rank rejects the same configuration) and are then killed: a rank left waiting
in a collective its dead peer will never join cannot hang the caller. A rank that exits with one
of `stop_codes` (a clear, final refusal) stops the others at once. The rendezvous TCPStore lives
in the parent on a port the OS picked (no free-port race). Under torchrun, torchrun's agent does
this job.

[Note: partial results]
A child may save what it has so far (`save_partial`, e.g. one entry per finished sub-case);
if the rank is later killed or raises, the parent still gets it (`RankOutcome.partial`).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from zerokern.platform.device import handle

TIMEOUT_ENV = "ZEROKERN_SPAWN_TIMEOUT_S"  # overrides spawn_ranks(timeout=)
GRACE_ENV = "ZEROKERN_SPAWN_GRACE_S"      # overrides spawn_ranks(grace=)
PG_TIMEOUT_ENV = "ZEROKERN_PG_TIMEOUT_S"  # overrides spawn_ranks(pg_timeout=) (comm/abort.py)

_out_path: Optional[str] = None  # child: this rank's result file


def _env_s(name: str, default: Optional[float]) -> Optional[float]:
    """Seconds from the environment variable `name` when set (a busy machine needs more than
    the caller's default: [Note: timeouts under load]), else `default`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: expected a positive number of seconds")
    return value
_partial: Dict[str, Any] = {}


@dataclass
class RankOutcome:
    rank: int
    exitcode: Optional[int]
    ok: bool = False
    value: Any = None
    error: Optional[str] = None      # the traceback
    message: Optional[str] = None    # "Type: message" of what the rank raised
    partial: Optional[dict] = None


class RankFailure(RuntimeError):
    """A rank raised, crashed or timed out; `outcomes` has every rank's story, `why` the
    parent's reason for killing ranks ('' when none was killed)."""

    def __init__(self, outcomes: List[RankOutcome], why: str) -> None:
        self.outcomes, self.why = outcomes, why
        lines = []
        for o in outcomes:
            if o.error is not None:
                lines.append(f"--- rank {o.rank} raised:\n{o.error.rstrip()}")
            elif not o.ok:
                lines.append(f"--- rank {o.rank}: {why or 'crashed'} (exit code {o.exitcode}, "
                             "no result)")
        super().__init__("a rank failed:\n" + "\n".join(lines))


def save_partial(results: Dict[str, Any]) -> None:
    """Child side: record results so far ([Note: partial results])."""
    _partial.clear()
    _partial.update(results)
    _write({"partial": dict(_partial)})


def _write(obj: Any) -> None:
    tmp = _out_path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, _out_path)


def _read(path: str) -> Optional[dict]:
    try:
        return torch.load(path, weights_only=False)
    except (FileNotFoundError, EOFError, RuntimeError):
        return None


def _rank_main(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple,
               backend: str, threads: Optional[int], pg_timeout: float,
               device_of: Optional[Callable[[int], torch.device]],
               exit_codes: Dict[type, int]) -> None:
    global _out_path
    _out_path = os.path.join(out_dir, f"rank{rank}.pt")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if threads:
        torch.set_num_threads(threads)
    code = 0
    try:
        timeout = datetime.timedelta(seconds=pg_timeout)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        kw = {}
        if device_of is not None:
            dev = device_of(rank)
            if dev.type != "cpu":
                handle(dev).set_device(dev.index)
                kw["device_id"] = dev
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout, **kw)
        _write({"ok": fn(rank, world_size, *args)})
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        _write({"error": traceback.format_exc(), "message": f"{type(e).__name__}: {e}",
                "partial": dict(_partial)})
        code = next((c for t, c in exit_codes.items() if isinstance(e, t)), 1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (joining gloo's threads can stall it)


def spawn_ranks(fn: Callable, world_size: int, *args, backend: str = "gloo",
                threads: Optional[int] = None, timeout: Optional[float] = None,
                grace: float = 10.0, pg_timeout: float = 120.0, context=None,
                device_of: Optional[Callable[[int], torch.device]] = None,
                exit_codes: Optional[Dict[type, int]] = None,
                stop_codes: Sequence[int] = ()) -> List[Any]:
    """Run `fn(rank, world_size, *args)` (a module-level function) on `world_size` ranks.

    Args:
        backend: the process group's ("gloo"; "nccl" with device_of giving each rank's GPU).
        threads: torch intra-op threads per rank (None: torch's default).
        timeout: seconds before still-running ranks are killed (None: no limit);
            $ZEROKERN_SPAWN_TIMEOUT_S overrides it.
        grace: seconds the others get after a rank failed ([Note: no hangs]);
            $ZEROKERN_SPAWN_GRACE_S overrides it.
        pg_timeout: seconds a collective waits before raising (a mismatch, or a peer slower
            than that: the error says so); $ZEROKERN_PG_TIMEOUT_S overrides it.
        context: a multiprocessing context (default "spawn": fork would copy this process's
            OpenMP/CUDA state), e.g. a forkserver with preloaded modules.
        exit_codes: {exception class: exit code} for what a rank raises (default 1).
        stop_codes: exit codes after which the other ranks are stopped at once.

    Returns every rank's return value, in rank order; raises RankFailure otherwise.
    """
    # [Note: timeouts under load] every time limit here can be raised from outside
    timeout = _env_s(TIMEOUT_ENV, timeout)
    grace = _env_s(GRACE_ENV, grace)
    pg_timeout = _env_s(PG_TIMEOUT_ENV, pg_timeout)
    ctx = context or mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=pg_timeout))
    with tempfile.TemporaryDirectory(prefix="zerokern-ranks-") as out_dir:
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(r, world_size, store.port, out_dir, fn, args, backend,
                                   threads, pg_timeout, device_of, exit_codes or {}))
                 for r in range(world_size)]
        why = ""
        try:
            for p in procs:
                p.start()
            start, failed_at = time.monotonic(), None
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                    failed_at = now
                if any(p.exitcode in stop_codes for p in procs if p.exitcode):
                    why = "stopped: another rank refused the run"
                    break
                if timeout is not None and now - start > timeout:
                    why = (f"timed out after {timeout:g} s (spawn_ranks(timeout=); raise it, "
                           f"or set {TIMEOUT_ENV}=<seconds>) and killed")
                    break
                if failed_at is not None and now - failed_at > grace:
                    why = (f"killed {grace:g} s after another rank failed, still running "
                           f"(spawn_ranks(grace=); raise it, or set {GRACE_ENV}=<seconds>, to "
                           "let it report its own error)")
                    break
                time.sleep(0.02)
        finally:  # also on Ctrl-C: no rank outlives the caller
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        outs = [_read(os.path.join(out_dir, f"rank{r}.pt")) or {} for r in range(world_size)]
    del store
    outcomes = [RankOutcome(r, p.exitcode, ok="ok" in o and p.exitcode == 0,
                            value=o.get("ok"), error=o.get("error"), message=o.get("message"),
                            partial=o.get("partial"))
                for r, (p, o) in enumerate(zip(procs, outs))]
    if all(o.ok for o in outcomes):
        return [o.value for o in outcomes]
    raise RankFailure(outcomes, why)
