"""engine.save_checkpoint / load_checkpoint of a PipelineEngine (issue 38: checkpoints across
pipeline layouts, DeepSpeed users): zerokern.initialize(model=PipelineModule(...)) saves after
SAVE_AT train_batch steps, with a WarmupLR scheduler and a client_state, and resumes:
- at the same layout (a fresh module of other initial values, `load_checkpoint(dir)` without
  a tag: `latest`): the continued run is the uninterrupted one bitwise, with the counters,
  the learning rate and the client_state back;
- at another layout: pp=1 x dp=2, the same layers as a plain nn.Sequential through
  zerokern.initialize (forward / backward / step), at another ZeRO stage; and (slow, saved at
  pp=2 x dp=2 on 4 ranks) pp=2 x dp=1 on 2 ranks: within fp32 tolerance of the
  uninterrupted run.
Negative control: the params alone (the model's state_dict loaded, fresh optimizer state and
scheduler) miss the uninterrupted run by far more than the tolerance.
Errors, on every rank before anything changes: a module holding a layer the checkpoint lacks
(its names named), and load_dir None.
Every test here failed before this change: save_checkpoint / load_checkpoint raised
NotImplementedError for a PipelineModule engine.

The global batch of a step is MICROS micro-batches; data-parallel rank d of a layout with
dp ranks reads micro-batches [d * MICROS/dp, (d+1) * MICROS/dp) (its gradient accumulation),
so every layout takes the same batch and the same gradient (DeepSpeed's: the sum of
loss / accumulation, averaged over the data-parallel ranks).
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")

from tests.support.harness import cached, case, run_cases  # noqa: E402

from . import common as C  # noqa: E402

TOL = {
    # another layout than the saver's against the uninterrupted run: fp32 sums in another
    # order (the dp mean, the norm over stages)
    "layout": 1e-6,
    # the params-only resume (negative control) misses the uninterrupted run by at least
    # this factor of the tolerance
    "negative_factor": 100,
}
D, H, MICRO, MICROS = 8, 16, 2, 4
SAVE_AT, MORE = 3, 2
MODEL_SEED, DATA_SEED = 4321, 99


@functools.cache
def _root() -> str:
    """One directory for this pytest process's checkpoints (the ranks get it as an argument)."""
    return tempfile.mkdtemp(prefix="zk-pipe-ckpt-")


def _layers(extra: bool = False):
    nn = torch.nn
    out = [nn.Linear(D, H), nn.Tanh(), nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H), nn.Tanh(),
           nn.Linear(H, D)]
    return out + [nn.Linear(D, D)] if extra else out


def _specs(extra: bool = False, tied: bool = False):
    """The layers as LayerSpecs (each stage builds its own); the same indices as _layers.
    tied: the first and the last layer one TiedLayerSpec "proj" (Linear(D, H) without bias;
    the last uses its weight transposed, an LM head sharing the embedding)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    specs = [LayerSpec(type(m), *_args(m)) for m in _layers(extra)]
    if tied:
        nn = torch.nn
        specs[0] = TiedLayerSpec("proj", nn.Linear, D, H, bias=False)
        specs[-1] = TiedLayerSpec("proj", nn.Linear, D, H, bias=False, forward_fn=_tied_out)
    return specs


def _tied_out(module, x):
    return torch.nn.functional.linear(x, module.weight.t())


def _args(m):
    return (m.in_features, m.out_features) if isinstance(m, torch.nn.Linear) else ()


def _config(stage: int, gas: int):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.8, 0.9],
                                                     "eps": 1e-6, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                         "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 8}},
            "gradient_clipping": 0.05, "steps_per_print": 1000,
            "zero_optimization": {"stage": stage}}


def _micro(step: int, m: int):
    g = torch.Generator().manual_seed(DATA_SEED + 1009 * step + 31 * m)
    return torch.randn(MICRO, D, generator=g), torch.randn(MICRO, D, generator=g)


def _mine(step: int, dp: int, dp_rank: int):
    gas = MICROS // dp
    return [_micro(step, m) for m in range(dp_rank * gas, (dp_rank + 1) * gas)]


def _pipe_engine(stages: int, stage: int, seed: int = MODEL_SEED, extra: bool = False,
                 tied: bool = False):
    import deepspeed
    from deepspeed.pipe import PipelineModule

    import zerokern

    C.launcher_env(torch.distributed.get_rank())
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(seed)
    model = PipelineModule(layers=_specs(extra, tied), num_stages=stages,
                           loss_fn=torch.nn.functional.mse_loss)
    dp = torch.distributed.get_world_size() // stages
    engine, _, _, _ = zerokern.initialize(model=model, model_parameters=model.parameters(),
                                          config=_config(stage, MICROS // dp))
    return engine


def _pipe_train(engine, first: int, steps: int):
    dp, d = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
    return [float(engine.train_batch(iter(_mine(s, dp, d)))) for s in range(first, first + steps)]


def _seq_engine(stage: int, seed: int = MODEL_SEED + 7, init=None):
    import zerokern

    C.launcher_env(torch.distributed.get_rank())
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*_layers())
    if init is not None:
        model.load_state_dict(init)
    dp = torch.distributed.get_world_size()
    engine, _, _, _ = zerokern.initialize(model=model, model_parameters=model.parameters(),
                                          config=_config(stage, MICROS // dp))
    return engine


def _seq_train(engine, first: int, steps: int):
    import torch.distributed as dist

    dp, d = dist.get_world_size(), dist.get_rank()
    for s in range(first, first + steps):
        for x, y in _mine(s, dp, d):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()


def _whole(engine):
    """The whole model's params by name, from every stage (the same dict on every rank)."""
    import torch.distributed as dist

    opt = engine.optimizer
    ctx = opt.gathered_params() if opt.stage == 3 else contextlib.nullcontext()
    with ctx:
        mine = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for sd in every for k, v in sd.items()}


