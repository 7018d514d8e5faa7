"""Ranks that start from different weights (issue 36, item 0): every optimizer copies the
data-parallel group's first rank's params and buffers to the other ranks at construction, as
DDP's constructor and DeepSpeed's initialize do (zerokern.core.model_sync [Note: ranks start from
the first rank's weights]).

Each rank builds its model from its own seed (rank 0 from models.MODEL_SEED). The reference is
DDP + torch.optim.AdamW on those per-rank models: DDP broadcasts rank 0's params, so it trains
rank 0's initial model. After construction every rank's params (frozen `pos` included, stage 3
gathered) and a per-rank buffer must be rank 0's bit for bit, and after 2 steps the params must
match the reference. Negative control: with the broadcast patched out (the old behaviour), the
ranks train other models (rel error >> the tolerance). One spawn per world size (2 and 3) runs
stages 0-3 for ZeroAdamW, plus ZeroLion, ZeroMuon, bare params, zerokern.initialize (with an
optimizer and forward-only) and broadcast_params=False (a ValueError naming it when the ranks
differ; no error and the same training when they agree); a 4-rank spawn runs a 2x2 HSDP mesh at
stages 0-3 and a 2x2 (dp, tp) DTensor model, whose tp shards must stay each tp rank's own.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import zerokern as zk
from zerokern.geometry.dtensor_params import local

from ..support import models as M
from ..support.harness import cached, case, run_cases, ws_params

STEPS = 2
STAGES = [0, 1, 2, 3]
TOL = {
    # Params vs DDP + AdamW after 2 steps, fp32 (test_parity's bound; an ulp or so measured).
    "param": 1e-6,
    # The negative control (no broadcast) must miss by at least this factor of TOL["param"].
    "negative_factor": 100,
}


def seed_of(rank: int) -> int:
    return M.MODEL_SEED + 1000 * rank  # rank 0: the models module's own model


def make(rank: int):
    """This rank's model (its own seed) with a per-rank buffer."""
    model = M.make_model(seed_of(rank))
    model.register_buffer("shift", torch.full((3,), float(rank) + 0.5))
    return model


def rank0_snapshot():
    model = make(0)
    return M.snapshot(model), model.shift.clone()


def zero_opt(model, stage, **kw):
    """models.zero_opt's ZeroAdamW, built from the model at every stage (so its buffers are
    the optimizer's to copy; bare params: `_bare_params`)."""
    kw = {"lr": M.LR, "betas": M.BETAS, "eps": M.EPS, "weight_decay": M.WD,
          "bucket_mb": M.BUCKET_MB, "backend": M.BACKEND, **kw}
    return zk.ZeroAdamW(model, stage=stage, precision="fp32",
                        param_groups=M.param_groups(model, tied_twice=False), **kw)


def _after_build(model, opt):
    """(params bitwise rank 0's initial ones, buffer rank 0's)."""
    ref, shift = rank0_snapshot()
    return {"params": M.bitwise_equal(M.full_snapshot(model, opt), ref),
            "buffer": torch.equal(model.shift, shift)}


def _adamw(rank, ws, stage, memo, **kw):
    model = make(rank)
    opt = zero_opt(model, stage, **kw)
    out = _after_build(model, opt)
    rec = M.train_zero(model, opt, rank, ws, STEPS)
    out["rel"] = M.rel_err(rec["params"][-1], memo["ref"]["params"][-1])
    out["replica"] = M.full_replica_diff(model, opt)
    return out


def _no_broadcast(rank, ws, stage, memo):
    """Negative control: the old behaviour (nothing copied at construction)."""
    with mock.patch("zerokern.core.optimizer.sync_from_first_rank", lambda *a, **k: 0):
        model = make(rank)
        opt = zero_opt(model, stage)
    rec = M.train_zero(model, opt, rank, ws, STEPS)
    return {"rel": M.rel_err(rec["params"][-1], memo["ref"]["params"][-1]),
            "replica": M.full_replica_diff(model, opt)}


