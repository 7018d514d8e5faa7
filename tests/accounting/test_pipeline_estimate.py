"""`zerokern estimate --pp P` / `estimate_pipeline` against what each pipeline stage's
memory_report() measures (issue 38): 4 gloo ranks as a (pp=2, dp=2) world mesh, the tiny demo
GPT split into 2 stages by layers (tools/gpt_stages.py: the embeddings on stage 0, the final norm
and the untied head on stage 1, so the stages differ), each rank training its stage's module
two steps with ZeroAdamW(mesh=world) at ZeRO stages 0-3. Every category of
memory_report()["measured"], live_units_bound, formula_total and the dp dims equal the
estimate of that pipeline stage for that dp rank, to the byte.

Negative controls: the other pipeline stage's estimate, and the whole model's over the same dp
group, both miss the measurement.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import zerokern as zk
from zerokern.accounting import estimate as E
from zerokern.accounting.model_spec import load_stage_models
from zerokern.tools.gpt import PRESETS
from zerokern.tools.gpt_stages import GPTStage, stage_layers

from ..support.harness import cached, case, run_cases

WS, PP, DP = 4, 2, 2
BUCKET_MB = 0.05  # a few buckets per stage at the tiny GPT's size
# default: the stages whose staging replays the grad and unit orders; the rest slow
CASES = [(2, "bf16"), (3, "bf16")]
SLOW = [(0, "bf16"), (1, "bf16"), (2, "fp32")]


def _specs():
    return [E.spec_from_model(m, d) for m, d in load_stage_models("tiny", PP)]


def _one(world, stage, precision):
    s, d = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    torch.manual_seed(7 + s)
    c = PRESETS["tiny"]
    model = GPTStage(c, s, PP)
    opt = zk.ZeroAdamW(model, stage=stage, precision=precision, bucket_mb=BUCKET_MB,
                       backend="cpu", mesh=world)
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + 10 * s + d)
        x = torch.randint(0, c.vocab, (2, 8), generator=g) if s == 0 else \
            torch.randn(2, 8, c.d_model, generator=g).to(opt.dtype)
        opt.backward(model(x).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
    rep = opt.memory_report()
    est = E.estimate_pipeline(_specs(), WS, stage, precision, BUCKET_MB, rank=d, comm="gloo")
    with torch.device("meta"):
        whole = E.spec_from_model(GPTStage(c, 0, 1), "whole")
    flat = E.estimate(whole, DP, stage, precision, BUCKET_MB, rank=d, comm="gloo")
    return {"stage": s, "measured": rep["measured"], "est": [r["bytes"] for r in est],
            "bound": (rep.get("live_units_bound"), est[s]["live_units_bound"]),
            "formula": (rep["formula_total"], est[s]["formula"]["total"]),
            "dims": (rep["mesh"], est[s]["mesh"]), "roles": est[s]["roles"],
            "whole": flat["bytes"]}


def _worker(rank, ws, slow):
    world = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    return run_cases({f"{k}-{p}": (lambda k=k, p=p: _one(world, k, p))
                      for k, p in (SLOW if slow else CASES)})


@pytest.mark.parametrize("stage, precision", CASES + [pytest.param(*c, marks=pytest.mark.slow)
                                                      for c in SLOW])
def test_estimate_equals_each_pipeline_stage_memory_report(stage, precision):
    res = cached(_worker, WS, (stage, precision) in SLOW)
    for rank, r in enumerate(case(res, f"{stage}-{precision}")):
        s = r["stage"]
        assert r["measured"] == r["est"][s], (rank, r["measured"], r["est"][s])
        assert r["bound"][0] == r["bound"][1]
        assert r["formula"][0] == r["formula"][1]
        assert r["dims"][0] == r["dims"][1]
        assert r["roles"]["pp"] == PP and r["roles"]["dp"] == DP and r["roles"]["world"] == WS
        # negative controls: the other stage, and the whole model over the same dp group
        assert r["est"][1 - s] != r["measured"]
        assert r["whole"] != r["measured"]


def test_stages_differ_and_split_by_layers():
    assert [list(r) for r in stage_layers(6, 4)] == [[0, 1], [2, 3], [4], [5]]
    specs = _specs()
    assert specs[0].num_params != specs[1].num_params  # embeddings vs head
    c = PRESETS["tiny"]
    names = [set(n for n, _ in GPTStage(c, s, 2).named_parameters()) for s in range(2)]
    assert "tok.weight" in names[0] and "head.weight" in names[1]
    assert "blocks.1.qkv.weight" in names[1] and not names[0] & names[1]  # whole-model names
    whole = set(n for n, _ in zk.tools.gpt.GPT(c).state_dict().items())
    assert names[0] | names[1] <= whole
    with pytest.raises(ValueError, match="pipeline stages"):
        stage_layers(2, 3)


def test_estimate_pp_cli(capsys):
    from zerokern.cli import main

    assert main(["estimate", "--model", "tiny", "--pp", "2", "--world-size", "4",
                 "--stage", "2"]) == 0
    out = capsys.readouterr().out
    assert "pp 0" in out and "pp 1" in out and "(4 ranks)" in out, out
    for bad, msg in ((["--params", "1e6"], "--pp needs --model"),
                     (["--model", "tiny", "--world-size", "3"], "multiple of the 2")):
        with pytest.raises(SystemExit):
            main(["estimate", "--pp", "2", *bad])
        err = capsys.readouterr().err
        assert msg in err, (bad, err)
