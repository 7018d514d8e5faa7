"""`zerokern.estimate` / `zerokern estimate`: exact against memory_report, within padding of §4.

- Exactness: for the odd-sized test model (tests/zero/models.py: tied weight, frozen param, 0-d
  param) and the gpt "tiny" preset, each category of `opt.memory_report()["measured"]` after two
  training steps equals the estimate, byte for byte, at stages 0-2, fp32 and bf16, tiny buckets
  (many, params straddling them) and the default 25 MB (one), at world size 1 (no process
  group) and 2 (gloo, both ranks: the padding split differs per rank). World size 3 passed
  too when tried (commit message); it is left out to keep this file near 30 s on 2 busy cores
  (its spawn alone costs ~10 s there).
- Negative controls: the estimate with the wrong grad order (reverse registration) misses the
  stage-2 staging bytes, and without the gloo ring scratch (comm="nccl") misses stage 1's.
- `--params`: a one-param model matches exactly; for Ψ up to 7e9 the total minus buckets lies
  within DESIGN §4's padding term (< N*128 elements per buffer) above the formula.
- The CLI: --json parses and equals the Python API; the table has every row; bad flags exit 2
  with usage; a Hugging Face config given as JSON builds on meta with the real param count.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from torch import nn
from zero import models as M  # tests/ is on sys.path (rootdir), as for tests/zero
from zero.harness import cached, case, one_thread, run_cases  # noqa: F401 (fixture)

import zerokern as zk
from zerokern import cli
from zerokern import estimate as E
from zerokern.gpt import build_gpt
from zerokern.memory import estimate_memory
from zerokern.partition import ALIGN

ELEM = {"fp32": 4, "bf16": 2}
STAGES = [0, 1, 2]
PRECISIONS = ["fp32", "bf16"]
# Per model: small buckets (3-12 of them, params straddling them, padding in the last) and the
# default 25 MB (one bucket). Smaller ones add nothing but collectives: at 0.002 MB the gpt and
# one-param models need 100-270 buckets, and the world-size-3 spawn took 125 s on 2 busy cores.
BUCKETS = {"tinylm": [M.BUCKET_MB, 25.0], "gpt-tiny": [0.05, 25.0], "one-param": [0.25, 25.0]}
ODD_NUMEL = 278011  # one param, not a multiple of N*128 for any N here


class OneParam(nn.Module):
    def __init__(self, n: int = ODD_NUMEL) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return (self.w[: tokens.numel()].view(tokens.shape) * tokens).unsqueeze(-1)


MAKERS = {"tinylm": M.make_model, "gpt-tiny": lambda: build_gpt("tiny"), "one-param": OneParam}


def _spec(name: str) -> E.ModelSpec:
    if name == "one-param":
        return E.spec_from_numel(ODD_NUMEL)
    with torch.device("meta"):
        return E.spec_from_model(MAKERS[name](), name)


def _train_and_report(name, stage, precision, bucket_mb, rank, world_size):
    """memory_report()['measured'] after 2 steps of a ZeroAdamW over the whole model."""
    torch.manual_seed(1234)
    model = MAKERS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        opt = zk.ZeroAdamW(model, stage=stage, precision=precision, bucket_mb=bucket_mb,
                           backend="reference")
    for step in range(2):
        tokens = M.rank_tokens(step, rank, world_size)
        model(tokens[:, :-1]).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt.memory_report()["measured"]


CASES = [(n, s, p, b) for n in MAKERS for s in STAGES for p in PRECISIONS for b in BUCKETS[n]]


def _key(n, s, p, b) -> str:
    return f"{n}-s{s}-{p}-b{b}"


def _multi_rank(rank, world_size):
    """Every case on this rank: (measured, estimate for this rank with gloo's ring)."""
    specs = {n: _spec(n) for n in MAKERS}
    cases = {}
    for n, s, p, b in CASES:
        def thunk(n=n, s=s, p=p, b=b):
            meas = _train_and_report(n, s, p, b, rank, world_size)
            est = E.estimate(specs[n], world_size, s, p, b, rank=rank, comm="gloo")
            extra = {}
            if n == "tinylm" and b == M.BUCKET_MB:  # negative controls
                wrong = dataclasses.replace(
                    specs[n], grad_order=tuple(reversed(range(len(specs[n].shapes)))))
                extra["reversed"] = E.estimate(wrong, world_size, s, p, b, rank=rank,
                                               comm="gloo")["bytes"]
                extra["nccl"] = E.estimate(specs[n], world_size, s, p, b, rank=rank,
                                           comm="nccl")["bytes"]
            return meas, est["bytes"], extra
        cases[_key(n, s, p, b)] = thunk
    return run_cases(cases)


def _assert_equal(meas: dict, est: dict, where: str) -> None:
    diff = {c: (meas[c], est[c]) for c in meas if meas[c] != est[c]}
    assert not diff, f"{where}: measured != estimate (category: (measured, estimate)) {diff}"


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name,stage,precision,bucket_mb", CASES)
def test_estimate_equals_memory_report_single_process(name, stage, precision, bucket_mb):
    meas = _train_and_report(name, stage, precision, bucket_mb, 0, 1)
    est = E.estimate(_spec(name), 1, stage, precision, bucket_mb)
    assert set(E.MEASURED) == set(meas)
    _assert_equal(meas, est["bytes"], "world size 1")
    assert est["device_total"] == sum(meas.values())


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("name,stage,precision,bucket_mb", CASES)
def test_estimate_equals_memory_report_every_rank(world_size, name, stage, precision,
                                                  bucket_mb):
    results = cached(_multi_rank, world_size)
    for rank, (meas, est, _) in enumerate(case(results, _key(name, stage, precision,
                                                             bucket_mb))):
        _assert_equal(meas, est, f"world size {world_size}, rank {rank}")


@pytest.mark.parametrize("world_size", [2])
def test_negative_controls_wrong_grad_order_and_missing_ring_scratch(world_size):
    results = cached(_multi_rank, world_size)
    meas, _, extra = case(results, _key("tinylm", 2, "bf16", M.BUCKET_MB))[0]
    # Reverse registration order launches buckets differently: fewer staging buffers.
    assert extra["reversed"]["buckets"] != meas["buckets"]
    meas1, _, extra1 = case(results, _key("tinylm", 1, "bf16", M.BUCKET_MB))[0]
    assert meas1["buckets"] > 0 and extra1["nccl"]["buckets"] == 0  # gloo's ring scratch


@pytest.mark.parametrize("psi,n", [(7_000_000_000, 8), (1_000_001, 3), (ODD_NUMEL, 4),
                                   (127, 2), (1, 1)])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_params_within_padding_of_design_formula(psi, n, stage, precision):
    est = E.estimate(E.spec_from_numel(psi), n, stage, precision)
    formula = estimate_memory(psi, n, stage, precision)["total"]
    e = ELEM[precision]
    per_elem = e + e + (12 if precision == "bf16" else 8)  # params, grads, master?, m, v
    pad_term = n * ALIGN * per_elem  # DESIGN §4: < N*128 padding elements per buffer
    over = est["device_total"] - est["bytes"]["buckets"] - formula
    assert -8 <= over < pad_term, (over, pad_term)  # -8: the formula rounds each term
    assert est["formula"]["total"] == formula
    ds = est["deepspeed"]["total"]
    expect = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n}[stage]
    assert abs(ds - expect) <= 3


