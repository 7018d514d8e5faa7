"""Stage 0's comm units ([Note: stage 0 reduces in smaller units], grads/comm_units.py): on
fresh random layouts they tile each bucket exactly, are cut at param starts only, hold at most
the cap unless one param alone is larger, and `buckets_of_slot` names exactly the units a
param intersects (checked against a brute-force scan). The 20m GPT's tied embedding gets a unit
of its own (the one launched after backward ends)."""

import random

import pytest

from zerokern.grads.comm_units import UNIT_FRACTION, CommUnits, units_for
from zerokern.layout.partition import make_layout


def _check(layout, cap):
    U = CommUnits(layout, cap)
    starts = {s.offset for s in layout.slots}
    pos = 0
    for u, (lo, hi) in enumerate(U.ranges):
        k = U.bucket[u]
        blo, bhi = layout.bucket_range(k)
        assert lo == pos and blo <= lo < hi <= bhi  # contiguous, inside one bucket
        assert lo == blo or lo in starts  # cut at a bucket start or a param start
        params = layout.overlaps(lo, hi)
        if cap is not None and len(params) > 1:  # (padding counts towards the cap)
            assert hi - lo <= cap
        pos = hi
    assert pos == layout.padded_numel
    for i, s in enumerate(layout.slots):
        brute = [u for u, (lo, hi) in enumerate(U.ranges)
                 if s.numel and lo < s.offset + s.numel and hi > s.offset]
        assert list(U.buckets_of_slot(i)) == brute
    assert sum(U.per_bucket) == U.n_buckets
    return U


@pytest.mark.parametrize("seed", range(20))
def test_units_tile_buckets_at_param_starts(seed):
    rng = random.Random(seed)
    shapes = [(rng.choice([1, 3, 64, 500, 4096, 20000]),) for _ in range(rng.randint(1, 40))]
    ws = rng.choice([1, 2, 3, 4])
    bucket = ws * 128 * rng.choice([1, 8, 50, 400])
    layout = make_layout(shapes, ws, bucket)
    for cap in (None, 1, max(1, layout.bucket_numel // UNIT_FRACTION), layout.bucket_numel):
        U = _check(layout, cap)
        if cap is None:  # unsplit: the buckets themselves
            assert U.ranges == [layout.bucket_range(k) for k in range(layout.n_buckets)]


def test_units_cap_is_respected_between_params():
    layout = make_layout([(10,)] * 10, 1, 128)  # one bucket of 128 (100 + padding)
    U = CommUnits(layout, 30)
    # filled from the top: the last param and the padding (38 > 30: one param), then 30 each
    assert U.ranges == [(0, 30), (30, 60), (60, 90), (90, 128)]
    # 48 with the padding fits 50; the next param would not
    assert CommUnits(layout, 50).ranges == [(0, 30), (30, 80), (80, 128)]


def test_gpt_tied_embedding_unit():
    from zerokern.gpt import build_gpt
    from zerokern.layout.partition import bucket_numel_for

    m = build_gpt("20m")
    params = list(m.parameters())  # the tied head is the embedding: stored once
    layout = make_layout([p.shape for p in params], 2, bucket_numel_for(25 * 2**20, 4, 2))

    class G:
        pass
    g = G()
    g.layout = layout
    (U,) = units_for([g], split=True)
    tok = layout.slots[0]
    assert (tok.offset, tok.offset + tok.numel) in U.ranges  # the embedding alone
    assert U.n_buckets > layout.n_buckets
