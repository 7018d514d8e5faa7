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
                for name, init in (("zerokern", zerokern.initialize),
                                   ("deepspeed", deepspeed.initialize)):
                    before = held_bytes()
                    model = build_gpt(args.model_size, seed=0)
                    eng = init(model=model, model_parameters=model.parameters(),
                               config=copy.deepcopy(cfg))[0]
                    linear[name] = F.linear
                    F.linear = torch_linear
                    engines[name] = (eng, model)
                    _iteration(eng, model, args, linear[name], torch_linear, rank)
                    mem[name] = held_bytes() - before
                times: Dict[str, List[float]] = {n: [] for n in engines}
                names = list(engines)
                for rep in range(args.warmup + args.reps):
                    for i in range(len(names)):
                        name = names[(i + rep) % len(names)]
                        eng, model = engines[name]
                        dist.barrier()
                        t0 = time.perf_counter()
                        _iteration(eng, model, args, linear[name], torch_linear, rank)
                        dt = torch.tensor((time.perf_counter() - t0) * 1e3)
                        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                        if rep >= args.warmup:
                            times[name].append(float(dt))
                m = torch.tensor([float(mem["zerokern"]), float(mem["deepspeed"])])
                dist.all_reduce(m, op=dist.ReduceOp.MAX)
                out[f"s{stage}-{precision}"] = {
                    "stage": stage, "precision": precision, "times": times,
                    "held_bytes": {"zerokern": m[0].item(), "deepspeed": m[1].item()},
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
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
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
        rows.append({"config": key, "zk_ms": z["median_ms"], "ds_ms": d["median_ms"],
                     "time_ratio": z["median_ms"] / d["median_ms"],
                     "bare_ms": b["median_ms"], "zk_over_ms": zo, "ds_over_ms": do,
                     "over_ratio": zo / do if do > 0 else float("nan"), "bare": b,
                     "zk_MiB": hz / 2**20, "ds_MiB": hd / 2**20, "mem_ratio": hz / hd,
                     "zk": z, "ds": d})
    cols = [("config", "stage-precision"), ("zk_ms", "zerokern iter ms"),
            ("ds_ms", "DeepSpeed iter ms"), ("time_ratio", "time zk/DS"),
            ("bare_ms", "bare model fwd+bwd ms"), ("over_ratio", "overhead zk/DS"),
            ("zk_MiB", "zerokern held MiB/rank"), ("ds_MiB", "DeepSpeed held MiB/rank"),
            ("mem_ratio", "memory zk/DS")]
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
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_json(args.out / f"{stem}.json", {"env": env, "rows": rows})
    md = (f"# {title}\n\n{common.markdown_env(env)}\n\n{common.markdown_table(rows, cols)}\n\n"
          "Targets (issue 12): time zk/DS <= 0.5 and memory zk/DS <= 0.9 at every row.\n"
          "overhead zk/DS = (zerokern iter - bare) / (DeepSpeed iter - bare): what each engine "
          "adds to the model's own forward and backward.\n")
    common.write_text(args.out / f"{stem}.md", md)
    print(f"wrote {args.out / stem}.json and .md")
    return 0
