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
bucket carries padding, less than `world_size × ALIGN` elements.
"""

from __future__ import annotations

from dataclasses import dataclass
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
        for i, s in enumerate(self.slots):
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append((i, a, b))
        return out

    def pad_in(self, lo: int, hi: int) -> int:
        """Padding elements (index >= numel) inside flat range [lo, hi)."""
        return max(0, hi - max(lo, self.numel))

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
                bucket_numel: int) -> FlatLayout:
    """Pack params back to back in the given order, pad the tail to world_size*ALIGN."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    unit = world_size * ALIGN
    if bucket_numel < unit or bucket_numel % unit:
        raise ValueError(f"bucket_numel must be a positive multiple of {unit}, got {bucket_numel}")
    slots, off = [], 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        slots.append(Slot(off, n, tuple(shape)))
        off += n
    padded = max(round_up(off, unit), unit)
    return FlatLayout(tuple(slots), off, world_size, min(bucket_numel, padded), padded)
