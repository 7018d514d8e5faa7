"""`zerokern train`: a small GPT trained with ZeroAdamW on the Python stdlib's source.

With no arguments on a CPU machine: 2 gloo ranks, stage 2, bf16, byte-level tokens read from
the stdlib on disk (no download). On a GPU machine: one rank per GPU over NCCL. Under torchrun:
the ranks torchrun started. See `zerokern train --help`.

    config.py   the options and their validation
    data.py     the corpus and each rank's batches
    loop.py     one rank's training loop
    launch.py   spawning ranks (and making sure none can hang the command), torchrun
    report.py   the printed summary, metrics.json, loss.png
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

from .config import TrainConfig, add_arguments, default_out_dir, from_args
from .launch import RankError

__all__ = ["TrainConfig", "add_arguments", "from_args", "run"]


def run(cfg: TrainConfig, t0: Optional[float] = None) -> int:
    """Run the job; returns the exit code (0, 1 a rank failed, 2 a feature not available).

    t0: `time.perf_counter()` when the command started (for the reported wall time).
    """
    from . import launch, report

    t0 = time.perf_counter() if t0 is None else t0
    out_dir = Path(cfg.out or default_out_dir())
    torchrun = launch.under_torchrun()
    dev_type, nproc = launch.plan(cfg) if not torchrun else (launch.resolve_device(cfg), 0)
    build_s = 0.0
    if dev_type == "cpu":
        # Build the CPU kernel once here, not in every rank at once (~45 s on first use).
        from ..kernels import load_op

        tb = time.perf_counter()
        load_op("cpu")
        build_s = time.perf_counter() - tb
    try:
        if torchrun:
            res = launch.run_torchrun(cfg)
            if res is None:  # not rank 0: rank 0 reports
                return 0
        elif nproc == 1:
            res = launch.run_in_process(cfg, dev_type)
        else:
            res = launch.run_spawned(cfg, dev_type, nproc)
    except RankError as e:
        print(f"zerokern train: {e}", file=sys.stderr)
        return e.exit_code
    ranks_done = time.perf_counter()
    comm = None if res["world_size"] == 1 and not torchrun else \
        ("nccl" if dev_type == "cuda" else "gloo")
    timing = {"build_s": build_s, "startup_s": ranks_done - t0 - res["rank_s"],
              "rank_s": res["rank_s"]}
    m = report.summarize(cfg, res, timing, comm)
    report.print_summary(cfg, res, m)
    png = report.write_plot(cfg, m, out_dir)
    m["timing"].update(wall_s=time.perf_counter() - t0,
                       report_s=time.perf_counter() - ranks_done)
    metrics = report.write_metrics(m, out_dir)
    print(f"\nwrote {metrics} and {png}")
    report.print_timing(m)
    return 0
