"""Issue 21, items 1-4: freezing and unfreezing mid-training, cleared grads across a re-prepare,
a dtype-preserving device move (stages 0-3, N = 1, 2, 3).

Each case runs one schedule of user actions twice: through ZeroAdamW, and through DDP +
torch.optim.AdamW (find_unused_parameters=True: a param frozen after DDP was built gets no
gradient, which DDP then leaves None, as torch does at world size 1), on fresh random data with
the exaggerated hyperparameters of models.py. Where torch has no equivalent (a param frozen at
construction and unfrozen), the case checks for a clear error on every rank with nothing
changed. All cases failed on the code before the fix (see the commit that added this file).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import zerokern as zk

from ..support import models as M
from ..support.harness import cached, case, one_thread, run_cases  # noqa: F401 (fixture)

TOL = 1e-6  # fp32 params vs DDP + AdamW (test_parity's bound)
# Params frozen mid-training: one in a block unit, one in the root unit (stage 3), and a whole
# submodule through module.requires_grad_() (what peft's disable_adapter_layers does).
FREEZE = ["blocks.0.fc1.weight", "ln_f.weight"]
FREEZE_MODULE = "blocks.1.ln2"


def _ops_apply(model, op):
    kind = op[0]
    if kind == "freeze":
        for n, p in model.named_parameters():
            if n in FREEZE:
                p.requires_grad_(False)
        model.get_submodule(FREEZE_MODULE).requires_grad_(False)
    elif kind == "unfreeze":
        for n, p in model.named_parameters():
            if n in op[1]:
                p.requires_grad_(True)
    elif kind == "model_zero":
        model.zero_grad()
    elif kind == "move":
        model.to(*op[1])


def _run_torch(rank, ws, schedule):
    torch.manual_seed(0)
    model = M.make_model()
    net = model if ws == 1 else nn.parallel.DistributedDataParallel(
        model, find_unused_parameters=True)
    opt = M.torch_adamw(model)
    for op in schedule:
        if op[0] == "train":
            opt.zero_grad(set_to_none=True)
            M.loss_fn(net, M.rank_tokens(op[1], rank, ws)).backward()
            opt.step()
        elif op[0] == "bwd":
            M.loss_fn(net, M.rank_tokens(op[1], rank, ws)).backward()
        elif op[0] == "step":
            opt.step()
        else:
            _ops_apply(model, op)
    return M.snapshot(model)


def _run_zero(rank, ws, stage, schedule, precision="fp32", **kw):
    model = M.make_model()
    opt = M.zero_opt(model, stage, precision, **kw)
    for op in schedule:
        if op[0] == "train":
            opt.zero_grad()
            opt.backward(M.loss_fn(model, M.rank_tokens(op[1], rank, ws)))
            opt.step()
        elif op[0] == "bwd":
            opt.backward(M.loss_fn(model, M.rank_tokens(op[1], rank, ws)))
        elif op[0] == "step":
            opt.step()
        else:
            _ops_apply(model, op)
    return model, opt


FREEZE_SCHEDULE = [("train", 0), ("train", 1), ("freeze",), ("train", 2), ("train", 3)]


def _freeze(rank, ws, stage):
    """Item 1: frozen after 2 steps, trained 2 more: as DDP + AdamW, the frozen ones bitwise
    as they were when frozen."""
    ref = _run_torch(rank, ws, FREEZE_SCHEDULE)
    frozen_at = _run_torch(rank, ws, FREEZE_SCHEDULE[:2])
    model, opt = _run_zero(rank, ws, stage, FREEZE_SCHEDULE)
    got = M.full_snapshot(model, opt)
    frozen = FREEZE + [f"{FREEZE_MODULE}.{n}" for n, _ in
                       model.get_submodule(FREEZE_MODULE).named_parameters()]
    zk_frozen_at = None
    model2, opt2 = _run_zero(rank, ws, stage, FREEZE_SCHEDULE[:2])
    zk_frozen_at = M.full_snapshot(model2, opt2)
    return {"rel": M.rel_err(got, ref),
            "frozen_unchanged": all(torch.equal(got[n], zk_frozen_at[n]) for n in frozen),
            "ref_frozen_unchanged": all(torch.equal(ref[n], frozen_at[n]) for n in frozen),
            # negative control: the same run without the freeze is far from the reference
            "control": M.rel_err(M.full_snapshot(*_run_zero(
                rank, ws, stage, [op for op in FREEZE_SCHEDULE if op[0] != "freeze"])), ref)}


REFREEZE_SCHEDULE = FREEZE_SCHEDULE[:4] + [("unfreeze", FREEZE), ("train", 3), ("train", 4)]


def _refreeze(rank, ws, stage):
    """Frozen for one step, then unfrozen (peft's enable_adapter_layers): trained on as torch
    does, with the bias correction of their own step count (one behind the others'); a
    checkpoint of the optimizer is refused meanwhile (the lag is not in the format)."""
    ref = _run_torch(rank, ws, REFREEZE_SCHEDULE)
    model, opt = _run_zero(rank, ws, stage, REFREEZE_SCHEDULE)
    err = None
    try:
        opt.state_dict()
    except RuntimeError as e:
        err = str(e)
    return {"rel": M.rel_err(M.full_snapshot(model, opt), ref), "err": err,
            # negative control: the one-step lag matters (a run that never froze differs)
            "control": M.rel_err(M.full_snapshot(*_run_zero(
                rank, ws, stage, [op for op in REFREEZE_SCHEDULE if op[0] == "train"])), ref)}


def _unfreeze_constructed(rank, ws, stage, given_model):
    """Item 2: `pos`, frozen at construction, unfrozen after a step: torch's AdamW (given the
    whole model) would start training it; a clear error naming it, nothing changed."""
    model = M.make_model()
    if given_model:
        opt = zk.ZeroAdamW(model, stage=stage, precision="fp32", lr=M.LR, betas=M.BETAS,
                           eps=M.EPS, weight_decay=M.WD, bucket_mb=M.BUCKET_MB,
                           backend=M.BACKEND)
    else:
        opt = M.zero_opt(model, stage)  # param groups that list `pos`
    opt.zero_grad()
    opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws)))
    opt.step()
    before = M.full_snapshot(model, opt)
    model.pos.requires_grad_(True)
    err = None
    try:
        opt.zero_grad()
        opt.backward(M.loss_fn(model, M.rank_tokens(1, rank, ws)))
        opt.step()
    except RuntimeError as e:
        err = str(e)
    model.pos.requires_grad_(False)
    after = M.full_snapshot(model, opt)
    return {"err": err, "unchanged": M.bitwise_equal(after, before)}


MOVE_SCHEDULE = [("train", 0), ("model_zero",), ("move", (torch.device("cpu", 0),)),
                 ("bwd", 1), ("step",), ("train", 2)]


def _move_clear(rank, ws, stage):
    """Item 3: p.grad cleared by model.zero_grad() after a step, then model.to() (new storage,
    as ZeroAccelerator.prepare): the next backward must not bring the old gradient back."""
    ref = _run_torch(rank, ws, MOVE_SCHEDULE)
    model, opt = _run_zero(rank, ws, stage, MOVE_SCHEDULE)
    control = _run_torch(rank, ws, [("train", 0), ("bwd", 1), ("step",), ("train", 2)])
    return {"rel": M.rel_err(M.full_snapshot(model, opt), ref),
            "control": M.rel_err(control, ref)}


def _move_live(rank, ws, stage):
    """A move between backward and step (the grads live: p.grad moves along, torch steps with
    it); stage 0's p.grad views were re-pointed by Module._apply."""
    sched = [("train", 0), ("bwd", 1), ("move", (torch.device("cpu", 0),)), ("step",),
             ("train", 2)]
    ref = _run_torch(rank, ws, sched)
    model, opt = _run_zero(rank, ws, stage, sched)
    return {"rel": M.rel_err(M.full_snapshot(model, opt), ref)}


def _peft(rank, ws, stage):
    """peft's adapters switched off and on: `with model.disable_adapter():` for a no_grad
    reference forward between steps (DPO's pattern: nothing skipped), then
    disable_adapter_layers() for one step (the adapters get no grad: torch skips them, so do
    we), then enable_adapter_layers() and a step (their own step count, one behind)."""
    from peft import LoraConfig, get_peft_model

    def run(zero):
        torch.manual_seed(0)
        model = get_peft_model(M.make_model(), LoraConfig(r=4, target_modules=["fc1", "fc2"],
                                                          lora_dropout=0.0))
        model.base_model.model.ln_f.requires_grad_(True)  # trained with adapters on or off
        with torch.no_grad():  # peft starts lora_B at zero: make the adapters matter
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator()
                                               .manual_seed(len(n))))
        hyper = dict(lr=M.LR, betas=M.BETAS, eps=M.EPS, weight_decay=M.WD)
        if zero:
            opt = zk.ZeroAdamW(model, stage=stage, precision="fp32", bucket_mb=M.BUCKET_MB,
                               backend=M.BACKEND, **hyper)
            net = model
        else:
            opt = torch.optim.AdamW(model.parameters(), foreach=False, **hyper)
            net = model if ws == 1 else nn.parallel.DistributedDataParallel(
                model, find_unused_parameters=True)

        def train(s):
            opt.zero_grad()
            M.loss_fn(net, M.rank_tokens(s, rank, ws)).backward()
            opt.step()

        train(0)
        with model.disable_adapter(), torch.no_grad():
            M.loss_fn(model, M.rank_tokens(9, rank, ws))
        train(1)
        model.base_model.disable_adapter_layers()
        train(2)
        model.base_model.enable_adapter_layers()
        train(3)
        return M.full_snapshot(model, opt) if zero else M.snapshot(model)

    return {"rel": M.rel_err(run(True), run(False))}