def _opt_out_differs(rank, stage):
    model = make(rank)
    before = M.snapshot(model)
    try:
        zero_opt(model, stage, broadcast_params=False)
    except ValueError as e:
        return {"error": str(e), "unchanged": M.bitwise_equal(M.snapshot(model), before)}
    return {"error": None}


def _opt_out_agrees(rank, ws, stage):
    """broadcast_params=False on ranks that agree: built, and trains as the reference."""
    model = M.make_model()
    opt = zero_opt(model, stage, broadcast_params=False)
    rec = M.train_zero(model, opt, rank, ws, STEPS)
    ref = M.train_torch(M.make_model(), rank, ws, STEPS)
    return M.rel_err(rec["params"][-1], ref["params"][-1])


def _bare_params(rank, ws):
    """Bare params (no model): every param passed (the frozen `pos` included) is copied."""
    model = make(rank)
    opt = M.zero_opt(model, 1)  # (stages 0-2 pass the group dicts, pos in the first)
    ref, _ = rank0_snapshot()
    return {"params": M.bitwise_equal(M.full_snapshot(model, opt), ref),
            "buffer_own": float(model.shift[0])}  # no model given: buffers stay


def _other_rule(rank, ws, which, stage):
    model = make(rank)
    if which == "lion":
        opt = zk.ZeroLion(model, lr=1e-3, weight_decay=0.1, stage=stage, precision="fp32",
                          bucket_mb=M.BUCKET_MB, backend=M.BACKEND)
    else:
        opt = zk.ZeroMuon(model, lr=0.02, stage=stage, precision="fp32",
                          bucket_mb=M.BUCKET_MB, backend=M.BACKEND)
    out = _after_build(model, opt)
    M.train_zero(model, opt, rank, ws, STEPS)
    out["replica"] = M.full_replica_diff(model, opt)
    return out


def _initialize(rank, ws, stage, optimizer: bool):
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    model = make(rank)
    engine, opt, _, _ = zk.initialize(model=model, config=cfg)
    if opt is None:
        ref, shift = rank0_snapshot()
        return {"params": M.bitwise_equal(M.snapshot(model), ref),
                "buffer": torch.equal(model.shift, shift)}
    return _after_build(model, opt)


def _reference(rank, ws, memo):
    # DDP broadcasts rank 0's params (and buffers) in its constructor: rank 0's model trained
    memo["ref"] = M.train_torch(make(rank), rank, ws, STEPS)
    return True


def _worker(rank, ws):
    memo = {}
    cases = {"ref": functools.partial(_reference, rank, ws, memo)}
    for stage in STAGES:
        cases[f"adamw-{stage}"] = functools.partial(_adamw, rank, ws, stage, memo)
        cases[f"negative-{stage}"] = functools.partial(_no_broadcast, rank, ws, stage, memo)
        cases[f"opt-out-differs-{stage}"] = functools.partial(_opt_out_differs, rank, stage)
    for stage in (0, 3):
        cases[f"opt-out-agrees-{stage}"] = functools.partial(_opt_out_agrees, rank, ws, stage)
        cases[f"initialize-{stage}"] = functools.partial(_initialize, rank, ws, stage, True)
        cases[f"forward-only-{stage}"] = functools.partial(_initialize, rank, ws, stage, False)
    for which, stage in (("lion", 2), ("lion", 3), ("muon", 1), ("muon", 3)):
        cases[f"{which}-{stage}"] = functools.partial(_other_rule, rank, ws, which, stage)
    cases["bare"] = functools.partial(_bare_params, rank, ws)
    return run_cases(cases)


WORLD_SIZES = ws_params(2, 3)  # harness [Note: world sizes in the default run]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"ws{n}")
def results(request):
    return cached(_worker, request.param)


@pytest.mark.parametrize("stage", STAGES)
def test_adamw_starts_from_rank0(results, stage):
    for r in case(results, f"adamw-{stage}"):
        assert r["params"] and r["buffer"], r
        assert r["rel"] <= TOL["param"], r
        assert r["replica"] == 0.0, r


@pytest.mark.parametrize("stage", STAGES)
def test_negative_control_diverges(results, stage):
    """Without the broadcast (the old code) the ranks train something else than DDP."""
    rels = [r["rel"] for r in case(results, f"negative-{stage}")]
    assert max(rels) >= TOL["negative_factor"] * TOL["param"], rels


