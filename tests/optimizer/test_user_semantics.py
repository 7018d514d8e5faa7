"""Issue 11: ZeroAdamW used the way real training code uses an optimizer (stages 0-3, N=1-3).

Every case is checked against DDP + torch.optim.AdamW doing the same thing (or against a clear
error where torch has no equivalent). Each row of the issue's table is a case; all ran wrong or
silently on the code before the fix (see the commit that added this file).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import weakref

import pytest
import torch
import torch.nn as nn

import zerokern as zk

from ..support import models as M
from ..support.harness import cached, case, one_thread, run_cases, ws_params  # noqa: F401 (fixture)

STEPS, MICRO, CLIP = 3, 3, 0.05
TOL = 1e-6        # params vs DDP + AdamW (test_parity's bound; measured <= 2e-7)
NORM_TOL = 1e-5   # a norm vs torch's clip_grad_norm_ (fp32 sums in another order)


# ---- the reference: DDP + torch AdamW ----------------------------------------------------------
def _ref(rank, ws, steps=STEPS, micro=1, clip=None, norm_type=2.0, schedule=None):
    """DDP + AdamW; loss / micro per micro-batch, no_sync on all but the last.

    schedule: a list of "b" (backward of the next micro-batch), "s" (step), "z" (zero_grad),
    "n" (a backward under no_sync() in zerokern; here reduced, the sum it must come to), "c"
    (p.grad = None on one param), "a" (p.grad = a given tensor on it) instead of the usual
    loop. Returns (params, norms)."""
    torch.manual_seed(0)
    model = M.make_model()
    net = model if ws == 1 else nn.parallel.DistributedDataParallel(model)
    opt = M.torch_adamw(model)
    norms = []
    for s, m, op in _ops(steps, micro, schedule):
        if op == "z":
            opt.zero_grad(set_to_none=True)
        elif op in "ca":
            _edit_grad(model, op)
        elif op in "bn":
            last = schedule is not None or m == micro - 1
            ctx = net.no_sync() if (ws > 1 and not last) else contextlib.nullcontext()
            with ctx:
                (M.loss_fn(net, M.rank_tokens(s, rank, ws, micro=m)) / micro).backward()
        else:
            if clip is not None:
                norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip,
                                                             norm_type=norm_type)))
            opt.step()
    return M.snapshot(model), norms


def _ops(steps, micro, schedule):
    if schedule is not None:
        s = 0
        for op in schedule:
            yield s, 0, op
            if op in "bn":
                s += 1  # fresh data for every backward
        return
    for s in range(steps):
        yield s, 0, "z"
        for m in range(micro):
            yield s, m, "b"
        yield s, 0, "s"


def _zero(rank, ws, stage, steps=STEPS, micro=1, clip=None, norm_type=2.0, schedule=None,
          no_sync=True, zero="opt", precision="fp32", on_opt=None, **kw):
    """The same loop with ZeroAdamW. clip: opt.clip_grad_norm_ (or torch's with clip_via)."""
    torch.manual_seed(0)
    model = M.make_model()
    opt = M.zero_opt(model, stage, precision=precision, **kw)
    if on_opt is not None:
        on_opt(model, opt)
    norms = []
    for s, m, op in _ops(steps, micro, schedule):
        if op == "z":
            (opt.zero_grad() if zero == "opt" else model.zero_grad())
        elif op in "ca":
            _edit_grad(model, op)
        elif op in "bn":
            last = schedule is not None or m == micro - 1
            ctx = opt.no_sync() if (no_sync == "all" or (no_sync and not last) or op == "n") \
                else contextlib.nullcontext()
            with ctx:
                opt.backward(M.loss_fn(model, M.rank_tokens(s, rank, ws, micro=m)) / micro)
        else:
            if clip is not None:
                norms.append(float(opt.clip_grad_norm_(clip, norm_type=norm_type)))
            opt.step()
    return model, opt, M.full_snapshot(model, opt), norms


def _edit_grad(model, op):
    """The user's hand on one param's p.grad (a weight in the middle of the model, so its
    bucket holds other params too): "c" clears it, "a" assigns the same tensor on every rank."""
    p = model.get_parameter("blocks.0.qkv.weight")
    p.grad = None if op == "c" else torch.full_like(p, 0.01)


def _changed_before_step(rank, ws, stage):
    """p.grad cleared or replaced between the last backward and step(): torch would use the
    change, zerokern has already reduced the old gradient; a clear error before anything is
    stepped, then the loop goes on after zero_grad()."""
    out = {}
    for op in "ca":
        torch.manual_seed(0)
        model = M.make_model()
        opt = M.zero_opt(model, stage)
        opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws)))
        before = M.full_snapshot(model, opt)
        _edit_grad(model, op)
        try:
            opt.step()
            out[op] = "stepped"
        except RuntimeError as e:
            out[op] = str(e)
        out[op + "_unchanged"] = _rel(M.full_snapshot(model, opt), before) == 0
        opt.zero_grad()
        opt.backward(M.loss_fn(model, M.rank_tokens(1, rank, ws)))
        opt.step()  # goes on
        out[op + "_moved"] = _rel(M.full_snapshot(model, opt), before) > 0
    return out


