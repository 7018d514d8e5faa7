"""`zerokern train --mesh PPxTPxDP` (issue 38): the demo GPT split into pipeline stages
(zerokern/train/pipeline.py [Note: the pipelined demo job]).

Reference, in this process: the same stages (tools/gpt_stages.py, seeded as the job seeds
them) composed into one model, fp32, the same windows (dp rank d draws its M x batch windows
with data.Batches seeded by d), the loss of the global batch (the mean over dp of the mean over
the micro-batches), `clip_grad_norm_(1.0)` over every stage's params, torch.optim.AdamW with
the job's hyperparameters and LambdaLR schedule. The job's loss curve (metrics.json) must be
the reference's within TOL at every step; negative control: the reference with lr x 1.01
misses by more than 10 x TOL.
- slow: --mesh 2x1x1 (2 ranks: two stages, no dp), stage 2, 1F1B, 2 micro-batches; 2x1x2
  (4 ranks) at stage 1 with GPipe, 2x2x1 (4 ranks, the MLPs over tp) at stage 2 (the
  pipelines' own parity runs in the default suite: tests/pipeline/);
- fast: the flags' cross-checks raise a ValueError naming the flag before anything starts.
On the old code `--mesh 2x1x1` was an argparse error (RxS only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
STEPS, SEQ, BATCH, SEED, LR = 4, 32, 2, 0, 1e-2
TOL = 2e-5  # rel per step: fp32, the stages' reductions in another order than one process


def _env():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    return env


def _train(out: Path, mesh: str, stage: int, *extra) -> dict:
    cmd = [sys.executable, "-m", "zerokern", "train", "--model-size", "tiny", "--seq",
           str(SEQ), "--batch", str(BATCH), "--steps", str(STEPS), "--device", "cpu",
           "--precision", "fp32", "--stage", str(stage), "--lr", str(LR), "--mesh", mesh,
           "--out", str(out), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return json.loads((out / "metrics.json").read_text())


def reference(pp: int, dp: int, micro: int, lr: float = LR):
    """The loss curve of one process training the stages composed ([module docstring])."""
    from zerokern.tools.gpt_stages import GPTStage
    from zerokern.train.config import TrainConfig
    from zerokern.train.data import Batches, load_corpus
    from zerokern.train.loop import HYPER, MAX_GRAD_NORM, lr_lambda
    from zerokern.train.pipeline import stage_config

    cfg = TrainConfig(model_size="tiny", seq=SEQ, batch=BATCH, steps=STEPS, seed=SEED)
    stages = []
    for s in range(pp):
        torch.manual_seed(SEED * 1_000 + s)
        stages.append(GPTStage(stage_config(cfg), s, pp))
    params = [p for m in stages for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, **HYPER)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(STEPS))
    corpus = load_corpus()
    data = [Batches(corpus, BATCH * micro, SEQ, SEED, d) for d in range(dp)]
    curve = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for d in range(dp):
            x, y = data[d].get(step)
            for xs, ys in zip(x.tensor_split(micro), y.tensor_split(micro)):
                h = xs
                for m in stages:
                    h = m(h)
                loss = F.cross_entropy(h.float().reshape(-1, h.shape[-1]), ys.reshape(-1))
                (loss / (micro * dp)).backward()
                total += float(loss.detach()) / (micro * dp)
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        opt.step()
        sched.step()
        curve.append(total)
    return curve


def _check(curve, pp, dp, micro):
    want = reference(pp, dp, micro)
    neg = reference(pp, dp, micro, lr=LR * 1.01)
    rel = max(abs(a - b) / abs(b) for a, b in zip(curve, want))
    miss = max(abs(a - b) / abs(b) for a, b in zip(curve, neg))
    assert len(curve) == STEPS
    assert rel <= TOL, f"loss curve rel {rel:.3g} > {TOL}: {curve} vs {want}"
    assert miss > 10 * TOL, f"negative control (lr x 1.01) not caught: {miss:.3g}"


@pytest.mark.slow  # (a 2-rank `zerokern train`: ~20 s quiet, 60 s under load)
def test_two_stages_match_one_process(tmp_path):
    m = _train(tmp_path / "run", "2x1x1", 2)
    assert m["pipeline"]["micro_batches"] == 2 and m["pipeline"]["schedule"] == "1f1b"
    assert m["memory"]["estimate_matches_rank0"], "estimate of stage 0 != rank 0's report"
    assert len(m["memory"]["estimate_per_stage"]) == 2
    _check(m["loss_curve"], 2, 1, 2)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,stage,extra", [("2x1x2", 1, ("--schedule", "gpipe")),
                                              ("2x2x1", 2, ()), ("2x1x2", 3, ()),
                                              ("2x2x1", 3, ()), ("2x2x2", 3, ())])
def test_pipeline_meshes_match_one_process(tmp_path, mesh, stage, extra):
    pp, tp, dp = (int(v) for v in mesh.split("x"))
    m = _train(tmp_path / "run", mesh, stage, *extra)
    _check(m["loss_curve"], pp, dp, 2)


@pytest.mark.parametrize("args,flag", [
    (["--mesh", "2x1x2", "--nproc", "3"], "--mesh"),
    (["--mesh", "2x2", "--schedule", "gpipe"], "--schedule"),
    (["--mesh", "2x1x1", "--hpz", "--stage", "3"], "--hpz"),
    (["--mesh", "2x1x1", "--global-batch", "8"], "--global-batch"),
])
def test_bad_flags_are_refused_naming_the_flag(args, flag):
    """The cross-checks `zerokern train` runs before it starts any rank (in process: the CLI
    prints the ValueError and exits 2, tests/test_train_mesh.py runs that path)."""
    import argparse

    from zerokern.train.config import add_arguments, from_args
    from zerokern.train.launch import plan
    from zerokern.train.pipeline import check_pipeline

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_args(p.parse_args(["--device", "cpu", "--model-size", "tiny", *args]))
    with pytest.raises(ValueError, match=flag):
        dev, n = plan(cfg)
        check_pipeline(cfg, n)  # (what each rank checks first)


def test_a_zero_dim_is_an_argparse_error():
    import argparse

    from zerokern.tools.argtypes import mesh_shape

    with pytest.raises(argparse.ArgumentTypeError, match="every dim"):
        mesh_shape("2x0x1")
    assert mesh_shape("2x1x2") == (2, 1, 2) and mesh_shape("2x2") == (2, 2)
