"""zerokern.checkpoint.recover_from_replica (replica.py [Note: recovery from a live replica]).

4 gloo ranks, a 2x2 (replicate, shard) mesh, ZeroAdamW at stage 2 bf16 (an fp32 master apart
from the bf16 values), stage 3 fp32 (the sharded params are the master) and stage 1 bf16 with
offload="cpu" (the state in the host placement). After K steps the
ranks of replica 1 lose their state: every master, rule state, value, step counter, buffer and
param filled with garbage (NaN, a wrong step), the LR and the loss scaler changed: what a
replica re-initialized or found corrupt holds. Then recover_from_replica(source=0):
- right after it, every rank's params and optimizer state equal, bit for bit, an uninterrupted
  run's at step K, and replica 0's are what they were before (it kept its own);
- K more steps later they equal the uninterrupted run's at step 2K bit for bit (nothing the
  training reads was left out: the step counters, the LR, the scaler);
- the source's client_state reaches every rank.
Negative control: the same loss without the recovery does not continue as the reference.
Refusals (on every rank, nothing changed): a source that is no replica; a rank whose layout
differs from its source's (faked). `verify`: a byte corrupted in transit (faked) raises
CheckpointError on every rank. In process: no mesh, bad argument types.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zerokern.checkpoint as ck
from zerokern.checkpoint import replica
from zerokern.checkpoint.views import model_extras, optimizer_view

from ..support import models as M
from ..support.harness import cached, case, one_thread, run_cases  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")
WS, K = 4, 2
CONFIGS = {"s2-bf16": (2, "bf16", {}), "s3-fp32": (3, "fp32", {}),
           "s1-bf16-offload-cpu": (1, "bf16", {"offload": "cpu"})}


def _state(model, opt) -> dict:
    """Full params (stage 3 gathered) and the optimizer's state_dict states (collective)."""
    sd = opt.state_dict()
    return {"params": M.full_snapshot(model, opt),
            "state": [{k: v.clone() for k, v in s.items()} for s in sd["state"]],
            "lr": [g["lr"] for g in opt.param_groups], "scale": float(opt.loss_scale)}


def _same(a: dict, b: dict) -> bool:
    return (M.bitwise_equal(a["params"], b["params"]) and a["lr"] == b["lr"]
            and a["scale"] == b["scale"] and len(a["state"]) == len(b["state"])
            and all(M.bitwise_equal(x, y) for x, y in zip(a["state"], b["state"])))


@torch.no_grad()
def _lose_state(model, opt, lr: bool = True) -> None:
    """Garbage in everything a load writes, and the params, LR (`lr`) and scaler besides."""
    view = optimizer_view(model, opt)
    ts = [t for p in view.held for t in p.tensors().values()] + [v.value for v in view.values]
    ts += [t for _, _, t in model_extras(model, view)] + [p for p in model.parameters()]
    for t in ts:
        t.detach().fill_(math.nan if t.is_floating_point() else 7)
    for c in view.steps:
        c.value.fill_(123)
    for g in opt.param_groups if lr else ():
        g["lr"] = 0.5


def _run(rank, mesh, stage, precision, opt_kw, lose: bool, heal: bool):
    model = M.make_model()
    opt = M.zero_opt(model, stage, precision, mesh=mesh, **opt_kw)
    M.train_zero(model, opt, rank, WS, K)
    at_k = _state(model, opt)
    out = {}
    if lose and rank >= 2:  # replica 1: ranks 2 and 3 of the (2, 2) mesh
        _lose_state(model, opt, lr=lose != "state")
    if heal:
        rep = ck.recover_from_replica(model, opt, client_state={"step": K} if rank < 2
                                      else "not sent")
        out["report"] = {k: rep[k] for k in ("received", "client_state", "broadcasts")}
        out["bytes"] = rep["bytes"]
        healed = _state(model, opt)
        out["healed_is_step_k"] = _same(healed, at_k)
    M.train_zero(model, opt, rank, WS, K, start=K)
    out["final"] = _state(model, opt)
    return out


def _raised(fn, *args):
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    return "no error"


def _uninterrupted(rank, mesh, stage, precision, opt_kw):
    model = M.make_model()
    opt = M.zero_opt(model, stage, precision, mesh=mesh, **opt_kw)
    M.train_zero(model, opt, rank, WS, 2 * K)
    return _state(model, opt)


