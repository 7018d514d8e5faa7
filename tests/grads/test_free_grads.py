"""ZeroAdamW(free_grads=True): the gradient memory is freed at zero_grad(set_to_none=True) and
allocated again by the next backward (DeepSpeed's memory profile between steps; the engine's
setting). Training must be bitwise the same as with the buffers kept.

Per world size N = 1, 2, 3, one spawned group runs every (stage, precision) sub-case:
- parity: 3 steps of 2 micro-batches (no_sync on the first), an fp16 run with an overflow
  skip, clipping, and a zero_grad(set_to_none=False) in between (which must not free), each
  bitwise equal to free_grads=False on the same data (params, master, m, v, grad norm);
- memory: after zero_grad() the report's grads and buckets are 0 and the storages of the
  optimizer's grad buffers are really gone (counted from the gc, not from memory.py), after a
  backward they are back; negative control: free_grads=False keeps them.
"""

from __future__ import annotations

import functools

import pytest
import torch

import zerokern as zk

# Every distinct storage alive in the process, found through the gc (independent of memory.py).
from zerokern.bench.engine import held_bytes

from ..support import models as M
from ..support.harness import cached, case, run_cases

# [Note: the slow mark] (pyproject.toml): the largest world runs in CI's -m slow pass
# N=2 in the default suite (the smallest world with shards); N=1 and 3 in the slow pass
WORLD_SIZES = [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)]
CASES = [(0, "fp32"), (1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16"), (3, "fp32"),
         (3, "bf16"), (1, "fp16"), (2, "fp16")]


def _run(rank, ws, stage, prec, free):
    model = M.make_model()
    kw = {"max_grad_norm": 0.5, "free_grads": free}
    if prec == "fp16":
        kw["loss_scale"] = {"init_scale": 2.0**15, "growth_interval": 2}  # skips step 3
    opt = M.zero_opt(model, stage, prec, **kw)
    rec = M.train_zero(model, opt, rank, ws, 2, micro=2)
    opt.zero_grad(set_to_none=False)  # keeps the buffers (p.grad zeros at stage 0, as torch)
    rec2 = M.train_zero(model, opt, rank, ws, 1, start=2, micro=2)
    out = {"params": rec["params"] + rec2["params"],
           "grad_norm": rec["grad_norm"] + rec2["grad_norm"],
           "skipped": rec["skipped"] + rec2["skipped"]}
    for key in ("master", "exp_avg", "exp_avg_sq"):
        out[key] = M.gather_state(opt, model, key)
    return out


def _memory(rank, ws, stage, prec, free):
    model = M.make_model()
    opt = M.zero_opt(model, stage, prec, free_grads=free)
    M.train_zero(model, opt, rank, ws, 1)
    after_step = opt.memory_report()["measured"]
    with_grads = held_bytes()
    opt.zero_grad()
    between = opt.memory_report()["measured"]
    without = held_bytes()
    M.train_zero(model, opt, rank, ws, 1, start=1)  # allocates again, trains again
    again = opt.memory_report()["measured"]
    return {"grads_after_step": after_step["grads"], "grads_between": between["grads"],
            "buckets_between": between["buckets"], "grads_again": again["grads"],
            "freed_bytes": with_grads - without,
            "expected": after_step["grads"] + after_step["buckets"] + after_step["padding"]
            - between["padding"]}


def _worker(rank, ws):
    cases = {}
    for stage, prec in CASES:
        for free in (False, True):
            cases[f"run {stage} {prec} {free}"] = functools.partial(_run, rank, ws, stage,
                                                                    prec, free)
    for stage, prec in [(0, "fp32"), (1, "fp32"), (2, "bf16"), (3, "fp32")]:
        for free in (False, True):
            cases[f"mem {stage} {prec} {free}"] = functools.partial(_memory, rank, ws, stage,
                                                                    prec, free)
    return run_cases(cases)


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage,prec", CASES)
def test_free_grads_trains_bitwise_as_kept_buffers(ws, stage, prec):
    res = cached(_worker, ws)
    kept, freed = case(res, f"run {stage} {prec} False"), case(res, f"run {stage} {prec} True")
    for r in range(ws):
        assert kept[r]["grad_norm"] == freed[r]["grad_norm"]
        assert kept[r]["skipped"] == freed[r]["skipped"]
        for a, b in zip(kept[r]["params"], freed[r]["params"]):
            assert M.bitwise_equal(a, b)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert M.bitwise_equal(kept[r][key], freed[r][key]), key
    if prec == "fp16":  # the skip ran (scale 2^15 grows to 2^16: step 3 overflows)
        assert any(kept[0]["skipped"]) and not all(kept[0]["skipped"])
    # The params moved: the comparison is of a real run, not of two untouched models.
    assert not M.bitwise_equal(kept[0]["params"][0], kept[0]["params"][-1])


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage,prec", [(0, "fp32"), (1, "fp32"), (2, "bf16"), (3, "fp32")])
def test_free_grads_releases_the_memory_at_zero_grad(ws, stage, prec):
    res = cached(_worker, ws)
    for m in case(res, f"mem {stage} {prec} True"):
        assert m["grads_after_step"] > 0 and m["grads_again"] == m["grads_after_step"]
        assert m["grads_between"] == 0 and m["buckets_between"] == 0
        # The storages are really gone (the process's count drops by what the report held).
        assert m["freed_bytes"] >= m["expected"] > 0
    for m in case(res, f"mem {stage} {prec} False"):  # negative control: kept
        assert m["grads_between"] == m["grads_after_step"] > 0
        assert m["freed_bytes"] < m["grads_after_step"]


def test_free_grads_must_be_a_bool():
    model = M.make_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match="free_grads"):
        zk.ZeroAdamW(model.parameters(), stage=1, precision="bf16", free_grads="yes")
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
