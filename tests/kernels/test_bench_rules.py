"""The kernel and step benchmarks per optimizer rule (issue 23; zerokern/bench/kernel_rules.py,
kernel_rules_ns.py, step_rules.py): the byte floors derived from the rules' StateSpec lists,
the peers the rows compare against (each the update it claims to be), and both CLIs end to end
at tiny sizes."""

from __future__ import annotations

import json

import pytest
import torch

from zerokern.bench import kernel_rules, kernel_rules_ns
from zerokern.bench.kernel_cases import adam_bytes, make_case
from zerokern.rules import Rule, StateSpec
from zerokern.rules.adamw import ADAMW

from ..test_cli import zk


def test_rule_floor_follows_the_statespec_list():
    """AdamW's derived floor is the hand formula of kernel_cases.adam_bytes (28 bf16, 28 fp32);
    Lion, 8-bit AdamW and Muon's pieces as [Note: the byte floor of a rule] lists them; one more
    fp32 state adds 8 bytes (a floor that ignored the rule could not change)."""
    for c in ("bf16", "fp32", "fp16"):
        case = make_case(c)
        assert kernel_rules.rule_floor(ADAMW, case) == adam_bytes(case.grad_dtype,
                                                                  case.param_out_dtype)
    bf16, fp32 = make_case("bf16"), make_case("fp32")
    floors = {n: kernel_rules.rule_floor(kernel_rules.rule_of(n), bf16)
              for n in kernel_rules.RULES}
    assert floors == {"lion": 20, "adamw8bit": 16.125, "muon": 20}
    assert kernel_rules.rule_floor(kernel_rules.rule_of("lion"), fp32) == 20

    class Three(Rule):
        states = ADAMW.states + (StateSpec("extra"),)

    assert kernel_rules.rule_floor(Three(), bf16) == 28 + 8


def test_ns_flops():
    """steps x (4 m^2 k + 2 m^3), m the short side: transposing changes nothing."""
    assert kernel_rules_ns.ns_flops((64, 256)) == 5 * (4 * 64 * 64 * 256 + 2 * 64 ** 3)
    assert kernel_rules_ns.ns_flops((256, 64)) == kernel_rules_ns.ns_flops((64, 256))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_foreach_lion_is_lion_pytorch():
    """The "torch-foreach" peer is lion-pytorch's Lion (3 steps, two params, lr 1e-2, rel <=
    1e-6); with lr x 1.01 it is not (the comparison can fail)."""
    from lion_pytorch import Lion

    g = torch.Generator().manual_seed(5)
    init = [torch.randn(300, generator=g), torch.randn(7, 11, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in init] for _ in range(3)]

    def run(cls, **hp):
        ps = [p.clone().requires_grad_(True) for p in init]
        opt = cls(ps, **{**kernel_rules.LION_HYPER, "lr": 1e-2, **hp})
        for gs in grads:
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            opt.step()
        return torch.cat([p.detach().flatten() for p in ps])

    ref = run(Lion)
    assert _rel(run(kernel_rules._ForeachLion), ref) <= 1e-6
    assert _rel(run(kernel_rules._ForeachLion, lr=1.01e-2), ref) > 1e-5


def test_torch_eager_muon_pieces_are_zerokerns():
    """The "torch-eager" peer does the update zerokern's pieces do (2 steps: master, momentum
    and param_out equal to rel 1e-6), so the row compares the same work."""
    n = 4096
    g = torch.Generator().manual_seed(6)
    master, buf = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3
    grad = (torch.randn(n, generator=g) * 1e-3).bfloat16()
    a = [master.clone(), buf.clone(), torch.empty(n, dtype=torch.bfloat16)]
    b = [master.clone(), buf.clone(), torch.empty(n, dtype=torch.bfloat16)]
    zk_fn = kernel_rules._zk_muon_pieces(a[0], a[1], grad, a[2], torch.device("cpu"))  # 1 step
    eager = kernel_rules._torch_eager_muon(b[0], b[1], grad, b[2])
    eager()
    zk_fn()
    eager()
    for x, y in zip(a, b):
        assert _rel(x.float(), y.float()) <= 1e-6
    assert _rel(a[0], master) > 1e-6  # it moved


