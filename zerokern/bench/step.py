"""Whole training-step benchmark: zerokern stages vs DDP + fused AdamW, ZeroRedundancyOptimizer
and FSDP2 (`fully_shard` per block and root, the stage-3 peer).

Every provider trains its own copy of the same GPT (same init, same data) inside one process
group (gloo on CPU; `--device cuda`: NCCL, one GPU per rank, issue 14), interleaved
round-robin per repetition so machine noise hits all alike
(`common` [Note: how a repetition is timed]). A repetition is one iteration: forward, backward,
optimizer step, zero_grad; stage 2 reduces during backward, DDP too, so the whole iteration is
the fair unit. `step_ms` times the optimizer step alone. Times are the max over ranks.

Per-rank model-state memory is measured from the tensors each provider holds (params, grads,
optimizer state; DDP with gradient_as_bucket_view so its buckets are the grads), and for
zerokern checked against the DESIGN §4 formula.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

from zerokern.platform.device import handle
from zerokern.tools.spawn import RankFailure, spawn_ranks

from . import common, step_pipeline, step_rules

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# stage 3 with every unit kept gathered from its forward to its backward ([Note: kept units])
KEEP_ALL = "zerokern s3 keep all"


def _storages(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # FSDP2 DTensor: this rank's local shard
            t = t.to_local()
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _torch_state_bytes(model: torch.nn.Module, opt) -> int:
    ps = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    if hasattr(opt, "optim"):  # ZeroRedundancyOptimizer wraps a local optimizer
        state = [v for s in opt.optim.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
    return _storages(ps) + _storages(p.grad for p in ps) + _storages(state)


def _make_providers(args, rank: int, world: int):
    """name -> (iteration fn, step-only fn, memory fn, model)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zerokern as zk
    from zerokern.tools.gpt import build_gpt

    hp = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    dev = _device(args, rank)
    gen = torch.Generator().manual_seed(1234 + rank)
    cfg = build_gpt(args.model_size).config
    data = [torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=gen).to(dev)
            for _ in range(4)]
    ddp_kw = dict(device_ids=[dev.index]) if dev.type == "cuda" else {}

    def gpt():
        return build_gpt(args.model_size).to(dev)
    provs: Dict[str, tuple] = {}

    def iteration(model, opt, fwd_model=None, mem_probe=None, no_sync=None):
        """One optimizer step over args.micro micro-batches (loss / micro each); every
        micro-batch but the last under no_sync(), the DDP accumulation pattern."""
        it = iter(range(1 << 30))

        def run():
            for j in range(args.micro):
                x = data[next(it) % len(data)]
                ctx = no_sync() if (no_sync is not None and j < args.micro - 1) \
                    else contextlib.nullcontext()
                with ctx:
                    loss = model.loss(x[:, :-1], x[:, 1:]) if fwd_model is None \
                        else _ddp_loss(fwd_model, x)
                    (loss / args.micro).backward()
            if mem_probe is not None:  # torch frees grads in zero_grad: measure them here
                mem_probe()
            opt.step()
            opt.zero_grad()
        return run

    def torch_probe(model, opt):
        box = {}

        def probe():
            box["bytes"] = max(box.get("bytes", 0), _torch_state_bytes(model, opt))
        return probe, box

    if args.optimizer != "adamw":  # Muon, Lion, 8-bit AdamW: step_rules.py
        return step_rules.make_providers(args, gpt, iteration, torch_probe, ddp_kw)
    for stage in args.stages:
        m = gpt()
        opt = zk.ZeroAdamW(m, stage=stage, precision=args.precision, backend=args.backend,
                           bucket_mb=args.bucket_mb, **hp)
        provs[f"zerokern s{stage}"] = (iteration(m, opt, no_sync=opt.no_sync), opt,
                                       lambda opt=opt: opt.memory_report(), m)
    if 3 in args.stages and args.keep_all:  # stage 3 trading memory for its re-gathers
        m = gpt()
        opt = zk.ZeroAdamW(m, stage=3, precision=args.precision, backend=args.backend,
                           bucket_mb=args.bucket_mb, keep_for_backward_mb=math.inf, **hp)
        provs[KEEP_ALL] = (iteration(m, opt, no_sync=opt.no_sync), opt,
                           lambda opt=opt: opt.memory_report(), m)
    if args.peers:
        m = gpt()
        ddp = DDP(m, gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_mb, **ddp_kw)
        opt = torch.optim.AdamW(m.parameters(), fused=True, **hp)
        probe, box = torch_probe(m, opt)
        provs["DDP + AdamW(fused)"] = (iteration(m, opt, ddp, probe, ddp.no_sync), opt,
                                       lambda box=box: box["bytes"], m)
        m = gpt()
        ddp = DDP(m, gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_mb, **ddp_kw)
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW,
                                      fused=True, **hp)
        probe, box = torch_probe(m, opt)
        provs["DDP + ZeroRedundancyOptimizer"] = (iteration(m, opt, ddp, probe, ddp.no_sync),
                                                  opt,
                                                  lambda box=box: box["bytes"], m)
    if args.fsdp2:
        from torch.distributed.fsdp import fully_shard

        m = gpt()
        for blk in m.blocks:  # the same units as zerokern's default stage-3 policy
            fully_shard(blk)
        fully_shard(m)
        # fused AdamW takes FSDP2's DTensor params on CPU (torch >= 2.4)
        opt = torch.optim.AdamW(m.parameters(), fused=True, **hp)
        probe, box = torch_probe(m, opt)
        fsdp_no_sync = _fsdp2_no_sync(m)
        provs["FSDP2 + AdamW(fused)"] = (iteration(m, opt, None, probe, fsdp_no_sync), opt,
                                         lambda box=box: box["bytes"], m)
    return provs


