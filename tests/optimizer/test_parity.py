"""fp32 parity of ZeroAdamW stages 0-2 with DDP + torch.optim.AdamW, at world sizes 1-4.

One spawn per world size runs every sub-case (plain parity, clipping, accumulation, lr
schedulers, the negative controls, frozen/tied bookkeeping); the tests below read one case each.
At world size 1 the reference is the bare model (no DDP wrap).
"""

from __future__ import annotations

import functools

import pytest
import torch

from ..support import models as M
from ..support.harness import cached, case, run_cases, ws_params

STEPS = 6
MAX_NORM = 0.05  # the global grad norm here is >= 2: every step is clipped (by >= 40x)
MICRO = 3
# [Note: the slow mark] (pyproject.toml): the largest world runs in CI's -m slow pass
WORLD_SIZES = ws_params(1, 2, 3, 4)  # harness [Note: world sizes in the default run]
STAGES = [0, 1, 2, 3]

# Tolerances: relative = max|a - b| / max|b| per param, the max over params (models.rel_err).
TOL = {
    # Params vs DDP + AdamW after 6 steps (the bound). Measured <= 1.7e-7: torch's
    # lerp/addcdiv vs the fused formula, and DDP's pre-divided buckets, differ by an ulp or so.
    "param": 1e-6,
    # exp_avg / exp_avg_sq: these follow grads of params that are already ~1e-7 apart, and a
    # bias with a tiny grad turns that into a larger relative change. Measured <= 1.2e-6.
    "moment": 1e-5,
    # opt.grad_norm vs clip_grad_norm_'s return value (the issue's bound). fp32 sums of ~1e4
    # squares in another order: ~1e-7 measured.
    "grad_norm": 1e-5,
    # Stage 1/2 vs zerokern stage 0 at world size <= 2: a sum of two fp32 numbers does not
    # depend on the order, and every kernel sees the same elements, so the bits must agree.
    "stage_bitwise_max_ws": 2,
    # A deliberately wrong reference must miss by at least this factor of TOL["param"];
    # measured 3.2e-3 (betas 0.5 -> 0.55) and 6e-3 (no weight decay).
    "negative_factor": 100,
}


# ---- rank side ---------------------------------------------------------------------------------
def _frozen_tied(model, opt) -> dict:
    bufs = [g.full if opt.stage == 3 else g.flat for g in opt.flat_groups]
    with opt.gathered_params():  # stage 3: params are views into the gathered full buffers
        flats = [(b.data_ptr(), b.data_ptr() + b.nbytes) for b in bufs]
        unique = sum(p.numel() for p in model.parameters() if p.requires_grad)
        in_flat = all(any(lo <= p.data_ptr() < hi for lo, hi in flats)
                      for p in model.parameters() if p.requires_grad)
    pos = model.pos
    with opt.gathered_params():  # stage 3 shards the frozen pos with the root unit too
        pos_full = pos.detach().clone()
    return {
        "layout_numel": sum(g.layout.numel for g in opt.flat_groups),
        "unique_numel": unique,
        "pos_in_flat": any(lo <= pos.data_ptr() < hi for lo, hi in flats),
        "pos_in_groups": any(p is pos for g in opt.param_groups for p in g["params"]),
        "pos_dtype": str(pos.dtype),
        "pos_unchanged": torch.equal(pos_full, M.make_model().pos),
        "tied": model.head.weight is model.emb.weight,
        "params_in_flat": in_flat,
        "n_buckets": [g.layout.n_buckets for g in opt.flat_groups],
    }


def _zero_run(rank, ws, stage, micro=1, **kw):
    model = M.make_model()
    opt = M.zero_opt(model, stage, **kw)
    rec = M.train_zero(model, opt, rank, ws, STEPS, micro=micro)
    return model, opt, rec


def _parity(rank, ws, stage, memo, backend=M.BACKEND):
    ref = memo["ref"]
    model, opt, rec = _zero_run(rank, ws, stage, backend=backend)
    memo[stage if backend == M.BACKEND else (stage, backend)] = rec
    out = {
        "rel": M.rel_err(rec["params"][-1], ref["params"][-1]),
        "moved": M.rel_err(rec["params"][-1], M.snapshot(M.make_model())),
        "exp_avg": M.rel_err(
            M.gather_state(opt, model, "exp_avg"),
            M.torch_state(ref["opt"], memo["ref_model"], "exp_avg"),
        ),
        "exp_avg_sq": M.rel_err(
            M.gather_state(opt, model, "exp_avg_sq"),
            M.torch_state(ref["opt"], memo["ref_model"], "exp_avg_sq"),
        ),
        "steps": sorted({int(s) for g in opt.flat_groups for s in g.steps}),
        "replica": M.full_replica_diff(model, opt),
        **_frozen_tied(model, opt),
    }
    if stage > 0:
        out["rel_stage0"] = max(M.rel_err(a, b) for a, b in zip(rec["params"], memo[0]["params"]))
        out["bitwise_stage0"] = all(
            M.bitwise_equal(a, b) for a, b in zip(rec["params"], memo[0]["params"])
        )
    return out


