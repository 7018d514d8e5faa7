"""Bad layouts and failures on a 2x2 (replicate, shard) mesh of 4 gloo ranks (issue 22 item 10).

- Layouts that differ across ranks (one rank a 1-D mesh over the same ranks, another hpz, a
  different stage, qgZ on one rank only, process_group= instead of the mesh) raise ValueError
  on every rank at construction (one all-gather of the layout), naming mesh, before any
  collective of a step; the same layout everywhere builds and trains (control). On the old
  code every rank built its optimizer and the first step hung in mismatched collectives.
- A rank that fails alone mid-step (its p.grad cleared between backward and step, stages 1-3
  on the mesh and stage 3 with hpZ) raises its error and every other rank raises RankAborted
  within PROMPT_S, far below the process-group timeout: the failure crosses the shard,
  replicate and hpZ groups ([Note: aborts cross groups] in zerokern/comm/abort.py). Before, the
  HSDP reduce-scatter + replicate all-reduce handle was not watched and the rank of the other
  shard group waited for the timeout.
- A rank whose process dies mid-backward (it raises in a backward hook, as user code may, and
  exits): every other rank raises within PROMPT_S instead of hanging.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from zerokern.tools import spawn as zk_spawn

from ..support import models as M
from ..support.harness import _CTX, GRACE, PG_TIMEOUT, case, run_cases, spawn
from .test_rank_failure import PROMPT_S, _check, _outcome

WS = 4


def _mesh(shape=(2, 2)):
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])


def _build(stage, **kw):
    t0 = time.monotonic()
    try:
        model = M.make_model()
        opt = M.zero_opt(model, stage, **kw)
        M.train_zero(model, opt, 0, WS, 1)
        return {"err": None, "elapsed": time.monotonic() - t0}
    except ValueError as e:
        return {"err": str(e), "elapsed": time.monotonic() - t0}


def _mismatch(rank, ws):
    m2, m1 = _mesh(), _mesh((4,))
    return run_cases({
        "same": lambda: _build(2, mesh=m2),
        "one_d": lambda: _build(2, mesh=m1 if rank == 1 else m2),
        "hpz": lambda: _build(3, mesh=m2, hpz=rank == 3),
        "stage": lambda: _build(3 if rank == 2 else 2, mesh=m2),
        "pg": lambda: _build(2, mesh=None if rank == 0 else m2),
        "quant": lambda: _build(2, mesh=m2, quantized_gradients="int8" if rank == 2 else False),
        "same_hpz": lambda: _build(3, mesh=m2, hpz=True),
    })


@pytest.mark.parametrize("name, words", [
    ("one_d", ["rank 1: mesh [0, 1, 2, 3]", "rank 0: mesh [[0, 1], [2, 3]]"]),
    ("hpz", ["rank 3: mesh [[0, 1], [2, 3]], process_group None, hpz=True"]),
    ("stage", ["rank 2:", "stage 3"]),
    ("pg", ["rank 0: no mesh, process_group [0, 1, 2, 3]"]),
    ("quant", ["rank 2:", "quantized_gradients=8", "rank 0:", "quantized_gradients=None"]),
])
def test_mismatched_layouts_raise_on_every_rank(name, words):
    res = cached_mismatch()
    for r in case(res, name):
        assert r["err"] is not None and "differ across the data-parallel ranks" in r["err"]
        assert all(w in r["err"] for w in words), r["err"]
        assert r["elapsed"] < PROMPT_S
    for control in ("same", "same_hpz"):  # the same layout everywhere trains
        assert all(r["err"] is None for r in case(res, control))


_RES = {}


def cached_mismatch():
    if "m" not in _RES:
        _RES["m"] = spawn(_mismatch, WS)
    return _RES["m"]


def _grad_cleared(rank, ws, stage, hpz):
    model = M.make_model()
    opt = M.zero_opt(model, stage, mesh=_mesh(), hpz=hpz)
    M.train_zero(model, opt, rank, ws, 1)
    opt.zero_grad()
    opt.backward(M.loss_fn(model, M.rank_tokens(1, rank, ws)))
    if rank == 3:
        model.blocks[0].fc1.weight.grad = None

    def rest():
        for s in (2, 3, 4):
            opt.step()
            opt.zero_grad()
            opt.backward(M.loss_fn(model, M.rank_tokens(s, rank, ws)))

    return _outcome(rest)


@pytest.mark.parametrize("stage, hpz", [(1, False), (2, False), (3, False), (3, True)])
def test_one_rank_failing_on_a_mesh_fails_every_rank_promptly(stage, hpz):
    _check(spawn(_grad_cleared, WS, stage, hpz), 3, "RuntimeError",
           "was cleared after the last backward")


def _assigned_before_backward(rank, ws, stage, hpz):
    model = M.make_model()
    opt = M.zero_opt(model, stage, mesh=_mesh(), hpz=hpz)
    M.train_zero(model, opt, rank, ws, 1)
    opt.zero_grad()
    if rank == 3:  # found by rank 3 alone as its backward starts; the others reduce
        w = model.blocks[0].fc1.weight
        w.grad = torch.zeros_like(w)

    def rest():
        for s in (2, 3):
            opt.backward(M.loss_fn(model, M.rank_tokens(s, rank, ws)))
            opt.step()
            opt.zero_grad()

    return _outcome(rest)


@pytest.mark.parametrize("stage", [2, 3])
def test_one_rank_failing_in_backward_on_a_mesh_fails_every_rank_promptly(stage):
    # rank 3 raises as its backward starts; rank 2 waits for it in their shard group's
    # reduce-scatter, rank 1 in their replicate all-reduce, rank 0 in its replicate all-reduce
    # with rank 2 (queued behind rank 2's stuck reduce-scatter): only the cascade reaches it
    _check(spawn(_assigned_before_backward, WS, stage, False), 3, "RuntimeError",
           "cannot be assigned")


def _dies(rank, ws, stage, hpz):
    model = M.make_model()
    opt = M.zero_opt(model, stage, mesh=_mesh(), hpz=hpz)
    M.train_zero(model, opt, rank, ws, 1)
    if rank == 3:  # user code raising in the middle of the backward on one rank
        def boom(g):
            raise RuntimeError("user hook failed on rank 3")
        model.blocks[0].fc1.weight.register_hook(boom)
    t0 = time.monotonic()
    try:
        for s in (1, 2, 3):
            opt.zero_grad()
            opt.backward(M.loss_fn(model, M.rank_tokens(s, rank, ws)))
            opt.step()
    except Exception as e:  # noqa: BLE001
        if rank == 3:
            raise  # the process exits with it
        return {"err": (type(e).__name__, str(e)[:300]), "elapsed": time.monotonic() - t0}
    return {"err": None, "elapsed": time.monotonic() - t0}


@pytest.mark.parametrize("stage, hpz", [(2, False), (3, True)])
def test_rank_process_dying_mid_step_fails_every_rank(stage, hpz):
    with pytest.raises(zk_spawn.RankFailure) as info:
        zk_spawn.spawn_ranks(_dies, WS, stage, hpz, threads=1, timeout=120, grace=GRACE,
                             pg_timeout=PG_TIMEOUT, context=_CTX)
    out = info.value.outcomes
    assert "user hook failed on rank 3" in (out[3].error or "")
    for o in out[:3]:
        assert o.ok, f"rank {o.rank} was still waiting {GRACE} s after rank 3 died ({o})"
        assert o.value["err"] is not None, o.value
        assert o.value["elapsed"] < PROMPT_S, o.value
