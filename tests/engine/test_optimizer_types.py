"""Optimizer types beyond Adam/AdamW (issue 23): DeepSpeed's config `"optimizer": {"type":
"Lion"}`, a client lion-pytorch / bitsandbytes Lion handed to `zerokern.initialize` or to
`ZeroAccelerator`, and `ZeroTrainer(args.optim="lion_32bit")` all train with ZeroLion, equal
to the library's own Lion on the same model and data; what zerokern cannot honour is a
ValueError/TypeError naming it. DeepSpeed's own CPU Lion is the reference in a slow test (its
op compiles for minutes on a busy machine)."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

import zerokern as zk
from zerokern.engine import parse_config
from zerokern.engine.convert import zero_from_torch

from . import common as C

TOL = 1e-6  # fp32, the same elementwise update and data: only summation order differs
LION = {"lr": 3e-3, "betas": [0.8, 0.9], "weight_decay": 0.1}


def _cfg(opt, gas=1, **zero):
    cfg = C.base_config(2, "fp32", gas=gas, **zero)
    cfg["optimizer"] = opt
    cfg["gradient_clipping"] = 0  # DeepSpeed 0.19 clips at 1.0 by default; the references don't
    return cfg


def _train_engine(engine, steps=4):
    for s in range(steps):
        x = C.tokens(s, 0, 0)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    return [p.detach().clone() for p in engine.module.parameters()]


def _train_reference(model, opt, steps=4):
    for s in range(steps):
        x = C.tokens(s, 0, 0)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _rel(a, b):
    num = sum(float((x - y).double().pow(2).sum()) for x, y in zip(a, b)) ** 0.5
    den = sum(float(y.double().pow(2).sum()) for y in b) ** 0.5
    return num / den


def _lion_reference(lr_factor=1.0, steps=4):
    from lion_pytorch import Lion

    model = C.gpt2()
    opt = Lion(model.parameters(), lr=LION["lr"] * lr_factor, betas=tuple(LION["betas"]),
               weight_decay=LION["weight_decay"])
    return _train_reference(model, opt, steps)


def test_config_type_lion_trains_as_lion_pytorch():
    engine, opt, _, _ = zk.initialize(model=C.gpt2(), config=_cfg({"type": "Lion",
                                                                     "params": LION}))
    assert isinstance(opt, zk.ZeroLion) and opt.stage == 2
    got = _train_engine(engine)
    assert _rel(got, _lion_reference()) <= TOL
    assert _rel(got, _lion_reference(lr_factor=1.01)) > 100 * TOL  # negative control


def test_config_lion_defaults_are_deepspeeds():
    """Omitted params take DeepSpeed's Lion defaults (not lion-pytorch's), read from
    DeepSpeed's own FusedLion and DeepSpeedCPULion signatures."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

    _, opt, _, _ = zk.initialize(model=C.gpt2(), config=_cfg({"type": "lion"}))
    g = opt.param_groups[0]
    for cls in (FusedLion, DeepSpeedCPULion):
        sig = inspect.signature(cls.__init__).parameters
        assert g["lr"] == sig["lr"].default
        assert tuple(g["betas"]) == tuple(sig["betas"].default)
        assert g["weight_decay"] == sig["weight_decay"].default


