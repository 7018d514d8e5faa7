"""The pipeline's agreement: one comparison over the whole job at a schedule's first step.

[Note: agreement over the pipeline]
Each rank builds its stage, its optimizer and its schedule alone, so nothing local can tell
that a peer chose differently; and a difference is silent or a hang: stages with different
micro-batch counts wait for a send that never comes, a stage at another ZeRO stage sums its
grad statistics in other units (stage 0 reads averaged grads, 1-3 summed ones), a param in two
stage modules trains as two copies. So at the first `schedule.step()` of every schedule, before
any of its communication (torch calls the stage's `clear_runtime_states` first), each rank
describes what it runs and the descriptions are gathered over the pp group, then over the
optimizer's dp world, then over tp: three `all_gather_object`s of a few hundred bytes, once per
schedule. Every rank then holds every description and decides alone, alike, so a difference
raises the same ValueError on every rank, before anything changed. Compared:
- the schedule class, its micro-batch count and `scale_grads`;
- the stage layout: num_stages, and every stage index held by the same number of ranks;
- the optimizers' ZeRO stage, precision, loss scale, max_grad_norm and learning rates, and
  the stages' keep_gathered (stage 3 gathers at other moments otherwise);
- per rank: no `opt.no_sync()` around the schedule step (the stage decides which backward
  reduces; at later steps a rank inside no_sync() raises on its own and posts the error, as
  below); its stages' optimizer (one per rank, stage.py [Note: one optimizer per rank]) with
  the pp role over the stage's own pp group, params owned by it, no param object in two of
  the rank's stage modules;
- across ranks, stage modules whose params overlap: a trainable param with the same shape,
  dtype and values (a float64 sum and sum of squares) in two stages is taken to be one param
  in two stage modules (every rank builds the model from one seed; names are not compared,
  since a stage module built as `nn.Sequential(*blocks)` renames them). A param whose
  elements are all equal (a zero bias, a ones norm weight) is not compared: such params
  coincide by chance. A copy made on purpose (a tied embedding copied into the last stage)
  is refused too: tied weights across stages are not supported.

[Note: a failure inside the schedule]
A rank whose stage raises inside a forward or backward must not leave its peers waiting.
Its pipeline peers may be in one of torch's point-to-point receives, which nothing can poll
on gloo (a timed-out gloo wait closes the pair; `is_completed()` never turns True for a
receive; destroying a group closes nothing while references to it live: all measured, torch
2.13). So the failing rank drains the schedule step instead of leaving it: it posts the error
on every failure channel of its optimizer (dp, pp, tp: comm/abort.py), stops computing, and
sends what its peers expect, NaN of torch's own metadata for each output and input grad, so
the step completes everywhere; its next `opt.step()` raises the error. Its peers' first
zerokern collective after that (the last backward's reduce-scatter of its dp peers, the
step's agreement over pp for the others) sees the post and raises RankAborted naming it,
within a poll interval. Nothing a drained step computed reaches a param: every rank raises
before its update. A failure before torch's shape inference (the first step's first
forward) has no metadata to drain with: it is posted and raised at once. The loss function
runs in the schedule, outside the stage: an error there is not drained.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
    _PipelineSchedule,
)

SUPPORTED_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
                       "ScheduleLoopedBFS")
NO_SYNC = ("schedule.step() inside opt.no_sync(): the stage decides "
           "which backward reduces (the step's last, [Note: one reduction per schedule step] "
           "in zerokern/pipelining/stage.py). To accumulate over more micro-batches raise "
           "n_microbatches, or run several schedule steps with scale_grads=False before one "
           "opt.step() outside no_sync() (their gradients sum)")
ACCUMULATED = (
    "schedule.step() with scale_grads=True while the optimizer holds the gradients of {n} "
    "earlier backward(s) (a second schedule step before opt.step()/opt.zero_grad()): torch's "
    "PipelineStage divides whatever p.grad holds at every such step, (g1 / n + g2) / n over "
    "two steps, which zerokern (the division folded into the loss) does not reproduce. To "
    "accumulate over several schedule steps build the schedule with scale_grads=False (the "
    "micro-batch gradients then sum, as torch's) and scale the loss yourself (e.g. divide it "
    "by steps x n_microbatches), or use more micro-batches (n_microbatches) and one schedule "
    "step per opt.step(); nothing was changed")
_SUPPORTED = (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS)


def calling_schedule() -> Optional[_PipelineSchedule]:
    """The torch schedule whose `step()` called the stage (a few frames up), or None when
    the stage is driven by hand."""
    frame = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, _PipelineSchedule):
            return obj
        frame = frame.f_back
    return None


def schedule_stages(schedule) -> list:
    """The stages a schedule drives on this rank."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def _fingerprints(module: torch.nn.Module) -> List[tuple]:
    """(name, shape, dtype, sum, sum of squares) of each trainable, non-constant param."""
    out = []
    for name, p in module.named_parameters():
        if not p.requires_grad or p.numel() == 0:
            continue
        v = p.detach().reshape(-1).double()
        if bool((v == v[0]).all()):
            continue  # constant: equal by chance in two stages (zero biases, ones weights)
        out.append((name, tuple(p.shape), str(p.dtype), float(v.sum()), float((v * v).sum())))
    return out


