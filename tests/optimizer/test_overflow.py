"""A non-finite grad on ONE rank: every rank skips the step, bitwise (DESIGN §3), then trains on.

Two clean steps, then step 2 with one grad element set to inf (nan in one case) on the last rank
only, through a tensor hook on one param (after autograd, before zerokern sees the grad), then
two clean steps. The skipped step must leave params, master, exp_avg, exp_avg_sq, the step
counters and the param groups bitwise unchanged on every rank, set opt.step_skipped, and halve
a dynamic fp16 loss scale. Stages 0-2, fp32 / bf16 / fp16 static / fp16 dynamic.
"""

from __future__ import annotations

import functools

import pytest

from ..support import models as M
from ..support.harness import cached, case, run_cases, ws_params

# [Note: the slow mark] (pyproject.toml): the largest world runs in CI's -m slow pass
WORLD_SIZES = ws_params(1, 2, 3)  # harness [Note: world sizes in the default run]
STAGES = [0, 1, 2, 3]
KINDS = {  # name: (precision, loss_scale, injected value)
    "fp32": ("fp32", None, float("inf")),
    "fp32_nan": ("fp32", None, float("nan")),
    "bf16": ("bf16", None, float("-inf")),
    "fp16_static": ("fp16", 512.0, float("inf")),
    # dynamic, from 2^12: the default 2^16 overflows on its own in the first steps here
    "fp16_dynamic": ("fp16", {"init_scale": 2.0**12}, float("inf")),
}
BAD_STEP, STEPS = 2, 5

# Tolerances: none. A skipped step is a bitwise no-op (DESIGN §3), and a static scale does not
# move.
TOL = {
    "backoff": 0.5,  # exact factor of the dynamic loss scale after an overflow (a power of two)
}


def _state(opt, model):
    sd = opt.state_dict()
    return {
        "tensors": {f"{gi}.{k}": t for gi, st in enumerate(sd["state"]) for k, t in st.items()},
        "params": M.full_snapshot(model, opt),
        "groups": sd["param_groups"],
    }


def _same(a, b) -> dict:
    return {
        "tensors": M.bitwise_equal(a["tensors"], b["tensors"]),
        "params": M.bitwise_equal(a["params"], b["params"]),
        "groups": a["groups"] == b["groups"],
    }


def _case(rank, ws, kind, stage, **kw):
    """kw: more ZeroAdamW options for both runs (test_offload passes offload="cpu")."""
    precision, scale, value = KINDS[kind]
    model = M.make_model()
    opt = M.zero_opt(model, stage, precision, loss_scale=scale or "dynamic", **kw)
    target = model.blocks[1].fc1.weight  # mid-model: several buckets before and after it
    handles = []

    def inject(step):
        for h in handles:
            h.remove()
        handles.clear()
        if step == BAD_STEP and rank == ws - 1:

            def hook(g):
                g = g.clone()
                g[5, 7] = value
                return g

            handles.append(target.register_hook(hook))

    M.train_zero(model, opt, rank, ws, BAD_STEP, before_backward=inject)
    before = _state(opt, model)
    scale_before = float(opt.loss_scale)
    bad = M.train_zero(model, opt, rank, ws, 1, start=BAD_STEP, before_backward=inject)
    after = _state(opt, model)
    scale_after = float(opt.loss_scale)
    clean = M.train_zero(
        model, opt, rank, ws, STEPS - BAD_STEP - 1, start=BAD_STEP + 1, before_backward=inject
    )
    out = {
        "skipped": bad["skipped"][0],
        "unchanged": _same(before, after),
        "scale_before": scale_before,
        "scale_after": scale_after,
        "clean_skipped": clean["skipped"],
        "clean_moved": not M.bitwise_equal(clean["params"][0], after["params"]),
        "steps_after": sorted({int(s) for g in opt.flat_groups for s in g.steps}),
    }
    if not isinstance(scale, dict):
        # The same run without the bad step's data must give the same bits: the skip left no
        # trace (no stale grads, no half-updated bucket, no advanced counter).
        ref_model = M.make_model()
        ref_opt = M.zero_opt(ref_model, stage, precision, loss_scale=scale or "dynamic", **kw)
        M.train_zero(ref_model, ref_opt, rank, ws, BAD_STEP)
        ref = M.train_zero(ref_model, ref_opt, rank, ws, STEPS - BAD_STEP - 1, start=BAD_STEP + 1)
        out["same_as_without_bad_step"] = M.bitwise_equal(clean["params"][-1], ref["params"][-1])
    return out


def _worker(rank, ws):
    return run_cases(
        {
            f"{kind}_{stage}": functools.partial(_case, rank, ws, kind, stage)
            for kind in KINDS
            for stage in STAGES
        }
    )


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_overflow_on_one_rank_skips_everywhere(kind, stage, ws):
    precision, scale, _ = KINDS[kind]
    for r, res in enumerate(case(cached(_worker, ws), f"{kind}_{stage}")):
        assert res["skipped"], f"rank {r}: opt.step_skipped is False after an inf grad"
        for what, same in res["unchanged"].items():
            assert same, f"rank {r}: the skipped step changed {what}"
        if isinstance(scale, dict):
            assert res["scale_after"] == TOL["backoff"] * res["scale_before"], (
                f"rank {r}: loss scale {res['scale_before']} -> {res['scale_after']}"
            )
        else:
            assert res["scale_after"] == res["scale_before"]
            assert res["same_as_without_bad_step"], f"rank {r}: the skipped step left a trace"
        assert res["clean_skipped"] == [False] * (STEPS - BAD_STEP - 1), f"rank {r}"
        assert res["clean_moved"], f"rank {r}: clean steps after the skip did not train"
        assert res["steps_after"] == [STEPS - 1], f"rank {r}: step counters {res['steps_after']}"
