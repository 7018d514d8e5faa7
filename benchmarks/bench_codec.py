"""The CPU block-quantization codec (csrc/cpu/blockquant_cpu.cpp, qwZ / qgZ's payloads) against
its byte floor, one thread: every (bits, dtype, op) the collectives use, at one size in cache
and one out of it. Not a timed test.

[Note: the codec's byte floor] The floor is a copy of the same bytes on one core (torch's copy_
of uint8, half read, half written: the machine's rate for streaming bytes through one core),
timed call by call alternated with the kernel. quantize reads x (4 or 2 B/element) and writes
the codes (1 or 1/2) and one fp32 scale per 128; dequantize reads codes + scales and writes the
out dtype; dequantize-add (qgZ's decode-and-sum) also reads the fp32 accumulator. fraction =
copy time / kernel time (1.0: the kernel streams its bytes as fast as a copy), from the medians
over `--reps` alternated calls; "(min)" is min / min, the least disturbed call of each on a
shared machine.

Before and after in one run (each tree's own zerokern and its own C++ build cache, the trees
alternated A B B A ..., each run a fresh process):

    python benchmarks/bench_codec.py --trees before=/tmp/zk-before,after=. --runs 4 \\
        --json benchmarks/results/codec-....json
    python benchmarks/bench_codec.py --report benchmarks/results/codec-....json

One tree (the zerokern on PYTHONPATH): `PYTHONPATH=. python benchmarks/bench_codec.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# (op, bits, dtype): dtype is x's for quantize, the output's for dequantize
CONFIGS = [("quantize", 8, "float32"), ("quantize", 4, "float32"),
           ("quantize", 8, "bfloat16"), ("quantize", 4, "bfloat16"),
           ("dequantize", 8, "float32"), ("dequantize", 4, "float32"),
           ("dequantize", 8, "bfloat16"), ("dequantize", 4, "bfloat16"),
           ("dequantize_add", 8, "float32"), ("dequantize_add", 4, "float32")]
SIZES = (1 << 20, 1 << 24)
BLOCK = 128



def time_against_copy(f, nbytes: int, reps: int):
    """Seconds of `f()` and of a copy of `nbytes // 2` bytes (its byte floor: read + write =
    `nbytes`), alternated call by call `reps` times after one warm-up of each, so both see the
    same machine load: (f's times, the copy's). Here, not in zerokern: it must time the codec
    of an older tree too (--trees); bench_mesh.py's codec rows use it as well."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    f(), dst.copy_(src)
    tk, tc = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t1 = time.perf_counter()
        dst.copy_(src)
        t2 = time.perf_counter()
        tk.append(t1 - t0)
        tc.append(t2 - t1)
    return tk, tc

def _call(codec, what: str, n: int, bits: int, dtype):
    """(a call of the codec on n elements, the bytes it reads and writes)."""
    import torch

    x = torch.randn(n).to(dtype if what == "quantize" else torch.float32)
    codes, scale = codec.quantize(x, BLOCK, bits)
    cs = codes.numel() + scale.numel() * 4
    if what == "quantize":
        return (lambda: codec.quantize_into(x, codes, scale, BLOCK, bits)), \
            n * x.element_size() + cs
    out = torch.zeros(n, dtype=dtype)
    if what == "dequantize":
        return (lambda: codec.dequantize_into(codes, scale, out, BLOCK, bits)), \
            cs + n * out.element_size()
    return (lambda: codec.dequantize_add_(codes, scale, out, BLOCK, bits)), cs + 8 * n


def rows(reps: int, sizes=SIZES) -> list:
    """Every config at every size, this process's zerokern (one thread)."""
    import torch

    from zerokern.kernels import blockquant, load_op

    torch.set_num_threads(1)
    op = load_op("cpu")
    codec = blockquant.NativeCodec(op)
    out = []
    for n in sizes:
        for what, bits, dt in CONFIGS:
            f, nbytes = _call(codec, what, n, bits, getattr(torch, dt))
            tk, tc = time_against_copy(f, nbytes, reps)
            out.append({"n": n, "op": what, "bits": bits, "dtype": dt, "bytes": nbytes,
                        "kernel_ms": 1e3 * statistics.median(tk),
                        "copy_ms": 1e3 * statistics.median(tc),
                        "frac": statistics.median(tc) / statistics.median(tk),
                        "frac_min": min(tc) / min(tk), "isa": op.selected_isa()})
    return out


