"""Communication units: the sub-ranges of a buffer that are reduced one collective each.

A unit lies inside one layout bucket (a landing completes part of one bucket). Where the
collective does not care where a bucket is cut (stage 0's all-reduce), a bucket is split into
several units at param boundaries; where it does (a reduce-scatter hands rank r its piece of the
bucket), the units are the buckets.

[Note: stage 0 reduces in smaller units]
A bucket is all-reduced once its last grad is in. On the 20m GPT (2 layout buckets of 50 MiB at
bucket_mb=25, fp32) the tied embedding `tok.weight` lies in bucket 0 and its grad arrives last
(the head's use and the lookup's both accumulate into it), so the whole of bucket 0 was
all-reduced after backward had ended: the main thread waited 47 ms per iteration at the end of
backward (benchmarks/step_profile.py, 2 gloo ranks, 3 iterations) against 15 ms at stage 2. DDP
buckets by `bucket_cap_mb` of grads (25 MiB: half our bucket) and rebuilds them in arrival
order, so its last all-reduce holds little more than that embedding. Stage 0 now splits each
bucket into units of at most UNIT_FRACTION of it, cut at param boundaries from the bucket's end
(grads arrive in reverse order): the units without the embedding are reduced while backward runs
and only the embedding's unit waits for the end. Same bytes, more calls (comm_stats counts them).
"""

from __future__ import annotations

import bisect
from typing import List, Optional, Tuple

# A stage-0 unit holds at most this fraction of its layout bucket (cut at param boundaries; a
# param larger than that is one unit). See the Note above for the measured waits.
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
