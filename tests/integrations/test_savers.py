"""Every saver a user reaches for, on a ZeroAdamW-trained model (issue 21, item 5 and siblings):
safetensors (save_model / load_model / save_file of model.state_dict()), accelerate
(ZeroAccelerator.save_model), transformers (save_pretrained with safetensors, from_pretrained),
torch.save of a state dict (and of one param), PEFT save_pretrained; stages 0-3, N = 1, 2, 3.

References: the model's own values (gathered, read param by param) and the key set the same
saver writes for the same model without zerokern (parent process, plain torch). Negative
control: the saver checks run on a model whose params are views of one flat buffer (what
zerokern did before the fix) and must fail.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")

from tests.engine import common as C  # noqa: E402
from tests.support.harness import cached, case, run_cases, ws_params  # noqa: E402

from . import hf_common as H  # noqa: E402

STAGES = (0, 1, 2, 3)
_TMP = tempfile.mkdtemp(prefix="zk_savers_")
atexit.register(shutil.rmtree, _TMP, True)


def _values(model):
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _load_st(path):
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(path).items()}


def _trained(rank, stage, precision):
    """A tiny GPT-2 after 2 ZeroAdamW steps (params differ from the init everywhere)."""
    import zerokern as zk

    model = C.gpt2()
    opt = zk.ZeroAdamW(model, lr=1e-2, stage=stage, precision=precision)
    for step in range(2):
        x = C.tokens(step, 0, rank)
        opt.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        opt.zero_grad()
    return model, opt


def _barrier():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _savers(rank, stage, precision, d, tmp):
    """Each saver on the trained model; rank 0 returns (model values, what each file holds)."""
    import safetensors.torch as st

    os.makedirs(d, exist_ok=True)
    model, opt = _trained(rank, stage, precision)
    out = {}
    with opt.gathered_params():  # collective at stage 3, nothing at 0-2
        values = _values(model)
        sd = model.state_dict()  # every rank (collective hooks); rank 0 writes
        if rank == 0:
            st.save_model(model, f"{d}/save_model.safetensors")
            # (the tied head is one tensor under two names: safetensors refuses that for any
            # model, so save_file users drop it, as here)
            st.save_file({k: v for k, v in sd.items() if k != "lm_head.weight"},
                         f"{d}/save_file.safetensors")
            torch.save(sd, f"{d}/torch.pt")
            torch.save({"wte": sd["transformer.wte.weight"]}, f"{d}/one.pt")
        model.save_pretrained(f"{d}/pretrained", is_main_process=rank == 0)
    _barrier()
    if rank == 0:
        from transformers import GPT2LMHeadModel

        out["save_model"] = _load_st(f"{d}/save_model.safetensors")
        out["save_file"] = _load_st(f"{d}/save_file.safetensors")
        out["torch"] = {k: v.float() for k, v in torch.load(f"{d}/torch.pt").items()}
        out["one_pt_bytes"] = os.path.getsize(f"{d}/one.pt")
        out["pretrained"] = _values(GPT2LMHeadModel.from_pretrained(f"{d}/pretrained"))
        # safetensors.load_model into a fresh plain model (strict: every key present)
        fresh = C.gpt2(seed=5)
        st.load_model(fresh, f"{d}/save_model.safetensors")
        out["load_model_plain"] = _values(fresh)
    # load_model INTO the zerokern model (stage 3: inside gathered_params(modify=True)): every
    # value taken in (safetensors.load_model reads model.state_dict() to find aliases first)
    other = f"{tmp}/other.safetensors"
    if rank == 0 and not os.path.exists(other):
        st.save_model(C.gpt2(seed=11), other)
    _barrier()
    with opt.gathered_params(modify=True):
        st.load_model(model, other)
    with opt.gathered_params():
        out["loaded_into_zk"] = _values(model)
    out["other"] = _load_st(other)
    return (values, out) if rank == 0 else None


def _accelerate_save(rank, stage, d):
    """ZeroAccelerator.save_model after two prepared steps."""
    from zerokern.integrations.accelerate import ZeroAccelerator

    H.env(rank)
    acc = ZeroAccelerator(zero_stage=stage, cpu=True)
    model = C.gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    for step in range(2):
        x = C.tokens(step, 0, rank)
        acc.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        opt.zero_grad()
    acc.save_model(model, d)  # collective at stage 3; the main process writes
    with acc.zero_optimizer.gathered_params():
        values = _values(model)
    _barrier()
    return (values, _load_st(f"{d}/model.safetensors")) if rank == 0 else None


def _peft_save(rank, stage, d):
    """PEFT LoRA adapters saved with save_pretrained (safetensors) and loaded back."""
    from peft import LoraConfig, PeftModel, get_peft_model

    import zerokern as zk

    model = get_peft_model(C.gpt2(), LoraConfig(r=4, target_modules=["c_attn"],
                                                lora_dropout=0.0, init_lora_weights=False))
    opt = zk.ZeroAdamW(model, lr=1e-2, stage=stage, precision="fp32")
    x = C.tokens(0, 0, rank)
    opt.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    with opt.gathered_params():
        values = {n: v for n, v in _values(model).items() if "lora_" in n}
        model.save_pretrained(d, is_main_process=rank == 0)
    _barrier()
    if rank != 0:
        return None
    loaded = PeftModel.from_pretrained(C.gpt2(), d)
    return values, {n: v for n, v in _values(loaded).items() if "lora_" in n}


def _worker(rank, ws, tmp):
    d = f"{tmp}/n{ws}"
    cases = {}
    for s in STAGES:
        cases[f"savers-s{s}-fp32"] = lambda s=s: _savers(rank, s, "fp32", f"{d}/s{s}", tmp)
        cases[f"accelerate-s{s}"] = lambda s=s: _accelerate_save(rank, s, f"{d}/acc{s}")
    if ws == 2:
        for s in (2, 3):
            cases[f"savers-s{s}-bf16"] = lambda s=s: _savers(rank, s, "bf16", f"{d}/b{s}", tmp)
            cases[f"peft-s{s}"] = lambda s=s: _peft_save(rank, s, f"{d}/peft{s}")
    return run_cases(cases)


def _runs(ws):
    return cached(_worker, ws, _TMP)


# ---- the checks (also run on the negative control) -------------------------------------------
def _same(saved, values, keys=None):
    """The file holds every expected key, each equal to the model's value (exact)."""
    keys = set(values) if keys is None else keys
    missing = keys - set(saved)
    assert not missing, f"saved file is missing {sorted(missing)[:5]} ({len(missing)} keys)"
    for k in keys:
        assert torch.equal(saved[k], values[k]), k