def _group_changed(rank, ws, stage, memo):
    """[Note: hyperparameters changed between steps] (core/optimizer.py): after a step, a bad
    value in the second param group (lr NaN) or another optimizer's key in the first
    (amsgrad=True, which torch would honour): a clear error at step() before anything is
    updated; the value put back, the run goes on to the reference's params (the failed
    step left no trace, its step count included)."""
    ref = memo.setdefault("plain", _ref(rank, ws)[0])
    out = {}
    for name, gi, change in (("lr_nan", 1, {"lr": float("nan")}),
                             ("amsgrad", 0, {"amsgrad": True})):
        torch.manual_seed(0)
        model = M.make_model()
        opt = M.zero_opt(model, stage)
        for s in range(STEPS):
            opt.zero_grad()
            opt.backward(M.loss_fn(model, M.rank_tokens(s, rank, ws)))
            if s == STEPS - 1:
                group = opt.param_groups[gi]
                saved = {k: group[k] for k in change if k in group}
                group.update(change)
                before = M.full_snapshot(model, opt)
                try:
                    opt.step()
                    out[name] = "stepped"
                except ValueError as e:
                    out[name] = str(e)
                out[name + "_unchanged"] = _rel(M.full_snapshot(model, opt), before) == 0
                for k in change:
                    group.pop(k)
                group.update(saved)
            opt.step()
        out[name + "_rel"] = _rel(M.full_snapshot(model, opt), ref)
    return out


def _group_params_edited(rank, ws, stage):
    """[Note: a group's params edited] (core/optimizer.py): fine-tuning code appends a param
    it unfroze to a group, or swaps one in the list; torch would train it. A clear error at
    zero_grad() and at step() (the user's own zero_grad may be the model's), nothing
    changed; the list put back, the run goes on."""
    out = {}
    for how in ("append", "swap"):
        torch.manual_seed(0)
        model = M.make_model()
        opt = M.zero_opt(model, stage)
        opt.zero_grad()
        opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws)))
        opt.step()
        ps = opt.param_groups[0]["params"]
        extra = nn.Parameter(torch.randn(4))
        old = ps[0]
        if how == "append":
            ps.append(extra)
        else:
            ps[0] = extra
        before = M.full_snapshot(model, opt)
        for where, call in (("zero_grad", lambda: opt.zero_grad()),
                            ("step", lambda: (model.zero_grad(), opt.backward(
                                M.loss_fn(model, M.rank_tokens(1, rank, ws))), opt.step()))):
            try:
                call()
                out[f"{how}_{where}"] = "no error"
            except RuntimeError as e:
                out[f"{how}_{where}"] = str(e)
        out[how + "_unchanged"] = _rel(M.full_snapshot(model, opt), before) == 0
        if how == "append":
            ps.pop()
        else:
            ps[0] = old
        opt.zero_grad()
        opt.backward(M.loss_fn(model, M.rank_tokens(1, rank, ws)))
        opt.step()
        out[how + "_goes_on"] = _rel(M.full_snapshot(model, opt), before) > 0
    return out


def _hyper_differ(rank, ws, stage, memo):
    """[Note: the same hyperparameters on every rank] (core/hyper_agreement.py): the last rank
    alone sets lr x 10 before the last step (a scheduler stepped on the main process only):
    every rank raises at step() before anything is updated, and again on a retry without a
    new backward; the lr put back, zero_grad() and the backward again, the run ends at DDP +
    AdamW's params."""
    ref = memo.setdefault("plain", _ref(rank, ws)[0])
    torch.manual_seed(0)
    model = M.make_model()
    opt = M.zero_opt(model, stage)
    out = {}
    for s in range(STEPS):
        opt.zero_grad()
        opt.backward(M.loss_fn(model, M.rank_tokens(s, rank, ws)))
        if s == STEPS - 1:
            lr = opt.param_groups[0]["lr"]
            if rank == ws - 1:
                opt.param_groups[0]["lr"] = lr * 10
            before = M.full_snapshot(model, opt)
            for k in ("first", "retry"):
                try:
                    opt.step()
                    out[k] = "stepped"
                except ValueError as e:
                    out[k] = str(e)
            out["unchanged"] = _rel(M.full_snapshot(model, opt), before) == 0
            opt.param_groups[0]["lr"] = lr
            opt.zero_grad()
            opt.backward(M.loss_fn(model, M.rank_tokens(s, rank, ws)))
        opt.step()
    out["rel"] = _rel(M.full_snapshot(model, opt), ref)
    return out