@pytest.mark.slow  # [Note: the slow mark]: 9 s of benchmark smoke (the 8-bit rows' peers)
def test_bench_kernels_rules_quick(tmp_path):
    """Rows per rule (zk cpu kernel and its peers, fp32 case), the Newton-Schulz rows, the byte
    floors in the JSON; every header printed whole when piped (issue 25 Note)."""
    r = zk("bench", "--kernels", "--quick", "--no-plot", "--sizes", "12", "--dtype-cases",
           "fp32", "--rules", "lion", "adamw8bit", "muon", "--ns-shapes", "32x48",
           "--reps", "1", "--warmup", "0", "--out", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "kernels-cpu-quick.json").read_text())
    provs = {(row["op"], row["provider"]) for row in data["rows"]}
    assert {("lion_step_", "cpu"), ("lion_step_", "lion-pytorch"),
            ("lion_step_", "torch-foreach"), ("adamw8bit_step_", "cpu"),
            ("adamw8bit_step_", "torch-fused"), ("adamw8bit_step_", "zk-adamw32"),
            ("muon_pieces", "zk-pieces"),
            ("muon_pieces", "torch-eager")} <= provs, provs
    assert not any(row["op"] == "adam_step_" for row in data["rows"])  # --rules without adamw
    assert all(row["frac_rmw"] > 0 for row in data["rows"])
    assert data["rule_floors"] == {"lion": {"fp32": 20}, "adamw8bit": {"fp32": 16.125},
                                   "muon": {"fp32": 20}}
    ns = {(row["op"], row["provider"]) for row in data["ns_rows"]}
    assert ns == {("newton_schulz", "zk"), ("newton_schulz", "torch"), ("muon_step", "zk"),
                  ("muon_step", "torch")}
    for header in ("median ms", "% RMW", "vs torch", "GFLOP/s", "% NS"):
        assert header in r.stdout
    md = (tmp_path / "kernels-cpu-quick.md").read_text()
    assert "## lion_step_ fp32" in md and "## Newton-Schulz" in md


@pytest.mark.slow  # a bench run with DDP + torch Muon (9 s on 2 loaded cores)
@pytest.mark.parametrize("optimizer, peer", [("muon", "DDP + torch Muon + AdamW")])
def test_bench_step_optimizer_quick(tmp_path, optimizer, peer):
    """`bench --step --optimizer muon`: ZeroMuon at the stage asked for and the DDP peer, the
    ratio measured in the run; the file name says the optimizer."""
    r = zk("bench", "--step", "--quick", "--optimizer", optimizer, "--stages", "1", "--reps",
           "1", "--warmup", "0", "--no-plot", "--out", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / f"step-tiny-n2-fp32-{optimizer}-quick.json").read_text())
    rows = {row["provider"]: row for row in data["rows"]}
    assert set(rows) == {"zerokern s1", peer}
    assert rows[peer]["vs_ddp"] == 1.0 and rows["zerokern s1"]["vs_ddp"] > 0
    assert data["env"]["optimizer"] == optimizer


def test_engine_bench_gives_deepspeed_zeromuons_split():
    """bench --engine --optimizer muon ([Note: --optimizer muon]): DeepSpeed's own tagging
    sends this GPT's `tok` and `pos` embeddings to Muon (by name); the bench's replacement tags
    exactly ZeroMuon's default split (embeddings and tied head AdamW, matrices Muon)."""
    import os
    import types

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from deepspeed import set_optimizer_flags

    from zerokern.bench.engine import _same_muon_split
    from zerokern.bench.step_rules import muon_split
    from zerokern.tools.gpt import build_gpt

    model = build_gpt("tiny")
    set_optimizer_flags(types.SimpleNamespace(optimizer_name="muon", optimizer_params={}),
                        model)
    names = {id(p): n for n, p in model.named_parameters()}
    ds = {n for n, p in model.named_parameters() if p.use_muon}
    _same_muon_split(None, model)
    ours = {n for n, p in model.named_parameters() if p.use_muon}
    assert ds - ours == {"tok.weight", "pos.weight"} and ours <= ds
    assert ours == {names[id(p)] for p in muon_split(model)[0]}


@pytest.mark.slow  # [Note: the slow mark] (pyproject.toml): DeepSpeed's init costs ~30 s
def test_bench_engine_muon_stage3(tmp_path):
    """`bench --engine --optimizer muon` at stage 3 (DeepSpeed needs reduce_scatter off)."""
    r = zk("bench", "--engine", "--optimizer", "muon", "--model-size", "tiny", "--stages", "3",
           "--precisions", "fp32", "--reps", "1", "--warmup", "0", "--out", str(tmp_path),
           timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "engine-tiny-n2-muon.json").read_text())
    (row,) = data["rows"]
    assert row["config"] == "s3-fp32" and row["zk_ms"] > 0 and row["ds_ms"] > 0
    assert data["env"]["optimizer"] == "muon"
