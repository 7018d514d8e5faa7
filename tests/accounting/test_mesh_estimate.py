"""`zerokern.accounting.estimate(mesh=, hpz=)` / `zerokern estimate --mesh RxS [--hpz]` against
what memory_report() measures on a 2x2 (replicate, shard) mesh of 4 gloo ranks.

Each rank trains the tiny LM of models.py two steps (one param group, tiny buckets so params
straddle buckets), at HSDP stages 0-3 and hpZ at stage 3, bf16 and fp32; its
memory_report()["measured"] (every category, hpz_secondary included), live_units_bound and
formula_total equal the estimate for (mesh (2, 2), hpz, that rank) to the byte.
Negative controls: the flat 4-rank estimate misses the HSDP measurement (the shard is over 2
ranks, not 4), and the hpZ measurement without its secondary copy misses the hpZ estimate.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import zerokern as zk
from zerokern.accounting import estimate as E

from ..support import models as M
from ..support.harness import cached, case, run_cases

WS, MESH = 4, (2, 2)
CASES = [(s, p, False) for s in (0, 1, 2, 3) for p in ("bf16", "fp32")] + \
    [(3, p, True) for p in ("bf16", "fp32")]


def _one(rank, mesh, stage, precision, hpz):
    torch.manual_seed(3)
    model = M.make_model()
    opt = zk.ZeroAdamW(model, stage=stage, precision=precision, bucket_mb=M.BUCKET_MB,
                       backend=M.BACKEND, mesh=mesh, hpz=hpz)
    for step in range(2):
        opt.zero_grad()
        opt.comm_stats(reset=True)  # the last step's traffic only
        opt.backward(M.loss_fn(model, M.rank_tokens(step, rank, WS)))
        opt.step()
    rep = opt.memory_report()
    comm = opt.comm_stats()
    padded = sum(g.layout.padded_numel for g in opt.flat_groups)
    with torch.device("meta"):
        spec = E.spec_from_model(M.make_model(), "tiny-lm")
    est = E.estimate(spec, WS, stage, precision, M.BUCKET_MB, rank=rank, comm="gloo",
                     mesh=MESH, hpz=hpz)
    flat = E.estimate(spec, WS, stage, precision, M.BUCKET_MB, rank=rank, comm="gloo")
    return {"measured": rep["measured"], "est": est["bytes"],
            "bound": (rep.get("live_units_bound"), est["live_units_bound"]),
            "formula": (rep["formula_total"], est["formula"]["total"]),
            "dims": (rep["mesh"], est["mesh"]), "flat": flat["bytes"],
            "comm": comm, "padded": padded, "elem": torch.empty((), dtype=opt.dtype).itemsize,
            "stats_bytes": opt._stats.numel() * opt._stats.element_size()}


def _worker(rank, ws):
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))
    return run_cases({f"{s}-{p}-{h}": (lambda s=s, p=p, h=h: _one(rank, mesh, s, p, h))
                      for s, p, h in CASES})


@pytest.mark.parametrize("stage, precision, hpz", CASES)
def test_estimate_equals_memory_report_on_a_mesh(stage, precision, hpz):
    for rank, r in enumerate(case(cached(_worker, WS), f"{stage}-{precision}-{hpz}")):
        assert r["measured"] == r["est"], (rank, r["measured"], r["est"])
        assert r["bound"][0] == r["bound"][1]
        assert r["formula"][0] == r["formula"][1]
        assert r["dims"][0] == r["dims"][1]
        if hpz:  # negative control: the secondary copy is really there and counted
            assert r["measured"]["hpz_secondary"] > 0
            without = dict(r["measured"], hpz_secondary=0)
            assert without != r["est"]
        elif stage > 0:  # negative control: a flat 4-rank layout is not what a rank holds
            assert r["flat"] != r["measured"]


def test_estimate_mesh_arguments_are_checked():
    with torch.device("meta"):
        spec = E.spec_from_model(M.make_model(), "tiny-lm")
    for kw, msg in (({"mesh": (2, 3)}, "mesh 2x3 has 6 ranks"),
                    ({"mesh": (2, 0)}, "two ints >= 1"),
                    ({"hpz": True}, "hpz=True needs mesh"),
                    ({"mesh": (2, 2), "hpz": True, "stage": 2}, "hpz=True is for stage 3")):
        kw = {"stage": 3, **kw}
        stage = kw.pop("stage")
        with pytest.raises(ValueError, match=msg):
            E.estimate(spec, 4, stage, "bf16", **kw)


def test_cli_mesh_prints_dims_and_formulas(capsys):
    from zerokern import cli

    assert cli.main(["estimate", "--params", "7e9", "--mesh", "8x8", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert "mesh 8x8 (64 ranks)" in out and "DESIGN §4 with N -> S" in out
    assert "replicate (across nodes): 2(Ψ/S)(R-1)/R = 1,531,250,000 (between nodes)" in out
    assert cli.main(["estimate", "--params", "7e9", "--mesh", "8x8", "--hpz"]) == 0
    out = capsys.readouterr().out
    assert "hpZ secondary (16-bit, over S)" in out and "1.63 GiB" in out
    assert "hpz (node): Ψ(S-1)/S = 6,125,000,000 (inside a node)" in out


@pytest.mark.parametrize("stage, precision", [(s, p) for s in (1, 2, 3) for p in ("bf16", "fp32")])
def test_inter_node_bytes_equal_the_printed_formula(stage, precision):
    """HSDP: comm_stats()["nodes"]["inter_node"] is the replicate all-reduce plus the
    agreement (found_inf, sumsq and a flag per param tensor), and the replicate bytes equal `zerokern estimate --mesh`'s 2(Ψ/S)(R-1)/R line
    (Ψ the padded elements the shards are cut from) times the element size, to the byte."""
    from zerokern.memory.mesh import comm_formulas

    for r in case(cached(_worker, WS), f"{stage}-{precision}-False"):
        c, dims = r["comm"], r["dims"][0]
        rows = {row["dim"]: row for row in comm_formulas(r["padded"], dims, stage)}
        rep = c["dims"]["replicate"]["total"]
        assert rep == rows["replicate (across nodes)"]["elements"] * r["elem"]
        assert c["nodes"] == {"inter_node": rep + c["dims"]["world"]["total"],
                              "intra_node": c["dims"]["shard"]["total"]}
        # found_inf + sumsq and one "used" flag per param tensor, fp32, 2(N-1)/N
        assert c["dims"]["world"]["total"] == int(2 * 3 / 4 * r["stats_bytes"])
    for r in case(cached(_worker, WS), f"3-{precision}-True"):  # hpZ: the node group inside
        assert r["comm"]["nodes"]["intra_node"] == r["comm"]["dims"]["hpz"]["total"] > 0
