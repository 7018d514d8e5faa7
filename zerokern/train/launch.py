"""Where `zerokern train` runs its ranks: spawned here (zerokern/tools/spawn.py, which also says
why nothing can hang), under torchrun, or in this process."""

from __future__ import annotations

import datetime
import math
import os
import sys
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from zerokern.comm.errors import RankAborted
from zerokern.platform.device import handle
from zerokern.platform.host import usable_cpus
from zerokern.tools.spawn import PG_TIMEOUT_ENV, RankFailure, _env_s, spawn_ranks

from . import events
from .config import TrainConfig, accumulation
from .loop import run_rank as run_flat_rank
from .pipeline import run_rank_pipelined

# [Note: a store per attempt]
# torchrun's c10d rendezvous (torch 2.13) hands every attempt of a job the same store, its
# agent's (TORCHELASTIC_USE_AGENT_STORE=True), keys and all: after `--max-restarts` restarted
# the workers, the new ranks found the dead ones' keys. gloo's rendezvous read a dead rank's
# address ("Gloo connectFullMesh failed ... Connection refused", 1 restart of 2 here), and
# zerokern's liveness (comm/liveness.py) found the dead pids of the attempt before and raised
# PeerLost at once (every restart): the job used up its restarts and failed. So each attempt's
# process group lives under its own prefix, the restart count. That count is the agent's own,
# the same on every rank of one node; across nodes it is not (torch issue 135712), and there
# the job keeps torch's store (a warning names TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, with
# which rank 0 hosts a fresh store each attempt).
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
    cuda = handle("cuda")
    if cfg.device == "cuda" and not cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch")
    if cfg.device == "auto":
        return "cuda" if cuda.is_available() else "cpu"
    return cfg.device


def check_mesh(cfg: TrainConfig, world: Optional[int]) -> None:
    """--mesh RxS or PPxTPxDP must cover the `world` ranks (None: not known yet); --hpz needs
    --mesh RxS and --stage 3; --micro-batches and --schedule need --mesh PPxTPxDP. ValueError
    naming the flag."""
    three_d = cfg.mesh is not None and len(cfg.mesh) == 3
    if cfg.hpz and (cfg.mesh is None or three_d):
        raise ValueError("--hpz needs --mesh RxS (the secondary copy is sharded over S, the "
                         "ranks of a node)")
    if cfg.hpz and cfg.stage != 3:
        raise ValueError(f"--hpz is for --stage 3 (its params are sharded), got --stage "
                         f"{cfg.stage}")
    if not three_d and (cfg.micro_batches is not None or cfg.schedule != "1f1b"):
        raise ValueError("--micro-batches and --schedule are for a pipeline mesh "
                         "(--mesh PPxTPxDP)")
    n = mesh_ranks(cfg)
    if n is not None and n < 2:
        raise ValueError(f"--mesh {'x'.join(map(str, cfg.mesh))} is one rank: give a mesh of "
                         ">= 2 ranks, or no --mesh")
    if n is not None and world is not None and n != world:
        raise ValueError(f"--mesh {'x'.join(map(str, cfg.mesh))} has {n} ranks but the job "
                         f"has {world} (--nproc, or torchrun's nnodes x nproc-per-node)")


def mesh_ranks(cfg: TrainConfig) -> Optional[int]:
    """The ranks --mesh spans (None without one)."""
    return None if cfg.mesh is None else math.prod(cfg.mesh)


def plan(cfg: TrainConfig) -> Tuple[str, int]:
    """(device type, number of ranks to spawn) for a run outside torchrun; checks --nproc and
    --offload against --stage, --mesh against --nproc."""
    if cfg.offload and cfg.stage == 0:
        raise ValueError(f"--offload {cfg.offload} needs --stage 1, 2 or 3 (stage 0 keeps the "
                         "full optimizer state on every rank)")
    if cfg.quantize in ("weights", "both") and cfg.stage != 3:
        raise ValueError(f"--quantize {cfg.quantize} quantizes stage 3's param gathers: it "
                         f"needs --stage 3, got --stage {cfg.stage}")
    if cfg.quantize == "grads" and cfg.stage == 0:
        raise ValueError("--quantize grads needs --stage 1, 2 or 3 (stage 0 all-reduces)")
    check_mesh(cfg, cfg.nproc)
    dev = resolve_device(cfg)
    n = _nproc(cfg, dev)
    accumulation(cfg, n)  # --global-batch against the ranks (ValueError naming the flags)
    return dev, n


def _nproc(cfg: TrainConfig, dev: str) -> int:
    mesh_n = mesh_ranks(cfg)
    if dev == "cuda":
        n_gpu = handle("cuda").device_count()
        nproc = cfg.nproc or mesh_n or n_gpu
        if nproc > n_gpu:
            raise ValueError(f"--nproc {nproc}: only {n_gpu} GPU(s) visible (one rank per GPU)")
        return nproc
    return cfg.nproc or mesh_n or 2


