"""A replaced replica joins a running HSDP job (issue 39), against a restart from the last
checkpoint: the time from a SIGKILL until the job trains on, and bitwise checks.

    python benchmarks/replica_join.py                  # 2 replicas x 2 ranks, 40 steps
    python benchmarks/replica_join.py --model-size 20m --steps 20 --kill-at 8

What it does and checks: zerokern/bench/replica_join.py [Note: the replica-join run].
Results: benchmarks/results/replica-join-<size>-<date>.{json,md}. Exit code 0 when every
check passed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import tempfile
from pathlib import Path

import torch

from zerokern.bench import replica_join
from zerokern.bench.common import environment, write_json, write_text

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=17)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--backend", default="auto",
                   help="the optimizer's kernels (reference: no C++ build in the restarts)")
    p.add_argument("--join-attempts", type=int, default=3,
                   help="run the join again after a torn attempt (zerokern/bench/"
                        "replica_join.py [Note: a torn attempt]), up to this many in all")
    p.add_argument("--work", default=None, help="the runs' directory (default: a temp dir)")
    p.add_argument("--no-write", action="store_true", help="do not write benchmarks/results")
    a = p.parse_args(argv)
    work = Path(a.work or tempfile.mkdtemp(prefix="zerokern-replica-join-"))
    r = replica_join.run(work, replicas=a.replicas, shards=a.shards, steps=a.steps,
                         kill_at=a.kill_at, save_every=a.save_every, seq=a.seq, batch=a.batch,
                         model_size=a.model_size, backend=a.backend,
                         join_attempts=a.join_attempts, log=lambda m: print(m, flush=True))
    env = environment(torch.device("cpu"))
    md = replica_join.markdown(r, env)
    print(md)
    if not a.no_write:
        stem = f"replica-join-{a.model_size}-{a.backend}-{_dt.date.today():%Y%m%d}"
        write_json(RESULTS / f"{stem}.json", {"env": env, "result": r})
        write_text(RESULTS / f"{stem}.md", md)
        print(f"wrote {RESULTS / stem}.{{json,md}}")
    j, rs = r["join"], r["restart"]
    ok = j["bitwise_equal"] and j["replicas_equal"] and j["live_ranks_never_restarted"] and \
        rs["final_bitwise_equal"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