def _post_hooks(rank, ws, stage, memo, micro, no_sync=True):
    """Hooks the user registers after the wrap with p.register_post_accumulate_grad_hook: one
    scales a weight's gradient by 3 in place, one records the norm of another's. DDP reduces
    after them (a hook on the AccumulateGrad node), so they see this rank's gradient (the sum
    of the micro-batches so far) and the scaled one is reduced. `micro` micro-batches per step,
    all but the last under no_sync() (no_sync=False: each reduces). Returns (params' rel err to
    DDP + AdamW, the seen norms' max rel err to DDP's); where the sum is held only reduced and
    sharded (stages 2-3; stage 1 without no_sync()) and micro > 1, the error of the second
    backward on every rank, whether that failed backward changed any param, and whether the
    run goes on after zero_grad()."""
    def hooked(model):
        seen = []

        def scale(p):
            p.grad.mul_(3)

        def record(p):
            seen.append(float(p.grad.norm()))

        model.get_parameter("blocks.0.qkv.weight").register_post_accumulate_grad_hook(scale)
        model.get_parameter("blocks.1.fc1.weight").register_post_accumulate_grad_hook(record)
        return seen

    def run(model, net, opt, backward, sync_off):
        seen = hooked(model)
        for s in range(STEPS):
            opt.zero_grad()
            for m in range(micro):
                ctx = sync_off() if (sync_off is not None and no_sync and m < micro - 1) \
                    else contextlib.nullcontext()
                with ctx:
                    backward(M.loss_fn(net, M.rank_tokens(s, rank, ws, micro=m)) / micro)
            opt.step()
        return seen

    key = f"post_hooks{micro}{no_sync}"
    if key not in memo:
        torch.manual_seed(0)
        model = M.make_model()
        net = model if ws == 1 else nn.parallel.DistributedDataParallel(model)
        seen = run(model, net, M.torch_adamw(model), lambda loss: loss.backward(),
                   getattr(net, "no_sync", None))
        memo[key] = M.snapshot(model), seen
    ref, ref_seen = memo[key]
    torch.manual_seed(0)
    model = M.make_model()
    opt = M.zero_opt(model, stage)
    if micro > 1 and (stage >= 2 or stage == 1 and not no_sync):
        hooked(model)
        opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws, micro=0)) / micro)
        before = M.full_snapshot(model, opt)
        try:
            opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws, micro=1)) / micro)
            return "no error", False, False
        except RuntimeError as e:
            msg, unchanged = str(e), _rel(M.full_snapshot(model, opt), before) == 0
        opt.zero_grad()  # one backward per step: the loop goes on
        opt.backward(M.loss_fn(model, M.rank_tokens(1, rank, ws)))
        opt.step()
        return msg, unchanged, _rel(M.full_snapshot(model, opt), before) > 0
    seen = run(model, model, opt, opt.backward, opt.no_sync)
    if len(seen) != len(ref_seen):
        return math.inf, f"{len(seen)} norms seen, DDP's hook saw {len(ref_seen)}"
    return _rel(M.full_snapshot(model, opt), ref), max(abs(a - b) / b
                                                       for a, b in zip(seen, ref_seen))


def _fp16_torch_clip(rank, ws):
    """[Note: an edit of a loss-scaled p.grad] (core/optimizer.py): fp16 at stage 0, p.grad
    holds the loss-scaled gradient; torch's clip_grad_norm_ / clip_grad_value_ on it is a
    clear error at step() (before, a wrong step), nothing changed; after zero_grad() the
    same loop with opt.clip_grad_norm_ trains."""
    out = {}
    for how in ("norm", "value"):
        model = M.make_model()
        opt = M.zero_opt(model, 0, "fp16", loss_scale={"init_scale": 2.0**12})
        opt.zero_grad()
        opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws)))
        before = M.snapshot(model)
        if how == "norm":
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        else:
            nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        try:
            opt.step()
            out[how] = "stepped"
        except RuntimeError as e:
            out[how] = str(e)
        out[how + "_unchanged"] = M.bitwise_equal(M.snapshot(model), before)
        opt.zero_grad()
        opt.backward(M.loss_fn(model, M.rank_tokens(1, rank, ws)))
        opt.clip_grad_norm_(CLIP)
        opt.step()
        out[how + "_goes_on"] = not M.bitwise_equal(M.snapshot(model), before)
    return out


def _rel(a, b):
    return M.rel_err(a, b)


# ---- cases ---------------------------------------------------------------------------------
def _accum(rank, ws, stage, memo, no_sync):
    ref = memo.setdefault("accum", _ref(rank, ws, micro=MICRO)[0])
    model, opt, got, _ = _zero(rank, ws, stage, micro=MICRO, no_sync=no_sync)
    return _rel(got, ref)


def _no_sync_comm(rank, ws, stage):
    """Backward passes inside no_sync() reduce nothing (stages 0-2 send nothing at all; stage 3
    still gathers its params); the one outside reduces."""
    model = M.make_model()
    opt = M.zero_opt(model, stage)
    opt.reset_comm_stats()
    with opt.no_sync():
        for m in range(2):
            opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws, micro=m)))
    inside = opt.comm_stats()
    opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws, micro=2)))
    return inside["total"], inside["reduce_scatter"], opt.comm_stats()["reduce_scatter"]


def _schedule(rank, ws, stage, memo, schedule, zero="opt"):
    key = "sched" + "".join(schedule)
    ref = memo.setdefault(key, _ref(rank, ws, schedule=schedule)[0])
    _, _, got, _ = _zero(rank, ws, stage, schedule=schedule, zero=zero)
    return _rel(got, ref)


