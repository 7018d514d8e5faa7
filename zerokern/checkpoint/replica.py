"""`recover_from_replica(model, opt)`: an HSDP replica takes its whole training state from a
live replica over the replicate group, without a checkpoint (issue 39, torchft's idea).

[Note: recovery from a live replica]
With an HSDP mesh (replicate, shard) every replica holds the same state: after each step's
replicate all-reduce, rank s of every replica holds the same shard s of the fp32 master, the
optimizer rule's states, the step counters and the model-dtype values, and every rank holds the
same buffers and frozen params. So a replica whose state was lost can be rebuilt from any live
replica by copying, shard rank by shard rank, over the replicate group (the ranks holding the
same shard), while the other replicas keep theirs. A restart from disk instead stops every
rank, reads the newest checkpoint (every rank: the whole job's state) and recomputes the
steps since it was saved.

What moves is exactly what a checkpoint load writes, read through the same `optimizer_view`
(views.py): every held piece's master and rule states (per-block states through their
per-element form and `after_load`, as reader.py), the per-matrix states, the model-dtype values
(except where they are the master's own memory: fp32 without offload), the step counters, the
model's buffers and frozen params; then as small objects the param groups' hyperparameters
(the LR a scheduler set), the loss-scaler state, and the caller's `client_state` (the data
position, the scheduler: what the training loop needs besides model and optimizer). Transfer:
a tensor of at least DIRECT_BYTES (contiguous, as the views of the flat buffers are) is
broadcast in place as its bytes; smaller ones are packed into chunks of up to CHUNK_BYTES
(one broadcast each, 64-byte aligned pieces). Bytes, not values: bitwise, any dtype.

Order: (1) a pending async save is waited for (its staging reads the state); (2) the checks,
agreed over the data-parallel world before anything changes (a ValueError/TypeError on every
rank): a replicate group exists, `source` is one of its ranks, the placement is one this was
tested on, and each rank's state has the same layout as its source's (a crc of names, ranges,
dtypes, shapes: a replica built with another model or stage would otherwise receive bytes of
another meaning); (3) the broadcasts; (4) with `verify`, every rank's crc32 of all of it is
compared with its source's, agreed over the world (a transport that corrupted bytes raises on
every rank: nothing silently wrong, though the state was written); (5) the receivers rebuild
per-block states, take the hyperparameters and the scaler, and tell the optimizer that its
masters were replaced (`state_loaded`).

What this is not (docs/fault-tolerance.md): it does not bring a new process into a running
job. torch's process groups are fixed at creation, and under torchrun a failed worker restarts
every worker, so in-memory state survives on no rank. torchft gets around both with a
quorum and a process group it reconfigures per step (ProcessGroupBabyNCCL/Gloo), a
Manager that, after a quorum with new members, has a live replica send its state_dict to them
(point to point, or over HTTP), and fault-tolerant DDP/HSDP wrappers that skip a step whose
all-reduce failed. zerokern's groups are built once by the optimizer; here the recovery runs
inside one job whose processes and groups live, for a replica whose state is lost or wrong
(re-initialized, or found corrupt: a NaN or a silent data error caught by comparing the
replicas' crcs, which `verify` computes). Every non-source replica receives (a broadcast
reaches the whole group; a healthy one receives the bytes it holds already).
"""

from __future__ import annotations

import time
import zlib
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from zerokern.platform.device import handle

from ..comm import liveness
from .collective import Collective
from .format import CheckpointError, tensor_bytes
from .views import OptimizerView, model_extras, optimizer_view, whole_frozen_params

CHUNK_BYTES = 64 << 20  # small tensors are packed into broadcasts of up to this many bytes
DIRECT_BYTES = 1 << 20  # a contiguous tensor this large is broadcast in place
ALIGN = 64


