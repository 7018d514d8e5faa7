"""Bytes per step by group, and step time, of stage 3 on 4 gloo ranks as 2 "nodes" x 2:
plain (a 1-D mesh of 4), HSDP (2x2 mesh), hpZ (2x2, hpz=True) and hpZ + qwZ + qgZ
(quantized_weights=True, quantized_gradients int8 / int4). Not a timed test.

Cross-node bytes are derived from the per-group counts (comm_stats()["dims"]), with ranks 0-1
on node A and 2-3 on node B:
- a ring over all 4 ranks (0-1-2-3-0) crosses nodes on 2 of its 4 links, so half the bytes of
  the world-wide collectives cross (plain: everything; hpZ: the forward gathers and the
  reduce-scatters);
- HSDP's replicate all-reduce pairs rank r with r+2: all its bytes cross; its shard group and
  hpZ's node group never cross;
- with hpZ + qwZ + qgZ the "cross" group (the mesh's dim 0, r with r+2) carries qwZ's first
  hop (each int8 payload once) and qgZ's second hop: all of it crosses; the "hpz" node group
  (qwZ's second hop, hpZ's backward gathers, qgZ's first hop) never does.
The formula beside each row is the same count from the buffer sizes alone (E: each stage-3
unit buffer's padded numel, summed; the root and the last unit (E_kept) stay gathered from
forward to backward, so their backward gathers are not sent; w(c) = c·bits/8 + 4·c/128, the
quantized payload).

--loss-steps N also trains the "tiny" preset on the stdlib corpus (zerokern train's data) for N
steps with plain stage 3 and with everything on, and reports the mean loss of the last 10 and
of the last 50 steps (the last 10 alone move by ~2% between seeds and configs).

    PYTHONPATH=. python benchmarks/bench_mesh.py [--size small] [--steps 6] [--loss-steps 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import zerokern as zk
from zerokern.tools.gpt import PRESETS, build_gpt
from zerokern.tools.spawn import spawn_ranks

CONFIGS = ("plain", "hsdp", "hpz", "hpz_q8", "hpz_q4")
QUANT = {"hpz_q8": dict(quantized_weights=True, quantized_gradients="int8"),
         "hpz_q4": dict(quantized_weights=True, quantized_gradients="int4")}


PRECISION = {"p": "fp32"}  # --precision (set in the workers)


def _opt(model, name, meshes, lr=1e-3):
    mesh = meshes["4"] if name == "plain" else meshes["2x2"]
    return zk.ZeroAdamW(model, lr=lr, stage=3, precision=PRECISION["p"], mesh=mesh,
                        hpz=name.startswith("hpz"), backend="cpu", **QUANT.get(name, {}))


def _wire(c: int, bits: int) -> int:
    return c * bits // 8 + c // 128 * 4


def _formula(name, opt) -> tuple:
    """(cross-node bytes per step from the buffer sizes, the formula as text); e: bytes per
    element of the precision (4 fp32, 2 bf16)."""
    e = opt.dtype.itemsize
    E = [f.layout.padded_numel for f in opt.flat_groups]
    kept = set(opt.grad_sync.kept_units)  # the root and the last unit
    held = sum(f.layout.padded_numel for f in opt.flat_groups if f.unit_index in kept)
    tot = sum(E)
    if name == "plain":  # ring over 4: half the bytes cross; gathers 2x but the kept once
        return (3 * e * (2 * tot - held + tot) // 4 // 2,
                f"1/2 · 3/4 · {e}B · (2E − E_kept + E)")
    if name == "hsdp":
        return 2 * e * tot // 2 // 2, f"2 · 1/2 · {e}B · E/2 (replicate all-reduce of the shard)"
    if name == "hpz":
        return 3 * e * (tot + tot) // 4 // 2, f"1/2 · 3/4 · {e}B · (E + E) (fwd gather, RS)"
    bits = 8 if name == "hpz_q8" else 4
    fwd = sum(_wire(e // 4, 8) for e in E)  # each payload crosses once ([Note: qwZ over nodes])
    rs = sum(_wire(e // 4, bits) for e in E)
    return fwd + rs, f"w8(E/4) + w{bits}(E/4) (int8 fwd gather hop 1, qgZ hop 2)"


class Probe:
    """Where a step's time goes ([Note: the breakdown]): wall and CPU seconds of wrapped
    functions, by key and by thread (the step's own thread, "main", or a ring thread, "ring").

    [Note: the breakdown]
    --breakdown wraps, in each rank, the functions a stage-3 step with quantized collectives
    runs through (those that exist in the zerokern it imports: the same bench measures an
    older tree): the codec kernels (quantize/dequantize, "codec"); the qgZ reduce-scatter as a
    whole ("qgz", on a ring thread: codec, all-to-alls, sums, copies); its all-to-alls
    ("a2a"); qwZ's two gather hops ("qwz_hops", ring thread); the ring's all-gathers and
    reduce-scatters ("ring_ag", "ring_rs"); hpZ's copy of the secondary ("hpz_keep"); and, on
    the step's thread, every wait for a collective ("wait": exposed communication, including
    the time the ring threads take because the CPUs are shared). Each key counts inclusive
    time; keys nest (codec inside qgz), so the report subtracts where it says so. The process's
    CPU time per step ("cpu") is the work the 2 shared cores must do for each rank: on a
    machine whose cores all run ranks, a step cannot take less than ranks x cpu / cores."""

    def __init__(self) -> None:
        import threading

        self.main = threading.main_thread()
        self.tot: dict = {}

    def wrap(self, obj, name: str, key: str) -> None:
        import functools
        import threading

        fn = getattr(obj, name, None)
        if fn is None:
            return
        probe = self

        @functools.wraps(fn)
        def timed(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                where = "main" if threading.current_thread() is probe.main else "ring"
                acc = probe.tot.setdefault(f"{key}@{where}", [0.0, 0.0])
                acc[0] += time.perf_counter() - t0
                acc[1] += time.thread_time() - c0

        setattr(obj, name, timed)

    def install(self) -> None:
        import torch.distributed as dist

        from zerokern.comm import quantized, ring
        from zerokern.kernels import blockquant
        from zerokern.stage3 import hpz

        for name in ("quantize_now", "dequantize_now", "quantize_into", "dequantize_into",
                     "dequantize_sum_into"):
            self.wrap(blockquant.NativeCodec, name, "codec")
        self.wrap(quantized, "_reduce_levels", "qgz")
        self.wrap(dist, "all_to_all_single", "a2a")
        self.wrap(quantized, "_two_gathers", "qwz_hops")
        self.wrap(ring.RingRunner, "all_gather", "ring_ag")
        self.wrap(ring.RingRunner, "reduce_scatter", "ring_rs")
        self.wrap(ring.RingRunner, "exchange_rows", "a2a")
        self.wrap(ring.FutureWork, "wait", "wait")
        self.wrap(hpz.HpzSecondary, "keep", "hpz_keep")

    def take(self) -> dict:
        out, self.tot = self.tot, {}
        return out


def _worker(rank, ws, size, steps, batch, precision="fp32", breakdown=False):
    PRECISION["p"] = precision
    probe = None
    if breakdown:
        probe = Probe()
        probe.install()
    meshes = {"4": init_device_mesh("cpu", (4,)),
              "2x2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))}
    cfg = PRESETS[size]
    runs = {}
    for name in CONFIGS:
        model = build_gpt(size, seed=0)
        runs[name] = (model, _opt(model, name, meshes))
    times = {n: [] for n in CONFIGS}
    parts = {n: [] for n in CONFIGS}  # --breakdown: per step {key@thread: [wall, cpu]}
    stats = {}
    g = torch.Generator().manual_seed(rank)
    for s in range(steps + 1):  # step 0 warms up; configs interleaved per step
        tok = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
        for i in range(len(CONFIGS)):  # rotated each step: no config always goes first
            name = CONFIGS[(i + s) % len(CONFIGS)]
            model, opt = runs[name]
            opt.reset_comm_stats()
            if probe is not None:
                probe.take()
            c0 = time.process_time()
            t0 = time.perf_counter()
            logits = model(tok[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), tok[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            dt = time.perf_counter() - t0
            if s > 0:
                times[name].append(dt)
                if probe is not None:
                    p = probe.take()
                    p["cpu"] = [time.process_time() - c0] * 2
                    parts[name].append(p)
            stats[name] = opt.comm_stats()
    popt = runs["plain"][1]
    sizes = {"E": sum(f.layout.padded_numel for f in popt.flat_groups),
             "E_kept": sum(f.layout.padded_numel for f in popt.flat_groups
                           if f.unit_index in set(popt.grad_sync.kept_units)),
             "e": popt.dtype.itemsize, "e_r": popt.reduce_dtype.itemsize}
    return {"times": times, "stats": stats, "parts": parts, "mesh": sizes,
            "formula": {n: _formula(n, runs[n][1]) for n in CONFIGS},
            "params": sum(g.layout.numel for g in runs["plain"][1].flat_groups)}


def codec_rows(sizes=(1 << 20, 1 << 24), reps: int = 15) -> list:
    """[Note: the codec's byte floor] The CPU codec (the C++ kernel, 1 thread) against a copy
    of the same bytes, interleaved call by call: quantize reads x (4 or 2 B/element) and writes
    the codes (1 or 1/2) and a scale per 128; dequantize reads codes + scales and writes fp32;
    dequantize-add (qgZ's decode-and-sum) also reads the fp32 accumulator. The copy moves the
    same number of bytes (half read, half written: torch's copy_ of uint8, the machine's
    ceiling for streaming bytes on one core); fraction = copy time / kernel time. Medians over
    `reps` alternated calls, and the minimum of each (on a shared machine the minimum is the
    least disturbed)."""
    from bench_codec import time_against_copy  # (benchmarks/, this script's folder)

    from zerokern.kernels import blockquant, load_op

    torch.set_num_threads(1)
    op = load_op("cpu")
    codec = blockquant.NativeCodec(op)
    rows = []
    for n in sizes:
        for dt, bits, what in ((torch.float32, 8, "quantize"), (torch.float32, 4, "quantize"),
                               (torch.bfloat16, 8, "quantize"), (torch.float32, 8, "dequantize"),
                               (torch.float32, 4, "dequantize"),
                               (torch.float32, 8, "dequantize_add")):
            if what == "dequantize_add" and not hasattr(codec, "dequantize_add_"):
                continue  # an older tree
            f, nbytes = _codec_call(codec, what, n, dt, bits)
            tk, tc = time_against_copy(f, nbytes, reps)
            rows.append({"n": n, "op": what, "bits": bits, "in": str(dt).split(".")[-1],
                         "bytes": nbytes, "kernel_ms": 1e3 * statistics.median(tk),
                         "copy_ms": 1e3 * statistics.median(tc),
                         "frac": statistics.median(tc) / statistics.median(tk),
                         "frac_min": min(tc) / min(tk),
                         "GBps": nbytes / statistics.median(tk) / 1e9,
                         "isa": op.selected_isa()})
    return rows


def _codec_call(codec, what: str, n: int, dt, bits: int):
    """(a call of the codec on n elements, the bytes it reads and writes)."""
    x = torch.randn(n).to(dt)
    codes, scale = codec.quantize(x, 128, bits)
    acc = torch.zeros(n)
    cs = codes.numel() + scale.numel() * 4
    if not hasattr(codec, "quantize_into"):  # an older tree: its allocating calls
        if what == "quantize":
            return (lambda: codec.quantize(x, 128, bits)), n * x.element_size() + cs
        return (lambda: codec.dequantize(codes, scale, 128, bits)), cs + 4 * n
    if what == "quantize":
        return (lambda: codec.quantize_into(x, codes, scale, 128, bits)), \
            n * x.element_size() + cs
    if what == "dequantize":
        return (lambda: codec.dequantize_into(codes, scale, acc, 128, bits)), cs + 4 * n
    return (lambda: codec.dequantize_add_(codes, scale, acc, 128, bits)), cs + 8 * n


def codec_table(rows) -> str:
    lines = ["| n | op | bits | in | bytes/elem | kernel ms | copy of the same bytes ms | "
             "fraction of the copy (median) | (min) | GB/s |", "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| 2^{r['n'].bit_length() - 1} | {r['op']} | {r['bits']} | {r['in']} | "
                     f"{r['bytes'] / r['n']:.2f} | {r['kernel_ms']:.3f} | {r['copy_ms']:.3f} | "
                     f"{r['frac']:.0%} | {r['frac_min']:.0%} | {r['GBps']:.1f} |")
    return "\n".join(lines)


def before_after_table(runs: dict) -> str:
    """Per tree and config: the median over the runs of (config step / plain step in the same
    run), and of the step itself; the runs' range of the ratio."""
    lines = ["| tree | config | x plain (median of runs) | range | step ms (median) | "
             "cross-node B/step | CPU ms/rank-step |", "|" + "---|" * 7]
    for name, rs in runs.items():
        for c in CONFIGS:
            ratios = [next(r for r in x["rows"] if r["config"] == c)["ratio"] for x in rs]
            steps = [next(r for r in x["rows"] if r["config"] == c)["step_s"] for x in rs]
            cross = next(r for r in rs[0]["rows"] if r["config"] == c)["cross_node"]
            cpu = [x["breakdown"][c]["cpu"][0] for x in rs if x.get("breakdown")]
            lines.append(f"| {name} | {c} | {statistics.median(ratios):.2f} | "
                         f"{min(ratios):.2f}-{max(ratios):.2f} | "
                         f"{1e3 * statistics.median(steps):.0f} | {cross:,} | "
                         + (f"{statistics.median(cpu):.1f}" if cpu else "") + " |")
    return "\n".join(lines)


def merged_breakdown(rs) -> dict:
    """{config: {key: [wall ms, cpu ms]}}: the median over runs of each run's breakdown."""
    out = {}
    for c in CONFIGS:
        keys = {k for x in rs for k in x["breakdown"][c]}
        out[c] = {k: [statistics.median(x["breakdown"][c].get(k, [0.0, 0.0])[i] for x in rs)
                      for i in (0, 1)] for k in sorted(keys)}
    return out


def merged_codec(rs) -> list:
    """The codec rows with the median over runs of each fraction and time."""
    rows = []
    for i, r in enumerate(rs[0]["codec"]):
        same = [x["codec"][i] for x in rs]
        rows.append({**r, **{k: statistics.median(y[k] for y in same)
                             for k in ("kernel_ms", "copy_ms", "frac", "frac_min", "GBps")}})
    return rows


def report_md(data: dict) -> str:
    """The tables of a --trees result file (bench_mesh.py --report FILE)."""
    runs = data["runs"]
    out = ["## Step time, before and after (x plain stage 3 in the same run)", "",
           before_after_table(runs), ""]
    loads = {n: [x["load"] for x in rs] for n, rs in runs.items()}
    out += ["Load average (1 min) at the start and end of each run: " + "; ".join(
        f"{n}: " + ", ".join(f"{a:.0f}-{b:.0f}" for a, b in ls) for n, ls in loads.items()),
        ""]
    for n, rs in runs.items():
        out += [f"## Where the time goes: {n} (ms per step, mean over the 4 ranks, median over "
                f"the {len(rs)} runs; wall (CPU) where they differ)", "",
                breakdown_table(merged_breakdown(rs)), ""]
    for n, rs in runs.items():
        if rs[0].get("codec"):
            out += [f"## The codec against a copy of the same bytes: {n} (1 thread, median "
                    f"over the {len(rs)} runs of each run's median of 15)", "",
                    codec_table(merged_codec(rs)), ""]
    return "\n".join(out)


BREAKDOWN_KEYS = ("cpu", "wait@main", "codec@main", "codec@ring", "qgz@ring", "a2a@ring",
                  "qwz_hops@ring", "ring_ag@ring", "ring_rs@ring", "hpz_keep@main")


def summarize_parts(res) -> dict:
    """{config: {key: [wall ms, cpu ms]}}: per rank the median over the timed steps, then the
    mean over the ranks ([Note: the breakdown])."""
    out = {}
    for name in CONFIGS:
        per_rank = []
        for r in res:
            steps = r["parts"][name]
            keys = {k for p in steps for k in p}
            per_rank.append({k: [1e3 * statistics.median(p.get(k, [0.0, 0.0])[i] for p in steps)
                                 for i in (0, 1)] for k in keys})
        keys = {k for p in per_rank for k in p}
        out[name] = {k: [sum(p.get(k, [0.0, 0.0])[i] for p in per_rank) / len(per_rank)
                         for i in (0, 1)] for k in sorted(keys)}
        out[name]["step"] = [1e3 * statistics.mean(statistics.median(r["times"][name])
                                                   for r in res)] * 2
    return out


def breakdown_table(b: dict) -> str:
    """Markdown: ms per step, mean over the 4 ranks; wall (CPU) where they differ."""
    head = ["config", "step"] + list(BREAKDOWN_KEYS)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, d in b.items():
        cells = [name, f"{d['step'][0]:.0f}"]
        for k in BREAKDOWN_KEYS:
            w, c = d.get(k, [0.0, 0.0])
            cells.append(f"{w:.1f}" if k == "cpu" or abs(w - c) < 0.05 * max(w, 1e-9)
                         else f"{w:.1f} ({c:.1f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _loss_worker(rank, ws, steps, batch, seq):
    from zerokern.train.data import VOCAB, Batches, load_corpus

    meshes = {"4": init_device_mesh("cpu", (4,)),
              "2x2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))}
    corpus = load_corpus()
    out = {}
    for name in ("plain", "hpz_q8", "hpz_q4"):
        model = build_gpt("tiny", seed=0, vocab=VOCAB, seq=seq)
        opt = _opt(model, name, meshes, lr=1e-2)
        data = Batches(corpus, batch, seq, 0, rank)
        losses = []
        for s in range(steps):
            x, y = data.get(s)
            loss = model.loss(x, y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            torch.distributed.all_reduce(t)
            losses.append(float(t) / ws)
        out[name] = {"last10": sum(losses[-10:]) / 10, "last50": sum(losses[-50:]) / 50,
                     "first": losses[0]}
    return out


def _cross(name, st) -> int:
    d = st["dims"]
    if name == "hsdp":
        return d["replicate"]["total"]
    cross = d.get("cross", {}).get("total", 0)  # qgZ's second hop: all of it crosses
    return d["shard"]["total"] // 2 + cross  # the world ring: 2 of 4 links cross


def alternate(trees, reps: int, argv) -> dict:
    """[Note: before and after in one run] Run this benchmark `reps` times per tree, the trees
    alternated (A B A B ...), each run in its own processes with PYTHONPATH=the tree (its
    zerokern, its C++ build), and return every run's JSON by tree."""
    import os
    import subprocess
    import sys
    import tempfile

    out = {name: [] for name, _ in trees}
    for i in range(reps):
        order = trees if i % 2 == 0 else trees[::-1]  # no tree always first
        for name, path in order:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                env = dict(os.environ, PYTHONPATH=path)
                load0 = os.getloadavg()[0]
                subprocess.run([sys.executable, __file__, *argv, "--json", f.name], env=env,
                               check=True, stdout=subprocess.DEVNULL)
                r = json.load(open(f.name))
                r["load"] = [load0, os.getloadavg()[0]]
                out[name].append(r)
                print(f"{name} run {i}: " + ", ".join(
                    f"{row['config']} {row['ratio']:.2f}" for row in r["rows"])
                    + f" (load {load0:.1f}-{r['load'][1]:.1f})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", default=None,
                    help="NAME=PATH,NAME=PATH: before/after, alternated ([Note: before and "
                         "after in one run])")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--report", default=None, help="print the tables of a --trees result file")
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--loss-steps", type=int, default=0)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--codec", action="store_true",
                    help="also time the CPU codec against a copy of the same bytes")
    ap.add_argument("--breakdown", action="store_true",
                    help="time the codec, the hops and the waits ([Note: the breakdown])")
    a = ap.parse_args()
    if a.report:
        with open(a.report) as f:
            print(report_md(json.load(f)))
        return
    if a.trees:
        import sys

        argv, skip = [], False  # this run's own flags (and their values) stay here
        for x in sys.argv[1:]:
            if skip:
                skip = False
            elif x in ("--trees", "--reps", "--json"):
                skip = True
            elif not x.startswith(("--trees=", "--reps=", "--json=")):
                argv.append(x)
        trees = [tuple(t.split("=", 1)) for t in a.trees.split(",")]
        runs = alternate(trees, a.reps, argv)
        print(before_after_table(runs))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"trees": dict(trees), "reps": a.reps, "runs": runs}, f, indent=1)
        return
    codec = codec_rows() if a.codec else None
    if codec:
        print(codec_table(codec))
    res = spawn_ranks(_worker, 4, a.size, a.steps, a.batch, a.precision, a.breakdown,
                      threads=1, timeout=1200)
    r0 = res[0]
    base = statistics.median(r0["times"]["plain"])
    rows = []
    for name in CONFIGS:
        st = r0["stats"][name]
        med = statistics.median(r0["times"][name])
        rows.append({"config": name, "bytes_per_step": st["total"],
                     "dims": {k: v["total"] for k, v in st["dims"].items()},
                     "cross_node": _cross(name, st), "formula": r0["formula"][name][0],
                     "formula_text": r0["formula"][name][1],
                     "step_s": med, "ratio": med / base,
                     "spread_s": [min(r0["times"][name]), max(r0["times"][name])]})
    breakdown = summarize_parts(res) if a.breakdown else None
    plain_cross = rows[0]["cross_node"]
    print(f"GPT {a.size} ({r0['params'] / 1e6:.2f}M params), stage 3 {a.precision}, 4 gloo ranks "
          f"(2 x 2), rank 0, {a.steps} steps, torch {torch.__version__}")
    print("| config | bytes/step (rank 0) | per group | cross-node | formula | x plain | "
          "step s | x plain |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['bytes_per_step']:,} | {r['dims']} | "
              f"{r['cross_node']:,} | {r['formula']:,} = {r['formula_text']} | "
              f"{r['cross_node'] / plain_cross:.3f} | {r['step_s']:.3f} | {r['ratio']:.2f} |")
    if breakdown:
        print(breakdown_table(breakdown))
    loss = None
    if a.loss_steps:
        lr = spawn_ranks(_loss_worker, 4, a.loss_steps, 8, 64, threads=1, timeout=3600)[0]
        loss = lr
        print(f"\nloss (tiny, stdlib corpus, batch 8 x seq 64 per rank, lr 1e-2, "
              f"{a.loss_steps} steps; mean of the last 10 and of the last 50 steps):")
        for name, v in lr.items():
            print(f"  {name}: {v['last10']:.4f} "
                  f"({v['last10'] / lr['plain']['last10'] - 1:+.2%} vs plain), "
                  f"{v['last50']:.4f} ({v['last50'] / lr['plain']['last50'] - 1:+.2%}); "
                  f"first {v['first']:.4f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"size": a.size, "steps": a.steps, "precision": a.precision,
                       "rows": rows, "loss": loss, "breakdown": breakdown, "codec": codec,
                       "mesh": r0["mesh"], "zerokern": zk.__file__,
                       "loss_steps": a.loss_steps}, f, indent=1)


if __name__ == "__main__":
    main()
