"""Muon's orthogonalization over flat shards (zerokern/orthogonalize.py) against torch.optim.Muon.

Every matrix's Newton-Schulz result, assembled from the pieces every rank holds after the
exchange, must be bitwise torch's `_zeropower_via_newtonschulz` of the whole matrix (the same
bf16 ops on the same bits). Layouts: tiny buckets so matrices straddle buckets and rank pieces,
5 matrices (uneven over 2 and 3 ranks), a conv-shaped 4-D weight and 1-D params left alone;
sharded (stages 1-3) and replicated (stage 0). Negative control: one Newton-Schulz step fewer
on the owner is caught.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.optim._muon import _zeropower_via_newtonschulz

from zerokern.geometry.partition import ALIGN, make_layout
from zerokern.rules.muon_orthogonalize import (
    ShardedOrthogonalizer,
    adjusted_lr,
    assign_owners,
    newton_schulz,
)

from ..support.harness import cached, case, run_cases

# Matrices (and two 1-D params that are not orthogonalized) with uneven sizes; bucket of
# 2 * world_size * ALIGN elements so most matrices cross a bucket and a rank boundary.
SHAPES = [(40, 24), (7,), (96, 33), (3, 5, 2, 2), (17,), (130, 8), (12, 70)]
MATRICES = [0, 2, 3, 5, 6]
NS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)


def _state_of(layout, rank, replicated, flat):
    """This rank's state buffer for a full flat vector (the layout's state pieces)."""
    st = torch.zeros(layout.state_numel(replicated))
    for k in range(layout.n_buckets):
        lo, hi = layout.state_range(k, rank, replicated)
        at = layout.state_offset(k, replicated)
        st[at:at + hi - lo] = flat[lo:hi]
    return st


def _flat_of(layout, states, replicated):
    """Reassemble the full flat vector from every rank's state (checks holders agree)."""
    flat = torch.full((layout.padded_numel,), float("nan"))
    for r, st in enumerate(states):
        for k in range(layout.n_buckets):
            lo, hi = layout.state_range(k, r, replicated)
            at = layout.state_offset(k, replicated)
            piece = st[at:at + hi - lo]
            if replicated and r > 0:
                assert torch.equal(flat[lo:hi].nan_to_num(0), piece.nan_to_num(0)), \
                    "replicas disagree"
            flat[lo:hi] = piece
    return flat


def _worker(rank, world_size):
    torch.manual_seed(1234)  # the same data on every rank: the full flat update
    cases = {}
    for replicated in (False, True):
        for drop_step in (False, True):
            layout = make_layout(SHAPES, world_size, 2 * world_size * ALIGN)
            flat = torch.randn(layout.padded_numel)
            steps = NS[1] - 1 if (drop_step and rank == 0) else NS[1]
            orth = ShardedOrthogonalizer(layout, rank, world_size, replicated, MATRICES,
                                         dist.group.WORLD if world_size > 1 else None,
                                         NS[0], steps, NS[2])
            state = _state_of(layout, rank, replicated, flat)
            orth.orthogonalize_(state)
            cases[f"{replicated}-{drop_step}"] = (
                lambda s=state, f=flat, o=orth: (s, f, o.owner, o.bytes_sent))
    return run_cases(cases)


@pytest.mark.parametrize("ws", [1, 2, 3])
@pytest.mark.parametrize("replicated", [False, True])
def test_each_matrix_is_torchs_newton_schulz(ws, replicated):
    res = case(cached(_worker, ws), f"{replicated}-False")
    layout = make_layout(SHAPES, ws, 2 * ws * ALIGN)
    flat_in = res[0][1]
    got = _flat_of(layout, [r[0] for r in res], replicated)
    for i, shape in enumerate(SHAPES):
        s = layout.slots[i]
        before = flat_in[s.offset:s.offset + s.numel]
        after = got[s.offset:s.offset + s.numel]
        if i in MATRICES:
            mat = before.view(shape[0], -1)
            want = _zeropower_via_newtonschulz(mat, *NS).float().reshape(-1)
            assert torch.equal(after, want), f"matrix {i} {shape} differs from torch's"
        else:
            assert torch.equal(after, before), f"1-D param {i} was changed"
    owners = res[0][2]
    assert all(r[2] == owners for r in res)
    if ws > 1:  # the work is spread: every rank owns a matrix (5 matrices, <= 3 ranks)
        assert set(owners.values()) == set(range(ws))
    if ws > 1 and not replicated:
        assert all(r[3] > 0 for r in res)


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_negative_control_a_dropped_newton_schulz_step_is_caught(ws):
    res = case(cached(_worker, ws), "False-True")
    layout = make_layout(SHAPES, ws, 2 * ws * ALIGN)
    got = _flat_of(layout, [r[0] for r in res], False)
    flat_in = res[0][1]
    owners = res[0][2]
    differs = []
    for i in MATRICES:
        s = layout.slots[i]
        want = _zeropower_via_newtonschulz(
            flat_in[s.offset:s.offset + s.numel].view(SHAPES[i][0], -1), *NS).float().reshape(-1)
        differs.append(not torch.equal(got[s.offset:s.offset + s.numel], want))
    # exactly rank 0's matrices are wrong: the check sees a dropped step
    assert differs == [owners[i] == 0 for i in MATRICES]


def test_newton_schulz_is_torchs_bitwise():
    torch.manual_seed(0)
    for shape in [(16, 16), (40, 9), (9, 40), (1, 7)]:
        g = torch.randn(shape)
        assert torch.equal(newton_schulz(g), _zeropower_via_newtonschulz(g, *NS))
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.randn(3))
    with pytest.raises(ValueError, match="ns_steps"):
        newton_schulz(torch.randn(3, 3), steps=100)


def test_adjusted_lr_matches_torch():
    from torch.optim._muon import _adjust_lr
    for fn in (None, "original", "match_rms_adamw"):
        for shape in [(64, 16), (16, 64), (32, 32)]:
            assert adjusted_lr(0.02, fn, shape) == _adjust_lr(0.02, fn, torch.Size(shape))
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        adjusted_lr(0.02, "bogus", (2, 2))


def test_owners_balance_flops_and_are_deterministic():
    shapes = [(1024, 1024)] + [(256, 256)] * 8
    owners = assign_owners(shapes, 2)
    assert owners == assign_owners(shapes, 2)
    assert owners[0] == 0 and all(o == 1 for o in owners[1:])  # 1 big = 8 small (m³ terms)
    assert assign_owners([(4, 4)] * 5, 3) == [0, 1, 2, 0, 1]


def test_a_1d_slot_is_refused():
    layout = make_layout(SHAPES, 1, ALIGN)
    with pytest.raises(ValueError, match="not a matrix"):
        ShardedOrthogonalizer(layout, 0, 1, False, [1])
