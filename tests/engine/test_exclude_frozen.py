"""`engine.save_checkpoint(..., exclude_frozen_parameters=True)` as DeepSpeed 0.19 does it.

A LoRA-like model (frozen embedding and base linear, trainable adapters and head, a buffer):
2 steps, a checkpoint without the frozen params' values, 2 more steps; a fresh engine on the
same frozen weights loads it (`load_module_strict=False`) and its 2 steps give the same params
bit for bit. DeepSpeed 0.19 (CPU, gloo; `torch_adam` for an exact resume) is the reference for
what is and is not restored, checked on it by the same runs: `load_module_strict=True` raises
(a RuntimeError for the missing keys), `False` loads and leaves the frozen params as the model
holds them, even when they differ from the ones saved (silently; zerokern warns), and
zero_to_fp32 leaves them out of its output (silently; zerokern's consolidate warns).

Negative controls (each a ModelMismatchError naming the param, with every param unchanged):
load_module_strict=True, a frozen param of another shape, a param frozen at save and
trainable now. N = 1, 2; stages 0 and 3 (1 and 2 under the slow mark), DeepSpeed stages 0 and
2 (3 under the slow mark). On the old code every test failed: save_checkpoint raised
NotImplementedError for exclude_frozen_parameters=True.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import shutil
import struct
import tempfile
import types
import warnings

import pytest
import torch
import torch.nn as nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from tests.support.harness import cached, case, run_cases  # noqa: E402

from . import common as C  # noqa: E402

FROZEN = ("emb.weight", "base.weight", "base.bias")
_BASE = []


def _base() -> str:
    """The checkpoints' directory, made in the pytest process (ranks are handed its path: a
    forkserver child imports this module afresh)."""
    if not _BASE:
        _BASE.append(tempfile.mkdtemp(prefix="zk-exclude-frozen-"))
        atexit.register(shutil.rmtree, _BASE[0], True)
    return _BASE[0]


class Lora(nn.Module):
    """Frozen emb + base (the "pretrained" weights), trainable LoRA a/b and head, a buffer."""

    def __init__(self, rows: int = C.VOCAB, train_base: bool = False) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.emb = nn.Embedding(rows, 32)
        self.base = nn.Linear(32, 32)
        self.a = nn.Linear(32, 4, bias=False)
        self.b = nn.Linear(4, 32, bias=False)
        self.head = nn.Linear(32, C.VOCAB)
        self.register_buffer("scale", torch.tensor(0.5))
        self.emb.weight.requires_grad_(False)
        for p in self.base.parameters():
            p.requires_grad_(train_base)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        h = torch.tanh(self.base(h) + self.scale * self.b(self.a(h)))
        logits = self.head(h)
        return types.SimpleNamespace(loss=nn.functional.cross_entropy(
            logits.reshape(-1, C.VOCAB), labels.reshape(-1)))


def _init(which, rank, stage, model):
    C.launcher_env(rank)
    stage, _, prec = str(stage).partition("-")  # "3-bf16": stage 3 at bf16
    cfg = C.base_config(int(stage), prec or "fp32", gas=1)
    if which == "deepspeed":
        import deepspeed

        return deepspeed.initialize(model=model, config=cfg, model_parameters=[
            p for p in model.parameters() if p.requires_grad])[0]
    import zerokern as zk

    return zk.initialize(model=model, config=cfg)[0]


def _steps(engine, rank, steps):
    for s in steps:
        x = C.tokens(s, 0, rank)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()


def _params(which, engine):
    """{name: full value} of every param (gathered at stage 3)."""
    if which == "deepspeed":
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        ctx = GatheredParameters(list(engine.module.parameters()))
    elif engine.optimizer.stage == 3:
        ctx = engine.optimizer.gathered_params()
    else:
        import contextlib

        ctx = contextlib.nullcontext()
    with ctx:
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _flat(params):
    return torch.cat([params[n].reshape(-1) for n in sorted(params)])


def _diff(a, b):
    """max |a - b| over every param, and whether all are bitwise equal."""
    return (max(float((a[n] - b[n]).abs().max()) for n in a),
            all(torch.equal(a[n], b[n]) for n in a))


def _close(which, e):
    e.destroy()


def _try_load(which, e, d, strict):
    """(error type name, message) of load_checkpoint, or None; warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            e.load_checkpoint(d, tag="x", load_module_strict=strict)
            err = None
        except Exception as ex:  # noqa: BLE001 - the kind is part of the result
            err = (type(ex).__name__, str(ex))
    return err, [str(w.message) for w in caught if "frozen" in str(w.message)]


