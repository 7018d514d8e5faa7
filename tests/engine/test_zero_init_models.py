"""Models built under `deepspeed.zero.Init` (DeepSpeed's TestNoOptim[3], TestZeroFrozenWeights[3],
TestZeroPartitionCache, TestParamPartitioningSkipInit build them so) are refused by
zerokern.initialize and by the zerokern optimizers with a ValueError naming zero.Init and what
to do instead, before anything changes (issue 36, item 7; zerokern.options.args [Note:
DeepSpeed-partitioned params]). On the old code initialize accepted them and the first forward
crashed inside F.linear ("mat2 must be a matrix, got 1-D tensor"); ZeroAdamW built over them.
2 gloo ranks (zero.Init partitions over the world), DeepSpeed 0.19.8 on the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")

from tests.support.harness import cached, case, run_cases  # noqa: E402

from . import common as C  # noqa: E402


def _zero_init_model(rank):
    import deepspeed

    C.launcher_env(rank)
    with C.restore_linear():
        with deepspeed.zero.Init(config_dict_or_path=C.base_config(3)):
            model = C.gpt2()
    return model


def _attempt(fn):
    """(exception type, message) of fn(), or ('no error', forward's outcome)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return "no error", ""


def _worker(rank, ws):
    import zerokern as zk

    def one(kind, stage=3):
        def run():
            model = _zero_init_model(rank)
            shards = {n: p.ds_tensor.detach().clone() for n, p in model.named_parameters()}
            shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}

            def go():
                if kind == "initialize":
                    engine, _, _, _ = zk.initialize(model=model, config=C.base_config(stage))
                    x = C.tokens(0, 0, rank)
                    engine.backward(engine(input_ids=x, labels=x).loss)  # the old crash
                    engine.step()
                elif kind == "initialize-params":
                    zk.initialize(model=C.gpt2(), model_parameters=list(model.parameters()),
                                  config=C.base_config(stage))
                elif kind == "zero_adamw":
                    zk.ZeroAdamW(model, stage=stage, precision="fp32")
                else:  # bare params
                    zk.ZeroAdamW(list(model.parameters()), stage=stage, precision="fp32")
            err = _attempt(go)
            same = all(torch.equal(p.ds_tensor, shards[n]) and tuple(p.shape) == shapes[n]
                       for n, p in model.named_parameters())
            return {"error": err, "unchanged": same}
        return run

    cases = {"initialize-s3": one("initialize"), "initialize-s0": one("initialize", 0),
             "initialize-params": one("initialize-params"), "zero_adamw-s3": one("zero_adamw"),
             "zero_adamw-s1": one("zero_adamw", 1), "bare-s1": one("bare", 1)}
    return run_cases(cases)


@pytest.mark.parametrize("which", ["initialize-s3", "initialize-s0", "initialize-params",
                                   "zero_adamw-s3", "zero_adamw-s1", "bare-s1"])
def test_zero_init_model_is_refused_before_any_change(which):
    for r in case(cached(_worker, 2), which):
        kind, msg = r["error"]
        assert kind == "ValueError", r
        assert "deepspeed.zero.Init" in msg and "meta device" in msg, r
        assert "nothing was changed" in msg, r
        assert r["unchanged"], r