class _Branchy(nn.Module):
    """A data-dependent branch: `side` runs only for inputs whose first feature is positive,
    so some ranks use it in a step and others do not."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(16, 19)
        self.side = nn.Linear(19, 19)
        self.b = nn.Linear(19, 7)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if bool(x[0, 0] > 0):
            h = h + self.side(h)
        return self.b(h)


def _branch(rank, ws, stage):
    """A branch taken on some ranks only in each step: its grad is the average with zeros
    from the ranks that skipped it, as DDP(find_unused_parameters=True) gives."""
    def data(s):
        g = torch.Generator().manual_seed(100 + s)
        x = torch.randn(ws, 5, 16, generator=g)
        x[:, 0, 0] = torch.tensor([1.0 if (r + s) % 2 == 0 else -1.0 for r in range(ws)])
        return x[rank]

    def run(zero):
        model = _Branchy()
        hyper = dict(lr=M.LR, betas=M.BETAS, eps=M.EPS, weight_decay=M.WD)
        if zero:
            opt = zk.ZeroAdamW(model, stage=stage, precision="fp32", bucket_mb=M.BUCKET_MB,
                               backend=M.BACKEND, **hyper)
            net = model
        else:
            opt = torch.optim.AdamW(model.parameters(), foreach=False, **hyper)
            net = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        for s in range(4):
            opt.zero_grad()
            net(data(s)).pow(2).mean().backward()
            opt.step()
        return M.full_snapshot(model, opt) if zero else M.snapshot(model)

    return {"rel": M.rel_err(run(True), run(False))}


def _masters(opt):
    return [g.master.clone() for g in opt.flat_groups if g.master is not None]


def _move_bf16(rank, ws, stage, master):
    """Item 4: model.to("cpu:0", torch.bfloat16) on the bf16 model after a step: the fp32
    masters (and with them the params) continue bit for bit as in the unmoved run."""
    plain = [("train", 0), ("train", 1), ("train", 2)]
    moved = [("train", 0), ("move", (torch.device("cpu", 0), torch.bfloat16)),
             ("train", 1), ("train", 2)]
    m1, o1 = _run_zero(rank, ws, stage, plain, "bf16", master=master)
    m2, o2 = _run_zero(rank, ws, stage, moved[:1], "bf16", master=master)
    ptr = m2.blocks[0].fc1.weight.data_ptr()
    _ops_apply(m2, moved[1])
    new_storage = m2.blocks[0].fc1.weight.data_ptr() != ptr
    for op in moved[2:]:
        o2.zero_grad()
        o2.backward(M.loss_fn(m2, M.rank_tokens(op[1], rank, ws)))
        o2.step()
    a, b = _masters(o1), _masters(o2)
    return {"new_storage": new_storage,
            "params": M.bitwise_equal(M.snapshot(m2), M.snapshot(m1)),
            "masters": len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))}


def _worker(rank, ws):
    p = functools.partial
    cases = {}
    for st in (0, 1, 2, 3):
        cases[f"freeze_s{st}"] = p(_freeze, rank, ws, st)
        cases[f"refreeze_s{st}"] = p(_refreeze, rank, ws, st)
        cases[f"unfreeze_groups_s{st}"] = p(_unfreeze_constructed, rank, ws, st, st == 3)
        if st < 3:
            cases[f"unfreeze_model_s{st}"] = p(_unfreeze_constructed, rank, ws, st, True)
            cases[f"move_clear_s{st}"] = p(_move_clear, rank, ws, st)
            cases[f"move_bf16_s{st}"] = p(_move_bf16, rank, ws, st, "fp32")
            cases[f"move_live_s{st}"] = p(_move_live, rank, ws, st)
        cases[f"peft_s{st}"] = p(_peft, rank, ws, st)
        if ws > 1:  # at N = 1 a branch not taken is unused on every rank (see the docs)
            cases[f"branch_s{st}"] = p(_branch, rank, ws, st)
    cases["move_bf16_compact_s2"] = p(_move_bf16, rank, ws, 2, "compact")
    return run_cases(cases)


def _res(ws):
    return cached(_worker, ws)


# [Note: the slow mark] (pyproject.toml): the largest world runs in CI's -m slow pass
# N=2 in the default suite (the smallest world with shards); N=1 and 3 in the slow pass
WS = [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)]
STAGES = [0, 1, 2, 3]


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
def test_param_frozen_mid_training_stays_as_torch_leaves_it(ws, stage):
    for r in case(_res(ws), f"freeze_s{stage}"):
        assert r["ref_frozen_unchanged"]  # the reference really leaves them alone
        assert r["frozen_unchanged"], r
        assert r["rel"] <= TOL, r
        assert r["control"] > 100 * TOL, r  # the check can fail


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
def test_param_unfrozen_after_skipped_steps_trains_as_torch(ws, stage):
    for r in case(_res(ws), f"refreeze_s{stage}"):
        assert r["rel"] <= TOL, r
        assert r["control"] > 100 * TOL, r
        assert r["err"] is not None and "frozen for some steps" in r["err"], r


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage, given", [(s, g) for s in STAGES for g in ("groups", "model")
                                          if not (s == 3 and g == "model")])
def test_param_frozen_at_construction_unfrozen_is_refused(ws, stage, given):
    for r in case(_res(ws), f"unfreeze_{given}_s{stage}"):
        assert r["err"] is not None and "'pos'" in r["err"] or "shape (7, 24)" in r["err"], r
        assert "frozen (requires_grad=False) when ZeroAdamW was built" in r["err"], r
        assert r["unchanged"], r


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_cleared_grads_stay_cleared_across_a_move(ws, stage):
    for r in case(_res(ws), f"move_clear_s{stage}"):
        assert r["rel"] <= TOL, r
        assert r["control"] > 100 * TOL, r


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage, master", [(0, "fp32"), (1, "fp32"), (2, "fp32"),
                                           (2, "compact")])
def test_device_move_keeps_the_bf16_master(ws, stage, master):
    name = f"move_bf16_s{stage}" if master == "fp32" else "move_bf16_compact_s2"
    for r in case(_res(ws), name):
        assert r["new_storage"], "the move must give the params new storage"
        assert r["masters"], r
        assert r["params"], r


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_move_between_backward_and_step_keeps_the_grads(ws, stage):
    for r in case(_res(ws), f"move_live_s{stage}"):
        assert r["rel"] <= TOL, r


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
def test_peft_adapters_disabled_and_enabled_as_torch(ws, stage):
    for r in case(_res(ws), f"peft_s{stage}"):
        assert r["rel"] <= TOL, r


# the N=3 spawn of this module runs in CI's -m slow pass ([Note: the slow mark]); N=2 (one rank
# takes the branch / wraps differently) stays in the default run. The N=3 spawn took 59 s / 23 s
# of the default run (durations on 2026-11-26, default run 661 s against the 10-minute target).
@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("stage", STAGES)
def test_branch_taken_on_some_ranks_only_as_ddp(ws, stage):
    for r in case(_res(ws), f"branch_s{stage}"):
        assert r["rel"] <= TOL, r


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("stage", STAGES)
def test_new_optimizer_after_unfreezing_trains_the_param(stage):
    """The way out the error names: unfreeze, then build a new ZeroAdamW on the model. The
    old optimizer's watch must not refuse the forward (it no longer owns the params), and the
    unfrozen param trains as with torch's AdamW built at that point (one step, N = 1)."""
    def build(model, zero):
        hyper = dict(lr=M.LR, betas=M.BETAS, eps=M.EPS, weight_decay=M.WD)
        if zero:
            return zk.ZeroAdamW(model, stage=stage, precision="fp32", bucket_mb=M.BUCKET_MB,
                                backend=M.BACKEND, **hyper)
        return torch.optim.AdamW(model.parameters(), foreach=False, **hyper)

    snaps = []
    for zero in (True, False):
        model = M.make_model()
        opt = build(model, zero)  # the first optimizer, with `pos` frozen
        model.pos.requires_grad_(True)
        opt = build(model, zero)  # (the first is alive while the second takes over)
        opt.zero_grad()
        M.loss_fn(model, M.rank_tokens(0, 0, 1)).backward()
        opt.step()
        snaps.append(M.full_snapshot(model, opt) if zero else M.snapshot(model))
    assert not torch.equal(snaps[1]["pos"], M.make_model().pos)  # the reference moved it
    assert M.rel_err(*snaps) <= TOL
