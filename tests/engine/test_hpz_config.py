"""zero_optimization.zero_hpz_partition_size in zerokern.initialize: DeepSpeed's hpZ groups of h
consecutive ranks, mapped to ZeroAdamW(mesh=(world/h, h), hpz=True) at stage 3.

4 gloo ranks, h = 2, the tiny GPT-2 of tests/engine/common.py, fp32:
- the per-step losses equal plain stage 3's bit for bit (hpZ changes where the backward
  gathers from, not the math), the optimizer has an hpz group of 2 consecutive ranks;
- DeepSpeed 0.19.8 itself with the same config (its hpZ on CPU) gives the same losses
  within the engine parity tolerance; negative control: lr x 1.01 is caught.
Parsing (no ranks): ignored with a warning below stage 3 (as DeepSpeed), no effect when
h >= world size, ValueError naming the key when h does not divide it or with offload_param.
"""

from __future__ import annotations

import copy

import pytest

from tests.engine.common import base_config, rel, train
from tests.support.harness import cached, case, run_cases
from zerokern.engine.config import parse_config

WS, H, STEPS = 4, 2, 4
# zerokern vs DeepSpeed stage 3 (fp32): the engine parity bound (test_deepspeed_parity.py)
DS_TOL = 1e-5


def _cfg(hpz: int = H, lr: float = 3e-3) -> dict:
    cfg = base_config(3, gas=1)
    cfg["optimizer"]["params"]["lr"] = lr
    if hpz:
        cfg["zero_optimization"]["zero_hpz_partition_size"] = hpz
    return cfg


def _groups(rank):
    import torch.distributed as dist

    import zerokern
    from tests.engine.common import gpt2

    _, opt, _, _ = zerokern.initialize(model=gpt2(), config=_cfg())
    hpz = opt.comm.hpz
    return {"dims": opt.comm.dims,
            "hpz_ranks": dist.get_process_group_ranks(hpz.group) if hpz else None}


def _worker(rank, ws):
    from tests.engine.common import launcher_env

    launcher_env(rank)
    return run_cases({
        "hpz": lambda: train("zerokern", rank, _cfg(), steps=STEPS),
        "plain": lambda: train("zerokern", rank, _cfg(0), steps=STEPS),
        "neg": lambda: train("zerokern", rank, _cfg(0, lr=3e-3 * 1.01), steps=STEPS),
        "groups": lambda: _groups(rank),
        "deepspeed": lambda: train("deepspeed", rank, _cfg(), steps=STEPS),
    })


def _res():
    return cached(_worker, WS)


@pytest.mark.slow  # the 4-rank group (17 s on 2 loaded cores)
def test_hpz_config_is_bitwise_plain_stage3():
    hpz, plain = case(_res(), "hpz"), case(_res(), "plain")
    assert hpz == plain
    neg = case(_res(), "neg")
    assert all(rel(n, p) > 1e-5 for n, p in zip(neg, plain))


@pytest.mark.slow  # the 4-rank group (17 s on 2 loaded cores)
def test_hpz_groups_are_deepspeeds_consecutive_ranks():
    for rank, g in enumerate(case(_res(), "groups")):
        assert g["dims"]["hpz"] == H and g["dims"]["shard"] == WS
        assert g["hpz_ranks"] == [rank // H * H + i for i in range(H)]


@pytest.mark.slow  # the 4-rank group (17 s on 2 loaded cores)
def test_hpz_config_matches_deepspeed():
    zk, ds = case(_res(), "hpz"), case(_res(), "deepspeed")
    for a, b in zip(zk, ds):
        assert rel(a, b) <= DS_TOL, (a, b)
    neg = case(_res(), "neg")
    assert any(rel(n, b) > DS_TOL for n, b in zip(neg, ds))


def test_hpz_parse_rules():
    cfg = parse_config(_cfg(), 4)
    assert cfg.hpz_partition_size == 2
    low = copy.deepcopy(_cfg())
    low["zero_optimization"]["stage"] = 2
    c = parse_config(low, 4)
    assert c.hpz_partition_size == 1 and any("zero_hpz_partition_size" in k for k, _ in c.ignored)
    c = parse_config(_cfg(hpz=4), 4)
    assert c.hpz_partition_size == 1 and any("zero_hpz_partition_size" in k
                                             for k, _ in c.no_effect)
    assert parse_config(_cfg(hpz=1), 4).hpz_partition_size == 1
    with pytest.raises(ValueError, match="zero_hpz_partition_size=3 must divide"):
        parse_config(_cfg(hpz=3), 4)
    with pytest.raises(ValueError, match="zero_hpz_partition_size"):
        parse_config(_cfg(hpz=-1), 4)
    off = _cfg()
    off["zero_optimization"]["offload_param"] = {"device": "cpu"}
    with pytest.raises(ValueError, match="zero_hpz_partition_size=2 does not support"):
        parse_config(off, 4)
