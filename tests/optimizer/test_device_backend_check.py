"""The params' device against the process group's backend, at construction
(comm/device_check.py [Note: the params' device and the backend]).

CPU params with an NCCL group, and CUDA params with a gloo-only group, raise a ValueError naming
the argument and the fix, before anything changes: ZeroAdamW, ZeroLion, ZeroMuon and
zerokern.initialize. No GPU and no NCCL here: on a 1-rank gloo group (spawned)
`torch.distributed.get_backend` is made to answer "nccl" for the group the optimizer is given
(zerokern.initialize asks for the default backend without a group, to move the model itself
under NCCL; that answer stays "gloo", as for a model the engine did not move). The CUDA side is
checked through the function with a CUDA device object. On the old code every construction
here succeeded (no check): failed.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import zerokern as zk

from ..support import models as M
from ..support.harness import cached, case, run_cases


def test_what_each_backend_carries():
    from zerokern.comm import device_check as D

    assert D.carried("nccl") == {"cuda"}
    assert D.carried("gloo") == {"cpu"}
    assert D.carried("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}
    assert D.carried("cuda:gloo") == set()  # CUDA tensors through gloo: not zerokern's paths
    assert D.carried("mpi") is None and D.carried("fake") is None  # not known: not checked


def test_cuda_params_on_a_gloo_group_raise(monkeypatch):
    from zerokern.comm import device_check as D

    group = object()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "gloo")
    with pytest.raises(ValueError, match=r"ZeroLion: params_or_model's params are on cuda:0, "
                                         r"but process_group is a gloo group.*CPU tensors only"
                                         r".*NCCL group.*before constructing ZeroLion"):
        D.check_params_backend(torch.device("cuda", 0), group, None, "ZeroLion")
    D.check_params_backend(torch.device("cpu"), group, None, "ZeroLion")  # control: fine
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "cpu:gloo,cuda:nccl")
    D.check_params_backend(torch.device("cuda", 0), group, None, "ZeroLion")  # both carried


def test_no_process_group_no_check():
    from zerokern.comm import device_check as D

    assert not dist.is_initialized()
    D.check_params_backend(torch.device("cuda", 0), None, None)  # world size 1: nothing to say


# ---- on a 1-rank gloo group ------------------------------------------------------------------
BUILDERS = {
    "ZeroAdamW": lambda model, **kw: zk.ZeroAdamW(model, stage=2, precision="bf16", **kw),
    "ZeroLion": lambda model, **kw: zk.ZeroLion(model, stage=3, precision="bf16", **kw),
    "ZeroMuon": lambda model, **kw: zk.ZeroMuon(model, stage=1, precision="bf16", **kw),
}


def _fake_nccl(answer):
    """get_backend answering `answer` for an explicit group, the real one otherwise."""
    real = dist.get_backend

    def get_backend(group=None):
        return answer if group is not None else real(group)
    return real, get_backend


def _untouched(model, before) -> bool:
    return (M.bitwise_equal(M.snapshot(model), before)
            and all(p.dtype == torch.float32 and not hasattr(p, "_zerokern_sync")
                    for p in model.parameters()))


def _raises(build, answer="nccl"):
    model = M.make_model()
    before = M.snapshot(model)
    real, fake = _fake_nccl(answer)
    dist.get_backend = fake
    try:
        build(model)
    except ValueError as e:
        return {"error": str(e), "untouched": _untouched(model, before)}
    finally:
        dist.get_backend = real
    return {"error": None, "untouched": _untouched(model, before)}


def _initialize(model):
    return zk.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2}})


def _worker(rank, ws):
    cases = {f"nccl_{name}": functools.partial(_raises, b) for name, b in BUILDERS.items()}
    cases["nccl_explicit_group"] = functools.partial(
        _raises, lambda m: zk.ZeroAdamW(m, process_group=dist.group.WORLD))
    cases["nccl_initialize"] = functools.partial(_raises, _initialize)
    cases["mixed_backend"] = functools.partial(_raises, BUILDERS["ZeroAdamW"],
                                               "cpu:gloo,cuda:nccl")
    cases["gloo"] = functools.partial(_raises, BUILDERS["ZeroMuon"], "gloo")
    return run_cases(cases)


def _results():
    return cached(_worker, 1)


@pytest.mark.parametrize("name", list(BUILDERS) + ["initialize"])
def test_cpu_params_on_an_nccl_group_raise_before_any_change(name):
    who = "ZeroAdamW" if name == "initialize" else name
    (res,) = case(_results(), f"nccl_{name}")
    assert res["error"] is not None, f"{name}: CPU params on an NCCL group were accepted"
    for part in (f"{who}: params_or_model's params are on cpu",
                 "the default process group (process_group=None) is an NCCL group",
                 f"move the model to cuda before constructing {who}", "LOCAL_RANK"):
        assert part.lower() in res["error"].lower(), res["error"]
    assert res["untouched"], "the model changed before the error"


def test_the_error_names_a_given_process_group():
    (res,) = case(_results(), "nccl_explicit_group")
    assert "but process_group is an NCCL group (backend 'nccl')" in res["error"]
    assert res["untouched"]


@pytest.mark.parametrize("name", ["mixed_backend", "gloo"])
def test_groups_that_carry_cpu_tensors_are_accepted(name):
    (res,) = case(_results(), name)
    assert res["error"] is None, res["error"]
