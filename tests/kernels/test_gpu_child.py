"""On a CUDA machine, a plain `pytest` run also runs the `gpu` tests, in a child process.

Not marked `gpu` itself: in the process that runs it the Triton interpreter is on (conftest:
one kind of Triton kernel per process), so the child runs `python -m pytest -m "gpu and not
large"`, where it is off and the compiled kernels run. Skipped without CUDA, and in the gpu run.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="this is the gpu run")
def test_gpu_suite_in_child():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
         "gpu and not large", str(REPO / "tests")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=3600,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0 and " passed" in out, out[-8000:]
