"""The NVMe rows of `zerokern bench --offload`: offload="nvme" against the disk's own bandwidth.

In the same run, under the same directory (`--nvme-path`):
1. The disk's floor. `disk_copy` streams a file as large as one half of the step's state files
   from one region to another with the offloader's own machinery (O_DIRECT, aligned buffers,
   a thread pool of positional reads and writes, the default chunk and depth), with no compute:
   the sequential read+write bandwidth a step could at best reach. Read-only and write-only
   figures are printed beside it.
2. The offloaded step. ZeroAdamW(offload="nvme") on the GPT preset, one process: step time,
   the cpu kernel's share, the time the main thread waited for I/O, and the fraction of the
   floor = (bytes the step reads and writes / the disk's read+write bandwidth) / step time.
3. The sweep that sets the defaults: chunk size x queue depth (buffer sets), on the offloaded
   step alone (offloader.configure between runs).
"""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List

from zerokern.state import aligned_io as aio
from zerokern.state import offload_nvme as nv

from . import common


def disk_bandwidth(root: str, nbytes: int, chunk_bytes: int, depth: int) -> dict:
    """GB/s of O_DIRECT sequential read, write, and read-then-write-elsewhere (a step's
    pattern) over a file of 2 x nbytes under root."""
    nbytes = aio.align_up(nbytes, chunk_bytes)
    path = os.path.join(root, f".zerokern-bench-{os.getpid()}.bin")
    fd = aio.open_state(path, aio.direct_supported(root), create=True)
    ex = ThreadPoolExecutor(3 * depth)
    bufs = [memoryview(aio.aligned_empty(chunk_bytes, False).numpy()) for _ in range(depth)]
    try:
        os.posix_fallocate(fd, 0, 2 * nbytes)

        def run(job) -> float:
            futs = []
            t0 = time.perf_counter()
            for i, off in enumerate(range(0, nbytes, chunk_bytes)):
                if len(futs) >= depth:
                    futs.pop(0).result()
                futs.append(ex.submit(job, bufs[i % depth], off))
            for f in futs:
                f.result()
            return time.perf_counter() - t0

        def write(b, off):
            aio.pwrite_full(fd, b, nbytes + off, path)

        def write_first(b, off):
            aio.pwrite_full(fd, b, off, path)

        def read(b, off):
            aio.pread_full(fd, b, off, path)

        def copy(b, off):
            aio.pread_full(fd, b, off, path)
            aio.pwrite_full(fd, b, nbytes + off, path)

        # First touch of both halves: reading an unwritten extent returns zeros with no disk
        # I/O (an earlier version measured 7.6 GB/s "read+write" that way).
        run(write_first)
        run(write)
        out = {"write_GBps": nbytes / run(write) / 1e9, "read_GBps": nbytes / run(read) / 1e9,
               "rw_GBps": 2 * nbytes / run(copy) / 1e9, "bytes": nbytes}
        return out
    finally:
        ex.shutdown()
        os.close(fd)
        os.unlink(path)


