"""Checkpoints of a pipelined job (issue 38): saved at (pp=2, dp=2) on 4 gloo ranks with
`mesh=` the world mesh, loaded by parameter name at (pp=2, dp=2) (bitwise), (pp=1, dp=4), one
rank and (pp=2, dp=1) on 2 ranks, with the optimizer state resharded, and continued.

Model and loss: tests/checkpoint/pipeline_support.py (each stage trains its own params; the
stage modules keep the whole model's names). References: the uninterrupted saving run (the
same layout resumes bitwise) and one process training the whole model with torch.optim.AdamW
and the global clip (other layouts: fp32 tolerance, the dp means and the norm's sum reorder).
Negative control: the params alone (consolidated) without the optimizer state miss it.

The real path: torch.distributed.pipelining's PipelineStage and ScheduleGPipe (2 micro-batches)
on the same mesh save after 2 steps and take a third; the checkpoint loaded into the whole
model at (pp=1, dp=4, stage 3) takes the third step with a plain forward and backward. Both
third steps must be the one-process run's (each micro-batch loss halved, so the micro-batch
grads sum to the batch's); loading the params alone misses it.

Errors, each before anything is written: a checkpoint that lacks a stage's params (loaded into
the whole model: names them), a loading job whose params do not cover the checkpoint (names
the uncovered ones on every rank), stages that renumber their layers (two stages holding one
name: save refuses), and a stage optimizer over the dp sub-mesh alone (it knows no stages).
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import zerokern as zk
import zerokern.checkpoint as ck

from ..support.harness import cached, case, one_thread, run_cases  # noqa: F401
from . import pipeline_support as S

WS, PP, DP = 4, 2, 2
SAVE_AT, MORE = 3, 2

TOL = {
    # another layout than the saver's vs the uninterrupted run and the one-process reference:
    # fp32 sums in another order (the dp mean of 4 vs 2 row shares, the norm's sum over
    # stages); measured <= 2e-7
    "layout": 1e-6,
    # the params-only resume (negative control) misses the reference by at least this factor
    "negative_factor": 100,
}


def _path(root):
    return os.path.join(root, "pp2dp2")


def _save(world, root, stage):
    s, d = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    model = S.stage_model(s, PP)
    opt = S.zero_opt(model, stage, mesh=world)
    S.train(model, opt, d, DP, 0, SAVE_AT)
    saved = S.params_of(model, opt)
    ck.save(_path(root), model, opt, client_state={"step": SAVE_AT})
    S.train(model, opt, d, DP, SAVE_AT, MORE)
    return {"saved": saved, "after": S.params_of(model, opt), "stage": s,
            "listing": sorted(os.listdir(_path(root)))}


def _load_same(world, root, stage):
    """(pp=2, dp=2) again, at another ZeRO stage: the resumed run is the uninterrupted one,
    bitwise."""
    s, d = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    model = S.stage_model(s, PP, seed=S.SEED + 1)  # every value must come from the checkpoint
    opt = S.zero_opt(model, stage, mesh=world)
    info = ck.load(_path(root), model, opt)
    loaded = S.params_of(model, opt)
    S.train(model, opt, d, DP, SAVE_AT, MORE)
    return {"loaded": loaded, "after": S.params_of(model, opt), "client": info["client_state"],
            "parts": info["parts"]}


def _load_whole(rank, root, stage, ws, group=None, params_only=False):
    """The whole model (pp=1) over `group` (None: the 4 ranks, dp=4; a group of one: one
    rank), continued MORE steps."""
    model = S.stage_model(0, 1, seed=S.SEED + 1)
    opt = S.zero_opt(model, stage, process_group=group)
    if params_only:
        model.load_state_dict(ck.consolidate(_path(root)))
    else:
        ck.load(_path(root), model, opt)
    loaded = S.params_of(model, opt)
    S.train(model, opt, rank if ws > 1 else 0, ws, SAVE_AT, MORE)
    return {"loaded": loaded, "after": S.params_of(model, opt)}


def _uncovered(root):
    """pp=1, dp=4 with layer 3 deleted: the checkpoint's layers.3.* are loaded by no rank."""
    model = S.Net(seed=S.SEED + 1)
    del model.layers["3"]
    opt = S.zero_opt(model, 2)
    before = S.params_of(model)
    try:
        ck.load(_path(root), model, opt)
        return {"error": None}
    except ck.ModelMismatchError as e:
        return {"error": str(e), "unchanged": all(torch.equal(a, S.params_of(model)[n])
                                                   for n, a in before.items())}