def _cli(capsys, *argv):
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_json_matches_api_and_table_has_every_row(capsys):
    rc, out, _ = _cli(capsys, "estimate", "--params", "7e9", "--world-size", "8", "--json")
    assert rc == 0
    res = json.loads(out)["results"]
    assert [r["stage"] for r in res] == [0, 1, 2, 3]
    spec = E.spec_from_numel(7_000_000_000)
    for r in res:
        api = E.estimate(spec, 8, r["stage"], "bf16")
        assert r["bytes"] == api["bytes"] and r["device_total"] == api["device_total"]
        assert r["exact"] == (r["stage"] < 3)
    assert res[3]["bytes"]["live_units"] == 0  # no model: n/a
    rc, out, _ = _cli(capsys, "estimate", "--params", "7e9", "--world-size", "8")
    assert rc == 0
    for _, label in E._ROWS:
        assert label in out
    assert "live units (max gathered unit)" in out and "n/a" in out
    assert "DeepSpeed" in out and "DESIGN §4" in out


def test_cli_model_preset_and_factory_and_stage_selection(capsys):
    rc, out, _ = _cli(capsys, "estimate", "--model", "tiny", "--world-size", "2", "--stage",
                      "2", "--stage", "3", "--json", "--comm", "gloo")
    assert rc == 0
    res = json.loads(out)["results"]
    assert [r["stage"] for r in res] == [2, 3]
    psi = sum(p.numel() for p in build_gpt("tiny").parameters())  # the tie counted once
    assert all(r["num_params"] == psi for r in res)
    assert res[0]["grad_order"] == "one backward on the meta device"
    assert res[1]["bytes"]["live_units"] > 0  # a block is the largest unit
    rc, out2, _ = _cli(capsys, "estimate", "--model", "zerokern.gpt:build_gpt", "--json",
                       "--stage", "1")
    assert rc == 0
    assert json.loads(out2)["results"][0]["num_params"] == \
        sum(p.numel() for p in build_gpt("20m").parameters())


def test_cli_hugging_face_config_json_builds_on_meta(capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
           "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 503}
    rc, out, err = _cli(capsys, "estimate", "--model", json.dumps(cfg), "--world-size", "3",
                        "--stage", "2", "--json")
    assert rc == 0, err
    real = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    psi = sum(p.numel() for p in real.parameters() if p.requires_grad)
    assert json.loads(out)["results"][0]["num_params"] == psi


@pytest.mark.parametrize("argv,flag", [
    (["--params", "0"], "--params"), (["--params", "1.5"], "--params"),
    (["--params", "x"], "--params"), (["--params", "10", "--world-size", "0"], "--world-size"),
    (["--params", "10", "--stage", "4"], "--stage"), ([], "--params"),
    (["--params", "10", "--model", "tiny"], "--model"),
    (["--params", "10", "--precision", "fp8"], "--precision"),
    (["--params", "10", "--bucket-mb", "0"], "--bucket-mb"),
    (["--params", "10", "--world-size", "2", "--rank", "2"], "--rank"),
    (["--model", "no_such_module:f"], "--model"),
])
def test_cli_bad_flags_exit_2_with_usage(capsys, argv, flag):
    rc, _, err = _cli(capsys, "estimate", *argv)
    assert rc == 2
    assert "usage: zerokern estimate" in err
    assert flag in err


def test_cli_hub_name_offline_fails_fast_and_clearly(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, _, err = _cli(capsys, "estimate", "--model", "no-such-org/no-such-model-zk")
    assert rc == 2
    assert "not reachable" in err and "config.json" in err
