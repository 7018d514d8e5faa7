"""`zerokern bench --step` on two checkouts, runs alternated (before, after, before, after, ...),
for a change that must not make a stage slower (or must make it faster).

    python benchmarks/step_before_after.py --before /tmp/base --runs 3 --tag issue20-grads \\
        -- --stages 0 1 2 3 --no-fsdp2

Each run is one `zerokern bench --step` (its providers interleaved per repetition, so machine
noise hits all of them alike); the checkouts cannot share a process, so before and after are
alternated run by run. On a shared machine the absolute times drift between runs: compare each
stage against DDP + fused AdamW *from the same run* (the `x DDP` columns, median over runs).

Writes benchmarks/results/step-<model>-n<ranks>-<precision>-<tag>-before-after.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zerokern.bench import common  # noqa: E402

DDP = "DDP + AdamW(fused)"


def _run(checkout: Path, bench_args, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    subprocess.run([sys.executable, "-m", "zerokern", "bench", "--step", "--no-plot",
                    "--out", str(out), *bench_args], env=env, check=True, cwd=str(checkout))
    (path,) = out.glob("step-*.json")
    return json.loads(path.read_text())


def _fmt(xs, nd=0):
    return ", ".join(f"{x:.{nd}f}" for x in xs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", type=Path, required=True, help="checkout of the old code")
    p.add_argument("--after", type=Path, default=ROOT, help="checkout of the new code")
    p.add_argument("--before-label", default=None, help="e.g. the old commit (default: its sha)")
    p.add_argument("--after-label", default=None, help="e.g. the new commit (default: its sha)")
    p.add_argument("--runs", type=int, default=3, help="runs per side")
    p.add_argument("--tag", required=True, help="names the result files")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--keep", type=Path, default=None,
                   help="keep each run's output under DIR/<side><i>/ (default: a temp dir)")
    p.add_argument("--from-dir", type=Path, default=None,
                   help="run nothing: summarize the runs kept in DIR (before*/, after*/)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="after --: flags for zerokern bench --step")
    a = p.parse_args(argv)
    bench_args = [x for x in a.bench_args if x != "--"]
    sides = {"before": a.before, "after": a.after}
    runs = {"before": [], "after": []}
    if a.from_dir is not None:
        for side in sides:
            for d in sorted(a.from_dir.glob(f"{side}*")):
                runs[side] += [json.loads(f.read_text()) for f in d.glob("step-*.json")]
        bench_args = bench_args or runs["after"][0].get("bench_args", [])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            keep = a.keep or Path(tmp)
            for i in range(a.runs):
                for side, checkout in sides.items():
                    out = keep / f"{side}{i}"
                    print(f"--- run {i + 1}/{a.runs}: {side} ({checkout})", flush=True)
                    runs[side].append(_run(checkout, bench_args, out))
    n_runs = min(len(r) for r in runs.values())
    env = runs["after"][-1]["env"]
    env["other_cpu_load_during"] = None
    shas = {s: runs[s][0]["env"].get("git_sha") for s in sides}
    shas["before"] = a.before_label or shas["before"]
    shas["after"] = a.after_label or shas["after"]
    def has(run, name):
        return any(r["provider"] == name for r in run["rows"])
    after_names = [r["provider"] for r in runs["after"][0]["rows"]]
    # providers on both sides; one the old code lacks (a new option) is shown after the table
    names = [n for n in after_names if all(has(r, n) for s in sides for r in runs[s])]
    new_only = [n for n in after_names if n not in names and "zerokern s2" in names]
    table = []
    for name in names:
        row = {"provider": name}
        for side in sides:
            meds = [next(r["iter_ms"] for r in run["rows"] if r["provider"] == name)
                    for run in runs[side]]
            vs = [next(r["vs_ddp"] for r in run["rows"] if r["provider"] == name)
                  for run in runs[side]]
            row[side] = {"iter_ms": meds, "median_ms": statistics.median(meds),
                         "vs_ddp": vs, "vs_ddp_median": statistics.median(vs)}
        row["after_over_before"] = row["after"]["median_ms"] / row["before"]["median_ms"]
        table.append(row)
    s3 = {side: [next(r["iter_ms"] for r in run["rows"] if r["provider"] == "zerokern s3")
                 / next(r["iter_ms"] for r in run["rows"] if r["provider"] == "zerokern s2")
                 for run in runs[side]] for side in sides} \
        if {"zerokern s2", "zerokern s3"} <= set(names) else None
    e = runs["after"][0]["env"]
    stem = f"step-{e['model_size']}-n{e['world_size']}-{e['precision']}-{a.tag}-before-after"
    common.write_json(a.out / f"{stem}.json", {
        "env": env, "before_sha": shas["before"], "after_sha": shas["after"],
        "bench_args": bench_args, "rows": table, "s3_over_s2": s3,
        "runs": {s: [{"env": r["env"], "rows": [{k: v for k, v in row.items()
                                                   if k != "memory_report"}
                                                  for row in r["rows"]]} for r in runs[s]]
                 for s in sides}})
    md = [f"# `zerokern bench --step` before ({shas['before']}) and after ({shas['after']}), runs "
          f"alternated", "",
          f"{e['world_size']} {e['backend']} ranks, GPT {e['model_size']}, {e['precision']}, "
          f"batch {e['batch']}x{e['seq']}, {n_runs} runs per side alternated (before, after, "
          f"...), flags `{' '.join(bench_args)}`; each run interleaves its providers per "
          "repetition and reports medians. Compare the x DDP columns (same run) more than "
          "the ms: the machine's load drifts between runs.", "",
          common.markdown_env(env), "",
          "| provider | before: median ms (runs) | after: median ms (runs) | after/before | "
          "before x DDP (runs) | after x DDP (runs) |",
          "|---|---:|---:|---:|---:|---:|"]
    for row in table:
        b, f = row["before"], row["after"]
        md.append(f"| {row['provider']} | {b['median_ms']:.0f} ({_fmt(b['iter_ms'])}) | "
                  f"{f['median_ms']:.0f} ({_fmt(f['iter_ms'])}) | "
                  f"{row['after_over_before']:.3f} | {b['vs_ddp_median']:.3f} "
                  f"({_fmt(b['vs_ddp'], 2)}) | {f['vs_ddp_median']:.3f} "
                  f"({_fmt(f['vs_ddp'], 2)}) |")
    if s3:
        md += ["", "stage 3 / stage 2 (same run): before "
               f"{statistics.median(s3['before']):.3f} ({_fmt(s3['before'], 2)}), after "
               f"{statistics.median(s3['after']):.3f} ({_fmt(s3['after'], 2)})"]
    for name in new_only:  # after only: against stage 2 and DDP of the same run
        vs2 = [next(r["iter_ms"] for r in run["rows"] if r["provider"] == name)
               / next(r["iter_ms"] for r in run["rows"] if r["provider"] == "zerokern s2")
               for run in runs["after"]]
        vsd = [next(r["vs_ddp"] for r in run["rows"] if r["provider"] == name)
               for run in runs["after"]]
        md += ["", f"{name} (after only) / stage 2 (same run): {statistics.median(vs2):.3f} "
               f"({_fmt(vs2, 2)}); x DDP {statistics.median(vsd):.3f} ({_fmt(vsd, 2)})"]
    md.append("")
    common.write_text(a.out / f"{stem}.md", "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
