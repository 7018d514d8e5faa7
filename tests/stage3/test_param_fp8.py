"""Stage 3 with `param_format="fp8"` (kernels/param_codec.py [Note: FP8 params with an agreed
scale]): the param shards held and all-gathered as FP8 codes with one fp32 scale per param,
agreed across the ranks, and decoded to bf16 at the gather.

Checked on gloo ranks, N = 1 and 2, on the test transformer (odd sizes, params straddling
the shards, a tie, a 0-d param, a frozen param), over real training steps:
- the params every forward sees (gathered_params(), and a forward pre-hook) are, bit for bit,
  the float64 spec of the quantization (tests/kernels/test_param_codec.py `spec_param`) applied
  to this optimizer's own fp32 masters (gathered with plain dist.all_gather): after
  construction and after each step; the masters themselves train (the loss falls);
- the shard costs 1 byte per element (memory_report, measured and formula) and one step's
  all-gathers move half the bytes of the same run with bf16 params (comm_stats; every param
  trainable there: frozen params have no master to encode from and stay 16-bit);
- opt.state_dict() round trip, gathered_params(modify=True) and zerokern.checkpoint save/load
  keep the spec;
- negative control: with the agreement switched off (each rank's scale from its own part of a
  param) the gathered params are not the spec, and the two ranks' scales differ;
- bad input: TypeError/ValueError naming param_format, on every rank, before any change.
"""

from __future__ import annotations

import pytest
import torch

from ..kernels.test_param_codec import spec_param
from ..support import models as M
from ..support.harness import cached, case, run_cases

STEPS = 3
WORLD_SIZES = [1, 2]
TOL = {
    "decoded": 0,  # gathered params bitwise the spec of the masters (the format is exact)
}


def _opt(model, param_format="fp8", **kw):
    return M.zero_opt(model, 3, "bf16", param_format=param_format, **kw)


def _spec_mismatch(opt, model) -> list:
    """Names of trainable params whose gathered value is not the spec of the gathered master."""
    masters = M.gather_state(opt, model, "master")
    values = M.full_snapshot(model, opt)
    bad = []
    for name, m in masters.items():
        _, want, _ = spec_param(m.reshape(-1), torch.bfloat16)
        if not torch.equal(values[name].reshape(-1).view(torch.int16), want.view(torch.int16)):
            bad.append(name)
    return bad


def _train(model, opt, rank, world_size, steps=STEPS, check=True):
    """Steps on one fixed batch (so the loss must fall); with check, the spec after each."""
    losses, bad = [], []
    for step in range(steps):
        loss = M.loss_fn(model, M.rank_tokens(0, rank, world_size))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if check:
            bad += [(step, n) for n in _spec_mismatch(opt, model)]
    return losses, bad


def _case_spec(rank, world_size):
    model = M.make_model()
    opt = _opt(model)
    bad0 = _spec_mismatch(opt, model)  # the construction's encode
    seen = {}  # what the forward computes with: the decoded params
    h = model.blocks[0].register_forward_pre_hook(
        lambda m, a: seen.update({n: p.detach().clone() for n, p in m.named_parameters()}))
    loss = M.loss_fn(model, M.rank_tokens(0, rank, world_size))
    h.remove()
    masters = M.gather_state(opt, model, "master")
    fwd_bad = []
    for n, v in seen.items():
        _, want, _ = spec_param(masters["blocks.0." + n].reshape(-1), torch.bfloat16)
        if not torch.equal(v.reshape(-1).view(torch.int16), want.view(torch.int16)):
            fwd_bad.append(n)
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    losses, bad = _train(model, opt, rank, world_size)
    return {"bad0": bad0, "fwd_bad": fwd_bad, "fwd_seen": len(seen), "bad": bad,
            "losses": losses, "dtypes": sorted({str(g.param_shard.dtype)
                                                for g in opt.flat_groups}),
            "params_bytes": opt.memory_report()["measured"]["params"],
            "formula_params": opt.memory_report()["formula"]["params"],
            "shard_numel": sum(g.param_shard.numel() - g.state_padding
                               for g in opt.flat_groups)}


