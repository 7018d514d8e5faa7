"""DeepSpeed's default Muon config (no `ns_method`: DeepSpeed 0.19's Gram Newton-Schulz) runs
unchanged through zerokern.initialize and matches DeepSpeed's Muon (issue 36, item 7).

- `newton_schulz_gram` is DeepSpeed's `zeropower_via_gram_newtonschulz` op for op: bitwise
  against its eager code in fp32 and fp16 (wide, tall, square; 1, 3, 5 and 7 steps).
- A DeepSpeed `"type": "Muon"` config without `ns_method` builds ZeroMuon with
  ns_method "gram" (on the old code: ValueError naming optimizer.params.ns_method).
- Training (slow): deepspeed.initialize (0.19.8, CPU, its Newton-Schulz in fp32: the dtype it
  picks on an accelerator without fp16, and zerokern's on the CPU) and zerokern.initialize on
  the same config, stages 0-3, 1 and 2 gloo ranks, 3 steps of 2 micro-batches: the params'
  change from the init agrees within TOL per half (Muon params, AdamW params). Controls: Muon
  lr x 1.01, and zerokern with ns_method "standard" (bf16), both far outside TOL.
Model, data and measure: tests/engine/test_deepspeed_muon.py.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")

import zerokern as zk  # noqa: E402
from tests.support.harness import cached, case, run_cases  # noqa: E402
from zerokern.engine.config import parse_config  # noqa: E402
from zerokern.rules.muon_orthogonalize import gram_dtype, newton_schulz_gram  # noqa: E402

from . import common as C  # noqa: E402
from . import test_deepspeed_muon as M  # noqa: E402

# DeepSpeed's Muon config as its users write it: no ns_method (DeepSpeed's default "gram")
GRAM = {k: v for k, v in M.MUON.items() if k != "ns_method"}
TOL = 1e-4  # fp32 Newton-Schulz of two codes (DeepSpeed's is torch.compile'd), 3 steps


def _eager(fn):
    """DeepSpeed's function without its @torch.compile wrapper (inductor fuses, eager rounds
    op by op as zerokern does)."""
    return getattr(fn, "_torchdynamo_orig_callable", None) or fn.__wrapped__


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gram_is_deepspeeds_iteration_bitwise(dtype):
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.muon import original_muon as om

    acc = get_accelerator()
    saved = acc.is_fp16_supported
    acc.is_fp16_supported = lambda: dtype == torch.float16  # ns_compute_dtype("gram")
    try:
        ds = _eager(om.zeropower_via_gram_newtonschulz)
        g = torch.Generator().manual_seed(0)
        for shape in [(16, 48), (48, 16), (32, 32), (8, 100), (100, 8)]:
            for steps in (1, 3, 5, 7):
                x = torch.randn(shape, generator=g) * 1e-3
                want = ds(x.clone(), steps)
                got = newton_schulz_gram(x.clone(), steps=steps, dtype=dtype)
                assert got.dtype == want.dtype == dtype
                assert torch.equal(got, want), (shape, steps)
    finally:
        acc.is_fp16_supported = saved
    assert gram_dtype(torch.device("cpu")) == torch.float32
    assert gram_dtype(torch.device("cuda", 0)) == torch.float16


def test_gram_differs_from_standard_only_by_rounding():
    """Gram NS is the standard quintic re-associated: in float64 the two agree to 1.6e-9 (the
    eps: DeepSpeed divides by norm + 1e-7, torch by max(norm, 1e-7)); an orthogonalization
    that skipped the restart or an R update would be O(1) away."""
    from zerokern.rules.muon_orthogonalize import orthogonalize

    x = torch.randn(24, 80, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a = newton_schulz_gram(x, dtype=torch.float64)
    b = M.newton_schulz64(x)
    assert (a - b).abs().max() <= 1e-8
    assert orthogonalize(x.float(), "gram").dtype == torch.float32
    with pytest.raises(ValueError, match="ns_method"):
        orthogonalize(x, "svd")


def test_deepspeed_muon_config_without_ns_method_runs():
    """On the old code: ValueError 'config key optimizer.params.ns_method must be
    "standard"'. Now ns_method "gram" reaches every Muon group; "standard" stays selectable and
    an unknown method is a ValueError naming the key."""
    cfg = M._config(1)
    cfg["optimizer"]["params"] = dict(GRAM)
    engine, opt, _, _ = zk.initialize(model=M._model(), config=cfg)
    assert isinstance(opt, zk.ZeroMuon)
    assert {g["ns_method"] for g in opt.param_groups if g["use_muon"]} == {"gram"}
    x = C.tokens(0, 0, 0)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    cfg["optimizer"]["params"]["ns_method"] = "standard"
    _, opt, _, _ = zk.initialize(model=M._model(), config=cfg)
    assert {g["ns_method"] for g in opt.param_groups if g["use_muon"]} == {"standard"}
    cfg["optimizer"]["params"]["ns_method"] = "svd"
    with pytest.raises(ValueError, match=r"optimizer\.params\.ns_method"):
        parse_config(cfg, world_size=1)
    with pytest.raises(ValueError, match="ns_method"):
        zk.ZeroMuon(M._model(), ns_method="svd", stage=0, precision="fp32")


def _train(which: str, rank: int, stage: int, lr_factor: float = 1.0,
           ns_method=None):
    """(losses, params after the last step) of DeepSpeed's Muon config (ns_method left out,
    or given) through `which`; DeepSpeed runs its Gram iteration in fp32."""
    import contextlib

    C.launcher_env(rank)
    cfg = M._config(stage, lr_factor)
    params = {k: v for k, v in cfg["optimizer"]["params"].items() if k != "ns_method"}
    if ns_method is not None:
        params["ns_method"] = ns_method
    cfg["optimizer"]["params"] = params
    if which == "deepspeed":
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        saved = acc.is_fp16_supported
        acc.is_fp16_supported = lambda: False  # ns_compute_dtype("gram") -> fp32
        ctx, init = C.restore_linear(), deepspeed.initialize
    else:
        ctx, init = contextlib.nullcontext(), zk.initialize
    try:
        with ctx:
            model = M._model()
            engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=cfg)
            losses = []
            for s in range(M.STEPS):
                total = 0.0
                for m in range(M.GAS):
                    x = C.tokens(s, m, rank)
                    loss = engine(input_ids=x, labels=x).loss
                    engine.backward(loss)
                    engine.step()
                    total += float(loss.detach())
                losses.append(total / M.GAS)
            last = M._full_params(which, engine, stage)
            if which == "deepspeed":
                engine.destroy()
    finally:
        if which == "deepspeed":
            acc.is_fp16_supported = saved
    return losses, last


def _summary(got, ref):
    return {"muon": M.delta_rel(got[1], ref[1], True),
            "adamw": M.delta_rel(got[1], ref[1], False), "loss": C.rel(got[0], ref[0])}


def _worker(rank, ws):
    cases = {}
    for stage in (0, 1, 2, 3):
        def one(stage=stage):
            return _summary(_train("zerokern", rank, stage), _train("deepspeed", rank, stage))
        cases[f"s{stage}"] = one

    def controls():
        ds = _train("deepspeed", rank, 1)
        return {"lr": _summary(_train("zerokern", rank, 1, lr_factor=M.WRONG), ds),
                "standard": _summary(_train("zerokern", rank, 1, ns_method="standard"), ds)}
    cases["controls"] = controls
    return run_cases(cases)


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gram_config_matches_deepspeed(stage, ws):
    for r in case(cached(_worker, ws), f"s{stage}"):
        assert r["muon"] <= TOL and r["adamw"] <= TOL, r


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
def test_gram_controls_are_caught(ws):
    """Muon lr x 1.01 and the other method (standard, bf16) are far outside TOL."""
    for r in case(cached(_worker, ws), "controls"):
        assert r["lr"]["muon"] > 10 * TOL, r
        assert r["standard"]["muon"] > 10 * TOL, r
