"""Stages 0-1 no longer zero the grad buffer at zero_grad() ([Note: no per-step memset] in
full_grads.py): a param's view keeps the values of an earlier step (stage 0: the last average;
stage 1: the partial sums the in-place reduce-scatter left) until a grad overwrites it or its
bucket's reduction zeroes it. These cases make such stale values reachable and compare against
an independent reference, DDP's rule written out (`_reference`): a per-param buffer B, zeroed by
zero_grad, each backward adds the local grad (0 for a param it did not use), a synced backward
replaces B by the mean over ranks, and torch.optim.AdamW steps with p.grad = B, or with
p.grad None (skipped) for a param no rank used since zero_grad(set_to_none=True) (as DDP with
find_unused_parameters=True leaves it; frozen_slots.py [Note: a param no rank used]).

The usage pattern changes every step and differs between ranks: params used in one step and
not the next (their view holds last step's values), a param no rank uses in a step, no_sync()
micro-batches that use a different subset than the synced one, a backward after step() with no
zero_grad() (stage 1: the in-place reduction's pieces are set aside, the rest is stale), and
zero_grad(set_to_none=False) (p.grad must read zeros). Tiny buckets put params of both kinds
in one bucket and split params across buckets.

Negative control: the same run with the stale-zeroing disabled (FullGrads._zero_stale a no-op)
must differ from the reference: the cases do reach stale values.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import zerokern as zk
from zerokern.grads.full_grads import FullGrads

from ..support.harness import cached, case, run_cases

WORLD_SIZES = [2, 3]
STAGES = [0, 1]
HP = dict(lr=3e-2, betas=(0.5, 0.7), eps=1e-3, weight_decay=0.1)  # exaggerated: bugs show
TOL = 1e-6  # fp32 relative error vs the reference: same adds, same order, fp32 AdamW

# (step, micro-batch) -> which branches rank r uses; None: the same on every rank.
# Each step: a list of micro-batches (all but the last under no_sync()), and whether
# zero_grad(set_to_none) runs before it ("none", "zeros", or "keep": no zero_grad).
PLAN = [
    ("none", [lambda r: {"a", "b", "c"}]),
    ("none", [lambda r: {"a"} if r == 0 else {"a", "b"}]),            # b stale on rank 0, c all
    ("none", [lambda r: {"c"}, lambda r: {"b"} if r % 2 else {"a"}]),  # no_sync uses others
    ("keep", [lambda r: {"a", "c"} if r == 1 else {"b"}]),             # sums across a step()
    ("zeros", [lambda r: {"b"}]),                                      # p.grad zeros first
    ("none", [lambda r: {"a", "c"}, lambda r: {"c"}]),
]


class Branches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.a = torch.nn.Linear(13, 64)
        self.b = torch.nn.Linear(13, 64)
        self.c = torch.nn.Linear(13, 64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / 4 + 0.05)

    def forward(self, x, use):
        return sum(getattr(self, n)(x).pow(2).mean() for n in sorted(use))


def _data(step, micro, rank):
    return torch.randn(5, 13, generator=torch.Generator().manual_seed(1000 * step + 10 * micro
                                                                      + rank))


def _zerokern(rank, ws, stage, broken=False):
    model = Branches()
    opt = zk.ZeroAdamW(model, stage=stage, precision="fp32", bucket_mb=0.0005,
                       backend="cpu", **HP)
    assert opt.flat_groups[0].layout.n_buckets > 3
    if broken:  # negative control: stale views reach the reduction
        opt.grad_sync._zero_stale = lambda gi, k: None
    params, zero_reads = [], []
    for s, (zero, micros) in enumerate(PLAN):
        if zero != "keep":
            opt.zero_grad(set_to_none=(zero == "none"))
            if zero == "zeros" and stage == 0:
                zero_reads.append(all(torch.equal(p.grad, torch.zeros_like(p))
                                      for p in model.parameters()))
        for m, use in enumerate(micros):
            ctx = opt.no_sync() if m < len(micros) - 1 else _null()
            with ctx:
                model(_data(s, m, rank), use(rank)).backward()
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return {"params": params, "zeros_read_as_zeros": zero_reads}


def _reference(rank, ws):
    model = Branches()
    opt = torch.optim.AdamW(model.parameters(), **HP)
    buf = [torch.zeros_like(p) for p in model.parameters()]
    seen = torch.zeros(len(buf))  # p.grad not None here since zero_grad(set_to_none=True)
    params = []
    for s, (zero, micros) in enumerate(PLAN):
        if zero != "keep":
            for b in buf:
                b.zero_()
            seen.fill_(0.0 if zero == "none" else 1.0)  # set_to_none=False: p.grad zeros
        for m, use in enumerate(micros):
            model.zero_grad(set_to_none=True)
            model(_data(s, m, rank), use(rank)).backward()
            for i, (b, p) in enumerate(zip(buf, model.parameters())):
                if p.grad is not None:
                    b.add_(p.grad)
                    seen[i] = 1.0
            if m == len(micros) - 1:  # the synced backward: DDP's mean over ranks
                for b in buf:
                    dist.all_reduce(b)
                    b.div_(ws)
        anywhere = seen.clone()
        dist.all_reduce(anywhere)
        for i, (p, b) in enumerate(zip(model.parameters(), buf)):
            # no rank used it since zero_grad(set_to_none=True): grad None, AdamW skips it
            # (DDP with find_unused_parameters=True; issue 36, item 1)
            p.grad = b.clone() if anywhere[i] > 0 else None
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return {"params": params}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _rel(got, ref):
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref))


def _worker(rank, ws):
    ref = _reference(rank, ws)
    cases = {}
    for stage in STAGES:
        for broken in (False, True):
            def run(stage=stage, broken=broken):
                got = _zerokern(rank, ws, stage, broken)
                return {"rel": [_rel(g, r) for g, r in zip(got["params"], ref["params"])],
                        "zeros": got["zeros_read_as_zeros"]}
            cases[f"s{stage}{'-broken' if broken else ''}"] = functools.partial(run)
    return run_cases(cases)


def _results(ws):
    return cached(_worker, ws)


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_stale_views_match_ddp_rule(ws, stage):
    for r, res in enumerate(case(_results(ws), f"s{stage}")):
        assert max(res["rel"]) <= TOL, f"rank {r}: per-step rel err vs reference {res['rel']}"
        assert all(res["zeros"]), "zero_grad(set_to_none=False): p.grad must read zeros"


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_negative_control_stale_values_reach_the_reduction(ws, stage):
    worst = max(max(res["rel"]) for res in case(_results(ws), f"s{stage}-broken"))
    assert worst > 1e3 * TOL, f"without zeroing stale views the run still matched ({worst})"


def test_full_grads_has_no_memset_in_zero_grad():
    """zero_grad(set_to_none=True) marks the views stale instead of writing the buffer."""
    model = Branches()
    opt = zk.ZeroAdamW(model, stage=0, precision="fp32", backend="cpu", **HP)
    model(_data(0, 0, 0), {"a", "b", "c"}).backward()
    gs = opt.grad_sync
    assert isinstance(gs, FullGrads)
    before = [b.clone() for b in gs.grads]
    opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, gs.grads))  # not written
    assert all(all(row) for row in gs._stale)