_REF_KEYS = {}


def _reference_keys(saver):
    """The keys the same saver writes for the same model without zerokern (parent process):
    the tied lm_head / wte pair is one tensor, and each saver keeps its own choice of name."""
    if saver not in _REF_KEYS:
        import safetensors.torch as st

        d = tempfile.mkdtemp(dir=_TMP)
        model = C.gpt2()
        if saver == "safetensors":
            st.save_model(model, f"{d}/m.safetensors")
        else:
            _plain_accelerator().save_model(model, d)
        _REF_KEYS[saver] = set(_load_st(f"{d}/{'m' if saver == 'safetensors' else 'model'}"
                                        ".safetensors"))
    return _REF_KEYS[saver]


def _plain_accelerator():
    """accelerate.Accelerator in this (pytest) process: one process, no process group."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(k, None)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=True)


def _tied(values):
    """Model values under every state-dict name (the tied head under both of its names)."""
    return {**values, "lm_head.weight": values["transformer.wte.weight"]}


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("ws", ws_params(1, 2, 3))
@pytest.mark.parametrize("stage", STAGES)
def test_safetensors_torch_transformers_savers(stage, ws):
    runs = [(f"savers-s{stage}-fp32")] + ([f"savers-s{stage}-bf16"]
                                          if ws == 2 and stage in (2, 3) else [])
    ref_keys = _reference_keys("safetensors")
    for name in runs:
        values, out = case(_runs(ws), name)[0]
        sd_keys = set(values) | {"lm_head.weight"}  # the tied head: in state_dict, not params
        values = _tied(values)
        _same(out["save_model"], values, ref_keys)
        _same(out["save_file"], values, sd_keys - {"lm_head.weight"})
        _same(out["torch"], values, sd_keys)
        _same(out["pretrained"], values, set(out["pretrained"]))
        _same(out["load_model_plain"], values, set(out["load_model_plain"]))
        # one param's torch.save holds that param, not the whole flat buffer
        assert out["one_pt_bytes"] < values["transformer.wte.weight"].numel() * 4 + 4096
        # load_model into the zerokern model took every value (bf16: rounded once)
        dt = torch.bfloat16 if name.endswith("bf16") else torch.float32
        other = _tied(out["other"]) if "transformer.wte.weight" in out["other"] else \
            {**out["other"], "transformer.wte.weight": out["other"]["lm_head.weight"]}
        for k, v in out["loaded_into_zk"].items():
            want = other[k]
            assert torch.equal(v, want.to(dt).float()), k


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("ws", ws_params(1, 2, 3))
@pytest.mark.parametrize("stage", STAGES)
def test_accelerate_save_model_holds_every_param(stage, ws):
    values, saved = case(_runs(ws), f"accelerate-s{stage}")[0]
    _same(saved, _tied(values), _reference_keys("accelerate"))


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("stage", [2, 3])
def test_peft_save_pretrained(stage):
    pytest.importorskip("peft")
    values, loaded = case(_runs(2), f"peft-s{stage}")[0]
    assert values and values.keys() == loaded.keys()
    for k in values:
        assert torch.equal(values[k], loaded[k]), k


def test_negative_control_views_of_one_buffer(tmp_path):
    """Params as plain views of one flat buffer (the old layout): accelerate's save_model
    drops params and safetensors.save_model refuses, and the checks above see it."""
    import safetensors.torch as st

    keys = _reference_keys("accelerate")
    model = C.gpt2()
    ps = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in ps])
    o = 0
    for p in ps:
        p.data = flat[o:o + p.numel()].view(p.shape)
        o += p.numel()
    values = _tied(_values(model))
    _plain_accelerator().save_model(model, str(tmp_path))
    with pytest.raises(AssertionError, match="missing"):
        _same(_load_st(f"{tmp_path}/model.safetensors"), values, keys)
    with pytest.raises(RuntimeError, match="covering the entire storage"):
        st.save_model(model, str(tmp_path / "x.safetensors"))
