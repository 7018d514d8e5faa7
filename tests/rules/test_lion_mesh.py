"""ZeroLion on a 2-D mesh (HSDP, and hpZ at stage 3) against ZeroLion over the flat 4-rank group.

The flat run is itself checked against lion-pytorch in test_rules.py. Lion's update is a sign,
so both runs agree to rounding unless a reduction-order difference flips the sign of a ~0
interpolation (random data makes that rare; the tolerance allows none here). Negative control:
the flat run with lr x 1.01 is caught.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zerokern as zk

from ..support.harness import cached, case, run_cases

WS = 4
TOL = 1e-6  # fp32, the same data: rounding of the two reduction orders only


def _train(rank, stage, mesh=None, hpz=False, lr=1e-3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 40), torch.nn.GELU(),
                                torch.nn.Linear(40, 7))
    opt = zk.ZeroLion(model if stage == 3 else model.parameters(), lr=lr, betas=(0.8, 0.9),
                      weight_decay=0.1, stage=stage, precision="fp32", bucket_mb=0.001,
                      mesh=mesh, hpz=hpz)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(4):
        x = torch.randn(8, 33, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _worker(rank, ws):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    cases = {}
    for stage in (1, 2, 3):
        cases[f"flat{stage}"] = lambda s=stage: _train(rank, s)
        cases[f"mesh{stage}"] = lambda s=stage: _train(rank, s, mesh)
    cases["hpz3"] = lambda: _train(rank, 3, mesh, hpz=True)
    cases["flat_lr_off"] = lambda: _train(rank, 2, lr=1.01e-3)
    out = run_cases(cases)
    dist.barrier()
    return out


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lion_hsdp_equals_flat(stage):
    res = cached(_worker, WS)
    for flat, hs in zip(case(res, f"flat{stage}"), case(res, f"mesh{stage}")):
        assert _rel(hs, flat) <= TOL


def test_lion_hpz_equals_flat_stage3():
    res = cached(_worker, WS)
    for flat, hp in zip(case(res, "flat3"), case(res, "hpz3")):
        assert _rel(hp, flat) <= TOL


def test_negative_control_lr_off():
    res = cached(_worker, WS)
    for flat, off in zip(case(res, "flat2"), case(res, "flat_lr_off")):
        assert _rel(off, flat) > 100 * TOL
