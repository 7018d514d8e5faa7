"""Render the benchmark tables of docs/benchmarks.md and README.md from benchmarks/results/*.json.

    python benchmarks/render.py --check   # exit 1 where a page's rendered table differs (a diff)
    python benchmarks/render.py --write   # rewrite the rendered regions from the results

A page marks each rendered region, and the prose around it is left alone:

    <!-- render: step-20m-fp32 -->
    ...the table and the line naming its run(s)...
    <!-- /render -->

[Note: one source for a benchmark number] Each table is a function of result files (TABLES: name
-> renderer); every number in it is read or computed from those files, never typed, and below
each table a line names its run: the file, date, commit, machine, and the load recorded beside
the measurement ("not recorded" where the file holds none). Rerun a benchmark, run --write, and
the page follows; a hand edit inside a region fails --check (tests/test_benchmark_pages.py, so
CI). --check also fails on a heading that appears twice in docs/benchmarks.md: the page once
held two "Training step" sections, the second stale.

Result files differ by kind (step, kernels, paired, engine, mesh, activations, infinity,
offload, ...; `kind()`); only the kinds a table needs have a renderer, and a file of any other
kind, or of one this script has never seen, is listed as such and otherwise ignored.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
PAGES = ("docs/benchmarks.md", "README.md")
# the page whose headings must be unique (README repeats none either, but is not a results page)
UNIQUE_HEADINGS = ("docs/benchmarks.md",)

REGION = re.compile(r"(<!-- render: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /render -->)",
                    re.S)


# --- reading result files -------------------------------------------------------------------

def load(name: str, results: Path = RESULTS):
    with open(results / name) as f:
        return json.load(f)


def kind(data) -> str:
    """The kind of a result file, from its shape (the files carry no schema tag of their own)."""
    if isinstance(data, list):
        if data and isinstance(data[0], dict) and "b_over_a" in data[0]:
            return "paired"
        if data and isinstance(data[0], dict) and "sides" in data[0]:
            return "phases"
        return "other"
    if not isinstance(data, dict):
        return "other"
    rows = data.get("rows")
    first = rows[0] if isinstance(rows, list) and rows and isinstance(rows[0], dict) else {}
    if data.get("benchmark") == "kernels":
        return "kernels"
    if "meta" in data and isinstance(rows, dict):
        return "adamw8bit-cpu-kernel"
    if "before_sha" in data or "before" in data:
        return "before-after"
    if "device_MiB" in first:   # before "step": the offload rows also carry iter_ms
        return "offload"
    if "iter_ms" in first:
        return "step"
    if "zk_ms" in first:
        return "engine"
    if "fitted_seq" in first:
        return "activations"
    if "cross_node" in first:
        return "mesh"
    if "nvme" in data:
        return "offload-nvme"
    if "probe_GBps" in data and "step_s" in data:
        return "infinity"
    if "stall_s" in first:
        return "checkpoint-async"
    if "phase" in first:
        return "checkpoint"
    return "other"


def kinds(results: Path = RESULTS) -> Dict[str, str]:
    """Every result file and its kind; a file that does not parse is 'unreadable', not an error."""
    out = {}
    for path in sorted(results.glob("*.json")):
        try:
            out[path.name] = kind(json.loads(path.read_text()))
        except (ValueError, OSError):
            out[path.name] = "unreadable"
    return out


def run_line(name: str, data) -> str:
    """`file`: date, commit, machine, load: what the file records of its run."""
    env = data.get("env") if isinstance(data, dict) else None
    if env is None and isinstance(data, dict) and "meta" in data:
        return _meta_line(name, data["meta"])
    if env is None:
        when = sorted({r["when"] for r in data if "when" in r}) if isinstance(data, list) else []
        span = f"{when[0]}-{when[-1][11:]}" if len(when) > 1 else (when[0] if when else None)
        return (f"`{name}`: {span or 'date not recorded'}; commit, machine and load not "
                "recorded in the file")
    date = env.get("date", "")
    date = f"{date[:10]} {date[11:16]} UTC" if len(date) >= 16 else "date not recorded"
    sha = env.get("git_sha")
    commit = (f"commit {sha[:7]}" + (" + uncommitted changes" if sha.endswith("-dirty") else "")
              if sha else "commit not recorded")
    machine = env.get("cpu_model") or env.get("device_name") or "machine not recorded"
    if env.get("device_kind") not in (None, "cpu"):
        machine = f"{env.get('device_name')} ({env.get('cpu_model')})"
    cores = env.get("usable_cpus")
    isa = env.get("cpu_capability")
    machine += (f", {cores} cores" if cores else "") + (f", {isa}" if isa else "")
    machine += f", torch {env['torch']}" if env.get("torch") else ""
    return f"`{name}`: {date}, {commit}, {machine}; load: {_load(data, env)}"


def _load(data, env) -> str:
    load = dict(data.get("raw", {}).get("load") or {})
    for key in ("other_cpu_load_before", "other_cpu_load_during", "loadavg_1min_before",
                "loadavg_1min_after", "loadavg_before", "loadavg_after"):
        if key in env:
            load.setdefault(key, env[key])
    parts = []
    for key, label in (("other_cpu_load_before", "others' CPU share before"),
                       ("other_cpu_load_during", "during")):
        if load.get(key) is not None:
            parts.append(f"{label} {load[key]:.0%}")
    avg = [load.get(k) for k in ("loadavg_1min_before", "loadavg_1min_after")]
    if avg[0] is None and load.get("loadavg_before"):
        avg = [load["loadavg_before"][0], (load.get("loadavg_after") or [None])[0]]
    if avg[0] is not None:
        parts.append(f"load average {avg[0]:.1f}" + (f" → {avg[1]:.1f}" if avg[1] else ""))
    return ", ".join(parts) if parts else "not recorded"


def _meta_line(name: str, meta) -> str:
    lo = meta.get("loadavg_at_start")
    load = f"load average {lo[0]:.1f} at start" if lo else "not recorded"
    return (f"`{name}`: {meta.get('date', 'date not recorded')}, commit not recorded, "
            f"{meta.get('cpu', '?')} ({meta.get('nproc')} cores, {meta.get('isa')}); load: {load}")


def runs_note(*pairs) -> str:
    lines = [run_line(n, d) for n, d in pairs]
    if len(lines) == 1:
        return f"Run: {lines[0]}."
    return "Runs:\n\n" + "\n".join(f"- {line}" for line in lines)


# --- number formats (three significant digits, as the benchmarks' own markdown) -------------

def g3(x: float) -> str:
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def ratio(x: float, bold_below: Optional[float] = None) -> str:
    s = f"{x:.2f}"
    return f"**{s}**" if bold_below is not None and x < bold_below else s


def times(x: float, bold_below: Optional[float] = None) -> str:
    s = f"{x:.2f}×"
    return f"**{s}**" if bold_below is not None and x < bold_below else s


def pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def table(header: List[str], align: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# --- renderers: one per table; each returns the region's text -------------------------------

STAGE_NAMES = {"zerokern s0": "zerokern stage 0", "zerokern s1": "zerokern stage 1",
               "zerokern s2": "zerokern stage 2", "zerokern s3": "zerokern stage 3",
               "zerokern s3 keep all": "zerokern stage 3, `keep_for_backward_mb=inf`",
               "FSDP2 + AdamW(fused)": "FSDP2 (`fully_shard`) + AdamW(fused)"}


def _rows(data) -> Dict[str, dict]:
    return {r["provider"]: r for r in data["rows"]}


def render_step(results: Path) -> str:
    one, micro4, n4 = (load(f, results) for f in (
        "step-20m-n2-fp32.json", "step-20m-n2-fp32-micro4.json", "step-20m-n4-fp32.json"))
    r1, r4, rn = _rows(one), _rows(micro4), _rows(n4)
    out = []
    for p, a in r1.items():
        b, c = r4.get(p), rn.get(p)
        zk = p.startswith("zerokern")
        s3 = p.startswith("zerokern s3")
        x1 = ratio(a["vs_ddp"], 1.0 if zk and not s3 else None)
        xn = ratio(c["vs_ddp"], 1.0 if zk and not s3 else None) if c else ""
        if s3:   # stage 3's target is against stage 2 (issue 20)
            x1 += f" ({a['iter_ms'] / r1['zerokern s2']['iter_ms']:.2f}× stage 2)"
            xn += f" ({c['iter_ms'] / rn['zerokern s2']['iter_ms']:.2f}× s2)" if c else ""
        mib = f"{a['state_MiB']:.0f}"
        out.append([STAGE_NAMES.get(p, p),
                    f"{a['iter_ms']:.0f} ({a['p20_ms']:.0f}-{a['p80_ms']:.0f})", x1,
                    f"{a['step_ms']:.0f}" if a.get("step_ms") is not None else "",
                    f"{b['iter_ms']:.0f}" if b else "",
                    ratio(b["vs_ddp"], 1.0 if zk and not s3 else None) if b else "",
                    f"**{mib}**" if s3 else mib, xn,
                    (f"**{c['state_MiB']:.0f}**" if s3 else f"{c['state_MiB']:.0f}") if c else ""])
    head = ["provider", "1 micro-batch: ms (p20-p80)", "× DDP", "step() ms",
            "4 micro-batches: ms", "× DDP", "model states MiB/rank", "N=4 × DDP", "N=4 MiB/rank"]
    return table(head, ["---"] + ["---:"] * 8, out) + "\n\n" + runs_note(
        ("step-20m-n2-fp32.json", one), ("step-20m-n2-fp32-micro4.json", micro4),
        ("step-20m-n4-fp32.json", n4))


STEP_PP = "step-pp-20m-pp2-dp{dp}-{sched}-m4-run{run}.json"   # zerokern bench --step --pp 2
STEP_PP_RUNS = ((2, "1f1b", 1), (2, "1f1b", 2), (2, "1f1b", 3), (2, "gpipe", 1),
                (1, "1f1b", 1), (1, "1f1b", 2), (1, "1f1b", 3))


def render_step_pp(results: Path) -> str:
    """The pipeline row (issue 38): pp 2 x dp 2 (1F1B three runs, GPipe one) and pp 2 x dp 1
    (three runs); the times shown are the last run's (the least loaded)."""
    runs = {k: load(STEP_PP.format(dp=k[0], sched=k[1], run=k[2]), results)
            for k in STEP_PP_RUNS}
    rows = {k: _rows(d) for k, d in runs.items()}

    def peer(dp, p, sched="1f1b", n=(1, 2, 3)):
        return " / ".join(f"{rows[dp, sched, r][p]['vs_peer']:.2f}" for r in n)
    out = []
    for p, a in rows[2, "1f1b", 3].items():
        b = rows[1, "1f1b", 3][p]
        loss = max(d["losses"]["step1_rel_diff_vs_peer"].get(p, 0.0) for d in runs.values())
        out.append([p, f"{a['iter_ms']:.0f} ({a['p20_ms']:.0f}-{a['p80_ms']:.0f})",
                    peer(2, p), peer(2, p, "gpipe", (1,)),
                    " / ".join(f"{a[f's{s}_all_gathers']}, {a[f's{s}_reduce_scatters']}"
                               for s in (0, 1)),
                    " / ".join(f"{a[f's{s}_state_MiB']:.0f}" for s in (0, 1)),
                    f"{b['iter_ms']:.0f} ({b['p20_ms']:.0f}-{b['p80_ms']:.0f})", peer(1, p),
                    " / ".join(f"{b[f's{s}_state_MiB']:.0f}" for s in (0, 1)),
                    f"{loss:.0e}" if p != "FSDP2 + torch PipelineStage + AdamW(fused)" else ""])
    head = ["provider", "pp 2 × dp 2, 1F1B: step ms, run 3 (p20-p80)", "× peer (runs 1 / 2 / 3)",
            "GPipe × peer", "all-gathers, reduce-scatters per step (stage 0 / 1)",
            "MiB/rank (stage 0 / 1)", "pp 2 × dp 1: step ms, run 3", "× peer (runs 1 / 2 / 3)",
            "MiB/rank (stage 0 / 1)", "step-1 loss vs peer (rel.)"]
    return table(head, ["---"] + ["---:"] * 9, out) + "\n\n" + runs_note(
        *((STEP_PP.format(dp=k[0], sched=k[1], run=k[2]), runs[k]) for k in STEP_PP_RUNS))


