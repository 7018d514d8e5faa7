"""Fake-CUDA scenarios for the features of issues 35-39 (registered into
tests/support/fake_cuda/scenarios.py's SCENARIOS): FP8 params at stage 3, DeepSpeed's stage-3
keys, and recovery from a live HSDP replica. Each trains like the other scenarios
(scenarios._train) on the rank's fake CUDA device over groups that say "nccl"."""

from __future__ import annotations

from typing import Callable, Dict

import zerokern as zk


def _fp8(hsdp: bool = False):
    from tests.support.fake_cuda.scenarios import _run

    return _run(3, param_format="fp8", mesh=hsdp)


def _ds_keys(rank, world, dev, log):
    """Stage 3 with DeepSpeed's keys (Stage3Runtime.use_schedule): units kept gathered for
    the backward, the root released after the forward."""
    import torch

    from tests.support.fake_cuda.scenarios import BACKEND, Net, _train
    from zerokern.stage3.ds_schedule import Stage3Keys

    torch.manual_seed(0)
    log.phase = "model"
    with dev:
        model = Net()
    log.phase = "construct"
    opt = zk.ZeroAdamW(model, lr=1e-3, stage=3, precision="bf16", bucket_mb=0.01,
                       backend=BACKEND)
    opt.grad_sync.use_schedule(Stage3Keys(max_reuse_distance=10**9, max_live_parameters=10**9,
                                          prefetch_bucket_size=20_000,
                                          param_persistence_threshold=100))
    _train(model, opt, dev, log)


# The source replica's objects, by (replicate group's ranks, call on that rank): the ranks of
# replica 0 play first (ranks 0-3 of the 2x4 mesh), so a receiver takes what its source sent.
_SENT: Dict[tuple, list] = {}


def _replica_stand_ins(rank):
    """What recover_from_replica needs that a fake world cannot give: (1) broadcast_object_list
    delivers the source's objects (the fake group changes nothing: a receiver would keep
    None), replayed from _SENT; (2) zlib reads no bytes of a FakeTensor: tensor_bytes still
    makes its copy (a device tensor's `.cpu()`: recorded as the real one would be), then
    hands zlib nothing."""
    import torch.distributed as dist

    from zerokern.checkpoint import replica

    calls: Dict[tuple, int] = {}
    fake_bcast = dist.broadcast_object_list

    def bcast(object_list, src=None, group=None, **kw):
        fake_bcast(object_list, src, group=group, **kw)
        key = tuple(dist.get_process_group_ranks(group))
        n = calls[key] = calls.get(key, -1) + 1
        if rank == src:
            _SENT[key, n] = list(object_list)
        else:
            object_list[:] = _SENT[key, n]

    def tensor_bytes(t):
        t.detach().cpu()
        return b""

    return (dist, "broadcast_object_list", fake_bcast, bcast), \
        (replica, "tensor_bytes", replica.tensor_bytes, tensor_bytes)


def _replica(stage: int, **kw):
    """An HSDP run, then recover_from_replica (verify on) between steps, then a step more."""
    def run(rank, world, dev, log):
        patches = _replica_stand_ins(rank)
        for mod, name, _, new in patches:
            setattr(mod, name, new)
        try:
            _replica_run(rank, world, dev, log, stage, kw)
        finally:
            for mod, name, old, _ in patches:
                setattr(mod, name, old)
    return run


def _replica_run(rank, world, dev, log, stage, kw):
    if True:
        import torch

        from tests.support.fake_cuda.scenarios import BACKEND, Net, _mesh_2x4, _train
        from zerokern.checkpoint.replica import recover_from_replica

        torch.manual_seed(0)
        log.phase = "model"
        with dev:
            model = Net()
        log.phase = "construct"
        opt = zk.ZeroAdamW(model, lr=1e-3, stage=stage, precision="bf16", bucket_mb=0.01,
                           mesh=_mesh_2x4(), backend=BACKEND, **kw)
        _train(model, opt, dev, log, steps=1)
        log.phase = "recover"
        recover_from_replica(model, opt, source=0, verify=True)
        _train(model, opt, dev, log, steps=1)


def register(scenarios: Dict[str, Callable]) -> None:
    scenarios["stage3-fp8"] = _fp8()
    scenarios["stage3-fp8-hsdp"] = _fp8(hsdp=True)
    scenarios["stage3-ds-keys"] = _ds_keys
    scenarios["stage3-hsdp-replica"] = _replica(3)
    scenarios["stage2-hsdp-replica-offload-cpu"] = _replica(2, offload="cpu")