def run(args, x, setup) -> dict:
    """setup(offload, **kw) -> (model, opt); x: the batch. Returns the payload for the report."""
    root = args.nvme_path or tempfile.gettempdir()
    m, opt = setup("nvme", offload_path=root)
    off = opt.offloader
    moved = 2 * 3 * sum(f.half for f in off.files)  # read one half, write the other

    def steps(reps: int) -> List[dict]:
        out = []
        for rep in range(reps + 1):
            opt.backward(m.loss(x[:, :-1], x[:, 1:]))
            k0, w0, b0 = off.kernel_s, off.io_wait_s, off.bytes_moved
            t0 = time.perf_counter()
            opt.step()
            dt = time.perf_counter() - t0
            opt.zero_grad()
            if rep:  # rep 0 warms up
                out.append({"step_ms": dt * 1e3, "kernel_ms": (off.kernel_s - k0) * 1e3,
                            "io_wait_ms": (off.io_wait_s - w0) * 1e3,
                            "bytes": off.bytes_moved - b0})
        return out

    def med(rows, key):
        return common.summarize([r[key] for r in rows])["median_ms"]

    base = steps(args.reps)
    disk = disk_bandwidth(root, moved // 2, nv.CHUNK_NUMEL * 4, nv.QUEUE_DEPTH)
    step_ms = med(base, "step_ms")
    floor_ms = moved / (disk["rw_GBps"] * 1e9) * 1e3
    kernel_ms = med(base, "kernel_ms")
    row = {"config": f"offload nvme (chunk {off.chunk}, depth {off.depth})",
           "step_ms": step_ms, "kernel_ms": kernel_ms,
           "io_wait_ms": med(base, "io_wait_ms"), "GB_per_step": moved / 1e9,
           "floor_ms": floor_ms, "of_floor_pct": 100 * floor_ms / step_ms,
           # with perfect overlap a step takes the longer of its I/O and its compute
           "bound_ms": max(floor_ms, kernel_ms),
           "of_bound_pct": 100 * max(floor_ms, kernel_ms) / step_ms,
           "step_GBps": moved / step_ms / 1e6}
    # Round-robin over the configurations, one step each per round (after a warm-up step), so
    # that the shared disk's drift over the run spreads over all of them alike.
    configs = [(c, d) for c in args.nvme_chunks for d in args.nvme_depths]
    times = {cfg: [] for cfg in configs}
    pools = {}
    for rnd in range(max(2, args.reps // 2)):
        for cfg in (configs if rnd % 2 == 0 else configs[::-1]):
            off.configure(chunk_numel=cfg[0], queue_depth=cfg[1])
            pools[cfg] = (off.chunk, off.host_bytes()["host_staging"] / 2**20)
            times[cfg] += [r["step_ms"] for r in steps(1)]
    sweep = []
    for (chunk, depth), ts in times.items():
        ms = common.summarize(ts)["median_ms"]
        used, pool_mib = pools[chunk, depth]
        sweep.append({"chunk_numel": chunk, "chunk_MiB_per_file": used * 4 / 2**20,
                      "depth": depth, "step_ms": ms, "of_floor_pct": 100 * floor_ms / ms,
                      "pool_MiB": pool_mib})
    off.configure()
    disk_after = disk_bandwidth(root, moved // 2, nv.CHUNK_NUMEL * 4, nv.QUEUE_DEPTH)
    rep = opt.memory_report()
    opt.close()
    return {"row": row, "disk": disk, "disk_after_sweep": disk_after, "sweep": sweep,
            "direct": off.direct, "path": root,
            "memory_report": rep}


ROW_COLS = [("config", "config"), ("step_ms", "step ms"), ("kernel_ms", "cpu kernel ms"),
            ("io_wait_ms", "waiting for I/O ms"), ("GB_per_step", "GB read+written"),
            ("floor_ms", "disk floor ms"), ("of_floor_pct", "% of floor"),
            ("bound_ms", "max(floor, kernel) ms"), ("of_bound_pct", "% of that"),
            ("step_GBps", "GB/s")]
SWEEP_COLS = [("chunk_numel", "chunk (elements)"), ("chunk_MiB_per_file", "MiB per request"),
              ("depth", "buffer sets"), ("pool_MiB", "host pool MiB"), ("step_ms", "step ms"),
              ("of_floor_pct", "% of floor")]


def report(res: dict) -> List[str]:
    d = res["disk"]
    common.print_table([res["row"]], ROW_COLS, "offload='nvme': the step against the disk")
    common.print_table(res["sweep"], SWEEP_COLS, "offload='nvme': chunk x queue-depth sweep")
    lines = [f"- disk under {res['path']} ({'O_DIRECT' if res['direct'] else 'buffered'}), "
             f"{d['bytes'] / 2**20:.0f} MiB per pass: read {d['read_GBps']:.2f} GB/s, write "
             f"{d['write_GBps']:.2f} GB/s, read+write (a step's pattern) {d['rw_GBps']:.2f} GB/s",
             f"- NVMe step: {res['row']['step_ms']:.0f} ms for {res['row']['GB_per_step']:.2f} GB "
             f"moved; the floor at {d['rw_GBps']:.2f} GB/s is {res['row']['floor_ms']:.0f} ms: "
             f"{res['row']['of_floor_pct']:.0f}% of the disk's bandwidth; the cpu kernel alone "
             f"takes {res['row']['kernel_ms']:.0f} ms, so perfect overlap would give "
             f"{res['row']['bound_ms']:.0f} ms ({res['row']['of_bound_pct']:.0f}% reached)",
             f"- the disk measured again after the sweep: read+write "
             f"{res['disk_after_sweep']['rw_GBps']:.2f} GB/s (a shared virtual disk drifts; the "
             "sweep's % of floor uses the first figure)"]
    for ln in lines:
        print(ln)
    return ["## offload='nvme'", "", common.markdown_table([res["row"]], ROW_COLS), "", *lines,
            "", "### chunk size x queue depth", "", common.markdown_table(res["sweep"], SWEEP_COLS),
            ""]