def _refused(rank, mesh, what):
    model = M.make_model()
    opt = M.zero_opt(model, 2, "fp32", mesh=mesh)
    M.train_zero(model, opt, rank, WS, 1)
    before = _state(model, opt)
    if rank >= 2:
        _lose_state(model, opt)
    lost = _state(model, opt)
    real = replica._layout_crc, replica._transfer
    if what == "layout" and rank == 3:
        replica._layout_crc = lambda *a: 0
    if what == "verify" and rank == 3:
        def flip(tensors, *a):
            n = real[1](tensors, *a)
            tensors[0].view(-1)[:1].view(torch.uint8)[0] ^= 1
            return n
        replica._transfer = flip
    try:
        ck.recover_from_replica(model, opt, source=2 if what == "source" else 0)
        err = None
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    finally:
        replica._layout_crc, replica._transfer = real
    after = _state(model, opt)
    return {"error": err, "unchanged": _same(after, lost),
            "replica0_kept": rank >= 2 or _same(after, before)}


def _worker(rank, ws):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    cases = {}
    for name, (stage, precision, kw) in CONFIGS.items():
        cases[f"ref-{name}"] = functools.partial(_uninterrupted, rank, mesh, stage, precision,
                                                 kw)
        cases[f"heal-{name}"] = functools.partial(_run, rank, mesh, stage, precision, kw, True,
                                                  True)
    # the LR kept: an LR that differs across the ranks is refused at the next step
    # (core/hyper_agreement.py), so the lost params and state alone show the departure
    cases["no-heal"] = functools.partial(_run, rank, mesh, 2, "bf16", {}, "state", False)
    cases["no-heal-lr"] = functools.partial(_raised, _run, rank, mesh, 2, "bf16", {}, True,
                                            False)
    cases["kept"] = functools.partial(_run, rank, mesh, 2, "bf16", {}, False, True)
    for what in ("source", "layout", "verify"):
        cases[f"refused-{what}"] = functools.partial(_refused, rank, mesh, what)
    return run_cases(cases)


def _results():
    return cached(_worker, WS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_lost_replica_takes_the_live_ones_state_bitwise(name):
    refs = case(_results(), f"ref-{name}")
    for r, (res, ref) in enumerate(zip(case(_results(), f"heal-{name}"), refs)):
        assert res["healed_is_step_k"], r  # right after: the uninterrupted run's step K
        assert _same(res["final"], ref), r  # and it trains on as if nothing had happened
        assert res["report"]["received"] == (r >= 2), (r, res["report"])
        assert res["report"]["client_state"] == {"step": K}, (r, res["report"])
        assert res["bytes"] > 0 and res["report"]["broadcasts"] >= 1


def test_negative_control_without_recovery_the_run_departs():
    refs = case(_results(), "ref-s2-bf16")
    for r, (res, ref) in enumerate(zip(case(_results(), "no-heal"), refs)):
        assert not _same(res["final"], ref), r


def test_without_recovery_a_lost_lr_is_refused_on_every_rank():
    """The lost replica's LR garbled too: the ranks' hyperparameter agreement refuses the next
    step on every rank (before it, the run trained on with two LRs)."""
    for r, msg in enumerate(case(_results(), "no-heal-lr")):
        assert "differ across the data-parallel ranks" in msg, f"rank {r}: {msg}"


def test_the_source_replica_keeps_its_state():
    """Nothing lost: the recovery changes no rank's state (replica 1 receives its own bytes)."""
    refs = case(_results(), "ref-s2-bf16")
    for r, (res, ref) in enumerate(zip(case(_results(), "kept"), refs)):
        assert res["healed_is_step_k"] and _same(res["final"], ref), r


@pytest.mark.parametrize("what,error", [
    ("source", "ValueError: source=2 is not a replica: the mesh has 2 replicas"),
    ("layout", "another layout than its source's"),
])
def test_refusals_on_every_rank_before_any_change(what, error):
    for r, res in enumerate(case(_results(), f"refused-{what}")):
        assert res["error"] is not None and error in res["error"], (r, res)
        assert res["error"].startswith("ValueError"), (r, res)
        assert res["unchanged"] and res["replica0_kept"], (r, res)


def test_verify_finds_a_byte_changed_in_transit_on_every_rank():
    for r, res in enumerate(case(_results(), "refused-verify")):
        assert res["error"] is not None and res["error"].startswith("CheckpointError"), res
        assert "differs from its source's" in res["error"], (r, res)
        assert res["replica0_kept"], (r, res)


def test_refused_without_a_replicate_group_and_bad_arguments():
    model = M.make_model()
    opt = M.zero_opt(model, 1)
    with pytest.raises(ValueError, match="needs an HSDP mesh"):
        ck.recover_from_replica(model, opt)
    with pytest.raises(TypeError, match="source must be an int"):
        ck.recover_from_replica(model, opt, source="0")
    with pytest.raises(TypeError, match="verify must be True or False"):
        ck.recover_from_replica(model, opt, verify=1)
    with pytest.raises(TypeError, match="opt must be"):
        ck.recover_from_replica(model, torch.optim.SGD(model.parameters(), lr=1.0))
    assert not dist.is_initialized()