def _resume_case(which, rank, ws, stage, base):
    """Everything one engine kind does with an exclude_frozen_parameters checkpoint."""
    import torch.distributed as dist

    d = os.path.join(base, f"{which}-s{stage}-n{ws}")
    out = {"dir": d}
    with C.restore_linear():
        e = _init(which, rank, stage, Lora())
        _steps(e, rank, range(2))
        saved = _params(which, e)
        e.save_checkpoint(d, tag="x", exclude_frozen_parameters=True)
        e.save_checkpoint(d, tag="full")
        _steps(e, rank, range(2, 4))
        ref, ref_steps = _params(which, e), e.global_steps
        out["ref"] = _flat(ref)
        _close(which, e)

        # resume on the same frozen weights: bitwise the uninterrupted run
        e = _init(which, rank, stage, Lora())
        out["load"], out["load_warnings"] = _try_load(which, e, d, False)
        out["loaded_vs_saved"] = _diff(_params(which, e), saved)
        _steps(e, rank, range(2, 4))
        out["resume_vs_ref"] = _diff(_params(which, e), ref)
        out["steps"] = (e.global_steps, ref_steps)
        _close(which, e)

        # frozen weights that differ from the saved ones: kept as the model holds them
        m = Lora()
        with torch.no_grad():
            m.emb.weight.add_(1.0)
        e = _init(which, rank, stage, m)
        perturbed = _params(which, e)["emb.weight"]  # (in the training dtype)
        out["perturbed_load"], out["perturbed_warnings"] = _try_load(which, e, d, False)
        now = _params(which, e)
        out["perturbed_emb_kept"] = bool(torch.equal(now["emb.weight"], perturbed))
        out["perturbed_rest_vs_saved"] = _diff(
            {n: v for n, v in now.items() if n != "emb.weight"},
            {n: v for n, v in saved.items() if n != "emb.weight"})
        _close(which, e)

        # load_module_strict=True: the checkpoint lacks the frozen keys
        e = _init(which, rank, stage, Lora())
        before = _params(which, e)
        out["strict"], _ = _try_load(which, e, d, True)
        out["strict_changed"] = _diff(_params(which, e), before)
        out["strict_steps"] = e.global_steps
        _close(which, e)

        if which == "zerokern":  # the negative controls DeepSpeed has no answer for
            for key, model in (("shape", Lora(rows=C.VOCAB + 1)),
                               ("trainable", Lora(train_base=True))):
                e = _init(which, rank, stage, model)
                before = _params(which, e)
                out[key], _ = _try_load(which, e, d, False)
                out[key + "_changed"] = _diff(_params(which, e), before)
                out[key + "_steps"] = e.global_steps
                _close(which, e)
    try:
        if rank == 0:
            out["files"] = _files(which, d, saved)
    finally:
        if ws > 1:
            dist.barrier()
    return out