def _reference(rank, ws, memo):
    memo["ref_model"] = M.make_model()
    memo["ref"] = M.train_torch(memo["ref_model"], rank, ws, STEPS)
    return True


def _negative(rank, ws, memo, **wrong):
    ref = M.train_torch(M.make_model(), rank, ws, STEPS, **wrong)
    return M.rel_err(memo[2]["params"][-1], ref["params"][-1])


def _clip(rank, ws, stage):
    ref = M.train_torch(M.make_model(), rank, ws, STEPS, clip=MAX_NORM)
    _, _, rec = _zero_run(rank, ws, stage, max_grad_norm=MAX_NORM)
    return {
        "rel": M.rel_err(rec["params"][-1], ref["params"][-1]),
        "norm_rel": max(abs(a - b) / b for a, b in zip(rec["grad_norm"], ref["grad_norm"])),
        "min_ref_norm": min(ref["grad_norm"]),
    }


def _accum(rank, ws, stage, memo):
    if "big" not in memo:
        memo["big"] = M.train_torch(M.make_model(), rank, ws, STEPS, micro=MICRO)
    _, _, rec = _zero_run(rank, ws, stage, micro=MICRO)
    return {
        "rel": M.rel_err(rec["params"][-1], memo["big"]["params"][-1]),
        "rel_1micro": M.rel_err(rec["params"][-1], memo[stage]["params"][-1]),
    }


def _double_step(rank, ws, stage):
    """step() twice on one backward's grads (torch.optim allows it: two updates, same grads)."""
    model = M.make_model()
    opt = M.zero_opt(model, stage)
    opt.zero_grad()
    opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws)))
    opt.step()
    norm1 = float(opt.grad_norm)
    opt.step()
    ref_model = M.make_model()
    net = ref_model if ws == 1 else torch.nn.parallel.DistributedDataParallel(ref_model)
    ref_opt = M.torch_adamw(ref_model)
    M.loss_fn(net, M.rank_tokens(0, rank, ws)).backward()
    ref_opt.step()
    ref_opt.step()
    snap = M.full_snapshot(model, opt)
    return {
        "rel": M.rel_err(snap, M.snapshot(ref_model)),
        "norm_ratio": float(opt.grad_norm) / norm1,
    }


_LAMBDA = [1.0, 0.3, 1.7, 0.5, 2.0, 0.1, 0.9]  # non-monotone, per-step lr factors


def _sched_fn(kind):
    if kind == "lambda":
        return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _LAMBDA[s])
    return lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=1e-3)


def _sched(rank, ws, stage, kind):
    ref = M.train_torch(M.make_model(), rank, ws, STEPS, scheduler_fn=_sched_fn(kind))
    model = M.make_model()
    opt = M.zero_opt(model, stage)
    rec = M.train_zero(model, opt, rank, ws, STEPS, scheduler=_sched_fn(kind)(opt))
    return {
        "rel": max(M.rel_err(a, b) for a, b in zip(rec["params"], ref["params"])),
        "lr_equal": rec["lr"] == ref["lr"],
        "lrs": rec["lr"],
    }


def _worker(rank, ws):
    memo = {}
    cases = {"reference": functools.partial(_reference, rank, ws, memo)}
    for stage in STAGES:
        cases[f"parity{stage}"] = functools.partial(_parity, rank, ws, stage, memo)
    cases["parity2_reference"] = functools.partial(_parity, rank, ws, 2, memo, "reference")
    cases["neg_betas"] = functools.partial(_negative, rank, ws, memo, betas=(0.55, 0.6))
    cases["neg_no_wd"] = functools.partial(_negative, rank, ws, memo, weight_decay=0.0)
    for stage in STAGES:
        cases[f"clip{stage}"] = functools.partial(_clip, rank, ws, stage)
        cases[f"accum{stage}"] = functools.partial(_accum, rank, ws, stage, memo)
    for stage in STAGES:
        cases[f"double_step{stage}"] = functools.partial(_double_step, rank, ws, stage)
    for kind in ("lambda", "cosine"):
        cases[f"sched_{kind}"] = functools.partial(_sched, rank, ws, 2 if ws > 1 else 1, kind)
    return run_cases(cases)


