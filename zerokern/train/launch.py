"""Where `zerokern train` runs its ranks: spawned here, under torchrun, or in this process.

[Note: no hangs]
A spawned rank that raises records its traceback in a result file and exits non-zero. The
parent polls the ranks; once one has failed, the others get GRACE_S seconds to finish (they
usually raise too, e.g. every rank rejects the same configuration) and are then killed:
a rank left waiting in a collective its dead peer will never join cannot hang the command.
The rendezvous TCPStore lives in the parent on a port the OS picked (no free-port race), as in
tests/zero/harness.py. Under torchrun, torchrun's agent does this job.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..host import usable_cpus
from .config import TrainConfig
from .loop import run_rank

GRACE_S = 10.0       # the other ranks' time to finish after one failed
PG_TIMEOUT_S = 120   # a collective that waits this long raises instead of blocking forever
EXIT_NOT_IMPLEMENTED = 2


class RankError(RuntimeError):
    """A rank failed; `exit_code` is what the command should return."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def resolve_device(cfg: TrainConfig) -> str:
    """'cuda' or 'cpu'; ValueError (naming --device) if CUDA was asked for and is absent."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch")
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def plan(cfg: TrainConfig) -> Tuple[str, int]:
    """(device type, number of ranks to spawn) for a run outside torchrun; checks --nproc and
    --offload against --stage."""
    if cfg.offload and cfg.stage == 0:
        raise ValueError(f"--offload {cfg.offload} needs --stage 1, 2 or 3 (stage 0 keeps the "
                         "full optimizer state on every rank)")
    dev = resolve_device(cfg)
    if dev == "cuda":
        n_gpu = torch.cuda.device_count()
        nproc = cfg.nproc or n_gpu
        if nproc > n_gpu:
            raise ValueError(f"--nproc {nproc}: only {n_gpu} GPU(s) visible (one rank per GPU)")
        return dev, nproc
    return dev, cfg.nproc or 2


def _threads_per_rank(local_world: int) -> int:
    # Each rank gets its share of the cores, as the step benchmark does: more OpenMP threads
    # than cores make the ranks' threads spin against each other.
    return max(1, usable_cpus() // max(1, local_world))


def _device(dev_type: str, local_rank: int) -> torch.device:
    if dev_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _not_implemented_message(e: NotImplementedError, cfg: TrainConfig) -> str:
    flags = " ".join(f for f, on in ((f"--stage {cfg.stage}", cfg.stage == 3),
                                     (f"--offload {cfg.offload}", cfg.offload)) if on)
    return f"{flags or 'this configuration'} is not available yet: {e}"


# ---------------------------------------------------------------------------- in process


def run_in_process(cfg: TrainConfig, dev_type: str) -> Dict[str, Any]:
    """World size 1 without a process group (ZeroAdamW's no-init path)."""
    torch.set_num_threads(_threads_per_rank(1))
    try:
        return run_rank(cfg, _device(dev_type, 0))
    except NotImplementedError as e:
        raise RankError(_not_implemented_message(e, cfg), EXIT_NOT_IMPLEMENTED) from None


def run_torchrun(cfg: TrainConfig) -> Optional[Dict[str, Any]]:
    """This process is one rank of a torchrun job. Returns the results on rank 0, else None."""
    dev_type = resolve_device(cfg)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.set_num_threads(_threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    device = _device(dev_type, local_rank)
    dist.init_process_group("nccl" if dev_type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        res = run_rank(cfg, device)
        return res if dist.get_rank() == 0 else None
    except NotImplementedError as e:
        raise RankError(_not_implemented_message(e, cfg), EXIT_NOT_IMPLEMENTED) from None
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- spawned ranks


def _save(path: str, obj: Any) -> None:
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def _child(rank: int, world: int, port: int, cfg: TrainConfig, dev_type: str,
           out_dir: str, work: Callable) -> None:
    path = os.path.join(out_dir, f"rank{rank}.pt")
    code = 0
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        torch.set_num_threads(_threads_per_rank(world))
        device = _device(dev_type, rank)
        timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("nccl" if dev_type == "cuda" else "gloo", store=store,
                                rank=rank, world_size=world, timeout=timeout)
        res = work(cfg, device)
        _save(path, {"ok": res if rank == 0 else None})
    except NotImplementedError as e:
        _save(path, {"not_implemented": _not_implemented_message(e, cfg)})
        code = EXIT_NOT_IMPLEMENTED
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        _save(path, {"error": traceback.format_exc(), "message": f"{type(e).__name__}: {e}"})
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (joining gloo's threads can stall it)


def _read(path: str) -> Optional[dict]:
    try:
        return torch.load(path, weights_only=False)
    except (FileNotFoundError, EOFError):
        return None


def run_spawned(cfg: TrainConfig, dev_type: str, nproc: int,
                work: Callable = run_rank) -> Dict[str, Any]:
    """Spawn `nproc` ranks that each run `work(cfg, device)` (a module-level function) in a
    process group; return rank 0's result or raise RankError."""
    ctx = mp.get_context("spawn")  # fork would copy this process's OpenMP/CUDA state
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    with tempfile.TemporaryDirectory(prefix="zerokern-train-") as out_dir:
        procs = [ctx.Process(target=_child, args=(r, nproc, store.port, cfg, dev_type, out_dir,
                                                   work),
                             daemon=True) for r in range(nproc)]
        try:
            for p in procs:
                p.start()
            first_fail, killed = None, False
            while any(p.is_alive() for p in procs):
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed and first_fail is None:
                    first_fail = time.monotonic()
                # A feature not available yet needs no other rank's story: stop at once
                # (a slower rank may still be joining the group its peer already left).
                if any(p.exitcode == EXIT_NOT_IMPLEMENTED for p in procs) or \
                        (first_fail is not None and time.monotonic() - first_fail > GRACE_S):
                    killed = True
                    break
                time.sleep(0.05)
        finally:  # also on Ctrl-C: no rank outlives the command
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        outs = [_read(os.path.join(out_dir, f"rank{r}.pt")) for r in range(nproc)]
    del store
    return _collect(procs, outs, killed)


def _collect(procs, outs, killed: bool) -> Dict[str, Any]:
    """Rank 0's result, or RankError with the most useful failure first."""
    if all(p.exitcode == 0 and o and "ok" in o for p, o in zip(procs, outs)):
        return outs[0]["ok"]
    for o in outs:  # a feature not available yet: the clear message, exit 2, no traceback
        if o and "not_implemented" in o:
            raise RankError(o["not_implemented"], EXIT_NOT_IMPLEMENTED)
    lines = []
    for r, (p, o) in enumerate(zip(procs, outs)):
        if o and "error" in o:
            lines.append(f"--- rank {r} raised:\n{o['error'].rstrip()}")
        elif p.exitcode != 0 and not (o and "ok" in o):
            how = ("killed: it was still running after another rank failed"
                   if killed and p.exitcode == -9 else f"exit code {p.exitcode}, no result")
            lines.append(f"--- rank {r}: {how}")
    raise RankError("a rank failed:\n" + "\n".join(lines), 1)
