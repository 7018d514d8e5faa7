"""The gloo ring's all-gather (comm/ring.py, through GroupComm.all_gather_): from an input apart
from out (stage 3's shard) and in place (stages 1-2), at N = 2 and 3, equal
to every rank's seeded input laid side by side, exactly (a gather is a copy).

The gloo ring's reduce-scatter ([Note: the ring's last step lands in out], comm/ring.py) against
an independent reference: every rank's input is rebuilt from its seed and summed in float64.
Out apart from the input (stages 2-3: the last step lands in out), out as the input's own chunk
(stage 1: in place), and an out of another dtype (copied at the end), at N = 2 and 3; over 2
ranks out = recv + ours is the same bits as ours + recv (IEEE addition commutes), so it equals
the fp32 sum of the two inputs exactly. A negative control: a reference missing one rank's
input is far off."""

import pytest
import torch

from zerokern.comm import GroupComm

from ..support.harness import cached

PER = 1000  # elements per rank's chunk (not a multiple of anything in particular)


def _inp(rank: int, ws: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(ws * PER, generator=g)


def _ring(rank, ws):
    comm = GroupComm()
    assert comm.ring is not None  # gloo, CPU: the ring path
    out = {}
    # apart: a fresh output
    o = torch.full((PER,), float("nan"))
    comm.reduce_scatter_(o, _inp(rank, ws))
    out["apart"] = o
    # apart, the second call: reuses nothing stale
    o2 = torch.full((PER,), float("nan"))
    comm.reduce_scatter_(o2, _inp(rank, ws) * 2)
    out["apart_again"] = o2
    # in place: out is the input's own chunk
    w = _inp(rank, ws)
    comm.reduce_scatter_(w[rank * PER:(rank + 1) * PER], w)
    out["in_place"] = w[rank * PER:(rank + 1) * PER].clone()
    # out inside a larger buffer that is not the input
    big = torch.full((3 * PER,), float("nan"))
    comm.reduce_scatter_(big[PER:2 * PER], _inp(rank, ws))
    out["apart_view"] = big.clone()
    # out of another dtype: the last step cannot land in it; reduced in the input, copied
    o64 = torch.full((PER,), float("nan"), dtype=torch.float64)
    comm.reduce_scatter_(o64, _inp(rank, ws))
    out["other_dtype"] = o64
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_ring_reduce_scatter_matches_float64_sum(ws):
    res = cached(_ring, ws)
    full = sum(_inp(r, ws).double() for r in range(ws))
    missing = sum(_inp(r, ws).double() for r in range(ws - 1))
    for r in range(ws):
        ref = full[r * PER:(r + 1) * PER]
        for name in ("apart", "in_place", "other_dtype"):
            got = res[r][name]
            torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6,
                                       msg=f"rank {r} {name}")
            assert not torch.allclose(got.double(), missing[r * PER:(r + 1) * PER],
                                      rtol=1e-3, atol=1e-3)  # negative control
        torch.testing.assert_close(res[r]["apart_again"].double(), 2 * ref, rtol=1e-6,
                                   atol=1e-6)
        big = res[r]["apart_view"]
        torch.testing.assert_close(big[PER:2 * PER].double(), ref, rtol=1e-6, atol=1e-6)
        assert big[:PER].isnan().all() and big[2 * PER:].isnan().all()  # nothing else written
        if ws == 2:  # one fp32 add: the same bits on every path
            exact = (_inp(0, 2) + _inp(1, 2))[r * PER:(r + 1) * PER]
            assert torch.equal(res[r]["apart"], exact)
            assert torch.equal(res[r]["in_place"], exact)


def _gather(rank, ws):
    comm = GroupComm()
    out = {}
    full = torch.full((ws * PER,), float("nan"))
    shard = _inp(rank, ws)[:PER].clone()
    h = comm.all_gather_(full, shard, async_op=True)
    h.wait()
    out["apart"] = full
    out["shard_after"] = shard
    inplace = torch.full((ws * PER,), float("nan"))
    inplace[rank * PER:(rank + 1) * PER] = _inp(rank, ws)[:PER]
    comm.all_gather_(inplace, inplace[rank * PER:(rank + 1) * PER])
    out["in_place"] = inplace
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_ring_all_gather_from_apart_and_in_place(ws):
    res = cached(_gather, ws)
    ref = torch.cat([_inp(r, ws)[:PER] for r in range(ws)])
    for r in range(ws):
        assert torch.equal(res[r]["apart"], ref), r
        assert torch.equal(res[r]["in_place"], ref), r
        assert torch.equal(res[r]["shard_after"], _inp(r, ws)[:PER])  # the input untouched
    wrong = ref.clone()
    wrong[:PER] = _inp(1, ws)[:PER]  # negative control: another rank's piece in chunk 0
    assert not torch.equal(res[0]["apart"], wrong)
