"""hpZ (issue 22 item 3): stage 3 on a 2x2 mesh with hpz=True, params sharded over all 4 gloo
ranks plus a secondary copy sharded over the node (mesh dim 1), must train bit for bit as
plain stage 3 over the same 4 ranks, while the backward re-gathers stay in the node.

One spawn: bitwise parity (plain, clipped, no_sync accumulation), DDP + torch AdamW as the
independent reference, comm_stats per dim, memory_report, the negative control (a secondary
never invalidated, so gathers read params from before the step), the bad-argument errors.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
from torch.distributed.device_mesh import init_device_mesh

from zerokern.stage3.hpz import HpzSecondary

from ..support import models as M
from ..support.harness import cached, case, run_cases

WS = 4
STEPS = 4
MAX_NORM = 0.05

TOL = {
    # vs DDP + torch AdamW (the bound for fp32 parity); hpZ itself must be bitwise.
    "param": 1e-6,
}


def _parity(rank, memo, variant):
    kw = {"clip": {"max_grad_norm": MAX_NORM}, "plain": {}}.get(variant, {})
    micro = 2 if variant == "accum" else 1
    out = {}
    recs = {}
    for hpz in (False, True):
        model = M.make_model()
        mesh = memo["mesh22"] if hpz else memo["mesh4"]
        opt = M.zero_opt(model, 3, mesh=mesh, hpz=hpz, **kw)
        opt.reset_comm_stats()
        recs[hpz] = M.train_zero(model, opt, rank, WS, STEPS, micro=micro)
        out[f"stats{int(hpz)}"] = opt.comm_stats()
        if hpz:
            mem = opt.memory_report()
            out["mem"] = {"gap": abs(mem["measured_total"] - mem["formula_total"]),
                          "slack": mem["allowed_slack"],
                          "secondary": mem["measured"]["hpz_secondary"],
                          "secondary_formula": mem["formula"]["hpz_secondary"],
                          "dims": opt.comm.dims}
    out["bitwise"] = all(M.bitwise_equal(a, b)
                         for a, b in zip(recs[True]["params"], recs[False]["params"]))
    out["norms_equal"] = recs[True]["grad_norm"] == recs[False]["grad_norm"]
    if variant == "plain":
        out["rel_ddp"] = M.rel_err(recs[True]["params"][-1], memo["ref"]["params"][-1])
    return out


def _negative(rank, memo):
    """A secondary that is never dropped: later gathers read params from before the step."""
    model = M.make_model()
    with mock.patch.object(HpzSecondary, "invalidate", lambda self: None):
        opt = M.zero_opt(model, 3, mesh=memo["mesh22"], hpz=True)
        rec = M.train_zero(model, opt, rank, WS, STEPS)
    return M.rel_err(rec["params"][-1], memo["ref"]["params"][-1])


def _errors(rank, memo):
    out = {}
    for name, kw in {"stage2": dict(stage=2, mesh=memo["mesh22"]),
                     "one_d": dict(stage=3, mesh=memo["mesh4"]),
                     "no_mesh": dict(stage=3),
                     "not_bool": dict(stage=3, mesh=memo["mesh22"], hpz="yes")}.items():
        kw.setdefault("hpz", True)
        model = M.make_model()
        try:
            M.zero_opt(model, kw.pop("stage"), **kw)
            out[name] = None
        except (ValueError, TypeError) as e:
            out[name] = (type(e).__name__, str(e),
                         not any(hasattr(p, "_zerokern_sync") for p in model.parameters()))
    return out


def _worker(rank, ws):
    memo = {"mesh22": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
            "mesh4": init_device_mesh("cpu", (WS,))}
    memo["ref"] = M.train_torch(M.make_model(), rank, WS, STEPS)
    cases = {v: functools.partial(_parity, rank, memo, v) for v in ("plain", "clip", "accum")}
    cases["negative"] = functools.partial(_negative, rank, memo)
    cases["errors"] = functools.partial(_errors, rank, memo)
    return run_cases(cases)


def _results():
    return cached(_worker, WS)


@pytest.mark.parametrize("variant", ["plain", "clip", "accum"])
def test_hpz_is_bitwise_plain_stage3(variant):
    for r, v in enumerate(case(_results(), variant)):
        assert v["bitwise"] and v["norms_equal"], (r, variant)


def test_hpz_matches_ddp():
    for r, v in enumerate(case(_results(), "plain")):
        assert v["rel_ddp"] <= TOL["param"], (r, v["rel_ddp"])


def test_hpz_backward_gathers_stay_in_the_node():
    for r, v in enumerate(case(_results(), "plain")):
        plain, hpz = v["stats0"], v["stats1"]
        assert set(plain["dims"]) == {"shard"}, plain
        world_ag, node_ag = hpz["dims"]["shard"]["all_gather"], hpz["dims"]["hpz"]["all_gather"]
        assert node_ag > 0 and world_ag < plain["all_gather"], (r, hpz)
        # the same gathers, a part of them over 2 ranks ((2-1)/2 of the unit) instead of 4
        # ((4-1)/4): the bytes they would have sent over the world are 3/2 of the node's
        assert world_ag + node_ag * 3 // 2 == plain["all_gather"], (r, plain, hpz)
        assert hpz["calls"]["all_gather"] == plain["calls"]["all_gather"], (r, plain, hpz)
        # reduce-scatter over the world as in plain stage 3
        assert hpz["reduce_scatter"] == plain["reduce_scatter"], (r, plain, hpz)


def test_hpz_memory_report():
    for r, v in enumerate(case(_results(), "plain")):
        m = v["mem"]
        assert m["dims"] == {"shard": 4, "replicate": 1, "world": 4, "hpz": 2}, (r, m)
        assert m["gap"] <= m["slack"], (r, m)
        assert m["secondary"] >= m["secondary_formula"] > 0, (r, m)


def test_negative_control_stale_secondary_misses():
    for r, rel in enumerate(case(_results(), "negative")):
        assert rel > 100 * TOL["param"], (r, rel)


@pytest.mark.parametrize("name,kind", [("stage2", "ValueError"), ("one_d", "ValueError"),
                                       ("no_mesh", "ValueError"), ("not_bool", "TypeError")])
def test_hpz_bad_arguments(name, kind):
    for r, v in enumerate(case(_results(), "errors")):
        err = v[name]
        assert err is not None and err[0] == kind and "hpz" in err[1] and err[2], (r, err)
