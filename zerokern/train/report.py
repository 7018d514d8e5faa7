"""The end of `zerokern train`: the summary printed, `metrics.json` and `loss.png` written.

Memory per rank is what `opt.memory_report()` measured on each rank, beside zerokern's exact
estimate for the same model (`zerokern.accounting.estimate`, which must agree to the byte),
the DESIGN §4
formula at this stage and at stage 0 (`estimate_memory(..., stage=0)`), and, with --compare,
what stage 0 really held. Communication is bytes sent per rank per step (`opt.comm_stats()`)
against DESIGN §5's ring volume.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from zerokern.accounting.estimate import (
    categories,
    estimate,
    estimate_pipeline,
    host_categories,
    spec_from_model,
)
from zerokern.memory.formula import estimate_memory
from zerokern.options.args import elem_size
from zerokern.platform.device import handle
from zerokern.platform.host import cpu_model
from zerokern.tools.tables import print_table

from .config import TrainConfig
from .loop import build_model

MAX_RANK_COLUMNS = 4  # more ranks: rank 0 and the largest total are shown

def _rule(cfg: TrainConfig):
    """The run's optimizer rule: ZeroAdamW's, 8-bit with --state-bits 8."""
    from zerokern.rules.registry import rule_by_name

    return rule_by_name("adamw8bit" if cfg.state_bits == 8 else "adamw")


def host_rows(cfg: TrainConfig) -> Dict[str, str]:
    """memory_report()["host_measured"] category -> its row (offload); the formula's master
    and moments are host bytes with offload, so they go on these rows."""
    return {c: "host " + c.replace("host_", "") for c in host_categories(_rule(cfg))}


def _unit(nbytes: float) -> tuple:
    """(name, scale) that shows `nbytes` with a few significant digits."""
    return ("MiB", 2**20) if nbytes >= 10 * 2**20 else ("KiB", 2**10)


def exact_estimate(cfg: TrainConfig, world: int, comm: str) -> Optional[Dict[str, Any]]:
    """zerokern.accounting.estimate for this run's model (on meta), at its stage and offload.
    With --mesh PPxTPxDP: rank 0's pipeline stage (`stage_estimates` has every stage), None
    with tp > 1 (estimate counts whole params, not a DTensor's local shards)."""
    if cfg.mesh is not None and len(cfg.mesh) == 3:
        stages = stage_estimates(cfg, world, comm)
        return None if stages is None else stages[0]
    with torch.device("meta"):
        model = build_model(cfg, torch.device("meta"))
    return estimate(spec_from_model(model, f"gpt {cfg.model_size}"), world, cfg.stage,
                    cfg.precision, cfg.bucket_mb, cfg.offload, comm=comm,
                    optimizer=_rule(cfg), mesh=cfg.mesh, hpz=cfg.hpz)


def stage_estimates(cfg: TrainConfig, world: int, comm: str) -> Optional[List[Dict[str, Any]]]:
    """--mesh PPxTPxDP: `estimate_pipeline` of the GPT's stages (train/pipeline.py), one per
    stage, for dp rank 0; None with tp > 1."""
    from .pipeline import stage_specs

    pp, tp, dp = cfg.mesh
    if tp > 1:
        return None
    return estimate_pipeline(stage_specs(cfg), pp * dp, cfg.stage, cfg.precision,
                             cfg.bucket_mb, cfg.offload, comm=comm, optimizer=_rule(cfg))


def _figures(m: Dict[str, Any], cfg: TrainConfig) -> Dict[str, Any]:
    """memory_report() / estimate() as {row: bytes}: the device categories, then the host
    ones (offload) and the live-unit bound (stage 3) where the run has them. A report has
    `measured`, an estimate `bytes`."""
    dev = m["measured"] if "measured" in m else m["bytes"]
    out = {c: dev[c] for c in categories(_rule(cfg))}
    if "hpz_secondary" in dev:  # --hpz: the node copies (stage3/hpz.py)
        out["hpz_secondary"] = dev["hpz_secondary"]
    out["total"] = m["measured_total"] if "measured" in m else m["device_total"]
    host = m.get("host_measured") if "measured" in m else (m["host"] if m["offload"] else None)
    if host is not None:
        out.update({row: host[c] for c, row in host_rows(cfg).items()})
        out["host total"] = sum(host.values())
    if m.get("live_units_bound") is not None:
        out["live units bound"] = m["live_units_bound"]
    return out


def memory_rows(cfg: TrainConfig, res: Dict[str, Any], est: Optional[dict],
                scale: float) -> List[dict]:
    """One row per memory_report category, values in units of `scale` bytes."""
    def _mib(b: Optional[float]) -> Optional[float]:
        return None if b is None else b / scale

    reports = res["main"]["memory_reports"]
    world = len(reports)
    show = list(range(world)) if world <= MAX_RANK_COLUMNS else \
        [0, max(range(world), key=lambda r: reports[r]["measured_total"])]
    psi = reports[0]["num_params"]
    f = reports[0]["formula"]
    f0 = estimate_memory(psi, world, 0, cfg.precision)
    cmp = res.get("compare")
    figs = [_figures(reports[r], cfg) for r in range(world)]
    est_figs = _figures(est, cfg) if est is not None else None
    cmp_figs = _figures(cmp["memory_reports"][0], cfg) if cmp else None
    rows_of = host_rows(cfg)
    rows = []
    for cat in figs[0]:
        if cat == "live_units" and cfg.stage != 3:
            continue  # gathered stage-3 units only (compared all the same)
        row = {"category": cat}
        for r in show:
            row[f"rank{r}"] = _mib(figs[r][cat])
        if est_figs is not None:
            row["estimate"] = _mib(est_figs.get(cat))
        host_cat = {row: c for c, row in rows_of.items()}.get(cat)
        if cat == "host total":
            row["formula"] = _mib(f["host"])
        elif host_cat is not None:
            row["formula"] = _mib(f.get(host_cat))
        elif cfg.offload and cat in rows_of and cat != "host_staging":
            row["formula"] = None  # the formula's figure is on the host row
        else:
            row["formula"] = _mib(f.get(cat))
        row["stage0_formula"] = None if cat.startswith("host ") else _mib(f0.get(cat))
        if cmp_figs is not None:
            row["stage0_measured"] = _mib(cmp_figs.get(cat))
        rows.append(row)
    return rows


def memory_columns(rows: List[dict], stage: int, unit: str) -> List[tuple]:
    cols = [("category", f"{unit} per rank")]
    cols += [(k, f"rank {k[4:]} measured") for k in rows[0] if k.startswith("rank")]
    if "estimate" in rows[0]:
        cols.append(("estimate", "zerokern estimate"))
    cols += [("formula", f"§4 formula stage {stage}"), ("stage0_formula", "§4 formula stage 0")]
    if "stage0_measured" in rows[0]:
        cols.append(("stage0_measured", "stage 0 measured"))
    return cols


def comm_formula_bytes(psi: int, world: int, stage: int, precision: str) -> float:
    """DESIGN §5: about 2Ψ(N-1)/N elements per rank per step (3Ψ(N-1)/N at stage 3)."""
    e = elem_size(precision)
    return (3 if stage == 3 else 2) * psi * (world - 1) / world * e


def estimate_matches(res: Dict[str, Any], est: Optional[dict],
                     cfg: Optional[TrainConfig] = None) -> Optional[bool]:
    """Rank 0's report equals the estimate in every device category, and in every host one
    (offload) and the live-unit bound (stage 3)."""
    if est is None:
        return None
    cfg = TrainConfig() if cfg is None else cfg
    return _figures(res["main"]["memory_reports"][0], cfg) == _figures(est, cfg)


def summarize(cfg: TrainConfig, res: Dict[str, Any], timing: Dict[str, float],
              comm_backend: str) -> Dict[str, Any]:
    """Everything `metrics.json` holds."""
    main, world = res["main"], res["world_size"]
    est = exact_estimate(cfg, world, "gloo" if comm_backend == "gloo" else "nccl")
    psi = main["num_params"]  # (--mesh PPxTPxDP: rank 0's stage, over its dp ranks)
    three_d = cfg.mesh is not None and len(cfg.mesh) == 3
    dp_world = cfg.mesh[2] if three_d else world
    out = {
        "config": cfg.to_dict(), "world_size": world, "device": res["device"],
        "comm_backend": comm_backend, "num_params": psi,
        "env": {"torch": torch.__version__, "python": platform.python_version(),
                "cpu": cpu_model(),
                "gpu": handle(res["device"]).name(0) if not res["device"].startswith("cpu")
                else None},
        "corpus_bytes": res["corpus_bytes"],
        "loss": {k: main[k] for k in ("loss_first", "loss_last", "loss_final")},
        "loss_curve": main["loss_curve"],
        "tokens_per_step": main["tokens_per_step"], "tokens_per_s": main["tokens_per_s"],
        "memory": {"per_rank": main["memory_reports"],
                   "estimate": est,
                   "estimate_matches_rank0": estimate_matches(res, est, cfg),
                   "formula_stage0": estimate_memory(psi, dp_world, 0, cfg.precision),
                   "estimate_per_stage": stage_estimates(
                       cfg, world, "gloo" if comm_backend == "gloo" else "nccl")
                   if three_d else None},
        "comm_per_step": main["comm_per_step"],
        "comm_calls_per_step": main["comm_calls_per_step"],
        "dims": main["dims"],  # group sizes by role ({"shard", "replicate", "world"[, "hpz"]})
        "comm_per_dim_per_step": main["comm_per_dim_per_step"],
        "comm_formula_bytes_per_step": comm_formula_bytes(psi, dp_world, cfg.stage,
                                                          cfg.precision),
        "pipeline": main.get("pipeline"),
        "timing": {**timing, "train_s": main["train_s"]},
        "compare": None,
    }
    cmp = res.get("compare")
    if cmp:
        diffs = [abs(a - b) for a, b in zip(main["loss_curve"], cmp["loss_curve"])]
        out["compare"] = {"stage": 0, "loss_first": cmp["loss_first"],
                          "loss_final": cmp["loss_final"], "loss_curve": cmp["loss_curve"],
                          "max_abs_loss_diff": max(diffs), "train_s": cmp["train_s"],
                          "memory_per_rank": cmp["memory_reports"],
                          "comm_per_step": cmp["comm_per_step"]}
    return out


def print_summary(cfg: TrainConfig, res: Dict[str, Any], m: Dict[str, Any]) -> None:
    main, world = res["main"], m["world_size"]
    print(f"\nzerokern train: GPT {cfg.model_size} ({m['num_params'] / 1e6:.2f}M params, byte "
          f"vocab), stage {cfg.stage}, {cfg.precision}, {world} rank(s) on {m['device']} "
          f"({m['comm_backend'] or 'no process group'}), {cfg.steps} steps of "
          f"{main['tokens_per_step']:,} tokens")
    print(f"loss: {main['loss_first']:.3f} -> {main['loss_final']:.3f} (first step -> mean of "
          f"the last {min(10, cfg.steps)} steps; last step {main['loss_last']:.3f})")
    c = m["compare"]
    if c:
        print(f"stage 0 (--compare, same seed and data): {c['loss_first']:.3f} -> "
              f"{c['loss_final']:.3f}; largest per-step loss difference "
              f"{c['max_abs_loss_diff']:.2e}")
    est = m["memory"]["estimate"]
    unit, scale = _unit(main["memory_reports"][0]["measured_total"])
    rows = memory_rows(cfg, res, est, scale)
    print_table(rows, memory_columns(rows, cfg.stage, unit), "\nmemory per rank (model states "
                "and communication buffers, opt.memory_report())")
    if est is not None:
        ok = m["memory"]["estimate_matches_rank0"]
        verdict = "equal in every category" if ok else "DIFFERENT (a bug: please report it)"
        print("zerokern.accounting.estimate (this model on the meta device) vs rank 0 "
              f"measured: {verdict}")
    cps = m["comm_per_step"]
    crow = [{"kind": k, "bytes": int(cps[k]), "calls": m["comm_calls_per_step"].get(k)}
            for k in ("all_reduce", "reduce_scatter", "all_gather", "total")]
    crow.append({"kind": "§5 formula 2Ψ(N-1)/N", "bytes": int(m["comm_formula_bytes_per_step"])})
    print_table(crow, [("kind", "collective"), ("bytes", "bytes sent per step"),
                       ("calls", "calls per step")],
                f"\ncommunication per rank per step (opt.comm_stats(), {world} ranks)")


def print_timing(m: Dict[str, Any]) -> None:
    t, tok_s = m["timing"], m["tokens_per_s"]
    print(f"time: {t['wall_s']:.1f} s since the command started: start-up {t['startup_s']:.1f} "
          f"s (kernel build {t['build_s']:.1f} s, rank spawn), training {t['train_s']:.1f} s at "
          f"{tok_s:,.0f} tokens/s, report {t['report_s']:.1f} s")


def plot_loss(m: Dict[str, Any], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    curves = [(f"stage {m['config']['stage']}", m["loss_curve"])]
    if m["compare"]:
        curves.append(("stage 0 (--compare)", m["compare"]["loss_curve"]))
    for (label, ys), style in zip(curves, ("-", "--")):
        ax.plot(range(1, len(ys) + 1), ys, style, label=label, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte, mean over ranks)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plot(cfg: TrainConfig, m: Dict[str, Any], out_dir: Path) -> Path:
    title = (f"zerokern train: GPT {cfg.model_size}, stage {cfg.stage}, {cfg.precision}, "
             f"{m['world_size']} rank(s), {m['device']}")
    return plot_loss(m, out_dir / "loss.png", title)


def write_metrics(m: Dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "metrics.json"
    path.write_text(json.dumps(m, indent=1, default=str) + "\n")
    return path