@pytest.mark.parametrize("opt_cfg,key", [
    ({"type": "SGD", "params": {"lr": 0.1}}, "optimizer.type"),
    ({"type": "OneBitAdam", "params": {}}, "optimizer.type"),
    ({"type": "Lion", "params": {"eps": 1e-8}}, "optimizer.params.eps"),
    ({"type": "Lion", "params": {"betas": [0.9]}}, "optimizer.params.betas"),
    ({"type": "Lion", "params": {"lr": -1.0}}, "optimizer.params.lr"),
])
def test_unsupported_types_and_params_raise_naming_the_key(opt_cfg, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        parse_config(_cfg(opt_cfg), world_size=1)


def test_client_lion_pytorch_is_converted():
    from lion_pytorch import Lion

    model = C.gpt2()
    client = Lion(model.parameters(), lr=LION["lr"], betas=tuple(LION["betas"]),
                  weight_decay=LION["weight_decay"])
    engine, opt, _, _ = zk.initialize(model=model, optimizer=client,
                                      config=_cfg({"type": "AdamW", "params": {}}))
    assert isinstance(opt, zk.ZeroLion)
    assert _rel(_train_engine(engine), _lion_reference()) <= TOL


def test_bitsandbytes_lion_32bit_is_converted_8bit_raises():
    bnb = pytest.importorskip("bitsandbytes")  # a [test] extra: present in CI
    model = C.gpt2()
    opt = bnb.optim.Lion(model.parameters(), lr=LION["lr"], betas=tuple(LION["betas"]),
                         weight_decay=LION["weight_decay"], optim_bits=32)
    zopt = zero_from_torch(opt, model, stage=1, precision="fp32")
    assert isinstance(zopt, zk.ZeroLion)
    g = zopt.param_groups[0]
    assert (g["lr"], tuple(g["betas"]), g["weight_decay"]) == \
        (LION["lr"], tuple(LION["betas"]), LION["weight_decay"])
    zopt.close()
    model = C.gpt2()
    with pytest.raises(ValueError, match="8-bit Lion"):
        zero_from_torch(bnb.optim.Lion8bit(model.parameters()), model, stage=1,
                        precision="fp32")


def test_other_client_optimizers_raise_naming_the_class():
    model = C.gpt2()
    with pytest.raises(TypeError, match="SGD"):
        zero_from_torch(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=1)


def test_trainer_optim_lion_32bit_and_unknown_names(tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import TrainingArguments

    from zerokern.integrations.transformers import ZeroTrainer

    ds = [{"input_ids": C.tokens(s, 0, 0)[0], "labels": C.tokens(s, 0, 0)[0]} for s in range(8)]

    def args(optim):
        return TrainingArguments(output_dir=str(tmp_path), optim=optim, learning_rate=3e-3,
                                 weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.9,
                                 per_device_train_batch_size=2, max_steps=3,
                                 lr_scheduler_type="constant", report_to=[], use_cpu=True,
                                 save_strategy="no", logging_strategy="no")

    model = C.gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = ZeroTrainer(model=model, args=args("lion_32bit"), train_dataset=ds, zero_stage=2)
    trainer.train()
    assert isinstance(trainer.zero_optimizer, zk.ZeroLion)
    g = trainer.zero_optimizer.param_groups
    assert {tuple(x["betas"]) for x in g} == {(0.8, 0.9)}
    assert {x["weight_decay"] for x in g} == {0.1, 0.0}  # Trainer's no-decay group kept
    assert _rel([p.detach() for p in model.parameters()], before) > 1e-4
    with pytest.raises(ValueError, match="adafactor"):
        ZeroTrainer(model=C.gpt2(), args=args("adafactor"), train_dataset=ds)


def _ds_lion_worker(rank, ws):
    from tests.support.harness import run_cases

    cfg = _cfg({"type": "Lion", "params": LION}, gas=2, offload_optimizer={"device": "cpu"})
    return run_cases({"losses": lambda: (C.train("deepspeed", rank, cfg, steps=5),
                                         C.train("zerokern", rank, cfg, steps=5))})


@pytest.mark.slow
def test_lion_matches_deepspeed_cpu_lion():
    """DeepSpeed's DeepSpeedCPULion (offload_optimizer cpu; its FusedLion needs CUDA) on 2
    gloo ranks, stage 2, accumulation 2: the per-step losses equal zerokern's (measured: bitwise
    at 1 rank)."""
    from tests.support.harness import cached, case

    for ds, ours in case(cached(_ds_lion_worker, 2), "losses"):
        assert max(abs(a - b) / abs(a) for a, b in zip(ds, ours)) <= 1e-5, (ds, ours)


# ---- Muon ---------------------------------------------------------------------------------------
MUON = {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.05, "betas": [0.8, 0.9], "eps": 1e-8,
        "adam_lr": 2e-3, "ns_method": "standard"}


def test_config_type_muon_trains_as_zero_muon():
    """{"type": "Muon"} builds ZeroMuon with DeepSpeed's update (Nesterov, lr scaled by
    sqrt(max(1, rows/cols)) = torch's adjust_lr_fn="original") and halves (adam_lr, betas,
    eps on the AdamW params; the head and embeddings there); equal to ZeroMuon built by hand
    (itself equal to torch.optim.Muon + AdamW: tests/rules/test_muon.py)."""
    engine, opt, _, _ = zk.initialize(model=C.gpt2(), config=_cfg({"type": "Muon",
                                                                     "params": MUON}))
    assert isinstance(opt, zk.ZeroMuon)
    got = _train_engine(engine)
    muon_groups = [g for g in opt.param_groups if g["use_muon"]]
    adam_groups = [g for g in opt.param_groups if not g["use_muon"]]
    assert {(g["lr"], g["momentum"], g["weight_decay"], g["adjust_lr_fn"], g["nesterov"])
            for g in muon_groups} == {(0.01, 0.9, 0.05, "original", True)}
    assert {(g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in adam_groups} == \
        {(2e-3, (0.8, 0.9), 1e-8, 0.05)}

    def by_hand(lr_factor=1.0):
        model = C.gpt2()
        opt = zk.ZeroMuon(model, lr=0.01 * lr_factor, momentum=0.9, weight_decay=0.05,
                          adjust_lr_fn="original", adamw_lr=2e-3, adamw_betas=(0.8, 0.9),
                          adamw_eps=1e-8, adamw_weight_decay=0.05, stage=2, precision="fp32")
        return _train_reference(model, opt)

    assert _rel(got, by_hand()) <= TOL
    assert _rel(got, by_hand(1.01)) > 100 * TOL  # negative control


def test_config_muon_defaults_are_deepspeeds():
    """Omitted params take DeepSpeed's MuonWithAuxAdam defaults (read from its source file),
    ns_method its "gram" (tests/engine/test_deepspeed_muon_gram.py); a method DeepSpeed does
    not have is a ValueError naming the key."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from pathlib import Path

    import deepspeed

    src = (Path(deepspeed.__file__).parent / "runtime/zero/muon/original_muon.py").read_text()
    for key, value in (("lr", "0.02"), ("momentum", "0.95"), ("lr", "3e-4"),
                       ("betas", "(0.9, 0.95)"), ("eps", "1e-10")):
        assert f'group.get("{key}", {value})' in src, (key, value)
    _, opt, _, _ = zk.initialize(model=C.gpt2(), config=_cfg(
        {"type": "muon", "params": {"ns_method": "standard"}}))
    m = [g for g in opt.param_groups if g["use_muon"]][0]
    a = [g for g in opt.param_groups if not g["use_muon"]][0]
    assert (m["lr"], m["momentum"], m["weight_decay"]) == (0.02, 0.95, 0.0)
    assert (a["lr"], tuple(a["betas"]), a["eps"], a["weight_decay"]) == \
        (3e-4, (0.9, 0.95), 1e-10, 0.0)
    assert m["ns_method"] == "standard"
    _, opt, _, _ = zk.initialize(model=C.gpt2(), config=_cfg({"type": "muon", "params": {}}))
    assert {g["ns_method"] for g in opt.param_groups if g["use_muon"]} == {"gram"}
    for params in ({"ns_method": "newton"}, {"ns_method": None}):
        with pytest.raises(ValueError, match=r"optimizer\.params\.ns_method"):
            parse_config(_cfg({"type": "Muon", "params": params}), world_size=1)


def test_bf16_lion_config_uses_the_compact_master_bitwise():
    """A bf16 Lion config gets master="compact" (as AdamW); the same training bit for bit as
    ZeroLion with the plain fp32 master (the compact master is lossless)."""
    cfg = _cfg({"type": "Lion", "params": LION})
    cfg["bf16"] = {"enabled": True}
    engine, opt, _, _ = zk.initialize(model=C.gpt2(), config=cfg)
    assert isinstance(opt, zk.ZeroLion) and opt.master == "compact"
    got = _train_engine(engine)
    model = C.gpt2()
    ref = zk.ZeroLion(model, lr=LION["lr"], betas=tuple(LION["betas"]),
                      weight_decay=LION["weight_decay"], stage=2, precision="bf16")
    assert ref.master == "fp32"
    want = _train_reference(model, ref)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_bitsandbytes_adamw_converts_with_its_state_bits():
    """bitsandbytes' AdamW8bit (Trainer's optim="adamw_8bit") -> ZeroAdamW(state_bits=8) with
    its groups' hyperparameters; its 32-bit AdamW -> fp32 states."""
    bnb = pytest.importorskip("bitsandbytes")
    for cls, bits in ((bnb.optim.AdamW8bit, 8), (bnb.optim.AdamW32bit, 32)):
        model = C.gpt2()
        opt = cls(model.parameters(), lr=2e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2)
        zopt = zero_from_torch(opt, model, stage=1, precision="fp32")
        assert isinstance(zopt, zk.ZeroAdamW) and zopt.state_bits == bits
        g = zopt.param_groups[0]
        assert (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"], g["adamw"]) == \
            (2e-3, (0.8, 0.9), 1e-6, 0.2, True)
        zopt.close()
