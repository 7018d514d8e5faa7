"""benchmarks/bench_infinity.py end to end at the `tiny` preset: probe and step interleaved
(steps + 1 probes after the warm-up steps), each probe moving exactly the step's bytes, the
loss falling on the fixed batch, and the report's spreads computed from the rows it prints."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # [Note: the slow mark]: 9 s of benchmark smoke
def test_bench_infinity_tiny(tmp_path):
    (tmp_path / "disk").mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(REPO / "benchmarks/bench_infinity.py"), "--path",
                          str(tmp_path / "disk"), "--model", "tiny", "--steps", "3", "--lr",
                          "1e-2", "--out", str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "infinity-tiny.json").read_text())
    whats = [r["what"] for r in res["rows"]]
    assert whats == ["warm-up step 0", "warm-up step 1", "disk probe", "step 0", "disk probe",
                     "step 1", "disk probe", "step 2", "disk probe"]
    gb = {r["GB"] for r in res["rows"]}
    assert gb == {res["bytes_per_step_GB"]}  # every probe and step moved the same bytes
    losses = [r["loss"] for r in res["rows"] if "loss" in r]
    assert losses[-1] < losses[0]
    probes = [r["GBps"] for r in res["rows"] if r["what"] == "disk probe"]
    assert res["probe_GBps"]["median"] == statistics.median(probes)
    assert (res["probe_GBps"]["min"], res["probe_GBps"]["max"]) == (min(probes), max(probes))
    steps = [r["GBps"] for r in res["rows"] if r["what"].startswith("step")]
    frac = res["step_of_probe"]
    assert abs(frac["median_pct"] - 100 * statistics.median(steps) / statistics.median(probes)) \
        < 1e-9
    pairs = [200 * st / (probes[i] + probes[i + 1]) for i, st in enumerate(steps)]
    assert frac["paired"]["median"] == statistics.median(pairs)
    md = (tmp_path / "infinity-tiny.md").read_text()
    assert "disk probe" in md and "load average" in md and "as a fraction of the probe" in md
    assert os.listdir(tmp_path / "disk") == []  # the state files are removed at close