def _ranks(group) -> List[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _describe(schedule, stages: list) -> Dict[str, Any]:
    """What this rank runs, and the problems only it can see (raised on every rank)."""
    errors = []
    me = dist.get_rank()
    # (a ZeroPipelineStage is known by its flag, not by an import of stage.py, which imports
    # this module: no loop)
    ours = [s for s in stages if getattr(s, "owned_by_zerokern", False)]
    if len(ours) != len(stages):
        errors.append("a stage of this rank is a plain PipelineStage; every stage needs the "
                      "optimizer: ZeroPipelineStage(..., optimizer)")
    if not isinstance(schedule, _SUPPORTED):
        errors.append(f"schedule {type(schedule).__name__} is not supported (split backward "
                      f"passes); use one of {SUPPORTED_SCHEDULES}")
    opts = {id(s.optimizer): s.optimizer for s in ours}
    if len(opts) > 1:
        errors.append(f"its {len(ours)} stages hold {len(opts)} optimizers: with several "
                      "stages per rank, build one optimizer over all of the rank's stage "
                      "modules (e.g. ZeroAdamW(nn.ModuleList(modules), mesh=world)) and give "
                      "it to each stage")
    if any(not s.optimizer.grad_sync.sync for s in ours):
        errors.append(NO_SYNC)
    zero: Dict[str, Any] = {}
    params: Dict[int, list] = {}
    if ours:
        opt = ours[0].optimizer
        pp = opt.plan.pp
        stage_group = _ranks(ours[0].group)
        if pp is None and len(stage_group) > 1:
            errors.append("the optimizer has no pipeline role: build it with mesh= the world "
                          "mesh (with its 'pp' dim), not mesh=world['dp'], or its grad norm "
                          "and overflow flag would cover this stage only")
        elif pp is not None and _ranks(pp.group) != stage_group:
            errors.append(f"the stage's group (ranks {stage_group}) is not the optimizer's pp "
                          f"group (ranks {_ranks(pp.group)}): pass group=world['pp']."
                          "get_group() and mesh=world")
        seen: Dict[int, int] = {}
        for s in ours:
            for p in s.submod.parameters():
                if id(p) in seen and seen[id(p)] != s.stage_index:
                    errors.append(f"a param is in stage modules {seen[id(p)]} and "
                                  f"{s.stage_index}: stage modules must not share params")
                    break
                seen[id(p)] = s.stage_index
                owner = getattr(p, "_zerokern_sync", None)
                gs = owner() if owner is not None else None
                if p.requires_grad and gs is not s.optimizer.grad_sync:
                    errors.append(f"stage {s.stage_index}: a trainable param is not the "
                                  "optimizer's (build the optimizer over the stage module(s))")
                    break
        groups = opt.param_groups
        zero = {"optimizer": type(opt).__name__, "stage": opt.stage,
                "precision": opt.precision, "loss_scale": float(opt.loss_scale),
                "max_grad_norm": opt.max_grad_norm,
                "lr": sorted({float(g["lr"]) for g in groups}),
                "keep_gathered": sorted({s.keep_gathered for s in ours})}
        with opt.gathered_params() if opt.stage == 3 else _Null():
            params = {s.stage_index: _fingerprints(s.submod) for s in ours}
    return {"rank": me, "schedule": type(schedule).__name__,
            "n_microbatches": int(schedule._n_microbatches),
            "scale_grads": bool(schedule.scale_grads),
            "stages": sorted(s.stage_index for s in stages),
            "num_stages": sorted({s.num_stages for s in stages}),
            "zero": zero, "params": params, "errors": errors}


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _gather(obj, group) -> list:
    n = dist.get_world_size(group)
    if n == 1:
        return [obj]
    out = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


def _flatten(x) -> list:
    return [d for v in x for d in _flatten(v)] if isinstance(x, list) else [x]


def agree_on_schedule(schedule, stage) -> None:
    """[Note: agreement over the pipeline] Describe, gather over pp x dp x tp, and raise the
    same ValueError on every rank if the descriptions disagree."""
    stages = schedule_stages(schedule)
    desc = _describe(schedule, stages)
    opt = stage.optimizer
    seen = _gather(desc, stage.group)  # over the pp group
    seen = _gather(seen, opt.comm.world.group)  # over dp: every pp group of the job
    if opt.plan.tp is not None:
        seen = _gather(seen, opt.plan.tp.comm.group)
    everyone = sorted(_flatten(seen), key=lambda d: d["rank"])
    for s in stages:  # one agreement per schedule and rank
        if hasattr(s, "_schedule"):
            s._schedule = weakref.ref(schedule)
    problem = _disagreement(everyone)
    if problem is not None:
        raise ValueError(f"ZeroPipelineStage: {problem}; nothing was changed")


def _disagreement(everyone: List[dict]) -> Optional[str]:
    local = [f"rank {d['rank']}: {e}" for d in everyone for e in d["errors"]]
    if local:
        return "; ".join(local[:4]) + (f" (and {len(local) - 4} more)" if len(local) > 4 else "")

    def differ(key, what):
        vals = {repr(d[key]) for d in everyone}
        if len(vals) > 1:
            per = ", ".join(f"rank {d['rank']}: {d[key]!r}" for d in everyone)
            return f"the pipeline's ranks disagree on {what} ({per})"
        return None

    for key, what in (("schedule", "the schedule"), ("n_microbatches",
                      "the number of micro-batches (n_microbatches)"),
                      ("scale_grads", "the schedule's scale_grads"),
                      ("num_stages", "the number of stages (num_stages)"),
                      ("zero", "the optimizer's settings (ZeRO stage, precision, loss scale, "
                               "max_grad_norm, lr)")):
        msg = differ(key, what)
        if msg is not None:
            return msg
    n = everyone[0]["num_stages"][0]
    held = {}
    for d in everyone:
        for s in d["stages"]:
            held[s] = held.get(s, 0) + 1
    if sorted(held) != list(range(n)) or len(set(held.values())) != 1:
        return (f"the stage layout is not a pipeline of {n} stages held alike by every "
                f"replica: stage index -> ranks holding it {dict(sorted(held.items()))}")
    where: Dict[tuple, int] = {}
    for d in everyone:
        for s, prints in d["params"].items():
            for fp in prints:
                other = where.setdefault(fp[1:], s)  # (names may restart per stage module)
                if other != s:
                    return (f"stage modules {other} and {s} both hold the param {fp[0]!r} "
                            f"(shape {list(fp[1])}, the same values): a param may be in one "
                            "stage only (tied weights across stages are not supported)")
    return None


def post_failure(stage, error: BaseException) -> None:
    """[Note: a failure inside the schedule]: post the error on every channel the peers may
    wait on (the optimizer's dp groups, its pp group, its tp group)."""
    opt = stage.optimizer
    comms = [opt.comm, opt.plan.pp, getattr(opt.plan.tp, "comm", None)]
    for c in comms:
        if c is None:
            continue
        try:
            c.signal_failure(error)
        except Exception:  # noqa: BLE001 (the original error is the one to raise)
            pass


def raise_at_next_step(opt, error: BaseException) -> None:
    """The failing rank's next `opt.step()` raises `error` (as torch's lr schedulers do, the
    instance's `step` is wrapped): every rank is then out of the schedule step, and the
    peers' first collective of their step sees the posted error."""
    inner = opt.step

    def step(*args, **kwargs):
        opt.step = inner
        raise error

    step._wrapped_by_lr_sched = getattr(inner, "_wrapped_by_lr_sched", False)
    opt.step = step
