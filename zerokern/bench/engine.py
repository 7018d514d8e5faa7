"""Engine benchmark: `deepspeed.initialize` vs `zerokern.initialize` on the same DeepSpeed
config, the same GPT and the same data, 2 gloo ranks, stages 1-3, fp32 and bf16.

Both engines of one (stage, precision) are alive at once and timed interleaved (A B, B A, ...),
so machine noise hits both alike. An iteration is engine(x) -> loss, engine.backward(loss),
engine.step() (gradient_accumulation_steps 1). Times are the max over ranks per iteration.

Held memory per rank: the bytes of every tensor storage alive in the process (found through
the garbage collector, each storage counted once) after an iteration, minus the same count
before the engine was built: params, grads, optimizer state, and any buffers the engine keeps
between steps (staging buckets included), measured the same way for both.
DeepSpeed's stage 3 replaces torch.nn.functional.linear for the whole process; each engine runs
with its own (DeepSpeed's while DeepSpeed runs, torch's otherwise).

A third contestant, `bare`, is the same model in the same dtype with no engine: forward and
loss.backward() only, timed in the same interleaving. `iter - bare` is what each engine adds
(its backward hooks and reductions, its step); `overhead zk/DS` compares those. It matters
where the model's own compute swamps both engines: on a CPU without AVX512-BF16/AMX torch
emulates bf16 matmuls (~17x slower than fp32), so bf16 iterations are ~95% model compute.

[Note: CPU time beside wall time] Each iteration is also timed in process CPU time (every
thread of the rank: the ring threads too; mean over ranks), and the overhead ratio is given on
it as well (`overhead zk/DS (CPU)`). On a machine shared with other jobs a rank waits for a core
for most of its wall time (measured 2026-11-29, load 9-26 on 2 cores: the bare 20m model's
fp32 forward+backward 112-150 ms of CPU in 580-1340 ms of wall), so wall-time differences of
tens of ms between contestants are the load's; the CPU time is what each engine asks of the
machine. The load average is recorded per row (`load`: at its start and end).

[Note: the paired overhead ratio] Every repetition runs each contestant once (the order
rotated), so one repetition's bare, zerokern and DeepSpeed iterations met the same load. Besides
the ratio of the medians (`overhead zk/DS (CPU)`), each repetition gives its own ratio
(zk_i - bare_i) / (DS_i - bare_i) on CPU time, and `paired` reports their median with the
20th-80th percentiles: a load change during the run moves the three iterations of a
repetition together, not one contestant's median against another's. The CPU time of an
iteration is the mean over ranks (the machine's CPU per rank: each rank's own noise, a cache
or memory-bandwidth bump, is averaged rather than the larger of two taken), wall time the max
over ranks (the step ends with the slowest rank). Stage 1 (the control: nothing changed there)
gave 0.07-0.14 between identical runs on 2026-11-29 (shared 2-core VM, 6-8 repetitions, the max
over ranks); the defaults are now 12 repetitions after 2 warm-up ones.

--before adds a fourth contestant in the same interleaving (before/after in one run): zerokern as
it was before issue 40's fourth round, i.e. with the lazy pool of freed host mappings off around
its iterations (state/huge_pages.py [Note: freed mappings kept lazily]): each buffer freed at
zero_grad is a fresh mapping again at the next backward. Where the engine frees nothing large
(stage 3, stage 2 fp32: [Note: the engine keeps its grad shard]) the two are nearly the same
code: a control. The pool's bytes after the run are reported as "lazily freed" (reclaimable by
the kernel), beside the held bytes. (Earlier result files' `before` was zerokern before the
third round, grad shards freed at every step, or before the first: their reading sections say
so.)

[Note: --optimizer muon]
Both engines get `"optimizer": {"type": "Muon", ..., "ns_method": "standard"}` (zerokern runs
only the standard Newton-Schulz; DeepSpeed's default "gram" is another algorithm) and, for
DeepSpeed's stage 3, `reduce_scatter: false` (it refuses Muon otherwise). DeepSpeed picks the
Muon params by name (no "embed" / "lm_head" in it), zerokern by module (nn.Embedding weights
and the tied head take AdamW): this GPT's `tok` and `pos` embeddings would be Muon matrices in
DeepSpeed only, an extra 44 GFLOP of Newton-Schulz per step at 20m. So that both run the same
work, DeepSpeed's tagging is given zerokern's split (`_same_muon_split`); what is timed is
the engines, not their choice of params (tests/engine/test_deepspeed_muon.py [Note: the
model]).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

from zerokern.state.huge_pages import POOL
from zerokern.tools.spawn import RankFailure, spawn_ranks

from . import common

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def config(stage: int, precision: str, batch: int, bucket=None,
           optimizer: str = "adamw") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01,
                                                     "torch_adam": True}},
           "zero_optimization": {"stage": stage, "overlap_comm": True,
                                 "contiguous_gradients": True}}
    if optimizer == "muon":  # [Note: --optimizer muon]
        cfg["optimizer"] = {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 1e-4,
                                                       "weight_decay": 0.01,
                                                       "ns_method": "standard"}}
        cfg["zero_optimization"]["reduce_scatter"] = False
    if bucket:
        cfg["zero_optimization"]["reduce_bucket_size"] = int(bucket)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _same_muon_split(config_class, model) -> None:
    """DeepSpeed's set_optimizer_flags with zerokern's default Muon split ([Note: --optimizer
    muon]): use_muon on the params ZeroMuon gives Muon, False on the rest."""
    from ..rules.muon import embedding_weight_ids, takes_muon

    emb = embedding_weight_ids(model)
    for p in model.parameters():
        p.use_muon = takes_muon(tuple(getattr(p, "ds_shape", p.shape)), id(p) in emb)


def held_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process."""
    import warnings

    gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated module attributes
        objs = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in objs:
        try:
            if not isinstance(o, torch.Tensor) or o.device.type == "meta":
                continue
            s = o.untyped_storage()
            key = s.data_ptr()
        except Exception:  # noqa: BLE001 - odd tensor subclasses (ReleasedGrad: no storage)
            continue
        if key and key not in seen:
            seen.add(key)
            total += s.nbytes()
    return total


