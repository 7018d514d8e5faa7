"""Checkpoints on meshes (issue 22 item 7): save on a 2x2 (replicate, shard) mesh of 4 gloo
ranks, load at 2x2, 1x4 (1-D), 4x1 (shard size 1) and on one rank, continue, and compare with
the uninterrupted DDP + torch.optim.AdamW run (fp32, fresh random data).

Only replica 0 of each shard writes its file: the checkpoint of a 2x2 mesh has the two rank
files of a 2-rank run. Every rank reads. The negative control loads only the params (not the
optimizer state) at 1x4: the continuation must then miss the reference.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zerokern.checkpoint as ck
from zerokern.checkpoint.format import read_meta

from ..support import models as M
from ..support.harness import cached, case, run_cases

WS = 4
SAVE_AT, MORE = 3, 2
STAGES = [2, 3]

TOL = {
    # Continuation after a reshard vs the uninterrupted DDP run (the bound); measured
    # <= 2e-7 (the order of the fp32 gradient sums differs across meshes).
    "param": 1e-6,
    # The params-only resume (negative control) misses by at least this factor.
    "negative_factor": 100,
}


def _mesh(shape):
    return init_device_mesh("cpu", shape) if len(shape) == 1 else \
        init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _save(rank, stage, root, memo):
    model = M.make_model()
    opt = M.zero_opt(model, stage, mesh=memo["mesh22"])
    M.train_zero(model, opt, rank, WS, SAVE_AT)
    path = os.path.join(root, f"s{stage}")
    ck.save(path, model, opt)
    dist.barrier()
    files = sorted(f for f in os.listdir(path) if f.startswith("rank"))
    meta_ws = read_meta(path)["world_size"]
    cont = M.train_zero(model, opt, rank, WS, MORE, start=SAVE_AT)["params"][-1]
    return {"files": files, "meta_ws": meta_ws,
            "cont_rel": M.rel_err(cont, memo["ref"]["params"][-1])}


def _load(rank, stage, root, memo, shape, params_only=False):
    """Load the 2x2 checkpoint on a mesh of `shape` (None: one rank, its own process group)
    and continue MORE steps."""
    model = M.make_model(seed=M.MODEL_SEED + 1)  # everything must come from the checkpoint
    if shape is None:
        opt = M.zero_opt(model, stage, process_group=memo["single"])
        r, ws = 0, 1  # the whole global batch on one rank: DDP's average at 4 ranks
    else:
        opt = M.zero_opt(model, stage, mesh=memo.setdefault(shape, _mesh(shape)))
        r, ws = rank, WS
    path = os.path.join(root, f"s{stage}")
    if params_only:
        model.load_state_dict(ck.consolidate(path))
    else:
        ck.load(path, model, opt)
    rec = M.train_zero(model, opt, r, ws, MORE, start=SAVE_AT)
    return M.rel_err(rec["params"][-1], memo["ref"]["params"][-1])


def _consolidated(rank, stage, root, memo):
    """consolidate() of the 2x2 checkpoint is the 3-step DDP params."""
    sd = ck.consolidate(os.path.join(root, f"s{stage}"))
    ref = memo["ref"]["params"][SAVE_AT - 1]
    return M.rel_err({k: sd[k] for k in ref}, ref)


def _worker(rank, ws, root):
    memo = {"mesh22": _mesh((2, 2))}
    memo["ref"] = M.train_torch(M.make_model(), rank, WS, SAVE_AT + MORE)
    singles = [dist.new_group([r]) for r in range(WS)]  # every rank makes every group
    memo["single"] = singles[rank]
    cases = {}
    for stage in STAGES:
        cases[f"save{stage}"] = functools.partial(_save, rank, stage, root, memo)
        cases[f"consolidate{stage}"] = functools.partial(_consolidated, rank, stage, root, memo)
        for name, shape in (("2x2", (2, 2)), ("1x4", (4,)), ("4x1", (4, 1)), ("1", None)):
            cases[f"load{stage}_{name}"] = functools.partial(_load, rank, stage, root, memo,
                                                             shape)
    cases["negative"] = functools.partial(_load, rank, 2, root, memo, (4,), params_only=True)
    return run_cases(cases)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("mesh_ckpt"))


def _results(root):
    return cached(_worker, WS, root)


@pytest.mark.parametrize("stage", STAGES)
def test_only_replica_zero_writes(root, stage):
    for r, v in enumerate(case(_results(root), f"save{stage}")):
        assert v["files"] == ["rank00000.bin", "rank00001.bin"], (r, v)
        assert v["meta_ws"] == 2, (r, v)  # the layout's world: the shard group
        assert v["cont_rel"] <= TOL["param"], (r, v)  # saving changed nothing


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("target", ["2x2", "1x4", "4x1", "1"])
def test_load_across_meshes_and_continue(root, stage, target):
    for r, rel in enumerate(case(_results(root), f"load{stage}_{target}")):
        assert rel <= TOL["param"], (r, rel)


@pytest.mark.parametrize("stage", STAGES)
def test_consolidate_of_a_mesh_checkpoint(root, stage):
    for r, rel in enumerate(case(_results(root), f"consolidate{stage}")):
        assert rel <= TOL["param"], (r, rel)


def test_negative_control_params_only_resume_misses(root):
    for r, rel in enumerate(case(_results(root), "negative")):
        assert rel > TOL["negative_factor"] * TOL["param"], (r, rel)


