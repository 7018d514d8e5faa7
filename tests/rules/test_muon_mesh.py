"""ZeroMuon(mesh=...) on a 2x2 HSDP (replicate, shard) mesh of 4 gloo ranks (issue 36, item 5),
against single-process torch.optim.Muon + torch.optim.AdamW, as tests/rules/test_muon.py checks
the 1-D case: stages 0-3, fp32, 3 steps on fresh tokens per rank. Each reference step takes the
gradient the engine reduced ([Note: the reference takes the engine's reduced gradient] in
test_muon.py), gathered over the shard group (replicas hold the same shard after the
replicate all-reduce); that gradient is checked against the single-process global-batch one.
The Newton-Schulz plan runs over the shard group (2 owners), each replica orthogonalizing its
own copy. Negative controls: lr x 1.01 and ns_steps=4 in the reference are caught, and so is
HSDP without the replicate all-reduce (each shard then holds only its replica's sum).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from ..support import models as M
from ..support.harness import cached, case, run_cases
from .test_muon import (
    MUON,
    STEPS,
    TOL,
    _compare,
    build,
    global_grads,
    make_reference,
    reference_steps,
)

WS = 4
STAGES = [0, 1, 2, 3]


def _full(opt, model, bufs) -> dict:
    """Whole tensors by param name from each buffer's pieces (`bufs(gi, g, k)`: bucket k's
    piece on this rank), gathered over the shard group only."""
    shard = opt.comm.shard
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for gi, g in enumerate(opt.flat_groups):
        L = g.layout
        pieces = [bufs(gi, g, k) for k in range(L.n_buckets)]
        if any(p is None for p in pieces):
            continue
        full = torch.zeros(L.padded_numel)
        for k, piece in enumerate(pieces):
            lo, hi = g.state_range(k)
            if g.pattern.replicated_state or shard.world_size == 1:
                full[lo:hi] = piece
            else:
                parts = [torch.empty_like(piece) for _ in range(shard.world_size)]
                dist.all_gather(parts, piece.contiguous(), group=shard.group)
                full[slice(*L.bucket_range(k))] = torch.cat(parts)
        for p, s in zip(g.params, L.slots):
            out[names[id(p)]] = full[s.offset:s.offset + s.numel].view(s.shape).clone()
    return out


def reduced_grads(opt, model) -> dict:
    """The gradient the next step() uses, whole: the reduced pieces times the unscale."""
    opt._prepare()
    gs = opt.grad_sync
    return _full(opt, model, lambda gi, g, k: gs.grad_piece(gi, k).float() * opt._unscale)


def states(opt, model) -> dict:
    out = {}
    for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
        out[key] = _full(opt, model, lambda gi, g, k, key=key: (
            g.rule_states[key][g.state_slice(k)] if key in g.rule_states else None))
    return out


def _train(model, opt, rank, steps):
    grads = []
    for s in range(steps):
        opt.zero_grad()
        opt.backward(M.loss_fn(model, M.rank_tokens(s, rank, WS)))
        grads.append(reduced_grads(opt, model))
        opt.step()
    return grads


def _parity(rank, stage, mesh, controls=False, no_replicate=False):
    model = M.make_model()
    opt = build(model, stage, mesh=mesh)
    if no_replicate:  # negative control: the replicate all-reduce dropped
        opt.comm.replicate = None
        if stage == 3:
            opt.grad_sync.rs_comm.replicate = None
    grads = _train(model, opt, rank, STEPS)
    got, state = M.full_snapshot(model, opt), states(opt, model)
    ref = M.make_model()
    opts = make_reference(ref)
    if no_replicate:  # the reference steps on the single-process global-batch gradients
        for s in range(STEPS):
            reference_steps(ref, opts, [global_grads(ref, s)])
        return {"param": M.rel_err(got, M.snapshot(ref))}
    reference_steps(ref, opts, grads)
    out = _compare(got, state, ref, opts)
    out["grad0"] = M.rel_err(grads[0], global_grads(M.make_model(), 0))
    out["muon_groups"] = [g["use_muon"] for g in opt.param_groups]
    out["dims"] = opt.comm.dims
    out["owners"] = sorted(set(o for p in opt._plans.values() for o in p.owner.values()))
    out["replica"] = M.full_replica_diff(model, opt)
    if controls:
        for name, kw in (("lr", dict(lr_scale=1.01)), ("ns", dict(ns_steps=4))):
            ctl = M.make_model()
            reference_steps(ctl, make_reference(ctl, MUON, **kw), grads)
            out[name] = M.rel_err(got, M.snapshot(ctl))
    return out


def _worker(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    cases = {}
    for stage in STAGES:
        cases[f"parity-{stage}"] = functools.partial(_parity, rank, stage, mesh,
                                                     controls=stage == 2)
    cases["no-replicate"] = functools.partial(_parity, rank, 2, mesh, no_replicate=True)
    return run_cases(cases)


@pytest.fixture(scope="module")
def results():
    return cached(_worker, WS)


@pytest.mark.parametrize("stage", STAGES)
def test_muon_hsdp_matches_torch(results, stage):
    for r, x in enumerate(case(results, f"parity-{stage}")):
        where = f"2x2 mesh stage {stage} rank {r}"
        assert x["dims"] == {"shard": 2, "replicate": 2, "world": 4}, where
        assert x["muon_groups"] == [True, False], where
        assert x["owners"] == [0, 1], f"{where}: owners {x['owners']} (the shard group's)"
        assert x["grad0"] <= TOL["grad"], f"{where}: reduced grad rel {x['grad0']:.3g}"
        assert x["state"] <= TOL["state"], f"{where}: state rel {x['state']:.3g}"
        assert x["param"] <= TOL["param"], f"{where}: params rel {x['param']:.3g}"
        assert x["muon_bitwise"], f"{where}: the Muon params are not torch's bit for bit"
        assert x["replica"] == 0.0, f"{where}: ranks differ by {x['replica']}"
        if "lr" in x:
            assert x["lr"] > TOL["control"], f"{where}: lr x 1.01 not caught ({x['lr']})"
            assert x["ns"] > TOL["control"], f"{where}: ns_steps 4 not caught ({x['ns']})"


def test_negative_control_without_replicate_reduce(results):
    rels = [x["param"] for x in case(results, "no-replicate")]
    assert min(rels) > 10 * TOL["control"], rels
