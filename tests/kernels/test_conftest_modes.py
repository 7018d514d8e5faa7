"""conftest's choice between the Triton interpreter and the compiled kernels (issue 14, 1).

`python -m pytest -m gpu` on a CUDA machine must leave TRITON_INTERPRET unset, so the gpu
tests run compiled kernels; every other run sets it and skips the gpu tests with the command
that runs them. Checked by calling the hooks with a stand-in config and CUDA patched.
"""

import sys

import pytest
import torch

from tests import conftest


class _Config:
    def __init__(self, markexpr):
        self.markexpr, self.lines = markexpr, []

    def getoption(self, name, default=None):
        return self.markexpr if name == "markexpr" else default

    def addinivalue_line(self, key, line):
        self.lines.append((key, line))


@pytest.fixture
def hooks(monkeypatch):
    """Run pytest_configure for (cuda available, -m expression); restore everything after."""
    saved = dict(conftest.COMPILED)
    # the kernels of this process are decorated already; hide them from the late-import check
    monkeypatch.delitem(sys.modules, "zerokern.kernels.triton_kernels", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def run(cuda: bool, markexpr: str):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        cfg = _Config(markexpr)
        conftest.pytest_configure(cfg)
        return cfg

    yield run
    conftest.COMPILED.update(saved)


@pytest.mark.parametrize("markexpr", ["gpu", "gpu and not large"])
def test_gpu_run_on_cuda_is_compiled(hooks, monkeypatch, markexpr):
    import os

    cfg = hooks(True, markexpr)
    assert conftest.COMPILED["on"] and "TRITON_INTERPRET" not in os.environ
    assert {k for k, _ in cfg.lines} == {"markers"}
    assert any(line.startswith("gpu:") for _, line in cfg.lines)
    assert any(line.startswith("large:") for _, line in cfg.lines)


@pytest.mark.parametrize("cuda,markexpr", [(True, ""), (True, "not gpu"), (False, "gpu")])
def test_other_runs_interpret_and_skip_gpu_tests(hooks, cuda, markexpr):
    import os

    hooks(cuda, markexpr)
    assert not conftest.COMPILED["on"] and os.environ["TRITON_INTERPRET"] == "1"

    class Item:
        def __init__(self, gpu):
            self.gpu, self.marks = gpu, []

        def get_closest_marker(self, name):
            return object() if name == "gpu" and self.gpu else None

        def add_marker(self, m):
            self.marks.append(m)

    items = [Item(True), Item(False)]
    conftest.pytest_collection_modifyitems(None, items)
    assert [len(i.marks) for i in items] == [1, 0]
    reason = items[0].marks[0].kwargs["reason"]
    assert ("python -m pytest -m gpu" in reason) if cuda else ("CUDA" in reason)