@pytest.mark.parametrize("stage", STAGES)
def test_opt_out_refuses_differing_ranks(results, stage):
    for r in case(results, f"opt-out-differs-{stage}"):
        assert r["error"] is not None, "broadcast_params=False accepted ranks that differ"
        assert "broadcast_params" in r["error"] and "'emb.weight'" in r["error"], r["error"]
        assert r["unchanged"]


@pytest.mark.parametrize("stage", [0, 3])
def test_opt_out_when_ranks_agree(results, stage):
    assert max(case(results, f"opt-out-agrees-{stage}")) <= TOL["param"]


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("optimizer", [True, False], ids=["optimizer", "forward-only"])
def test_initialize_starts_from_rank0(results, stage, optimizer):
    for r in case(results, f"{'initialize' if optimizer else 'forward-only'}-{stage}"):
        assert r["params"] and r["buffer"], r


@pytest.mark.parametrize("which,stage", [("lion", 2), ("lion", 3), ("muon", 1), ("muon", 3)])
def test_other_rules_start_from_rank0(results, which, stage):
    for r in case(results, f"{which}-{stage}"):
        assert r["params"] and r["buffer"] and r["replica"] == 0.0, r


def test_bare_params(results):
    rs = case(results, "bare")
    assert all(r["params"] for r in rs), rs
    assert [r["buffer_own"] for r in rs] == [k + 0.5 for k in range(len(rs))]


# ---- a 2x2 HSDP mesh and a (dp, tp) DTensor model on 4 ranks ----------------------------------
def _mesh_adamw(rank, stage, memo):
    model = make(rank)
    opt = zero_opt(model, stage, mesh=memo["mesh"])
    out = _after_build(model, opt)
    rec = M.train_zero(model, opt, rank, 4, STEPS)
    out["rel"] = M.rel_err(rec["params"][-1], memo["ref"]["params"][-1])
    return out


def _tp(rank, stage):
    """dp 2 x tp 2: each rank's local tensors perturbed by its dp rank; after construction
    every rank holds dp rank 0's local tensors of its own tp coordinate (the tp shards differ
    and must stay apart)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..comm.test_tp import make_tp_model

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    want = {n: local(p).detach().clone() for n, p in make_tp_model(world).named_parameters()}
    model = make_tp_model(world)
    dp_rank = world["dp"].get_local_rank()
    with torch.no_grad():
        for p in model.parameters():
            local(p).add_(0.125 * dp_rank)
    opt = zk.ZeroAdamW(model, stage=stage, precision="fp32", mesh=world["dp"], backend="cpu")
    with opt.gathered_params():
        have = {n: local(p).detach().clone() for n, p in model.named_parameters()}
    parts = [torch.empty_like(want["up1.weight"]) for _ in range(2)]
    dist.all_gather(parts, want["up1.weight"], group=world["tp"].get_group())
    return {"equal": M.bitwise_equal(have, want), "tp_shards_differ": not torch.equal(*parts)}


def _worker4(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    memo = {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))}
    cases = {"ref": functools.partial(_reference, rank, ws, memo)}
    for stage in STAGES:
        cases[f"mesh-{stage}"] = functools.partial(_mesh_adamw, rank, stage, memo)
    for stage in (0, 3):
        cases[f"tp-{stage}"] = functools.partial(_tp, rank, stage)
    return run_cases(cases)


@pytest.fixture(scope="module")
def results4():
    return cached(_worker4, 4)


@pytest.mark.parametrize("stage", STAGES)
def test_hsdp_mesh_starts_from_rank0(results4, stage):
    for r in case(results4, f"mesh-{stage}"):
        assert r["params"] and r["buffer"], r
        assert r["rel"] <= TOL["param"], r


@pytest.mark.parametrize("stage", [0, 3])
def test_tp_shards_stay_apart(results4, stage):
    for r in case(results4, f"tp-{stage}"):
        assert r["equal"] and r["tp_shards_differ"], r
