"""A trainable param that no rank used in a step is skipped as torch's AdamW skips a param whose
grad is None (issue 36, item 1; frozen_slots.py [Note: a param no rank used]).

A small MoE-like model on N = 1, 2, 3 gloo ranks, routed by step number (deterministic):
expert 0 every step; expert 1 on no rank at steps 1 and 4; expert 2 on no rank at steps 1, 2
and 4 (back at step 3 with its own bias-correction count, t = 2 where the bucket's is 4);
expert 3 on rank 0 only (the negative control: used on one rank, it moves on all, as DDP's
zero-gradient contribution makes it). weight_decay 0.1, fp32, the cpu backend.

Reference: DistributedDataParallel(find_unused_parameters=True) + torch.optim.AdamW
(foreach=False), which leaves an expert no rank used with grad None, so AdamW skips it (no
decay, no moment update, no step count). Checks per case:
- "skip": at every step where an expert was used by no rank, its params (and master and moments
  where kept) are bit for bit what they were before the step, on every rank;
- "rel": params after 5 steps against the reference (TOL, the parity tests' fp32 bound);
- "control": the expert used on rank 0 only moved at every step (N >= 2).
ZeroMuon (Muon over the expert matrices, AdamW over the biases; torch.optim.Muon skips a grad
None param too) and ZeroLion (no lion-pytorch here; Lion counts no steps) get the "skip" and
"control" checks; ZeroMuon's AdamW half is the biases'.
On the code before this change the "skip" check failed at every stage (the unused experts moved
by weight decay and stale momentum) and so did "rel" (1e-3).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zerokern as zk

from ..support import models as M
from ..support.harness import cached, case, run_cases

STEPS = 5
LR, WD = 1e-2, 0.1
TOL = 1e-5
UNUSED = {1: {1, 4}, 2: {1, 2, 4}}  # expert -> steps where no rank uses it


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x, route):
        h = torch.relu(self.inp(x))
        out = sum(self.experts[e](h) for e in route)
        return self.head(torch.relu(out))


def route(step: int, rank: int):
    r = [0] + [e for e in (1, 2) if step not in UNUSED[e]]
    return r + [3] if rank == 0 else r


def batch(step: int, rank: int):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _expert(name: str):
    return int(name.split(".")[1]) if name.startswith("experts.") else None


def _state(opt, model):
    """master / moments by name where the rule keeps them (gathered)."""
    out = {}
    for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
        shim = type("S", (), dict(comm=opt.comm, stage=opt.stage, flat_groups=[
            g for g in opt.flat_groups if key in g.rule_states]))()
        if shim.flat_groups:
            out[key] = M.gather_state(shim, model, key)
    return out


def _run(rank, ws, stage, kind="adamw", **kw):
    model = MoE()
    if kind == "adamw":
        opt = zk.ZeroAdamW(model, stage=stage, precision="fp32", backend="cpu", lr=LR,
                           weight_decay=WD, bucket_mb=0.002, **kw)
    elif kind == "lion":
        opt = zk.ZeroLion(model, stage=stage, precision="fp32", backend="cpu", lr=1e-3,
                          weight_decay=WD, bucket_mb=0.002, **kw)
    else:
        opt = zk.ZeroMuon(model, stage=stage, precision="fp32", backend="cpu", lr=0.02,
                          weight_decay=WD, adamw_lr=LR, adamw_weight_decay=WD,
                          bucket_mb=0.002, **kw)
    ref = ropt = None
    if kind == "adamw":
        ref_model = MoE()
        ref = nn.parallel.DistributedDataParallel(ref_model, find_unused_parameters=True)
        ropt = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=WD,
                                 foreach=False)
    skip_bad, control_still = [], []
    for step in range(STEPS):
        before = M.full_snapshot(model, opt)
        st_before = _state(opt, model)
        model(batch(step, rank), route(step, rank)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        after = M.full_snapshot(model, opt)
        st_after = _state(opt, model)
        for n, p in after.items():
            e = _expert(n)
            if e in UNUSED and step in UNUSED[e]:
                if not torch.equal(p, before[n]):
                    skip_bad.append((step, n, float((p - before[n]).abs().max())))
                for key, d in st_after.items():
                    if n in d and not torch.equal(d[n], st_before[key][n]):
                        skip_bad.append((step, f"{key}:{n}",
                                         float((d[n] - st_before[key][n]).abs().max())))
            if e == 3 and torch.equal(p, before[n]):
                control_still.append((step, n))
        if ref is not None:
            ref(batch(step, rank), route(step, rank)).pow(2).mean().backward()
            ropt.step()
            ropt.zero_grad()
    out = dict(skip=skip_bad, control=control_still)
    if ref is not None:
        got, want = M.full_snapshot(model, opt), M.snapshot(ref.module)
        out["rel"] = M.rel_err(got, want)
        out["rel_unused"] = max(
            float((got[n] - want[n]).abs().max() / want[n].abs().max())
            for n in got if _expert(n) in UNUSED)
    return out


CASES = [(kind, stage) for stage in range(4) for kind in ("adamw", "lion", "muon")]


def _worker(rank, ws):
    cases = {f"{kind}-s{stage}": (lambda kind=kind, stage=stage: _run(rank, ws, stage, kind))
             for kind, stage in CASES}
    return run_cases(cases)


@pytest.fixture(scope="module", params=[1, 2, 3])
def results(request):
    return request.param, cached(_worker, request.param)


@pytest.mark.parametrize("kind,stage", CASES)
def test_param_no_rank_used_is_skipped(results, kind, stage):
    ws, res = results
    for r, got in enumerate(case(res, f"{kind}-s{stage}")):
        assert not got["skip"], f"rank {r}: moved while no rank used it: {got['skip'][:4]}"
        if ws >= 2:  # negative control: used on rank 0 only, it moves on every rank
            assert not got["control"], f"rank {r}: expert 3 did not move: {got['control']}"
        if "rel" in got:
            assert got["rel"] <= TOL, f"rank {r}: params vs DDP+AdamW rel {got['rel']:.3g}"
            assert got["rel_unused"] <= TOL, \
                f"rank {r}: the unused experts vs DDP+AdamW {got['rel_unused']:.3g}"