def _counters(engine):
    return {"global_steps": engine.global_steps, "lr": engine.get_lr()[0],
            "skipped": engine.skipped_steps}


def _save_run(stages: int, path: str, tied: bool = False):
    """train SAVE_AT steps, save (tag None: global_step3), train MORE: the uninterrupted run."""
    engine = _pipe_engine(stages, 1, tied=tied)
    _pipe_train(engine, 0, SAVE_AT)
    saved = _whole(engine)
    engine.save_checkpoint(path, client_state={"epoch": 7})
    at_save = _counters(engine)
    losses = _pipe_train(engine, SAVE_AT, MORE)
    return {"saved": saved, "after": _whole(engine), "losses": losses, "at_save": at_save,
            "end": _counters(engine), "tags": sorted(os.listdir(path))}


def _resume_pipe(stages: int, path: str, stage: int = 1, tied: bool = False):
    engine = _pipe_engine(stages, stage, seed=MODEL_SEED + 1, tied=tied)
    loaded_path, client = engine.load_checkpoint(path)
    at_load = _counters(engine)
    loaded = _whole(engine)
    losses = _pipe_train(engine, SAVE_AT, MORE)
    return {"path": loaded_path, "client": client, "at_load": at_load, "loaded": loaded,
            "losses": losses, "after": _whole(engine), "end": _counters(engine)}


def _resume_seq(path: str, stage: int):
    engine = _seq_engine(stage)
    _, client = engine.load_checkpoint(path)
    at_load = _counters(engine)
    loaded = _whole(engine)
    _seq_train(engine, SAVE_AT, MORE)
    return {"client": client, "at_load": at_load, "loaded": loaded, "after": _whole(engine),
            "end": _counters(engine)}


def _params_only(saved):
    """Negative control: the saved params into a fresh engine whose scheduler is stepped to
    the saved step (so only the optimizer state is missing: fresh Adam moments), continued."""
    engine = _seq_engine(1, init=saved)
    for _ in range(SAVE_AT):
        engine.lr_scheduler.step()
    lr = engine.get_lr()[0]
    _seq_train(engine, SAVE_AT, MORE)
    return {"lr": lr, "after": _whole(engine)}