def recover_from_replica(model: nn.Module, opt, source: int = 0, *,
                         client_state: Any = None, verify: bool = True) -> Dict[str, Any]:
    """Copy the training state of replica `source` to every other replica of an HSDP mesh,
    over the replicate group ([Note: recovery from a live replica]). Collective: every rank of
    the data-parallel world calls it between steps (not inside a forward/backward or
    `gathered_params()`), with the model and optimizer of its replica; afterwards each rank
    holds, bit for bit, what rank `source` of its replicate group held.

    Args:
        model: the nn.Module the optimizer was built on.
        opt: a zerokern optimizer (ZeroAdamW, ...) built with `mesh=` a 2-D (replicate, shard)
            mesh.
        source: the replica to copy from (its index along the mesh's replicate dim).
        client_state: any picklable object; the source replica's is returned to every rank
            (e.g. the data position and the LR scheduler's state_dict). Ignored elsewhere.
        verify: compare every rank's crc32 of the state received with its source's.

    Returns:
        A dict: "source", "received" (this rank took the state: False on the source replica),
        "bytes" (state bytes moved per rank), "broadcasts", "seconds" (the transfer),
        "verify_seconds", "client_state" (the source replica's).

    Raises:
        TypeError: bad argument types. ValueError: no replicate group (no 2-D mesh, or hpZ),
            `source` not a replica, a placement not supported (offload="nvme",
            offload_params, tensor or pipeline parallel), or a rank whose state layout
            differs from its source's: on every rank, before anything changed.
        CheckpointError: `verify` found a rank whose state differs from its source's after
            the transfer (on every rank).
    """
    if not isinstance(source, int) or isinstance(source, bool):
        raise TypeError(f"source must be an int (a replica index), got {type(source).__name__}")
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be True or False, got {type(verify).__name__}")
    from .async_save import wait

    wait()  # a pending async save stages from this state: it commits (or raises) first
    with whole_frozen_params(opt, write_back=True):  # stage 3 (collective): frozen params whole
        return _recover(model, opt, source, client_state, verify)


def _refusal(opt, source: int) -> Optional[BaseException]:
    rep = opt.comm.replicate
    if rep is None:
        return ValueError("recover_from_replica needs an HSDP mesh: mesh= a 2-D (replicate, "
                          "shard) DeviceMesh with more than one replica (hpz=True shards over "
                          "every rank: no replica holds another's state)")
    if not 0 <= source < rep.world_size:
        return ValueError(f"source={source} is not a replica: the mesh has {rep.world_size} "
                          f"replicas (0..{rep.world_size - 1})")
    if getattr(opt, "offload", None) == "nvme" or getattr(opt, "param_homes", None) is not None:
        return ValueError("recover_from_replica does not support offload='nvme' or "
                          "offload_params (not tested: the state files' own commit protocol); "
                          "restart from a checkpoint instead")
    if opt.plan.has_model_parallel:
        return ValueError("recover_from_replica does not support tensor or pipeline "
                          "parallel params (not tested); restart from a checkpoint instead")
    return None


def _state_tensors(view: OptimizerView, extras) -> List[torch.Tensor]:
    """Everything a load writes, in one order on every replica (module Note)."""
    out: List[torch.Tensor] = []
    seen = set()

    def add(t: torch.Tensor) -> None:
        key = (t.data_ptr(), t.numel(), t.dtype, t.device)
        if key not in seen:  # fp32 without offload: the values are the master itself
            seen.add(key)
            out.append(t)

    for p in view.held:
        for t in p.tensors().values():
            add(t)
    for _, _, t in view.matrix:
        add(t)
    for v in view.values:
        add(v.value)
    for c in view.steps:
        add(c.value)
    for _, _, t in extras:
        add(t.detach())
    return out


def _layout_crc(view: OptimizerView, extras, tensors: List[torch.Tensor]) -> int:
    """A crc of what the bytes mean: names, ranges, rule, dtypes, shapes (not values)."""
    parts = [view.stage, view.precision, view.rule, view.sections, view.world_size, view.rank,
             [(s.name, s.shape, s.group) for s in view.params],
             [(p.param, p.lo, p.hi, tuple(p.states)) for p in view.held],
             [(i, n, tuple(t.shape)) for i, n, t in view.matrix],
             [(v.param, v.lo, v.hi) for v in view.values],
             [c.params for c in view.steps], [(n, a) for n, a, _ in extras],
             [(str(t.dtype), tuple(t.shape), t.device.type) for t in tensors],
             [sorted(k for k in g if k != "params") for g in view.param_groups]]
    return zlib.crc32(repr(parts).encode())


