"""`zerokern bench --activations --quick` (issue 37): the tiny GPT on 2 gloo ranks, zerokern's
stage 3 without and with activation_checkpointing="full". Checks the result files' fields,
and that "full" holds fewer bytes than "none" at the same length (after forward, and at the
iteration's peak) and so fits at least as long a sequence in the same budget."""

from __future__ import annotations

import json

import pytest

from zerokern.bench import activations


@pytest.mark.slow  # two bench runs in subprocesses (10 s on 2 loaded cores)
def test_quick_run_writes_the_fields_and_full_holds_less(tmp_path):
    assert activations.main(["--quick", "--out", str(tmp_path), "--stem", "q"]) == 0
    res = json.loads((tmp_path / "q.json").read_text())
    md = (tmp_path / "q.md").read_text()
    env = res["env"]
    for k in ("device_name", "torch", "date", "git_sha", "world_size", "model", "budget_MiB",
              "common_seq", "precision"):
        assert k in env, k
    assert env["world_size"] == 2 and env["model"] == "tiny"
    assert "method" in res and "max_memory_allocated" in res["method"]
    rows = {r["key"]: r for r in res["rows"]}
    assert set(rows) == {"zk-none", "zk-full"}
    for r in rows.values():
        for k in ("fitted_seq", "MiB_at_fit", "states_MiB", "after_forward_MiB", "common_ms",
                  "overhead", "common_cpu_ms", "overhead_cpu"):
            assert k in r, k
        assert r["fitted_seq"] > 0 and r["MiB_at_fit"] <= env["budget_MiB"]
        assert r["provider"] in md
    assert rows["zk-none"]["overhead"] == 1.0 == rows["zk-none"]["overhead_cpu"]
    trials = {k: {t["seq"]: t for t in p["trials"]} for k, p in res["providers"].items()}
    seq = min(trials["zk-none"])  # the first length both measured
    none, full = trials["zk-none"][seq], trials["zk-full"][seq]
    assert full["after_forward_bytes"] < 0.8 * none["after_forward_bytes"]
    assert full["peak_bytes"] < none["peak_bytes"]
    assert rows["zk-full"]["fitted_seq"] >= rows["zk-none"]["fitted_seq"]
    # the same model states (the policy changes no params, grads or optimizer state)
    assert abs(rows["zk-full"]["states_MiB"] - rows["zk-none"]["states_MiB"]) < 0.01
