"""A replica quorum: the process groups of an HSDP job whose replicas run as separate launcher
jobs, formed again when a replica is replaced (issue 39, torchft's idea).

[Note: a replica quorum]
torch's process groups are fixed at creation, and under torchrun a failed worker restarts
every worker of its job, so a job of one torchrun keeps nothing in memory across a failure.
Here each replica (the ranks holding one copy of the sharded state: one row of the
(replicate, shard) mesh) is a job of its own (its own torchrun, `--max-restarts`), and the
replicas meet at a *lighthouse*: a TCPStore that no replica hosts (`serve`; torchft's
lighthouse is a server of the same role). Each formation of the whole world is an *epoch*:

1. every rank of every replica calls `Quorum.form()`: it destroys the process groups it had
   (`dist.destroy_process_group()`), and initializes the default group for the next epoch,
   over the lighthouse store under the prefix `zerokern/quorum/<epoch>/`, with rank
   replica x S + shard rank of R x S; init_process_group waits (up to `timeout_s`) until every
   rank of the epoch has joined;
2. the epoch: a rank that took part in the last epoch joins the next one (it caught the
   failure of that epoch's groups); a new process (a replaced replica's first start) joins
   the epoch after the last one formed (the key `zerokern/quorum/formed`, set by every rank
   once its epoch is formed), which is the one the live ranks go to after the failure;
3. the (replicate, shard) DeviceMesh of the new groups is returned; the caller builds its
   model and optimizer on it (checkpoint/replica_join.py: the live ranks copy their state
   into the new ones, then a live replica sends its state to the new replica).

The replicas' sizes are fixed (R replicas of S ranks): an epoch forms only when every rank is
there, so the live replicas wait for the replacement (up to `timeout_s`, then a clear error)
rather than go on with fewer replicas and a smaller global batch (torchft's choice): a run
with a replaced replica is then the run never interrupted, bit for bit.

Not handled: a second failure while an epoch forms (init_process_group's timeout raises on
the ranks waiting: the job stops with an error, and restarts from its checkpoint); the
lighthouse's own loss (every rank's store operations fail: an error on every rank).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from . import collectives
from . import mesh as mesh_groups

LIGHTHOUSE_ENV = "ZEROKERN_LIGHTHOUSE"  # host:port of the lighthouse (`connect()` default)
PREFIX = "zerokern/quorum"
TIMEOUT_S = 300.0  # how long an epoch waits for its last rank (a replica restarting: seconds)


def serve(port: int = 0, host: str = "0.0.0.0") -> dist.TCPStore:
    """Host the lighthouse: a TCPStore server the replicas connect to (run it where no replica
    runs, and keep the returned store alive as long as the job: it is the server).

    Args:
        port: the TCP port (0: a free one; read it from `.port`).
        host: the address to listen on.
    """
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=TIMEOUT_S))


def connect(address: Optional[str] = None, timeout_s: float = TIMEOUT_S) -> dist.TCPStore:
    """A client of the lighthouse.

    Args:
        address: "host:port" of the lighthouse (`serve`); default $ZEROKERN_LIGHTHOUSE.
        timeout_s: how long a store operation waits.
    """
    address = address or os.environ.get(LIGHTHOUSE_ENV)
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"address must be 'host:port' (or set ${LIGHTHOUSE_ENV}), got "
                         f"{address!r}")
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"address: the port of {address!r} is not a number")
    return dist.TCPStore(host, int(port), is_master=False,
                         timeout=timedelta(seconds=timeout_s))


def _count(name: str, value, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


class Quorum:
    """This rank's place in a replica quorum ([Note: a replica quorum]).

    Args:
        store: the lighthouse (`connect()`).
        replica: this rank's replica (0..replicas-1).
        replicas: the number of replicas R.
        shards: the ranks of one replica S (its torchrun's world size).
        shard_rank: this rank in its replica (its torchrun's RANK).
        backend: "gloo" (CPU tensors) or "nccl".
        timeout_s: how long an epoch waits for its last rank, and the groups' timeout.
    """

    def __init__(self, store: dist.Store, replica: int, replicas: int, shards: int,
                 shard_rank: int, backend: str = "gloo", timeout_s: float = TIMEOUT_S) -> None:
        if not isinstance(store, dist.Store):
            raise TypeError(f"store must be a torch.distributed.Store (connect()), got "
                            f"{type(store).__name__}")
        self.replicas = _count("replicas", replicas, 2)
        self.shards = _count("shards", shards, 1)
        self.replica = _count("replica", replica, 0)
        self.shard_rank = _count("shard_rank", shard_rank, 0)
        if replica >= replicas:
            raise ValueError(f"replica={replica} is not one of the {replicas} replicas")
        if shard_rank >= shards:
            raise ValueError(f"shard_rank={shard_rank} is not one of the {shards} ranks")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
        self.store, self.backend, self.timeout_s = store, backend, float(timeout_s)
        self.epoch: Optional[int] = None  # the last epoch this process took part in
        self.form_seconds: Optional[float] = None

    @property
    def rank(self) -> int:
        """This rank in the whole world: replica x S + shard rank."""
        return self.replica * self.shards + self.shard_rank

    @property
    def world_size(self) -> int:
        """Every rank of every replica: R x S."""
        return self.replicas * self.shards

    def formed(self) -> int:
        """The last epoch every rank formed (0: none yet)."""
        return int(self.store.add(f"{PREFIX}/formed", 0))

    def form(self):
        """Leave this process's groups, form the next epoch's, and return its (replicate,
        shard) DeviceMesh (blocks until every rank of the world has joined)."""
        from torch.distributed.device_mesh import init_device_mesh

        t0 = time.perf_counter()
        if dist.is_initialized():
            dist.destroy_process_group()
        collectives.forget_groups()
        mesh_groups.forget_groups()
        epoch = (self.formed() if self.epoch is None else self.epoch) + 1
        store = dist.PrefixStore(f"{PREFIX}/{epoch}/", self.store)
        dist.init_process_group(self.backend, store=store, rank=self.rank,
                                world_size=self.world_size,
                                timeout=timedelta(seconds=self.timeout_s))
        mesh = init_device_mesh("cpu" if self.backend == "gloo" else "cuda",
                                (self.replicas, self.shards),
                                mesh_dim_names=("replicate", "shard"))
        self.epoch = epoch
        self.store.set(f"{PREFIX}/formed", str(epoch))
        self.form_seconds = time.perf_counter() - t0
        return mesh