def _files(which, d, saved):
    """Sizes, and whether each frozen param's bytes are anywhere in the checkpoint's files."""
    def raw(t):  # the first 8 elements' bytes (a piece of one rank's file at stage 3 too)
        return t.reshape(-1)[:8].contiguous().view(torch.uint8).numpy().tobytes()

    def scan(tag):
        files = [f for f in glob.glob(os.path.join(d, tag, "**"), recursive=True)
                 if os.path.isfile(f)]
        blob = b"".join(open(f, "rb").read() for f in files)
        return {"bytes": sum(os.path.getsize(f) for f in files),
                "frozen_found": {n: raw(saved[n]) in blob for n in FROZEN},
                "trained_found": raw(saved["head.weight"]) in blob}
    out = {"x": scan("x"), "full": scan("full")}
    if which == "zerokern":
        meta = json.loads(open(os.path.join(d, "x", "zero", "meta.json")).read()
                          .rsplit("\n#crc32=", 1)[0])
        out["excluded"] = [e["name"] for e in meta["excluded_frozen"]]
        out["extras"] = [e["name"] for e in meta["extras"]]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import zerokern as zk

            sd = zk.checkpoint.consolidate(os.path.join(d, "x", "zero"))
        out["consolidated_keys"] = list(sd)
        out["consolidated_vs_saved"] = max(float((sd[n] - saved[n]).abs().max())
                                           for n in sd if n in saved)
        out["consolidate_warnings"] = [str(w.message) for w in caught]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            out["zero_to_fp32_keys"] = list(get_fp32_state_dict_from_zero_checkpoint(d, "x"))
        except Exception as ex:  # noqa: BLE001 - stage 0 writes no zero checkpoint
            out["zero_to_fp32_keys"] = type(ex).__name__
    return out


def _zk_worker(rank, ws, stages, base):
    return run_cases({f"s{s}": (lambda s=s: _resume_case("zerokern", rank, ws, s, base))
                      for s in stages})


def _ds_worker(rank, ws, stages, base):
    return run_cases({f"s{s}": (lambda s=s: _resume_case("deepspeed", rank, ws, s, base))
                      for s in stages})


def _zk(ws, stage):
    stages = (0, 3) if stage in (0, 3) else (stage,)
    return case(cached(_zk_worker, ws, stages, _base()), f"s{stage}")


def _ds(stage):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    stages = (0, 2) if stage in (0, 2) else (stage,)
    return case(cached(_ds_worker, 2, stages, _base()), f"s{stage}")


def _check_resume(r, which):
    assert r["load"] is None, r["load"]
    assert r["loaded_vs_saved"][1], r["loaded_vs_saved"]
    assert r["resume_vs_ref"] == (0.0, True), r["resume_vs_ref"]
    assert r["steps"][0] == r["steps"][1] == 4, r["steps"]
    # the model's frozen weights are kept, the rest loaded; zerokern says they differ
    assert r["perturbed_load"] is None and r["perturbed_emb_kept"], r
    assert r["perturbed_rest_vs_saved"][1], r["perturbed_rest_vs_saved"]
    assert r["load_warnings"] == [], r["load_warnings"]
    if which == "zerokern":
        assert len(r["perturbed_warnings"]) == 1 and "emb.weight" in r["perturbed_warnings"][0] \
            and "base.weight" not in r["perturbed_warnings"][0], r["perturbed_warnings"]
    # load_module_strict=True refuses
    assert r["strict"] is not None and all(n in r["strict"][1] for n in FROZEN), r["strict"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["2-bf16", "3-bf16"])
def test_bf16_resume_is_bitwise(stage):
    """bf16: the frozen params are held in bf16 (crc32 of those bytes), the masters fp32."""
    rs = case(cached(_zk_worker, 2, (stage,), _base()), f"s{stage}")
    for r in rs:
        _check_resume(r, "zerokern")
        assert r["shape"][0] == r["trainable"][0] == "ModelMismatchError", r
    f = rs[0]["files"]
    assert f["x"]["frozen_found"] == {n: False for n in FROZEN}, f
    assert f["full"]["frozen_found"] == {n: True for n in FROZEN}, f


def _check_files(f, which):
    for tag, expect in (("x", False), ("full", True)):
        assert f[tag]["frozen_found"] == {n: expect for n in FROZEN}, (tag, f[tag])
        assert f[tag]["trained_found"], (tag, f[tag])
    frozen_bytes = (C.VOCAB * 32 + 32 * 32 + 32) * 4
    assert f["full"]["bytes"] - f["x"]["bytes"] >= frozen_bytes, f


