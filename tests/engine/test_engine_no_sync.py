"""`engine.no_sync()` misuse raises as DeepSpeed's does (issue 36, item 7), 2 gloo ranks,
stages 0-3, each rank its own data:

- `engine.step()` inside `no_sync()` (DeepSpeed: AssertionError "It is illegal to call
  Engine.step() inside no_sync context manager"). On the old code the step ran on each rank's
  own, unreduced gradient: the ranks' params came apart (the numbers in the commit message)
  and nothing was said. Now: NoSyncError (an AssertionError and a RuntimeError) before
  anything changes, the params equal on both ranks and unchanged; the same for a step inside
  the optimizer's own `no_sync()`.
- re-entering `no_sync()` (DeepSpeed: AssertionError "no_sync context manager reentry is
  unsupported"): NoSyncError at the inner `with`, the outer context still intact.
- `no_sync()` at stages 2-3, which DeepSpeed forbids, stays supported: a micro-batch's
  backward inside it, the step outside, equals the same accumulation without it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import cached, case, run_cases

from . import common as C


def _flat(engine, stage):
    ctx = engine.optimizer.gathered_params() if stage == 3 else contextlib.nullcontext()
    with ctx:
        return torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])


def _spread(v: torch.Tensor) -> float:
    """max |rank 0 - rank r| of v."""
    out = [torch.zeros_like(v) for _ in range(dist.get_world_size())]
    dist.all_gather(out, v)
    return max(float((out[0] - o).abs().max()) for o in out)


def _engine(rank, stage, gas=1):
    import zerokern as zk

    C.launcher_env(rank)
    engine, _, _, _ = zk.initialize(model=C.gpt2(), config=C.base_config(stage, gas=gas))
    return engine


def _loss(engine, rank, s=0, m=0):
    x = C.tokens(s, m, rank)
    return engine(input_ids=x, labels=x).loss


def _misuse(rank, stage, how):
    engine = _engine(rank, stage)
    before = _flat(engine, stage)
    raised = None
    try:
        if how == "step":
            with engine.no_sync():
                engine.backward(_loss(engine, rank))
                engine.step()
        elif how == "opt-step":
            with engine.optimizer.no_sync():
                engine.backward(_loss(engine, rank))
                engine.step()
        elif how == "normal":  # the same step, no no_sync: what the old code's step equalled
            engine.backward(_loss(engine, rank))
            engine.step()
        else:  # "reenter"
            with engine.no_sync():
                engine.backward(_loss(engine, rank))
                with engine.no_sync():
                    engine.backward(_loss(engine, rank, 1))
            engine.step()
    except AssertionError as e:
        raised = (type(e).__name__, isinstance(e, RuntimeError), str(e))
    after = _flat(engine, stage)
    out = {"raised": raised, "spread": _spread(after),
           "changed": float((after - before).abs().max())}
    # the engine is usable afterwards: a normal step keeps the ranks together
    engine.optimizer.zero_grad()
    engine.backward(_loss(engine, rank, 2))
    engine.step()
    out["spread_after_normal_step"] = _spread(_flat(engine, stage))
    return out


def _accumulate(rank, stage, use_no_sync):
    engine = _engine(rank, stage, gas=2)
    for s in range(2):
        ctx = engine.no_sync() if use_no_sync else contextlib.nullcontext()
        with ctx:
            engine.backward(_loss(engine, rank, s, 0))
        engine.step()
        engine.backward(_loss(engine, rank, s, 1))
        engine.step()
    return _flat(engine, stage)


def _deepspeed(rank):
    """What DeepSpeed 0.19.8 raises for the same misuse (stage 1; at 2-3 no_sync itself)."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    out = {}
    for stage, how in ((1, "step"), (1, "reenter"), (2, "enter")):
        C.launcher_env(rank)
        with C.restore_linear():
            engine, _, _, _ = deepspeed.initialize(model=C.gpt2(),
                                                   config=C.base_config(stage, gas=1))
            try:
                with engine.no_sync():
                    engine.backward(_loss(engine, rank))
                    if how == "step":
                        engine.step()
                    elif how == "reenter":
                        with engine.no_sync():
                            pass
                out[f"{how}-s{stage}"] = None
            except AssertionError as e:
                out[f"{how}-s{stage}"] = (type(e).__name__, str(e))
            engine.destroy()
    return out


def _worker(rank, ws):
    cases = {"deepspeed": lambda: _deepspeed(rank)}
    for stage in (0, 1, 2, 3):
        for how in ("step", "opt-step", "reenter", "normal"):
            cases[f"{how}-s{stage}"] = lambda stage=stage, how=how: _misuse(rank, stage, how)
        if stage >= 2:
            def acc(stage=stage):
                a, b = _accumulate(rank, stage, True), _accumulate(rank, stage, False)
                return {"diff": float((a - b).abs().max()), "spread": _spread(a)}
            cases[f"acc-s{stage}"] = acc
    return run_cases(cases)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("how", ["step", "opt-step", "reenter"])
def test_no_sync_misuse_raises_before_any_change(how, stage):
    for r in case(cached(_worker, 2), f"{how}-s{stage}"):
        assert r["raised"] is not None, r
        name, is_runtime, msg = r["raised"]
        assert name == "NoSyncError" and is_runtime, r
        assert ("reentry" if how == "reenter" else "inside no_sync") in msg, r
        assert r["changed"] == 0.0, r  # nothing stepped
        assert r["spread"] == 0.0 and r["spread_after_normal_step"] == 0.0, r


def test_deepspeed_raises_assertion_errors_there():
    """The reference: DeepSpeed raises AssertionError for both misuses (and for no_sync at
    stage 2, which zerokern supports)."""
    pytest.importorskip("deepspeed")
    for r in case(cached(_worker, 2), "deepspeed"):
        assert r["step-s1"] == ("AssertionError", "It is illegal to call Engine.step() inside "
                                "no_sync context manager"), r
        assert r["reenter-s1"] == ("AssertionError",
                                   "no_sync context manager reentry is unsupported"), r
        assert r["enter-s2"][0] == "AssertionError" and "ZeRO stage 2" in r["enter-s2"][1], r


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_at_stages_2_3_is_kept(stage):
    for r in case(cached(_worker, 2), f"acc-s{stage}"):
        assert r["diff"] <= 1e-6 and r["spread"] == 0.0, r
