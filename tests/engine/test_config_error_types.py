"""Config errors are a ValueError and an AssertionError (zerokern.engine.ConfigError), as
NoOptimizerError is: DeepSpeed raises AssertionError for these configs and code and tests
written for it catch that (issue 36, item 7). Five bad configs DeepSpeed 0.19.8 rejects with an
AssertionError (its messages checked on one gloo rank, the CPU accelerator): on the old code
zerokern raised a plain ValueError, which `except AssertionError` does not catch.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import zerokern as zk  # noqa: E402
from zerokern.engine import ConfigError  # noqa: E402

from . import common as C  # noqa: E402

ADAMW = {"type": "AdamW", "params": {"lr": 1e-3}}
# name -> (config, a piece of DeepSpeed's AssertionError message)
BAD = {
    "batch_mismatch": ({"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2,
                        "gradient_accumulation_steps": 1}, "train_batch_size is not equal"),
    "no_batch_size": ({"gradient_accumulation_steps": 1}, "Either train_batch_size or"),
    "fp16_and_bf16": ({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True},
                       "bf16": {"enabled": True}}, "cannot be simultaneously enabled"),
    "accumulation_0": ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 0},
                       "has to be greater than 0"),
    "optimizer_type": ({"train_micro_batch_size_per_gpu": 2,
                        "optimizer": {"type": "Foo", "params": {}}},
                       "is not a supported DeepSpeed Optimizer"),
}


def _config(name):
    cfg = dict(BAD[name][0])
    cfg.setdefault("optimizer", ADAMW)
    return cfg


@pytest.mark.parametrize("name", sorted(BAD))
def test_zerokern_config_error_is_value_and_assertion_error(name):
    model = C.gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(AssertionError) as info:
        zk.initialize(model=model, config=_config(name))
    assert isinstance(info.value, ValueError) and isinstance(info.value, ConfigError)
    assert "config" in str(info.value)
    assert all((v == before[k]).all() for k, v in model.state_dict().items())


def _ds_worker(rank, ws):
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True  # reach the fp16+bf16 check
    C.launcher_env(rank)
    out = {}
    for name in BAD:
        model = C.gpt2()
        try:
            with C.restore_linear():
                deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                     config=_config(name))
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = (type(e).__name__, str(e))
    return out


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
def test_deepspeed_raises_assertion_error_for_them():
    pytest.importorskip("deepspeed")
    from tests.support.harness import cached

    got = cached(_ds_worker, 1)[0]
    for name, (_, piece) in BAD.items():
        assert got[name] is not None and got[name][0] == "AssertionError", (name, got[name])
        assert piece in got[name][1], (name, got[name])


def test_config_error_is_raised_by_parse_config_too():
    from zerokern.engine import parse_config

    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        parse_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 4}},
                     world_size=1)
