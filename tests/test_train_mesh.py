"""`zerokern train --mesh RxS [--hpz]` on two simulated nodes under torchrun.

- slow (about 70-110 s on the 2-core VM, all jobs at once): two `torchrun --nnodes 2
  --node-rank {0,1} --nproc-per-node 2 --rdzv-backend c10d` processes on this host (`--device
  cpu`, stage 3, --mesh 2x2 --hpz, fp32) give the same per-step loss curve as a one-node 4-rank
  run of the same command (measured: bit for bit; bound rel 1e-6), and the job's optimizer has
  the 2x2 dims (shard 4, hpz 2); negative control: the one-node run at lr x 1.01 misses by far
  more than the bound.
- fast: the flags' cross-checks exit 2 with the flag's name before anything starts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from zerokern import cli

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--model-size", "tiny", "--seq", "32", "--batch", "4", "--steps", "5", "--device", "cpu",
        "--precision", "fp32", "--stage", "3", "--mesh", "2x2", "--hpz"]
TOL = 1e-6  # rel per step; the two launches run the same collectives in the same order


def _env():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(node: int, port: int, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
           str(node), "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"localhost:{port}", "-m", "zerokern", "train", *ARGS, "--out", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), cwd=REPO)


def _one_node(out: Path, *extra) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "zerokern", "train", *ARGS, "--out", str(out), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), cwd=REPO)


def _finish(procs, timeout=400):
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]


def _curve(out: Path):
    m = json.loads((out / "metrics.json").read_text())
    return m, m["loss_curve"]


@pytest.mark.slow
def test_two_nodes_under_torchrun_match_one_node(tmp_path):
    port = _free_port()
    two, one, neg = tmp_path / "two", tmp_path / "one", tmp_path / "neg"
    # both "nodes" write to `two`: only global rank 0 (on whichever node c10d gave it) reports
    _finish([_torchrun(0, port, two), _torchrun(1, port, two), _one_node(one),
             _one_node(neg, "--lr", str(1e-2 * 1.01))])
    m2, c2 = _curve(two)
    m1, c1 = _curve(one)
    _, cn = _curve(neg)
    assert m2["world_size"] == m1["world_size"] == 4
    assert m2["dims"] == {"shard": 4, "replicate": 1, "world": 4, "hpz": 2}
    assert len(c2) == len(c1) == 5
    for a, b in zip(c2, c1):
        assert abs(a - b) <= TOL * abs(b), (c2, c1)
    assert max(abs(a - b) / abs(b) for a, b in zip(cn[1:], c1[1:])) > 100 * TOL


@pytest.mark.parametrize("flags, message", [
    (["--hpz", "--stage", "3"], "--hpz needs --mesh"),
    (["--hpz", "--mesh", "2x2", "--stage", "2"], "--hpz is for --stage 3"),
    (["--mesh", "2x2", "--nproc", "2"], "--mesh 2x2 has 4 ranks but the job has 2"),
    (["--mesh", "1x1"], "--mesh 1x1 is one rank"),
    (["--mesh", "2by2"], "--mesh: expected RxS"),
    (["--mesh", "0x2"], "--mesh: every dim must be >= 1"),
])
def test_mesh_flag_errors(capsys, flags, message):
    # In process, as test_train.py's flag errors: the checks run before anything is spawned
    # (a subprocess each took 7 s of the default run on 2 cores, for the same parser path).
    with pytest.raises(SystemExit) as ei:
        cli.main(["train", "--device", "cpu", *flags])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage" in err