RULE_STEP = (("lion", "ZeroLion", "lion-pytorch `Lion`"),
             ("adamw8bit", "ZeroAdamW(state_bits=8)", "bitsandbytes `AdamW8bit`"),
             ("muon", "ZeroMuon", "`torch.optim.Muon` + `AdamW(fused)`"))


def render_step_rules(results: Path) -> str:
    out, notes = [], []
    for rule, name, peer in RULE_STEP:
        f = f"step-20m-n2-fp32-{rule}.json"
        data = load(f, results)
        rows = _rows(data)
        stages = [rows[f"zerokern s{s}"] for s in range(4)]
        peer_row = next(r for p, r in rows.items() if not p.startswith("zerokern"))
        out.append([name, peer] + [times(r["vs_ddp"], 1.0) for r in stages]
                   + [" / ".join(f"{r['state_MiB']:.0f}" for r in stages)
                      + f" ({peer_row['state_MiB']:.0f})"])
        notes.append((f, data))
    head = ["optimizer", "peer (DDP +)", "stage 0", "stage 1", "stage 2", "stage 3",
            "MiB/rank zerokern s0 / s1 / s2 / s3 (peer)"]
    return table(head, ["---", "---"] + ["---:"] * 4 + ["---"], out) + "\n\n" + runs_note(*notes)


