"""DeepSpeed's own unit-test expectations, with zerokern.initialize in place of
deepspeed.initialize (issue 21 item 11): what its tests/unit/runtime/test_ds_config_dict.py,
test_ds_initialize.py, test_lr_schedulers.py and tests/unit/checkpoint/ check, written afresh
against zerokern (world size 1, in this process; the 2-rank cases against DeepSpeed itself are
in test_deepspeed_defaults.py). Where DeepSpeed returns its own classes (FusedAdam, its
schedulers) zerokern returns ZeroAdamW and zerokern.engine.schedulers; the schedulers are
compared with DeepSpeed's, value for value."""

from __future__ import annotations

import argparse
import base64
import json
import logging
import math
import os
import sys

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR, StepLR

import zerokern as zk
from zerokern.engine import NoOptimizerError, parse_config
from zerokern.engine import schedulers as S

HIDDEN = 10


class Simple(torch.nn.Module):
    """DeepSpeed's SimpleModel shape: linear layers and a cross-entropy loss."""

    def __init__(self, hidden=HIDDEN, layers=2):
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x, y):
        for lin in self.linears:
            x = lin(x)
        return torch.nn.functional.cross_entropy(x, y)


def _batches(n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, HIDDEN, generator=g).to(dtype), torch.randint(0, HIDDEN, (2,),
                                                                           generator=g))
            for _ in range(n)]


def _config(**over):
    cfg = {"train_batch_size": 2, "steps_per_print": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}, "gradient_clipping": 1.0}
    cfg.update(over)
    return cfg


def _init(cfg, model=None, **kw):
    model = Simple() if model is None else model
    kw.setdefault("model_parameters", model.parameters())
    return zk.initialize(config=cfg, model=model, **kw)


def _ds():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return pytest.importorskip("deepspeed.runtime.lr_schedules", reason="deepspeed not installed")


# ---- test_lr_schedulers.py ------------------------------------------------------------------
SCHEDULES = [
    ("LRRangeTest", {}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 3,
                     "lr_range_test_step_rate": 0.5, "lr_range_test_staircase": True}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 5,
                  "cycle_second_step_size": 7, "decay_step_size": 2, "decay_lr_rate": 0.1,
                  "decay_mom_rate": 0.05, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 6,
                  "cycle_first_stair_count": 3, "cycle_momentum": False}),
    ("WarmupLR", {"warmup_num_steps": 7}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5}),  # default max lr
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5}),
]


@pytest.mark.filterwarnings("ignore:Detected call of")  # no optimizer steps here, by design
@pytest.mark.parametrize("name,params", SCHEDULES)
def test_schedules_match_deepspeed_step_by_step(name, params):
    """Two param groups; step() and DeepSpeed's step(n) (jumps, back and forth); lr, betas,
    get_lr(), get_mom() and last_batch_iteration equal DeepSpeed 0.19.8's at every point."""
    lrs = _ds()

    def opt():
        return torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(2))]},
                                  {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 2e-3}],
                                 lr=5e-3)

    mine_opt, ref_opt = opt(), opt()
    mine, ref = getattr(S, name)(mine_opt, **params), getattr(lrs, name)(ref_opt, **params)
    for n in [None] * 6 + [12, 3, None, None, 30, None, 0, -1, None]:
        for a, b in zip(mine_opt.param_groups, ref_opt.param_groups):
            assert a["lr"] == pytest.approx(b["lr"], rel=1e-12, abs=1e-15), (name, n)
            assert a["betas"] == pytest.approx(b["betas"], rel=1e-12), (name, n)
        assert mine.get_lr() == pytest.approx(ref.get_lr(), rel=1e-12, abs=1e-15)
        assert mine.last_batch_iteration == ref.last_batch_iteration
        if hasattr(ref, "get_mom"):
            assert mine.get_mom() == ref.get_mom()
        mine.step(n)
        ref.step(n)


