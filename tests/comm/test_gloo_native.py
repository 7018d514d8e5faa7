"""gloo's own reduce-scatter / all-gather (ZEROKERN_GLOO_RING=0) still give the same training as
the default send/recv rings: stages 1 and 2 equal to fp32 rounding (the sums run in another
order) across the two paths, at N = 2 and 3
(uneven), and the ring path really is the one in use by default."""

import os

import pytest
import torch

from ..support import models as M
from ..support.harness import spawn


def _train(rank, ws, ring: str):
    os.environ["ZEROKERN_GLOO_RING"] = ring  # read when the optimizer builds its Comm
    out = {}
    for stage in (1, 2):
        model = M.make_model()
        opt = M.zero_opt(model, stage)
        out[f"uses_ring_{stage}"] = opt.comm.shard.ring is not None
        out[stage] = M.train_zero(model, opt, rank, ws, 3)["params"][-1]
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_native_gloo_matches_rings(ws):
    ring = spawn(_train, ws, "1")
    native = spawn(_train, ws, "0")
    for r in range(ws):
        assert ring[r]["uses_ring_1"] and ring[r]["uses_ring_2"]
        assert not native[r]["uses_ring_1"] and not native[r]["uses_ring_2"]
        for stage in (1, 2):
            for name, t in ring[r][stage].items():
                # Same sums in a different order across ranks: equal to fp32 rounding.
                torch.testing.assert_close(t, native[r][stage][name], rtol=1e-6, atol=1e-7,
                                           msg=f"rank {r} stage {stage} {name}")
