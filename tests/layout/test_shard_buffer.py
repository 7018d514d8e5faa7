"""ShardBuffer and StagePattern (issue 15): the coordinates every stage shares, in one process.

- the state slices of a buffer's buckets tile [0, state_numel) exactly, each as long as its
  flat state range, and the padding counted is the padding in those ranges;
- `fill_master_` in any chunking (offload="nvme" streams the master 16 MiB at a time) writes
  exactly what the on-device master holds, bitwise;
- stage 3's one-bucket layout uses partition.ALIGN like the others;
- block-aligned slots (slot_align=128, a per-block rule's: partition.py [Note: block-aligned
  slots]): every param starts at a multiple of 128, the gaps count as padding everywhere
  (`pad_in`, `pad_ranges`, `padding`, the state padding) against a brute-force oracle, and
  `zero_padding_` zeros exactly the padding of a grad staging range.
Odd sizes (1, 127, 4097) and tiny buckets so that pieces straddle params and padding exists.
"""

from __future__ import annotations

import pytest
import torch

from zerokern.geometry.partition import ALIGN, make_layout
from zerokern.layout.flat_group import FlatGroup
from zerokern.layout.stages import pattern
from zerokern.stage3 import ShardedFlat
from zerokern.state.placement import DeviceState

SHAPES = [(1,), (127,), (4097,), (33, 5)]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _buffers(ws, rank, align=1):
    for stage in (0, 1, 2):
        yield FlatGroup(_params(), torch.bfloat16, ws, rank, stage, bucket_bytes=3000,
                        slot_align=align)
    yield ShardedFlat(_params(), torch.bfloat16, ws, rank, 0, 0, slot_align=align)


def _is_pad(L):
    """Brute force: flat index -> not an element of any param."""
    real = set()
    for s in L.slots:
        real.update(range(s.offset, s.offset + s.numel))
    return [j not in real for j in range(L.padded_numel)]


@pytest.mark.parametrize("align", [1, 128])
@pytest.mark.parametrize("ws", [1, 3])
def test_state_slices_tile_the_state(ws, align):
    for rank in range(ws):
        for b in _buffers(ws, rank, align):
            L, pos, pad = b.layout, 0, 0
            is_pad = _is_pad(L)
            for k in range(L.n_buckets):
                lo, hi = b.state_range(k)
                sl = b.state_slice(k)
                assert sl.start == pos and sl.stop - sl.start == hi - lo, (b.stage, k)
                pos = sl.stop
                pad += sum(is_pad[lo:hi])
            assert pos == b.state_numel == b.master.numel(), b.stage
            assert pad == b.state_padding, b.stage
            expect = L.padded_numel if b.pattern.replicated_state else L.shard_numel
            assert b.state_numel == expect


class _Probe:
    """A placement that, while the buffer is built (the params still hold their original
    values, as for offload="nvme"), fills the master chunk by chunk beside the device one."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk

    def allocate(self, buf) -> DeviceState:
        st = DeviceState(buf)
        got = torch.full((buf.state_numel,), float("nan"))
        bad = torch.zeros(buf.state_numel)  # negative control: each chunk one element off
        for lo in range(0, buf.state_numel, self.chunk):
            part = torch.zeros(min(self.chunk, buf.state_numel - lo))
            buf.fill_master_(part, lo)
            got[lo:lo + part.numel()] = part
            buf.fill_master_(bad[lo:lo + part.numel()], lo + 1)
        self.got, self.bad, self.ref = got, bad, st.master
        return st


@pytest.mark.parametrize("ws", [1, 3])
@pytest.mark.parametrize("chunk", [1, 100, 1024])
def test_chunked_master_fill_equals_the_device_master(ws, chunk):
    for rank in range(ws):
        for stage in (0, 1, 2, 3):
            probe = _Probe(chunk)
            if stage == 3:
                ShardedFlat(_params(), torch.bfloat16, ws, rank, 0, 0, placement=probe)
            else:
                FlatGroup(_params(), torch.bfloat16, ws, rank, stage, bucket_bytes=3000,
                          placement=probe)
            assert torch.equal(probe.got, probe.ref), (stage, rank)
            assert probe.ref.abs().sum() > 0  # random values, not zeros
            assert not torch.equal(probe.bad, probe.ref)  # the check can fail


@pytest.mark.parametrize("ws", [1, 3])
def test_block_aligned_slots(ws):
    L0 = make_layout(SHAPES, ws, 2 * ws * ALIGN)
    L = make_layout(SHAPES, ws, 2 * ws * ALIGN, slot_align=128)
    assert [s.offset for s in L0.slots] == [0, 1, 128, 4225]  # packed
    assert [s.offset for s in L.slots] == [0, 128, 256, 4480]  # each on a block boundary
    assert L.numel == L0.numel == sum(s.numel for s in L.slots)  # the params' elements only
    pad = _is_pad(L)
    assert L.padding == sum(pad) == L.padded_numel - L.numel
    assert L.end == 4480 + 165
    for lo, hi in [(0, L.padded_numel), (1, 200), (127, 129), (250, 4400), (4400, 4700)]:
        assert L.pad_in(lo, hi) == sum(pad[lo:hi]), (lo, hi)
        got = [j for a, b in L.pad_ranges(lo, hi) for j in range(a, b)]
        assert got == [j for j in range(lo, hi) if pad[j]], (lo, hi)
        for lay in (L0,):  # packed: the tail only, as before
            assert lay.pad_in(lo, hi) == max(0, hi - max(lo, lay.numel))
    with pytest.raises(ValueError, match="slot_align"):
        make_layout(SHAPES, ws, 2 * ws * ALIGN, slot_align=3)


@pytest.mark.parametrize("align", [1, 128])
def test_zero_padding_zeros_the_gaps_and_the_tail(align):
    """A pooled grad staging buffer holds stale values: zero_padding_ clears exactly the
    padding of the range it stages (the params' regions get their grads)."""
    for b in _buffers(2, 1, align):
        L = b.layout
        pad = torch.tensor(_is_pad(L))
        for k in range(L.n_buckets):
            lo, hi = L.bucket_range(k)
            view = torch.full((hi - lo,), 7.0)
            b.zero_padding_(view, lo)
            assert torch.equal(view == 0, pad[lo:hi]), (b.stage, k)


def test_patterns():
    assert [pattern(s).publishes for s in range(4)] == [False, True, True, False]
    assert [pattern(s).shards_grads for s in range(4)] == [False, False, True, True]
    with pytest.raises(ValueError, match="stage must be one of"):
        pattern(4)
    # stage 3's single bucket is padded to world_size * ALIGN, as every other buffer
    f = ShardedFlat([torch.nn.Parameter(torch.randn(5))], torch.float32, 3, 0, 0, 0)
    assert f.layout.padded_numel == 3 * ALIGN and f.layout.n_buckets == 1
