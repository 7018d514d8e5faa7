"""Pa+cpu's backward prefetch, one checkpoint ahead (zerokern/checkpointing/store.py [Note:
Pa+cpu's backward prefetch], issue 37).

On this CPU-only machine the copy back is the host buffer itself, so only the control flow
runs: the recompute of checkpoint c starts with the unpack of its inputs, and the prefetch of
checkpoint c - 1 is issued right then, before c - 1's unpack; every input but the last
checkpoint's comes from the prefetch; the losses and params are bitwise those of no
checkpointing, with the prefetch on and off. The side-stream copy has not run on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import zerokern.checkpointing as ck
from tests.checkpointing.common import N_LAYERS
from tests.checkpointing.test_api import STEPS, _run, _same, reference  # noqa: F401 (fixture)
from zerokern.checkpointing import api


@pytest.fixture(autouse=True)
def _restore_state():
    saved = api._STATE
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    api._STATE = saved
    torch.set_num_threads(n)


def _cpu_checkpointing(prefetch: bool):
    with pytest.warns(UserWarning, match="cpu_checkpointing"):  # no CUDA: host is the device
        ck.configure(None, checkpoint_in_cpu=True)
    store = api._STATE.store
    store.prefetch = prefetch
    store.trace = []
    return store


def _first(trace, what, idx):
    return next(i for i, e in enumerate(trace) if e == (what, idx))


def test_prefetch_one_checkpoint_ahead_and_bitwise(reference):  # noqa: F811
    store = _cpu_checkpointing(True)
    got = _run(ck.checkpoint)
    assert _same(got, reference)
    tr = store.trace
    assert ck.stats()["prefetches"] == store.prefetches == (N_LAYERS - 1) * STEPS
    for step in range(STEPS):  # each forward's checkpoints, in backward order
        calls = list(range(step * N_LAYERS, (step + 1) * N_LAYERS))
        for c in calls[1:]:
            # c's recompute starts (its first unpack), then c - 1 is prefetched, before its
            # own unpack
            assert _first(tr, "unpack", c) < _first(tr, "prefetch", c - 1) \
                < _first(tr, "unpack", c - 1)
        assert ("prefetch", calls[-1]) not in tr  # the last one: nothing before it prefetched it
    # every input but the last checkpoint's of each step was handed out from a prefetch
    assert store.prefetch_hits == (N_LAYERS - 1) * STEPS

def test_prefetch_off_is_the_same(reference):  # noqa: F811
    store = _cpu_checkpointing(False)
    assert _same(_run(ck.checkpoint), reference)
    assert store.prefetches == 0 and not any(w == "prefetch" for w, _ in store.trace)
