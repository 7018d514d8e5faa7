"""zerokern.initialize keeps the staging pool of stages 2-3 between steps (engine/build.py
[Note: the engine keeps its staging]): the staging buffers are allocated once, not at every
step, and stage 2's default bucket (no reduce_bucket_size) is 6 MiB, so the pool holds 12 MiB
at most. The grad shards are kept at stage 3 and at stage 2 with fp32 params (the flat params
are the master), freed at each step elsewhere ([Note: the engine keeps its grad shard]).
One process, world size 1."""

from __future__ import annotations

import os

import pytest
import torch

from . import common as C


def _run(stage: int, keep: bool, steps: int = 4, precision: str = "fp32",
         free_shards: bool = False, gas: int = 1):
    import zerokern

    C.launcher_env(0)
    model = C.gpt2()
    cfg = C.base_config(stage, precision, gas=gas)
    engine, opt, _, _ = zerokern.initialize(model=model, model_parameters=model.parameters(),
                                            config=cfg)
    gs = opt.grad_sync
    if not keep:
        gs.keep_staging = False  # the negative control: freed at every step, as before
    if free_shards:
        gs.free_on_zero = True  # the control: grad shards freed at every step, as before
    allocated, losses, shards = [], [], []
    for s in range(steps * gas):
        x = C.tokens(s, 0, 0)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        if (s + 1) % gas:  # mid-accumulation: no optimizer step taken
            continue
        allocated.append(gs.staging_allocated)
        losses.append(float(loss.detach()))
        shards.append(None if gs._grad_shards is None
                      else tuple(t.data_ptr() for t in gs._grad_shards))
    with opt.gathered_params():  # (stage 3: the params are empty outside it)
        params = [p.detach().float().clone() for p in model.parameters()]
    assert all(p.numel() > 0 for p in params)
    return allocated, losses, gs, engine, shards, params


@pytest.mark.parametrize("stage", [2, 3])
def test_staging_allocated_once(stage, one_thread):
    allocated, losses, gs, *_ = _run(stage, keep=True)
    assert allocated[-1] == allocated[0] > 0, allocated  # none after the first step
    before, losses_before, *_ = _run(stage, keep=False, free_shards=True)
    assert before[-1] > before[0], before  # the control: allocated again at every step
    assert losses == losses_before  # where the buffers come from changes no number


@pytest.mark.parametrize("stage,precision,kept", [(2, "fp32", True), (2, "bf16", False),
                                                  (3, "fp32", True), (3, "bf16", True)])
def test_grad_shard_kept_where_deepspeed_holds_as_much(stage, precision, kept, one_thread):
    """[Note: the engine keeps its grad shard]: the same shard tensors after every step where
    kept (stage 3; stage 2 at fp32), none between steps elsewhere (stage 2 bf16: its compact
    master). Against the control that frees the shards at every step (the engine before):
    the same losses and params, bit for bit, with gradient accumulation (gas 2: the first
    micro-batch's no_sync accumulation lands on the kept shard's second reduction)."""
    _, losses, _, _, shards, params = _run(stage, keep=True, precision=precision, gas=2,
                                           steps=3)
    if kept:
        assert shards[0] is not None and all(s == shards[0] for s in shards), shards
    else:
        assert all(s is None for s in shards), shards
    _, losses_freed, _, _, shards_freed, params_freed = _run(
        stage, keep=True, precision=precision, gas=2, steps=3, free_shards=True)
    assert all(s is None for s in shards_freed)  # the control frees them
    assert losses == losses_freed
    assert all(torch.equal(a, b) for a, b in zip(params, params_freed))


def test_stage2_default_bucket_holds_12_mib(one_thread):
    _, _, gs, engine, *_ = _run(2, keep=True, steps=2)
    assert engine.config.bucket_mb == 6.0
    held = sum(b.numel() * b.element_size() for b in gs._pool)
    assert 0 < held <= 12 * 2**20, held


@pytest.fixture(autouse=True)
def _restore_environ():
    """launcher_env sets RANK/LOCAL_RANK/WORLD_SIZE in this (the pytest) process: put them
    back, or a later in-process test (accelerate's PartialState) takes the process for a
    launched rank and asks for MASTER_ADDR."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