def test_onecycle_momentum_through_initialize():
    """TestOneCycle.test_mom: get_mom() starts at cycle_max_mom, reaches cycle_min_mom at
    cycle_first_step_size, falls then rises, and rises again in the decay phase."""
    for min_mom, max_mom, decay, size in [(0.08, 0.09, 1e-3, 10), (0.08, 0.09, 0, 21)]:
        sched_cfg = {"type": "OneCycle", "params": {
            "cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_min_mom": min_mom,
            "cycle_max_mom": max_mom, "decay_mom_rate": decay, "cycle_first_step_size": size,
            "decay_step_size": size}}
        engine, _, _, sched = _init(_config(scheduler=sched_cfg))
        moms = []
        for x, y in _batches(max(50, size * 3)):
            moms.append(sched.get_mom())
            engine.backward(engine(x, y))
            engine.step()
        assert moms[0][0][0] == max_mom and moms[size][0][0] == min_mom
        assert all(a > b for a, b in zip(moms[:size], moms[1:size]))
        assert all(a < b for a, b in zip(moms[size:2 * size], moms[size + 1:2 * size]))
        if decay > 0:
            assert all(a < b for a, b in zip(moms[2 * size:], moms[2 * size + 1:]))


@pytest.mark.parametrize("min_lr,rate,size,staircase", [
    (1e-4, 1e-5, 1, True), (1e-5, 1e-5, 1, False), (1e-4, 1e-3, 10, True),
    (1e-3, 1e-3, 10, False), (1e-2, 1e-2, 19, True), (1e-2, 1e-2, 19, False)])
def test_lr_range_test_through_initialize(min_lr, rate, size, staircase):
    """TestLrRange: the config's LRRangeTest starts at its min lr and grows, continuously or
    in stairs of lr_range_test_step_size steps."""
    engine, _, _, sched = _init(_config(scheduler={"type": "LRRangeTest", "params": {
        "lr_range_test_min_lr": min_lr, "lr_range_test_step_rate": rate,
        "lr_range_test_step_size": size, "lr_range_test_staircase": staircase}}))
    assert isinstance(sched, S.LRRangeTest)
    seen = []
    for x, y in _batches(max(50, size * 2)):
        seen.extend(sched.get_lr())
        engine.backward(engine(x, y))
        engine.step()
    assert seen[0] == min_lr
    if staircase:
        for i in range(0, len(seen), size):
            assert all(v == seen[i] for v in seen[i:i + size])
        assert seen[size] > seen[0]
    else:
        assert all(a < b for a, b in zip(seen, seen[1:]))


@pytest.mark.parametrize("name,params", [
    ("WarmupLR", {}), ("WarmupDecayLR", {"warmup_num_steps": 5, "total_num_steps": 10}),
    ("WarmupCosineLR", {"warmup_num_steps": 10, "total_num_steps": 20}),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_first_step_size": 5,
                  "decay_step_size": 5}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 1})])
def test_scheduler_and_optimizer_agree(name, params):
    """TestGetLrBeforeTrain and TestSchedulerOptimizerParity: before training the groups hold
    the scheduler's get_lr(); after every step scheduler.get_lr() == engine.get_lr()."""
    engine, opt, _, sched = _init(_config(scheduler={"type": name, "params": params}))
    assert [g["lr"] for g in opt.param_groups] == sched.get_lr()
    for x, y in _batches(20):
        engine.backward(engine(x, y))
        engine.step()
        assert sched.get_lr() == engine.get_lr()


# ---- test_ds_initialize.py: client optimizer and scheduler ----------------------------------
def _halving(step):
    return step // 10


