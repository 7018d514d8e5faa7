"""`zerokern train --save-every N --resume auto`: a resumed run is bitwise the uninterrupted one.

2 gloo ranks, the tiny preset: run A trains 2N steps saving every N (`--resume auto` on its
empty save dir starts from step 0); run B trains the same schedule but stops after N
(`--stop-after N`, a job's time slot), and run C resumes B's save dir with `--resume auto` and
trains the rest. C's loss curve (the whole run's: the first N losses come from the checkpoint)
and its final params (the last checkpoint, consolidated: fp32 masters) equal A's bit for bit.
Slow: resuming a run that already finished trains nothing more.
In process (world size 1): the train state round-trips (step, scheduler, CPU RNG, losses) while
the RNG was moved on in between (the tiny GPT has no dropout, so the end-to-end runs do not
show it); a resume into another run's settings is refused naming the flag (negative control).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

import zerokern.checkpoint as ck

from .support.train_cli import N, train


def _train(*args, timeout=240):
    return train(*args, timeout=timeout)


def _metrics(out_dir) -> dict:
    return json.loads((Path(out_dir) / "metrics.json").read_text())


def _final(save_dir) -> dict:
    return ck.consolidate(ck.latest(str(save_dir)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("resume")
    a, b = tmp_path / "a", tmp_path / "b"
    _train("--save-dir", str(a / "ck"), "--out", str(a), "--resume", "auto")
    _train("--save-dir", str(b / "ck"), "--out", str(b / "first"), "--stop-after", str(N))
    assert sorted(os.listdir(b / "ck")) == [f"step{N:08d}"]
    out = _train("--save-dir", str(b / "ck"), "--out", str(b), "--resume", "auto")
    return a, b, out.stdout + out.stderr


@pytest.mark.slow  # [Note: the slow mark]: 3 train runs, 21 s; the in-process round trip stays
def test_resume_auto_is_bitwise_the_uninterrupted_run(runs):
    a, b, said = runs
    assert f"resumed from {b / 'ck' / f'step{N:08d}'}" in said
    la, lb = _metrics(a)["loss_curve"], _metrics(b)["loss_curve"]
    assert len(la) == len(lb) == 2 * N
    assert la == lb  # bitwise: floats read back from JSON exactly
    fa, fb = _final(a / "ck"), _final(b / "ck")
    assert ck.latest(str(b / "ck")).endswith(f"step{2 * N:08d}")
    assert fa.keys() == fb.keys()
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    assert _metrics(b / "first")["loss_curve"] == la[:N]  # the first slot trained N steps


@pytest.mark.slow  # [Note: the slow mark] (pyproject.toml): one more run, 13-20 s
def test_resuming_a_finished_run_trains_nothing_more(runs):
    a, b, _ = runs
    _train("--save-dir", str(b / "ck"), "--out", str(b / "again"), "--resume", "auto")
    assert _metrics(b / "again")["loss_curve"] == _metrics(a)["loss_curve"]
    assert sorted(os.listdir(b / "ck")) == [f"step{N:08d}", f"step{2 * N:08d}"]


def _tiny(cfg):
    import zerokern as zk
    from zerokern.train import loop

    model = loop.build_model(cfg, torch.device("cpu"))
    opt = zk.ZeroAdamW(model, lr=cfg.lr, stage=1, precision="fp32", backend="reference")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, loop.lr_lambda(cfg.steps))
    return model, opt, sched


def test_train_state_round_trips_and_another_run_is_refused(tmp_path):
    from zerokern.train import loop
    from zerokern.train.config import TrainConfig

    cfg = TrainConfig(model_size="tiny", seq=32, batch=2, steps=10, save_every=4,
                      save_dir=str(tmp_path), resume="auto", stage=1, precision="fp32")
    model, opt, sched = _tiny(cfg)
    with warnings.catch_warnings():  # (no opt.step() here: the schedule alone moves on)
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(4):
            sched.step()
    losses = torch.arange(10, dtype=torch.float32)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    loop.save(cfg, model, opt, sched, losses, 4, torch.device("cpu"))
    ck.wait()
    torch.rand(5)  # the RNG moves on after the save
    model2, opt2, sched2 = _tiny(cfg)
    got = torch.zeros(10)
    assert loop.resume(cfg, model2, opt2, sched2, got, torch.device("cpu")) == 4
    assert torch.equal(torch.get_rng_state(), rng)
    assert sched2.last_epoch == sched.last_epoch == 4
    assert torch.equal(got[:4], losses[:4]) and not got[4:].any()
    other = TrainConfig(**{**cfg.to_dict(), "lr": cfg.lr * 2})
    with pytest.raises(ValueError, match="--lr"):
        loop.resume(other, *_tiny(other), torch.zeros(10), torch.device("cpu"))