def _krow(data, op, case, provider, log2n):
    for r in data["rows"]:
        if (r["op"], r["case"], r["provider"], r["log2n"]) == (op, case, provider, log2n):
            return r
    raise KeyError((op, case, provider, log2n))


def render_kernels_adam(results: Path) -> str:
    data = load("kernels-cpu.json", results)
    out = []
    for case, what in (("bf16", "bf16 grad + bf16 param_out vs mixed torch path"),
                       ("fp32", "fp32 vs `AdamW(fused=True)`")):
        for n in (24, 26):
            zk = _krow(data, "adam_step_", case, "cpu", n)
            peer = _krow(data, "adam_step_", case, "torch-fused", n)
            out.append([f"2^{n}", what, f"{g3(zk['median_ms'])} ms", f"{g3(peer['median_ms'])} ms",
                        f"**{peer['median_ms'] / zk['median_ms']:.2f}×**", f"{zk['gbps']:.1f}",
                        pct(zk["frac_rmw"])])
    head = ["size", "case", "zerokern cpu", "torch", "ratio", "zerokern GB/s",
            "% of RMW ceiling"]
    return table(head, ["---:", "---", "---:", "---:", "---:", "---:", "---:"], out) + "\n\n" \
        + runs_note(("kernels-cpu.json", data))


