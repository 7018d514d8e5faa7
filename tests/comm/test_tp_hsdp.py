"""HSDP (and hpZ) on the data-parallel dims of a DTensor tensor-parallel model: 8 gloo ranks as a
(replicate=2, shard=2, tp=2) mesh; ZeroAdamW(model, mesh=world["replicate", "shard"]) shards
over "shard", replicates over "replicate", and the model is tensor-parallel over "tp".

Reference: test_tp's, with the dp all-reduce over all 4 dp ranks (the global norm from the full
gradients, clip, torch AdamW on the DTensor params). Negative control: lr x 1.01. Slow (8
processes on 2 cores); tests/comm/test_tp.py is the fast representative.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import zerokern as zk

from ..support.harness import cached, case, run_cases
from .test_tp import (
    BETAS,
    EPS,
    LR,
    MAX_NORM,
    WD,
    _groups,
    _null,
    full,
    loss_of,
    make_tp_model,
    rel_err,
)

WS, REP, SHARD, TP = 8, 2, 2, 2
DP = REP * SHARD
STEPS = 3
TOL = {"param": 1e-6, "negative_factor": 10}


def _dp(world):
    dp_mesh = world["replicate", "shard"]
    rank = dp_mesh.get_local_rank(0) * SHARD + dp_mesh.get_local_rank(1)
    return dp_mesh, rank


def _set_lr(opt, lr):
    for g in opt.param_groups:
        g["lr"] = lr if g["weight_decay"] else 2 * lr


def _reference(world, dp_group) -> dict:
    model = make_tp_model(world)
    opt = torch.optim.AdamW(_groups(model), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            foreach=False)
    _set_lr(opt, LR)
    _, dp_rank = _dp(world)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, step, dp_rank, DP).backward()
        for p in model.parameters():
            g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=dp_group)
            g.div_(DP)
        sq = sum((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                 .double().pow(2).sum() for p in model.parameters())
        coef = min(1.0, MAX_NORM / (math.sqrt(float(sq)) + 1e-6))
        for p in model.parameters():
            p.grad.mul_(coef)
        opt.step()
    return full(model)


def _zero(world, stage, memo, hpz=False, lr=LR) -> float:
    dp_mesh, dp_rank = _dp(world)
    model = make_tp_model(world)
    opt = zk.ZeroAdamW(model, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, stage=stage,
                       precision="fp32", max_grad_norm=MAX_NORM, bucket_mb=0.0002,
                       backend="cpu", mesh=dp_mesh, hpz=hpz, param_groups=_groups(model))
    _set_lr(opt, lr)
    for step in range(STEPS):
        loss_of(model, step, dp_rank, DP).backward()
        opt.step()
        opt.zero_grad()
    with opt.gathered_params() if stage == 3 else _null():
        return rel_err(full(model), memo["ref"])


def _worker(rank, ws):
    world = init_device_mesh("cpu", (REP, SHARD, TP), mesh_dim_names=("replicate", "shard", "tp"))
    # the dp group (all 4 dp ranks of this tp coordinate), for the reference's all-reduce
    dp_group = None
    for t in range(TP):
        ranks = [r for r in range(WS) if r % TP == t]
        g = dist.new_group(ranks)
        if rank % TP == t:
            dp_group = g
    memo = {}

    def ref():
        memo["ref"] = _reference(world, dp_group)
        return True

    cases = {"ref": ref}
    for stage in (1, 2, 3):
        cases[f"hsdp{stage}"] = functools.partial(_zero, world, stage, memo)
    cases["hpz3"] = functools.partial(_zero, world, 3, memo, True)
    cases["lr_control"] = functools.partial(_zero, world, 2, memo, False, LR * 1.01)
    return run_cases(cases)


def _results():
    return cached(_worker, WS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hsdp1", "hsdp2", "hsdp3", "hpz3"])
def test_hsdp_tp_parity(name):
    for rel in case(_results(), name):
        assert rel <= TOL["param"], rel


@pytest.mark.slow
def test_hsdp_tp_lr_control_is_caught():
    for rel in case(_results(), "lr_control"):
        assert rel > TOL["negative_factor"] * TOL["param"], rel
