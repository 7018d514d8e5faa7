"""The README's quickstart runs as written (world size 1, on the CPU here) and puts its model
and its batches on the device before using them (placement_probe.py: on a GPU, a model left on
the CPU is refused under NCCL and a batch left there fails in the forward). The snippet is read
from README.md's "## Quickstart" section and run with a small `MyModel` and `loader`. The old
quickstart never moved either: failed. Also the probe's negative controls.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import zerokern as zk

from ..support.harness import one_thread  # noqa: F401 - the fixture
from .placement_probe import Probe

pytestmark = pytest.mark.usefixtures("one_thread")
README = Path(__file__).resolve().parents[2] / "README.md"
VOCAB, DIM, SEQ, BATCHES = 32, 16, 8, 4


def quickstart() -> str:
    text = README.read_text()
    section = text[text.index("## Quickstart"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


class MyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        return self.out(self.emb(x)).flatten(0, 1)


def loader():
    g = torch.Generator().manual_seed(0)
    for _ in range(BATCHES):
        x = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        yield x, ((x + 1) % VOCAB).flatten()


def test_the_quickstart_moves_model_and_batches_to_the_device(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    probe = Probe()
    probe.install(monkeypatch.setattr)
    ns = {"MyModel": MyModel, "loader": loader()}
    exec(compile(quickstart(), "README.md quickstart", "exec"), ns)
    assert probe.optimizers == 1 and probe.forwards == BATCHES, probe.summary()
    assert isinstance(ns["opt"], zk.ZeroAdamW)
    assert all(p.device == ns["device"] for p in ns["model"].parameters())


def test_the_probe_refuses_a_model_or_a_batch_that_never_moved(monkeypatch):
    probe = Probe()
    probe.install(monkeypatch.setattr)
    with pytest.raises(RuntimeError, match="never moved to a device.*move the model first"):
        zk.ZeroAdamW(MyModel(), stage=2, precision="fp32")
    model = MyModel().to("cpu")
    zk.ZeroAdamW(model, stage=2, precision="fp32")
    x = torch.zeros(2, SEQ, dtype=torch.long)
    with pytest.raises(RuntimeError, match="never moved to a device.*move the batches too"):
        model(x)
    model(x.to("cpu")[:, 1:])  # a view of a moved batch counts
    assert probe.optimizers == 1 and probe.forwards == 1
