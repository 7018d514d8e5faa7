"""Pinned host buffers are exactly the size reported (issue 14, defect 4).

The caching host allocator behind `torch.empty(pin_memory=True)` rounds each buffer up to a
power of two, so offload could lock up to 2x the host RAM that `memory_report()` showed. The
offload buffers now come from `zerokern.state.pinned.empty`: ordinary host memory,
page-locked in place.
Checked here on the CPU with a stand-in for the CUDA runtime that records what is registered;
tests/gpu/test_gpu.py checks the same with the real runtime and the optimizer's report.
"""

from __future__ import annotations

import gc

import pytest
import torch

from zerokern.state import pinned


class FakeCudart:
    def __init__(self):
        self.live = {}
        self.calls = []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (CUDA's name)
        assert ptr not in self.live
        self.live[ptr] = size
        self.calls.append(("register", ptr, size, flags))
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr, self.live.pop(ptr)))
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


@pytest.mark.parametrize("n,dtype", [(1_000_003, torch.bfloat16), (3 * 2**20 + 5, torch.float32),
                                     (1, torch.float16)])
def test_offload_pins_exactly_the_reported_bytes(cudart, n, dtype):
    before = pinned.pinned_bytes()
    t = pinned.host_empty(n, dtype, pin=True)
    nbytes = n * t.element_size()
    assert t.numel() == n and t.dtype == dtype
    assert t.untyped_storage().nbytes() == nbytes  # what host_bytes() reports
    assert list(cudart.live.values()) == [nbytes]  # what is locked: the same, not 2^k
    assert cudart.live == {t.data_ptr(): nbytes}
    assert t.data_ptr() % pinned.ALIGN == 0
    assert pinned.pinned_bytes() - before == nbytes
    t.fill_(3)  # ordinary host memory, usable by the cpu kernel
    assert t[-1].item() == 3
    del t
    gc.collect()
    assert not cudart.live and pinned.pinned_bytes() == before


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
def test_views_keep_the_pages_locked(cudart):
    t = pinned.empty(4096, torch.float32)
    view = t[100:200]
    del t
    gc.collect()
    assert len(cudart.live) == 1, "unregistered while a view still uses the memory"
    view.fill_(1.0)
    del view
    gc.collect()
    assert not cudart.live


def test_register_failure_is_an_error_naming_the_limit(monkeypatch):
    class Failing(FakeCudart):
        def cudaHostRegister(self, ptr, size, flags):  # noqa: N802
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Failing())
    with pytest.raises(RuntimeError, match="memlock"):
        pinned.empty(100, torch.float32)


def test_unpinned_is_plain_memory(cudart):
    t = pinned.host_empty(100, torch.float32, pin=False)
    assert t.numel() == 100 and not cudart.calls