def _opt_clip(rank, ws, stage, memo, norm_type):
    key = f"clip{norm_type}"
    if key not in memo:
        memo[key] = _ref(rank, ws, clip=CLIP, norm_type=norm_type)
    ref, ref_norms = memo[key]
    _, _, got, norms = _zero(rank, ws, stage, clip=CLIP, norm_type=norm_type)
    return _rel(got, ref), max(abs(a - b) / b for a, b in zip(norms, ref_norms))


def _torch_clip(rank, ws, stage, memo):
    """The user clips with torch.nn.utils.clip_grad_norm_: DDP's result at stage 0, a clear
    error at stages 1-3 (p.grad holds no full gradient there)."""
    if "clip2.0" not in memo:
        memo["clip2.0"] = _ref(rank, ws, clip=CLIP)
    ref, ref_norms = memo["clip2.0"]
    model = M.make_model()
    opt = M.zero_opt(model, stage)
    norms = []
    try:
        for s in range(STEPS):
            opt.zero_grad()
            opt.backward(M.loss_fn(model, M.rank_tokens(s, rank, ws)))
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
    except RuntimeError as e:
        return "raised", str(e)
    got = M.full_snapshot(model, opt)
    return _rel(got, ref), max(abs(a - b) / b for a, b in zip(norms, ref_norms))


def _pgrad(rank, ws, stage):
    """p.grad after backward: DDP's gradient at stage 0; None/zeros after zero_grad."""
    torch.manual_seed(0)
    ref_model = M.make_model()
    net = ref_model if ws == 1 else nn.parallel.DistributedDataParallel(ref_model)
    M.loss_fn(net, M.rank_tokens(0, rank, ws)).backward()
    ref = {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.grad is not None}
    model = M.make_model()
    opt = M.zero_opt(model, stage)
    opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws)))
    out = {"types": sorted({type(p.grad).__name__ for p in model.parameters()
                            if p.requires_grad})}
    if stage == 0:
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out["rel"] = _rel(got, ref)
    opt.zero_grad(set_to_none=True)
    out["none_after_zero"] = all(p.grad is None for p in model.parameters())
    opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws)))
    opt.zero_grad(set_to_none=False)
    out["zeros_after_zero_false"] = all(
        p.grad is not None and (stage > 1 or not p.grad.any())
        for p in model.parameters() if p.requires_grad)
    return out


def _fp16_plain(rank, ws, stage):
    model = M.make_model()
    opt = M.zero_opt(model, stage, precision="fp16")
    M.loss_fn(model, M.rank_tokens(0, rank, ws)).backward()  # not through the loss scale
    try:
        opt.step()
        plain = "stepped"
    except RuntimeError as e:
        plain = str(e)
    opt.zero_grad()
    opt.scale_loss(M.loss_fn(model, M.rank_tokens(0, rank, ws))).backward()
    opt.step()
    return plain


def _load_sd(rank, ws, stage, bare, offload=None):
    """model.load_state_dict after building the optimizer = building it after loading."""
    src = M.make_model(seed=5)
    sd = src.state_dict()  # fp32
    kw = dict(stage=stage, precision="bf16", lr=M.LR, eps=M.EPS, bucket_mb=M.BUCKET_MB,
              backend=M.BACKEND, offload=offload)

    def build(model):
        return zk.ZeroAdamW(model.parameters() if bare else model, **kw)

    def train(model, opt):
        for s in range(2):
            opt.zero_grad()
            opt.backward(M.loss_fn(model, M.rank_tokens(s, rank, ws)))
            opt.step()
        return M.full_snapshot(model, opt)

    a = M.make_model()
    opt_a = build(a)
    a.load_state_dict(sd)
    got = train(a, opt_a)
    b = M.make_model()
    if bare:  # without the model no hook sees the fp32 values: the masters take the bf16 ones
        b.load_state_dict({k: v.to(torch.bfloat16) for k, v in sd.items()})
    else:
        b.load_state_dict(sd)
    want = train(b, build(b))
    return M.bitwise_equal(got, want)


def _replaced(rank, ws, stage, memo):
    """The params get new storage after construction (what model.to(device) does)."""
    ref = memo.setdefault("plain", _ref(rank, ws)[0])
    _, _, got, _ = _zero(rank, ws, stage,
                         on_opt=lambda model, opt: model._apply(lambda t: t.clone()))
    return _rel(got, ref)


def _cast_error(rank, ws, stage):
    model = M.make_model()
    opt = M.zero_opt(model, stage, precision="bf16")
    model.float()
    try:
        opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws)))
        opt.step()
    except TypeError as e:
        return str(e)
    return "no error"


def _param_replaced(rank, ws, stage):
    """A Parameter replaced after construction: a clear error, nothing changed."""
    model = M.make_model()
    opt = zk.ZeroAdamW(model, stage=stage, precision="fp32", backend=M.BACKEND)
    model.blocks[0].fc1.weight = nn.Parameter(model.blocks[0].fc1.weight.detach().clone())
    before = M.snapshot(model)
    try:
        opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws)))
        opt.step()
        msg = "no error"
    except RuntimeError as e:
        msg = str(e)
    return msg, M.bitwise_equal(M.snapshot(model), before)