@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("stage", [0, 3, pytest.param(1, marks=pytest.mark.slow),
                                   pytest.param(2, marks=pytest.mark.slow)])
def test_resume_without_frozen_params_is_bitwise(ws, stage):
    for rank, r in enumerate(_zk(ws, stage)):
        _check_resume(r, "zerokern")
        assert r["strict"][0] == "ModelMismatchError" and "load_module_strict=False" in \
            r["strict"][1], r["strict"]
        # zerokern refuses before anything changes (DeepSpeed's torch load_state_dict has
        # copied the keys it holds by then)
        assert r["strict_changed"][1] and r["strict_steps"] == 0, r
        if rank == 0:
            f = r["files"]
            _check_files(f, "zerokern")
            assert f["excluded"] == list(FROZEN) and f["extras"] == ["scale"], f


@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("stage", [0, 3])
def test_frozen_param_of_another_shape_or_trainable_now_refused(ws, stage):
    for r in _zk(ws, stage):
        kind, msg = r["shape"]
        assert kind == "ModelMismatchError" and "'emb.weight'" in msg and "shape" in msg, r
        kind, msg = r["trainable"]
        assert kind == "ModelMismatchError" and "'base." in msg and "trainable" in msg, r
        for key in ("shape", "trainable"):
            assert r[key + "_changed"][1] and r[key + "_steps"] == 0, (key, r)


@pytest.mark.parametrize("stage", [0, 3])
def test_consolidate_leaves_them_out_and_says_so(stage, capsys):
    f = _zk(2, stage)[0]["files"]
    # the model's state_dict keys (its own buffer first), less the frozen params
    assert f["consolidated_keys"] == ["scale", "a.weight", "b.weight", "head.weight",
                                      "head.bias"], f
    assert f["consolidated_vs_saved"] == 0.0, f
    assert len(f["consolidate_warnings"]) == 1 and all(
        n in f["consolidate_warnings"][0] for n in FROZEN), f
    # the CLI: the rest to a file, a warning naming them, the safetensors header lists them
    from zerokern.checkpoint.cli import main

    d = os.path.join(_zk(2, stage)[0]["dir"], "x", "zero")
    out = os.path.join(_base(), f"cli-s{stage}.safetensors")
    assert main(["consolidate", d, out]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and all(n in err for n in FROZEN), err
    with open(out, "rb") as fh:
        header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
    assert json.loads(header["__metadata__"]["excluded_frozen_parameters"]) == list(FROZEN)
    assert not set(FROZEN) & set(header), header.keys()


@pytest.mark.parametrize("stage", [0, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_deepspeed_does_the_same(stage):
    """The reference: what DeepSpeed restores and what it refuses, on the same runs; and
    zerokern's resumed run against DeepSpeed's (fp32 parity, not bitwise)."""
    ds = _ds(stage)
    zk = _zk(2, stage if stage in (0, 3) else 0)  # any stage: the same math
    for r in ds:
        _check_resume(r, "deepspeed")
        assert r["perturbed_warnings"] == [], r  # DeepSpeed says nothing
        assert r["strict"][0] == "RuntimeError" and "Missing key" in r["strict"][1], r
    f = ds[0]["files"]
    _check_files(f, "deepspeed")
    if stage > 0:  # zero_to_fp32 leaves them out too, without a word
        assert not set(FROZEN) & set(f["zero_to_fp32_keys"]), f
    assert [r["steps"] for r in ds] == [r["steps"] for r in zk]
    init = _flat(dict(Lora().named_parameters())).detach()
    for z, d in zip(zk, ds):
        rel = float((z["ref"] - d["ref"]).abs().max() / (d["ref"] - init).abs().max())
        assert rel <= 1e-5, rel


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