def _fsdp2_no_sync(m):
    @contextlib.contextmanager
    def ctx():
        m.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            m.set_requires_gradient_sync(True)
    return ctx


def _ddp_loss(ddp, x):
    logits = ddp(x[:, :-1])
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             x[:, 1:].reshape(-1))


def _device(args, rank: int) -> torch.device:
    """This rank's device: the CPU, or GPU `rank` (--device cuda; one GPU per rank)."""
    return torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")


def _timer(dev: torch.device):
    """perf_counter around the work; on a GPU, after the queued kernels have finished."""
    def now() -> float:
        handle(dev).synchronize(dev)
        return time.perf_counter()
    return now


def _worker(rank: int, world: int, args):
    """One rank (run by zerokern.tools.spawn): every provider, interleaved; rank 0's results."""
    dev = _device(args, rank)
    now = _timer(dev)
    provs = _make_providers(args, rank, world)
    iters: Dict[str, List[float]] = {n: [] for n in provs}
    names = list(provs)
    for rep in range(args.warmup + args.reps):
        for i in range(len(names)):
            name = names[(i + rep) % len(names)]
            dist.barrier()
            t0 = now()
            provs[name][0]()
            dt = torch.tensor((now() - t0) * 1e3, device=dev)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if rep >= args.warmup:
                iters[name].append(float(dt))
    # Optimizer step alone: backward once, then time repeated steps (same work per step).
    steps: Dict[str, List[float]] = {}
    for name, (_, opt, _, model) in provs.items():
        steps[name] = []
        for _ in range(max(3, args.reps // 2)):
            x = torch.randint(0, model.config.vocab, (args.batch, args.seq + 1), device=dev)
            (model.loss(x[:, :-1], x[:, 1:])).backward() if name.startswith("zerokern") \
                else None
            if not name.startswith("zerokern"):
                continue  # peers' step without DDP's backward reduction is not comparable
            dist.barrier()
            t0 = now()
            opt.step()
            dt = torch.tensor((now() - t0) * 1e3, device=dev)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            steps[name].append(float(dt))
            opt.zero_grad()
    mem = {name: p[2]() for name, p in provs.items()}
    if rank == 0:
        return {"iters": iters, "steps": steps, "mem": mem,
                "params": sum(p.numel() for p in next(iter(provs.values()))[3]
                              .parameters())}
    return None


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="zerokern bench --step", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, help="ranks (default: CPU 2 gloo ranks; CUDA one NCCL "
                                             "rank per visible GPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (gloo) or cuda (NCCL, GPU i for rank i)")
    p.add_argument("--model-size", default="20m", choices=["tiny", "small", "20m", "100m"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="zerokern precision (peers run fp32)")
    p.add_argument("--stages", type=int, nargs="+", default=None, choices=[0, 1, 2, 3],
                   help="zerokern stages (default 0-3; with --pp 1-3)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--optimizer", default="adamw", choices=step_rules.OPTIMIZERS,
                   help="zerokern's ZeroAdamW (default), ZeroMuon, ZeroLion or ZeroAdamW("
                        "state_bits=8), against DDP + the single-process optimizer (step_rules)")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--micro", type=int, default=1,
                   help="micro-batches per step, all but the last under no_sync() (DDP too)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-peers", dest="peers", action="store_false",
                   help="without DDP and ZeroRedundancyOptimizer")
    p.add_argument("--no-keep-all", dest="keep_all", action="store_false",
                   help="leave out stage 3 with keep_for_backward_mb=inf (every unit gathered "
                        "from its forward to its backward: no backward re-gathers)")
    p.add_argument("--no-fsdp2", dest="fsdp2", action="store_false",
                   help="without the FSDP2 peer (it runs by default when stage 3 does)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 3 reps, for tests (writes step-...-quick.*)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    step_pipeline.add_arguments(p)
    a = p.parse_args(argv)
    a.stages = a.stages or ([1, 2, 3] if a.pp else [0, 1, 2, 3])
    if a.device == "cuda":
        cuda = handle("cuda")
        if not cuda.is_available():
            p.error("--device cuda: no CUDA device visible to torch")
        a.nproc = a.nproc or cuda.device_count()
        if a.nproc > cuda.device_count():  # NCCL refuses two ranks on one GPU
            p.error(f"--nproc {a.nproc} > {cuda.device_count()} visible GPUs")
    a.nproc = a.nproc or (2 * a.pp if a.pp else 2)
    if a.quick:
        a.model_size, a.reps, a.warmup, a.seq = "tiny", 3, 1, 16
    a.fsdp2 = a.fsdp2 and 3 in a.stages and a.optimizer == "adamw"
    if a.nproc < 1 or a.reps < 1 or a.batch < 1 or a.seq < 1:
        p.error("--nproc, --reps, --batch and --seq must be >= 1")
    if a.pp is not None:  # the pipeline row (step_pipeline.py)
        step_pipeline.check_args(p, a)
    return a


def _cuda_of(rank: int) -> torch.device:
    return torch.device("cuda", rank)


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    if args.pp is not None:  # the pipeline row: its own sides and result files
        return step_pipeline.main(args)
    cuda = args.device == "cuda"
    # How busy the machine was: others' share before (the ranks' own CPU cannot be told apart
    # during the run, common.OtherLoad), and the 1-minute load average around the run.
    load = {"other_cpu_load_before": common.other_load_now(), "loadavg_1min_before":
            round(os.getloadavg()[0], 2)}
    try:
        res = spawn_ranks(_worker, args.nproc, args, backend="nccl" if cuda else "gloo",
                          threads=max(1, common.usable_cpus() // args.nproc),
                          device_of=_cuda_of if cuda else None)[0]
    except RankFailure as e:  # a dead rank stops the others within seconds ([Note: no hangs])
        print(e, file=sys.stderr)
        raise SystemExit("a benchmark rank failed") from None
    res["load"] = dict(load, loadavg_1min_after=round(os.getloadavg()[0], 2))
    return report(args, res)


def report(args, res) -> int:
    env = common.environment(torch.device(args.device))
    pg = "nccl" if args.device == "cuda" else "gloo"
    env.update(world_size=args.nproc, backend=pg, model_size=args.model_size,
               params=res["params"], batch=args.batch, seq=args.seq, precision=args.precision,
               micro_batches=args.micro, optimizer=args.optimizer)
    env.update(res.get("load", {}))
    shm_bytes = [m.get("comm_buffers", 0) for m in res["mem"].values() if isinstance(m, dict)]
    if shm_bytes and pg == "gloo":  # how zerokern's CPU collectives travelled (comm/shm.py)
        env["zerokern_collectives"] = ("shared memory (ranks on one host)" if any(shm_bytes)
                                       else "gloo send/recv rings")
    ddp = step_rules.DDP_NAME[args.optimizer]
    base = common.summarize(res["iters"][ddp])["median_ms"] if ddp in res["iters"] else None
    rows = []
    for name, ms in res["iters"].items():
        s = common.summarize(ms)
        mem = res["mem"][name]
        row = {"provider": name, "iter_ms": s["median_ms"], "p20_ms": s["p20_ms"],
               "p80_ms": s["p80_ms"], "vs_ddp": (s["median_ms"] / base) if base else None}
        if res["steps"].get(name):
            row["step_ms"] = common.summarize(res["steps"][name])["median_ms"]
        if isinstance(mem, dict):
            # Model states (params, grads, optimizer, padding); staging buckets are
            # communication buffers ("residual states" in the ZeRO paper), shown apart.
            states = mem["measured_total"] - mem["measured"]["buckets"]
            row["state_MiB"] = states / 2**20
            row["buckets_MiB"] = mem["measured"]["buckets"] / 2**20
            row["formula_MiB"] = mem["formula_total"] / 2**20
            row["vs_formula"] = states / mem["formula_total"]
            row["memory_report"] = mem
            if "peak_live_units" in mem:  # stage 3: full units gathered at once, at most
                row["live_MiB"] = mem["peak_live_units"] / 2**20
        else:
            row["state_MiB"] = mem / 2**20
        rows.append(row)
    cols = [("provider", "provider"), ("iter_ms", "iter ms (median)"), ("p20_ms", "p20"),
            ("p80_ms", "p80"), ("vs_ddp", "× DDP"), ("step_ms", "step ms"),
            ("state_MiB", "model states MiB/rank"), ("buckets_MiB", "buckets MiB"),
            ("formula_MiB", "formula MiB"), ("live_MiB", "peak live units MiB"),
            ("vs_formula", "meas/formula")]
    title = (f"step benchmark: GPT {args.model_size} ({res['params'] / 1e6:.1f}M params), "
             f"{args.nproc} {pg} ranks, optimizer {args.optimizer}, zerokern {args.precision}, "
             "peers fp32")
    common.print_table(rows, cols, title)
    targets = []
    by = {r["provider"]: r for r in rows}
    if "zerokern s2" in by:
        r = by["zerokern s2"]
        ok = abs(r["vs_formula"] - 1) <= 0.02
        targets.append(("stage 2 per-rank model-state bytes within 2% of the formula",
                        f"{r['vs_formula']:.3f}×", ok))
    for s in (0, 1, 2):
        if f"zerokern s{s}" in by and base:
            v = by[f"zerokern s{s}"]["vs_ddp"]
            targets.append((f"stage {s} iteration ≤ 1.0× {ddp}", f"{v:.2f}×", v <= 1.0))
    for s3name in ("zerokern s3", KEEP_ALL):  # issue 20: stage 3 <= 1.1x stage 2
        if s3name not in by:
            continue
        s3 = by[s3name]["iter_ms"]
        for peer, bound in (("zerokern s2", 1.1), ("FSDP2 + AdamW(fused)", 1.0)):
            if peer in by:
                v = s3 / by[peer]["iter_ms"]
                by[s3name][f"vs {peer}"] = v
                targets.append((f"{s3name[9:]} iteration ≤ {bound}× {peer}", f"{v:.2f}×",
                                v <= bound))
    for t, v, ok in targets:
        print(f"[{'PASS' if ok else 'MISS'}] {t}: {v}")
    stem = f"step-{args.model_size}-n{args.nproc}-{args.precision}" + \
        (f"-{args.optimizer}" if args.optimizer != "adamw" else "") + \
        (f"-micro{args.micro}" if args.micro > 1 else "") + \
        ("-cuda" if args.device == "cuda" else "") + ("-quick" if args.quick else "")
    common.write_json(args.out / f"{stem}.json",
                      {"env": env, "rows": rows, "raw": res,
                       "targets": [{"target": t, "value": v, "pass": ok}
                                   for t, v, ok in targets]})
    md = [f"# {title}", "", common.markdown_env(env), "",
          common.markdown_table([{k: v for k, v in r.items() if k != "memory_report"}
                                 for r in rows], cols), "",
          *[f"- [{'PASS' if ok else 'MISS'}] {t}: {v}" for t, v, ok in targets], ""]
    common.write_text(args.out / f"{stem}.md", "\n".join(md))
    if not args.no_plot:
        plot(rows, args.out / f"{stem}.png", title)
    return 0


def plot(rows: List[dict], path: Path, title: str) -> Path:
    """Iteration time per provider (median, p20-p80 whiskers) beside model-state MiB/rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["provider"] for r in rows]
    ys = range(len(rows))
    colors = ["tab:blue" if n.startswith("zerokern") else "tab:gray" for n in names]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 0.5 * len(rows) + 1.8), sharey=True)
    med = [r["iter_ms"] for r in rows]
    err = [[m - r["p20_ms"] for m, r in zip(med, rows)],
           [r["p80_ms"] - m for m, r in zip(med, rows)]]
    ax_t.barh(ys, med, xerr=err, color=colors, capsize=3)
    ax_t.set_xlabel("iteration ms (median, p20-p80)")
    ax_t.set_yticks(list(ys), names)
    ax_t.invert_yaxis()
    mem = [r["state_MiB"] for r in rows]
    ax_m.barh(ys, mem, color=colors)
    bk = [r.get("buckets_MiB") or 0 for r in rows]
    ax_m.barh(ys, bk, left=mem, color="tab:orange", label="comm buffers (buckets)")
    ax_m.set_xlim(0, 1.08 * max(m + b for m, b in zip(mem, bk)))
    ax_m.set_xlabel("model states MiB per rank")
    ax_m.legend(fontsize=8)
    for ax in (ax_t, ax_m):
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
