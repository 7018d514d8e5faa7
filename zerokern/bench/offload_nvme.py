"""The NVMe rows of `zerokern bench --offload`: offload="nvme" against the disk probe.

In the same run, under the same directory (`--nvme-path`):
1. The offloaded step against the disk. ZeroAdamW(offload="nvme") on the GPT preset, one
   process, two warm-up steps (both halves of every file written), then probe, step, probe,
   ..., step, probe: the probe (disk_probe.py) replays the step's own I/O on its own files with
   no compute. Reported: step time, the cpu kernel's share, the time the main thread waited for
   I/O, the probe's time and GB/s (median, min-max), and the step's GB/s as a fraction of the
   probes around it (disk_probe.paired).
2. The sweep that sets the defaults: chunk size x queue depth (buffer sets), round-robin, each
   configuration's step beside a probe of that configuration's own pattern.
"""

from __future__ import annotations

import tempfile
import time
from typing import List

from . import common
from . import disk_probe as dp


def run(args, x, setup) -> dict:
    """setup(offload, **kw) -> (model, opt); x: the batch. Returns the payload for the report."""
    root = args.nvme_path or tempfile.gettempdir()
    m, opt = setup("nvme", offload_path=root)
    off = opt.offloader

    def steps(reps: int, warm: int) -> List[dict]:
        out = []
        for rep in range(warm + reps):
            opt.backward(m.loss(x[:, :-1], x[:, 1:]))
            k0, w0, b0 = off.kernel_s, off.io_wait_s, off.bytes_moved
            t0 = time.perf_counter()
            opt.step()
            dt = time.perf_counter() - t0
            opt.zero_grad()
            if rep >= warm:
                out.append({"step_ms": dt * 1e3, "kernel_ms": (off.kernel_s - k0) * 1e3,
                            "io_wait_ms": (off.io_wait_s - w0) * 1e3,
                            "bytes": off.bytes_moved - b0})
        return out

    def med(rows, key):
        return common.summarize([r[key] for r in rows])["median_ms"]

    steps(0, warm=2)  # both halves of every file written (disk_probe [Note: borrowing ...])
    files = dp.ProbeFiles.borrow(off)
    pattern = dp.pattern_of(off)
    moved = pattern.bytes_per_step
    probes = [dp.replay(files, pattern)]
    base = []
    for _ in range(args.reps):
        base += steps(1, warm=0)
        probes.append(dp.replay(files, pattern))
    probe_ms = [p["seconds"] * 1e3 for p in probes]
    frac = dp.fraction([moved / r["step_ms"] / 1e6 for r in base],
                       [p["GBps"] for p in probes], pattern.direct)
    step_ms, probe_med = med(base, "step_ms"), common.summarize(probe_ms)["median_ms"]
    row = {"config": f"offload nvme (chunk {off.chunk}, depth {off.depth})",
           "step_ms": step_ms, "kernel_ms": med(base, "kernel_ms"),
           "io_wait_ms": med(base, "io_wait_ms"), "GB_per_step": moved / 1e9,
           "probe_ms": probe_med, "probe_min_ms": min(probe_ms), "probe_max_ms": max(probe_ms),
           "of_probe_pct": frac["paired"]["median"], "of_probe_min_pct": frac["paired"]["min"],
           "of_probe_max_pct": frac["paired"]["max"], "step_GBps": moved / step_ms / 1e6}
    # Round-robin over the configurations, one warm-up and one timed step each per round, and
    # a probe of that configuration's own pattern, so that the shared disk's drift over the
    # run spreads over all of them alike.
    configs = [(c, d) for c in args.nvme_chunks for d in args.nvme_depths]
    times = {cfg: [] for cfg in configs}
    ptimes = {cfg: [] for cfg in configs}
    pools = {}
    for rnd in range(max(2, args.reps // 2)):
        for cfg in (configs if rnd % 2 == 0 else configs[::-1]):
            off.configure(chunk_numel=cfg[0], queue_depth=cfg[1])
            pools[cfg] = (off.chunk, off.host_bytes()["host_staging"] / 2**20)
            times[cfg] += [r["step_ms"] for r in steps(1, warm=1)]
            ptimes[cfg].append(dp.replay(files, dp.pattern_of(off))["seconds"] * 1e3)
    sweep = []
    for (chunk, depth), ts in times.items():
        ms = common.summarize(ts)["median_ms"]
        pms = common.summarize(ptimes[chunk, depth])["median_ms"]
        used, pool_mib = pools[chunk, depth]
        sweep.append({"chunk_numel": chunk, "chunk_MiB_per_file": used * 4 / 2**20,
                      "depth": depth, "step_ms": ms, "probe_ms": pms,
                      "of_probe_pct": 100 * pms / ms, "pool_MiB": pool_mib})
    off.configure()
    rep = opt.memory_report()
    opt.close()
    return {"row": row, "probe_GBps": dp.spread([p["GBps"] for p in probes]),
            "fraction": frac, "sweep": sweep, "direct": off.direct, "path": root,
            "pattern": {"request_MiB": pattern.chunk * 4 / 2**20, "in_flight": pattern.in_flight,
                        "files": sum(map(len, pattern.specs))},
            "memory_report": rep}


ROW_COLS = [("config", "config"), ("step_ms", "step ms"), ("kernel_ms", "cpu kernel ms"),
            ("io_wait_ms", "waiting for I/O ms"), ("GB_per_step", "GB read+written"),
            ("probe_ms", "disk probe ms"), ("of_probe_pct", "% of probe"),
            ("step_GBps", "GB/s")]
SWEEP_COLS = [("chunk_numel", "chunk (elements)"), ("chunk_MiB_per_file", "MiB per request"),
              ("depth", "buffer sets"), ("pool_MiB", "host pool MiB"), ("step_ms", "step ms"),
              ("probe_ms", "its probe ms"), ("of_probe_pct", "% of its probe")]


def report(res: dict) -> List[str]:
    """Print the tables and the summary lines; return the markdown lines."""
    r, p, f, pat = res["row"], res["probe_GBps"], res["fraction"], res["pattern"]
    common.print_table([r], ROW_COLS, "offload='nvme': the step against the disk probe")
    common.print_table(res["sweep"], SWEEP_COLS, "offload='nvme': chunk x queue-depth sweep")
    io = "O_DIRECT" if res["direct"] else "buffered + fadvise(DONTNEED): O_DIRECT unavailable"
    lines = [f"- disk probe under {res['path']} ({io}): the step's own I/O ({pat['files']} "
             f"files, {pat['request_MiB']:.0f} MiB requests, at most {pat['in_flight']} in "
             f"flight) with no compute, interleaved with the steps: {p['median']:.2f} GB/s "
             f"median ({p['min']:.2f}-{p['max']:.2f}, n={p['n']}), {r['probe_ms']:.0f} ms "
             f"({r['probe_min_ms']:.0f}-{r['probe_max_ms']:.0f})",
             f"- NVMe step: {r['step_ms']:.0f} ms for {r['GB_per_step']:.2f} GB moved; against "
             f"the probes around it: {r['of_probe_pct']:.0f}% ({r['of_probe_min_pct']:.0f}-"
             f"{r['of_probe_max_pct']:.0f}%); the cpu kernel alone takes "
             f"{r['kernel_ms']:.0f} ms" + (f"; {f['note']}" if f["note"] else ""),
             "- the sweep's probe replays each configuration's own pattern (its request size "
             "and buffer sets)"]
    for ln in lines:
        print(ln)
    return ["## offload='nvme'", "", common.markdown_table([r], ROW_COLS), "", *lines,
            "", "### chunk size x queue depth", "", common.markdown_table(res["sweep"], SWEEP_COLS),
            ""]
