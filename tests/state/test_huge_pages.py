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


def _status_mib(field: str, path: str = "/proc/self/status") -> float:
    with open(path) as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in {path}")


@pytest.fixture
def pool():
    """The process's lazy pool, emptied before and after (other tests' mappings out of it)."""
    huge_pages.POOL.clear()
    enabled = huge_pages.POOL.enabled
    yield huge_pages.POOL
    huge_pages.POOL.enabled = enabled
    huge_pages.POOL.clear()


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
def test_memory_returns_when_the_last_view_dies(pool):
    """With the pool off (the code before [Note: freed mappings kept lazily]): the mapping goes
    with the last tensor that views it."""
    pool.enabled = False
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


@pytest.mark.skipif(huge_pages._LAZY is None, reason="no MADV_FREE on this platform: no pool")
def test_a_freed_mapping_is_lazily_free_and_reused_zeroed(pool):
    """[Note: freed mappings kept lazily]: the last view's death hands the mapping to the pool
    advised MADV_FREE (the kernel counts it as LazyFree: reclaimable), and the next buffer of
    that size is the same pages, zero again."""
    n = 64 << 18  # 64 MiB of fp32
    lazy0 = _status_mib("LazyFree", "/proc/self/smaps_rollup")
    t = huge_pages.zeros(n, torch.float32, "cpu", reuse=True)
    t.fill_(3.0)
    ptr, view = t.data_ptr(), t[7:9]
    del t
    gc.collect()
    assert pool.bytes == 0, "a live view: the mapping must not be reused"
    assert float(view.sum()) == 6.0  # the user's tensor keeps its values
    del view
    assert pool.bytes == n * 4
    lazy = _status_mib("LazyFree", "/proc/self/smaps_rollup") - lazy0
    assert lazy > 60, f"64 MiB given back lazily, LazyFree grew {lazy:.0f} MiB"
    # another size: a fresh mapping
    other = huge_pages.zeros(n // 2, torch.float32, "cpu", reuse=True)
    assert other.data_ptr() != ptr and pool.bytes == n * 4
    again = huge_pages.zeros(n, torch.float32, "cpu", reuse=True)
    assert again.data_ptr() == ptr and pool.bytes == 0 and pool.reused >= 1
    assert not again.any(), "a reused mapping must be zero"


@pytest.mark.skipif(huge_pages._LAZY is None, reason="no MADV_FREE on this platform: no pool")
def test_the_pool_keeps_at_most_its_bounds(pool):
    n = huge_pages.MIN_BYTES
    bufs = [huge_pages.zeros(n, torch.uint8, "cpu", reuse=True) for _ in range(pool.per_size + 2)]
    del bufs
    gc.collect()
    assert pool.bytes == pool.per_size * n  # the rest were unmapped
    pool.clear()
    pool.enabled = False
    t = huge_pages.zeros(n, torch.uint8, "cpu", reuse=True)
    del t
    assert pool.bytes == 0
    pool.enabled = True  # a buffer not made for reuse (params, states) is never pooled
    t = huge_pages.zeros(n, torch.uint8, "cpu")
    del t
    assert pool.bytes == 0


@pytest.mark.skipif(huge_pages._LAZY is None, reason="no MADV_FREE on this platform: no pool")
@pytest.mark.parametrize("stage", [0, 1])
def test_a_kept_grad_keeps_its_values_across_freed_steps(pool, stage):
    """A user who keeps `p.grad` (stage 0: a view of the Ψ grad buffer) across zero_grad()
    with free_grads=True holds the old buffer: it must keep torch's values while the next steps
    reuse pooled mappings, and the steps must equal the run without the pool (bitwise)."""
    import zerokern as zk

    def run(use_pool: bool):
        pool.clear()
        pool.enabled = use_pool
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1100), torch.nn.Linear(1100, 8))
        opt = zk.ZeroAdamW(model, lr=1e-3, stage=stage, precision="fp32", backend="reference",
                           free_grads=True)
        kept, want = None, None
        for step in range(4):
            x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            if step == 1 and stage == 0:
                kept = model[0].weight.grad
                want = kept.clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()], kept, want, pool.reused

    with_pool, kept, want, reused = run(True)
    without, _, _, _ = run(False)
    assert reused >= 2, "the freed grad buffer was not reused"
    assert all(torch.equal(a, b) for a, b in zip(with_pool, without))
    if stage == 0:
        assert torch.equal(kept, want), "a kept p.grad changed under the user"


class _Branchy(torch.nn.Module):
    """A param used only on even steps (no grad on odd ones) and sizes that leave padding."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(1024, 1100)
        self.b = torch.nn.Linear(1100, 8)
        self.side = torch.nn.Linear(1024, 8)

    def forward(self, x, step):
        y = self.b(self.a(x))
        return y + self.side(x) if step % 2 == 0 else y


@pytest.mark.skipif(huge_pages._LAZY is None, reason="no MADV_FREE on this platform: no pool")
@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_reused_grad_buffer_full_of_nans_changes_nothing(pool, monkeypatch, stage,
                                                           set_to_none):
    """The full grad buffer (stages 0-1) takes a pooled mapping without a memset
    (`huge_pages.maybe_zeros`): each view is written or zeroed before it is read and the padding is
    zeroed. Here every mapping the pool hands out is first filled with NaN bytes: the params,
    and every p.grad the user sees after each backward (a param with no grad on odd steps, so
    None or zeros as torch gives), must equal the run without the pool, bit for bit. A view
    or padding read unzeroed would show a NaN (the negative control below shows they do)."""
    import numpy as np

    import zerokern as zk
    from zerokern.grads.released_grad import ReleasedGrad

    take = huge_pages.LazyPool.take

    def poisoned_take(self, nbytes):
        mm = take(self, nbytes)
        if mm is not None:
            np.frombuffer(mm, dtype=np.uint8)[:] = 0xFF  # NaN in every fp32 element
        return mm

    monkeypatch.setattr(huge_pages.LazyPool, "take", poisoned_take)

    def run(use_pool: bool):
        pool.clear()
        pool.enabled = use_pool
        torch.manual_seed(0)
        model = _Branchy()
        opt = zk.ZeroAdamW(model, lr=1e-3, stage=stage, precision="fp32", backend="reference",
                           free_grads=True)
        grads = []
        for step in range(5):
            x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(step))
            model(x, step).square().mean().backward()
            # stage 1 releases p.grad after the backward (grads/released_grad.py)
            grads.append([p.grad if p.grad is None or isinstance(p.grad, ReleasedGrad)
                          else p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        return [p.detach().clone() for p in model.parameters()], grads, pool.reused

    with_pool, grads_pool, reused = run(True)
    without, grads_plain, _ = run(False)
    assert reused >= 3, "the freed grad buffer was not reused"
    assert all(torch.equal(a, b) for a, b in zip(with_pool, without))
    for step, (gp, gq) in enumerate(zip(grads_pool, grads_plain)):
        for a, b in zip(gp, gq):
            assert type(a) is type(b), step
            assert a is None or isinstance(a, ReleasedGrad) or torch.equal(a, b), step
    # negative control: the poison reaches the buffer (a raw maybe_zeros() of a pooled size is NaN)
    pool.enabled = True
    t, zero = huge_pages.maybe_zeros(1 << 21, torch.float32, "cpu", reuse=True)
    del t
    gc.collect()
    u, zero = huge_pages.maybe_zeros(1 << 21, torch.float32, "cpu", reuse=True)
    assert not zero and torch.isnan(u).all()
