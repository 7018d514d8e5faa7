"""The chaos benchmark (issue 39): SIGKILL ranks of `zerokern train` under torchrun
--max-restarts on a seeded schedule; the run must end bitwise equal to an uninterrupted one.

    python benchmarks/chaos.py                    # 200 steps, 6 kills (one mid-save)
    python benchmarks/chaos.py --seed 7           # another schedule (the seed is printed)
    python benchmarks/chaos.py --quick            # 40 steps, 2 kills (tests/test_chaos.py)
    python benchmarks/chaos.py --resize-to 3      # one restart at 3 ranks, global batch kept
    python benchmarks/chaos.py --offload nvme     # state in files; one kill mid NVMe write

What it does and checks: zerokern/bench/chaos.py [Note: the chaos run] and, with --resize-to,
[Note: a restart at another world size], with --offload nvme [Note: a mid-write kill].
Results: benchmarks/results/chaos-<date>.{json,md} (chaos-quick-<date>.* with --quick,
chaos-resize<N>-<date>.* with --resize-to, chaos-nvme-<date>.* with --offload nvme); the run's files
(checkpoints, each rank's events, torchrun's log) under --work (default a temporary dir).
Exit code 0 when every check passed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

from zerokern.bench import chaos
from zerokern.bench.common import environment, write_json, write_text

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kills", type=int, default=6)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=None, help="default: drawn, and printed")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--monitor-interval", type=float, default=chaos.MONITOR_S,
                   help="torchrun's --monitor-interval (default %(default)g s: "
                        "zerokern/bench/chaos.py MONITOR_S)")
    p.add_argument("--resize-to", type=int, default=None, metavar="N",
                   help="one kill ends the 2-rank job and it restarts on N ranks (with "
                        "--global-batch: default batch x lcm(2, N))")
    p.add_argument("--global-batch", type=int, default=None,
                   help="zerokern train --global-batch (default with --resize-to: "
                        "batch x lcm(2, N))")
    p.add_argument("--offload", choices=["none", "cpu", "nvme"], default="none",
                   help="zerokern train --offload; nvme: one kill of the schedule lands in an "
                        "NVMe state write, one mid-save (default none)")
    p.add_argument("--quick", action="store_true", help="40 steps, 2 kills, seq 64, batch 8")
    p.add_argument("--work", default=None, help="the runs' directory (default: a temp dir)")
    p.add_argument("--no-write", action="store_true", help="do not write benchmarks/results")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.kills, a.seq, a.batch = 40, 2, 64, 8
    offload = None if a.offload == "none" else a.offload
    if offload == "nvme" and a.kills < 2:
        p.error(f"--offload nvme needs --kills >= 2 (one mid-save, one mid-write), got {a.kills}")
    if a.resize_to is not None and a.global_batch is None:
        a.global_batch = a.batch * 2 * a.resize_to // math.gcd(2, a.resize_to)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"chaos: seed {seed} (rerun with --seed {seed})", flush=True)
    work = Path(a.work or tempfile.mkdtemp(prefix="zerokern-chaos-"))
    load_start = os.getloadavg()  # the machine is shared: the load goes with the result
    r = chaos.run_chaos(work, a.steps, a.save_every, a.kills, seed, seq=a.seq, batch=a.batch,
                        monitor_s=a.monitor_interval, log=lambda m: print(m, flush=True),
                        resize_to=a.resize_to, global_batch=a.global_batch, offload=offload)
    r["load_avg"] = {"start": [round(x, 2) for x in load_start],
                     "end": [round(x, 2) for x in os.getloadavg()]}
    env = environment(torch.device("cpu"))
    md = chaos.markdown(r, env)
    print(md)
    if not a.no_write:
        resize = f"-resize{a.resize_to}" if a.resize_to else ""
        off = f"-{offload}" if offload else ""
        stem = f"chaos{off}{'-quick' if a.quick else ''}{resize}-{_dt.date.today():%Y%m%d}"
        write_json(RESULTS / f"{stem}.json", {"env": env, "result": r})
        write_text(RESULTS / f"{stem}.md", md)
        print(f"wrote {RESULTS / stem}.{{json,md}}")
    ok = r["exit_code"] == 0 and r["final_bitwise_equal"] and r["bytes_lost"] == 0 and \
        r["kills_survived"] == a.kills
    if offload == "nvme":  # both kinds landed, and no killed rank's state files stayed
        ok = ok and {"mid-save", "mid-write"} <= {k["kind"] for k in r["kills"]} and \
            not r["nvme_files_left"]
    if a.resize_to is not None:
        z = r["resize"] or {}
        ok = ok and z.get("after_bitwise_equal") is True and z.get("before_bytes_differ") == 0 \
            and z.get("global_batch_kept_logged") is True
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
