"""Checkpoint benchmark: save / load / consolidate throughput and peak RAM on the CPU.

    python benchmarks/bench_checkpoint.py            # GPT 100m (112M params), 1 and 2 ranks
    python benchmarks/bench_checkpoint.py --quick    # GPT small, for smoke runs
    python benchmarks/bench_checkpoint.py --async-stall   # async save's step stall (issue 39)
    python benchmarks/bench_checkpoint.py --heal   # replica recovery vs a load (issue 39)
    python benchmarks/bench_checkpoint.py --help

--async-stall: the time an async save holds the training thread (the save() call, then the
next opt.step()'s wait for the staging copy; zerokern/checkpoint/async_save.py [Note:
asynchronous saves]) against a synchronous save's time, per repetition in one process, at 1
rank and 2 ranks (stage 2), with a real training step after each save. Results:
benchmarks/results/checkpoint-async-cpu.{json,md}.

--heal: on 4 gloo ranks, a 2x2 (replicate, shard) HSDP mesh at stage 2, the time of
`zerokern.checkpoint.recover_from_replica` (replica 1's state rebuilt from replica 0's over the
replicate group, checksummed after) against `zerokern.checkpoint.load` of the same state from
the latest checkpoint (every rank, the first cold), and the model + optimizer build that a
restart also repeats. Results: benchmarks/results/checkpoint-heal-cpu.{json,md}.

Every phase runs in a fresh process, so its peak resident set is its own:
- RssAnon is sampled every 2 ms from /proc/self/status (anonymous memory: what the process
  really allocates); "extra" is the peak minus the value just before the phase (after the
  model and optimizer exist). For consolidate-to-dict the output itself is subtracted too.
- ru_maxrss (VmHWM) is reported as well: it also counts file pages the process has mapped,
  i.e. page cache touched through memory maps, which the kernel can drop at any time.
The state is the optimizer's own buffers with random moments (no training step is needed to
time I/O). The model is zerokern.tools.gpt preset "100m", ZeroAdamW precision bf16 (fp32 master,
exp_avg, exp_avg_sq: 12 bytes per param on disk). Cold loads drop this benchmark's own files
from the page cache first (posix_fadvise DONTNEED, nothing global). Peers in the same run:
torch.save / torch.load of the same tensors (one file, no sharding, no checksums).

Results: benchmarks/results/checkpoint-cpu.{json,md} (checkpoint-cpu-quick.* with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zerokern as zk  # noqa: E402
from zerokern.bench import common  # noqa: E402
from zerokern.checkpoint.views import optimizer_view  # noqa: E402
from zerokern.tools.gpt import build_gpt  # noqa: E402

GB = 1e9


# ---- measurement -------------------------------------------------------------------------------
def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


class MemSampler:
    """Peak RssAnon / VmRSS while running, sampled every 2 ms on a thread."""

    def __init__(self) -> None:
        self.base = _status()
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            for k, v in _status().items():
                self.peak[k] = max(self.peak[k], v)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        for k, v in _status().items():
            self.peak[k] = max(self.peak[k], v)

    def report(self, minus: int = 0) -> dict:
        return {"base_anon_mb": self.base["RssAnon"] / 2**20,
                "extra_anon_mb": (self.peak["RssAnon"] - self.base["RssAnon"] - minus) / 2**20,
                "extra_rss_mb": (self.peak["VmRSS"] - self.base["VmRSS"] - minus) / 2**20,
                "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _dir_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def _drop_cache(path: str) -> None:
    """Evict this benchmark's own files from the page cache (clean pages only)."""
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in os.listdir(path)]
    for fn in files:
        fd = os.open(fn, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _build(size: str, stage: int, seed: int):
    torch.manual_seed(seed)
    model = build_gpt(size, seed=seed)
    opt = zk.ZeroAdamW(model, stage=stage, precision="bf16", backend="reference")
    g = torch.Generator().manual_seed(seed)
    # Moments as after training: random and nonzero, in the params' elements only (padding
    # stays zero, as the optimizer keeps it, so the sums below compare across layouts).
    for piece in optimizer_view(model, opt).held:
        piece.exp_avg.copy_(torch.randn(piece.exp_avg.shape, generator=g))
        piece.exp_avg_sq.copy_(torch.rand(piece.exp_avg_sq.shape, generator=g))
    return model, opt


def _fingerprint(opt) -> list:
    """Sums of master, exp_avg, exp_avg_sq over all ranks (collective): a load must match
    the save (to float64 rounding: the sums run in another order after a reshard)."""
    t = torch.zeros(3, dtype=torch.float64)
    for fg in opt.flat_groups:
        for i, buf in enumerate((fg.master, fg.exp_avg, fg.exp_avg_sq)):
            t[i] += buf.double().sum()
    if opt.stage > 0 and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def _same_sums(a, b) -> bool:
    return all(abs(x - y) <= 1e-9 * max(abs(y), 1.0) for x, y in zip(a, b))


# ---- phases (each in a fresh process) ----------------------------------------------------------
def _timed(fn, reps: int):
    out = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        if dist.is_initialized():
            dist.barrier()
        out.append(time.perf_counter() - t0)
    return out


def phase_save(a, rank=0):
    model, opt = _build(a.model, a.stage, seed=1)
    with MemSampler() as mem:
        secs = _timed(lambda: zk.checkpoint.save(a.dir, model, opt), a.reps)
    return {"secs": secs, "bytes": _dir_bytes(a.dir), "mem": mem.report(),
            "fingerprint": _fingerprint(opt)}


def phase_load(a, rank=0):
    model, opt = _build(a.model, a.stage, seed=2)
    secs = []
    with MemSampler() as mem:
        for cold in [True] + [False] * (a.reps - 1):
            if cold and rank == 0:
                _drop_cache(a.dir)
            secs += _timed(lambda: zk.checkpoint.load(a.dir, model, opt), 1)
    return {"secs": secs, "cold_first": True, "bytes": _dir_bytes(a.dir), "mem": mem.report(),
            "fingerprint": _fingerprint(opt)}


def phase_consolidate(a, rank=0):
    with MemSampler() as mem:
        t0 = time.perf_counter()
        sd = zk.checkpoint.consolidate(a.dir)
        secs = [time.perf_counter() - t0]
    out_bytes = sum(t.nbytes for t in {id(t): t for t in sd.values()}.values())
    return {"secs": secs, "bytes": out_bytes, "mem": mem.report(minus=out_bytes),
            "read_bytes": _master_bytes(a.dir)}


def phase_consolidate_file(a, rank=0):
    out = os.path.join(os.path.dirname(a.dir), f"model-{a.dtype}.safetensors")
    with MemSampler() as mem:
        t0 = time.perf_counter()
        zk.checkpoint.consolidate(a.dir, out, dtype=a.dtype)
        secs = [time.perf_counter() - t0]
    n = os.path.getsize(out)
    os.remove(out)
    return {"secs": secs, "bytes": n, "mem": mem.report(), "read_bytes": _master_bytes(a.dir)}


def _master_bytes(d: str) -> int:
    """Bytes consolidate reads: the master sections of the rank files."""
    meta = zk.checkpoint.format.read_meta(d)
    return sum(f["sections"]["exp_avg"] - f["sections"]["master"]
               for f in meta["files"].values() if "sections" in f)


def _file_writes(fn: str, write, reps: int) -> dict:
    with MemSampler() as mem:
        secs = _timed(write, reps)
    return {"secs": secs, "bytes": os.path.getsize(fn), "mem": mem.report()}


def _file_reads(fn: str, read, reps: int) -> dict:
    """read() timed cold (fn dropped from the page cache), then warm; fn removed after."""
    secs = []
    with MemSampler() as mem:
        for cold in [True] + [False] * (reps - 1):
            if cold:
                _drop_cache(fn)
            t0 = time.perf_counter()
            read()
            secs.append(time.perf_counter() - t0)
    n = os.path.getsize(fn)
    os.remove(fn)
    return {"secs": secs, "cold_first": True, "bytes": n, "mem": mem.report()}


def phase_torch_save(a, rank=0):
    model, opt = _build(a.model, 0, seed=1)
    fn = a.dir + ".pt"
    obj = {"model": model.state_dict(),
           "opt": [{"master": g.master, "exp_avg": g.exp_avg, "exp_avg_sq": g.exp_avg_sq}
                   for g in opt.flat_groups]}

    def save():
        torch.save(obj, fn)
        with open(fn, "rb+") as f:
            os.fsync(f.fileno())

    return _file_writes(fn, save, a.reps)


def phase_torch_load(a, rank=0):
    fn = a.dir + ".pt"
    return _file_reads(fn, lambda: torch.load(fn, weights_only=True), a.reps)


def phase_raw_write(a, rank=0):
    """Ceiling: the same fp32 state bytes, written sequentially to a new file and fsync'd
    while the previous file still exists, which is then deleted: what a save does. (On this
    VM's disk, rewriting just-freed blocks measured 4-10x faster than new ones, so a
    delete-then-write loop would be no fair ceiling.)"""
    model, opt = _build(a.model, 0, seed=1)
    fn = a.dir + ".raw"
    n = [0]

    def write():
        n[0] += 1
        with open(f"{fn}.{n[0]}", "wb") as f:
            for g in opt.flat_groups:
                for buf in (g.master, g.exp_avg, g.exp_avg_sq):
                    f.write(buf.numpy())
            f.flush()
            os.fsync(f.fileno())
        if n[0] > 1:
            os.remove(f"{fn}.{n[0] - 1}")

    with MemSampler() as mem:
        secs = _timed(write, a.reps)
    os.replace(f"{fn}.{n[0]}", fn)
    return {"secs": secs, "bytes": os.path.getsize(fn), "mem": mem.report()}


def phase_raw_read(a, rank=0):
    """Ceiling: that file read back into one preallocated buffer (cold, then warm)."""
    fn = a.dir + ".raw"
    buf = bytearray(os.path.getsize(fn))

    def read():
        with open(fn, "rb", buffering=0) as f:
            f.readinto(buf)

    return _file_reads(fn, read, a.reps)


STEP_SEQ = 64  # tokens per rank per training step in --async-stall (batch 1)


def _train_step(model, opt, rank: int) -> float:
    """One training step (forward, backward, opt.step) on fixed tokens; seconds."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, model.config.vocab, (1, STEP_SEQ + 1), generator=g)
    t0 = time.perf_counter()
    opt.zero_grad()
    opt.backward(model.loss(x[:, :-1], x[:, 1:]))
    opt.step()
    return time.perf_counter() - t0


def phase_async_stall(a, rank=0):
    model, opt = _build(a.model, a.stage, seed=1)
    sync_dir, async_dir = a.dir + "-sync", a.dir + "-async"
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    _train_step(model, opt, rank)  # warm-up
    t0 = time.perf_counter()
    h = zk.checkpoint.save(async_dir, model, opt, async_save=True)  # buffer and group created
    first_call = time.perf_counter() - t0
    _train_step(model, opt, rank)
    h.wait()
    first_stall = first_call + h.stall_s
    out = {k: [] for k in ("sync_s", "call_s", "hook_s", "stall_s", "async_total_s",
                           "step_s", "step_with_save_s")}
    for _ in range(a.reps):
        barrier()
        out["step_s"].append(_train_step(model, opt, rank))
        barrier()
        t0 = time.perf_counter()
        zk.checkpoint.save(sync_dir, model, opt)
        out["sync_s"].append(time.perf_counter() - t0)
        barrier()
        t0 = time.perf_counter()
        h = zk.checkpoint.save(async_dir, model, opt, async_save=True)
        call = time.perf_counter() - t0
        step = _train_step(model, opt, rank)  # its opt.step() waits for the staging copy
        h.wait()
        out["async_total_s"].append(time.perf_counter() - t0)
        out["call_s"].append(call)
        out["hook_s"].append(h.stall_s)
        out["stall_s"].append(call + h.stall_s)
        out["step_with_save_s"].append(call + step)
    staged = zk.checkpoint.async_save.staging_buffer().numel()
    return {"secs": out["sync_s"], **out, "first_stall_s": first_stall,
            "staging_bytes": staged, "bytes": _dir_bytes(async_dir), "mem": {}}


def phase_heal(a, rank=0):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, a.ws // 2), mesh_dim_names=("replicate", "shard"))
    dist.barrier()
    t0 = time.perf_counter()
    torch.manual_seed(1)
    model = build_gpt(a.model, seed=1)
    opt = zk.ZeroAdamW(model, stage=a.stage, precision="bf16", backend="reference", mesh=mesh)
    dist.barrier()
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(opt.comm.shard.rank)  # the same shard, the same state
    for piece in optimizer_view(model, opt).held:
        piece.exp_avg.copy_(torch.randn(piece.exp_avg.shape, generator=g))
        piece.exp_avg_sq.copy_(torch.rand(piece.exp_avg_sq.shape, generator=g))
    _train_step(model, opt, opt.comm.shard.rank)  # replicas hold the same state after a step
    zk.checkpoint.save(a.dir, model, opt)  # the latest checkpoint a restart would load
    lost = opt.comm.replicate.rank == 1
    out = {k: [] for k in ("heal_s", "transfer_s", "verify_s", "load_s")}
    fp = _fingerprint(opt)
    for _ in range(a.reps):
        if lost:  # replica 1 loses its state
            with torch.no_grad():
                for piece in optimizer_view(model, opt).held:
                    for t in piece.tensors().values():
                        t.fill_(float("nan"))
        dist.barrier()
        t0 = time.perf_counter()
        r = zk.checkpoint.recover_from_replica(model, opt)
        out["heal_s"].append(time.perf_counter() - t0)
        out["transfer_s"].append(r["seconds"])
        out["verify_s"].append(r["verify_seconds"])
    healed = _same_sums(_fingerprint(opt), fp)
    for cold in [True] + [False] * (a.reps - 1):
        if cold and rank == 0:
            _drop_cache(a.dir)
        out["load_s"] += _timed(lambda: zk.checkpoint.load(a.dir, model, opt), 1)
    return {"secs": out["heal_s"], **out, "build_s": build_s, "state_bytes": r["bytes"],
            "broadcasts": r["broadcasts"], "bytes": _dir_bytes(a.dir), "mem": {},
            "healed_state_is_the_source": healed,
            "loaded_state_is_the_saved": _same_sums(_fingerprint(opt), fp)}


PHASES = {"raw_write": phase_raw_write, "raw_read": phase_raw_read, "save": phase_save,
          "load": phase_load, "consolidate": phase_consolidate,
          "consolidate_file": phase_consolidate_file, "torch_save": phase_torch_save,
          "torch_load": phase_torch_load, "async_stall": phase_async_stall,
          "heal": phase_heal}


def _rank_phase(rank, ws, a):
    return PHASES[a.phase](a, rank)


def run_phase(a) -> dict:
    """Child side: one phase at world size a.ws; rank results merged (worst rank)."""
    if a.ws == 1:
        return PHASES[a.phase](a)
    from zerokern.tools.spawn import spawn_ranks  # the one multi-rank launcher

    ranks = spawn_ranks(_rank_phase, a.ws, a, threads=1, pg_timeout=600)
    res = dict(ranks[0])
    if a.phase in ("async_stall", "heal"):  # the slowest rank per repetition, per measure
        for k, v in ranks[0].items():
            if k.endswith("_s") and isinstance(v, list):
                res[k] = [max(x) for x in zip(*(r[k] for r in ranks))]
            elif k.endswith("_s"):
                res[k] = max(r[k] for r in ranks)
            elif isinstance(v, bool):
                res[k] = all(r[k] for r in ranks)
        return res
    res["secs"] = [max(x) for x in zip(*(r["secs"] for r in ranks))]
    res["mem"] = {k: max(r["mem"][k] for r in ranks) for k in ranks[0]["mem"]}
    res["mem_per_rank"] = [r["mem"] for r in ranks]
    return res


# ---- driver ----------------------------------------------------------------------------------
def _child(args, **kw) -> dict:
    cmd = [sys.executable, __file__, "--_phase", kw["phase"], "--model", args.model,
           "--reps", str(kw.get("reps", args.reps)), "--_dir", kw["dir"],
           "--_ws", str(kw.get("ws", 1)), "--_stage", str(kw.get("stage", 0)),
           "--_dtype", kw.get("dtype", "fp32")]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode:
        raise RuntimeError(f"phase {kw}: {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


ROWS = [  # (row name, phase, world size, stage, dir key, extra)
    ("ceiling: raw write + fsync", "raw_write", 1, 0, "n1", {}),
    ("ceiling: raw read", "raw_read", 1, 0, "n1", {}),
    ("save N=1 stage 0", "save", 1, 0, "n1", {}),
    ("load N=1 stage 0", "load", 1, 0, "n1", {}),
    ("save N=2 stage 2", "save", 2, 2, "n2", {}),
    ("load N=2 stage 2 from N=1 (reshard)", "load", 2, 2, "n1", {}),
    ("load N=1 stage 0 from N=2 (reshard)", "load", 1, 0, "n2", {}),
    ("consolidate -> dict fp32", "consolidate", 1, 0, "n2", {"reps": 1}),
    ("consolidate -> safetensors bf16", "consolidate_file", 1, 0, "n2",
     {"reps": 1, "dtype": "bf16"}),
    ("peer: torch.save same tensors", "torch_save", 1, 0, "n1", {}),
    ("peer: torch.load same file", "torch_load", 1, 0, "n1", {}),
]

COLUMNS = [("name", "phase"), ("bytes_gb", "GB"), ("first_s", "first s"),
           ("median_s", "median s"), ("gbps_first", "GB/s first"), ("gbps", "GB/s median"),
           ("extra_anon_mb", "extra anon MiB"), ("extra_rss_mb", "extra RSS MiB"),
           ("ru_maxrss_mb", "ru_maxrss MiB")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="100m", help="zerokern.tools.gpt preset (default 100m)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per phase (default 3)")
    p.add_argument("--quick", action="store_true", help="GPT small, 2 reps (smoke run)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--async-stall", action="store_true",
                   help="measure the async save's stall instead (module docstring)")
    p.add_argument("--heal", action="store_true",
                   help="measure recover_from_replica against a load instead (docstring)")
    p.add_argument("--_phase"), p.add_argument("--_dir"), p.add_argument("--_ws", type=int)
    p.add_argument("--_stage", type=int), p.add_argument("--_dtype")
    a = p.parse_args(argv)
    if a._phase:  # child
        torch.set_num_threads(1)
        ns = argparse.Namespace(phase=a._phase, dir=a._dir, ws=a._ws, stage=a._stage,
                                dtype=a._dtype, model=a.model, reps=a.reps)
        print(json.dumps(run_phase(ns)))
        return 0
    if a.quick:
        a.model, a.reps = "small", 2
    if a.async_stall:
        return main_async_stall(a)
    if a.heal:
        return main_heal(a)
    scratch = tempfile.mkdtemp(prefix="zk_bench_ckpt_", dir=a.dir)
    dirs = {"n1": os.path.join(scratch, "n1"), "n2": os.path.join(scratch, "n2")}
    env = common.environment(torch.device("cpu"))
    env["other_cpu_load_before"] = common.other_load_now()
    load = common.OtherLoad()
    n_params = sum(t.numel() for t in build_gpt(a.model).parameters())
    rows = []
    try:
        for name, phase, ws, stage, key, extra in ROWS:
            res = _child(a, phase=phase, dir=dirs[key], ws=ws, stage=stage, **extra)
            s = res["secs"]
            med = statistics.median(s[1:] if res.get("cold_first") and len(s) > 1 else s)
            row = {"name": name, "phase": phase, "world_size": ws, "stage": stage,
                   "bytes": res["bytes"], "bytes_gb": res["bytes"] / GB, "secs": s,
                   "first_s": s[0], "median_s": med, "gbps_first": res["bytes"] / GB / s[0],
                   "gbps": res["bytes"] / GB / med, **res["mem"],
                   "fingerprint": res.get("fingerprint"), "read_bytes": res.get("read_bytes"),
                   "mem_per_rank": res.get("mem_per_rank")}
            rows.append(row)
            common.print_table([row], COLUMNS)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    env["other_cpu_load_during"] = load.fraction()
    fp = {r["name"]: r["fingerprint"] for r in rows if r["fingerprint"]}
    checks = [("load N=1 state equals the saved state (sums)",
               _same_sums(fp["load N=1 stage 0"], fp["save N=1 stage 0"])),
              ("reshard N=1 -> N=2 state equals the saved state (sums)",
               _same_sums(fp["load N=2 stage 2 from N=1 (reshard)"], fp["save N=1 stage 0"])),
              ("reshard N=2 -> N=1 state equals the saved state (sums)",
               _same_sums(fp["load N=1 stage 0 from N=2 (reshard)"], fp["save N=2 stage 2"]))]
    payload = {"env": env, "model": a.model, "params": n_params, "reps": a.reps, "rows": rows,
               "checks": [{"check": c, "pass": ok} for c, ok in checks]}
    stem = "checkpoint-cpu" + ("-quick" if a.quick else "")
    out = REPO / "benchmarks" / "results"
    common.write_json(out / f"{stem}.json", payload)
    md = [f"# checkpoint benchmark: GPT {a.model} ({n_params / 1e6:.1f}M params), ZeroAdamW "
          "bf16 (12 B/param on disk), CPU\n", common.markdown_env(env), "",
          "Shared machine: 2 cores and the disk are shared with other jobs, so the numbers "
          "are noisy; `first` of a load is cold (this benchmark's files dropped from the page "
          "cache), the median is over the warm repetitions. Save includes fsync. Memory: "
          "extra anon = peak anonymous memory above the value before the phase (minus the "
          "output for consolidate -> dict); extra RSS adds mapped page-cache pages. Writing "
          "new files on this VM's disk varied 3x between runs within an hour (save N=1: "
          "2.0 to 6.3 s): compare rows within one run, against its ceiling rows.\n",
          common.markdown_table(rows, COLUMNS), "",
          *[f"- [{'PASS' if ok else 'FAIL'}] {c}" for c, ok in checks], ""]
    common.write_text(out / f"{stem}.md", "\n".join(md))
    print("\n".join(md))
    return 0 if all(ok for _, ok in checks) else 1


ASYNC_COLUMNS = [("name", "setting"), ("bytes_gb", "GB"), ("sync_s", "sync save s"),
                 ("call_s", "save() call s"), ("hook_s", "step waited s"),
                 ("stall_s", "stall s"), ("stall_frac", "stall / sync"),
                 ("step_s", "step s"), ("step_with_save_s", "step with async save s"),
                 ("async_total_s", "save to commit s"), ("first_stall_s", "first stall s")]


def main_async_stall(a) -> int:
    """--async-stall: one row per world size; medians over the repetitions."""
    scratch = tempfile.mkdtemp(prefix="zk_bench_async_", dir=a.dir)
    env = common.environment(torch.device("cpu"))
    env["other_cpu_load_before"] = common.other_load_now()
    load = common.OtherLoad()
    n_params = sum(t.numel() for t in build_gpt(a.model).parameters())
    rows = []
    try:
        for ws, stage in ((1, 0), (2, 2)):
            res = _child(a, phase="async_stall", dir=os.path.join(scratch, f"n{ws}"), ws=ws,
                         stage=stage)
            keys = ("sync_s", "call_s", "hook_s", "stall_s", "async_total_s", "step_s",
                    "step_with_save_s")
            med = {k: statistics.median(res[k]) for k in keys}
            row = {"name": f"N={ws} stage {stage}", "world_size": ws, "stage": stage,
                   "bytes": res["bytes"], "bytes_gb": res["bytes"] / GB, **med,
                   "stall_frac": med["stall_s"] / med["sync_s"],
                   "first_stall_s": res["first_stall_s"],
                   "staging_bytes": res["staging_bytes"],
                   "per_rep": {k: res[k] for k in keys}}
            rows.append(row)
            common.print_table([row], ASYNC_COLUMNS)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    env["other_cpu_load_during"] = load.fraction()
    target = 0.10
    checks = [(f"{r['name']}: stall <= {target:.0%} of a synchronous save",
               r["stall_frac"] <= target) for r in rows]
    payload = {"env": env, "model": a.model, "params": n_params, "reps": a.reps, "rows": rows,
               "target_stall_frac": target,
               "checks": [{"check": c, "pass": ok} for c, ok in checks]}
    stem = "checkpoint-async-cpu" + ("-quick" if a.quick else "")
    out = REPO / "benchmarks" / "results"
    common.write_json(out / f"{stem}.json", payload)
    md = [f"# async checkpoint save: GPT {a.model} ({n_params / 1e6:.1f}M params), ZeroAdamW "
          "bf16 (12 B/param on disk), CPU\n", common.markdown_env(env), "",
          "Stall: the time the training thread waits for an async save: the "
          "`zerokern.checkpoint.save(..., async_save=True)` call (the collective start, the "
          "snapshot of counters and buffers) plus the wait of the next `opt.step()` for the "
          "staging copy, which the writer thread makes while the next forward and backward "
          f"run (here one step: batch 1 x {STEP_SEQ} tokens per rank, one thread); against "
          "a synchronous save of the same state (files, crc32, fsync, metadata, commit) in "
          f"the same process. Medians over {a.reps} repetitions, the slowest rank per "
          "repetition. 'first stall' is the first async save's (it allocates the staging "
          "buffer and creates the checkpoint's gloo group). 'step with async save' includes "
          "the writer thread's competition for the 2 cores, shared by every rank and other "
          "jobs.\n",
          common.markdown_table(rows, ASYNC_COLUMNS), "",
          *[f"- [{'PASS' if ok else 'FAIL'}] {c}" for c, ok in checks], ""]
    common.write_text(out / f"{stem}.md", "\n".join(md))
    print("\n".join(md))
    return 0 if all(ok for _, ok in checks) else 1


HEAL_COLUMNS = [("name", "setting"), ("state_gb", "state GB per rank"),
                ("heal_s", "recover_from_replica s"), ("transfer_s", "of it: transfer s"),
                ("verify_s", "of it: crc verify s"), ("load_first_s", "load s (cold)"),
                ("load_s", "load s (warm)"), ("build_s", "model + optimizer build s"),
                ("heal_vs_load", "recover / warm load")]


def main_heal(a) -> int:
    """--heal: recover_from_replica against a load of the same state (module docstring)."""
    scratch = tempfile.mkdtemp(prefix="zk_bench_heal_", dir=a.dir)
    env = common.environment(torch.device("cpu"))
    env["other_cpu_load_before"] = common.other_load_now()
    load = common.OtherLoad()
    n_params = sum(t.numel() for t in build_gpt(a.model).parameters())
    try:
        res = _child(a, phase="heal", dir=os.path.join(scratch, "ck"), ws=4, stage=2)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    env["other_cpu_load_during"] = load.fraction()
    med = {k: statistics.median(res[k]) for k in ("heal_s", "transfer_s", "verify_s")}
    warm = res["load_s"][1:] or res["load_s"]
    row = {"name": "2x2 mesh, stage 2, 4 ranks", "state_bytes": res["state_bytes"],
           "state_gb": res["state_bytes"] / GB, **med, "load_first_s": res["load_s"][0],
           "load_s": statistics.median(warm), "build_s": res["build_s"],
           "checkpoint_bytes": res["bytes"], "broadcasts": res["broadcasts"],
           "per_rep": {k: res[k] for k in ("heal_s", "transfer_s", "verify_s", "load_s")}}
    row["heal_vs_load"] = row["heal_s"] / row["load_s"]
    common.print_table([row], HEAL_COLUMNS)
    checks = [("every healed rank's state sums equal the source's",
               res["healed_state_is_the_source"]),
              ("the loaded state's sums equal the saved one's", res["loaded_state_is_the_saved"])]
    payload = {"env": env, "model": a.model, "params": n_params, "reps": a.reps, "rows": [row],
               "checks": [{"check": c, "pass": ok} for c, ok in checks]}
    stem = "checkpoint-heal-cpu" + ("-quick" if a.quick else "")
    out = REPO / "benchmarks" / "results"
    common.write_json(out / f"{stem}.json", payload)
    md = [f"# replica recovery vs restart from a checkpoint: GPT {a.model} "
          f"({n_params / 1e6:.1f}M params), ZeroAdamW bf16, CPU\n", common.markdown_env(env), "",
          "4 gloo ranks on one host, a 2x2 (replicate, shard) mesh at stage 2. "
          "`recover_from_replica`: replica 1's optimizer state is overwritten with NaN, then "
          "rebuilt from replica 0's over the replicate group (params, fp32 master, moments, "
          "step counters, buffers; each rank receives its shard's state from its peer), with "
          "the crc32 check after (verify=True, the default). Load: `zerokern.checkpoint.load` "
          "of the same state from the checkpoint every rank would restart from (all 4 ranks, "
          "the first after this benchmark's files were dropped from the page cache). A "
          "restart from disk also pays the process start, the rendezvous, the model + "
          "optimizer build (measured here once) and the steps recomputed since the save; "
          f"the recovery pays none of those. Medians over {a.reps} repetitions, the slowest "
          "rank per repetition. The 2 cores are shared by the 4 ranks and other jobs.\n",
          common.markdown_table([row], HEAL_COLUMNS), "",
          *[f"- [{'PASS' if ok else 'FAIL'}] {c}" for c, ok in checks], ""]
    common.write_text(out / f"{stem}.md", "\n".join(md))
    print("\n".join(md))
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
