"""Stage 0's p.grad is DDP's average on every path of [Note: stage 0 divides as DDP does]:
a fresh grad divided while copied in, a sum accumulated in place under no_sync() divided before
its bucket is reduced, a no_sync()-only backward reduced at step(), and the same again after
zero_grad() (the per-param flags are reset). Reference: DDP(gradient_as_bucket_view=True) on
the same model and data, or the all-reduced local grads / N. Negative control: a buffer left
undivided (N x the average) is caught by the same check.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from ..support import models as M
from ..support.harness import cached, case, run_cases

WORLD_SIZES = [2, 3]
# p.grad vs DDP's: the same divided grads summed by gloo over other bucket boundaries, so the
# order of the N adds may differ per element: an ulp or so (measured <= 1.2e-7).
TOL = 1e-6


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def _pair(rank, ws):
    model, ref = M.make_model(), M.make_model()
    opt = M.zero_opt(model, 0)
    ddp = torch.nn.parallel.DistributedDataParallel(ref, gradient_as_bucket_view=True)
    return model, opt, ref, ddp


def _compare(got, want):
    return {"rel": M.rel_err(got, want),
            "rel_times_n": M.rel_err({k: v * dist.get_world_size() for k, v in got.items()},
                                     want),
            "names": sorted(got) == sorted(want)}


def _fresh_then_again(rank, ws):
    """Two iterations (zero_grad between, no step): every grad is fresh each time."""
    model, opt, ref, ddp = _pair(rank, ws)
    out = []
    for it in range(2):
        opt.zero_grad()
        ref.zero_grad(set_to_none=True)
        opt.backward(M.loss_fn(model, M.rank_tokens(it, rank, ws)))
        M.loss_fn(ddp, M.rank_tokens(it, rank, ws)).backward()
        out.append(_compare(_grads(model), _grads(ref)))
    return out


def _accumulated(rank, ws, set_to_none):
    """no_sync() then a synced backward: the second grad adds into the view in place."""
    model, opt, ref, ddp = _pair(rank, ws)
    out = []
    for it in range(2):
        opt.zero_grad(set_to_none=set_to_none)
        ref.zero_grad(set_to_none=set_to_none)
        with opt.no_sync():
            opt.backward(M.loss_fn(model, M.rank_tokens(it, rank, ws, micro=0)))
        with ddp.no_sync():
            M.loss_fn(ddp, M.rank_tokens(it, rank, ws, micro=0)).backward()
        opt.backward(M.loss_fn(model, M.rank_tokens(it, rank, ws, micro=1)))
        M.loss_fn(ddp, M.rank_tokens(it, rank, ws, micro=1)).backward()
        out.append(_compare(_grads(model), _grads(ref)))
    return out


def _no_sync_only(rank, ws):
    """Every backward under no_sync(): step() reduces; p.grad is then the average."""
    model, local = M.make_model(), M.make_model()
    opt = M.zero_opt(model, 0)
    with opt.no_sync():
        opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws)))
    M.loss_fn(local, M.rank_tokens(0, rank, ws)).backward()
    want = _grads(local)
    for g in want.values():
        dist.all_reduce(g)
        g.div_(ws)
    opt.step()
    return [_compare(_grads(model), want)]


def _worker(rank, ws):
    return run_cases({
        "fresh": functools.partial(_fresh_then_again, rank, ws),
        "accum_none": functools.partial(_accumulated, rank, ws, True),
        "accum_zeros": functools.partial(_accumulated, rank, ws, False),
        "no_sync_only": functools.partial(_no_sync_only, rank, ws),
    })


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("name", ["fresh", "accum_none", "accum_zeros", "no_sync_only"])
def test_stage0_grad_is_ddp_average(ws, name):
    for r, per_iter in enumerate(case(cached(_worker, ws), name)):
        for it, res in enumerate(per_iter):
            assert res["names"], f"rank {r} iteration {it}: params with a grad differ"
            assert res["rel"] <= TOL, f"rank {r} iteration {it}: p.grad vs DDP {res['rel']:.3g}"
            # negative control: an undivided sum (N x) would be far outside the tolerance
            assert res["rel_times_n"] > 0.3, f"rank {r}: the control misses N x ({res})"