def _debug_reorder(rank, ws, stage, inject):
    """ZEROKERN_DEBUG_COLLECTIVES=1 at stages 0-2: rank 1 launches two buckets in swapped
    order (an injected bug: same-sized buckets would pair silently on gloo's ring). Every rank
    must raise at step() naming the divergence; without the injection it trains."""
    os.environ["ZEROKERN_DEBUG_COLLECTIVES"] = "1"
    try:
        model = M.make_model()
        opt = M.zero_opt(model, stage, bucket_mb=M.BUCKET_MB)
    finally:
        os.environ.pop("ZEROKERN_DEBUG_COLLECTIVES", None)
    order = opt.grad_sync._sched.order
    if inject and rank == 1:
        order[0], order[1] = order[1], order[0]
    try:
        for s in range(2):
            opt.zero_grad()
            opt.backward(M.loss_fn(model, M.rank_tokens(s, rank, ws)))
            opt.step()
    except RuntimeError as e:
        return str(e)
    return "trained"


def _frozen_cast(rank, ws, stage):
    model = M.make_model()
    opt = M.zero_opt(model, stage, precision="bf16")
    with opt.gathered_params():
        dt = str(model.pos.dtype)
    return dt


def _gc(rank, ws, stage):
    model = M.make_model()
    opt = M.zero_opt(model, stage)
    opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws)))
    opt.step()
    r_opt, r_model = weakref.ref(opt), weakref.ref(model)
    del opt
    gc.collect()
    freed_opt = r_opt() is None
    del model
    gc.collect()
    return freed_opt, r_model() is None


def _ddp_refused(rank, ws, stage):
    """DDP around the model: a clear error at the first forward, nothing changed."""
    model = M.make_model()
    opt = zk.ZeroAdamW(model, stage=stage, precision="fp32", backend=M.BACKEND)
    net = nn.parallel.DistributedDataParallel(model)
    before = M.snapshot(model)
    try:
        M.loss_fn(net, M.rank_tokens(0, rank, ws))
        msg = "no error"
    except RuntimeError as e:
        msg = str(e)
    opt.zero_grad()
    return msg, M.bitwise_equal(M.snapshot(model), before)


STAGES = [0, 1, 2, 3]


def _rank_cases(rank, ws):
    memo = {}
    p = functools.partial
    cases = {}
    for st in STAGES:
        cases[f"accum_plain_s{st}"] = p(_accum, rank, ws, st, memo, False)
        cases[f"accum_nosync_s{st}"] = p(_accum, rank, ws, st, memo, True)
        cases[f"accum_allnosync_s{st}"] = p(_accum, rank, ws, st, memo, "all")
        cases[f"two_steps_s{st}"] = p(_schedule, rank, ws, st, memo, list("zbsbszbs"))
        cases[f"model_zero_grad_s{st}"] = p(_schedule, rank, ws, st, memo, list("zbszbbs"),
                                            zero="model")
        # After a reduction, without zero_grad: a no_sync() backward, a cleared p.grad, a
        # second step() with no backward (stage 1 reduces in place: full_grads.py's Note).
        cases[f"after_reduce_s{st}"] = p(_schedule, rank, ws, st, memo, list("zbsnsbcbs"))
        cases[f"step_twice_s{st}"] = p(_schedule, rank, ws, st, memo, list("zbssbs"))
        cases[f"changed_before_step_s{st}"] = p(_changed_before_step, rank, ws, st)
        cases[f"group_changed_s{st}"] = p(_group_changed, rank, ws, st, memo)
        cases[f"group_params_edited_s{st}"] = p(_group_params_edited, rank, ws, st)
        if ws > 1:
            cases[f"hyper_differ_s{st}"] = p(_hyper_differ, rank, ws, st, memo)
        cases[f"opt_clip_s{st}"] = p(_opt_clip, rank, ws, st, memo, 2.0)
        cases[f"opt_clip_inf_s{st}"] = p(_opt_clip, rank, ws, st, memo, math.inf)
        cases[f"torch_clip_s{st}"] = p(_torch_clip, rank, ws, st, memo)
        cases[f"pgrad_s{st}"] = p(_pgrad, rank, ws, st)
        cases[f"fp16_plain_s{st}"] = p(_fp16_plain, rank, ws, st)
        cases[f"gc_s{st}"] = p(_gc, rank, ws, st)
        cases[f"no_sync_comm_s{st}"] = p(_no_sync_comm, rank, ws, st)
        cases[f"post_hooks_s{st}"] = p(_post_hooks, rank, ws, st, memo, 1)
        cases[f"post_hooks_accum_s{st}"] = p(_post_hooks, rank, ws, st, memo, 2)
        cases[f"post_hooks_synced_s{st}"] = p(_post_hooks, rank, ws, st, memo, 2, False)
    cases["fp16_torch_clip_s0"] = p(_fp16_torch_clip, rank, ws)
    for st in (0, 1):  # p.grad can be assigned where a full grad buffer exists
        cases[f"assigned_after_reduce_s{st}"] = p(_schedule, rank, ws, st, memo,
                                                  list("zbsabsnabs"))
    for st in (0, 1, 2):
        cases[f"load_sd_s{st}"] = p(_load_sd, rank, ws, st, False)
        cases[f"load_sd_bare_s{st}"] = p(_load_sd, rank, ws, st, True)
        if st > 0:
            cases[f"load_sd_offload_s{st}"] = p(_load_sd, rank, ws, st, False, "cpu")
        cases[f"replaced_s{st}"] = p(_replaced, rank, ws, st, memo)
        cases[f"cast_error_s{st}"] = p(_cast_error, rank, ws, st)
        cases[f"param_replaced_s{st}"] = p(_param_replaced, rank, ws, st)
        cases[f"frozen_cast_s{st}"] = p(_frozen_cast, rank, ws, st)
        if ws > 1:
            cases[f"ddp_refused_s{st}"] = p(_ddp_refused, rank, ws, st)
            cases[f"debug_ok_s{st}"] = p(_debug_reorder, rank, ws, st, False)
            cases[f"debug_reorder_s{st}"] = p(_debug_reorder, rank, ws, st, True)
    return run_cases(cases)