RULE_KERNELS = (("adam_step_", "AdamW `adam_step_`", "torch-fused",
                 (("torch-fused", "copy_ + AdamW(fused) + copy_"),)),
                ("lion_step_", "Lion `lion_step_`", "lion-pytorch",
                 (("lion-pytorch", "lion-pytorch"), ("torch-foreach", "foreach Lion"))),
                ("muon_pieces", "Muon pieces `muon_pieces`", "torch-eager",
                 (("torch-eager", "eager torch"),)))


def render_kernel_rules(results: Path) -> str:
    data = load("kernels-cpu.json", results)
    floors = {"adam_step_": data["byte_floors"]["bf16"]["adam_step_"],
              "lion_step_": data["rule_floors"]["lion"]["bf16"],
              "muon_pieces": data["rule_floors"]["muon"]["bf16"]}
    out = []
    for op, label, _, peers in RULE_KERNELS:
        zk_provider = "zk-pieces" if op == "muon_pieces" else "cpu"
        for i, n in enumerate((22, 24)):
            zk = _krow(data, op, "bf16", zk_provider, n)
            cells = []
            for provider, pname in peers:
                p = _krow(data, op, "bf16", provider, n)
                cells.append(f"{pname} {g3(p['median_ms'])} "
                             f"({p['median_ms'] / zk['median_ms']:.2f}×)")
            out.append([f"{label} ({floors[op]:g})" if i == 0 else "", f"2^{n}",
                        f"{g3(zk['median_ms'])} ({pct(zk['frac_rmw'])})", ", ".join(cells)])
    head = ["rule (floor B/elem)", "size", "zerokern ms (% RMW)", "peers: ms (×)"]
    return table(head, ["---", "---:", "---:", "---"], out) + "\n\n" \
        + runs_note(("kernels-cpu.json", data))


ADAMW8BIT_PEERS = (("bnb-8bit", "bitsandbytes AdamW8bit"), ("torchao-8bit", "torchao AdamW8bit"),
                   ("zk-adamw32", "zerokern fp32 `adam_step_`"),
                   ("torch-fused", "fp32 AdamW(fused)"))