def _gather_bytes(param_format, rank, world_size):
    model = M.make_model()
    model.pos.requires_grad_(True)  # every param trainable: frozen params stay 16-bit
    opt = _opt(model, param_format)
    _train(model, opt, rank, world_size, steps=1, check=False)
    opt.reset_comm_stats()
    _train(model, opt, rank, world_size, steps=1, check=False)
    st = opt.comm_stats()
    return {k: v for k, v in st.items() if "gather" in k}


def _case_roundtrip(rank, world_size):
    model = M.make_model()
    opt = _opt(model)
    _train(model, opt, rank, world_size, steps=1, check=False)
    sd = opt.state_dict()
    before = M.full_snapshot(model, opt)
    _train(model, opt, rank, world_size, steps=1, check=False)  # moves on
    opt.load_state_dict(sd)
    back = M.full_snapshot(model, opt)
    same = M.bitwise_equal(back, before)
    # gathered_params(modify=True): a user's write goes into the master and is re-encoded
    name, _ = next(model.blocks[1].named_parameters())
    key = "blocks.1." + name
    m0 = M.gather_state(opt, model, "master")[key]
    with opt.gathered_params(modify=True):
        with torch.no_grad():
            next(model.blocks[1].parameters()).mul_(3.0)
    m1 = M.gather_state(opt, model, "master")[key]
    _, want, _ = spec_param(m0.reshape(-1), torch.bfloat16)
    w3 = (want.float() * 3.0).to(torch.bfloat16)  # what the user wrote (bf16 mul_)
    # the master takes the written value where the param changed (a 0 code stays 0 x 3)
    tripled = torch.equal(m1.reshape(-1), torch.where(w3 != want, w3.float(), m0.reshape(-1)))
    return {"same": same, "bad": _spec_mismatch(opt, model), "tripled": tripled}


def _case_checkpoint(rank, world_size, path):
    """zerokern.checkpoint: the masters saved and loaded, the codes re-encoded from them on
    every rank (before the re-encode on load, the codes were the later step's)."""
    import zerokern as zk

    model = M.make_model()
    opt = _opt(model)
    _train(model, opt, rank, world_size, steps=1, check=False)
    zk.checkpoint.save(path, model, opt)
    before = M.full_snapshot(model, opt)
    _train(model, opt, rank, world_size, steps=2, check=False)
    zk.checkpoint.load(path, model, opt)
    return {"same": M.bitwise_equal(M.full_snapshot(model, opt), before),
            "bad": _spec_mismatch(opt, model)}


def _case_unagreed(rank, world_size):
    model = M.make_model()
    opt = _opt(model)
    codec = opt.flat_groups[0].codec
    codec.agree = None  # the negative control: each rank's scale from its own part
    _train(model, opt, rank, world_size, steps=1, check=False)
    bad = _spec_mismatch(opt, model)
    scales = [g.param_scales.clone() for g in opt.flat_groups]
    return {"bad": bad, "scales": scales}


def _case_errors(rank, world_size):
    out = {}
    for name, kw in {"type": dict(param_format=8), "value": dict(param_format="fp4"),
                     "offload": dict(offload="cpu"), "qwz": dict(quantized_weights=True)}.items():
        model = M.make_model()
        before = M.snapshot(model)
        try:
            _opt(model, **({"param_format": "fp8"} | kw))
            out[name] = None
        except (TypeError, ValueError) as e:
            out[name] = (type(e).__name__, str(e), M.bitwise_equal(M.snapshot(model), before))
    model = M.make_model()
    try:
        M.zero_opt(model, 2, "bf16", param_format="fp8")
        out["stage"] = None
    except ValueError as e:
        out["stage"] = ("ValueError", str(e), True)
    return out