def _crc(tensors: List[torch.Tensor]) -> int:
    """crc32 of every tensor's bytes, in order (the crc of their concatenation).

    [Note: the crc's host reads]
    zlib reads host bytes. A device tensor read with `.cpu()` is a host sync per tensor
    (thousands of small state views at stage 3), so device bytes are staged instead through
    one pinned chunk of up to CHUNK_BYTES: non-blocking copies, then one wait for the stream
    per chunk (the host needs the bytes: the one wait this function makes, as a checkpoint
    write does), then zlib over the chunk. crc32 streams, so the value is the per-tensor
    chain's. Host tensors are read where they are, the pending chunk first."""
    crc = 0
    chunk, at = None, 0
    dev = None

    def flush() -> None:
        nonlocal crc, at
        if at:
            if handle(dev).has_streams:
                handle(dev).current_stream(dev).synchronize()  # the host reads the chunk
            crc = zlib.crc32(tensor_bytes(chunk[:at]), crc)
            at = 0

    for t in tensors:
        flat = _bytes_of(t.detach().contiguous())
        if flat.device.type == "cpu":
            flush()
            crc = zlib.crc32(tensor_bytes(flat), crc)
            continue
        if dev is not None and flat.device != dev:
            flush()
        if chunk is None:
            size = min(CHUNK_BYTES, sum(x.numel() * x.element_size() for x in tensors
                                        if x.device.type != "cpu"))
            chunk = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        dev = flat.device
        i = 0
        while i < flat.numel():
            n = min(flat.numel() - i, chunk.numel() - at)
            chunk[at:at + n].copy_(flat[i:i + n], non_blocking=True)
            at, i = at + n, i + n
            if at == chunk.numel():
                flush()
    flush()
    return crc


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as a flat uint8 view (t contiguous)."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _transfer(tensors: List[torch.Tensor], group, src: int, sending: bool, what: str) -> int:
    """Broadcast every tensor's bytes from global rank `src` (module Note); returns the number
    of broadcasts."""
    def bcast(buf: torch.Tensor) -> None:
        liveness.watched(lambda: dist.broadcast(buf, src, group=group), what, group)

    n = 0
    small: Dict[torch.device, List[torch.Tensor]] = {}
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if t.is_contiguous() and nbytes >= DIRECT_BYTES:
            bcast(_bytes_of(t))  # in place: the receivers' state is written directly
            n += 1
        elif nbytes:
            small.setdefault(t.device, []).append(t)
    for dev, ts in small.items():
        i = 0
        while i < len(ts):  # one chunk: as many tensors as fit (a bigger one alone)
            j, size = i, 0
            while j < len(ts) and (j == i or size + _aligned(
                    ts[j].numel() * ts[j].element_size()) <= CHUNK_BYTES):
                size += _aligned(ts[j].numel() * ts[j].element_size())
                j += 1
            buf = torch.empty(size, dtype=torch.uint8, device=dev)
            at = 0
            if sending:
                for t in ts[i:j]:
                    nb = t.numel() * t.element_size()
                    buf[at:at + nb].copy_(_bytes_of(t.contiguous()))
                    at += _aligned(nb)
            bcast(buf)
            n += 1
            if not sending:
                at = 0
                for t in ts[i:j]:
                    nb = t.numel() * t.element_size()
                    t.copy_(buf[at:at + nb].view(t.dtype).view(t.shape))
                    at += _aligned(nb)
            i = j
    return n


@torch.no_grad()
def _recover(model: nn.Module, opt, source: int, client_state: Any,
             verify: bool) -> Dict[str, Any]:
    view = optimizer_view(model, opt)  # TypeError/ValueError: not a zerokern optimizer
    world = Collective(view.world_group, view.world_rank, view.world_world_size)
    world.agree(_refusal(opt, source))
    rep = opt.comm.replicate
    group, src = rep.group, dist.get_global_rank(rep.group, source)
    sending = rep.rank == source
    what = f"recover_from_replica (replica {source} to the others)"
    extras = model_extras(model, view)
    tensors = _state_tensors(view, extras)

    def from_source(obj: Any) -> Any:
        box = [obj if sending else None]
        liveness.watched(lambda: dist.broadcast_object_list(box, src, group=group), what, group)
        return box[0]

    mine = _layout_crc(view, extras, tensors)
    theirs = from_source(mine)
    world.agree(None if theirs == mine else ValueError(
        f"recover_from_replica: rank {dist.get_rank()}'s state has another layout than its "
        f"source's (global rank {src}): build every replica with the same model, param "
        "groups, stage, precision and optimizer"))
    small = from_source({"groups": [{k: v for k, v in g.items() if k != "params"}
                                    for g in view.param_groups],
                         "scaler": view.scaler.state_dict(), "client_state": client_state}
                        if sending else None)
    t0 = time.perf_counter()
    n = _transfer(tensors, group, src, sending, what)
    if not sending:
        for rebuild in view.after_load:  # per-block states from the per-element ones received
            rebuild()
        for g, saved in zip(view.param_groups, small["groups"]):
            g.update(saved)
        view.scaler.load_state_dict(small["scaler"])
        if hasattr(opt, "state_loaded"):
            opt.state_loaded()  # the masters were replaced (core/model_sync.py)
    secs = time.perf_counter() - t0
    t1 = time.perf_counter()
    if verify:
        got = _crc(tensors)
        want = from_source(got)
        world.agree(None if got == want else CheckpointError(
            f"recover_from_replica: rank {dist.get_rank()}'s state differs from its source's "
            f"(global rank {src}) after the transfer (crc32 {got:08x}, source {want:08x})"))
    return {"source": source, "received": not sending,
            "bytes": sum(t.numel() * t.element_size() for t in tensors), "broadcasts": n,
            "seconds": secs, "verify_seconds": time.perf_counter() - t1,
            "client_state": small["client_state"]}