# [Note: the slow mark] (pyproject.toml): the largest world runs in CI's -m slow pass
WS = ws_params(1, 2, 3)  # harness [Note: world sizes in the default run]


def _res(ws):
    return cached(_rank_cases, ws)


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("no_sync", ["plain", "nosync", "allnosync"])
def test_accumulation_sums_like_ddp(ws, stage, no_sync):
    """loss / k per micro-batch (the torch habit) gives DDP's big-batch result: every backward
    reducing, all but the last under no_sync(), or all under no_sync() (step() reduces)."""
    for rel in case(_res(ws), f"accum_{no_sync}_s{stage}"):
        assert rel <= TOL


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
def test_no_sync_reduces_nothing(ws, stage):
    for inside, inside_rs, after_rs in case(_res(ws), f"no_sync_comm_s{stage}"):
        assert inside_rs == 0
        assert inside == 0 or stage == 3
        assert (after_rs > 0) == (ws > 1) or stage == 0


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
def test_step_without_zero_grad_keeps_summing(ws, stage):
    for rel in case(_res(ws), f"two_steps_s{stage}"):
        assert rel <= TOL


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
def test_grads_changed_after_a_reduction(ws, stage):
    """Without zero_grad after a step: a no_sync() backward, p.grad = None on one param, a
    second step() with no backward between, and (stages 0-1) p.grad assigned: as DDP."""
    for key in ("after_reduce", "step_twice") + (("assigned_after_reduce",) if stage < 2
                                                   else ()):
        for rel in case(_res(ws), f"{key}_s{stage}"):
            assert rel <= TOL, key


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
def test_p_grad_changed_between_backward_and_step_raises(ws, stage):
    """Before the fix the change was silently ignored: the step used the reduced gradient."""
    for out in case(_res(ws), f"changed_before_step_s{stage}"):
        assert "cleared after the last backward" in out["c"], out["c"]
        assert "replaced after the last backward" in out["a"], out["a"]
        assert "param group" in out["c"] and "opt.zero_grad()" in out["a"]
        for op in "ca":
            assert out[op + "_unchanged"] and out[op + "_moved"], (op, out)


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
def test_model_zero_grad_clears(ws, stage):
    for rel in case(_res(ws), f"model_zero_grad_s{stage}"):
        assert rel <= TOL


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("norm", ["2", "inf"])
def test_opt_clip_grad_norm_matches_torch(ws, stage, norm):
    name = f"opt_clip_s{stage}" if norm == "2" else f"opt_clip_inf_s{stage}"
    for rel, norm_rel in case(_res(ws), name):
        assert rel <= TOL
        assert norm_rel <= NORM_TOL


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
def test_torch_clip_grad_norm(ws, stage):
    for res in case(_res(ws), f"torch_clip_s{stage}"):
        if stage == 0:  # p.grad is DDP's gradient: torch's clipping is DDP's
            rel, norm_rel = res
            assert rel <= TOL and norm_rel <= NORM_TOL
        else:
            assert res[0] == "raised" and "opt.clip_grad_norm_" in res[1]


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
def test_p_grad(ws, stage):
    for res in case(_res(ws), f"pgrad_s{stage}"):
        if stage == 0:
            assert res["types"] == ["Tensor"] and res["rel"] <= TOL
        else:
            assert res["types"] == ["ReleasedGrad"]
        assert res["none_after_zero"]
        assert res["zeros_after_zero_false"]


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
def test_fp16_plain_backward_raises(ws, stage):
    for msg in case(_res(ws), f"fp16_plain_s{stage}"):
        assert "opt.backward(loss)" in msg


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("bare", [False, True])
def test_load_state_dict_after_construction(ws, stage, bare):
    for same in case(_res(ws), f"load_sd{'_bare' if bare else ''}_s{stage}"):
        assert same


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", [1, 2])
def test_load_state_dict_after_construction_with_offload(ws, stage):
    """The fp32 masters live on the host with offload='cpu': they are updated there."""
    for same in case(_res(ws), f"load_sd_offload_s{stage}"):
        assert same


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_params_replaced_are_followed(ws, stage):
    for rel in case(_res(ws), f"replaced_s{stage}"):
        assert rel <= TOL


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
def test_a_param_group_changed_between_steps_is_checked_before_the_step(ws, stage):
    """Before: the lr NaN in group 1 raised in group 1's kernel after group 0 was updated (a
    half step; the retry updated group 0 twice), and amsgrad=True was ignored."""
    for r, x in enumerate(case(_res(ws), f"group_changed_s{stage}")):
        assert "lr must be" in x["lr_nan"] and "param group 1" in x["lr_nan"], x["lr_nan"]
        assert "'amsgrad'" in x["amsgrad"] and "param group 0" in x["amsgrad"], x["amsgrad"]
        for name in ("lr_nan", "amsgrad"):
            assert x[name + "_unchanged"], f"rank {r}: the failed step ({name}) changed params"
            assert x[name + "_rel"] <= TOL, f"rank {r}: {name}: vs DDP + AdamW {x[name + '_rel']}"


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
def test_params_added_to_a_group_after_construction_are_a_clear_error(ws, stage):
    """Before: the appended param made opt.zero_grad() raise an IndexError, and a param
    swapped into the list was never trained, silently."""
    for r, x in enumerate(case(_res(ws), f"group_params_edited_s{stage}")):
        for how in ("append", "swap"):
            for where in ("zero_grad", "step"):
                msg = x[f"{how}_{where}"]
                assert "params of param group 0 were changed after" in msg, msg
            assert x[how + "_unchanged"], f"rank {r}: {how}: the refused calls changed params"
            assert x[how + "_goes_on"], f"rank {r}: {how}: the run did not go on"


