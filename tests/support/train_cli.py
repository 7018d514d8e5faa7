"""`zerokern train` as a user runs it, for the resume tests: the tiny preset on 2 gloo ranks,
2N steps saving every N (tests/test_train_resume.py, tests/test_train_offload_nvme.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
N = 3
TINY = ["--model-size", "tiny", "--seq", "32", "--batch", "4", "--device", "cpu",
        "--nproc", "2", "--steps", str(2 * N), "--save-every", str(N)]


def train(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m zerokern train` with TINY and `args`; asserts exit 0 (its output tail if
    not) and returns the process."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-m", "zerokern", "train", *TINY, *args],
                         capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out
