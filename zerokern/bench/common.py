"""Shared benchmark utilities: timing, cache flushing, statistics, environment and result files.

Used by the kernel microbenchmarks (`zerokern.bench.kernels`) and meant to be reused by a
whole-step benchmark. Nothing here knows about optimizers.

[Note: how a repetition is timed]
- Providers are interleaved round-robin within each repetition, and the starting provider
  rotates each repetition, so a noisy moment (another process, a frequency change, the
  hypervisor) hits every provider alike instead of one unlucky block of reps.
- Every timed call starts from cold caches:
  - CUDA: we write a 256 MB buffer before each call, as llm.c `dev/cuda` does; that is five
    times the 50 MB L2 of an H100.
  - CPU: we *read* a buffer of twice the last-level cache. A write would leave the LLC full of
    dirty lines that the timed kernel must write back, billing it up to one LLC of extra
    traffic (32 MB here, more than the whole 2^20 step moves in some providers).
- CPU calls are timed with `time.perf_counter` (all CPU kernels are synchronous). CUDA calls are
  bracketed by events and the stream is synchronised once per repetition, so host overhead
  between calls is not counted, while launch gaps inside one provider call are.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np
import torch

from zerokern.platform.device import handle

# Host facts and tables live below the bench layer (train/ uses them too); re-exported here.
from zerokern.platform.host import cpu_llc_bytes, cpu_model, usable_cpus  # noqa: F401
from zerokern.tools.tables import Column, fmt_value, format_rows, markdown_table, print_table  # noqa: F401

TimedFn = Tuple[str, Callable[[], None]]  # (name, zero-argument callable)

# Five times the 50 MB L2 of an H100, as in llm.c; the env records the device's actual L2.
CUDA_FLUSH_BYTES = 256 << 20


# ---------------------------------------------------------------------------- environment


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return handle(device).name(device)
    return cpu_model()


def device_kind(device: torch.device) -> str:
    """File-name slug: 'cpu', or the GPU name, e.g. 'nvidia-h100-80gb-hbm3'."""
    if device.type == "cpu":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-") or device.type


def git_sha(repo: Path | None = None) -> str | None:
    """HEAD's sha with '-dirty' if the tree has changes; None outside a git checkout."""
    cwd = str(repo or Path(__file__).resolve().parents[2])
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        if not sha:
            return None
        # Untracked files count: new kernel sources change what is measured as much as edits.
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _version(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except Exception:  # not installed, or broken install: record as absent
        return None


def environment(device: torch.device) -> dict:
    """Machine and software description stored with every result file."""
    env = {
        "device": str(device),
        "device_kind": device_kind(device),
        "device_name": device_name(device),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_sha": git_sha(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        props = handle(device).properties(device)
        env.update(cuda=torch.version.cuda, gpu_memory_bytes=props.total_memory,
                   sm_count=props.multi_processor_count,
                   l2_bytes=getattr(props, "L2_cache_size", None))
    else:
        env["llc_bytes"] = cpu_llc_bytes()
        # The vector ISA torch dispatches to (AVX2, AVX512, ...): without AVX512-BF16/AMX,
        # bf16 matmuls are emulated and ~17x slower than fp32 (measured on an AVX2 EPYC), so
        # a bf16 model's own compute dominates any engine comparison there.
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return env


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = f  # steal: the hypervisor's share
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class OtherLoad:
    """CPU time that *other* processes used over an interval, as a fraction of the machine.

    On 2 cores one busy process delays each 2-thread parallel region by a scheduler slice
    (measured here: in-place `mul_` at 2^24 went from 3.4 ms on one thread to 8.6 ms on two
    with a neighbour running), so CPU results must say how busy the machine was. The load
    average lags a minute and counts us; this subtracts our own CPU time from /proc/stat's busy
    jiffies over the same interval.
    """

    def __init__(self):
        self.j0, self.c0 = _cpu_jiffies(), _own_cpu_s()

    def fraction(self) -> float | None:
        j1, c1 = _cpu_jiffies(), _own_cpu_s()
        if self.j0 is None or j1 is None or j1[1] <= self.j0[1]:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        others = (j1[0] - self.j0[0]) - (c1 - self.c0) * hz
        return round(max(0.0, others / (j1[1] - self.j0[1])), 3)


def other_load_now(seconds: float = 0.5) -> float | None:
    """Fraction of the machine other processes use right now (sampled over `seconds`)."""
    probe = OtherLoad()
    time.sleep(seconds)
    return probe.fraction()


def busy_warning(load: float | None, when: str) -> str | None:
    """A warning line when other processes used more than 10% of the CPUs, else None."""
    if load is not None and load > 0.10:
        return (f"warning: other processes used {load:.0%} of the CPUs {when}: they compete "
                "for the cores, so CPU timings are noisy")
    return None


def free_memory_bytes(device: torch.device) -> int:
    """Memory a benchmark may still allocate on `device` (CPU: MemAvailable)."""
    if device.type == "cuda":
        free, _total = handle(device).mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: don't skip anything


# ---------------------------------------------------------------------------- timing


class CacheFlusher:
    """Evicts the caches between timed calls (see the Note at the top of this module)."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.device = device
        self.enabled = enabled
        if not enabled:
            self.buf = None
        elif device.type == "cuda":
            self.buf = torch.empty(CUDA_FLUSH_BYTES, dtype=torch.uint8, device=device)
        else:
            # fp32 so the read is a vectorised reduction: ~5 ms for 64 MB on 2 cores.
            self.buf = torch.rand(2 * cpu_llc_bytes() // 4, dtype=torch.float32)

    def __call__(self) -> None:
        if self.buf is None:
            return
        if self.device.type == "cuda":
            self.buf.zero_()
        else:
            self.buf.sum()


def synchronize(device: torch.device) -> None:
    handle(device).synchronize(device)


def round_robin(fns: Sequence[TimedFn], device: torch.device, reps: int, warmup: int,
                flush: CacheFlusher | None = None) -> Dict[str, List[float]]:
    """Time each (name, fn) `reps` times, interleaved; returns name -> list of ms.

    Each repetition calls every fn once, in an order rotated by one each repetition. The first
    `warmup` repetitions are run the same way but discarded.
    """
    flush = flush or CacheFlusher(device, enabled=False)
    times: Dict[str, List[float]] = {name: [] for name, _ in fns}
    k = len(fns)
    for rep in range(warmup + reps):
        order = [fns[(i + rep) % k] for i in range(k)]
        if device.type == "cuda":
            events = []
            for name, fn in order:
                flush()
                start = handle(device).event(enable_timing=True)
                end = handle(device).event(enable_timing=True)
                start.record()
                fn()
                end.record()
                events.append((name, start, end))
            handle(device).synchronize(device)
            if rep >= warmup:
                for name, start, end in events:
                    times[name].append(start.elapsed_time(end))
        else:
            for name, fn in order:
                flush()
                t0 = time.perf_counter()
                fn()
                dt = (time.perf_counter() - t0) * 1e3
                if rep >= warmup:
                    times[name].append(dt)
    return times


def summarize(ms: Sequence[float]) -> dict:
    """median, p20, p80 and min in ms (linear interpolation between order statistics).

    The median is what rows report; min is kept in the JSON as the least-disturbed sample, for
    comparing runs from a machine shared with other work.
    """
    a = np.asarray(ms, dtype=np.float64)
    p20, med, p80 = np.percentile(a, [20, 50, 80])
    return {"median_ms": float(med), "p20_ms": float(p20), "p80_ms": float(p80),
            "min_ms": float(a.min()), "reps": int(a.size)}


def gbps(nbytes: float, ms: float) -> float:
    """Decimal GB/s (1e9 bytes per second), as vendors quote bandwidth."""
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")


# ---------------------------------------------------------------------------- output

def markdown_env(env: dict) -> str:
    keys = ["device_name", "cpu_model", "usable_cpus", "torch_threads", "gpu_memory_bytes",
            "torch", "cuda", "triton", "numpy", "python", "git_sha", "date", "zk_cpu_isa",
            "other_cpu_load_before", "other_cpu_load_during"]
    return "\n".join(f"- {k}: `{env[k]}`" for k in keys if env.get(k) is not None)


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return path


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