def _worker(rank: int, world: int, args) -> dict:
    """One rank (run by zerokern.tools.spawn): both engines per (stage, precision), interleaved."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch.nn.functional as F

    import zerokern
    from zerokern.tools.gpt import build_gpt

    torch_linear = F.linear
    out: Dict[str, dict] = {}
    if args.optimizer == "muon":
        deepspeed.set_optimizer_flags = _same_muon_split  # deepspeed.initialize calls it
    try:
        for precision in args.precisions:
            for stage in args.stages:
                cfg = config(stage, precision, args.batch, args.reduce_bucket_size,
                             args.optimizer)
                engines, mem, linear = {}, {}, {}
                bare = build_gpt(args.model_size, seed=0)
                if precision == "bf16":
                    bare.to(torch.bfloat16)
                engines["bare"] = (None, bare)
                linear["bare"] = torch_linear
                contestants = [("zerokern", zerokern.initialize),
                               ("deepspeed", deepspeed.initialize)]
                if args.before:
                    contestants.append(("zerokern-before", zerokern.initialize))
                for name, init in contestants:
                    before = held_bytes()
                    model = build_gpt(args.model_size, seed=0)
                    run_cfg = copy.deepcopy(cfg)
                    eng = init(model=model, model_parameters=model.parameters(),
                               config=run_cfg)[0]
                    linear[name] = F.linear
                    F.linear = torch_linear
                    engines[name] = (eng, model)
                    POOL.enabled = name != "zerokern-before"
                    _iteration(eng, model, args, linear[name], torch_linear, rank)
                    mem[name] = held_bytes() - before
                times: Dict[str, List[float]] = {n: [] for n in engines}
                cpu: Dict[str, List[float]] = {n: [] for n in engines}
                names = list(engines)
                load = [os.getloadavg()[0]]
                for rep in range(args.warmup + args.reps):
                    for i in range(len(names)):
                        name = names[(i + rep) % len(names)]
                        eng, model = engines[name]
                        dist.barrier()
                        POOL.enabled = name != "zerokern-before"
                        c0, t0 = time.process_time(), time.perf_counter()
                        _iteration(eng, model, args, linear[name], torch_linear, rank)
                        wall = torch.tensor([(time.perf_counter() - t0) * 1e3])
                        cpu_ms = torch.tensor([(time.process_time() - c0) * 1e3])
                        dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slowest rank
                        dist.all_reduce(cpu_ms)  # [Note: the paired overhead ratio]: the mean
                        if rep >= args.warmup:
                            times[name].append(float(wall))
                            cpu[name].append(float(cpu_ms) / dist.get_world_size())
                load.append(os.getloadavg()[0])
                POOL.enabled = True
                m = torch.tensor([float(mem["zerokern"]), float(mem["deepspeed"]),
                                  float(mem.get("zerokern-before", 0)), float(POOL.bytes)])
                dist.all_reduce(m, op=dist.ReduceOp.MAX)
                out[f"s{stage}-{precision}"] = {
                    "stage": stage, "precision": precision, "times": times, "cpu": cpu,
                    "load": load,
                    "held_bytes": {"zerokern": m[0].item(), "deepspeed": m[1].item(),
                                   "zerokern-before": m[2].item(),
                                   "lazily_freed": m[3].item()},
                    "params": sum(p.numel() for p in build_gpt(args.model_size).parameters())}
                for eng, _ in engines.values():
                    if eng is not None and hasattr(eng, "destroy"):
                        eng.destroy()
                del engines, eng, model
                F.linear = torch_linear
                gc.collect()
    finally:
        F.linear = torch_linear
    return out


def _iteration(eng, model, args, linear, torch_linear, rank: int) -> None:
    import torch.nn.functional as F

    F.linear = linear
    try:
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, model.config.vocab, (args.batch, args.seq + 1), generator=g)
        logits = (eng or model)(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        if eng is None:  # the bare model: its own forward and backward, nothing else
            loss.backward()
            for p in model.parameters():
                p.grad = None
            return
        eng.backward(loss)
        eng.step()
    finally:
        F.linear = torch_linear


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="zerokern bench --engine", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model-size", default="20m", choices=["tiny", "small", "20m", "100m"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--reduce-bucket-size", type=float, default=None,
                   help="zero_optimization.reduce_bucket_size in elements (default: absent)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                   help="the config's optimizer: AdamW (default) or Muon (both engines; "
                        "[Note: --optimizer muon])")
    p.add_argument("--before", action="store_true",
                   help="also zerokern as before issue 40's fourth round (freed host "
                        "buffers unmapped, no lazy pool), interleaved ([Note: the paired "
                        "overhead ratio])")
    p.add_argument("--tag", default="",
                   help="appended to the result files' name (e.g. issue40-20261129)")
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise SystemExit("zerokern bench --engine compares against DeepSpeed: pip install "
                         "deepspeed (it runs on the CPU with DS_ACCELERATOR=cpu)")
    try:
        res = spawn_ranks(_worker, args.nproc, args,
                          threads=max(1, common.usable_cpus() // args.nproc))[0]
    except RankFailure as e:  # a dead rank stops the others within seconds
        print(e, file=sys.stderr)
        raise SystemExit("a benchmark rank failed") from None
    return report(args, res)


def report(args, res) -> int:
    env = common.environment(torch.device("cpu"))
    try:
        import deepspeed

        env["deepspeed"] = deepspeed.__version__
    except Exception:  # noqa: BLE001
        env["deepspeed"] = None
    env.update(world_size=args.nproc, backend="gloo", model_size=args.model_size,
               batch=args.batch, seq=args.seq, reps=args.reps,
               reduce_bucket_size=args.reduce_bucket_size, optimizer=args.optimizer)
    rows = []
    for key, r in res.items():
        z, d, b = (common.summarize(r["times"][n]) for n in ("zerokern", "deepspeed", "bare"))
        hz, hd = r["held_bytes"]["zerokern"], r["held_bytes"]["deepspeed"]
        zo, do = z["median_ms"] - b["median_ms"], d["median_ms"] - b["median_ms"]
        row = {"config": key, "zk_ms": z["median_ms"], "ds_ms": d["median_ms"],
               "time_ratio": z["median_ms"] / d["median_ms"],
               "bare_ms": b["median_ms"], "zk_over_ms": zo, "ds_over_ms": do,
               "over_ratio": zo / do if do > 0 else float("nan"), "bare": b,
               "zk_MiB": hz / 2**20, "ds_MiB": hd / 2**20, "mem_ratio": hz / hd,
               "lazy_MiB": r["held_bytes"].get("lazily_freed", 0) / 2**20,
               "zk": z, "ds": d}
        if "cpu" in r:  # [Note: CPU time beside wall time]
            zc, dc, bc = (common.summarize(r["cpu"][n])["median_ms"]
                          for n in ("zerokern", "deepspeed", "bare"))
            row.update(zk_cpu_ms=zc, ds_cpu_ms=dc, bare_cpu_ms=bc,
                       over_ratio_cpu=(zc - bc) / (dc - bc) if dc > bc else float("nan"),
                       load=f"{r['load'][0]:.1f}-{r['load'][1]:.1f}")
            row.update(_paired(r["cpu"], "zerokern", "paired"))
            if "zerokern-before" in r["cpu"]:
                row.update(_paired(r["cpu"], "zerokern-before", "paired_before"))
            if "zerokern-before" in r["times"]:
                zb = common.summarize(r["times"]["zerokern-before"])["median_ms"]
                zbc = common.summarize(r["cpu"]["zerokern-before"])["median_ms"]
                row.update(zk_before_ms=zb, zk_before_cpu_ms=zbc,
                           over_ratio_before=(zb - b["median_ms"]) / do if do > 0
                           else float("nan"),
                           over_ratio_cpu_before=(zbc - bc) / (dc - bc) if dc > bc
                           else float("nan"),
                           zk_before_MiB=r["held_bytes"].get("zerokern-before", 0) / 2**20)
        rows.append(row)
    cols = [("config", "stage-precision"), ("zk_ms", "zerokern iter ms"),
            ("ds_ms", "DeepSpeed iter ms"), ("time_ratio", "time zk/DS"),
            ("bare_ms", "bare model fwd+bwd ms"), ("over_ratio", "overhead zk/DS"),
            ("zk_MiB", "zerokern held MiB/rank"), ("ds_MiB", "DeepSpeed held MiB/rank"),
            ("mem_ratio", "memory zk/DS"),
            ("lazy_MiB", "zerokern lazily freed MiB/rank (reclaimable)")]
    if all("zk_cpu_ms" in r for r in rows):
        cols += [("zk_cpu_ms", "zerokern CPU ms"), ("ds_cpu_ms", "DeepSpeed CPU ms"),
                 ("bare_cpu_ms", "bare CPU ms"), ("over_ratio_cpu", "overhead zk/DS (CPU)")]
    if all("paired" in r for r in rows):
        cols += [("paired", "paired overhead zk/DS (CPU)"), ("paired_range", "p20-p80")]
    if all("zk_before_ms" in r for r in rows):
        cols += [("zk_before_ms", "before: zerokern iter ms"),
                 ("over_ratio_before", "before: overhead zk/DS"),
                 ("zk_before_cpu_ms", "before: zerokern CPU ms"),
                 ("over_ratio_cpu_before", "before: overhead zk/DS (CPU)"),
                 ("paired_before", "before: paired (CPU)"),
                 ("paired_before_range", "before: p20-p80"),
                 ("zk_before_MiB", "before: held MiB/rank")]
    if all("load" in r for r in rows):
        cols.append(("load", "load"))
    params = next(iter(res.values()))["params"]
    title = (f"engine benchmark: GPT {args.model_size} ({params / 1e6:.1f}M params), "
             f"{args.nproc} gloo ranks, batch {args.batch}x{args.seq}, medians of {args.reps}, "
             f"reduce_bucket_size {args.reduce_bucket_size or 'absent'}, optimizer "
             f"{args.optimizer}")
    common.print_table(rows, cols, title)
    stem = f"engine-{args.model_size}-n{args.nproc}"
    if args.reduce_bucket_size:
        stem += f"-bucket{int(args.reduce_bucket_size)}"
    if args.optimizer != "adamw":
        stem += f"-{args.optimizer}"
    if getattr(args, "tag", ""):
        stem += f"-{args.tag}"
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_json(args.out / f"{stem}.json", {"env": env, "rows": rows})
    md = (f"# {title}\n\n{common.markdown_env(env)}\n\n{common.markdown_table(rows, cols)}\n\n"
          "Targets (issue 12): time zk/DS <= 0.5 and memory zk/DS <= 0.9 at every row.\n"
          "overhead zk/DS = (zerokern iter - bare) / (DeepSpeed iter - bare): what each engine "
          "adds to the model's own forward and backward.\n" + _stage_ratios(rows))
    common.write_text(args.out / f"{stem}.md", md)
    print(f"wrote {args.out / stem}.json and .md")
    return 0


def _paired(cpu: Dict[str, List[float]], name: str, key: str) -> dict:
    """[Note: the paired overhead ratio]: the median over repetitions of (name_i - bare_i) /
    (DS_i - bare_i), CPU time, with its 20th-80th percentiles."""
    import numpy as np

    z, d, b = (np.asarray(cpu[n], dtype=np.float64) for n in (name, "deepspeed", "bare"))
    ok = d > b
    if not ok.any():
        return {key: float("nan"), f"{key}_range": "-"}
    ratios = (z[ok] - b[ok]) / (d[ok] - b[ok])
    p20, med, p80 = np.percentile(ratios, [20, 50, 80])
    return {key: float(med), f"{key}_range": f"{p20:.2f}-{p80:.2f}",
            f"{key}_all": [float(x) for x in ratios]}


def _stage_ratios(rows) -> str:
    """Stage 3 against stage 2 (zerokern, the same run), and the same for the --before
    contestant, wall and CPU time."""
    by = {r["config"]: r for r in rows}
    out = []
    for prec in ("fp32", "bf16"):
        s2, s3 = by.get(f"s2-{prec}"), by.get(f"s3-{prec}")
        if s2 is None or s3 is None:
            continue
        line = f"- {prec}: zerokern stage 3 / stage 2 = {s3['zk_ms'] / s2['zk_ms']:.2f} (wall)"
        if "zk_cpu_ms" in s3 and "zk_cpu_ms" in s2:
            line += f", {s3['zk_cpu_ms'] / s2['zk_cpu_ms']:.2f} (CPU)"
        if "zk_before_ms" in s3 and "zk_before_ms" in s2:  # before against before
            line += (f"; before (--before: no lazy pool of freed host buffers): "
                     f"{s3['zk_before_ms'] / s2['zk_before_ms']:.2f} (wall), "
                     f"{s3['zk_before_cpu_ms'] / s2['zk_before_cpu_ms']:.2f} (CPU)")
        out.append(line)
    return ("\nStage 3 vs stage 2, this run:\n\n" + "\n".join(out) + "\n") if out else ""
