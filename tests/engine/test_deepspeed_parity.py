"""zerokern.initialize against deepspeed.initialize (the reference) on the same model, data and
DeepSpeed config: per-step losses over 10 optimizer steps, 2 gloo ranks, with accumulation and
clipping on. DeepSpeed runs on the CPU (DS_ACCELERATOR=cpu) with "torch_adam": true (torch's
AdamW, exact). Skipped only when deepspeed cannot be imported."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")

from tests.support.harness import cached, case, run_cases  # noqa: E402

from . import common as C  # noqa: E402

# One tolerance table (relative, per-step loss, max over 10 steps).
TOL = {
    "fp32": 1e-5,  # the bound; measured 4.9e-8 (stage 2 and 3): only summation order
    # bf16: both keep bf16 params/grads and fp32 masters, but reduce and accumulate in another
    # order and dtype (DeepSpeed sums micro-batch grads into fp32 partitions); one bf16 ulp is
    # 2^-8 = 3.9e-3 of a value, and a loss is a mean over many of them. Measured 5.7e-5-6.2e-5.
    "bf16": 1e-3,
    # fp16 (seed 000, dynamic loss scale): 10 mantissa bits, 2^-11 = 4.9e-4 half-ulp per value;
    # measured 7.5e-6.
    "fp16": 2e-3,
}
SEEDS = Path(__file__).resolve().parents[3] / "shared" / "seeds"


def seed_000():
    """The stage-2 fp16 config of ../shared/seeds/000_*.txt, key for key."""
    return {"train_batch_size": 16, "gradient_accumulation_steps": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 5e-5}},
            "fp16": {"enabled": True},
            "zero_optimization": {"stage": 2, "allgather_partitions": True,
                                  "allgather_bucket_size": 2e8, "reduce_scatter": True,
                                  "reduce_bucket_size": 2e8, "overlap_comm": True}}


def seed_002():
    """The stage-3 config of ../shared/seeds/002_*.txt (optimizer passed by the script)."""
    return {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                  "offload_param": {"device": "cpu"}}}


def _torch_adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)


def _pair(rank, cfg, steps=10, zk_cfg=None, **kw):
    z = C.train("zerokern", rank, zk_cfg or cfg, steps=steps, **kw)
    d = C.train("deepspeed", rank, cfg, steps=steps, **kw)
    return z, d


def _cases(rank, ws):
    cases = {}
    for stage in (1, 2, 3):
        for prec in ("fp32", "bf16"):
            cfg = C.base_config(stage, prec, reduce_bucket_size=3000)
            cases[f"s{stage}-{prec}"] = lambda cfg=cfg: _pair(rank, cfg)

    def seed0():
        cfg = seed_000()
        cfg["optimizer"]["params"]["torch_adam"] = True  # exact Adam in the reference
        cfg["optimizer"]["params"]["lr"] = 5e-3          # 5e-5 moves a tiny model too little
        return _pair(rank, cfg, steps=6)

    def seed2():
        cfg = seed_002()  # offload_optimizer and offload_param on the CPU, unchanged
        with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu"):
            C.train("zerokern", rank, cfg, client_optimizer=_torch_adamw)  # as DeepSpeed
        # A batch size (DeepSpeed needs one too) and the client optimizer allowed with
        # optimizer offload.
        cfg.update(train_micro_batch_size_per_gpu=C.MICRO_BATCH, zero_force_ds_cpu_optimizer=False)
        # The config has no gradient_clipping key, so DeepSpeed 0.19 clips at 1.0
        # (GRADIENT_CLIPPING_DEFAULT) and zerokern follows it (config.py [Note:
        # gradient_clipping default]); the reference is DDP + torch.optim.AdamW +
        # clip_grad_norm_(1.0). (Before that default was followed, DeepSpeed "departed" from
        # unclipped DDP by 2.8e-4 here: that was its clipping.) Param offload itself must
        # change nothing: the same config without offload_param gives the same losses bit
        # for bit.
        z = C.train("zerokern", rank, cfg, steps=6, client_optimizer=_torch_adamw)
        no_param = copy.deepcopy(cfg)
        del no_param["zero_optimization"]["offload_param"]
        z0 = C.train("zerokern", rank, no_param, steps=6, client_optimizer=_torch_adamw)
        ref = C.train_ddp(rank, _torch_adamw, steps=6, clip=1.0)
        unclipped = C.train_ddp(rank, _torch_adamw, steps=6)
        d = C.train("deepspeed", rank, cfg, steps=6, client_optimizer=_torch_adamw)
        return z, z0, ref, unclipped, d

    def negative():
        cfg = C.base_config(2, "fp32")
        wrong = copy.deepcopy(cfg)
        wrong["optimizer"]["params"]["betas"] = [0.7, 0.9]  # a hyperparameter mis-mapped
        return _pair(rank, cfg, steps=10, zk_cfg=wrong)

    cases["seed000-fp16"] = seed0
    cases["seed002-s3-offload"] = seed2
    cases["negative-control"] = negative
    return run_cases(cases)


def _worker(rank, ws):
    return _cases(rank, ws)


def _results():
    return cached(_worker, 2)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_stage_precision_matches_deepspeed(stage, prec):
    for z, d in case(_results(), f"s{stage}-{prec}"):
        assert C.rel(z, d) <= TOL[prec], (z, d)


def test_seed_000_stage2_fp16_matches_deepspeed():
    for z, d in case(_results(), "seed000-fp16"):
        assert C.rel(z, d) <= TOL["fp16"], (z, d)


def test_seed_002_stage3_offload():
    """Seed 002's config (offload_optimizer + offload_param on the CPU, stage 3, no
    gradient_clipping key) trains through zerokern.initialize: bit for bit the losses without
    offload_param, and DDP + the script's AdamW + clip_grad_norm_(1.0) (DeepSpeed 0.19's
    default clip) and DeepSpeed on the same config within fp32's bound; unclipped DDP (what
    zerokern did before it followed that default) is the control."""
    for z, z0, ref, unclipped, d in case(_results(), "seed002-s3-offload"):
        assert z == z0, (z, z0)
        assert C.rel(z, ref) <= TOL["fp32"], (z, ref)
        assert C.rel(d, ref) <= TOL["fp32"], (d, ref)
        assert C.rel(z, d) <= TOL["fp32"], (z, d)
        assert C.rel(unclipped, d) > TOL["fp32"], (unclipped, d)


def test_negative_control():
    """beta1 0.7 instead of 0.8 fails the fp32 check: the comparison can fail. (A 1% lr change
    moved the losses by only 9.6e-6 over 4 steps: loss parity is a coarse check, which is why
    tests/optimizer compares params at 1e-6.)"""
    for z, d in case(_results(), "negative-control"):
        assert C.rel(z, d) > TOL["fp32"], (z, d)


def test_seed_files_hold_these_configs():
    """The configs above are the seeds' (guards against editing one without the other)."""
    if not SEEDS.is_dir():
        pytest.skip(f"{SEEDS} is not in this checkout")
    t0 = next(SEEDS.glob("000_*.txt")).read_text()
    t2 = next(SEEDS.glob("002_*.txt")).read_text()
    for key in ("allgather_bucket_size", "reduce_bucket_size", "overlap_comm", '"stage": 2'):
        assert key in t0
    assert re.search(r'"offload_param": \{"device": "cpu"\}', t2)
