"""The `zerokern` CLI end to end, in subprocesses, at tiny sizes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def zk(*args, timeout=300, **env):
    e = dict(os.environ, PYTHONPATH=str(REPO), **env)
    e.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "zerokern", *args], capture_output=True,
                          text=True, timeout=timeout, env=e, cwd=REPO)


def test_info_reports_versions_features_and_backends():
    r = zk("info")
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(None, 1) for line in r.stdout.splitlines()
                 if line and not line.startswith(" ") and len(line.split(None, 1)) == 2)
    import torch

    assert torch.__version__ in lines["torch"]
    assert "triton" in lines and "nvcc" in lines
    assert "avx2=" in lines["cpu"] and "f16c=" in lines["cpu"]
    backends = {ln.split()[0]: ln.split()[1] for ln in r.stdout.splitlines()
                if ln.startswith("  ")}
    assert backends["reference"] == "available"
    assert set(backends) == {"reference", "triton", "cuda", "cpu"}
    if not torch.cuda.is_available():  # the reason is printed for an unavailable backend
        assert "no CUDA device" in r.stdout


@pytest.mark.slow  # (5 s: a kernel build in a subprocess)
def test_build_prebuilds_cpu_op():
    r = zk("build", "cpu", timeout=600)
    assert r.returncode == 0, r.stderr
    assert "cpu: ok" in r.stdout
    again = zk("info")
    assert "cpu        available    built" in again.stdout


@pytest.mark.slow  # [Note: the slow mark]: 29 s; the quick plot test runs the same command
def test_bench_kernels_quick_writes_results(tmp_path):
    r = zk("bench", "--kernels", "--quick", "--no-plot", "--out", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    files = list(tmp_path.glob("*.json"))
    assert files, r.stdout
    data = json.loads(files[0].read_text())
    assert data["rows"], data
    assert list(tmp_path.glob("*.md"))


# [Note: the slow mark]: each case is a Python start-up with torch (~5 s on 2 cores): CI's -m slow
# pass (the parser's errors run in process in test_train.py's flag tests)
@pytest.mark.slow
@pytest.mark.parametrize("args", [["bogus"], ["build", "gpu"], ["info", "--nope"], []])
def test_bad_usage_exits_2_with_usage(args):
    r = zk(*args)
    assert r.returncode == 2
    assert "usage: zerokern" in r.stderr


@pytest.mark.slow  # [Note: the slow mark]: 25 s of the default run; CI runs it in -m slow
def test_bench_step_quick_writes_json_markdown_and_plot(tmp_path):
    r = zk("bench", "--step", "--quick", "--no-peers", "--no-fsdp2", "--stages", "0", "2", "3",
           "--reps", "2", "--out", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    stem = tmp_path / "step-tiny-n2-fp32-quick"
    data = json.loads(stem.with_suffix(".json").read_text())
    rows = {row["provider"]: row for row in data["rows"]}
    assert list(rows) == ["zerokern s0", "zerokern s2", "zerokern s3", "zerokern s3 keep all"]
    assert all(row["iter_ms"] > 0 and row["state_MiB"] > 0 for row in data["rows"])
    # stage 3 shows what keeping every unit for the backward costs (the tiny GPT: 2 blocks,
    # all live at once either way)
    assert rows["zerokern s3 keep all"]["live_MiB"] >= rows["zerokern s3"]["live_MiB"] > 0
    assert "iteration ≤ 1.1× zerokern s2" in r.stdout
    # how zerokern's collectives travelled, and what that held (comm/shm.py)
    from zerokern.comm import shm

    shared = shm.supported()
    assert data["env"]["zerokern_collectives"] == (
        "shared memory (ranks on one host)" if shared else "gloo send/recv rings")
    assert (rows["zerokern s2"]["memory_report"]["comm_buffers"] > 0) == shared
    assert "| provider |" in stem.with_suffix(".md").read_text()
    assert stem.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # [Note: the slow mark]: 25 s; `bench --step --quick` stays in the default run
def test_bench_kernels_quick_plot_has_ceiling(tmp_path):
    r = zk("bench", "--kernels", "--quick", "--sizes", "12", "--providers", "cpu",
           "--dtype-cases", "bf16", "--out", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(next(tmp_path.glob("kernels-*-quick.json")).read_text())
    provs = {row["provider"] for row in data["rows"]}
    assert {"cpu", "rmw", "copy"} <= provs  # rmw and copy: the ceilings drawn in the plot
    assert next(tmp_path.glob("kernels-*-quick.png")).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # (a Python start-up; the usage errors above cover the parser's exit)
def test_bench_bad_flag_is_an_error():
    r = zk("bench", "--kernels", "--sizes", "x")
    assert r.returncode == 2
    assert "usage" in r.stderr


@pytest.mark.slow  # a Python start-up with torch (6 s on 2 loaded cores)
def test_consolidate_without_args_is_a_usage_error():
    r = zk("consolidate")
    assert r.returncode == 2
    assert "usage" in r.stderr


@pytest.mark.slow  # (5 s: a spawned bench run)
def test_bench_step_failing_ranks_end_the_command(tmp_path):
    """A rank that raises ends `bench --step` at once with its error (it used to wait up to an
    hour for a result that never came)."""
    r = zk("bench", "--step", "--quick", "--nproc", "2", "--stages", "2", "--no-peers",
           "--backend", "bogus", "--out", str(tmp_path), timeout=120)
    assert r.returncode != 0
    assert "backend must be one of" in r.stderr
    assert "without a result" in r.stderr or "failed" in r.stderr


@pytest.mark.slow  # [Note: the slow mark] (pyproject.toml): run in CI's -m slow pass
def test_bench_engine_runs_both_engines_and_writes_results(tmp_path):
    """`bench --engine` end to end at the tiny size (it was broken by the launcher move: an
    ImportError of bench.step's removed `_free_port`, and no test ran it)."""
    r = zk("bench", "--engine", "--model-size", "tiny", "--stages", "1", "--precisions", "fp32",
           "--reps", "1", "--warmup", "0", "--out", str(tmp_path), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "engine-tiny-n2.json").read_text())
    (row,) = data["rows"]
    assert row["config"] == "s1-fp32" and row["zk_ms"] > 0 and row["ds_ms"] > 0
    assert row["zk_MiB"] > 0 and row["ds_MiB"] > 0
    assert 0 < row["bare_ms"] < row["zk_ms"] and row["zk_over_ms"] == row["zk_ms"] - row["bare_ms"]


