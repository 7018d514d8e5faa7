"""zerokern.state.huge_pages: large CPU buffers on their own zeroed mapping, freed with their last
view; everything else is torch.zeros."""

from __future__ import annotations

import gc

import pytest
import torch

from zerokern.state import huge_pages


def _rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int16])
def test_large_buffer_is_zero_and_writable(dtype):
    n = (huge_pages.MIN_BYTES // torch.empty((), dtype=dtype).element_size()) + 3
    t = huge_pages.zeros(n, dtype, "cpu")
    assert t.shape == (n,) and t.dtype == dtype and t.device.type == "cpu"
    assert t.untyped_storage().nbytes() == n * t.element_size()  # what memory_report counts
    assert not t.any()
    t[::4097] = 1
    assert int(t.count_nonzero()) == len(range(0, n, 4097))
    like = huge_pages.zeros_like(torch.empty(3, n // 3 + 1, dtype=dtype))
    assert like.shape == (3, n // 3 + 1) and not like.any()


def test_small_and_meta_buffers_are_torch_zeros():
    small = huge_pages.zeros(16, torch.float32, "cpu")
    assert small.untyped_storage().resizable()  # torch's allocator, not a mapping
    big = huge_pages.zeros(huge_pages.MIN_BYTES, torch.uint8, "cpu")
    assert not big.untyped_storage().resizable()  # a mapping (the control)
    meta = huge_pages.zeros(huge_pages.MIN_BYTES, torch.float32, "meta")
    assert meta.device.type == "meta"


def test_memory_returns_when_the_last_view_dies():
    """free_grads relies on it: the mapping goes with the last tensor that views it."""
    gc.collect()
    base = _rss_mib()
    t = huge_pages.zeros(64 << 18, torch.float32, "cpu")  # 64 MiB
    t.fill_(1.0)
    view = t[5:10]
    del t
    gc.collect()
    held = _rss_mib() - base
    assert held > 60, f"touched 64 MiB, RSS grew {held:.0f} MiB"
    assert float(view.sum()) == 5.0
    del view
    gc.collect()
    assert _rss_mib() - base < 8, "the mapping was not released"
