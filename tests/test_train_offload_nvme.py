"""`zerokern train --offload nvme` (config.py [Note: the NVMe state of zerokern train]) and the
chaos run's kill mid NVMe write (train/chaos_kill.py [Note: a kill mid-write on request]).

Fast: the flags' errors name the flag (exit 2 with the usage line); each rank's directory is
created and the files of dead processes are removed there, a live process's kept (negative
control); the mid-write hook is not installed without $ZEROKERN_CHAOS_DIR, ignores requests
for another attempt or rank or a later step, and kills at the requested write of the step
after it read a matching request (os.kill recorded, not sent).
Slow: a run stopped after N steps and resumed with `--resume auto` is bitwise (loss curve and
final fp32 params) the uninterrupted nvme run, whose params differ from an offload="cpu" run's
by nothing either (the same fused kernel on the same values).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import zerokern.checkpoint as ck
from zerokern import cli
from zerokern.train import chaos_kill, events
from zerokern.train.config import TrainConfig, offload_dir, offload_root

from .support.train_cli import N, train


@pytest.mark.parametrize("argv,says", [
    (["--offload-path", "/tmp"], "--offload-path is for --offload nvme"),
    (["--offload", "cpu", "--offload-path", "/tmp"], "--offload-path is for --offload nvme"),
    (["--offload", "nvme", "--offload-path", __file__], "--offload-path"),
    (["--offload", "disk"], "--offload"),
    (["--offload", "nvme", "--mesh", "1x1x2"], "--offload nvme is not available with a pipeline"),
])
def test_bad_offload_flags_exit_2_naming_the_flag(capsys, argv, says):
    with pytest.raises(SystemExit) as ei:
        cli.main(["train", *argv])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "usage: zerokern train" in err and says in err, err


def test_each_rank_has_its_directory_and_dead_processes_files_are_removed(tmp_path):
    cfg = TrainConfig(save_dir=str(tmp_path / "ck"))
    assert offload_root(cfg) == str(tmp_path / "ck" / ".offload-nvme")
    assert offload_root(TrainConfig(offload_path="/x")) == "/x"
    d0 = offload_dir(cfg, 0)
    assert d0 == str(tmp_path / "ck" / ".offload-nvme" / "rank0") and os.path.isdir(d0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = [f"zerokern-{dead.pid}-0a1b2c3d-rank0-buf0-master.bin",
                 f"zerokern-{alive.pid}-0a1b2c3d-rank0-buf0-master.bin",
                 f"zerokern-{os.getpid()}-0a1b2c3d-rank0-buf0-exp_avg.bin", "notes.txt"]
        for n in names:
            Path(d0, n).write_bytes(b"x")
        assert offload_dir(cfg, 0) == d0
        assert sorted(os.listdir(d0)) == sorted(names[1:])  # only the dead one's is gone
    finally:
        alive.kill()
        alive.wait()
    assert offload_dir(cfg, 1) != d0
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(ValueError, match="--offload-path"):
        offload_dir(TrainConfig(offload="nvme", offload_path=str(blocked)), 0)


def _offloader():
    return SimpleNamespace(offload="nvme", fault_hook=None, commit_hooks=[])


def test_the_mid_write_kill_only_on_request(tmp_path, monkeypatch):
    off = _offloader()
    monkeypatch.delenv(chaos_kill.CHAOS_ENV, raising=False)
    chaos_kill.install(SimpleNamespace(offloader=off), rank=1, step=0)
    assert off.fault_hook is None and off.commit_hooks == []  # unset: nothing installed
    monkeypatch.setenv(chaos_kill.CHAOS_ENV, str(tmp_path))
    chaos_kill.install(SimpleNamespace(offloader=SimpleNamespace(offload="cpu")), 1, 0)  # no-op
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv(events.EVENTS_ENV, str(tmp_path / "events"))
    monkeypatch.setattr(events, "_path", [None])
    kills = []
    monkeypatch.setattr(chaos_kill.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    chaos_kill.install(SimpleNamespace(offloader=off), rank=1, step=10)
    (hook,) = off.commit_hooks

    def request(**kw):
        (tmp_path / chaos_kill.REQUEST).write_text(json.dumps(
            {"attempt": 2, "rank": 1, "after_step": 11, "nth": 1, **kw}))

    def step():  # a step's 3 writes, then its commit
        for i in range(3):
            off.fault_hook(f"/d/zerokern-1-x-rank1-buf0-f{i}.bin", 4096 * i)
        hook()

    step()  # no request yet (commits step 11)
    for other in ({"attempt": 1}, {"rank": 0}, {"after_step": 99}):  # commits 12-17
        request(**other)
        step()
        step()
        assert kills == [], other
    request()  # read at the next commit (after_step 11 <= 18): armed from step 19
    step()
    assert kills == []
    step()  # step 19: killed at its write 1
    assert kills == [(os.getpid(), signal.SIGKILL)]
    ev = [json.loads(x) for f in (tmp_path / "events").iterdir()
          for x in f.read_text().splitlines()]
    assert [(e["event"], e["rank"], e["step"], e["file"], e["offset"], e["nth"]) for e in ev] == \
        [("mid-write", 1, 19, "zerokern-1-x-rank1-buf0-f1.bin", 4096, 1)]




def _train(*args, timeout=600):
    return train(*args, timeout=timeout)


def _curve(out_dir) -> list:
    return json.loads((Path(out_dir) / "metrics.json").read_text())["loss_curve"]


@pytest.mark.slow  # [Note: the slow mark]: 4 train runs of 2 ranks, 40-80 s
def test_nvme_resume_auto_is_bitwise_the_uninterrupted_run(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "cpu"
    _train("--offload", "nvme", "--save-dir", str(a / "ck"), "--out", str(a), "--resume", "auto")
    _train("--offload", "nvme", "--save-dir", str(b / "ck"), "--out", str(b / "first"),
           "--stop-after", str(N), "--offload-path", str(b / "nvme"))
    assert sorted(os.listdir(b / "nvme")) == ["rank0", "rank1"]
    assert not list((b / "nvme").glob("*/*"))  # the ranks removed their files at exit
    out = _train("--offload", "nvme", "--save-dir", str(b / "ck"), "--out", str(b),
                 "--resume", "auto", "--offload-path", str(b / "nvme"))
    assert f"resumed from {b / 'ck' / f'step{N:08d}'} at step {N}" in out.stdout + out.stderr
    _train("--offload", "cpu", "--save-dir", str(c / "ck"), "--out", str(c))
    assert sorted(os.listdir(a / "ck")) == [".offload-nvme", f"step{N:08d}", f"step{2 * N:08d}"]
    fa, fb, fc = (ck.consolidate(ck.latest(str(d / "ck"))) for d in (a, b, c))
    assert fa.keys() == fb.keys() == fc.keys()
    for k in fa:
        assert fa[k].equal(fb[k]), k
        assert fa[k].equal(fc[k]), k  # nvme is offload="cpu"'s update, streamed
    first = ck.consolidate(str(a / "ck" / f"step{N:08d}"))
    assert any(not first[k].equal(fa[k]) for k in fa)  # negative control: training moved them
    assert _curve(a) == _curve(b)
