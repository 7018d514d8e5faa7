"""Checkpoints across 3-D layouts (issue 38, slow: 8 gloo ranks): saved at (pp=2, tp=2, dp=2)
with each stage's blocks tensor-parallel (Colwise fc1, Rowwise fc2: DTensor params sharded on
dims 0 and 1, Replicate biases, plain params) and `mesh=` the (pp, dp, tp) world mesh; loaded
by name at (pp=2, tp=2, dp=2) (bitwise), (pp=1, dp=8) at stage 3, (pp=4, dp=2) at stage 1 and
one rank, the optimizer state put together from the tp parts; each continued and compared with
the uninterrupted run and one process with torch.optim.AdamW and the global clip
(tests/checkpoint/pipeline_support.py). Negative control: the params alone miss it.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import zerokern.checkpoint as ck

from ..support.harness import RankFailure, case, run_cases, spawn
from . import pipeline_support as S

pytestmark = pytest.mark.slow

WS, PP, TP, DP = 8, 2, 2, 2
SAVE_AT, MORE = 3, 2
TOL = {
    "layout": 1e-6,  # fp32 sums in another order (dp means, tp all-reduces, the norm's sum)
    "negative_factor": 100,  # the params-only resume misses by at least this factor
}


def _tp_stage(world, s: int, seed: int = S.SEED):
    model = S.stage_model(s, PP, seed=seed)
    plan = {}
    for k in model.layers:
        plan[f"layers.{k}.fc1"] = ColwiseParallel()
        plan[f"layers.{k}.fc2"] = RowwiseParallel()
    return parallelize_module(model, world["tp"], plan)


def _path(root):
    return os.path.join(root, "pp2tp2dp2")


def _save(world, root):
    s, d = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    model = _tp_stage(world, s)
    opt = S.zero_opt(model, 2, mesh=world)
    S.train(model, opt, d, DP, 0, SAVE_AT)
    saved = S.params_of(model, opt)
    ck.save(_path(root), model, opt)
    S.train(model, opt, d, DP, SAVE_AT, MORE)
    return {"saved": saved, "after": S.params_of(model, opt),
            "listing": sorted(os.listdir(_path(root)))}


def _same(world, root):
    s, d = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    model = _tp_stage(world, s, seed=S.SEED + 1)
    opt = S.zero_opt(model, 3, mesh=world)
    ck.load(_path(root), model, opt)
    loaded = S.params_of(model, opt)
    S.train(model, opt, d, DP, SAVE_AT, MORE)
    return {"loaded": loaded, "after": S.params_of(model, opt)}


def _pp4(world4, root):
    s, d = world4["pp"].get_local_rank(), world4["dp"].get_local_rank()
    model = S.stage_model(s, 4, seed=S.SEED + 1)
    opt = S.zero_opt(model, 1, mesh=world4)
    ck.load(_path(root), model, opt)
    loaded = S.params_of(model, opt)
    S.train(model, opt, d, 2, SAVE_AT, MORE)
    return {"loaded": loaded, "after": S.params_of(model, opt)}


def _whole(rank, root, stage, ws, group=None, params_only=False):
    model = S.stage_model(0, 1, seed=S.SEED + 1)
    opt = S.zero_opt(model, stage, process_group=group)
    if params_only:
        model.load_state_dict(ck.consolidate(_path(root)))
    else:
        ck.load(_path(root), model, opt)
    loaded = S.params_of(model, opt)
    S.train(model, opt, rank if ws > 1 else 0, ws, SAVE_AT, MORE)
    return {"loaded": loaded, "after": S.params_of(model, opt)}


def _dp_submesh(world, root):
    """tp stages with ZeroAdamW over the dp group alone (process_group=: the tp DTensors, but no
    pp in the plan; mesh=world["dp"] is refused at construction): the job the optimizer knows
    (dp x tp, 4 ranks) is not the whole one, so the save refuses."""
    s = world["pp"].get_local_rank()
    model = _tp_stage(world, s)
    opt = S.zero_opt(model, 2, process_group=world["dp"].get_group())
    path = os.path.join(root, "submesh")
    try:
        ck.save(path, model, opt)
        return {"error": None}
    except ValueError as e:
        dist.barrier()
        return {"error": str(e), "written": os.path.exists(path)}


def _worker(rank, ws, root):
    world = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    world4 = init_device_mesh("cpu", (4, 2), mesh_dim_names=("pp", "dp"))
    singles = [dist.new_group([r]) for r in range(ws)]
    out = run_cases({
        "save": functools.partial(_save, world, root),
        "same": functools.partial(_same, world, root),
        "dp8": functools.partial(_whole, rank, root, 3, ws),
        "pp4": functools.partial(_pp4, world4, root),
        "one": functools.partial(_whole, rank, root, 1, 1, singles[rank]),
        "negative": functools.partial(_whole, rank, root, 2, ws, None, True),
        "submesh": functools.partial(_dp_submesh, world, root),
    })
    out["ref"] = S.reference(SAVE_AT + MORE)[-1]
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("layouts"))


_RESULTS: dict = {}


def _results(root):
    """One 8-rank spawn for the file (8 ranks on a few cores: a longer limit than cached's)."""
    if root not in _RESULTS:
        try:
            _RESULTS[root] = spawn(_worker, WS, root, timeout=900)
        except RankFailure as e:
            _RESULTS[root] = e
    if isinstance(_RESULTS[root], RankFailure):
        raise _RESULTS[root]
    return _RESULTS[root]


def _saver(root):
    saves = case(_results(root), "save")
    return S.merge(r["saved"] for r in saves), S.merge(r["after"] for r in saves)


def test_the_3d_checkpoint_holds_every_stage_and_tp_rank(root):
    for r in case(_results(root), "save"):
        assert r["listing"] == ["parts.json", "pp00000-tp00000", "pp00000-tp00001",
                                "pp00001-tp00000", "pp00001-tp00001"], r["listing"]
    saved, after = _saver(root)
    assert sorted(saved) == sorted(n for n, _ in S.Net().named_parameters())
    ref = case(_results(root), "ref")[0]
    assert S.rel_err(after, ref) <= TOL["layout"]
    sd = ck.consolidate(_path(root))
    assert all(torch.equal(sd[n], v) for n, v in saved.items())


@pytest.mark.parametrize("target", ["same", "dp8", "pp4", "one"])
def test_load_across_3d_layouts_and_continue(root, target):
    saved, after = _saver(root)
    ref = case(_results(root), "ref")[0]
    names = set()
    for r in case(_results(root), target):
        names |= set(r["loaded"])
        assert all(torch.equal(v, saved[n]) for n, v in r["loaded"].items())
        want = {n: after[n] for n in r["after"]}
        if target == "same":
            assert all(torch.equal(v, want[n]) for n, v in r["after"].items())
        assert S.rel_err(r["after"], want) <= TOL["layout"]
        assert S.rel_err(r["after"], {n: ref[n] for n in r["after"]}) <= TOL["layout"]
    assert names == set(saved)


def test_negative_control_params_only_misses(root):
    ref = case(_results(root), "ref")[0]
    for r in case(_results(root), "negative"):
        assert S.rel_err(r["after"], ref) > TOL["negative_factor"] * TOL["layout"]


def test_a_tp_stage_optimizer_over_the_dp_submesh_refuses_to_save(root):
    for r in case(_results(root), "submesh"):
        assert r["error"] is not None and "not the whole job" in r["error"], r
        assert not r["written"], r