def render_kernel_adamw8bit(results: Path) -> str:
    f = "kernels-cpu-adamw8bit-issue40-20261129-r2.json"
    data = load(f, results)
    floor = data["rule_floors"]["adamw8bit"]["bf16"]
    out = []
    for case in data["cases"]:
        for n in data["sizes"]:
            zk = _krow(data, "adamw8bit_step_", case, "cpu", n)
            cells = []
            for provider, pname in ADAMW8BIT_PEERS:
                try:
                    p = _krow(data, "adamw8bit_step_", case, provider, n)
                except KeyError:   # a peer not installed in that run (torchao is optional)
                    continue
                cells.append(f"{pname} {g3(p['median_ms'])} "
                             f"({p['median_ms'] / zk['median_ms']:.2f}×)")
            out.append([case, f"2^{n}", f"{g3(zk['median_ms'])} ({pct(zk['frac_rmw'])})",
                        ", ".join(cells)])
    head = ["grad / param_out", "size", f"zerokern ms (% RMW, floor {floor:g} B/elem)",
            "peers: ms (×)"]
    return table(head, ["---", "---:", "---:", "---"], out) + "\n\n" + runs_note((f, data))


def render_newton_schulz(results: Path) -> str:
    data = load("kernels-cpu.json", results)
    by = {(r["op"], r["shape"], r["provider"]): r for r in data["ns_rows"]}
    out = []
    for shape in dict.fromkeys(r["shape"] for r in data["ns_rows"]):
        ns_zk, ns_t = by["newton_schulz", shape, "zk"], by["newton_schulz", shape, "torch"]
        st_zk, st_t = by["muon_step", shape, "zk"], by["muon_step", shape, "torch"]
        out.append([shape, f"{g3(ns_zk['median_ms'])} / {g3(ns_t['median_ms'])}",
                    f"{ns_zk['gflops']:.0f}",
                    f"{g3(st_zk['median_ms'])} / {g3(st_t['median_ms'])}",
                    pct(ns_zk["median_ms"] / st_zk["median_ms"])])
    head = ["shape", "Newton-Schulz: zerokern / torch ms", "zerokern GFLOP/s",
            "Muon step: zerokern / `torch.optim.Muon` ms", "% of the step in NS"]
    return table(head, ["---"] + ["---:"] * 4, out) + "\n\n" + runs_note(("kernels-cpu.json", data))


def render_offload_nvme(results: Path) -> str:
    new = load("offload-nvme-20m-s2-bf16.json", results)
    old = load("offload-nvme-100m-s2-bf16.json", results)
    r, probe = new["nvme"]["row"], new["nvme"]["probe_GBps"]
    row_new = [f"GPT {new['env']['model_size']} ({new['env']['params'] / 1e6:.1f}M params)",
               f"{r['GB_per_step']:.2f}",
               f"{r['probe_ms']:.0f} ms median ({r['probe_min_ms']:.0f}-{r['probe_max_ms']:.0f}), "
               f"{probe['median']:.2f} GB/s",
               f"{r['step_ms']:.0f} ms",
               f"**{r['of_probe_pct']:.0f}%** ({r['of_probe_min_pct']:.0f}-"
               f"{r['of_probe_max_pct']:.0f}%)", f"{r['kernel_ms']:.0f} ms"]
    o = old["nvme"]["row"]
    row_old = [f"GPT {old['env']['model_size']} ({old['env']['params'] / 1e6:.0f}M params), "
               "older method", f"{o['GB_per_step']:.2f}",
               f"{o['floor_ms']:.0f} ms (one sequential read+write sample, "
               f"{old['nvme']['disk']['rw_GBps']:.2f} GB/s)",
               f"{o['step_ms']:.0f} ms", f"{o['of_floor_pct']:.0f}% of that sample",
               f"{o['kernel_ms']:.0f} ms"]
    head = ["model", "GB read+written per step", "disk probe", "step",
            "step / probes around it", "cpu kernel"]
    return table(head, ["---"] + ["---:"] * 5, [row_new, row_old]) + "\n\n" + runs_note(
        ("offload-nvme-20m-s2-bf16.json", new), ("offload-nvme-100m-s2-bf16.json", old))


ACT_NAMES = {"DeepSpeed full+partition_activations+cpu_checkpointing":
             "DeepSpeed full + Pa + cpu (tp 1)", "FSDP2 offload": "FSDP2 offload (`save_on_cpu`)"}


