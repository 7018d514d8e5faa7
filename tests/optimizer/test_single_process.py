"""World size 1 without init_process_group, and bad input (DESIGN §1 "Errors on bad input").

Bad input must raise ValueError or TypeError naming the argument, BEFORE anything changes: the
model's params keep their dtype, values and storage, get no grad and no hook. Every case asks
for precision="bf16" where it can, so a late failure would already have cast the model.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zerokern as zk

from ..support import models as M
from ..support.harness import one_thread  # noqa: F401 - the fixture, used below

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 5

# Tolerances, as in test_parity.py.
TOL = {
    "param": 1e-6,  # max|a-b|/max|b| per param vs torch AdamW, 5 steps; measured ~1.4e-7
}


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_works_without_init_process_group(stage, backend):
    assert not dist.is_initialized()
    model = M.make_model()
    opt = M.zero_opt(model, stage, backend=backend)
    assert opt.comm.shard.world_size == 1 and opt.comm.shard.rank == 0
    assert opt.flat_groups[0].layout.n_buckets > 1
    rec = M.train_zero(model, opt, 0, 1, STEPS)
    ref = M.train_torch(M.make_model(), 0, 1, STEPS)
    err = M.rel_err(rec["params"][-1], ref["params"][-1])
    assert err <= TOL["param"], f"params vs torch AdamW: {err:.3g}"
    assert M.rel_err(rec["params"][-1], M.snapshot(M.make_model())) > 100 * TOL["param"]
    stats = opt.comm_stats()
    assert stats["total"] == 0 and sum(stats["calls"].values()) == 0


# ---- bad input -----------------------------------------------------------------------------------
def _fingerprint(model: nn.Module):
    return [
        (
            n,
            p.dtype,
            p.data_ptr(),
            p.detach().clone(),
            p.grad is None,
            len(getattr(p, "_post_accumulate_grad_hooks", None) or {}),
        )
        for n, p in model.named_parameters(remove_duplicate=False)
    ]


def _unchanged(before, after) -> None:
    assert len(before) == len(after)
    for (n, dt, ptr, val, nograd, hooks), (_, dt2, ptr2, val2, nograd2, hooks2) in zip(
        before, after
    ):
        assert dt2 == dt, f"{n}: dtype {dt} -> {dt2}"
        assert ptr2 == ptr, f"{n}: .data storage replaced"
        assert torch.equal(val2, val), f"{n}: values changed"
        assert nograd2 and nograd, f"{n}: got a grad"
        assert hooks2 == hooks, f"{n}: a hook was registered"


def _meta_beside_cpu(model):
    return [{"params": list(model.parameters()) + [nn.Parameter(torch.zeros(3, device="meta"))]}]


def _fp16_param(model):
    model.blocks[0].fc1.weight.data = model.blocks[0].fc1.weight.data.half()
    return model.parameters()


def _frozen_only(model):
    for p in model.parameters():
        p.requires_grad_(False)
    return model


BAD = {  # name: (params_or_model builder, kwargs, exception types, words the message must name)
    "stage_4": (None, {"stage": 4}, ValueError, ["stage"]),
    "stage_-1": (None, {"stage": -1}, ValueError, ["stage"]),
    "stage_str": (None, {"stage": "2"}, ValueError, ["stage"]),
    "stage_bool": (None, {"stage": True}, ValueError, ["stage"]),
    "stage3_bare_params": (lambda m: m.parameters(), {"stage": 3}, ValueError, ["stage", "param"]),
    "mixed_devices": (_meta_beside_cpu, {}, ValueError, ["device"]),
    "fp16_param_fp32": (_fp16_param, {"precision": "fp32"}, TypeError, ["precision", "float16"]),
    "empty_list": (lambda m: [], {}, ValueError, ["param"]),
    "empty_group": (lambda m: [{"params": []}], {}, ValueError, ["param"]),
    "all_frozen": (_frozen_only, {}, ValueError, ["param"]),
    "lr_-1": (None, {"lr": -1.0}, ValueError, ["lr"]),
    "lr_nan": (None, {"lr": float("nan")}, ValueError, ["lr"]),
    "group_lr_-1": (
        lambda m: [{"params": list(m.parameters()), "lr": -1.0}],
        {},
        ValueError,
        ["lr", "group"],
    ),
    "betas_1": (None, {"betas": (1.0, 0.9)}, ValueError, ["betas"]),
    "eps_0": (None, {"eps": 0.0}, ValueError, ["eps"]),
    "weight_decay_-1": (None, {"weight_decay": -1.0}, ValueError, ["weight_decay"]),
    "precision_fp8": (None, {"precision": "fp8"}, ValueError, ["precision"]),
    "offload_gpu": (None, {"offload": "gpu"}, ValueError, ["offload"]),
    "bucket_mb_0": (None, {"bucket_mb": 0}, ValueError, ["bucket_mb"]),
    "bucket_mb_-1": (None, {"bucket_mb": -1.0}, ValueError, ["bucket_mb"]),
    "backend_nope": (None, {"backend": "nope"}, ValueError, ["backend"]),
    "max_grad_norm_0": (None, {"max_grad_norm": 0.0}, ValueError, ["max_grad_norm"]),
    "loss_scale_str": (
        None,
        {"precision": "fp16", "loss_scale": "static"},
        ValueError,
        ["loss_scale"],
    ),
    "loss_scale_-1": (None, {"precision": "fp16", "loss_scale": -1.0}, ValueError, ["loss_scale"]),
    "reduce_dtype_int8": (None, {"reduce_dtype": torch.int8}, TypeError, ["reduce_dtype"]),
    "process_group_str": (None, {"process_group": "world"}, TypeError, ["process_group"]),
    "adamw_str": (None, {"adamw": "yes"}, TypeError, ["adamw"]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_raises_before_any_change(name):
    build, kwargs, exc, words = BAD[name]
    model = M.make_model()
    target = model if build is None else build(model)
    before = _fingerprint(model)  # after the builder's own edits (fp16 param, frozen flags)
    kwargs = {"precision": "bf16", "backend": "reference", **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(exc) as info:
            zk.ZeroAdamW(target, **kwargs)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"the message does not name {w!r}: {msg}"
    assert "{" not in msg, f"unformatted placeholder in the message: {msg}"
    _unchanged(before, _fingerprint(model))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_step_before_backward_raises_and_changes_nothing(stage):
    model = M.make_model()
    opt = M.zero_opt(model, stage, "bf16")
    state = opt.state_dict()
    params = M.snapshot(model)
    for _ in range(2):  # fresh optimizer, then again right after zero_grad()
        with pytest.raises(RuntimeError, match="backward"):
            opt.step()
        opt.zero_grad()
    after = opt.state_dict()
    for a, b in zip(after["state"], state["state"]):
        assert M.bitwise_equal(a, b)
    assert M.bitwise_equal(M.snapshot(model), params)
    # and it still trains afterwards
    M.train_zero(model, opt, 0, 1, 1)
    assert not M.bitwise_equal(M.snapshot(model), params)


class _SparseLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(M.VOCAB, M.D_MODEL, sparse=True)
        self.out = nn.Linear(M.D_MODEL, M.VOCAB)

    def forward(self, tokens):
        return self.out(self.emb(tokens))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_sparse_grads_rejected(stage):
    """nn.Embedding(sparse=True): detectable at construction when given the module (its
    `sparse` flag), else at the first backward or step; either way a ValueError/TypeError that
    says "sparse" -- never a silent densify or an unrelated RuntimeError."""
    model = _SparseLM()
    with pytest.raises((ValueError, TypeError), match="sparse"):
        opt = zk.ZeroAdamW(model, stage=stage, precision="fp32", backend="reference")
        opt.backward(M.loss_fn(model, M.rank_tokens(0, 0, 1)))
        opt.step()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_explicit_loss_scale_fp32(stage):
    """fp32 with an explicit loss_scale (DESIGN §1: "bf16/fp32: 1.0 unless given"): opt.backward
    scales the loss by it and step() unscales, so a power-of-two scale changes no bits of the
    grads: the run must still match torch AdamW."""
    model = M.make_model()
    opt = M.zero_opt(model, stage, loss_scale=8.0)
    assert float(opt.loss_scale) == 8.0
    rec = M.train_zero(model, opt, 0, 1, STEPS)
    ref = M.train_torch(M.make_model(), 0, 1, STEPS)
    err = M.rel_err(rec["params"][-1], ref["params"][-1])
    assert err <= TOL["param"], f"params vs torch AdamW: {err:.3g}"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_model_zero_grad_instead_of_opt_zero_grad(stage):
    """A drop-in torch loop that zeroes grads with model.zero_grad() (set_to_none) must train
    like torch: each step averages the grads of its own backward, not of every backward since
    the last opt.zero_grad()."""
    model = M.make_model()
    opt = M.zero_opt(model, stage)
    for s in range(STEPS):
        model.zero_grad()
        M.loss_fn(model, M.rank_tokens(s, 0, 1)).backward()
        opt.step()
    ref = M.train_torch(M.make_model(), 0, 1, STEPS)
    err = M.rel_err(M.snapshot(model), ref["params"][-1])
    assert err <= TOL["param"], f"params vs torch AdamW: {err:.3g}"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_second_optimizer_on_the_same_model(stage):
    """Re-creating the optimizer on a model (a new config, a restart in a notebook) must either
    be refused up front with a clear error, or train correctly; the first optimizer's hooks must
    not break or redirect the second one's gradients."""
    model = M.make_model()
    M.zero_opt(model, stage)
    try:
        opt = M.zero_opt(model, stage)
    except (ValueError, RuntimeError) as e:
        assert "ZeroAdamW" in str(e) or "optimizer" in str(e)
        return
    rec = M.train_zero(model, opt, 0, 1, STEPS)
    ref = M.train_torch(M.make_model(), 0, 1, STEPS)
    err = M.rel_err(rec["params"][-1], ref["params"][-1])
    assert err <= TOL["param"], f"params vs torch AdamW: {err:.3g}"