def alternate(trees, runs: int, reps: int, cache: str) -> dict:
    """[Note: before and after in one run] `runs` runs per tree, alternated (A B B A ...), each
    a fresh process with PYTHONPATH=the tree and ZEROKERN_CACHE_DIR=<cache>/<name> (no build
    shared between trees)."""
    out = {name: [] for name, _ in trees}
    for i in range(runs):
        for name, path in (trees if i % 2 == 0 else trees[::-1]):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                env = dict(os.environ, PYTHONPATH=os.path.abspath(path),
                           ZEROKERN_CACHE_DIR=os.path.join(cache, name))
                load0 = os.getloadavg()[0]
                subprocess.run([sys.executable, os.path.abspath(__file__), "--reps", str(reps),
                                "--json", f.name], env=env, check=True,
                               stdout=subprocess.DEVNULL)
                r = json.load(open(f.name))
            r["load"] = [load0, os.getloadavg()[0]]
            out[name].append(r)
            print(f"{name} run {i}: " + ", ".join(
                f"{x['op'][:3]}{x['bits']}{x['dtype'][0]}@2^{x['n'].bit_length() - 1} "
                f"{x['frac']:.0%}" for x in r["rows"]) + f" (load {r['load'][0]:.1f}-"
                f"{r['load'][1]:.1f})", flush=True)
    return out


def report_md(data: dict) -> str:
    """Per config and size: each tree's fraction of the copy (median over runs of each run's
    median; min over runs and max in brackets), its kernel time, and after / before."""
    runs = data["runs"]
    names = list(runs)
    head = ["n", "op", "bits", "dtype", "B/elem"]
    for nm in names:
        head += [f"{nm}: fraction of the copy (range)", f"{nm}: kernel ms"]
    if len(names) == 2:
        head.append(f"{names[1]} / {names[0]} kernel time")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(runs[names[0]][0]["rows"]):
        cells = [f"2^{r['n'].bit_length() - 1}", r["op"], str(r["bits"]), r["dtype"],
                 f"{r['bytes'] / r['n']:.2f}"]
        ks = {}
        for nm in names:
            fr = [x["rows"][i]["frac"] for x in runs[nm]]
            ks[nm] = statistics.median(x["rows"][i]["kernel_ms"] for x in runs[nm])
            cells += [f"{statistics.median(fr):.0%} ({min(fr):.0%}-{max(fr):.0%})",
                      f"{ks[nm]:.3f}"]
        if len(names) == 2:
            ratio = [x["rows"][i]["kernel_ms"] / y["rows"][i]["kernel_ms"]
                     for x, y in zip(runs[names[1]], runs[names[0]])]
            cells.append(f"{statistics.median(ratio):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    loads = "; ".join(f"{nm}: " + ", ".join(f"{a:.1f}-{b:.1f}" for a, b in
                                              (x["load"] for x in runs[nm])) for nm in names)
    lines += ["", f"Load average (1 min) at the start and end of each run: {loads}"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", default=None, help="NAME=PATH,NAME=PATH, alternated")
    ap.add_argument("--runs", type=int, default=4, help="runs per tree (with --trees)")
    ap.add_argument("--reps", type=int, default=15, help="alternated calls per config")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "zk-bench-codec"),
                    help="build caches, one per tree (with --trees)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", default=None, help="print the table of a --trees result file")
    a = ap.parse_args()
    if a.report:
        with open(a.report) as f:
            print(report_md(json.load(f)))
        return
    if a.trees:
        trees = [tuple(t.split("=", 1)) for t in a.trees.split(",")]
        data = {"trees": dict(trees), "runs_per_tree": a.runs, "reps": a.reps,
                "runs": alternate(trees, a.runs, a.reps, a.cache)}
        print(report_md(data))
    else:
        import zerokern

        data = {"rows": rows(a.reps), "zerokern": zerokern.__file__,
                "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        if not a.json:
            for r in data["rows"]:
                print(f"2^{r['n'].bit_length() - 1} {r['op']} int{r['bits']} {r['dtype']}: "
                      f"{r['kernel_ms']:.3f} ms, copy {r['copy_ms']:.3f} ms, {r['frac']:.0%} "
                      f"(min {r['frac_min']:.0%})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