def _renumbered(world, root):
    s = world["pp"].get_local_rank()
    model = S.renumbered_stage(s, PP)
    opt = S.zero_opt(model, 2, mesh=world)
    path = os.path.join(root, "renumbered")
    try:
        ck.save(path, model, opt)
        return {"error": None}
    except ValueError as e:
        dist.barrier()
        return {"error": str(e), "written": os.path.exists(path)}


def _dp_submesh(world, root):
    """One ZeroAdamW per stage over its dp group alone (process_group=; mesh=world["dp"] is
    refused at construction since issue 38's round): either the checkpoint knows the stages (it
    holds both) or the save refuses; never one stage's files over the other's."""
    s = world["pp"].get_local_rank()
    model = S.stage_model(s, PP)
    opt = S.zero_opt(model, 2, process_group=world["dp"].get_group())
    path = os.path.join(root, "submesh")
    try:
        ck.save(path, model, opt)
    except ValueError as e:
        dist.barrier()
        return {"error": str(e), "written": os.path.exists(path)}
    dist.barrier()
    return {"error": None, "names": sorted(ck.consolidate(path))}


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _chain_batch(step: int, dp_rank: int, dp: int):
    g = torch.Generator().manual_seed(777 + step)
    x, y = torch.randn(S.ROWS, S.IN, generator=g), torch.randn(S.ROWS, S.OUT, generator=g)
    n = S.ROWS // dp
    return x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]


def _chain_reference():
    """The whole chain on one process, 3 steps: torch.optim.AdamW, the global clip."""
    model = S.Net(chain=True)
    opt = torch.optim.AdamW(S.groups(model), lr=S.LR, betas=S.BETAS, eps=S.EPS)
    for step in range(3):
        opt.zero_grad()
        x, y = _chain_batch(step, 0, 1)
        _mse(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), S.MAX_NORM)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _gpipe(world, root, rank, ws):
    s, d = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    model = S.stage_model(s, PP, chain=True)
    opt = S.zero_opt(model, 2, mesh=world)
    stage = PipelineStage(model, s, PP, torch.device("cpu"), group=world["pp"].get_group())
    # the micro-batch losses halved, not scale_grads (which divides p.grad, released at stage 2)
    sched = ScheduleGPipe(stage, 2, loss_fn=lambda out, t: _mse(out, t) / 2, scale_grads=False)
    path = os.path.join(root, "gpipe")
    for step in range(3):
        x, y = _chain_batch(step, d, DP)
        if s == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        opt.step()
        opt.zero_grad()
        if step == 1:
            ck.save(path, model, opt)
    out = {"after": S.params_of(model, opt)}
    for name in ("resumed", "params_only"):  # at (pp=1, dp=4), stage 3: the third step
        whole = S.stage_model(0, 1, seed=S.SEED + 1, chain=True)
        opt2 = S.zero_opt(whole, 3)
        if name == "resumed":
            ck.load(path, whole, opt2)
        else:
            whole.load_state_dict(ck.consolidate(path))
        x, y = _chain_batch(2, rank, ws)
        _mse(whole(x), y).backward()
        opt2.step()
        out[name] = S.params_of(whole, opt2)
    return out


def _interleaved(world, root):
    """Two stages per rank (Interleaved1F1B's placement: rank s holds stages s and s + 2 of
    4) under one optimizer over both: `save` takes the list of the rank's stage modules."""
    s, d = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    chunks = [S.stage_model(s, 4), S.stage_model(s + 2, 4)]
    opt = S.zero_opt(torch.nn.ModuleList(chunks), 2, mesh=world)
    for step in range(2):
        sum(c(S.batch(step, d, DP)) for c in chunks).backward()
        opt.step()
        opt.zero_grad()
    ck.save(os.path.join(root, "interleaved"), chunks, opt)
    return S.merge(S.params_of(c) for c in chunks)


def _async(world, root):
    """An asynchronous save of the pipelined job (stage 3), written while a step runs."""
    s, d = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    model = S.stage_model(s, PP)
    opt = S.zero_opt(model, 3, mesh=world)
    S.train(model, opt, d, DP, 0, 1)
    saved = S.params_of(model, opt)
    h = ck.save(os.path.join(root, "runs", "step1"), model, opt, async_save=True)
    S.train(model, opt, d, DP, 1, 1)
    h.wait()
    return saved