_EXIT_PROBE = """
import atexit, sys
from pathlib import Path
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
class Finalized:
    def __del__(self):
        (out / "finalized").write_text("ran")
keep = Finalized()  # freed only when the interpreter finalizes this module
sys.argv = ["zerokern", *sys.argv[2:]]
from zerokern.cli import entry
entry()
"""


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("torchrun", [False, True])
def test_a_torchrun_rank_leaves_after_atexit_without_finalizing(tmp_path, torchrun):
    """[Note: leaving a torchrun rank] (cli.py): a torchrun rank (RANK and WORLD_SIZE set) runs
    the atexit handlers and exits with main()'s code but skips interpreter finalization, where
    a gloo worker thread taking the GIL aborted the process (SIGABRT) in 7 of 170 runs of
    `zerokern train` under torchrun; outside torchrun the exit is the normal one (the control:
    the module's object is finalized)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO)
    if torchrun:
        env.update(RANK="0", WORLD_SIZE="1")
    for args, code in ((["info"], 0), (["estimate", "--model", "20m", "--stage", "7"], 2)):
        for f in ("atexit", "finalized"):
            (tmp_path / f).unlink(missing_ok=True)
        r = subprocess.run([sys.executable, "-c", _EXIT_PROBE, str(tmp_path), *args],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == code, (args, r.returncode, r.stderr[-2000:])
        assert (tmp_path / "atexit").exists(), args
        assert (tmp_path / "finalized").exists() != torchrun, args
