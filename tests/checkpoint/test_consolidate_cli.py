"""`zerokern consolidate DIR OUT` through zerokern.checkpoint.cli, end to end.

The subcommand's parser and runner (`add_arguments`, `run`) are what zerokern/cli.py wires in;
here they run in process on an argparse parser, and as `python -m zerokern.checkpoint` in a
subprocess. The checkpoint comes from a world-size-1 training run in this process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerokern.checkpoint as ck
from tests.support import models as M
from tests.support.harness import one_thread  # noqa: F401 - the fixture
from zerokern.checkpoint import cli

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    d = str(tmp_path_factory.mktemp("cli") / "ck")
    model = M.make_model()
    opt = M.zero_opt(model, 1, "bf16")
    M.train_zero(model, opt, 0, 1, 2)
    ck.save(d, model, opt)
    torch.set_num_threads(n)
    return d


def _parse(argv):
    p = argparse.ArgumentParser(prog="zerokern consolidate")
    cli.add_arguments(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("name,dtype", [("out.pt", "fp32"), ("out.safetensors", "bf16")])
def test_run_writes_what_consolidate_returns(ckpt, tmp_path, name, dtype, capsys):
    out = str(tmp_path / name)
    assert cli.run(_parse([ckpt, out, "--dtype", dtype])) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    ref = ck.consolidate(ckpt, dtype=dtype)
    if name.endswith(".pt"):
        got = torch.load(out, weights_only=True)
    else:
        from safetensors.torch import load_file

        got = load_file(out)
    assert sorted(got) == sorted(ref) and M.bitwise_equal(got, ref)
    M.make_model(M.MODEL_SEED + 1).load_state_dict(got, strict=True)


def test_format_flag_overrides_the_suffix(ckpt, tmp_path):
    out = str(tmp_path / "weights.bin")
    assert cli.run(_parse([ckpt, out, "--format", "safetensors"])) == 0
    from safetensors import safe_open

    with safe_open(out, "pt") as f:
        assert "emb.weight" in f.keys() and "head.weight" in f.keys()


def test_errors_are_one_line_and_exit_1(ckpt, tmp_path, capsys):
    assert cli.run(_parse([str(tmp_path / "missing"), str(tmp_path / "o.pt")])) == 1
    err = capsys.readouterr().err
    assert err.startswith("zerokern consolidate: error:") and "no such checkpoint" in err
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
def test_python_dash_m_entry(ckpt, tmp_path):
    out = tmp_path / "m.safetensors"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-m", "zerokern.checkpoint", "consolidate", ckpt,
                        str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file

    assert M.bitwise_equal(load_file(str(out)), ck.consolidate(ckpt))
    r = subprocess.run([sys.executable, "-m", "zerokern.checkpoint", "consolidate",
                        str(tmp_path / "nope"), str(out)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 1 and "no such checkpoint" in r.stderr