def _threads_per_rank(local_world: int) -> int:
    # Each rank gets its share of the cores, as the step benchmark does: more OpenMP threads
    # than cores make the ranks' threads spin against each other.
    return max(1, usable_cpus() // max(1, local_world))


def _device(dev_type: str, local_rank: int) -> torch.device:
    if dev_type == "cpu":
        return torch.device("cpu")
    handle(dev_type).set_device(local_rank)
    return torch.device(dev_type, local_rank)


def _not_implemented_message(e: NotImplementedError, cfg: TrainConfig) -> str:
    flags = " ".join(f for f, on in ((f"--stage {cfg.stage}", cfg.stage == 3),
                                     (f"--offload {cfg.offload}", cfg.offload)) if on)
    return f"{flags or 'this configuration'} is not available yet: {e}"


def run_rank(cfg: TrainConfig, device: torch.device) -> Dict[str, Any]:
    """This rank's job: the GPT in pipeline stages with --mesh PPxTPxDP (pipeline.py), else
    the whole GPT on every rank (loop.py)."""
    if cfg.mesh is not None and len(cfg.mesh) == 3:
        return run_rank_pipelined(cfg, device)
    return run_flat_rank(cfg, device)


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
    if dev_type == "cuda" and local_rank >= handle("cuda").device_count():
        # one rank per GPU: say so before set_device fails inside CUDA (issue 24, item 7)
        raise ValueError(f"torchrun started LOCAL_RANK {local_rank} but this machine has "
                         f"{handle('cuda').device_count()} GPU(s) (one rank per GPU): lower "
                         "--nproc_per_node, or pass --device cpu for gloo ranks on the CPU")
    check_mesh(cfg, int(os.environ["WORLD_SIZE"]))
    torch.set_num_threads(_threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    device = _device(dev_type, local_rank)
    timeout = datetime.timedelta(seconds=_env_s(PG_TIMEOUT_ENV, PG_TIMEOUT_S))
    backend = "nccl" if dev_type == "cuda" else "gloo"  # (the env var wins)
    store = attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout, store=store,
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    events.record("start", rank=dist.get_rank(), world_size=dist.get_world_size(),
                  restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    try:
        res = run_rank(cfg, device)
        return res if dist.get_rank() == 0 else None
    except NotImplementedError as e:
        raise RankError(_not_implemented_message(e, cfg), EXIT_NOT_IMPLEMENTED) from None
    except RankAborted as e:  # a peer failed or was lost: the supervisor's detection time
        events.record("lost", rank=dist.get_rank(), origin=getattr(e, "origin", None),
                      error=type(e).__name__)
        raise
    finally:
        dist.destroy_process_group()


def attempt_store(timeout: datetime.timedelta):
    """The c10d store of this torchrun attempt ([Note: a store per attempt]), or None: let
    init_process_group's env:// make it (rank 0 hosts a new one each attempt)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0" and \
                os.environ.get("RANK") == "0":
            print("zerokern train: torchrun shares its agent's store across restarts, and with "
                  "more than one node the restart count is not the same on every node (torch "
                  "issue 135712): a restart may read the previous attempt's keys. Set "
                  "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun with --max-restarts",
                  file=sys.stderr, flush=True)
        return None
    tcp = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        is_master=False, timeout=timeout)
    return dist.PrefixStore(f"zerokern/attempt{attempt}", tcp)


# ---------------------------------------------------------------------------- spawned ranks


def _cuda_of(rank: int) -> torch.device:
    return torch.device("cuda", rank)


def _train_rank(rank: int, world: int, cfg: TrainConfig, dev_type: str, work: Callable):
    try:
        res = work(cfg, _device(dev_type, rank))
    except NotImplementedError as e:  # the clear message travels as the rank's exception
        raise NotImplementedError(_not_implemented_message(e, cfg)) from None
    return res if rank == 0 else None


def run_spawned(cfg: TrainConfig, dev_type: str, nproc: int,
                work: Callable = run_rank) -> Dict[str, Any]:
    """Spawn `nproc` ranks that each run `work(cfg, device)` (a module-level function) in a
    process group ([Note: no hangs] in zerokern/tools/spawn.py); return rank 0's result or raise
    RankError with the most useful failure first."""
    cuda = dev_type == "cuda"
    try:
        return spawn_ranks(_train_rank, nproc, cfg, dev_type, work,
                           backend="nccl" if cuda else "gloo",
                           threads=_threads_per_rank(nproc), grace=GRACE_S,
                           pg_timeout=PG_TIMEOUT_S, device_of=_cuda_of if cuda else None,
                           exit_codes={NotImplementedError: EXIT_NOT_IMPLEMENTED},
                           # a feature not available yet needs no other rank's story
                           stop_codes=(EXIT_NOT_IMPLEMENTED,))[0]
    except RankFailure as e:
        for o in e.outcomes:  # the clear message, exit 2, no traceback
            if o.exitcode == EXIT_NOT_IMPLEMENTED and o.message:
                raise RankError(o.message.split(": ", 1)[-1], EXIT_NOT_IMPLEMENTED) from None
        lines = []
        for o in e.outcomes:
            if o.error is not None:
                lines.append(f"--- rank {o.rank} raised:\n{o.error.rstrip()}")
            elif not o.ok:
                how = (e.why  # killed: after a timeout or another rank's failure, which
                       if e.why and o.exitcode == -9  # and the setting to raise (spawn.py)
                       else f"exit code {o.exitcode}, no result")
                lines.append(f"--- rank {o.rank}: {how}")
        raise RankError("a rank failed:\n" + "\n".join(lines), 1) from None