@pytest.mark.parametrize("ws", ws_params(2, 3))
@pytest.mark.parametrize("stage", STAGES)
def test_hyperparameters_that_differ_across_ranks_are_a_clear_error(ws, stage):
    """Before: each rank stepped with its own lr, without a word (the replicas drift apart at
    stage 0; at stages 1-3 every rank holds pieces trained with different lrs)."""
    for r, x in enumerate(case(_res(ws), f"hyper_differ_s{stage}")):
        for k in ("first", "retry"):
            assert "differ across the data-parallel ranks" in x[k], f"rank {r} {k}: {x[k]}"
        assert x["unchanged"], f"rank {r}: the refused step changed params"
        assert x["rel"] <= TOL, f"rank {r}: vs DDP + AdamW {x['rel']:.3g}"


@pytest.mark.parametrize("ws", WS)
def test_torch_clipping_of_loss_scaled_grads_is_a_clear_error(ws):
    """Before: torch's clipping acted on the fp16 loss-scaled p.grad (2^12 x the gradient) and
    the step ran on the wrongly clipped gradient without a word."""
    for r, x in enumerate(case(_res(ws), "fp16_torch_clip_s0")):
        for how in ("norm", "value"):
            assert "changed in place after the backward" in x[how] \
                and "opt.clip_grad_norm_" in x[how], f"rank {r} {how}: {x[how]}"
            assert x[how + "_unchanged"], f"rank {r}: the refused step changed params"
            assert x[how + "_goes_on"], f"rank {r}: the run did not go on"


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
def test_post_accumulate_grad_hooks_see_and_change_the_gradient_as_under_ddp(ws, stage):
    """Before: zerokern's own post-accumulate hook ran first and launched the bucket's
    reduction, so a hook registered after the wrap scaled a gradient already reduced (stage
    1: in a consumed buffer, a wrong step without a word, 5e-3 off), read a divided gradient
    (stage 0) or found p.grad None (stages 2-3). Now as DDP; where the sum is held only reduced
    and sharded (stages 2-3, stage 1 without no_sync()) accumulation under such a hook is a
    clear error on every rank (stage 1, N = 1, before that check: 1e-2 off)."""
    for r, res in enumerate(case(_res(ws), f"post_hooks_s{stage}")):
        rel, seen_rel = res
        assert rel <= TOL, f"rank {r}: params vs DDP + AdamW with the same hooks: {rel:.3g}"
        assert isinstance(seen_rel, float) and seen_rel <= 1e-6, f"rank {r}: {seen_rel}"
    for r, res in enumerate(case(_res(ws), f"post_hooks_accum_s{stage}")
                            + case(_res(ws), f"post_hooks_synced_s{stage}")):
        if len(res) == 2:
            rel, seen_rel = res
            assert rel <= TOL, f"rank {r}: accumulation: params vs DDP: {rel:.3g}"
            assert isinstance(seen_rel, float) and seen_rel <= 1e-6, f"rank {r}: {seen_rel}"
        else:
            msg, unchanged, goes_on = res
            assert "register_post_accumulate_grad_hook" in msg and "accumulation" in msg, \
                f"rank {r}: {msg}"
            assert unchanged, f"rank {r}: the refused backward changed params"
            assert goes_on, f"rank {r}: the run did not go on after zero_grad()"


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_cast_after_construction_raises(ws, stage):
    for msg in case(_res(ws), f"cast_error_s{stage}"):
        assert "precision='bf16'" in msg


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_replaced_parameter_raises(ws, stage):
    for msg, unchanged in case(_res(ws), f"param_replaced_s{stage}"):
        assert "parameters changed" in msg and "fc1.weight" in msg
        assert unchanged


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_frozen_params_cast(ws, stage):
    for dt in case(_res(ws), f"frozen_cast_s{stage}"):
        assert dt == "torch.bfloat16"


