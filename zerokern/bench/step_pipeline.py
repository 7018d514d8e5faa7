"""`zerokern bench --step --pp P`: the step benchmark's pipeline row (issue 38).

The demo GPT split into P pipeline stages (tools/gpt_stages.py) on P x dp gloo ranks, the
world mesh ("pp", "dp"), each side trained in the same run on its own copy of the same
stages and data, one schedule (`--schedule` 1f1b | gpipe) of `--micro-batches` micro-batches:
- zerokern at stage S (`--stages`, 1-3 by default): `ZeroPipelineStage` with one `ZeroAdamW`
  per stage over the world mesh (ZeRO over dp, agreement over pp x dp), as
  `zerokern train --mesh PPxTPxDP` builds it (train/pipeline.py); at stage 3 also a side with
  `keep_gathered=True` (the stage gathered once per step, the twin of the peer's setting;
  `--no-keep-gathered` leaves it out);
- the peer, torchtitan's composition: torch's `PipelineStage` over the stage wrapped in FSDP2
  (`fully_shard` per block, then the stage, over the dp sub-mesh) + `torch.optim.AdamW`
  (fused), with torchtitan's pipelining default `reshard_after_forward=False` (the stage is
  gathered once per step, not around every micro-batch).

[Note: how the pipeline row is timed]
One repetition is one training step of each side: `schedule.step` (every micro-batch's
forward and backward, the data-parallel reduction), the optimizer step and zero_grad, between
a barrier and a MAX all-reduce of each rank's time, so a row's time is the slowest rank's.
The sides alternate round-robin and the first side rotates each repetition (common.py
[Note: how a repetition is timed]); rows report the median after the warm-up repetitions.
Collective counts come from one further step per side, outside the timed ones: zerokern's
`comm_stats()` calls, and for FSDP2 the calls to `dist.all_gather_single` /
`dist.reduce_scatter_single` / `dist.all_reduce` (FSDP2's own collectives,
fsdp/_fully_shard/_fsdp_collectives.py) counted by wrapping them for that step; the pipeline's
send/recv between stages are the same on both sides and not counted. Per-stage memory: the
bytes of the params, grads and optimizer state each rank holds (zerokern: `memory_report()`,
its staging buckets apart; the peer: the tensors' storages, FSDP2's local shards), the max
over the stage's dp ranks, measured after the last backward (torch frees grads in zero_grad).

[Note: the fairness check]
Both sides start from the same stage weights (each stage seeded once, then copied) and see
the same micro-batches (drawn per dp rank from one seed), so the loss of the first step is
the same number up to fp32 summation order; the JSON records it per side, and a difference
beyond 1e-5 relative is printed as a MISS (the comparison would not be of the same work).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerokern.tools.spawn import RankFailure, spawn_ranks

from . import common

PEER = "FSDP2 + torch PipelineStage + AdamW(fused)"
HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
DATA_SEED = 4321
LOSS_RTOL = 1e-5  # [Note: the fairness check]


def _loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def _schedule_class(name: str):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    return ScheduleGPipe if name == "gpipe" else Schedule1F1B


class _Side:
    """One side of the comparison on this rank: its stage, schedule, optimizer and data."""

    def __init__(self, name, module, schedule, opt, data, first, last, count, memory,
                 gathered=None):
        self.name, self.module, self.schedule, self.opt = name, module, schedule, opt
        self.data, self.first, self.last = data, first, last
        self.count, self.memory = count, memory  # collective counter, model-state bytes
        # stage 3: the most param bytes held gathered at once in a step, beside the shards
        self.gathered = gathered
        self.steps, self.losses, self.mem_bytes = 0, [], 0

    def step(self, probe: bool = False) -> None:
        x = self.data[self.steps % len(self.data)]
        self.steps += 1
        out: List[torch.Tensor] = []
        kw = {"target": x[:, 1:], "losses": out} if self.last else {}
        self.schedule.step(*([x[:, :-1]] if self.first else []), **kw)
        if probe:  # after the last backward: the grads are still held
            self.mem_bytes = self.memory()
        self.opt.step()
        self.opt.zero_grad()
        if self.last:
            self.losses.append(float(torch.stack([v.detach().float() for v in out]).mean()))


@contextlib.contextmanager
def _counting_torch_collectives(calls: Dict[str, int]):
    """Count FSDP2's collectives ([Note: how the pipeline row is timed]) inside the block."""
    names = {"all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single",
             "all_reduce": "all_reduce"}
    saved = {k: getattr(dist, fn) for k, fn in names.items()}

    def wrap(kind, fn):
        def counted(*a, **kw):
            calls[kind] = calls.get(kind, 0) + 1
            return fn(*a, **kw)
        return counted
    try:
        for k, fn in names.items():
            setattr(dist, fn, wrap(k, saved[k]))
        yield calls
    finally:
        for k, fn in names.items():
            setattr(dist, fn, saved[k])


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _make_sides(args, rank: int, world):
    """(this rank's sides, its stage's param count)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    import zerokern as zk
    from zerokern.pipelining import ZeroPipelineStage
    from zerokern.tools.gpt import PRESETS, GPTConfig
    from zerokern.tools.gpt_stages import GPTStage

    dev = torch.device("cpu")
    pp = args.pp
    s, dp_rank = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    cfg = GPTConfig(**{**PRESETS[args.model_size].__dict__, "seq": args.seq})
    torch.manual_seed(1_000 + s)  # the same stage on every dp rank
    proto = GPTStage(cfg, s, pp)
    gen = torch.Generator().manual_seed(DATA_SEED + dp_rank)  # one replica's data
    data = [torch.randint(0, cfg.vocab, (args.batch * args.micro_batches, args.seq + 1),
                          generator=gen) for _ in range(4)]
    kind = _schedule_class(args.schedule)
    first, last = s == 0, s == pp - 1
    pp_group = world["pp"].get_group()
    sides = []
    for stage in args.stages:
        for keep in ([False, True] if stage == 3 and args.keep_gathered else [False]):
            m = copy.deepcopy(proto)
            opt = zk.ZeroAdamW(m, stage=stage, precision="fp32", mesh=world,
                               bucket_mb=args.bucket_mb, **HP)
            st = ZeroPipelineStage(m, s, pp, dev, opt, group=pp_group, keep_gathered=keep)
            sched = kind(st, args.micro_batches, loss_fn=_loss_fn)

            def memory(opt=opt):
                r = opt.memory_report()
                return int(r["measured_total"] - r["measured"]["buckets"])
            name = f"zerokern s{stage}" + (" keep_gathered" if keep else "")
            # the runtime's own high-water mark of gathered unit bytes (stage3/runtime.py)
            gathered = (lambda opt=opt: opt.grad_sync.peak_live_bytes) if stage == 3 else None
            sides.append(_Side(name, m, sched, opt, data, first, last,
                               lambda opt=opt: opt.comm_stats(reset=True)["calls"], memory,
                               gathered))
    if args.peers:
        m = copy.deepcopy(proto)
        dp_mesh = world["dp"]
        for blk in m.blocks:  # per block, then the stage: torchtitan's units
            fully_shard(blk, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(m, mesh=dp_mesh, reshard_after_forward=False)
        opt = torch.optim.AdamW(m.parameters(), fused=True, **HP)
        st = PipelineStage(m, s, pp, dev, group=pp_group)
        sched = kind(st, args.micro_batches, loss_fn=_loss_fn)

        def memory(m=m, opt=opt):
            ps = list(m.parameters())
            state = [v for o in opt.state.values() for v in o.values()
                     if isinstance(v, torch.Tensor)]
            return _storage_bytes(ps) + _storage_bytes(p.grad for p in ps) + \
                _storage_bytes(state)
        # reshard_after_forward=False: every param of the stage stays unsharded from its
        # first all-gather of a step to the step's last backward (FSDP2's contract): the
        # stage's whole params, fp32
        whole = 4 * sum(p.numel() for p in proto.parameters())
        sides.append(_Side(PEER, m, sched, opt, data, first, last, None, memory,
                           lambda whole=whole: whole))
    return sides, sum(p.numel() for p in proto.parameters())


def _worker(rank: int, world_size: int, args):
    """One rank: every side, round-robin ([Note: how the pipeline row is timed])."""
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (args.pp, world_size // args.pp),
                             mesh_dim_names=("pp", "dp"))
    sides, params = _make_sides(args, rank, world)
    times: Dict[str, List[float]] = {sd.name: [] for sd in sides}
    for rep in range(args.warmup + args.reps):
        for i in range(len(sides)):
            sd = sides[(i + rep) % len(sides)]
            dist.barrier()
            t0 = time.perf_counter()
            sd.step()
            dt = torch.tensor((time.perf_counter() - t0) * 1e3)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if rep >= args.warmup:
                times[sd.name].append(float(dt))
    calls, mem, gathered = {}, {}, {}
    for sd in sides:  # one more step each, counted, outside the timed ones
        dist.barrier()
        if sd.count is not None:
            sd.count()  # reset
            sd.step(probe=True)
            c = sd.count()
        else:
            with _counting_torch_collectives({}) as c:
                sd.step(probe=True)
        calls[sd.name] = {k: int(c.get(k, 0)) for k in ("all_gather", "reduce_scatter",
                                                          "all_reduce")}
        mem[sd.name] = sd.mem_bytes
        if sd.gathered is not None:
            gathered[sd.name] = int(sd.gathered())
    stage = world["pp"].get_local_rank()
    mine = {"rank": rank, "stage": stage, "dp_rank": world["dp"].get_local_rank(),
            "calls": calls, "mem": mem, "gathered": gathered,
            "params": params,
            "losses": {sd.name: sd.losses for sd in sides} if sides[0].last else None}
    everyone: List[dict] = [None] * world_size  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    return {"times": times, "ranks": everyone} if rank == 0 else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The pipeline row's flags (`zerokern bench --step --pp P ...`).

    Args:
        p: step.py's parser.
    """
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline stages: run the pipeline row (the GPT split into PP stages "
                        "on PP x dp gloo ranks, zerokern's ZeroPipelineStage against torch's "
                        "PipelineStage + FSDP2 + AdamW)")
    p.add_argument("--micro-batches", type=int, default=4,
                   help="with --pp: micro-batches per step (each --batch sequences)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                   help="with --pp: the pipeline schedule of both sides")
    p.add_argument("--no-keep-gathered", dest="keep_gathered", action="store_false",
                   help="with --pp: leave out zerokern stage 3 with keep_gathered=True (the "
                        "stage gathered once per step: the twin of the peer's "
                        "reshard_after_forward=False)")
    p.add_argument("--tag", default="", help="with --pp: a suffix for the result files")


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Flag errors of the pipeline row, through p.error (before any rank starts).

    Args:
        p: the parser (its error exits with the message).
        a: the parsed arguments.
    """
    from zerokern.tools.gpt import PRESETS

    layers = PRESETS[a.model_size].n_layers
    if not 2 <= a.pp <= layers:
        p.error(f"--pp must be in [2, {layers}] (the {a.model_size} GPT's layers), got {a.pp}")
    if a.nproc % a.pp:
        p.error(f"--nproc {a.nproc} is not a multiple of --pp {a.pp} (ranks = pp x dp)")
    if a.micro_batches < a.pp:
        p.error(f"--micro-batches {a.micro_batches} < --pp {a.pp}: 1F1B needs at least one "
                "micro-batch per stage")
    if a.device != "cpu":
        p.error("--pp runs on CPU gloo ranks only (--device cpu)")
    if a.optimizer != "adamw" or a.precision != "fp32":
        p.error("--pp compares fp32 ZeroAdamW with torch AdamW only (--optimizer adamw, "
                "--precision fp32)")
    if not set(a.stages) <= {1, 2, 3}:
        p.error(f"--pp runs zerokern at stages 1-3, got --stages {a.stages}")
    if a.seq > PRESETS[a.model_size].seq:
        p.error(f"--seq {a.seq} > the {a.model_size} GPT's {PRESETS[a.model_size].seq} "
                "positions")


def main(args: argparse.Namespace) -> int:
    """Run the pipeline row and write step-pp-*.json / .md (step.main dispatches here).

    Args:
        args: step.parse_args' namespace with --pp set.
    """
    load = {"other_cpu_load_before": common.other_load_now(),
            "loadavg_1min_before": round(os.getloadavg()[0], 2)}
    try:
        res = spawn_ranks(_worker, args.nproc, args, backend="gloo",
                          threads=max(1, common.usable_cpus() // args.nproc))[0]
    except RankFailure as e:
        print(e, file=sys.stderr)
        raise SystemExit("a benchmark rank failed") from None
    res["load"] = dict(load, loadavg_1min_after=round(os.getloadavg()[0], 2))
    return report(args, res)


def _loss_check(res) -> dict:
    """Each side's losses (the mean over the last stage's dp ranks), and the first step's
    largest relative difference from the peer ([Note: the fairness check])."""
    lasts = [r for r in res["ranks"] if r["losses"] is not None]
    names = list(lasts[0]["losses"])
    losses = {n: [sum(r["losses"][n][k] for r in lasts) / len(lasts)
                  for k in range(len(lasts[0]["losses"][n]))] for n in names}
    ref = losses.get(PEER)
    diff = {n: abs(v[0] - ref[0]) / abs(ref[0]) for n, v in losses.items()
            if ref is not None and n != PEER}
    return {"losses": losses, "step1_rel_diff_vs_peer": diff}


def report(args, res) -> int:
    env = common.environment(torch.device("cpu"))
    dp = args.nproc // args.pp
    env.update(world_size=args.nproc, backend="gloo", model_size=args.model_size,
               pp=args.pp, dp=dp, schedule=args.schedule, micro_batches=args.micro_batches,
               batch=args.batch, seq=args.seq, precision="fp32", reps=args.reps,
               warmup=args.warmup, uptime=_uptime())
    env.update(res["load"])
    checks = _loss_check(res)
    peer = common.summarize(res["times"][PEER])["median_ms"] if PEER in res["times"] else None
    by_stage: Dict[int, List[dict]] = {}
    for r in res["ranks"]:
        by_stage.setdefault(r["stage"], []).append(r)
    rows = []
    for name, ms in res["times"].items():
        s = common.summarize(ms)
        row = {"provider": name, "iter_ms": s["median_ms"], "p20_ms": s["p20_ms"],
               "p80_ms": s["p80_ms"], "min_ms": s["min_ms"],
               "vs_peer": s["median_ms"] / peer if peer else None}
        for st, rs in sorted(by_stage.items()):
            c = rs[0]["calls"][name]  # the same on every dp rank of a stage
            row[f"s{st}_all_gathers"] = c["all_gather"]
            row[f"s{st}_reduce_scatters"] = c["reduce_scatter"]
            row[f"s{st}_all_reduces"] = c["all_reduce"]
            row[f"s{st}_state_MiB"] = max(r["mem"][name] for r in rs) / 2**20
            peaks = [r.get("gathered", {}).get(name) for r in rs]
            row[f"s{st}_gathered_MiB"] = (max(peaks) / 2**20 if None not in peaks
                                          else None)
        row["loss_step1"] = checks["losses"][name][0]
        rows.append(row)
    stages = sorted(by_stage)
    cols = [("provider", "provider"), ("iter_ms", "step ms (median)"), ("p20_ms", "p20"),
            ("p80_ms", "p80"), ("vs_peer", "× peer")]
    for st in stages:
        cols += [(f"s{st}_all_gathers", f"stage {st} AG/step"),
                 (f"s{st}_reduce_scatters", f"stage {st} RS/step"),
                 (f"s{st}_all_reduces", f"stage {st} AR/step"),
                 (f"s{st}_state_MiB", f"stage {st} MiB/rank"),
                 (f"s{st}_gathered_MiB", f"stage {st} gathered params peak MiB")]
    cols.append(("loss_step1", "loss, step 1"))
    title = (f"step benchmark, pipeline: GPT {args.model_size} in {args.pp} stages × dp {dp} "
             f"({args.nproc} gloo ranks), {args.schedule}, {args.micro_batches} micro-batches "
             f"of {args.batch}, fp32")
    common.print_table(rows, cols, title)
    targets = []
    for name, d in checks["step1_rel_diff_vs_peer"].items():
        targets.append((f"{name}: step-1 loss equals the peer's (same weights, same data)",
                        f"rel. diff {d:.1e}", d <= LOSS_RTOL))
    for t, v, ok in targets:
        print(f"[{'PASS' if ok else 'MISS'}] {t}: {v}")
    stem = (f"step-pp-{args.model_size}-pp{args.pp}-dp{dp}-{args.schedule}-"
            f"m{args.micro_batches}" + (f"-{args.tag}" if args.tag else "")
            + ("-quick" if args.quick else ""))
    common.write_json(args.out / f"{stem}.json",
                      {"env": env, "rows": rows, "raw": res, "losses": checks,
                       "method": __doc__.split("[Note: how the pipeline row is timed]")[1]
                       .split("[Note: the fairness check]")[0].strip(),
                       "targets": [{"target": t, "value": v, "pass": ok}
                                   for t, v, ok in targets]})
    md = [f"# {title}", "", common.markdown_env(env), f"- uptime: `{env['uptime']}`", "",
          common.markdown_table(rows, cols), "",
          *[f"- [{'PASS' if ok else 'MISS'}] {t}: {v}" for t, v, ok in targets], "",
          "Collectives are per step on one rank of each stage; MiB/rank are the params, "
          "grads and optimizer state a rank of the stage holds (max over its dp ranks). "
          "Gathered params peak (stage 3): zerokern's high-water mark of unit params held "
          "gathered at once in a step (the runtime's peak_live_bytes), and for the peer "
          "(reshard_after_forward=False) the stage's whole fp32 params, which FSDP2 holds "
          "unsharded through the step; the cost of keep_gathered beside its fewer "
          "all-gathers.", ""]
    common.write_text(args.out / f"{stem}.md", "\n".join(md))
    # a step-1 loss that differs: the sides did not do the same work, the ratios mean nothing
    return 0 if all(ok for *_, ok in targets) else 1


def _uptime() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return "load average: " + ", ".join(fh.read().split()[:3])
    except OSError:
        return "not read"
