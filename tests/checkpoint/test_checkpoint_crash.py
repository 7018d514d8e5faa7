"""zerokern.checkpoint's atomic replace (writer.py [Note: atomic replace]), in this process.

A writer SIGKILLed mid-save (a subprocess paused by the writer's test hook right at the point
under test) must leave the previous checkpoint loadable and bitwise equal to the state it was
saved from; the next save must commit and remove the leftovers. Both commit paths run: the
RENAME_EXCHANGE swap and the two-rename fallback (forced by ZEROKERN_CHECKPOINT_NO_EXCHANGE).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import zerokern.checkpoint as ck

from ..support import models as M
from ..support.harness import one_thread  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two_renames"])
def test_save_replaces_a_checkpoint_and_leaves_nothing_behind(tmp_path, exchange, monkeypatch):
    if not exchange:
        monkeypatch.setenv(ck.writer.NO_EXCHANGE_ENV, "1")
    path = str(tmp_path / "ck")
    model = M.make_model()
    opt = M.zero_opt(model, 2, "fp32")
    ck.save(path, model, opt)
    M.train_zero(model, opt, 0, 1, 2)
    ck.save(path, model, opt)
    assert os.listdir(tmp_path) == ["ck"]
    m2 = M.make_model(M.MODEL_SEED + 9)
    o2 = M.zero_opt(m2, 0, "fp32")
    assert ck.load(path, m2, o2)["step"] == 2
    assert M.bitwise_equal(M.snapshot(m2), M.snapshot(model))


_CHILD = r"""
import os, sys, torch
sys.path.insert(0, sys.argv[4])
torch.set_num_threads(1)
import zerokern.checkpoint as ck
from tests.support import models as M
path, ref, point = sys.argv[1:4]
model = M.make_model()
opt = M.zero_opt(model, 1, "bf16")
M.train_zero(model, opt, 0, 1, 2)
ck.save(path, model, opt)
torch.save({"params": M.snapshot(model), "opt": opt.state_dict()}, ref)
M.train_zero(model, opt, 0, 1, 1, start=2)
os.environ[ck.writer.PAUSE_ENV] = point + "=300"
ck.save(path, model, opt)
print("NOT KILLED", flush=True)
"""


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("point,exchange", [  # a killed subprocess each (3 s on 2 loaded cores)
    ("files_written", True), pytest.param("files_written", False, marks=pytest.mark.slow),
    ("old_moved", False)])
def test_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, point, exchange):
    path, ref = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop(ck.writer.NO_EXCHANGE_ENV, None)
    if not exchange:
        env[ck.writer.NO_EXCHANGE_ENV] = "1"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, path, ref, point, REPO], env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        for line in proc.stderr:  # the writer announces the pause; kill it right there
            if f"paused at {point}" in line:
                break
            assert time.monotonic() < deadline, "the child never reached the pause"
        else:
            pytest.fail(f"child exited ({proc.wait()}) without pausing: {proc.stdout.read()}")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    left = sorted(os.listdir(tmp_path))
    tmps = [s for s in left if s.startswith("ck.tmp-")]
    assert len(tmps) == 1 and "rank00000.bin" in os.listdir(tmp_path / tmps[0]), left
    model = M.make_model(M.MODEL_SEED + 2)  # the child's model: no buffers
    opt = M.zero_opt(model, 1, "bf16")
    if point == "old_moved":  # between the two renames: `ck` is gone, its backup is read
        assert "ck" not in left and any(s.startswith("ck.old-") for s in left), left
        with pytest.warns(UserWarning, match="previous checkpoint"):
            ck.load(path, model, opt)
    else:
        assert "meta.json" not in os.listdir(tmp_path / tmps[0])
        ck.load(path, model, opt)
    want = torch.load(ref, weights_only=False)
    assert M.bitwise_equal(M.snapshot(model), want["params"])
    got_state, want_state = opt.state_dict(), want["opt"]
    for g, w in zip(got_state["state"], want_state["state"]):
        assert M.bitwise_equal(g, w)
    ck.save(path, model, opt)  # the next save commits and removes the leftovers
    assert sorted(os.listdir(tmp_path)) == ["ck", "ref.pt"]
