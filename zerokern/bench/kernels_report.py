"""Rows, targets and output (markdown, plot) of the kernel microbenchmarks (`kernels.py`).

Split from kernels.py to keep each module under ~400 lines; kernels.main imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence

import torch

from . import common, kernel_rules, kernel_rules_ns
from .kernel_cases import (
    HYPER,
    PROVIDERS,
    REFERENCE_MAX_LOG2,
    TARGET_CPU_FP32,
    TARGET_CPU_MIXED,
    TARGET_GPU_COPY,
    Case,
    Timed,
)

# ---------------------------------------------------------------------------- rows, targets


def make_rows(timed: Sequence[Timed], times: Dict[str, List[float]], n: int,
              log2n: int) -> List[dict]:
    rows = []
    for t in timed:
        s = common.summarize(times[t.key])
        rows.append(dict(op=t.op, case=t.case, provider=t.provider, log2n=log2n, n=n,
                         **s, bytes_per_elem=t.bytes_per_elem, bytes=t.bytes_per_elem * n,
                         gbps=common.gbps(t.bytes_per_elem * n, s["median_ms"]),
                         baseline=t.baseline))
    by_key = {(r["op"], r["case"], r["provider"]): r for r in rows}
    rmw = by_key[("ceiling", "fp32", "rmw")]["gbps"]
    copy = by_key[("ceiling", "fp32", "copy")]["gbps"]
    for r in rows:
        r["ceiling_rmw_gbps"], r["ceiling_copy_gbps"] = rmw, copy
        r["frac_rmw"], r["frac_copy"] = r["gbps"] / rmw, r["gbps"] / copy
        base = by_key.get((r["op"], r["case"], r["baseline"])) if r["baseline"] else None
        # speedup > 1: faster than the torch path measured in this same round-robin
        r["speedup"] = base["median_ms"] / r["median_ms"] if base else None
    return rows


def _find(rows, **kw) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in kw.items())), None)


def evaluate_targets(rows: Sequence[dict], device: torch.device) -> List[dict]:
    """The goals DESIGN §6 sets; benchmark outcomes to watch, not test assertions."""
    out = []
    if device.type == "cpu":
        for case, thr, what in (("bf16", TARGET_CPU_MIXED, "torch mixed fused path"),
                                ("fp32", TARGET_CPU_FP32, "AdamW(fused=True) fp32")):
            for log2n in (24, 26):
                r = _find(rows, op="adam_step_", case=case, provider="cpu", log2n=log2n)
                val = r["speedup"] if r else None
                out.append(dict(target=f"cpu adam_step_ {case} 2^{log2n}: >= {thr:.1f}x {what}",
                                value=None if val is None else round(val, 3), threshold=thr,
                                status="n/a" if val is None else
                                ("PASS" if val >= thr else "MISS")))
    else:
        big = [r for r in rows if r["op"] == "adam_step_" and r["log2n"] >= 28
               and r["provider"] in ("triton", "cuda")]
        for r in big:
            out.append(dict(target=f"{r['provider']} adam_step_ {r['case']} 2^{r['log2n']}: "
                                   f">= {TARGET_GPU_COPY:.0%} of copy bandwidth",
                            value=round(r["frac_copy"], 3), threshold=TARGET_GPU_COPY,
                            status="PASS" if r["frac_copy"] >= TARGET_GPU_COPY else "MISS"))
        if not big:
            out.append(dict(target=f"GPU adam_step_ >= 2^28: >= {TARGET_GPU_COPY:.0%} of copy "
                                   "bandwidth", value=None, threshold=TARGET_GPU_COPY,
                            status="n/a (no size >= 2^28 measured)"))
    return out


# ---------------------------------------------------------------------------- output

COLUMNS = [("size", "size"), ("provider", "provider"), ("median_ms", "median ms"),
           ("p20_ms", "p20 ms"), ("p80_ms", "p80 ms"), ("gbps", "GB/s"),
           ("pct_rmw", "% RMW"), ("pct_copy", "% copy"), ("speedup", "vs torch")]

SECTIONS = {
    "adam_step_": "adam_step_ ({desc}); vs torch = time of {base} / time",
    "grad_stats_": "grad_stats_ ({name} grad, floor {b} B/elem); vs torch = time of torch-norm "
                   "(vector_norm + isfinite().all()) / time",
    "ceiling": "ceilings (fp32, 8 B/elem): rmw = x.mul_(c) in place, copy = dst.copy_(src)",
}


def _display(rows: Sequence[dict]) -> List[dict]:
    return [dict(r, size=f"2^{r['log2n']}", pct_rmw=100 * r["frac_rmw"],
                 pct_copy=100 * r["frac_copy"]) for r in rows]


def sections(rows: Sequence[dict], cases: Sequence[Case]):
    """(title, rows) groups in reading order: adam per case, grad_stats per case, ceilings."""
    peers = tuple(p for name in kernel_rules.RULES for p in kernel_rules.PEERS[name])
    order = {p: i for i, p in enumerate(PROVIDERS + ("zk-pieces",) + peers + ("rmw", "copy"))}
    key = lambda r: (r["log2n"], order.get(r["provider"], 99))  # noqa: E731
    for op in ("adam_step_", "grad_stats_"):
        for c in cases:
            sel = sorted((r for r in rows if r["op"] == op and r["case"] == c.name), key=key)
            if not sel:
                continue
            base = ("copy_ + AdamW(fused) + copy_" if c.mixed else "AdamW(fused=True)")
            title = SECTIONS[op].format(desc=c.describe(), base=base, name=c.name,
                                        b=c.grad_dtype.itemsize)
            yield title, _display(sel)
    for name in kernel_rules.RULES:  # [Note: the byte floor of a rule] (kernel_rules.py)
        op = kernel_rules.OPS[name]
        for c in cases:
            sel = sorted((r for r in rows if r["op"] == op and r["case"] == c.name), key=key)
            if sel:
                yield kernel_rules.describe(name, c), _display(sel)
    yield SECTIONS["ceiling"], _display(sorted((r for r in rows if r["op"] == "ceiling"),
                                               key=key))


def render_markdown(payload: dict, cases: Sequence[Case]) -> str:
    env, rows = payload["env"], payload["rows"]
    lines = [f"# zerokern kernel benchmark: {env['device_name']} ({env['device_kind']})", "",
             common.markdown_env(env), "",
             f"Command: `{payload['command']}`; {payload['reps']} reps after "
             f"{payload['warmup']} warm-up, wall time {payload['wall_s']:.0f} s.", "",
             "- Times: median and p20/p80 over reps; providers interleaved round-robin in each "
             "rep; caches flushed before every call (CPU: read 2x LLC; CUDA: write 256 MB).",
             "- GB/s = byte floor of the case / median time (decimal GB). The floor is derived "
             "from the case's dtypes; the torch mixed path really moves >= 40 B/elem "
             "(upcast 6 + step 28 + cast-back 6), the floor credits it with 28.",
             "- % RMW / % copy: fraction of the fp32 in-place read-modify-write and copy "
             "bandwidth measured in the same rep loop at the same size. RMW is the fair ceiling "
             "on a CPU, copy on a GPU.",
             f"- Hyperparameters for every optimizer: lr {HYPER['lr']}, betas {HYPER['betas']}, "
             f"eps {HYPER['eps']}, weight decay {HYPER['weight_decay']}; torch optimizers step "
             "from prepared state (one step taken). Reference backend only at sizes <= "
             f"2^{REFERENCE_MAX_LOG2} unless named in --providers.", "",
             "## Targets", "", "| target | value | status |", "|---|---:|---|"]
    for t in payload["targets"]:
        lines.append(f"| {t['target']} | {common.fmt_value(t['value'])} | **{t['status']}** |")
    for w in payload["warnings"]:
        lines.append(f"\n**{w}**")
    for s in payload["skipped"]:
        lines.append(f"\nSkipped: {s}")
    for title, sel in sections(rows, cases):
        lines += ["", f"## {title}", "", common.markdown_table(sel, COLUMNS)]
    if payload.get("ns_rows"):
        lines += ["", f"## {kernel_rules_ns.title()}", "",
                  common.markdown_table(payload["ns_rows"], kernel_rules_ns.COLUMNS)]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict], cases: Sequence[Case], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ceil = sorted((r for r in rows if r["op"] == "ceiling"), key=lambda r: r["log2n"])
    ops = ("adam_step_", "grad_stats_")
    fig, axes = plt.subplots(len(ops), len(cases), figsize=(5.5 * len(cases), 8),
                             squeeze=False)
    for i, op in enumerate(ops):
        for j, c in enumerate(cases):
            ax = axes[i][j]
            sel = [r for r in rows if r["op"] == op and r["case"] == c.name]
            for p in PROVIDERS:
                pts = sorted((r["log2n"], r["gbps"]) for r in sel if r["provider"] == p)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=p)
            for name, style in (("rmw", "--"), ("copy", ":")):
                pts = [(r["log2n"], r["gbps"]) for r in ceil if r["provider"] == name]
                if pts:
                    ax.plot(*zip(*pts), linestyle=style, color="black", label=f"ceiling {name}")
            ax.set_title(f"{op} {c.name}")
            ax.set_xticks(sorted({r["log2n"] for r in rows}))
            ax.set_xlabel("log2(elements)")
            ax.set_ylabel("GB/s (byte floor / time)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
