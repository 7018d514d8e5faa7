"""ZeroAdamW.state_dict / load_state_dict: a bitwise resume, and mismatches rejected up front.

Round trip: 3 steps, save opt.state_dict() + the model's params (through torch.save bytes),
3 more steps recorded; then a FRESH model + optimizer (same config) loads both and runs the
same 3 steps: params and optimizer state must be bitwise identical to the uninterrupted run.

Mismatch: a state dict from another stage, precision, bucket size, world size (a subgroup),
rank, or loss-scaler kind must raise ValueError before anything changes.
"""

from __future__ import annotations

import functools
import io

import pytest
import torch
import torch.distributed as dist

from ..support import models as M
from ..support.harness import cached, case, run_cases

# [Note: the slow mark] (pyproject.toml): the largest world runs in CI's -m slow pass
WORLD_SIZES = [2, pytest.param(3, marks=pytest.mark.slow)]
STAGES = [0, 1, 2]
PRECISIONS = {"fp32": ("fp32", None), "bf16": ("bf16", None), "fp16": ("fp16", "dynamic")}
SAVE_AT, MORE = 3, 3

# Tolerances: none, both are exact.
TOL = {
    "resume": "bitwise",  # a resume replays the same arithmetic on the same bits
    "rejected_load": "bitwise",  # a rejected load_state_dict changes nothing at all
}


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _opt_state(opt) -> dict:
    sd = opt.state_dict()
    out = {f"{gi}.{k}": t for gi, st in enumerate(sd["state"]) for k, t in st.items()}
    out.update(
        {f"scaler.{k}": v for k, v in sd["loss_scaler"].items() if isinstance(v, torch.Tensor)}
    )
    return out


def _resume(rank, ws, prec, stage):
    precision, scale = PRECISIONS[prec]
    model = M.make_model()
    opt = M.zero_opt(model, stage, precision, loss_scale=scale or "dynamic")
    M.train_zero(model, opt, rank, ws, SAVE_AT)
    ckpt = _roundtrip({"opt": opt.state_dict(), "model": M.snapshot(model)})
    straight = M.train_zero(model, opt, rank, ws, MORE, start=SAVE_AT)
    state_straight = _opt_state(opt)

    model2 = M.make_model(seed=M.MODEL_SEED + 1)  # other init: everything must come from ckpt
    opt2 = M.zero_opt(model2, stage, precision, loss_scale=scale or "dynamic")
    with torch.no_grad():
        for n, p in model2.named_parameters():
            p.copy_(ckpt["model"][n])
    opt2.load_state_dict(ckpt["opt"])
    resumed = M.train_zero(model2, opt2, rank, ws, MORE, start=SAVE_AT)
    return {
        "params": all(M.bitwise_equal(a, b) for a, b in zip(resumed["params"], straight["params"])),
        "state": M.bitwise_equal(_opt_state(opt2), state_straight),
        "loss_scale": resumed["loss_scale"] == straight["loss_scale"],
        "moved": not M.bitwise_equal(straight["params"][-1], ckpt["model"]),
    }


def _rejects(target_opt, target_model, sd) -> dict:
    """Load `sd` into target_opt: must raise ValueError and leave every bit as it was."""
    before = (
        _opt_state(target_opt),
        M.snapshot(target_model),
        [dict(g, params=None) for g in target_opt.param_groups],
    )
    try:
        target_opt.load_state_dict(sd)
        err = None
    except ValueError as e:
        err = str(e)
    except Exception as e:  # noqa: BLE001 - the wrong type is a failure too
        err = f"WRONG TYPE {type(e).__name__}: {e}"
    after = (
        _opt_state(target_opt),
        M.snapshot(target_model),
        [dict(g, params=None) for g in target_opt.param_groups],
    )
    return {
        "error": err,
        "unchanged": M.bitwise_equal(after[0], before[0])
        and M.bitwise_equal(after[1], before[1])
        and after[2] == before[2],
    }


def _trained(rank, ws, stage, precision="fp32", loss_scale=None, steps=2, group=None, **kw):
    model = M.make_model()
    opt = M.zero_opt(
        model, stage, precision, loss_scale=loss_scale or "dynamic", process_group=group, **kw
    )
    M.train_zero(model, opt, rank, ws if group is None else dist.get_world_size(group), steps)
    return model, opt


def _mismatch(rank, ws, what):
    if what == "world_size":
        # a group of the first ws-1 ranks: the same model at another world size
        sub = dist.new_group(list(range(ws - 1)))
        m_all, o_all = _trained(rank, ws, 2, steps=1)  # every rank: collectives over WORLD
        out = {}
        if rank < ws - 1:
            m_sub, o_sub = _trained(rank, ws, 2, group=sub)
            out = {
                "sub_into_world": _rejects(o_all, m_all, o_sub.state_dict()),
                "world_into_sub": _rejects(o_sub, m_sub, o_all.state_dict()),
            }
        return out
    if what == "scaler_kind":  # fp16 dynamic checkpoint into an fp16 static-scale optimizer
        model, opt = _trained(rank, ws, 2, "fp16", 256.0, steps=1)
        return {"load": _rejects(opt, model, _trained(rank, ws, 2, "fp16")[1].state_dict())}
    model, opt = _trained(rank, ws, 2, steps=1)
    if what == "stage":
        sd = _trained(rank, ws, 1)[1].state_dict()
    elif what == "precision":
        sd = _trained(rank, ws, 2, "bf16")[1].state_dict()
    elif what == "bucket_mb":
        sd = _trained(rank, ws, 2, bucket_mb=2 * M.BUCKET_MB)[1].state_dict()
    elif what == "rank":
        objs = [None] * ws
        dist.all_gather_object(objs, _trained(rank, ws, 2)[1].state_dict())
        sd = objs[(rank + 1) % ws]
    elif what == "not_zero":
        sd = M.torch_adamw(M.make_model()).state_dict()
    return {"load": _rejects(opt, model, sd)}


MISMATCHES = ["stage", "precision", "bucket_mb", "world_size", "rank", "not_zero", "scaler_kind"]


def _worker(rank, ws):
    cases = {
        f"resume_{p}_{s}": functools.partial(_resume, rank, ws, p, s)
        for p in PRECISIONS
        for s in STAGES
    }
    cases.update({f"mismatch_{w}": functools.partial(_mismatch, rank, ws, w) for w in MISMATCHES})
    return run_cases(cases)


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("prec", list(PRECISIONS))
def test_resume_is_bitwise(prec, stage, ws):
    for r, res in enumerate(case(cached(_worker, ws), f"resume_{prec}_{stage}")):
        assert res["moved"], "the recorded steps must train"
        assert res["params"], f"rank {r}: resumed params differ from the uninterrupted run"
        assert res["state"], f"rank {r}: resumed optimizer state differs"
        assert res["loss_scale"], f"rank {r}: resumed loss scale differs"


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("what", MISMATCHES)
def test_mismatched_state_dict_rejected_before_any_change(what, ws):
    for r, res in enumerate(case(cached(_worker, ws), f"mismatch_{what}")):
        if what == "world_size" and r == ws - 1:
            continue  # not in the subgroup
        assert res, f"rank {r}: no result"
        for name, got in res.items():
            assert got["error"] is not None, f"rank {r} {name}: load_state_dict accepted it"
            assert not got["error"].startswith("WRONG TYPE"), f"rank {r} {name}: {got['error']}"
            assert got["unchanged"], (
                f"rank {r} {name}: state changed before the ValueError ({got['error']})"
            )