def _worker(rank, world_size, path):
    cases = {"spec": lambda: _case_spec(rank, world_size),
             "roundtrip": lambda: _case_roundtrip(rank, world_size),
             "checkpoint": lambda: _case_checkpoint(rank, world_size, path),
             "errors": lambda: _case_errors(rank, world_size)}
    if world_size == 2:
        cases["bytes_fp8"] = lambda: _gather_bytes("fp8", rank, world_size)
        cases["bytes_bf16"] = lambda: _gather_bytes(None, rank, world_size)
        cases["unagreed"] = lambda: _case_unagreed(rank, world_size)
    return run_cases(cases)


_DIRS = {}


def _run(world_size, tmp_path_factory):
    """One spawn per world size for every test here (the checkpoint's directory made once)."""
    if world_size not in _DIRS:
        _DIRS[world_size] = str(tmp_path_factory.mktemp(f"fp8_{world_size}") / "ck")
    return cached(_worker, world_size, _DIRS[world_size])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fp8_zerokern_checkpoint_reencodes_on_load(world_size, tmp_path_factory):
    for r in case(_run(world_size, tmp_path_factory), "checkpoint"):
        assert r["same"]
        assert r["bad"] == []


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fp8_params_are_the_spec_of_the_masters(world_size, tmp_path_factory):
    for r in case(_run(world_size, tmp_path_factory), "spec"):
        assert TOL["decoded"] == 0
        assert r["bad0"] == [] and r["bad"] == []
        assert r["fwd_seen"] > 0 and r["fwd_bad"] == []
        assert r["dtypes"] == ["torch.float8_e4m3fn"]
        assert r["params_bytes"] == r["shard_numel"]  # one byte per element held
        assert r["losses"][-1] < r["losses"][0]  # the masters train


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fp8_memory_formula_counts_one_byte(world_size, tmp_path_factory):
    """memory_report's formula (DESIGN §4 with the codec's bytes) sums, over the ranks, to
    what they hold: 1 byte per trainable element (2 with bf16 params)."""
    rs = case(_run(world_size, tmp_path_factory), "spec")
    assert sum(r["formula_params"] for r in rs) == sum(r["params_bytes"] for r in rs)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fp8_state_dict_roundtrip_and_write_back(world_size, tmp_path_factory):
    for r in case(_run(world_size, tmp_path_factory), "roundtrip"):
        assert r["same"]
        assert r["bad"] == []
        assert r["tripled"]  # the master took the written (decoded x 3, bf16) value


def test_fp8_gather_moves_half_the_bytes(tmp_path_factory):
    res = _run(2, tmp_path_factory)
    fp8, bf16 = case(res, "bytes_fp8"), case(res, "bytes_bf16")
    for a, b in zip(fp8, bf16):
        ka = sum(v for v in _flat_bytes(a))
        kb = sum(v for v in _flat_bytes(b))
        assert kb > 0 and ka * 2 == kb, (a, b)


def _flat_bytes(st):
    for v in st.values():
        if isinstance(v, dict):
            yield from _flat_bytes(v)
        elif isinstance(v, (int, float)):
            yield v


def test_fp8_negative_control_unagreed_scales(tmp_path_factory):
    r0, r1 = case(_run(2, tmp_path_factory), "unagreed")
    assert r0["bad"] and r1["bad"]  # the gathered params are not the spec
    assert any(not torch.equal(a, b) for a, b in zip(r0["scales"], r1["scales"]))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fp8_bad_input_names_param_format(world_size, tmp_path_factory):
    for r in case(_run(world_size, tmp_path_factory), "errors"):
        assert r["type"][0] == "TypeError" and "param_format" in r["type"][1]
        assert r["value"][0] == "ValueError" and "param_format" in r["value"][1]
        for k in ("offload", "qwz", "stage"):
            assert r[k] is not None and r[k][0] == "ValueError", k
            assert "param_format" in r[k][1], r[k]
            assert r[k][2]  # the model unchanged
