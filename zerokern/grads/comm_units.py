"""Communication units: the sub-ranges of a buffer that are reduced one collective each.

A unit lies inside one layout bucket (a landing completes part of one bucket). Where the
collective does not care where a bucket is cut (stage 0's all-reduce), a bucket is split into
several units at param boundaries; where it does (a reduce-scatter hands rank r its piece of the
bucket), the units are the buckets.

[Note: stage 0 reduces in smaller units]
A bucket is all-reduced once its last grad is in. On the 20m GPT (4 layout buckets of 25 MiB at
bucket_mb=25, fp32, 2 ranks) the tied embedding `tok.weight` lies in bucket 0 and its grad
arrives last (the head's use and the lookup's both accumulate into it), so all of bucket 0
(26.2 MB) was all-reduced after backward's last grad hook, the main thread waiting for it at the
end of backward. DDP buckets in arrival order after its first iteration, so its last all-reduce
holds that embedding and what arrived just before it. Stage 0 now splits each bucket into units
of at most 1/UNIT_FRACTION of it, cut at param boundaries from the bucket's end (grads arrive
in reverse order): the embedding is a unit of its own (16.8 MB launched after the last hook,
benchmarks/step_profile.py `tail`), the rest is reduced while backward runs. Same bytes, more
calls (18 all-reduces per step instead of 4 on the 20m GPT). Measured with
benchmarks/step_paired_ab.py (both sides in one pair of ranks, iterations alternated, the
unsplit schedule restored on one side; the median of B/A over 16-24 pairs): split by 4 against
unsplit 0.923, 0.940, 0.946, then (load average 4-5) 0.989, 1.027, 0.986, 0.922: median 0.946;
by 2 against by 4 1.008, 0.991 (the same); by 4 against by 8 0.978; by 4 against itself (A/A:
the noise) 1.003, 1.004. The gain needs spare CPU at the end of backward (the tail's transfer
is what the main thread waited for), so it shrinks on a loaded machine. The params stay
bit-equal (2 ranks).
"""

from __future__ import annotations

import bisect
from typing import List, Optional, Tuple

# A stage-0 unit holds at most 1/UNIT_FRACTION of its layout bucket (cut at param boundaries;
# a param larger than that is one unit). 4: see the Note above for the measured choice.
UNIT_FRACTION = 4


class CommUnits:
    """A layout's buckets cut into units (the Schedule's launch items); the same interface as
    the layout where the Schedule reads it (`n_buckets`, `bucket_range`, `overlaps`,
    `buckets_of_slot`, `numel`), `bucket[u]` the layout bucket unit u lies in.

    Args:
        layout: the group's FlatLayout.
        cap: at most this many elements per unit (cut at param boundaries); None: one unit per
            bucket.
    """

    def __init__(self, layout, cap: Optional[int] = None) -> None:
        self.layout = layout
        self.numel = layout.numel
        self.ranges: List[Tuple[int, int]] = []
        self.bucket: List[int] = []
        for k in range(layout.n_buckets):
            lo, hi = layout.bucket_range(k)
            cuts = _cuts(layout, lo, hi, cap) if cap else [(lo, hi)]
            self.ranges += cuts
            self.bucket += [k] * len(cuts)
        self._starts = [lo for lo, _ in self.ranges]
        self.per_bucket = [self.bucket.count(k) for k in range(layout.n_buckets)]

    @property
    def n_buckets(self) -> int:
        return len(self.ranges)

    def bucket_range(self, u: int) -> Tuple[int, int]:
        return self.ranges[u]

    def overlaps(self, lo: int, hi: int):
        return self.layout.overlaps(lo, hi)

    def buckets_of_slot(self, i: int) -> range:
        s = self.layout.slots[i]
        if s.numel == 0:
            return range(0)
        first = bisect.bisect_right(self._starts, s.offset) - 1
        last = bisect.bisect_right(self._starts, s.offset + s.numel - 1) - 1
        return range(first, last + 1)


def _cuts(layout, lo: int, hi: int, cap: int) -> List[Tuple[int, int]]:
    """[lo, hi) cut at param starts into ranges of at most `cap` elements where the params
    allow (a larger param is one range), filled from hi down; ascending."""
    out, end, holds = [], hi, False  # the unit being filled: [its lowest param's start, end)
    start = hi
    for _, a, _b in reversed(layout.overlaps(lo, hi)):
        if holds and end - a > cap:  # the param does not fit: the unit ends above it
            out.append((start, end))
            end = start
        start, holds = a, True
    out.append((lo, end))
    return out[::-1]


def units_for(groups, split: bool) -> List[CommUnits]:
    """Each group's units: stage 0's split ([Note: stage 0 reduces in smaller units]), or the
    layout buckets."""
    return [CommUnits(g.layout, max(1, g.layout.bucket_numel // UNIT_FRACTION) if split else None)
            for g in groups]
