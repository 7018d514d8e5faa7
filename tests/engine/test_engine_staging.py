"""zerokern.initialize keeps the staging pool of stages 2-3 between steps (engine/build.py
[Note: the engine keeps its staging]) while the grad shards are still freed at each step: the
staging buffers are allocated once, not at every step, and stage 2's default bucket (no
reduce_bucket_size) is 6 MiB, so the pool holds 12 MiB at most. One process, world size 1."""

from __future__ import annotations

import os

import pytest
import torch

from . import common as C


def _run(stage: int, keep: bool, steps: int = 4):
    import zerokern

    C.launcher_env(0)
    model = C.gpt2()
    cfg = C.base_config(stage, gas=1)
    engine, opt, _, _ = zerokern.initialize(model=model, model_parameters=model.parameters(),
                                            config=cfg)
    gs = opt.grad_sync
    if not keep:
        gs.keep_staging = False  # the negative control: freed at every step, as before
    allocated, losses = [], []
    for s in range(steps):
        x = C.tokens(s, 0, 0)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        allocated.append(gs.staging_allocated)
        losses.append(float(loss.detach()))
    return allocated, losses, gs, engine


@pytest.mark.parametrize("stage", [2, 3])
def test_staging_allocated_once(stage, one_thread):
    allocated, losses, gs, _ = _run(stage, keep=True)
    assert allocated[-1] == allocated[0] > 0, allocated  # none after the first step
    assert gs._grad_shards is None  # the grad shards are still freed at each step
    before, losses_before, _, _ = _run(stage, keep=False)
    assert before[-1] > before[0], before  # the control: allocated again at every step
    assert losses == losses_before  # where the buffers come from changes no number


def test_stage2_default_bucket_holds_12_mib(one_thread):
    _, _, gs, engine = _run(2, keep=True, steps=2)
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