def _rules(world, rank, root, singles, pairs):
    """Other optimizer rules' states across layouts: ZeroAdafactor (per-matrix states on their
    owner) saved at (pp=2, dp=2) and loaded on one rank; ZeroLion (one momentum; its sign update
    shows any reordered sum, so no clip and the same dp rows) loaded at (pp=1, dp=2):
    bitwise."""
    s, d = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    out = {}
    for name, cls, kw, clip in (("adafactor", zk.ZeroAdafactor, {"lr": 1e-2}, S.MAX_NORM),
                                ("lion", zk.ZeroLion, {"lr": 1e-3, "weight_decay": 0.1}, None)):
        def make(m, stage, cls=cls, kw=kw, clip=clip, **more):
            return cls(m, stage=stage, precision="fp32", backend="cpu", max_grad_norm=clip,
                       bucket_mb=S.BUCKET_MB, **kw, **more)
        model = S.stage_model(s, PP)
        opt = make(model, 1, mesh=world)
        S.train(model, opt, d, DP, 0, SAVE_AT)
        path = os.path.join(root, name)
        ck.save(path, model, opt)
        S.train(model, opt, d, DP, SAVE_AT, MORE)
        whole = S.stage_model(0, 1, seed=S.SEED + 1)
        if name == "adafactor":
            opt2, r, n = make(whole, 2, process_group=singles[rank]), 0, 1
        else:
            opt2, r, n = make(whole, 2, process_group=pairs[rank // 2]), rank % 2, 2
        ck.load(path, whole, opt2)
        S.train(whole, opt2, r, n, SAVE_AT, MORE)
        out[name] = {"after": S.params_of(model), "resumed": S.params_of(whole)}
    return out


def _worker(rank, ws, root):
    world = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    singles = [dist.new_group([r]) for r in range(ws)]  # every rank makes every group
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ref = S.reference(SAVE_AT + MORE)
    cases = {
        "save": functools.partial(_save, world, root, 2),
        "same": functools.partial(_load_same, world, root, 3),
        "dp4": functools.partial(_load_whole, rank, root, 3, ws),
        "one": functools.partial(_load_whole, rank, root, 1, 1, singles[rank]),
        "negative": functools.partial(_load_whole, rank, root, 2, ws, None, True),
        "uncovered": functools.partial(_uncovered, root),
        "renumbered": functools.partial(_renumbered, world, root),
        "submesh": functools.partial(_dp_submesh, world, root),
        "gpipe": functools.partial(_gpipe, world, root, rank, ws),
        "interleaved": functools.partial(_interleaved, world, root),
        "async": functools.partial(_async, world, root),
        "rules": functools.partial(_rules, world, rank, root, singles, pairs),
    }
    out = run_cases(cases)
    out["ref"], out["chain_ref"] = ref, _chain_reference()
    return out


def _load_pp2dp1(rank, ws, root):
    world = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    return run_cases({"pp2dp1": functools.partial(_load_same_at, world, root, 0)})


def _load_same_at(world, root, stage):
    s = world["pp"].get_local_rank()
    model = S.stage_model(s, 2, seed=S.SEED + 1)
    opt = S.zero_opt(model, stage, mesh=world)
    ck.load(_path(root), model, opt)
    loaded = S.params_of(model, opt)
    S.train(model, opt, 0, 1, SAVE_AT, MORE)
    return {"loaded": loaded, "after": S.params_of(model, opt)}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pipeline_ckpt"))


def _results(root):
    return cached(_worker, WS, root)


def _saver(root):
    saves = case(_results(root), "save")
    return S.merge(r["saved"] for r in saves), S.merge(r["after"] for r in saves)


def test_the_checkpoint_holds_every_stage(root):
    """One directory per pipeline stage and one index, written by all 4 ranks together."""
    saves = case(_results(root), "save")
    for r in saves:
        assert r["listing"] == ["parts.json", "pp00000", "pp00001"], r["listing"]
    with open(os.path.join(_path(root), "parts.json")) as f:
        index = json.load(f)
    assert index["pp_size"] == PP and [p["dir"] for p in index["parts"]] == ["pp00000",
                                                                            "pp00001"]
    saved, _ = _saver(root)
    assert sorted(saved) == sorted(n for n, _ in S.Net().named_parameters())
    # the stages differ: the input layer on the first, norm and head on the last
    assert "inp.weight" in saves[0]["saved"] and "head.weight" not in saves[0]["saved"]
    assert "head.weight" in saves[-1]["saved"] and "inp.weight" not in saves[-1]["saved"]
    # the uninterrupted pipelined run is the one-process run (global clip over both stages)
    ref = case(_results(root), "ref")[0]
    _, after = _saver(root)
    assert S.rel_err(after, ref[-1]) <= TOL["layout"]


def test_same_layout_resumes_bitwise(root):
    saved, after = _saver(root)
    for r in case(_results(root), "same"):
        assert all(torch.equal(v, saved[n]) for n, v in r["loaded"].items())
        assert all(torch.equal(v, after[n]) for n, v in r["after"].items())
        assert r["client"] == {"step": SAVE_AT} and r["parts"] == ["pp00000", "pp00001"]


@pytest.mark.parametrize("target", ["dp4", "one"])
def test_load_at_another_layout_and_continue(root, target):
    """(pp=1, dp=4) at stage 3 and one rank at stage 1: the loaded params are the saved ones
    bitwise (the fp32 masters), the continuation is the uninterrupted run's."""
    saved, after = _saver(root)
    ref = case(_results(root), "ref")[0]
    for r in case(_results(root), target):
        assert sorted(r["loaded"]) == sorted(saved)
        assert all(torch.equal(v, saved[n]) for n, v in r["loaded"].items())
        assert S.rel_err(r["after"], after) <= TOL["layout"]
        assert S.rel_err(r["after"], ref[-1]) <= TOL["layout"]


def test_load_at_pp2_dp1(root):
    saved, after = _saver(root)
    _results(root)  # the checkpoint
    res = cached(_load_pp2dp1, 2, root)
    names = set()
    for r in case(res, "pp2dp1"):
        names |= set(r["loaded"])
        assert all(torch.equal(v, saved[n]) for n, v in r["loaded"].items())
        assert S.rel_err(r["after"], {n: after[n] for n in r["after"]}) <= TOL["layout"]
    assert names == set(saved)


def test_negative_control_params_only_misses(root):
    ref = case(_results(root), "ref")[0]
    for r in case(_results(root), "negative"):
        assert S.rel_err(r["after"], ref[-1]) > TOL["negative_factor"] * TOL["layout"]


def test_consolidate_gives_the_whole_model(root, tmp_path):
    """consolidate() and `zerokern consolidate` of the pipelined checkpoint: one full state
    dict (every stage's params and the buffer), bitwise the saved params, loadable into the
    whole model."""
    saved, _ = _saver(root)
    sd = ck.consolidate(_path(root))
    assert sorted(sd) == sorted(S.Net().state_dict())
    assert all(torch.equal(sd[n], v) for n, v in saved.items())
    S.Net().load_state_dict(sd)  # strict
    from zerokern.checkpoint.cli import main

    out = str(tmp_path / "full.pt")
    assert main(["consolidate", _path(root), out]) == 0
    got = torch.load(out)
    assert all(torch.equal(got[n], v) for n, v in saved.items())
    assert ck.verify(_path(root))["files"] == 2 * (2 + 1) + 1  # per stage 2 ranks + extra;
    # client_state.pt with stage 0


@pytest.mark.usefixtures("one_thread")
def test_a_checkpoint_lacking_a_stage_names_its_params(root, tmp_path):
    """parts.json without stage 1: loading the whole model names stage 1's params and changes
    nothing."""
    _results(root)
    bad = str(tmp_path / "lacks")
    shutil.copytree(_path(root), bad)
    fn = os.path.join(bad, "parts.json")
    with open(fn) as f:
        index = json.load(f)
    index["parts"] = index["parts"][:1]
    with open(fn, "w") as f:
        json.dump(index, f)
    model = S.Net(seed=S.SEED + 1)
    opt = S.zero_opt(model, 2)
    before = S.params_of(model)
    with pytest.raises(ck.ModelMismatchError) as e:
        ck.load(bad, model, opt)
    msg = str(e.value)
    assert "head.weight" in msg and "layers.3.fc1.weight" in msg and "not in the checkpoint" \
        in msg, msg
    assert "inp.weight" not in msg
    assert all(torch.equal(v, before[n]) for n, v in S.params_of(model).items())


def test_a_layout_that_does_not_cover_the_checkpoint_raises_everywhere(root):
    for r in case(_results(root), "uncovered"):
        assert r["error"] is not None and "layers.3.fc1.weight" in r["error"], r
        assert "no rank of this job loads" in r["error"] and r["unchanged"], r


def test_stages_with_renumbered_layers_are_refused(root):
    for r in case(_results(root), "renumbered"):
        assert r["error"] is not None and "layers.0.fc1.weight" in r["error"], r
        assert "pipeline stages 0 and 1" in r["error"] and not r["written"], r


def test_a_stage_optimizer_over_the_dp_submesh_never_loses_a_stage(root):
    for r in case(_results(root), "submesh"):
        if r["error"] is not None:
            assert "pp" in r["error"] and not r["written"], r
        else:
            assert r["names"] == sorted(S.Net().state_dict()), r


def test_a_gpipe_checkpoint_resumes_in_the_whole_model(root):
    res = case(_results(root), "gpipe")
    ref = case(_results(root), "chain_ref")[0]
    after = S.merge(r["after"] for r in res)
    assert sorted(after) == sorted(ref)
    assert S.rel_err(after, ref) <= TOL["layout"]  # the pipelined run is the one-process run
    for r in res:
        assert S.rel_err(r["resumed"], ref) <= TOL["layout"]
        assert S.rel_err(r["resumed"], after) <= TOL["layout"]
        assert S.rel_err(r["params_only"], ref) > TOL["negative_factor"] * TOL["layout"]


@pytest.mark.usefixtures("one_thread")
def test_two_stages_per_rank_save_by_name(root):
    """The interleaved placement's checkpoint (stages 0 and 2 on one rank, 1 and 3 on the
    other) loads into the whole model on one process, bitwise."""
    saved = S.merge(case(_results(root), "interleaved"))
    path = os.path.join(root, "interleaved")
    assert sorted(os.listdir(path)) == ["parts.json", "pp00000", "pp00001"]
    model = S.Net(seed=S.SEED + 1)
    opt = S.zero_opt(model, 1)
    ck.load(path, model, opt)
    got = S.params_of(model)
    assert sorted(got) == sorted(saved)
    assert all(torch.equal(got[n], v) for n, v in saved.items())


def test_an_async_save_of_every_stage_is_the_latest(root):
    """save(async_save=True) of the pipelined job commits every stage; latest() finds it (its
    parts complete and checked) and consolidate gives the params at the save, bitwise."""
    saved = S.merge(case(_results(root), "async"))
    runs = os.path.join(root, "runs")
    assert ck.latest(runs) == os.path.join(runs, "step1")
    sd = ck.consolidate(os.path.join(runs, "step1"))
    assert sorted(saved) == sorted(n for n, _ in S.Net().named_parameters())
    assert all(torch.equal(sd[n], v) for n, v in saved.items())


def test_other_rules_states_move_across_layouts(root):
    res = case(_results(root), "rules")
    for name in ("adafactor", "lion"):
        after = S.merge(r[name]["after"] for r in res)
        for r in res:
            got = r[name]["resumed"]
            assert sorted(got) == sorted(after)
            if name == "lion":
                assert all(torch.equal(got[n], after[n]) for n in after), name
            else:
                assert S.rel_err(got, after) <= TOL["layout"], (name, S.rel_err(got, after))


@pytest.mark.usefixtures("one_thread")
def test_a_legacy_tp_index_is_read_as_tp_parts(tmp_path):
    """A checkpoint written before parts.json (tp.json + tpNNNNN/, here of one tp rank) loads
    and consolidates as a checkpoint in parts."""
    model = S.Net()
    opt = S.zero_opt(model, 1)
    S.train(model, opt, 0, 1, 0, 1)
    saved = S.params_of(model)
    plain, top = str(tmp_path / "plain"), tmp_path / "legacy"
    ck.save(plain, model, opt)
    top.mkdir()
    shutil.move(plain, str(top / "tp00000"))
    params = {n: {"shard": None, "shape": list(p.shape)} for n, p in model.named_parameters()}
    with open(top / "tp.json", "w") as f:
        json.dump({"format": "zerokern-tp-checkpoint", "tp_size": 1, "params": params}, f)
    fresh = S.Net(seed=S.SEED + 1)
    opt2 = S.zero_opt(fresh, 2)
    assert ck.load(str(top), fresh, opt2)["parts"] == ["tp00000"]
    assert all(torch.equal(v, saved[n]) for n, v in S.params_of(fresh).items())
    sd = ck.consolidate(str(top))
    assert all(torch.equal(sd[n], v) for n, v in saved.items())
