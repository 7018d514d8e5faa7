"""DeepSpeed's ZeRO++ keys `zero_optimization.zero_quantized_weights` / `zero_quantized_gradients`
map to ZeroAdamW(quantized_weights=True) / ZeroAdamW(quantized_gradients="int4") (int4: as
DeepSpeed 0.19's qgZ) in zerokern.initialize; bad values and stages raise naming the key.

The 2-rank case compares the engine built from the keys against the same engine with the
ZeroAdamW built by hand with those keywords (bitwise: the keys do exactly that) and against the
plain engine (different, and close: the quantization is on)."""

from __future__ import annotations

import pytest
import torch

import zerokern as zk
from tests.support.harness import cached, case, run_cases  # noqa: E402
from zerokern.engine import parse_config

from . import common as C


@pytest.mark.parametrize("zero,expect", [
    ({"stage": 3, "zero_quantized_weights": True}, (True, False)),
    ({"stage": 2, "zero_quantized_gradients": True}, (False, "int4")),
    ({"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True},
     (True, "int4")),
    ({"stage": 1, "zero_quantized_gradients": False}, (False, False)),
])
def test_keys_parse(zero, expect):
    cfg = parse_config(C.base_config(**zero), 1)
    assert (cfg.quantized_weights, cfg.quantized_gradients) == expect


@pytest.mark.parametrize("zero,key", [
    ({"stage": 2, "zero_quantized_weights": True}, "zero_quantized_weights"),
    ({"stage": 3, "zero_quantized_weights": "yes"}, "zero_quantized_weights"),
    ({"stage": 0, "zero_quantized_gradients": True}, "zero_quantized_gradients"),
    ({"stage": 2, "zero_quantized_gradients": 4}, "zero_quantized_gradients"),
])
def test_bad_keys_raise_naming_the_key(zero, key):
    with pytest.raises(ValueError, match=key):
        parse_config(C.base_config(**zero), 1)


def test_initialize_builds_the_quantized_optimizer():
    engine, opt, _, _ = zk.initialize(model=C.gpt2(), config=C.base_config(
        3, zero_quantized_weights=True, zero_quantized_gradients=True))
    assert opt.comm.qwz and opt.comm.qgz_bits == 4


def _losses(rank, which):
    C.launcher_env(rank)
    zero = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
    cfg = C.base_config(3, gas=1, **(zero if which == "keys" else {}))
    model = C.gpt2()
    opt = None
    if which == "by_hand":
        opt = zk.ZeroAdamW(model, stage=3, precision="fp32", lr=3e-3, betas=(0.8, 0.9),
                           eps=1e-6, weight_decay=0.1, free_grads=True,
                           quantized_weights=True, quantized_gradients="int4")
        cfg.pop("optimizer")
    engine, _, _, _ = zk.initialize(model=model, config=cfg, optimizer=opt)
    out = []
    for s in range(3):
        x = C.tokens(s, 0, rank)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        out.append(float(loss))
    return out


def _worker(rank, ws):
    return run_cases({w: (lambda w=w: _losses(rank, w)) for w in ("keys", "by_hand", "plain")})


def test_keys_train_as_the_keywords_do():
    res = cached(_worker, 2)
    for r, (keys, hand, plain) in enumerate(zip(case(res, "keys"), case(res, "by_hand"),
                                                case(res, "plain"))):
        assert keys == hand, (r, keys, hand)
        assert keys != plain and C.rel(keys, plain) < 0.02, (r, keys, plain)
        assert torch.isfinite(torch.tensor(keys)).all()
