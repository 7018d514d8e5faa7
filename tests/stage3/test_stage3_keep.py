"""ZeroAdamW(stage=3, keep_for_backward_mb=): units a grad-enabled forward leaves gathered for
the backward ([Note: kept units] in zerokern/stage3/units.py).

- Which units: the root and the last unit of the schedule always; then whole units from the
  end of the schedule while they fit the budget (a budget of exactly one more unit keeps one
  more; math.inf keeps every unit).
- Training is the same: parity with DDP + AdamW on the test GPT and on the data-dependent
  model of test_stage3_users (dropped blocks, branches, MoE experts: a rank that skipped a
  kept unit keeps it too, so the strict ZEROKERN_DEBUG_COLLECTIVES=1 check of one collective
  order on every rank runs at every step), bitwise equal to the default budget's run.
- Once the forward reaches the kept units it gathers all of them at once (with every unit
  kept, all are launched by the root's forward pre-hook), within the same bound.
- What it buys and costs, exactly: comm_stats()'s all-gather bytes are one gather per kept unit
  buffer and two per other one, from the padded layout (fewer bytes as the budget grows); the
  peak of gathered unit bytes stays within live_units_bound, which counts the kept units and
  equals `zerokern.estimate(..., keep_for_backward_mb=)`'s.
- With offload_params="cpu" training is bitwise the default budget's.
- Bad values raise before the model is touched.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import pytest
import torch

import zerokern as zk
from zerokern.accounting import estimate as E

from ..support import models as M
from ..support.harness import cached, case, run_cases, ws_params
from .test_stage3_users import TOL, _with_debug, _zero3, ddp_reference, make_dyn

BUDGETS = ("default", "one_more", "all")
D = 32


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class TiedLM(torch.nn.Module):
    """The last block uses block 1's weight: unit 6 depends on unit 2, which is then held
    from its forward gather to the end of backward, and kept whenever unit 6 is."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(M.MODEL_SEED)
        self.emb = torch.nn.Embedding(M.VOCAB, D)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(6))
        self.head = torch.nn.Linear(D, M.VOCAB)
        self.blocks[5].fc.weight = self.blocks[1].fc.weight

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _budget_mb(name: str, model_fn, ws: int) -> float:
    """The budget in MiB: 0, exactly the bytes of the unit before the last one in the
    schedule (with its deps; read from a default-budget optimizer's layout), or inf."""
    if name == "default":
        return 0.0
    if name == "all":
        return math.inf
    probe = _zero3(model_fn())
    sync = probe.grad_sync
    ui = sync.schedule[-2]
    extra = [uj for uj in sync._need(sync.units[ui]) if uj not in sync.kept_units]
    return sum(f.full_bytes for uj in extra for f in sync._bufs(uj)) / 2**20


def _run(rank, ws, model_name, budget_name):
    model_fn = {"gpt": M.make_model, "dyn": make_dyn, "tied": TiedLM}[model_name]
    mb = _budget_mb(budget_name, model_fn, ws)
    model = model_fn()
    opt = _with_debug(lambda: _zero3(model, keep_for_backward_mb=mb))
    sync = opt.grad_sync
    launched = []  # gathered or in flight once the root's forward pre-hook has run
    hook = model.register_forward_pre_hook(lambda m, a: launched.append(sync.live_bytes))
    steps = 3
    for s in range(steps):  # train3's steps, its snapshot (a gather of everything) after
        if s == steps - 1:
            opt.reset_comm_stats()  # the last step's collectives alone
        opt.zero_grad()
        M.loss_fn(model, M.rank_tokens(s, rank, ws)).backward()
        opt.step()
    all_gather = opt.comm_stats()["all_gather"]
    hook.remove()
    rep = opt.memory_report()
    got = M.full_snapshot(model, opt)
    ref = ddp_reference(model_fn(), rank, ws, steps=steps)
    sync = opt.grad_sync
    frac, e = Fraction(ws - 1, ws), 4
    kept = set(sync.kept_units)
    return {
        "rel": M.rel_err(got, ref), "moved": M.rel_err(got, M.snapshot(model_fn())),
        "params": {k: v.clone() for k, v in got.items()},
        "kept": sorted(kept), "schedule": list(sync.schedule), "checks": opt.comm.log.checks,
        "steps": steps, "all_gather": all_gather, "launched_at_root": max(launched),
        # one gather per kept unit buffer, two for the others ((N-1)/N of each, padded)
        "expected_all_gather": sum((1 if f.unit_index in kept else 2)
                                   * int(frac * f.layout.padded_numel * e)
                                   for f in opt.flat_groups + sync.frozen),
        "peak": rep["peak_live_units"], "bound": rep["live_units_bound"],
        "all_units": sum(f.full_bytes for f in opt.flat_groups + sync.frozen),
        "estimate_bound": E.estimate(E.spec_from_model(model_fn()), ws, 3, "fp32",
                                     rank=rank, comm="gloo",
                                     keep_for_backward_mb=mb)["live_units_bound"],
    }