@pytest.mark.parametrize("sched_kind", [None, "object", "callable"])
@pytest.mark.parametrize("opt_kind", [None, "object", "callable"])
def test_client_lr_scheduler_matrix(opt_kind, sched_kind):
    """TestClientLrScheduler: the config's WarmupLR when no client scheduler; the client's
    scheduler object itself; a callable's LambdaLR; a scheduler object with no client
    optimizer object to drive is an error (DeepSpeed: AssertionError; zerokern: ValueError)."""
    model = Simple()
    cfg = {"train_batch_size": 1}
    client_opt = None
    if opt_kind is None:
        cfg["optimizer"] = {"type": "Adam"}
    elif opt_kind == "object":
        client_opt = torch.optim.Adam(model.parameters())
    else:
        client_opt = lambda params: torch.optim.AdamW(params)  # noqa: E731
    client_sched = None
    if sched_kind is None:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {}}
    elif sched_kind == "object":
        bound = client_opt if isinstance(client_opt, torch.optim.Optimizer) else \
            torch.optim.Adam(model.parameters())
        client_sched = LambdaLR(bound, _halving)
    else:
        client_sched = lambda o: LambdaLR(o, _halving)  # noqa: E731
    kw = dict(model=model, model_parameters=list(model.parameters()), optimizer=client_opt,
              lr_scheduler=client_sched)
    if isinstance(client_sched, LRScheduler) and not isinstance(client_opt, torch.optim.Optimizer):
        with pytest.raises(ValueError, match="lr_scheduler"):
            zk.initialize(config=cfg, **kw)
        return
    _, opt, _, sched = zk.initialize(config=cfg, **kw)
    assert isinstance(opt, zk.ZeroAdamW)  # DeepSpeed: FusedAdam / the client's own object
    if sched_kind is None:
        assert isinstance(sched, S.WarmupLR)
    elif sched_kind == "object":
        assert sched is client_sched and sched.optimizer is opt  # rebound to the ZeroAdamW
    else:
        assert isinstance(sched, LambdaLR) and sched.optimizer is opt


@pytest.mark.parametrize("sched_kind", [None, "object", "callable"])
@pytest.mark.parametrize("pair", [("LambdaLR", "StepLR"), ("StepLR", "OneCycleLR")])
def test_client_lr_scheduler_beats_the_config(sched_kind, pair):
    """TestClientLrSchedulerInit: with a config scheduler too, a client scheduler (object or
    callable) is the one used; with none, the config's."""
    model = Simple()
    client_opt = torch.optim.Adam(model.parameters(), lr=0.01)
    make = {"LambdaLR": lambda o: LambdaLR(o, _halving), "StepLR": lambda o: StepLR(o, 30),
            "OneCycleLR": lambda o: OneCycleLR(o, max_lr=0.01, total_steps=200)}
    obj_kind, callable_kind = pair
    cfg = {"train_batch_size": 1,
           "scheduler": ({"type": "WarmupLR", "params": {}} if obj_kind == "LambdaLR" else
                         {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 0.1}})}
    client = None if sched_kind is None else \
        make[obj_kind](client_opt) if sched_kind == "object" else make[callable_kind]
    _, opt, _, sched = zk.initialize(config=cfg, model=model,
                                     model_parameters=list(model.parameters()),
                                     optimizer=client_opt, lr_scheduler=client)
    if sched_kind is None:
        assert type(sched).__name__ == cfg["scheduler"]["type"]
    else:
        assert type(sched).__name__ == (obj_kind if sched_kind == "object" else callable_kind)
    assert sched.optimizer is opt


def test_model_is_required():
    """TestNoModel (DeepSpeed: AssertionError)."""
    with pytest.raises(ValueError, match="model"):
        zk.initialize(model=None, config={"train_batch_size": 1})


# ---- forward-only engine (TestNoOptim, TestInitNoOptimizer) ---------------------------------
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_forward_only_engine(stage, precision, caplog):
    """No optimizer: the engine runs forward passes in the config's precision (the outputs of
    the model cast as DeepSpeed casts it), and backward/step raise AssertionError, as
    DeepSpeed's (NoOptimizerError is one). offload_param at stage 0 is ignored."""
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": stage,
                                                        "offload_param": {"device": "cpu"}}}
    dtype = torch.float32
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        dtype = torch.bfloat16
    model = Simple(layers=3)
    ref = Simple(layers=3)
    ref.load_state_dict(model.state_dict())
    ref.to(dtype)
    with caplog.at_level(logging.WARNING, logger="zerokern.engine"):
        engine, opt, _, sched = zk.initialize(model=model, config=cfg)
    assert opt is None and sched is None and engine.optimizer is None
    assert all(p.dtype == dtype for p in model.parameters())
    for x, y in _batches(5, dtype):
        loss = engine(x, y)
        assert torch.equal(loss, ref(x, y))
        with pytest.raises(AssertionError, match="no optimizer"):
            engine.backward(loss)
        with pytest.raises(NoOptimizerError):
            engine.step()
    assert engine.zero_optimization_stage() == stage and engine.get_lr() == []
    if stage == 3:
        assert "does not shard" in caplog.text
    with pytest.raises(ValueError, match="scheduler"):
        zk.initialize(model=Simple(), config=dict(cfg, scheduler={"type": "WarmupLR"}))


