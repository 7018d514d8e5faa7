"""offload_params: the argument and free-space checks (before the model is touched), the
DESIGN §4 formula with the param column moved, and `zerokern estimate`'s param-offload bytes.
The runtime is param_offload.py."""

from __future__ import annotations

from collections import Counter

import torch

from zerokern.geometry.dtensor_params import local_shape
from zerokern.options.args import OFFLOAD_PARAMS as KINDS  # noqa: F401 (re-exported)
from zerokern.options.args import check_offload_params as check_args  # noqa: F401
from zerokern.state import aligned_io as aio
from zerokern.state.nvme_state import check_free_space

NOTES = {  # zerokern estimate's note per kind
    "cpu": "offload_params='cpu': the 16-bit param and frozen shards live in host memory "
           "between uses (pinned with nccl); the device holds none between steps",
    "nvme": "offload_params='nvme': the 16-bit param shards in files, two halves each (a "
            "step writes the half it does not read), frozen shards one; the host holds a "
            "fetch buffer, a step buffer and read-ahead buffers of the largest shard",
}


def _shard_numel(shapes, world_size: int, slot_align: int = 1) -> int:
    """S of a stage-3 buffer of params of `shapes`: ShardedFlat's own layout (partition.py,
    its slots aligned to slot_align: [Note: block-aligned slots])."""
    from .sharded_flat import unit_layout

    return unit_layout(shapes, world_size, slot_align).shard_numel


def _shard_bytes(shapes, world_size: int, e: int, slot_align: int = 1) -> int:
    """align_up(S·e): a stage-3 buffer's shard as a file region."""
    return aio.align_up(_shard_numel(shapes, world_size, slot_align) * e)


def check_space(path: str, units, trainable, dtype: torch.dtype, world_size: int,
                offload_params, rule=None) -> None:
    """offload="nvme" at stage 3: the bytes this rank's files will take (state: what
    NvmeOffloader.disk_need says for `rule`, one Rule or a list of one per param group (the
    master and each rule state, 2 aligned halves per trainable buffer); offload_params="nvme":
    2 halves of the shard, one for a frozen buffer) against the free space of `path`, before
    the model is touched. The files are preallocated at construction all the same, which
    catches what this misses (other writers, file systems that count blocks differently)."""
    from zerokern.rules import slot_align
    from zerokern.rules.registry import adamw_rule
    from zerokern.state.offload_nvme import NvmeOffloader

    rule = adamw_rule() if rule is None else rule
    e = torch.empty((), dtype=dtype).element_size()
    group_of = {id(p): gi for gi, ps in enumerate(trainable) for p in ps}
    need = 0
    for u in units:
        for gi in range(len(trainable)):
            shapes = [local_shape(p) for p in u.params if group_of.get(id(p)) == gi]
            if shapes:
                r = rule[gi] if isinstance(rule, (list, tuple)) else rule  # one per group
                a = slot_align(r)
                need += NvmeOffloader.disk_need(r, [_shard_numel(shapes, world_size, a)])
                if offload_params == "nvme":
                    need += 2 * _shard_bytes(shapes, world_size, e, a)
        if u.frozen and offload_params == "nvme":
            need += _shard_bytes([local_shape(p) for p in u.frozen], world_size, e)
    check_free_space(path, need)


def formula_(formula: dict, kind: str) -> None:
    """DESIGN §4 with param offload: the 16-bit param (and frozen) shard leaves the device
    total for the host ("cpu") or the disk ("nvme", two halves of the trainable shard)."""
    p, fr = formula["params"], formula.get("frozen", 0)
    formula["total"] -= p + fr
    if kind == "cpu":
        formula["host"] = formula.get("host", 0) + p + fr
    else:
        formula["disk"] = formula.get("disk", 0) + 2 * p + fr


def estimate_(b: dict, host: dict, disk: dict, flats, frozen, rank: int, kind: str) -> None:
    """zerokern estimate with offload_params: the same moves as memory_report() sees after a
    step (device: no param or frozen shard, nor their padding; host or disk: the homes)."""
    host.update(params=0, frozen=0, param_staging=0)
    if kind == "nvme":
        disk.update(params=0, frozen=0)
    halves = []
    for f in list(flats) + list(frozen):
        L, e = f.layout, f.param_shard.element_size()
        S = L.shard_numel
        spad = L.state_padding(rank, replicated=False)  # this rank's shard's padding
        b["params" if f.trainable else "frozen"] -= (S - spad) * e
        b["padding"] -= spad * e
        half = aio.align_up(S * e)
        halves.append((half, f.trainable))
        if kind == "cpu":
            host["params" if f.trainable else "frozen"] += S * e
        else:
            disk["params" if f.trainable else "frozen"] += (2 if f.trainable else 1) * half
    if kind == "nvme" and halves:  # fetch buffer, step buffer, read-ahead buffers
        train = [h for h, t in halves if t]
        per_unit = Counter(f.unit_index for f in list(flats) + list(frozen))
        host["param_staging"] = (1 + max(per_unit.values())) * max(h for h, _ in halves) \
            + (max(train) if train else 0)
