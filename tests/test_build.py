"""JIT build: cache reuse across processes, crash-safe locking, clear build errors.

Uses a tiny pybind11-only op so each build takes seconds; the real ops share the same code path.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

GOOD_SRC = """
#include <pybind11/pybind11.h>
int add(int a, int b) { return a + b + %d; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""


def _run(code: str, cache: Path, timeout: float = 240, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ, ZEROKERN_CACHE_DIR=str(cache), PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=e)


def _load_code(root: Path, name: str = "tiny") -> str:
    return f"""
        import logging; logging.basicConfig(level=logging.WARNING)
        from zerokern.kernels.build import OpSpec, load_op, build_dir
        spec = OpSpec({name!r}, ["*.cpp"], cflags=["-O1"], root={str(root)!r})
        print("RESULT", load_op(spec).add(2, 3), build_dir(spec))
    """


@pytest.fixture
def tiny(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.cpp").write_text(GOOD_SRC % 10)
    return src, tmp_path / "cache"


@pytest.mark.slow  # [Note: the slow mark] (pyproject.toml): run in CI's -m slow pass
def test_second_process_reuses_cache_and_edit_rebuilds(tiny):
    src, cache = tiny
    first = _run(_load_code(src), cache)
    assert first.returncode == 0, first.stderr
    assert "RESULT 15" in first.stdout
    assert first.stderr.count("building tiny ops") == 1  # exactly one log line per build
    so = next(cache.glob("tiny-*/zerokern_tiny_ops.so"))
    mtime = so.stat().st_mtime_ns

    second = _run(_load_code(src), cache)
    assert second.returncode == 0, second.stderr
    assert "RESULT 15" in second.stdout
    assert "building" not in second.stderr
    assert so.stat().st_mtime_ns == mtime

    # A source edit changes the key: a new build, with the new behaviour.
    (src / "tiny.cpp").write_text(GOOD_SRC % 20)
    third = _run(_load_code(src), cache)
    assert "RESULT 25" in third.stdout, third.stderr
    assert "building tiny ops" in third.stderr


@pytest.mark.slow  # [Note: the slow mark] (pyproject.toml): run in CI's -m slow pass
def test_stale_torch_baton_does_not_hang(tiny):
    """A build killed mid-way leaves torch's O_EXCL `lock` file behind; a later load must build."""
    src, cache = tiny
    probe = _run(f"""
        from zerokern.kernels.build import OpSpec, build_dir
        print(build_dir(OpSpec("tiny", ["*.cpp"], cflags=["-O1"], root={str(src)!r})))
    """, cache)
    bdir = Path(probe.stdout.strip())
    bdir.mkdir(parents=True)
    (bdir / "lock").write_text("")
    t0 = time.time()
    r = _run(_load_code(src), cache, timeout=180)
    assert r.returncode == 0, r.stderr
    assert "RESULT 15" in r.stdout
    assert time.time() - t0 < 170


@pytest.mark.slow  # [Note: the slow mark] (pyproject.toml): run in CI's -m slow pass
def test_killed_lock_holder_releases_lock(tiny):
    """A process SIGKILLed while holding the build lock must not block the next build."""
    src, cache = tiny
    holder = _run(f"""
        import fcntl, os, signal
        from pathlib import Path
        p = Path({str(cache)!r}); p.mkdir(parents=True, exist_ok=True)
        fh = open(p / "tiny.lock", "a+"); fcntl.flock(fh, fcntl.LOCK_EX)
        os.kill(os.getpid(), signal.SIGKILL)
    """, cache)
    assert holder.returncode == -signal.SIGKILL
    r = _run(_load_code(src), cache, ZEROKERN_BUILD_TIMEOUT="120")
    assert r.returncode == 0, r.stderr
    assert "RESULT 15" in r.stdout


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
def test_live_lock_holder_times_out_with_clear_error(tiny):
    src, cache = tiny
    cache.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, time
        fh = open({str(cache / 'tiny.lock')!r}, "a+"); fcntl.flock(fh, fcntl.LOCK_EX)
        print("held", flush=True); time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = _run(_load_code(src), cache, ZEROKERN_BUILD_TIMEOUT="1")
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode != 0
    assert "BuildError" in r.stderr and "tiny.lock" in r.stderr
    assert "backend='reference'" in r.stderr


def test_build_failure_names_command_and_fallback(tiny):
    src, cache = tiny
    (src / "tiny.cpp").write_text("this is not C++;\n")
    r = _run(_load_code(src), cache)
    assert r.returncode != 0
    assert "BuildError" in r.stderr
    assert "ninja -v" in r.stderr
    assert "backend='reference'" in r.stderr
    assert "tiny.cpp" in r.stderr  # the compiler's own message survives in the error


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
def test_missing_sources_is_a_build_error(tmp_path):
    r = _run(_load_code(tmp_path / "nowhere"), tmp_path / "cache")
    assert r.returncode != 0
    assert "BuildError" in r.stderr and "no sources match" in r.stderr
