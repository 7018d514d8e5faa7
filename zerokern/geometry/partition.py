"""Flat-buffer layout: where each param lives, and which slice each rank owns (DESIGN §2).

[Note: bucket-major layout]
DESIGN §2 proposes one shard per rank, `[r·S, (r+1)·S)`. Reduce-scattering that during backward
needs every rank's slice of a bucket to be ready together, but those slices hold params from
opposite ends of the model, whose grads arrive far apart: nothing could be sent until backward
ends. So the flat buffer is cut into buckets of consecutive params (the order grads arrive in),
and each bucket is split evenly across ranks:

    flat:   | bucket 0                 | bucket 1                 | ... | last (padded) |
            | r0 piece | r1 piece | .. | r0 piece | r1 piece | .. |
    rank r's shard = its piece of every bucket, stored contiguously in the shard buffers
    (the master, the optimizer rule's states, the grad shard), bucket k at `shard_offset(k)`.

A bucket then reduce-scatters and all-gathers with one collective each, as soon as its params'
grads are in. With a single bucket this is exactly the DESIGN layout. Bucket sizes are multiples
of `world_size × ALIGN`, so every piece starts 16-byte aligned (128-bit loads) and only the last
bucket carries padding at its tail, less than `world_size × ALIGN` elements.

[Note: block-aligned slots]
A rule with per-block states (8-bit AdamW: one fp32 absmax per 128 elements, zerokern.rules
[Note: per-element and per-block states]) lays its buffers out with `slot_align` = its block
(`rules.slot_align`, decided once per param group from the group's rule by FlatGroup and
ShardedFlat): every param's slot starts at a multiple of the block, so every block holds the
elements of one param only (and zeros). Packed back to back, a block would be shared with the
neighbouring params: skipping a param that no rank used (frozen_slots.py) could not leave its
codes and absmax as they were once a neighbour's update changed the block's scale, and the
blocks would depend on which params share a buffer (stage 3's per-unit buffers against stages
0-2's per-group ones), so a checkpoint moved between them re-quantized the shared blocks. With
aligned slots a param's blocks are the same in every buffer, stage and world size, and are the
blocks of a per-param blockwise quantization (bitsandbytes' AdamW8bit blocks each param from
its first element). Cost: a gap of less than `slot_align` zero elements after each param
(< 128 x 6.06 bytes of state per param for 8-bit AdamW, plus the gap's 16-bit param and grad;
a 7B model's ~300 params: < 39k elements). Gaps are padding like the tail: `numel` still
counts the params' elements only, `padding`, `pad_in` and `pad_ranges` count the gaps too,
and whatever writes padding (the grad staging buffers) zeros them; the update keeps them zero
(zero grad, zero master and moments, as the tail). Without per-block states `slot_align` is 1
and there are no gaps.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property
from typing import List, Sequence, Tuple

# 128 elements: 256 B for 16-bit, 512 B for fp32; every piece start is 16-byte aligned.
ALIGN = 128


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class Slot:
    """One param in the flat buffer: elements [offset, offset + numel)."""

    offset: int
    numel: int
    shape: Tuple[int, ...]


@dataclass(frozen=True)
class FlatLayout:
    """Layout of one param group's flat buffer over `world_size` ranks."""

    slots: Tuple[Slot, ...]
    numel: int                 # sum of param numels, unpadded
    world_size: int
    bucket_numel: int          # full bucket size; a multiple of world_size * ALIGN
    padded_numel: int          # a multiple of world_size * ALIGN
    slot_align: int = 1        # every slot starts at a multiple (Note: block-aligned slots)

    @property
    def end(self) -> int:
        """Where the tail padding starts: the end of the last param (= numel without gaps)."""
        return self.slots[-1].offset + self.slots[-1].numel if self.slots else 0

    @cached_property
    def _starts(self) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """(slot offsets, param elements before each slot): the slots are in flat order."""
        before, n = [], 0
        for s in self.slots:
            before.append(n)
            n += s.numel
        return tuple(s.offset for s in self.slots), tuple(before)

    def _real_before(self, x: int) -> int:
        """Param elements at flat index < x."""
        offs, before = self._starts
        i = bisect.bisect_right(offs, x) - 1
        if i < 0:
            return 0
        s = self.slots[i]
        return before[i] + min(max(x - s.offset, 0), s.numel)

    @property
    def n_buckets(self) -> int:
        return -(-self.padded_numel // self.bucket_numel)

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def bucket_range(self, k: int) -> Tuple[int, int]:
        lo = k * self.bucket_numel
        return lo, min(lo + self.bucket_numel, self.padded_numel)

    def piece_numel(self, k: int) -> int:
        lo, hi = self.bucket_range(k)
        return (hi - lo) // self.world_size

    def piece_range(self, k: int, rank: int) -> Tuple[int, int]:
        """Flat coordinates of rank's piece of bucket k."""
        lo = self.bucket_range(k)[0] + rank * self.piece_numel(k)
        return lo, lo + self.piece_numel(k)

    def shard_offset(self, k: int) -> int:
        """Where bucket k's piece starts in a rank's contiguous shard buffers."""
        return k * (self.bucket_numel // self.world_size)

    def bucket_of(self, flat_index: int) -> int:
        return flat_index // self.bucket_numel

    def overlaps(self, lo: int, hi: int) -> List[Tuple[int, int, int]]:
        """Params intersecting flat range [lo, hi): (slot index, start, end) in flat coords."""
        out = []
        offs = self._starts[0]
        for i in range(max(bisect.bisect_right(offs, lo) - 1, 0), len(self.slots)):
            s = self.slots[i]
            if s.offset >= hi:
                break
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append((i, a, b))
        return out

    def pad_in(self, lo: int, hi: int) -> int:
        """Padding elements (the tail, and the gaps between block-aligned slots) inside flat
        range [lo, hi)."""
        if self.slot_align == 1:  # packed: padding only at the tail
            return max(0, hi - max(lo, self.end))
        return (hi - lo) - (self._real_before(hi) - self._real_before(lo))

    def pad_ranges(self, lo: int, hi: int) -> List[Tuple[int, int]]:
        """The padding inside flat range [lo, hi) as [a, b) flat ranges, in order (the gaps
        after block-aligned slots, then the tail; Note: block-aligned slots)."""
        out, x = [], lo
        for _, a, b in (self.overlaps(lo, hi) if self.slot_align != 1 else
                        [(None, lo, min(hi, self.end))] if lo < self.end else []):
            if x < a:
                out.append((x, a))
            x = max(x, b)
        if x < hi:
            out.append((x, hi))
        return out

    # -- the optimizer state a rank holds: `replicated` (stage 0) holds every bucket whole,
    # -- otherwise rank r holds its piece of each bucket, contiguously (Note: bucket-major)
    def state_range(self, k: int, rank: int, replicated: bool) -> Tuple[int, int]:
        """Flat coordinates of the elements whose state `rank` holds for bucket k."""
        return self.bucket_range(k) if replicated else self.piece_range(k, rank)

    def state_offset(self, k: int, replicated: bool) -> int:
        """Where bucket k's state starts in the state buffers (the master and rule states)."""
        return self.bucket_range(k)[0] if replicated else self.shard_offset(k)

    def state_numel(self, replicated: bool) -> int:
        return self.padded_numel if replicated else self.shard_numel

    def state_padding(self, rank: int, replicated: bool) -> int:
        """Padding elements among the state `rank` holds."""
        return sum(self.pad_in(*self.state_range(k, rank, replicated))
                   for k in range(self.n_buckets))

    def buckets_of_slot(self, i: int) -> range:
        s = self.slots[i]
        if s.numel == 0:
            return range(0)
        return range(self.bucket_of(s.offset), self.bucket_of(s.offset + s.numel - 1) + 1)


def bucket_numel_for(bucket_bytes: float, elem_size: int, world_size: int) -> int:
    """Largest multiple of world_size*ALIGN elements within bucket_bytes (at least one unit)."""
    unit = world_size * ALIGN
    return max(unit, int(bucket_bytes // elem_size) // unit * unit)


def one_bucket_numel(numel: int, world_size: int) -> int:
    """A bucket holding all `numel` elements (stage 3: one bucket per unit buffer)."""
    unit = world_size * ALIGN
    return max(round_up(max(numel, 1), unit), unit)


def make_layout(shapes: Sequence[Tuple[int, ...]], world_size: int,
                bucket_numel: int, slot_align: int = 1) -> FlatLayout:
    """Pack params in the given order, each starting at a multiple of slot_align (1: back to
    back; Note: block-aligned slots), pad the tail to world_size*ALIGN."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    unit = world_size * ALIGN
    if bucket_numel < unit or bucket_numel % unit:
        raise ValueError(f"bucket_numel must be a positive multiple of {unit}, got {bucket_numel}")
    if not isinstance(slot_align, int) or slot_align < 1 or ALIGN % slot_align:
        raise ValueError(f"slot_align must divide {ALIGN}, got {slot_align!r}")
    slots, off, total = [], 0, 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        off = round_up(off, slot_align)
        slots.append(Slot(off, n, tuple(shape)))
        off += n
        total += n
    padded = max(round_up(off, unit), unit)
    return FlatLayout(tuple(slots), total, world_size, min(bucket_numel, padded), padded,
                      slot_align)