def _results(ws):
    return cached(_worker, ws)


# ---- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES + ["2_reference"])
def test_fp32_parity_with_ddp_adamw(ws, stage):
    for r, res in enumerate(case(_results(ws), f"parity{stage}")):
        if stage != 3:  # stage 3 has one bucket per (unit, group) buffer
            assert res["n_buckets"][0] > 1, "tiny buckets must give several buckets"
        assert res["moved"] > 100 * TOL["param"], "training must move the params"
        assert res["rel"] <= TOL["param"], f"rank {r}: params vs DDP+AdamW {res['rel']:.3g}"
        assert res["exp_avg"] <= TOL["moment"], f"rank {r}: exp_avg {res['exp_avg']:.3g}"
        assert res["exp_avg_sq"] <= TOL["moment"], f"rank {r}: exp_avg_sq {res['exp_avg_sq']:.3g}"
        assert res["steps"] == [STEPS], f"rank {r}: step counters {res['steps']}"
        assert res["replica"] == 0.0, f"rank {r}: params differ from rank 0's"


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_stages_match_stage0(ws, stage):
    for r, res in enumerate(case(_results(ws), f"parity{stage}")):
        assert res["rel_stage0"] <= TOL["param"], f"rank {r}: {res['rel_stage0']:.3g}"
        if ws <= TOL["stage_bitwise_max_ws"]:
            assert res["bitwise_stage0"], f"rank {r}: not bitwise equal to stage 0"


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("wrong", ["neg_betas", "neg_no_wd"])
def test_negative_control_wrong_reference_detected(ws, wrong):
    for err in case(_results(ws), wrong):
        assert err > TOL["negative_factor"] * TOL["param"], f"{wrong} went undetected ({err:.3g})"


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_frozen_param_untouched_and_tied_weight_stored_once(ws, stage):
    for res in case(_results(ws), f"parity{stage}"):
        assert res["layout_numel"] == res["unique_numel"], "tied weight stored twice?"
        assert res["tied"] and res["params_in_flat"]
        assert res["pos_unchanged"] and res["pos_dtype"] == "torch.float32"
        assert not res["pos_in_flat"] and not res["pos_in_groups"]


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_clipping_matches_clip_grad_norm(ws, stage):
    for r, res in enumerate(case(_results(ws), f"clip{stage}")):
        assert res["min_ref_norm"] > 2 * MAX_NORM, "the test must actually clip"
        assert res["norm_rel"] <= TOL["grad_norm"], f"rank {r}: grad_norm {res['norm_rel']:.3g}"
        assert res["rel"] <= TOL["param"], f"rank {r}: params {res['rel']:.3g}"


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_accumulation_equals_big_batch(ws, stage):
    for r, res in enumerate(case(_results(ws), f"accum{stage}")):
        assert res["rel"] <= TOL["param"], f"rank {r}: 3 micro vs big batch {res['rel']:.3g}"
        # and the big batch is really another batch than the 1-micro-batch run
        assert res["rel_1micro"] > 100 * TOL["param"]


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("kind", ["lambda", "cosine"])
def test_lr_scheduler_trajectory(ws, kind):
    for r, res in enumerate(case(_results(ws), f"sched_{kind}")):
        assert res["lr_equal"], f"rank {r}: lrs differ: {res['lrs']}"
        assert len({tuple(lr) for lr in res["lrs"]}) > 2, "the schedule must change the lr"
        assert res["rel"] <= TOL["param"], f"rank {r}: trajectory {res['rel']:.3g}"


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_two_steps_on_the_same_grads(ws, stage):
    """torch.optim semantics: a second step() without a new backward reuses the same (averaged)
    grads; it must not reduce them across ranks a second time."""
    for r, res in enumerate(case(_results(ws), f"double_step{stage}")):
        assert res["norm_ratio"] == pytest.approx(1.0, rel=TOL["grad_norm"]), (
            f"rank {r}: grad_norm grew x{res['norm_ratio']:.4g} on the second step()"
        )
        assert res["rel"] <= TOL["param"], f"rank {r}: params vs DDP+AdamW {res['rel']:.3g}"
