"""The runs the fake-CUDA harness plays (issue 34, item 1): each builds a model on the rank's
device, a zerokern optimizer, and trains 2 steps, setting record.LOG.phase as it goes.

Data-dependent control flow comes from Python values (rank, step), never from tensor values:
fake tensors have none.
"""

from __future__ import annotations

import os
from typing import Callable, Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

import zerokern as zk

D, LAYERS, BATCH, STEPS = 64, 6, 8, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x, branch=False):
        h = F.gelu(self.up(self.ln(x)))
        return h[..., :D] if branch else self.down(h)


class Net(nn.Module):
    """LAYERS blocks (the stage-3 units); `plan(step)` says which blocks run, in what order."""

    def __init__(self, plan=None) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.out = nn.Linear(D, 1)
        self.plan = plan
        self.step = 0
        self.ckpt = None  # a checkpoint function each block runs through (or None)

    def forward(self, x):
        x = self.inp(x)
        order = self.plan(self.step) if self.plan else range(LAYERS)
        for i in order:
            if isinstance(i, tuple):  # a branch inside the block: its last Linear unused
                x = x + self.blocks[i[0]](x, branch=True)
            elif self.ckpt is not None:
                x = x + self.ckpt(self.blocks[i], x)
            else:
                x = x + self.blocks[i](x)
        return self.out(x).float()


def _train(model, opt, dev, log, steps=STEPS, backward=None):
    for step in range(steps):
        model.step = step
        x = torch.randn(BATCH, D, device=dev)
        log.phase = "forward"
        loss = model(x.to(next(model.parameters()).dtype)).square().mean()
        log.phase = "backward"
        (backward or opt.backward)(loss)
        log.phase = "step"
        opt.step()
        log.phase = "zero_grad"
        opt.zero_grad()


def _mesh_2x4():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cuda", (2, 4), mesh_dim_names=("replicate", "shard"))


def _run(stage, precision="bf16", plan=None, opt_cls=None, mesh=False, **kw):
    """A run of `opt_cls` (ZeroAdamW) at `stage` on Net(plan); mesh=True: a 2x4 HSDP mesh."""
    def run(rank, world, dev, log):
        torch.manual_seed(0)
        log.phase = "model"
        with dev:  # (Module.to swaps FakeTensor params, which their weakrefs forbid)
            model = Net(plan)
        log.phase = "construct"
        cls = opt_cls or zk.ZeroAdamW
        extra = dict(kw)
        if mesh:
            extra["mesh"] = _mesh_2x4()
        extra.setdefault("backend", BACKEND)
        opt = cls(model, lr=1e-3, stage=stage, precision=precision, bucket_mb=0.01, **extra)
        _train(model, opt, dev, log)
    return run


def _skips(rank):
    """Rank-dependent control flow: odd ranks skip block 1 and take a branch in block 2 that
    leaves its last Linear unused; rank 2 skips the last block, rank 3 the first two; step 1 calls the blocks out of
    registration order (the same order on every rank: a unit called again after the schedule
    passed it is gathered again, which FSDP and [Note: stage-3 collective order] rule 1 allow
    only when every rank calls it again)."""
    def plan(step):
        if step == 1:
            return [1, 0, 3, 2, 4, 5] if rank % 2 == 0 else [(1,), 0, 3, 2, 4, 5]
        if rank == 3:  # the first blocks skipped: the end of its backward gathers them
            return [4, 5]
        if rank % 2:
            return [0, (2,), 3, 4, 5]
        if rank == 2:
            return [0, 1, 2, 3, 4]
        return list(range(LAYERS))
    return plan


def _data_dependent(stage, **kw):
    def run(rank, world, dev, log):
        return _run(stage, plan=_skips(rank), **kw)(rank, world, dev, log)
    return run


# "auto" (the default, Triton's custom ops on CUDA); "reference" runs plain torch ops, for code
# that predates the custom ops (showing a finding on an old checkout).
BACKEND = os.environ.get("ZK_FAKE_CUDA_BACKEND", "auto")
SCENARIOS: Dict[str, Callable] = {}
for _stage in range(4):
    SCENARIOS[f"stage{_stage}-bf16"] = _run(_stage)
    SCENARIOS[f"stage{_stage}-fp16"] = _run(_stage, "fp16", max_grad_norm=1.0)
    if _stage:
        SCENARIOS[f"stage{_stage}-offload-cpu"] = _run(_stage, offload="cpu")
    SCENARIOS[f"stage{_stage}-data-dependent"] = _data_dependent(_stage)
SCENARIOS["stage3-offload-params-cpu"] = _run(3, offload_params="cpu")
SCENARIOS["stage2-compact"] = _run(2, master="compact")
SCENARIOS["stage1-hsdp-data-dependent"] = _data_dependent(1, mesh=True)
SCENARIOS["stage2-hsdp-data-dependent"] = _data_dependent(2, mesh=True)
SCENARIOS["stage2-hsdp"] = _run(2, mesh=True)
SCENARIOS["stage3-hsdp"] = _run(3, mesh=True)
SCENARIOS["stage3-hpz"] = _run(3, mesh=True, hpz=True)
SCENARIOS["stage3-hpz-qwz-qgz"] = _run(3, mesh=True, hpz=True, quantized_weights=True,
                                        quantized_gradients=True)
SCENARIOS["stage2-muon"] = _run(2, opt_cls=zk.ZeroMuon)
SCENARIOS["stage3-muon"] = _run(3, opt_cls=zk.ZeroMuon)
SCENARIOS["stage2-muon-offload-cpu"] = _run(2, opt_cls=zk.ZeroMuon, offload="cpu")
SCENARIOS["stage3-muon-offload-cpu"] = _run(3, opt_cls=zk.ZeroMuon, offload="cpu")
SCENARIOS["stage2-8bit"] = _run(2, state_bits=8)
SCENARIOS["stage3-8bit"] = _run(3, state_bits=8)
# activation_checkpointing="offload" with its backward prefetch on the copy stream (issue 37)
SCENARIOS["stage3-offload-activations"] = _run(3, activation_checkpointing="offload")


def _cpu_checkpointing(rank, world, dev, log):
    """zerokern.checkpointing with cpu_checkpointing around each block, at stage 3 (issue 37):
    the host pool's side-stream copies and its backward prefetch one checkpoint ahead."""
    import zerokern.checkpointing as ck

    log.phase = "model"
    with dev:
        model = Net()
    model.ckpt = ck.checkpoint
    log.phase = "construct"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stand-ins say no CUDA: "saves no memory"
        ck.configure(None, checkpoint_in_cpu=True)
    opt = zk.ZeroAdamW(model, lr=1e-3, stage=3, precision="bf16", bucket_mb=0.01,
                       backend=BACKEND)
    _train(model, opt, dev, log)


SCENARIOS["stage3-cpu-checkpointing"] = _cpu_checkpointing

# The features of issues 35-39 (FP8 params, DeepSpeed's keys, replica recovery): their
# scenarios live beside their checks in tests/gpu_control.
from tests.gpu_control.feature_scenarios import register  # noqa: E402

register(SCENARIOS)