def render_activations(results: Path) -> str:
    data = load("activations-small-n2-fp32.json", results)
    best = max(r["fitted_seq"] for r in data["rows"] if r["provider"].startswith("zerokern"))
    out = []
    for r in data["rows"]:
        seq = f"{r['fitted_seq']}"
        if r["provider"].startswith("zerokern") and r["fitted_seq"] == best:
            seq = f"**{seq}**"
        out.append([ACT_NAMES.get(r["provider"], r["provider"]), seq, f"{r['MiB_at_fit']:.1f}",
                    f"{r['states_MiB']:.1f}", f"{r['overhead_cpu']:.2f}",
                    f"{r['added_cpu_ms']:.0f}"])
    head = ["provider", "fitted seq", "MiB/rank at fit", "model states MiB", "CPU-time overhead",
            "added CPU ms"]
    return table(head, ["---"] + ["---:"] * 5, out) + "\n\n" \
        + runs_note(("activations-small-n2-fp32.json", data))


def _act(data, provider):
    return next(r for r in data["rows"] if r["provider"] == provider)


def _added(data, provider):
    """CPU ms over the family's none; older files lack the column, so it is computed the same
    way (zerokern/bench/activations.py)."""
    r = _act(data, provider)
    none = _act(data, provider.split(" ")[0] + " none")
    return r["common_cpu_ms"] - none["common_cpu_ms"]


