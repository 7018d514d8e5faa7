"""3D (issue 22, item 6): torch.distributed.pipelining x DTensor tensor parallelism x ZeRO on dp,
8 gloo ranks as a (pp=2, dp=2, tp=2) mesh.

Each pipeline stage is a part of the TP model of test_tp (stage 0: ln1, up1, down1; stage 1:
ln2, up2, down2, head), parallelized over "tp"; ZeroAdamW(part, mesh=world["dp"]) on each
stage's ranks. The schedule (GPipe, 1F1B) runs 2 micro-batches per step with `scale_grads=False`
and the loss divided by the number of micro-batches (at stages 1-3 p.grad is released, so the
schedule must not divide it; the loss division is DDP's rule for accumulation anyway).

Reference: the same pipeline, the same schedule and data, with a manual all-reduce of the local
grads over dp (/ dp size) and torch.optim.AdamW on the DTensor params (no clipping: the norm
of a pipelined model spans stages, and ZeroAdamW's spans its own stage only; see the docs).
Negative control: lr x 1.01. Marked slow (8 processes on 2 cores); tests/comm/test_tp.py is the
fast representative of the TP path.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import zerokern as zk

from ..support.harness import cached, case, run_cases
from .test_tp import BATCH, BETAS, EPS, LR, PLAN, SEED, WD, TPNet, batch, full, rel_err

WS, PP, DP, TP = 8, 2, 2, 2
MICRO = 2
STEPS = 3
TOL = {"param": 1e-6, "negative_factor": 10}
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Part0(nn.Module):
    def __init__(self, net: TPNet) -> None:
        super().__init__()
        self.ln1, self.up1, self.down1 = net.ln1, net.up1, net.down1

    def forward(self, x):
        return x + self.down1(F.gelu(self.up1(self.ln1(x))))


class Part1(nn.Module):
    def __init__(self, net: TPNet) -> None:
        super().__init__()
        self.ln2, self.up2, self.down2, self.head = net.ln2, net.up2, net.down2, net.head

    def forward(self, x):
        x = x + self.down2(torch.tanh(self.up2(self.ln2(x))))
        return self.head(x)


def _part(world):
    torch.manual_seed(SEED)
    net = TPNet()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1 * torch.randn(p.shape))  # as test_tp.make_tp_model
    pp = world["pp"].get_local_rank()
    part = (Part0 if pp == 0 else Part1)(net)
    plan = {k: v for k, v in PLAN.items() if hasattr(part, k)}
    return parallelize_module(part, world["tp"], plan), pp


def _groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters()
            if not (n.endswith("weight") and p.dim() == 2)]
    return [dict(params=decay, weight_decay=WD), dict(params=rest, weight_decay=0.0)]


def _train(world, schedule, zero_stage=None, lr=LR) -> dict:
    """zero_stage None: the reference (manual dp all-reduce + torch AdamW)."""
    part, pp = _part(world)
    if zero_stage is None:
        opt = torch.optim.AdamW(_groups(part), lr=lr, betas=BETAS, eps=EPS, weight_decay=WD,
                                foreach=False)
    else:
        opt = zk.ZeroAdamW(_groups(part), lr=lr, betas=BETAS, eps=EPS, weight_decay=WD,
                           stage=zero_stage, precision="fp32", bucket_mb=0.0002,
                           backend="cpu", mesh=world["dp"])
    stage = PipelineStage(part, pp, PP, torch.device("cpu"), group=world["pp"].get_group())
    sched = SCHEDULES[schedule](stage, MICRO, loss_fn=lambda out, y: F.mse_loss(out, y) / MICRO,
                                scale_grads=False)
    dp_rank = world["dp"].get_local_rank()
    assert BATCH // DP % MICRO == 0
    for step in range(STEPS):
        x, y = batch(step, dp_rank)
        if pp == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        if zero_stage is None:
            for p in part.parameters():
                g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(g, group=world["dp"].get_group())
                g.div_(DP)
        opt.step()
        opt.zero_grad()
    return full(part)


def _worker(rank, ws):
    world = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    memo = {}

    def ref(schedule):
        memo[schedule] = _train(world, schedule)
        return True

    def parity(schedule, stage, lr=LR):
        return rel_err(_train(world, schedule, stage, lr), memo[schedule])

    cases = {}
    for schedule in SCHEDULES:
        cases[f"ref_{schedule}"] = functools.partial(ref, schedule)
        for stage in (0, 1, 2):
            cases[f"{schedule}{stage}"] = functools.partial(parity, schedule, stage)
    cases["lr_control"] = functools.partial(parity, "gpipe", 1, LR * 1.01)
    return run_cases(cases)


def _results():
    return cached(_worker, WS)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_pipeline_tp_dp_parity(schedule, stage):
    """Each rank's stage part (its tp shards) equals the manual-dp-all-reduce reference."""
    for rel in case(_results(), f"{schedule}{stage}"):
        assert rel <= TOL["param"], rel


@pytest.mark.slow
def test_pipeline_lr_control_is_caught():
    for rel in case(_results(), "lr_control"):
        assert rel > TOL["negative_factor"] * TOL["param"], rel