@pytest.mark.parametrize("ws", WS)
@pytest.mark.parametrize("stage", STAGES)
def test_optimizer_is_garbage_collected(ws, stage):
    for freed_opt, freed_model in case(_res(ws), f"gc_s{stage}"):
        assert freed_opt and freed_model


# the N=3 spawn of this module runs in CI's -m slow pass ([Note: the slow mark]); N=2 (one rank
# takes the branch / wraps differently) stays in the default run. The N=3 spawn took 59 s / 23 s
# of the default run (durations on 2026-11-26, default run 661 s against the 10-minute target).
@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_ddp_wrap_is_refused(ws, stage):
    for msg, unchanged in case(_res(ws), f"ddp_refused_s{stage}"):
        assert "DistributedDataParallel" in msg and "bare model" in msg
        assert unchanged


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.slow)])  # (as above)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_debug_collectives_catches_a_reorder(ws, stage):
    assert case(_res(ws), f"debug_ok_s{stage}") == ["trained"] * ws  # negative control
    for msg in case(_res(ws), f"debug_reorder_s{stage}"):
        assert "collective" in msg.lower() and "rank" in msg


def test_world_size_env_without_process_group_raises(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="init_process_group"):
        zk.ZeroAdamW(nn.Linear(4, 4), stage=1, precision="fp32")


def test_negative_control_divided_by_micro_twice():
    """The old 'average over micro-batches' semantics (loss / k AND grads / k) is caught:
    with eps=0.25 Adam is not scale-invariant, so k x too small grads move the params."""
    got = cached(_control, 1)[0]
    assert got > 100 * TOL


def _control(rank, ws):
    ref = _ref(rank, ws, micro=MICRO)[0]
    model = M.make_model()
    opt = M.zero_opt(model, 1)
    for s in range(STEPS):
        opt.zero_grad()
        for m in range(MICRO):
            opt.backward(M.loss_fn(model, M.rank_tokens(s, rank, ws, micro=m)) / MICRO ** 2)
        opt.step()
    return _rel(M.full_snapshot(model, opt), ref)


def test_torch_compile_whole_model_stage2(one_thread):  # noqa: F811 - the fixture
    """torch.compile(model) at stages 0-2: the param hooks run in eager autograd (AccumulateGrad
    stays outside the compiled graph), so training matches eager torch AdamW. Stage 2 is the
    one whose hooks do the most (staging, reduce-scatter, ReleasedGrad); stages 0-1 measured
    the same 7.3e-8 by hand."""
    torch.manual_seed(0)
    ref = M.make_model()
    ref_opt = M.torch_adamw(ref)
    model = M.make_model()
    opt = M.zero_opt(model, 2)
    compiled = torch.compile(model)
    for s in range(STEPS):
        opt.zero_grad()
        opt.backward(M.loss_fn(compiled, M.rank_tokens(s, 0, 1)))
        opt.step()
        ref_opt.zero_grad()
        M.loss_fn(ref, M.rank_tokens(s, 0, 1)).backward()
        ref_opt.step()
    assert M.rel_err(M.snapshot(model), M.snapshot(ref)) <= TOL


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_opt_state_of_a_param_is_a_clear_error_not_an_empty_dict(stage, one_thread):  # noqa: F811
    """[Note: no per-param opt.state] (core/optimizer.py). Code written for torch reads or
    resets a param's moments in opt.state[p]; torch's defaultdict gave a new empty dict there,
    so `if "exp_avg" in opt.state[p]: opt.state[p]["exp_avg"].zero_()` reset nothing, silently
    (shown on the old code: no error, the moments unchanged)."""
    model = M.make_model()
    opt = M.zero_opt(model, stage)
    opt.zero_grad()
    M.loss_fn(model, M.rank_tokens(0, 0, 1)).backward()
    opt.step()
    before = [{k: t.clone() for k, t in g.state_tensors().items()} for g in opt.flat_groups]
    p = opt.param_groups[0]["params"][0]
    for use in (lambda: "exp_avg" in opt.state[p], lambda: opt.state.get(p),
                lambda: opt.state.setdefault(p, {}), lambda: opt.state.__setitem__(p, {})):
        with pytest.raises(RuntimeError, match=r"ZeroAdamW.state\[p\]: a zerokern optimizer "
                                               r"keeps its state .* zerokern.checkpoint"):
            use()
    # walking it finds nothing (library code that moves optimizer tensors has none to move)
    assert len(opt.state) == 0 and not list(opt.state.values()) and p not in opt.state
    after = [{k: t.clone() for k, t in g.state_tensors().items()} for g in opt.flat_groups]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before, after) for k in a)
    # the torch optimizer it stands in for: the same code does reach the state there
    ref = torch.optim.AdamW(M.make_model().parameters())
    q = ref.param_groups[0]["params"][0]
    q.grad = torch.ones_like(q)
    ref.step()
    assert "exp_avg" in ref.state[q]