def render_headline(results: Path) -> str:
    f = {k: load(v, results) for k, v in dict(
        kern="kernels-cpu.json", paired="step-20m-n2-fp32-shm-paired.json",
        step="step-20m-n2-fp32.json", engine="engine-20m-n2.json",
        mesh="mesh-quant-2x2.json", mesh16="mesh-quant-2x2-bf16.json",
        act="activations-small-n2-fp32.json", act1="activations-small-n2-fp32-run1.json",
        inf="infinity-2b.json").items()}
    rows = []
    # adam_step_
    zk = _krow(f["kern"], "adam_step_", "bf16", "cpu", 26)
    pe = _krow(f["kern"], "adam_step_", "bf16", "torch-fused", 26)
    rows.append(["`adam_step_`, 2^26 elements, bf16 grad + bf16 param",
                 f"{g3(zk['median_ms'])} ms", f"{g3(pe['median_ms'])} ms (torch mixed path)",
                 f"**{pe['median_ms'] / zk['median_ms']:.2f}×** faster, "
                 f"{pct(zk['frac_rmw'])} of the read-modify-write ceiling", "1"])
    # paired stages: the median over the sets of each pair
    def sets(a, b):
        return [r for r in f["paired"] if (r["a"], r["b"]) == (a, b)]

    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    vs = [med([r["b_over_a"] for r in sets("ddp", s)]) for s in "012"]
    ms = [med([r["b_ms"] for r in sets("ddp", s)]) for s in "012"]
    ddp = med([r["a_ms"] for s in "012" for r in sets("ddp", s)])
    tcp = [med([r["b_over_a"] for r in sets(f"{s}:tcp", s)]) for s in "02"]
    s3 = med([r["b_over_a"] for r in sets("2", "3")])
    keep = med([r["b_over_a"] for r in sets("2", "3:keep-all")])
    n_sets, n_pairs = len(sets("ddp", "0")), sets("ddp", "0")[0]["pairs"]
    rows.append(["iteration, 23.2M GPT, 2 ranks, fp32, stages 0 / 1 / 2 vs DDP + AdamW(fused); "
                 "stage 3 vs stage 2", f"{min(ms):.0f}-{max(ms):.0f} ms (stages 0-2)",
                 f"{ddp:.0f} ms", "**" + " / ".join(f"{v:.2f}" for v in vs) + "×** DDP's time "
                 f"(over TCP rings instead of shared memory: {min(tcp):.2f}-{max(tcp):.2f}× "
                 f"the same stages), stage 3 {s3:.2f}× stage 2 ({keep:.2f}× with "
                 f"`keep_for_backward_mb=inf`); each ratio paired in one pair of ranks, medians "
                 f"of {n_sets} sets of {n_pairs} pairs", "2"])
    st = _rows(f["step"])
    rows.append(["iteration, stage 3 vs FSDP2, same per-rank memory",
                 f"{st['zerokern s3']['iter_ms']:.0f} ms",
                 f"{st['FSDP2 + AdamW(fused)']['iter_ms']:.0f} ms",
                 f"**{st['zerokern s3']['iter_ms'] / st['FSDP2 + AdamW(fused)']['iter_ms']:.2f}×**"
                 " FSDP2's time", "3"])
    eng = {r["config"]: r for r in f["engine"]["rows"]}
    fp32 = [eng[f"s{s}-fp32"] for s in (1, 2, 3)]
    t = [r["time_ratio"] for r in fp32]
    rows.append(["`zerokern.initialize` vs `deepspeed.initialize`, fp32, stages 1-3",
                 f"{min(r['zk_ms'] for r in fp32):.0f}-{max(r['zk_ms'] for r in fp32):.0f} ms",
                 f"{min(r['ds_ms'] for r in fp32):.0f}-{max(r['ds_ms'] for r in fp32):.0f} ms",
                 f"**{min(t):.2f}-{max(t):.2f}×** DeepSpeed's time; held memory "
                 f"{fp32[0]['mem_ratio']:.2f}× (stage 1), {fp32[1]['mem_ratio']:.2f}× (stage 2), "
                 f"{fp32[2]['mem_ratio']:.2f}× (stage 3)", "4"])

    def cross(data, config):
        by = {r["config"]: r for r in data["rows"]}
        return by[config]["cross_node"] / by["plain"]["cross_node"]

    loss = f["mesh"]["loss"]
    rows.append(["stage 3 on 2 \"nodes\" × 2, cross-node bytes per step, hpZ + qwZ + qgZ "
                 "(int8 / int4 grads) vs plain ZeRO-3",
                 f"{cross(f['mesh16'], 'hpz_q8'):.2f}× / {cross(f['mesh16'], 'hpz_q4'):.2f}× "
                 f"(bf16), {cross(f['mesh'], 'hpz_q8'):.2f}× / {cross(f['mesh'], 'hpz_q4'):.2f}× "
                 "(fp32)", "1.00×",
                 f"loss after {f['mesh']['loss_steps']} steps (mean of the last 50) "
                 f"{(loss['hpz_q8']['last50'] / loss['plain']['last50'] - 1):+.2%} (int8), "
                 f"{(loss['hpz_q4']['last50'] / loss['plain']['last50'] - 1):+.2%} (int4) "
                 "against plain", "5"])
    a, a1 = f["act"], f["act1"]
    zf, df, ff = (_act(a, p) for p in ("zerokern full", "DeepSpeed full", "FSDP2 full"))
    ds_best = max(r["fitted_seq"] for r in a["rows"] if r["provider"].startswith("DeepSpeed"))
    rows.append([f"activation memory at stage 3, {a['env']['params'] / 1e6:.2f}M GPT, "
                 f"{a['env']['world_size']} ranks, {a['env']['budget_MiB']} MiB/rank budget, "
                 "`activation_checkpointing=\"full\"` vs DeepSpeed's `checkpointing.checkpoint` "
                 "per block", f"fits {zf['fitted_seq']} tokens",
                 f"{ds_best} (DeepSpeed's best setting)",
                 f"**{zf['fitted_seq'] / ds_best:.2f}×** DeepSpeed's length; recompute "
                 f"{zf['overhead_cpu']:.2f}× its none (+{_added(a, 'zerokern full'):.0f} CPU ms) "
                 f"vs {df['overhead_cpu']:.2f}× (+{_added(a, 'DeepSpeed full'):.0f} ms), "
                 f"{_act(a1, 'zerokern full')['overhead_cpu']:.2f}× vs "
                 f"{_act(a1, 'DeepSpeed full')['overhead_cpu']:.2f}× in a second run; iteration "
                 f"(CPU time) {zf['common_cpu_ms'] / df['common_cpu_ms']:.2f}× DeepSpeed's; "
                 f"FSDP2 + `checkpoint_wrapper` fits {ff['fitted_seq'] / zf['fitted_seq']:.2f}× "
                 "zerokern's", "6"])
    inf = f["inf"]
    losses = [r["loss"] for r in inf["rows"] if r.get("loss") is not None]
    paired = inf["step_of_probe"]["paired"]
    rows.append([f"ZeRO-Infinity: {inf['params'] / 1e9:.2f}B-param GPT, "
                 f"{inf['state_GB_fp32']:.1f} GB of optimizer state, {inf['ram_GiB']:.1f} GiB "
                 "of RAM", f"peak RSS {inf['peak_rss_GiB']:.1f} GiB",
                 "a probe replaying the step's own I/O, between the steps",
                 f"loss {losses[0]:.2f} → {losses[-1]:.2f} in {len(losses)} steps; "
                 f"{inf['step_s']['median']:.1f} s per step moving "
                 f"{inf['bytes_per_step_GB']:.1f} GB = **{paired['median']:.0f}%** "
                 f"({paired['min']:.0f}-{paired['max']:.0f}%) of the disk as probed", "7"])
    head = ["what", "zerokern", "peer", "", "run"]
    names = [("kernels-cpu.json", f["kern"]), ("step-20m-n2-fp32-shm-paired.json", f["paired"]),
             ("step-20m-n2-fp32.json", f["step"]), ("engine-20m-n2.json", f["engine"]),
             ("mesh-quant-2x2.json, mesh-quant-2x2-bf16.json", f["mesh"]),
             ("activations-small-n2-fp32.json", a), ("infinity-2b.json", inf)]
    notes = [f"{i}. " + run_line(n, d) for i, (n, d) in enumerate(names, 1)]
    notes[5] += " (the second run: " + run_line("activations-small-n2-fp32-run1.json", a1) + ")"
    return table(head, ["---", "---:", "---:", "---", "---:"], rows) + "\n\nRuns:\n\n" \
        + "\n".join(notes)