def _errors(path: str):
    """A module with a layer the checkpoint lacks, and load_dir None: every rank raises,
    nothing changed."""
    out = {}
    engine = _pipe_engine(2, 1, extra=True, seed=MODEL_SEED + 2)
    before = _whole(engine)
    try:
        engine.load_checkpoint(path)
        out["missing"] = "no error"
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        out["missing"] = f"{type(e).__name__}: {e}"
    try:
        engine.load_checkpoint(None)
        out["none"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["none"] = f"{type(e).__name__}: {e}"
    after = _whole(engine)
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["steps"] = engine.global_steps
    return out


def _max_diff(a, b) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _cases2(rank: int, ws: int, root: str):
    path = os.path.join(root, "pp2dp1")
    cases = {"save": lambda: _save_run(2, path)}
    cases["same"] = lambda: _resume_pipe(2, path)
    cases["seq-s2"] = lambda: _resume_seq(path, 2)
    cases["errors"] = lambda: _errors(path)
    tied = os.path.join(root, "tied-pp2dp1")
    cases["tied-save"] = lambda: _save_run(2, tied, tied=True)
    cases["tied-same"] = lambda: _resume_pipe(2, tied, tied=True)
    cases["tied-pp1"] = lambda: _resume_pipe(1, tied, tied=True)
    cases["tied-index"] = lambda: _tied_index(tied)
    return run_cases(cases)


def _tied_index(path: str):
    """What the tied checkpoint holds: parts.json's params, and per part the names it indexes
    and its rank files' bytes."""
    import json

    from zerokern.checkpoint.format import read_meta

    top = os.path.join(path, "global_step3", "zero")
    with open(os.path.join(top, "parts.json")) as f:
        index = json.load(f)
    parts = {}
    for p in index["parts"]:
        meta = read_meta(os.path.join(top, p["dir"]))
        parts[p["dir"]] = [q["name"] for q in meta["params"]]
    return {"params": sorted(index["params"]), "parts": parts}


def _cases4_save(rank: int, ws: int, root: str):
    path = os.path.join(root, "pp2dp2")
    return run_cases({"save": lambda: _save_run(2, path),
                      "same": lambda: _resume_pipe(2, path)})


def _cases4_load(rank: int, ws: int, root: str):
    path = os.path.join(root, "pp2dp2")
    return run_cases({"pp2dp1": lambda: _resume_pipe(2, path),
                      "seq-s3": lambda: _resume_seq(path, 3)})


def _r2():
    return cached(_cases2, 2, _root())


def _check_same(save, same):
    assert same["client"] == {"epoch": 7}
    assert same["path"].endswith("global_step3"), same["path"]
    assert same["at_load"] == save["at_save"], (same["at_load"], save["at_save"])
    assert same["losses"] == save["losses"], (same["losses"], save["losses"])
    for k, v in save["after"].items():
        assert torch.equal(same["after"][k], v), k
    assert same["end"] == save["end"]


def test_same_layout_resumes_bitwise():
    """pp=2 x dp=1 saved and resumed from `latest`: bitwise, counters, lr and client_state."""
    save, same = case(_r2(), "save"), case(_r2(), "same")
    assert save[0]["tags"] == ["global_step3", "latest"], save[0]["tags"]
    for s, r in zip(save, same):
        _check_same(s, r)


def test_no_pipeline_resumes_within_fp32():
    """The pp=2 checkpoint into the same layers as a plain nn.Sequential at pp=1 x dp=2 and
    ZeRO-2: loaded params equal the saved ones, the continued run is the uninterrupted one
    within fp32; the params-only resume (negative control) is not."""
    save, seq = case(_r2(), "save")[0], case(_r2(), "seq-s2")
    for r in seq:
        assert r["client"] == {"epoch": 7}
        assert r["at_load"]["global_steps"] == SAVE_AT
        assert r["at_load"]["lr"] == save["at_save"]["lr"]
        assert _max_diff(r["loaded"], save["saved"]) == 0.0
        assert _max_diff(r["after"], save["after"]) <= TOL["layout"]
        assert r["end"]["lr"] == save["end"]["lr"]


def test_errors_on_every_rank_before_anything_changes():
    for r in case(_r2(), "errors"):
        assert "7.weight" in r["missing"] and "ModelMismatchError" in r["missing"], r
        assert r["none"].startswith("ValueError") and "load_dir" in r["none"], r
        assert r["unchanged"] and r["steps"] == 0, r


def _negative(rank: int, ws: int, root: str):
    saved = torch.load(os.path.join(root, "saved.pt"))
    return _params_only(saved)


def test_negative_control_params_only():
    """The saved params and learning rate without the optimizer state miss the uninterrupted
    run: the resumes above must have loaded the Adam moments."""
    save = case(_r2(), "save")[0]
    fn = os.path.join(_root(), "saved.pt")
    torch.save(save["saved"], fn)
    neg = cached(_negative, 2, _root())[0]
    assert neg["lr"] == save["at_save"]["lr"], (neg["lr"], save["at_save"])
    assert _max_diff(neg["after"], save["after"]) > TOL["negative_factor"] * TOL["layout"]


@pytest.mark.slow
def test_pp2_dp2_resumes_bitwise_and_at_other_layouts():
    """Saved at pp=2 x dp=2 (4 ranks): the same layout bitwise; pp=2 x dp=1 (2 ranks) and
    pp=1 x dp=2 (nn.Sequential, ZeRO-3) within fp32."""
    r4 = cached(_cases4_save, 4, _root())
    save, same = case(r4, "save"), case(r4, "same")
    for s, r in zip(save, same):
        _check_same(s, r)
    r2 = cached(_cases4_load, 2, _root())
    ref = save[0]
    for r in case(r2, "pp2dp1") + case(r2, "seq-s3"):
        assert r["client"] == {"epoch": 7}
        assert r["at_load"]["lr"] == ref["at_save"]["lr"]
        assert _max_diff(r["loaded"], ref["saved"]) == 0.0
        assert _max_diff(r["after"], ref["after"]) <= TOL["layout"]


def test_tied_layers_saved_once_and_resumed():
    """A TiedLayerSpec shared by the first and the last stage (ZeRO-1): parts.json indexes the
    tied weight once, at the first stage; resumed bitwise at pp=2 and, by name, at pp=1 x dp=2
    (one stage holding it once) within fp32 of the uninterrupted run."""
    save, same = case(_r2(), "tied-save"), case(_r2(), "tied-same")
    for s, r in zip(save, same):
        _check_same(s, r)
    idx = case(_r2(), "tied-index")[0]
    assert idx["params"].count("tied_modules.proj.weight") == 1, idx
    assert "tied_modules.proj.weight" in idx["parts"]["pp00000"], idx
    ref = save[0]
    for r in case(_r2(), "tied-pp1"):
        assert r["client"] == {"epoch": 7} and r["at_load"] == ref["at_save"]
        assert _max_diff(r["loaded"], ref["saved"]) == 0.0
        assert _max_diff(r["after"], ref["after"]) <= TOL["layout"]
