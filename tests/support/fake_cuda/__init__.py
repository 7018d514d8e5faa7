"""Run zerokern's GPU control flow on a CPU machine: fake CUDA tensors, a fake process group.

Issue 34, item 1. One subprocess (`python -m tests.support.fake_cuda.rank SCENARIO`) plays every
rank of a world of 8 in turn on device `cuda:<local rank>`, with
- `fake_cuda.cpp` loaded before torch: a CUDA device guard and CUDA hooks for a CPU-only torch
  build (8 devices, default streams, pinned host memory that `is_pinned()` recognises), so
  autograd, copies and indexing work on FakeTensors (`FakeTensorMode`, meta storage: no data);
- `dist.init_process_group("fake")`: any rank of any world size, collectives complete at once
  and change nothing; the groups report backend "nccl", so zerokern takes its NCCL paths;
- recording stand-ins for torch.cuda's streams and events (what waits on what, and every host
  wait) and a TorchDispatchMode that flags host syncs, pageable host->device copies, ops that
  mix devices, and records the collectives in order per communicator (`record.py`).
The rank process prints one JSON record per rank and scenario; `run_scenarios` returns them.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def _torch_dir() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("torch").submodule_search_locations[0])


def shim_path() -> Path:
    """Build (once per source and torch) and return the fake-CUDA shared library."""
    src = HERE / "fake_cuda.cpp"
    td = _torch_dir()
    key = hashlib.sha256(src.read_bytes() + str(td).encode()
                         + (td / "version.py").read_bytes()).hexdigest()[:16]
    out_dir = Path(os.environ.get("ZEROKERN_CACHE", Path.home() / ".cache" / "zerokern")) / "fake_cuda"
    out = out_dir / f"libzk_fake_cuda-{key}.so"
    if not out.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cxx = os.environ.get("CXX", "c++")
        cmd = [cxx, "-O1", "-std=c++17", "-fPIC", "-shared", "-w", "-isystem", str(td / "include"),
               "-isystem", str(td / "include/torch/csrc/api/include"), str(src), "-o", str(tmp),
               f"-L{td / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{td / 'lib'}"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    return out


def run_scenarios(names: List[str], world: int = 8, timeout: float = 900.0,
                  repo: Path = REPO) -> Dict[str, List[Dict]]:
    """Run each scenario for every rank of `world` in one subprocess: name -> one record per
    rank. `repo`: the checkout whose zerokern and tests/ run (another one, with this harness
    copied in, shows a finding on old code)."""
    env = dict(os.environ)
    env["ZK_FAKE_CUDA_SHIM"] = str(shim_path())
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(repo), env.get("PYTHONPATH", "")) if p)
    env.pop("TRITON_INTERPRET", None)
    env.pop("ZEROKERN_DEBUG_COLLECTIVES", None)
    proc = subprocess.run([sys.executable, "-m", "tests.support.fake_cuda.rank", str(world),
                           *names], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(repo))
    out: Dict[str, List[Dict]] = {n: [] for n in names}
    for line in proc.stdout.splitlines():
        if line.startswith("ZKREC "):
            rec = json.loads(line[len("ZKREC "):])
            out[rec["scenario"]].append(rec)
    missing = [n for n in names if len(out[n]) != world]
    if missing:
        raise AssertionError(f"scenarios {missing}: not every rank reported (rc "
                             f"{proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return out