# ---- offload_param below stage 3: ignored with a warning, as DeepSpeed ----------------------
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_below_stage_3_is_ignored_with_a_warning(stage, caplog):
    losses = {}
    for name, zero in (("plain", {}), ("offload_param", {"offload_param": {"device": "cpu"}})):
        torch.manual_seed(5)
        cfg = _config(zero_optimization={"stage": stage, **zero})
        with caplog.at_level(logging.WARNING, logger="zerokern.engine"):
            engine, opt, _, _ = _init(cfg)
        assert opt.offload_params is None
        out = []
        for x, y in _batches(4):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            out.append(float(loss.detach()))
        losses[name] = out
    assert losses["plain"] == losses["offload_param"]  # bit for bit
    assert "offload_param.device='cpu' is ignored" in caplog.text and f"stage {stage}" in \
        caplog.text


# ---- test_ds_config_dict.py: config files and args ------------------------------------------
HJSON = """{
  # comments, unquoted keys and trailing commas: hjson, as DeepSpeed reads config files
  train_batch_size: 2
  gradient_accumulation_steps: 2,
  optimizer: {type: "Adam", params: {lr: 0.00015,},},
}
"""


def test_hjson_json_and_base64_configs(tmp_path, monkeypatch):
    """TestConfigLoad: a dict, a JSON file, an hjson file (and base64 JSON, as DeepSpeed)
    give the same engine; without hjson installed an hjson file is a ValueError that says
    to install it (before: a bare JSONDecodeError); duplicate keys are an error."""
    pytest.importorskip("hjson")
    as_dict = {"train_batch_size": 2, "gradient_accumulation_steps": 2,
               "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}}
    (tmp_path / "c.json").write_text(json.dumps(as_dict))
    (tmp_path / "c.hjson").write_text(HJSON)
    b64 = base64.urlsafe_b64encode(json.dumps(as_dict).encode()).decode()
    for cfg in (as_dict, str(tmp_path / "c.json"), str(tmp_path / "c.hjson"), b64,
                tmp_path / "c.hjson"):
        c = parse_config(cfg, world_size=1)
        assert (c.train_batch_size, c.gradient_accumulation_steps, c.optimizer["type"],
                c.optimizer["params"]["lr"]) == (2, 2, "Adam", 0.00015)
    engine, *_ = _init(str(tmp_path / "c.hjson"))
    assert engine.gradient_accumulation_steps() == 2
    (tmp_path / "dup.json").write_text('{"train_batch_size": 2, "train_batch_size": 4}')
    with pytest.raises(ValueError, match="train_batch_size.*twice"):
        parse_config(str(tmp_path / "dup.json"), 1)
    with pytest.raises(ValueError, match="no such file"):
        parse_config(str(tmp_path / "missing.json"), 1)
    monkeypatch.setitem(sys.modules, "hjson", None)  # hjson not installed
    with pytest.raises(ValueError, match="pip install hjson"):
        parse_config(str(tmp_path / "c.hjson"), 1)
    assert parse_config(str(tmp_path / "c.json"), 1).train_batch_size == 2  # JSON needs none


def test_deprecated_deepscale_config(tmp_path):
    """TestDeprecatedDeepScaleConfig: args.deepscale_config is read (and moved to
    args.deepspeed_config, as DeepSpeed does); both given is an error."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_config(gradient_accumulation_steps=2)))
    args = argparse.Namespace(deepscale_config=str(path), local_rank=0)
    engine, *_ = zk.initialize(args=args, model=Simple())
    assert engine.gradient_accumulation_steps() == 2
    assert args.deepspeed_config == str(path) and args.deepscale_config is None
    for x, y in _batches(4):
        engine.backward(engine(x, y))
        engine.step()
    assert engine.global_steps == 2
    both = argparse.Namespace(deepscale_config=str(path), deepspeed_config=str(path))
    with pytest.raises(ValueError, match="deepscale_config"):
        zk.initialize(args=both, model=Simple())


def test_config_model_expectations(tmp_path):
    """test_ds_config_model.py: train_batch_size alone is enough (micro = 64, gas = 1 on one
    rank); a duplicate key in a file (with a trailing comma: hjson's reading) is a ValueError;
    a non-finite fp16.loss_scale is rejected (before: inf was taken as a static scale)."""
    c = parse_config({"train_batch_size": 64}, 1)
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (64, 64, 1)
    (tmp_path / "dup.json").write_text('{"train_batch_size": 24, "train_batch_size": 24,}')
    with pytest.raises(ValueError):
        parse_config(str(tmp_path / "dup.json"), 1)
    for bad in (float("inf"), float("-inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match=r"fp16\.loss_scale"):
            parse_config({"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale": bad}}, 1)
    for ok in (0, 1.0, 128.0, 65536.0):
        parse_config({"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale": ok}}, 1)


def test_gradient_clipping_default_is_deepspeed_019():
    assert parse_config({"train_batch_size": 1}, 1).gradient_clipping == 1.0
    assert parse_config({"train_batch_size": 1, "gradient_clipping": 0}, 1).gradient_clipping \
        == 0.0


# ---- tests/unit/checkpoint: save_dir, tag_validation, latest --------------------------------
def test_save_checkpoint_needs_a_save_dir(tmp_path, monkeypatch):
    """DeepSpeed 0.19: ValueError for save_dir None and "" (zerokern before: "" wrote into the
    current directory, None a TypeError). Nothing is written."""
    monkeypatch.chdir(tmp_path)
    engine, *_ = _init(_config())
    for bad in (None, ""):
        with pytest.raises(ValueError, match="save_dir"):
            engine.save_checkpoint(bad)
    with pytest.raises(TypeError, match="save_dir"):
        engine.save_checkpoint(3)
    assert os.listdir(tmp_path) == []
    assert engine.load_checkpoint(str(tmp_path)) == (None, None)  # test_missing_latest
    (tmp_path / "latest").write_text("nothing-here")  # "" would have read this one
    for bad in (None, ""):
        with pytest.raises(ValueError, match="load_dir"):
            engine.load_checkpoint(bad)


@pytest.mark.parametrize("mode", ["FAIL", "Warn", "ignore"])
def test_tag_validation_modes_parse(mode, tmp_path):
    """The checkpoint section (TestCheckpointValidationTag): modes in any case; one rank's tag
    is always consistent; an unknown mode is an error naming the key."""
    engine, *_ = _init(_config(checkpoint={"tag_validation": mode}))
    assert engine.config.tag_validation == mode.upper()
    assert engine.save_checkpoint(str(tmp_path), tag="t")
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"]


@pytest.mark.parametrize("bad", [{"tag_validation": "foo"}, {"load_universal": True}, "Fail"])
def test_checkpoint_section_errors(bad):
    with pytest.raises(ValueError, match=r"checkpoint"):
        _init(_config(checkpoint=bad))


@pytest.mark.filterwarnings("ignore:Detected call of")  # no optimizer steps here, by design
def test_onecycle_per_group_momentum():
    """cycle_min_mom / cycle_max_mom per param group, as DeepSpeed accepts them."""
    lrs = _ds()
    params = {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3,
              "cycle_min_mom": [0.8, 0.7], "cycle_max_mom": [0.9, 0.95]}

    def opt():
        return torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                                  {"params": [torch.nn.Parameter(torch.zeros(1))]}])

    def flat(xs):
        """(shape, values): pytest.approx refuses nested sequences (pytest >= 9.2), so the
        per-group (beta1, beta2) pairs are compared flattened, their nesting separately."""
        if isinstance(xs, (list, tuple)):
            parts = [flat(x) for x in xs]
            return [p[0] for p in parts], [v for p in parts for v in p[1]]
        return None, [xs]

    a, b = opt(), opt()
    mine, ref = S.OneCycle(a, **params), lrs.OneCycle(b, **params)
    for _ in range(8):
        for have, want in ((mine.get_mom(), ref.get_mom()),
                           ([g["betas"] for g in a.param_groups],
                            [g["betas"] for g in b.param_groups])):
            (shape, values), (ref_shape, ref_values) = flat(have), flat(want)
            assert shape == ref_shape and len(ref_values) >= 2
            assert values == pytest.approx(ref_values)
        mine.step()
        ref.step()
    assert not math.isclose(a.param_groups[0]["betas"][0], a.param_groups[1]["betas"][0])
