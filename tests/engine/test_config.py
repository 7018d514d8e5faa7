"""DeepSpeed config keys: each key group changes behaviour as DeepSpeed documents; unknown,
'auto', inconsistent and unhonourable keys raise naming the key; no-effect keys are logged
once. World size 1 in this process, plus one spawn of 2 gloo ranks (loader, checkpoint)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import zerokern as zk
from tests.support.harness import cached, case, run_cases  # noqa: E402
from zerokern.engine import parse_config
from zerokern.engine import schedulers as S

from . import common as C

TOL = 1e-6  # params vs torch AdamW + clip_grad_norm_ on the same accumulated grads (fp32)


def _cfg(**over):
    cfg = C.base_config(2, "fp32", gas=2)
    cfg.update(over)
    return cfg


def _engine(cfg, model=None):
    model = C.gpt2() if model is None else model
    return zk.initialize(model=model, model_parameters=model.parameters(), config=cfg)


# ---- batch sizes ----------------------------------------------------------------------------
@pytest.mark.parametrize("given,expect", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, (16, 2, 4)),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 4}, (16, 2, 4)),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, (16, 2, 4)),
    ({"train_batch_size": 16}, (16, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, (6, 3, 1)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 4}, (16, 2, 4)),
])
def test_batch_triple_any_two_imply_the_third(given, expect):
    c = parse_config(given, world_size=2)
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == expect


@pytest.mark.parametrize("given", [
    {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
    {"train_batch_size": 15, "train_micro_batch_size_per_gpu": 2},
    {"gradient_accumulation_steps": 2},
])
def test_batch_triple_inconsistent_raises(given):
    with pytest.raises(ValueError, match="train_batch_size|train_micro_batch_size_per_gpu"):
        parse_config(given, world_size=2)


# ---- errors name the key --------------------------------------------------------------------
@pytest.mark.parametrize("mutate,key", [
    (lambda c: c.update(foo=1), "foo"),
    (lambda c: c["zero_optimization"].update(stage3_foo=1), "zero_optimization.stage3_foo"),
    (lambda c: c.update(fp16={"enabled": True, "scale": 2}), "fp16.scale"),
    (lambda c: c["optimizer"]["params"].update(momentum=0.9), "optimizer.params.momentum"),
    (lambda c: c["optimizer"].update(type="SGD"), "optimizer.type"),
    (lambda c: c["zero_optimization"].update(offload_optimizer={"device": "nvme"}),
     "zero_optimization.offload_optimizer.nvme_path"),
    (lambda c: c["zero_optimization"].update(offload_optimizer={"device": "disk"}),
     "zero_optimization.offload_optimizer.device"),
    # (offload_param at stage 0-2 is ignored with a warning, as DeepSpeed:
    # test_deepspeed_expectations.py::test_offload_param_below_stage_3_is_ignored_with_a_warning)
    (lambda c: c["zero_optimization"].update(offload_param={"device": "cpu", "ratio": 0.5}),
     "zero_optimization.offload_param.ratio"),  # still validated at stage 2
    (lambda c: c["zero_optimization"].update(stage=3, offload_param={"device": "ssd"}),
     "zero_optimization.offload_param.device"),
    (lambda c: c["zero_optimization"].update(stage=3, offload_param={"device": "nvme"}),
     "zero_optimization.offload_param.nvme_path"),
    (lambda c: c["zero_optimization"].update(
        stage=3, offload_optimizer={"device": "cpu"},
        offload_param={"device": "nvme", "nvme_path": "/tmp"}),
     "zero_optimization.offload_param.device"),
    (lambda c: c["zero_optimization"].update(
        stage=3, offload_optimizer={"device": "nvme", "nvme_path": "/tmp"},
        offload_param={"device": "nvme", "nvme_path": "/var/tmp"}),
     "zero_optimization.offload_param.nvme_path"),
    (lambda c: c["zero_optimization"].update(stage=3, offload_param={"device": "cpu",
                                                                     "ratio": 0.5}),
     "zero_optimization.offload_param.ratio"),
    (lambda c: c["zero_optimization"].update(stage=4), "zero_optimization.stage"),
    (lambda c: c.update(train_micro_batch_size_per_gpu="auto"), "train_micro_batch_size_per_gpu"),
    (lambda c: c.update(scheduler={"type": "WarmupLR", "params": {"warmup_steps": 3}}),
     "scheduler.params.warmup_steps"),
    (lambda c: c.update(scheduler={"type": "StepLR"}), "scheduler.type"),
    (lambda c: c.update(fp16={"enabled": True}, bf16={"enabled": True}), "fp16.enabled"),
    (lambda c: c["zero_optimization"].update(overlap_comm="yes"), "zero_optimization.overlap_comm"),
])
def test_bad_keys_raise_naming_the_key(mutate, key):
    cfg = _cfg()
    mutate(cfg)
    model = C.gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        zk.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # untouched


def test_no_effect_keys_are_logged_once(caplog, tmp_path):
    cfg = _cfg()
    cfg["zero_optimization"].update(contiguous_gradients=True, overlap_comm=True,
                                    allgather_bucket_size=2e8)
    path = tmp_path / "ds.json"
    import json

    path.write_text(json.dumps(cfg))  # config as a JSON path
    with caplog.at_level(logging.INFO, logger="zerokern.engine"):
        engine, *_ = zk.initialize(model=C.gpt2(), config=str(path))
    lines = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert len(lines) == 1
    for k in ("contiguous_gradients", "overlap_comm", "allgather_bucket_size"):
        assert f"zero_optimization.{k}" in lines[0]
    assert ("zero_optimization.contiguous_gradients" in dict(engine.config.no_effect))
    # DeepSpeed's aliases: config_params=, and args.deepspeed_config (a JSON path)
    import argparse

    for kw in ({"config_params": cfg}, {"args": argparse.Namespace(deepspeed_config=str(path))}):
        engine, *_ = zk.initialize(model=C.gpt2(), **kw)
        assert engine.gradient_accumulation_steps() == 2 and engine.optimizer.stage == 2


# ---- optimizer / precision / zero_optimization map onto ZeroAdamW --------------------------
def test_optimizer_params_map():
    cfg = _cfg(optimizer={"type": "Adam", "params": {"lr": 0.01, "betas": [0.7, 0.8],
                                                     "eps": 1e-4, "weight_decay": 0.2,
                                                     "adam_w_mode": False}})
    _, opt, _, _ = _engine(cfg)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"], g["adamw"]) == \
        (0.01, (0.7, 0.8), 1e-4, 0.2, False)  # Adam + adam_w_mode false = L2
    # weight_decay defaults: DeepSpeed's fused/CPU Adam 0; torch_adam -> torch's AdamW 0.01
    _, opt, _, _ = _engine(_cfg(optimizer={"type": "AdamW", "params": {}}))
    assert opt.param_groups[0]["weight_decay"] == 0.0 and opt.param_groups[0]["adamw"]
    _, opt, _, _ = _engine(_cfg(optimizer={"type": "AdamW", "params": {"torch_adam": True}}))
    assert opt.param_groups[0]["weight_decay"] == 0.01


def test_precision_and_loss_scale_map():
    model = C.gpt2()
    _, opt, _, _ = _engine(_cfg(bf16={"enabled": True}), model)
    assert opt.precision == "bf16" and all(p.dtype == torch.bfloat16 for p in model.parameters())
    _, opt, _, _ = _engine(_cfg(fp16={"enabled": True, "loss_scale": 128}))
    assert opt.precision == "fp16" and float(opt.loss_scale) == 128 and not opt.scaler.dynamic
    _, opt, _, _ = _engine(_cfg(fp16={"enabled": True, "initial_scale_power": 10,
                                      "loss_scale_window": 50, "hysteresis": 3,
                                      "min_loss_scale": 4}))
    s = opt.scaler
    assert float(opt.loss_scale) == 1024 and s.dynamic
    assert (s.growth_interval, s.hysteresis, s.min_scale) == (50, 3, 4.0)


def test_zero_optimization_maps():
    cfg = _cfg()
    cfg["zero_optimization"] = {"stage": 1, "reduce_bucket_size": 3000,
                                "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    engine, opt, _, _ = _engine(cfg)
    assert opt.stage == 1 and opt.offload == "cpu"
    # 3000 ELEMENTS (DeepSpeed's unit) of fp32 = 11.7 KiB buckets (zerokern's MiB)
    assert engine.config.bucket_mb == pytest.approx(3000 * 4 / 2**20)
    assert opt.flat_groups[0].layout.bucket_numel <= 3000 + 2 * 128
    assert opt.flat_groups[0].layout.n_buckets > 1
    cfg["communication_data_type"] = "bf16"
    assert _engine(cfg)[1].reduce_dtype == torch.bfloat16


def test_stage3_gather_16bit_weights_on_model_save(tmp_path):
    cfg = _cfg()
    cfg["zero_optimization"] = {"stage": 3}
    engine, *_ = _engine(cfg)
    assert engine.save_16bit_model(str(tmp_path / "a")) is False  # DeepSpeed's rule
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    model = C.gpt2()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    engine, *_ = _engine(cfg, model)
    assert engine.save_16bit_model(str(tmp_path / "b"))
    sd = torch.load(tmp_path / "b" / "pytorch_model.bin")
    assert all(torch.equal(sd[k], ref[k]) for k in ref)


# ---- accumulation, clipping, scheduler: against torch doing it by hand ---------------------
def _by_hand(steps, gas, clip, sched_fn=None):
    model = C.gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.8, 0.9), eps=1e-6,
                            weight_decay=0.1)
    sched = sched_fn(opt) if sched_fn else None
    for s in range(steps):
        for m in range(gas):
            x = C.tokens(s, m, 0)
            (model(input_ids=x, labels=x).loss / gas).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    return [p.detach().clone() for p in model.parameters()], opt


def _by_engine(cfg, steps):
    model = C.gpt2()
    engine, opt, _, sched = _engine(cfg, model)
    gas = engine.gradient_accumulation_steps()
    seen = []
    for s in range(steps):
        for m in range(gas):
            x = C.tokens(s, m, 0)
            before = [p.detach().clone() for p in model.parameters()]
            engine.backward(engine(input_ids=x, labels=x).loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
            seen.append((boundary, moved))
    return [p.detach().clone() for p in model.parameters()], engine, seen


@pytest.mark.parametrize("gas,clip", [(1, 0.0), (3, 0.0), (3, 0.05)])
def test_accumulation_and_clipping(gas, clip):
    cfg = _cfg(gradient_accumulation_steps=gas, gradient_clipping=clip)
    mine, engine, seen = _by_engine(cfg, 3)
    ref, _ = _by_hand(3, gas, clip)
    assert all(b == m for b, m in seen)  # params move exactly at the boundaries
    assert engine.global_steps == 3 and engine.micro_steps == 3 * gas
    assert engine.train_batch_size() == gas * C.MICRO_BATCH
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
    if clip == 0.0 and gas == 3:  # the control: the clip above really changed the result
        clipped, _, _ = _by_engine(_cfg(gradient_accumulation_steps=3, gradient_clipping=0.05), 3)
        assert max(float((a - b).abs().max()) for a, b in zip(mine, clipped)) > 1e-4


def test_scheduler_drives_the_engine():
    sched_cfg = {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_min_lr": 0.0,
                                                     "warmup_max_lr": 3e-3, "warmup_num_steps": 3,
                                                     "warmup_type": "linear"}}
    mine, engine, _ = _by_engine(_cfg(gradient_clipping=0.0, scheduler=sched_cfg), 4)
    ref, _ = _by_hand(4, 2, 0.0, lambda o: S.WarmupDecayLR(o, **sched_cfg["params"]))
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
    assert engine.get_lr() == [pytest.approx(3e-3 * 3 / 3)]  # index 3: decay starts


# ---- schedules vs DeepSpeed's own (the reference) -------------------------------------------
SCHEDS = [
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 7}),
    ("WarmupLR", {"warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_max_lr": 2e-3, "warmup_num_steps": 5}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_min_ratio": 0.1, "warmup_num_steps": 4,
                        "cos_min_ratio": 0.05}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 5,
                  "cycle_second_step_size": 7, "decay_step_size": 2, "decay_lr_rate": 0.1,
                  "decay_mom_rate": 0.05, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 6,
                  "cycle_first_stair_count": 3, "cycle_momentum": False}),
]


@pytest.mark.filterwarnings("ignore:Detected call of")  # no optimizer steps here, by design
@pytest.mark.parametrize("name,params", SCHEDS)
def test_schedules_match_deepspeed(name, params):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    lrs = pytest.importorskip("deepspeed.runtime.lr_schedules",
                              reason="deepspeed is not installed")

    def opt():
        w = torch.nn.Parameter(torch.zeros(2))
        return torch.optim.AdamW([{"params": [w]}], lr=5e-3, betas=(0.9, 0.999))

    mine_opt, ref_opt = opt(), opt()
    mine = getattr(S, name)(mine_opt, **params)
    ref = getattr(lrs, name)(ref_opt, **params)
    for _ in range(25):
        for key in ("lr", "betas"):
            a, b = mine_opt.param_groups[0][key], ref_opt.param_groups[0][key]
            assert a == pytest.approx(b, rel=1e-12, abs=1e-15), (name, key)
        mine.step()
        ref.step()


# ---- 2 ranks: the loader and checkpoints across world sizes ---------------------------------
def _two_ranks(rank, ws, path):
    def loader():
        C.launcher_env(rank)
        data = torch.utils.data.TensorDataset(torch.arange(40))
        engine, _, dl, _ = zk.initialize(model=C.gpt2(), config=_cfg(), training_data=data)
        assert isinstance(dl.sampler, torch.utils.data.distributed.DistributedSampler)
        return [b[0].tolist() for b in dl]

    def save():
        engine, _, _, _ = _engine(_cfg(scheduler={"type": "WarmupLR",
                                                  "params": {"warmup_num_steps": 4}}))
        for s in range(3):
            for m in range(2):
                x = C.tokens(s, m, rank)
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()
        engine.save_checkpoint(path, client_state={"epoch": 7})
        return engine.get_lr(), engine.global_steps

    return run_cases({"loader": loader, "save": save})


@pytest.mark.slow  # (12 s; the engine's checkpoint across world sizes: also test_async_save's engine case)
def test_loader_and_checkpoint_across_world_sizes(tmp_path):
    res = cached(_two_ranks, 2, str(tmp_path))
    batches = case(res, "loader")
    assert all(len(b) == C.MICRO_BATCH for bs in batches for b in bs)
    seen = sorted(i for bs in batches for b in bs for i in b)
    assert seen == list(range(40))  # each sample once across the 2 ranks
    lr, steps = case(res, "save")[0]
    # load the 2-rank stage-2 checkpoint at world size 1, stage 3
    cfg = _cfg(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4}})
    cfg["zero_optimization"] = {"stage": 3}
    engine, *_ = _engine(cfg)
    path, client = engine.load_checkpoint(str(tmp_path))
    assert client == {"epoch": 7} and path.endswith(f"global_step{steps}")
    assert engine.global_steps == steps and engine.get_lr() == lr
    assert engine.load_checkpoint(str(tmp_path / "nothing")) == (None, None)


# ---- the process group from the launcher's environment -------------------------------------
@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_init_distributed_from_launcher_env(launcher):
    """torchrun/deepspeed set RANK/WORLD_SIZE/LOCAL_RANK; mpirun OMPI_COMM_WORLD_*; gloo on
    a CPU-only machine. (A subprocess: the default group is process-wide.)"""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("OMPI_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    if launcher == "torchrun":
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    else:
        env.update(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="1",
                   OMPI_COMM_WORLD_LOCAL_RANK="0")
    code = ("import torch.distributed as d, zerokern; zerokern.init_distributed(); "
            "print(d.get_backend(), d.get_rank(), d.get_world_size())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == ["gloo", "0", "1"]


def _losses(cfg, steps=3):
    engine, opt, _, _ = _engine(cfg)
    out = []
    for s in range(steps):
        for m in range(engine.gradient_accumulation_steps()):
            x = C.tokens(s, m, 0)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            out.append(float(loss.detach()))
    return out, opt


def test_offload_optimizer_nvme_maps(tmp_path):
    """offload_optimizer.device 'nvme' with nvme_path is ZeroAdamW(offload='nvme',
    offload_path=nvme_path): the same losses as the 'cpu' device, bit for bit."""
    cfg = _cfg()
    cfg["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    ref, _ = _losses(cfg)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme",
                                                     "nvme_path": str(tmp_path)}
    got, opt = _losses(cfg)
    assert opt.offload == "nvme" and any(tmp_path.iterdir())
    assert got == ref
    opt.close()


def test_offload_param_maps(tmp_path, caplog):
    """offload_param.device 'cpu' is ZeroAdamW(offload_params='cpu'), 'nvme' with nvme_path
    (the offload_optimizer's) offload_params='nvme': the same losses as without it, bit for
    bit; pin_memory and the buffer sizes are accepted and logged as having no effect."""
    base = C.base_config(3, "bf16")
    losses = {}
    for name, zero in [
            ("none", {}),
            ("cpu", {"offload_param": {"device": "cpu", "pin_memory": True}}),
            ("nvme_opt", {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}),
            ("nvme", {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
                      "offload_param": {"device": "nvme", "nvme_path": str(tmp_path),
                                        "buffer_count": 5, "buffer_size": 1e8,
                                        "max_in_cpu": 1e9}})]:
        cfg = dict(base, zero_optimization={"stage": 3, "reduce_bucket_size": 3000, **zero})
        with caplog.at_level(logging.INFO, logger="zerokern.engine"):
            engine, opt, _, _ = zk.initialize(model=C.gpt2(), config=cfg)
        assert opt.offload_params == (name if name in ("cpu", "nvme") else None)
        out = []
        for s in range(3):
            for m in range(2):
                x = C.tokens(s, m, 0)
                loss = engine(input_ids=x, labels=x).loss
                engine.backward(loss)
                engine.step()
                out.append(float(loss.detach()))
        losses[name] = out
        if name == "nvme":
            assert any(p.name.endswith("-params.bin") for p in tmp_path.iterdir())
        opt.close()
    assert losses["cpu"] == losses["none"] and losses["nvme"] == losses["nvme_opt"]
    logged = " ".join(r.getMessage() for r in caplog.records if "no effect" in r.getMessage())
    for k in ("offload_param.pin_memory", "offload_param.buffer_count",
              "offload_param.max_in_cpu"):
        assert k in logged


# ---- master="compact" (issue 12) --------------------------------------------------------------
@pytest.mark.parametrize("stage,precision,offload,want", [
    (1, "bf16", None, "compact"), (2, "bf16", None, "compact"), (0, "bf16", None, "compact"),
    (3, "bf16", None, "fp32"), (2, "fp16", None, "fp32"), (2, "fp32", None, "fp32"),
    (2, "bf16", "cpu", "fp32")])
def test_initialize_uses_the_compact_master_for_bf16_on_the_device(stage, precision, offload,
                                                                  want):
    zero = {"offload_optimizer": {"device": offload}} if offload else {}
    cfg = C.base_config(stage, precision, gas=1, **zero)
    engine, opt, _, _ = _engine(cfg)
    assert opt.master == want
    x = C.tokens(0, 0, 0)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    if want == "compact":  # the chunked path ran and the master is held compact
        assert all(g.state.compact_pieces > 0 and not g.state.expanded for g in opt.flat_groups)
        rep = opt.memory_report()
        held = sum(4 * g.state_numel for g in opt.flat_groups)  # an fp32 master's bytes
        assert rep["measured"]["master"] <= 0.54 * held  # 2 + 1/8 of 4 bytes
        assert abs(rep["measured"]["master"] - rep["formula"]["master"]) <= rep["allowed_slack"]