def _offload(rank, ws, mb):
    """offload_params="cpu": the kept units stay on the device from forward to backward."""
    model = M.make_model()
    opt = _zero3(model, offload_params="cpu", keep_for_backward_mb=mb)
    for s in range(3):
        opt.zero_grad()
        M.loss_fn(model, M.rank_tokens(s, rank, ws)).backward()
        opt.step()
    return M.full_snapshot(model, opt)


def _worker(rank, ws):
    cases = {f"{m}_{b}": functools.partial(_run, rank, ws, m, b)
             for m in ("gpt", "dyn", "tied") for b in BUDGETS}
    cases.update({f"offload_{b}": functools.partial(_offload, rank, ws, mb)
                  for b, mb in (("default", 0.0), ("all", math.inf))})
    return run_cases(cases)


@pytest.mark.parametrize("ws", ws_params(1, 2, 3))
@pytest.mark.parametrize("model", ["gpt", "dyn", "tied"])
def test_kept_units_train_as_ddp_and_save_their_gathers(ws, model):
    res = {b: case(cached(_worker, ws), f"{model}_{b}") for b in BUDGETS}
    for b in BUDGETS:
        for r, x in enumerate(res[b]):
            assert x["moved"] > 100 * TOL["param"], "training must move the params"
            assert x["rel"] <= TOL["param"], f"{b}, rank {r}: vs DDP + AdamW {x['rel']:.3g}"
            # the bytes gathered are those of one gather per kept unit buffer, two per other
            assert x["all_gather"] == x["expected_all_gather"], (b, r, x["all_gather"],
                                                                 x["expected_all_gather"])
            assert 0 < x["peak"] <= x["bound"], (b, r, x["peak"], x["bound"])
            assert x["bound"] == x["estimate_bound"], (b, r, x["bound"], x["estimate_bound"])
            if ws > 1:  # one collective order on every rank, checked at every step()
                assert x["checks"] == x["steps"], (b, r, x["checks"])
            same = all(torch.equal(x["params"][k], res["default"][r]["params"][k])
                       for k in x["params"])
            assert same, f"{b}, rank {r}: training differs from the default budget's"
    d, one, every = (res[b][0] for b in BUDGETS)
    sched = d["schedule"]
    assert set(d["kept"]) >= {0, sched[-1]} and sched[-2] not in d["kept"], d["kept"]
    assert sched[-2] in one["kept"], one["kept"]
    if len(sched) > 2:  # (the test GPT has 2 blocks: one more is every unit)
        assert sched[-3] not in one["kept"], one["kept"]
    assert set(every["kept"]) >= set(sched), every["kept"]
    # every unit kept: all launched as the forward starts (they stay gathered until their
    # backward anyway: [Note: kept units]); by default the root and the next unit only
    assert every["launched_at_root"] == every["all_units"], every
    assert d["launched_at_root"] < d["all_units"], d
    if ws > 1:  # the saving is real: fewer bytes gathered as the budget grows
        assert every["all_gather"] <= one["all_gather"] < d["all_gather"]
        assert every["all_gather"] < one["all_gather"] or len(sched) == 2
    # the cost is counted: the bound with every unit kept holds every unit
    assert every["bound"] >= every["all_units"] >= d["bound"]
    assert every["all_units"] > d["bound"] or len(sched) == 2


@pytest.mark.parametrize("ws", ws_params(1, 2))
def test_kept_units_with_param_offload_train_bitwise_the_same(ws):
    for r, (d, every) in enumerate(zip(case(cached(_worker, ws), "offload_default"),
                                       case(cached(_worker, ws), "offload_all"))):
        assert all(torch.equal(d[k], every[k]) for k in d), f"rank {r}"


def test_bad_keep_for_backward_mb_raises_before_the_model_changes():
    model = M.make_model()
    before = M.snapshot(model)
    for bad, err in ((-1.0, ValueError), (float("nan"), ValueError), ("8", TypeError),
                     (True, TypeError), (None, TypeError)):
        with pytest.raises(err, match="keep_for_backward_mb"):
            zk.ZeroAdamW(model, stage=3, precision="fp32", keep_for_backward_mb=bad)
    with pytest.raises(ValueError, match="keep_for_backward_mb applies to stage=3"):
        zk.ZeroAdamW(model, stage=2, precision="fp32", keep_for_backward_mb=4)
    with pytest.raises(ValueError, match="keep_for_backward_mb"):
        E.estimate(E.spec_from_numel(1000), 1, 2, keep_for_backward_mb=4)
    assert M.rel_err(M.snapshot(model), before) == 0
    zk.ZeroAdamW(model, stage=2, precision="fp32", keep_for_backward_mb=0)  # 0: any stage
