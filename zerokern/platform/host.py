"""Facts about the host machine (CPU model, last-level cache, usable CPUs), used by training,
benchmarks and reports alike."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

# Used when sysfs does not report an L3 (some VMs, containers).
CPU_LLC_FALLBACK_BYTES = 32 << 20


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_llc_bytes() -> int:
    """Size of the largest cache sysfs lists for cpu0 (the LLC), or a 32 MB guess."""
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            txt = (idx / "size").read_text().strip()
        except OSError:
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", txt)
        if m:
            best = max(best, int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20,
                                                  "G": 1 << 30}[m.group(2)])
    return best or CPU_LLC_FALLBACK_BYTES


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