TABLES: Dict[str, Callable[[Path], str]] = {
    "kernels-adam": render_kernels_adam,
    "step-20m-fp32": render_step,
    "step-pp": render_step_pp,
    "step-rules": render_step_rules,
    "kernel-rules": render_kernel_rules,
    "kernel-adamw8bit": render_kernel_adamw8bit,
    "newton-schulz": render_newton_schulz,
    "offload-nvme": render_offload_nvme,
    "activations": render_activations,
    "headline": render_headline,
}


# --- pages ----------------------------------------------------------------------------------

def render_page(text: str, results: Path = RESULTS, page: str = "page"):
    """The page with every region re-rendered, and the problems found: unknown table names."""
    problems = []

    def sub(m):
        name = m.group("name")
        if name not in TABLES:
            problems.append(f"{page}: unknown table `{name}` (known: {', '.join(TABLES)})")
            return m.group(0)
        return m.group(1) + TABLES[name](results) + "\n" + m.group(4)

    return REGION.sub(sub, text), problems


def duplicate_headings(text: str) -> List[str]:
    seen, dups, fence = set(), [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        if fence or not line.startswith("#"):
            continue
        if line in seen:
            dups.append(line)
        seen.add(line)
    return dups


def check(root: Path = REPO, results: Optional[Path] = None, pages=PAGES) -> List[str]:
    """Problems on the pages under root: each differing table with its diff, duplicate headings."""
    results = results or root / "benchmarks" / "results"
    problems = []
    for page in pages:
        text = (root / page).read_text()
        new, unknown = render_page(text, results, page)
        problems += unknown
        old_regions = {m.group("name"): m.group("body") for m in REGION.finditer(text)}
        for m in REGION.finditer(new):
            name, body = m.group("name"), m.group("body")
            if old_regions.get(name) != body:
                diff = difflib.unified_diff(old_regions.get(name, "").splitlines(),
                                            body.splitlines(), f"{page} (page)",
                                            f"{page} (from results)", lineterm="")
                problems.append(f"{page}: table `{name}` differs from benchmarks/results:\n"
                                + "\n".join(diff))
        if page in UNIQUE_HEADINGS:
            problems += [f"{page}: heading appears twice: {h!r}" for h in duplicate_headings(text)]
    return problems


def write(root: Path = REPO, results: Optional[Path] = None, pages=PAGES) -> List[str]:
    results = results or root / "benchmarks" / "results"
    changed = []
    for page in pages:
        path = root / page
        text = path.read_text()
        new, unknown = render_page(text, results, page)
        if unknown:
            raise SystemExit("\n".join(unknown))
        if new != text:
            path.write_text(new)
            changed.append(page)
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 where a page differs")
    mode.add_argument("--write", action="store_true", help="rewrite the rendered regions")
    mode.add_argument("--kinds", action="store_true", help="list the result files and kinds")
    ap.add_argument("--root", type=Path, default=REPO,
                    help="the checkout whose pages and results to use (default: this one)")
    args = ap.parse_args(argv)
    if args.kinds:
        for name, k in kinds(args.root / "benchmarks" / "results").items():
            print(f"{k:22s} {name}")
        return 0
    if args.write:
        changed = write(args.root)
        print("rewrote " + ", ".join(changed) if changed else "pages already match the results")
        problems = [p for p in check(args.root) if "heading appears twice" in p]
    else:
        problems = check(args.root)
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
