"""`mesh=` a world mesh with a "pp" dim (comm/mesh.py [Note: a world mesh], comm/plan.py [Note:
one parallel plan]): ZeRO over the data-parallel dim, and the global grad norm and the overflow
skip agreed over the pipeline stages too (issue 35: the plan's pp role; issue 38 builds the
pipeline schedules on it).

4 gloo ranks as a (pp=2, dp=2) mesh. Pipeline stage s holds `Stage(s)`: its own params (the
stages share none). Each rank computes a loss of its stage's params on its own batch (no real
pipeline is needed to check the agreement: what matters is that each stage's grads are its own).
Reference, in every process: both stages' params in one torch model, each stage's grads the
average over dp of what its ranks computed, `clip_grad_norm_` over all of them (the global
norm of a pipelined model), then `torch.optim.AdamW`.

Negative control: the same run over the stage's dp group alone (`process_group=`; `mesh=world["dp"]`
is refused since issue 38's round): its norm covers one stage, so it clips differently and misses
the reference.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import zerokern as zk

from ..support.harness import cached, case, run_cases

WS, PP, DP = 4, 2, 2
LR, MAX_NORM, STEPS = 1e-2, 0.05, 3
TOL = 1e-6


def _stage(s: int) -> nn.Module:
    torch.manual_seed(100 + s)
    return nn.Sequential(nn.Linear(8, 16 + 8 * s), nn.Tanh(), nn.Linear(16 + 8 * s, 4))


def _loss(model: nn.Module, s: int, dp_rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * s + dp_rank)
    x = torch.randn(6, 8, generator=g)
    return (model(x) ** 2).mean() * (3.0 if s == 1 else 1.0)


def _reference():
    """Both stages in one process: dp-averaged grads, one global clip, AdamW."""
    stages = [_stage(0), _stage(1)]
    params = [p for m in stages for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        for s, m in enumerate(stages):
            for d in range(DP):
                (_loss(m, s, d, step) / DP).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        opt.step()
    return [[p.detach().clone() for p in m.parameters()] for m in stages], norms


def _run(world, stage: int, dp_only: bool = False, inf_at=None):
    s, d = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    model = _stage(s)
    opt = zk.ZeroAdamW(model, lr=LR, stage=stage, precision="fp32", backend="cpu",
                       max_grad_norm=MAX_NORM,
                       **({"process_group": world["dp"].get_group()} if dp_only else
                          {"mesh": world}))
    norms, skipped = [], []
    for step in range(STEPS):
        loss = _loss(model, s, d, step)
        if inf_at == (step, dist.get_rank()):
            loss = loss * float("inf")
        loss.backward()
        opt.step()
        norms.append(float(opt.grad_norm))
        skipped.append(bool(opt.step_skipped))
        opt.zero_grad()
    with opt.gathered_params() if stage == 3 else _null():
        params = [p.detach().clone() for p in model.parameters()]
    return {"stage": s, "params": params, "norms": norms, "skipped": skipped,
            "plan": dict(pp=opt.plan.sizes.pp, shard=opt.plan.sizes.shard)}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _parity(world, stage: int, memo, dp_only: bool = False):
    ref_params, ref_norms = memo["ref"]
    r = _run(world, stage, dp_only)
    want = ref_params[r["stage"]]
    rel = max(float((a - b).norm() / b.norm()) for a, b in zip(r["params"], want))
    norm_rel = max(abs(a - b) / b for a, b in zip(r["norms"], ref_norms))
    return {"rel": rel, "norm_rel": norm_rel, "plan": r["plan"]}


def _overflow(world, stage: int):
    """An inf in rank 3's loss (pipeline stage 1) at step 1: every rank of both stages skips
    that step (its params unchanged from step 0's), bitwise."""
    r = _run(world, stage, inf_at=(1, 3))
    return {"skipped": r["skipped"]}


def _bad(world):
    out = {}
    cp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "dp"))
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    nodp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    # a dp sub-mesh of a pipelined (or cp) job: refused ([Note: a dp sub-mesh of a pipelined
    # job]); of a tp-only job: accepted (the DTensor params carry tp)
    for name, mesh in (("cp", cp), ("tp_plain", tp), ("no_dp", nodp),
                       ("pp_submesh", world["dp"]), ("cp_submesh", cp["dp"]),
                       ("tp_submesh", tp["dp"])):
        model = _stage(0)
        before = [p.detach().clone() for p in model.parameters()]
        try:
            zk.ZeroAdamW(model, lr=LR, stage=2, backend="cpu", mesh=mesh)
            out[name] = "no error"
        except ValueError as e:
            same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            out[name] = (str(e), same)
    return out


# the default run: stages 0 and 3, the control, one overflow, the errors; the rest slow
DEFAULT = {"parity": (0, 3), "overflow": (0,)}
SLOW = {"parity": (1, 2), "overflow": (3,)}


def _worker(rank: int, world_size: int, slow: bool):
    torch.set_num_threads(1)
    world = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    memo = {"ref": _reference()}
    which = SLOW if slow else DEFAULT
    cases = {}
    for stage in which["parity"]:
        cases[f"parity{stage}"] = functools.partial(_parity, world, stage, memo)
    for stage in which["overflow"]:
        cases[f"overflow{stage}"] = functools.partial(_overflow, world, stage)
    if not slow:
        cases["dp_only"] = functools.partial(_parity, world, 2, memo, True)
        cases["bad"] = functools.partial(_bad, world)
    return run_cases(cases)


def _results(stage=None, kind="parity"):
    slow = stage is not None and stage in SLOW[kind]
    return cached(_worker, WS, slow)


def _slow_if(kind, stages):
    return [pytest.param(s, marks=pytest.mark.slow) if s in SLOW[kind] else s for s in stages]


@pytest.mark.parametrize("stage", _slow_if("parity", [0, 1, 2, 3]))
def test_world_mesh_clips_over_every_pipeline_stage(stage):
    for r in case(_results(stage), f"parity{stage}"):
        assert r["plan"] == {"pp": PP, "shard": DP}
        assert r["rel"] <= TOL and r["norm_rel"] <= TOL, r


def test_the_stage_alone_misses_the_global_norm():
    """Negative control: the stage's dp group alone clips by one stage's norm."""
    rs = case(_results(), "dp_only")
    assert max(r["norm_rel"] for r in rs) > 0.05, rs
    assert max(r["rel"] for r in rs) > 100 * TOL, rs


@pytest.mark.parametrize("stage", _slow_if("overflow", [0, 3]))
def test_an_inf_on_one_stage_skips_every_stage(stage):
    for r in case(_results(stage, "overflow"), f"overflow{stage}"):
        assert r["skipped"] == [False, True, False], r


def test_bad_world_meshes_raise_before_any_change():
    for r in case(_results(), "bad"):
        for name, want in (("cp", "context-parallel"), ("tp_plain", "not DTensors"),
                           ("no_dp", "data-parallel dims"), ("pp_submesh", "pp=2"),
                           ("cp_submesh", "cp=2")):
            msg, same = r[name]
            assert want in msg and "mesh" in msg and same, (name, msg)
        assert r["tp_submesh"] == "no error", r["tp_submesh"]
