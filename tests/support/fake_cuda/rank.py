"""One process plays every rank of a world on fake CUDA (see __init__.py).

    python -m tests.support.fake_cuda.rank WORLD SCENARIO [SCENARIO ...]
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

SHIM = ctypes.CDLL(os.environ["ZK_FAKE_CUDA_SHIM"], mode=ctypes.RTLD_GLOBAL)  # before torch

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from . import record  # noqa: E402
from .cuda_stubs import install as install_cuda_stubs  # noqa: E402
from .scenarios import SCENARIOS  # noqa: E402

LOG = record.LOG
GROUPS: dict = {}  # ProcessGroup -> creation index on this rank (the same on every rank)


def _patch_dist() -> None:
    """The fake groups say "nccl", and every group gets a creation index for the records."""
    real_new_group = dist.new_group
    real_get_backend = dist.get_backend

    def new_group(ranks=None, *a, backend=None, **kw):
        g = real_new_group(ranks, *a, backend=None, **kw)  # the world's "fake" backend
        GROUPS[g] = (len(GROUPS), backend or "nccl")
        return g

    def get_backend(group=None):
        real_get_backend(group)  # raises as torch does for a group this rank is not in
        g = group if group is not None else dist.group.WORLD
        return GROUPS.get(g, (0, "nccl"))[1]

    def all_gather_object(object_list, obj, group=None):
        # Host objects: every rank of a fake world is taken to agree with this one.
        _record_object("all_gather_object", group)
        for i in range(len(object_list)):
            object_list[i] = obj

    def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
        _record_object("broadcast_object_list", group)  # this rank's objects stand for src's

    dist.new_group = new_group
    dist.get_backend = get_backend
    dist.all_gather_object = all_gather_object
    dist.broadcast_object_list = broadcast_object_list
    torch.cuda.nccl.version = lambda: (2, 27, 3)


def _record_object(op: str, group) -> None:
    g = group if group is not None else dist.group.WORLD
    record.LOG.collectives.append({"op": op, "group": record.group_name(g), "shapes": [],
                                   "dtypes": [], "devices": ["host"],
                                   "phase": record.LOG.phase})


def _stand_ins() -> None:
    """What cannot run on FakeTensors, and what stands in for it (each says why)."""
    from zerokern.layout import param_alias

    # DLPack exports a data pointer, which a FakeTensor has not: the param aliases its flat
    # buffer through a plain view instead (same elements; only the storage object differs).
    param_alias.to_dlpack = lambda t: t
    param_alias.from_dlpack = lambda t: t

    # The kernels' overlap check compares data pointers, which FakeTensors have not: the same
    # check over (storage, byte range) stands in (with the plain-view aliases above, a param
    # shares its flat buffer's storage, as the real DLPack alias shares its memory).
    from zerokern.kernels import adamw8bit, lion, validate

    def check_no_overlap(bufs: dict) -> None:
        spans = [(t.untyped_storage()._cdata, t.storage_offset() * t.element_size(),
                  (t.storage_offset() + t.numel()) * t.element_size(), name)
                 for name, t in bufs.items() if t.numel()]
        for i, (st, lo, hi, name) in enumerate(spans):
            for st2, lo2, hi2, name2 in spans[:i]:
                if st == st2 and lo < hi2 and lo2 < hi:
                    raise ValueError(f"{name} overlaps {name2} in memory; each buffer must be "
                                     "distinct")

    for mod in (validate, lion, adamw8bit):
        mod.check_no_overlap = check_no_overlap


def _no_triton() -> None:
    """A Triton launch on a FakeTensor would read a null pointer: every kernel must reach the
    device through its custom op (kernels/custom_ops.py), whose fake implementation runs."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return

    def run(self, *a, **k):
        record.LOG.note("triton_launch", getattr(self, "__name__", repr(self)))
        raise RuntimeError("a Triton kernel was launched on fake tensors")

    JITFunction.run = run


def _forget_groups() -> None:
    """zerokern caches process groups per module; a new rank's world has new groups."""
    from zerokern.comm import collectives, host_agree, mesh, tp

    for cache in (mesh._WORLD_GROUPS, collectives._SPLIT_GROUPS, collectives._CHANNELS,
                  host_agree._HOST_GROUPS, tp._TP_GROUPS):
        cache.clear()


def play(scenario: str, rank: int, world: int) -> dict:
    record.LOG = LOG = record.Log()
    GROUPS.clear()
    _forget_groups()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    GROUPS[dist.group.WORLD] = (0, "nccl")
    error = None
    local = rank % 8
    torch.cuda.set_device(local)  # as a torchrun script does with LOCAL_RANK
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake, record.Recorder(fake):
            SCENARIOS[scenario](rank, world, torch.device("cuda", local), LOG)
    except Exception as e:  # noqa: BLE001 - reported in the record
        import traceback

        error = ("".join(traceback.format_tb(e.__traceback__)[-8:])
                 + f"{type(e).__name__}: {str(e)[:1500]}")
    seen: dict = {}  # a communicator -> its index in this rank's first uses
    for c in LOG.collectives:
        c["group_ranks"] = c["group"].split(":")[0]
        i = seen.setdefault(c["group"], len(seen))
        c["group"] = f"g{i}/{len(c['group_ranks'].split(','))}"
    dist.destroy_process_group()
    return {"rank": rank, "device": f"cuda:{local}", "error": error, "events": LOG.events,
            "collectives": LOG.collectives, "waits": LOG.waits, "kernels": LOG.kernels}


def main() -> None:
    world, scenarios = int(sys.argv[1]), sys.argv[2:]
    install_cuda_stubs(record, SHIM)
    _patch_dist()
    _stand_ins()
    _no_triton()
    for scenario in scenarios:
        for rank in range(world):
            rec = play(scenario, rank, world)
            rec["scenario"] = scenario
            print("ZKREC " + json.dumps(rec), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the autograd engine's device threads abort a normal interpreter exit


if __name__ == "__main__":
    main()
