"""`zerokern bench --offload --nvme-only --quick`: the NVMe rows are measured against the disk
probe (disk_probe.py), interleaved: reps + 1 probes moving exactly the step's bytes, the paired
fraction recomputed from them, each sweep configuration beside a probe of its own pattern, and
no file left under --nvme-path."""

from __future__ import annotations

import json
import os

import pytest

from zerokern.bench import offload


@pytest.mark.slow  # [Note: the slow mark]: 8 s of benchmark smoke
def test_nvme_rows_use_the_probe(tmp_path, capsys):
    (tmp_path / "disk").mkdir()
    rc = offload.main(["--nvme-only", "--quick", "--nvme-path", str(tmp_path / "disk"),
                       "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "offload-nvme-tiny-s2-bf16.json").read_text())["nvme"]
    row, frac = res["row"], res["fraction"]
    assert res["probe_GBps"]["n"] == 2 + 1  # --quick: 2 reps
    assert frac["paired"]["n"] == 2 and row["of_probe_pct"] == frac["paired"]["median"]
    assert row["probe_min_ms"] <= row["probe_ms"] <= row["probe_max_ms"]
    assert len(res["sweep"]) == 4 and all(r["probe_ms"] > 0 for r in res["sweep"])
    for r in res["sweep"]:
        assert r["of_probe_pct"] == pytest.approx(100 * r["probe_ms"] / r["step_ms"])
    md = (tmp_path / "offload-nvme-tiny-s2-bf16.md").read_text()
    assert "% of probe" in md and "disk probe under" in md
    assert os.listdir(tmp_path / "disk") == []
