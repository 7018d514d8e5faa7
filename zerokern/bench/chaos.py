"""The chaos run (issue 39): `zerokern train` under `torchrun --max-restarts`, with ranks
SIGKILLed on a seeded schedule, ends with the same params and optimizer state as a run never
interrupted, bit for bit.

[Note: the chaos run]
1. The reference: the same `zerokern train` command under torchrun, never killed.
2. The chaos run: torchrun --standalone --nproc-per-node 2 --max-restarts R, --save-every N
   (saves are asynchronous: the writer thread commits while training goes on) and
   --resume auto. Each rank logs its events ($ZEROKERN_TRAIN_EVENTS, train/events.py): its
   start (pid, rank, torchrun restart count), each step done, and the time it raised
   PeerLost. The supervisor (this process) reads them to find the current attempt's pids, and
   kills one rank (SIGKILL) per scheduled kill, at steps drawn over the whole run: a random
   rank, a random fraction of one step's time (at most DELAY_S) after the attempt reached the
   kill's step, or (one kill of the
   schedule) the moment a checkpoint's temporary directory appears in the save dir after that
   step: mid-save, nothing committed yet; with offload="nvme", one more kill of the schedule
   is mid-write ([Note: a mid-write kill]). random.Random(seed)
   draws every choice; the seed is printed and recorded.
   torchrun's --monitor-interval is MONITOR_S (10 s, not its 0.1 s): the survivor must find
   the dead rank itself (liveness.py, within ~0.5 s) and exit, as a rank on another node
   would, rather than be SIGTERMed by its agent first (which adds up to MONITOR_S to each
   restart).
3. Checks: the chaos run exits 0; its final checkpoint, consolidated (fp32 params and every
   optimizer state), equals the reference's bit for bit, and so does every checkpoint both
   runs committed (bytes lost: the differing bytes, 0).
Reported per kill: the step it hit, the steps recomputed (steps the killed attempt trained past
the checkpoint the next attempt resumed from: at most the save interval plus the steps trained
while an async save was still writing), and each survivor's detection time (its PeerLost's
time minus the kill's).

[Note: a mid-write kill]
With offload="nvme" (`zerokern train --offload nvme`: each rank's master and moments in files
under <save dir>/.offload-nvme/rank<R>), one kill of the schedule (seeded, drawn after the
others so that a seed's schedule without nvme is unchanged; not the mid-save one) lands in the
middle of an NVMe state write. A write of the tiny GPT's state lasts microseconds, so the
victim kills itself on request (train/chaos_kill.py [Note: a kill mid-write on request]): once
the attempt reached the kill's step, the supervisor writes <events dir>/mid-write.json
(attempt, rank, after_step, nth: the write of the step that dies, drawn in [0, 3)) and waits
for the victim to die; its last event, "mid-write", gives the time, the file and the offset.
The rank reads the request once per committed step, so the kill lands 1-2 steps after the
kill's step, in a step whose other half is partly written and never committed.

[Note: a restart at another world size]
With `resize_to` (2 -> 3 ranks), one kill of the schedule (seeded; not the mid-save one) ends
the first torchrun job: its --max-restarts is the number of kills before it, so that kill finds
no restart left, as a job that lost a node and is started again on another set of machines.
A second torchrun job on `resize_to` ranks then resumes from the same save dir (`--resume
auto`: the checkpoint reshards on load), and the kills after it land there (its restarts
stay at the new size). Every run passes `--global-batch G`: the micro-batches per rank become
G / (batch x ranks), so each step trains on the same G sequences at either size (DeepSpeed's
elastic config keeps train_batch_size the same way); the new job's log must say so. Checks:
- every checkpoint up to the one the new size resumed from equals the reference's bit for
  bit (they were written at the old size);
- an uninterrupted run at the new size from a copy of that checkpoint (a third torchrun job,
  never killed): every later checkpoint of the chaos run equals its own bit for bit (at one
  world size a resume is bitwise, and the kills after the resize are resumes at the new size);
- the final params against the uninterrupted run at the old size: not bitwise (a step's
  gradient is summed in another order over 3 ranks x 2 micro-batches than over 2 x 3), the
  max abs difference is reported.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
# torchrun's worker poll (default 0.1 s). It polls its own children, so a poll that falls
# between the kill and the survivor's exit stops the survivor (SIGTERM) before it has raised
# PeerLost: at 1 s that was 2 kills of 6, at 5 s 2 of 6 again (kills a few steps into an
# attempt land near the poll at start + 5 s). 10 s leaves the survivors time to find the dead
# rank and exit on their own, as ranks on another node must; it is also the longest a
# restart waits for torchrun to notice.
MONITOR_S = 10.0
# A random kill lands a random fraction of one step's time after its step (the attempt's own
# mean step time, from its step events), at most DELAY_S: a fixed 0.3 s was ~2 steps when a
# step took 0.1-0.2 s, but 30 steps at the 10 ms a GPT-tiny step takes on an idle 2-core VM,
# so the kill could land after the run had ended (the CI failure of 2026-11-29: no attempt
# resumed after it).
DELAY_S = 0.3
POLL_S = 0.001  # the supervisor's poll of the save dir (a tiny model's save lasts ~10-50 ms)
# [Note: a mid-write kill]: the names train/chaos_kill.py reads (zerokern.train and
# zerokern.bench are sibling layers: neither imports the other) and train/config.py's
# OFFLOAD_DIR, where each rank's NVMe state files live under the save dir.
CHAOS_ENV = "ZEROKERN_CHAOS_DIR"
MID_WRITE_REQUEST = "mid-write.json"
OFFLOAD_DIR = ".offload-nvme"
MID_WRITE_NTH = 3  # the write of the step that dies: 0, 1 or 2 (master, exp_avg, exp_avg_sq)


@dataclass
class Kill:
    index: int
    kind: str            # "random" | "mid-save" | "mid-write"
    restart: int         # torchrun's restart count of the attempt killed
    rank: int
    pid: int
    t: float             # time.time() of the kill
    step: int            # the last step any rank of the attempt logged before the kill
    saving: Optional[str] = None  # mid-save: the temporary directory seen
    writing: Optional[str] = None  # mid-write: "<state file> at <offset>, step <s>"
    resumed_from: Optional[int] = None
    recomputed: Optional[int] = None
    detect_s: Dict[int, Optional[float]] = field(default_factory=dict)  # survivor rank -> s
    exit_s: Dict[int, Optional[float]] = field(default_factory=dict)  # survivor rank -> s
    sigtermed: List[int] = field(default_factory=list)  # survivors torchrun had to stop
    nproc: int = 2        # the ranks of the attempt killed
    ends_job: bool = False  # the kill that ends the first torchrun job (resize: no restart left)


def train_args(steps: int, save_every: int, seq: int, batch: int, seed: int,
               global_batch: Optional[int] = None, offload: Optional[str] = None) -> List[str]:
    g = [] if global_batch is None else ["--global-batch", str(global_batch)]
    o = [] if offload is None else ["--offload", offload]  # (nvme: under the save dir)
    return ["--model-size", "tiny", "--device", "cpu", "--steps", str(steps), "--seq", str(seq),
            "--batch", str(batch), "--seed", str(seed), "--save-every", str(save_every),
            "--resume", "auto", *g, *o]


def torchrun_cmd(args: List[str], nproc: int, max_restarts: int,
                 monitor_s: float = MONITOR_S) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "--monitor-interval", f"{monitor_s:g}", "-m", "zerokern", "train", *args]


def _env(events: Optional[Path], chaos_dir: bool = False) -> dict:
    """The ranks' environment; with chaos_dir, mid-write requests are read from the events
    dir ([Note: a mid-write kill])."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    env.pop(CHAOS_ENV, None)
    if events is not None:
        env["ZEROKERN_TRAIN_EVENTS"] = str(events)
        if chaos_dir:
            env[CHAOS_ENV] = str(events)
    return env


def read_events(events: Path, restart_offset: int = 0) -> List[dict]:
    """Every rank's events, by time; `restart_offset` is added to the restart counts (a second
    torchrun job's attempts numbered after the first job's)."""
    out = []
    for f in sorted(events.glob("pid*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:  # a line cut by the SIGKILL
                    continue
                if "restart" in e:
                    e["restart"] += restart_offset
                out.append(e)
    return sorted(out, key=lambda e: e["t"])


def _attempt(events: List[dict]) -> Optional[dict]:
    """{restart, pids: {rank: pid}, step: last step logged} of the newest attempt."""
    starts = [e for e in events if e["event"] == "start"]
    if not starts:
        return None
    restart = max(e["restart"] for e in starts)
    pids = {e["rank"]: e["pid"] for e in starts if e["restart"] == restart}
    steps = [e["step"] for e in events if e["event"] == "step" and e["pid"] in pids.values()]
    return {"restart": restart, "pids": pids, "step": max(steps, default=None)}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def run_chaos(work: Path, steps: int, save_every: int, kills: int, seed: int, nproc: int = 2,
              seq: int = 128, batch: int = 16, max_restarts: int = 8, timeout_s: float = 900,
              monitor_s: float = MONITOR_S, log=print, resize_to: Optional[int] = None,
              global_batch: Optional[int] = None, offload: Optional[str] = None) -> dict:
    """Steps 1-3 of [Note: the chaos run] (4 with `resize_to`: [Note: a restart at another
    world size]); with offload="nvme" one kill is mid-write ([Note: a mid-write kill]);
    returns the report (see `summarize`)."""
    if resize_to is not None and global_batch is None:
        raise ValueError("resize_to needs global_batch (the global batch the runs keep)")
    if offload not in (None, "cpu", "nvme"):
        raise ValueError(f"offload must be None, 'cpu' or 'nvme', got {offload!r}")
    if offload == "nvme" and kills < 2:
        raise ValueError(f"offload='nvme' needs kills >= 2 (one mid-save, one mid-write), "
                         f"got {kills}")
    rng = random.Random(seed)
    args = train_args(steps, save_every, seq, batch, seed=0, global_batch=global_batch,
                      offload=offload)
    ref_dir, run_dir = work / "reference", work / "chaos"
    log(f"chaos: seed {seed}; reference run ({steps} steps, {nproc} ranks)")
    t0 = time.time()
    _torchrun_job(args, ref_dir, nproc, timeout_s)
    ref_s = time.time() - t0
    mid_save_at = rng.randrange(kills) if kills else -1
    # the kills' steps, spread over the run (two never at the same step)
    targets = sorted(rng.sample(range(save_every // 2, steps - save_every), kills))
    # jobs: (ranks, the kills that land in it, torchrun's --max-restarts)
    jobs = [(nproc, range(kills), max_restarts)]
    resize_at = None
    if resize_to is not None and kills:  # the kill that ends the first job (its last restart)
        resize_at = rng.choice([i for i in range(kills) if i != mid_save_at] or [0])
        jobs = [(nproc, range(resize_at + 1), resize_at),
                (resize_to, range(resize_at + 1, kills), max_restarts)]
    mid_write_at = -1  # drawn last: the draws above stay those of a run without nvme
    if offload == "nvme":
        mid_write_at = rng.choice([i for i in range(kills) if i not in (mid_save_at, resize_at)]
                                  or [i for i in range(kills) if i != mid_save_at])
    kind_of = {mid_save_at: "mid-save", mid_write_at: "mid-write"}
    save_dir = run_dir / "ck"
    run_dir.mkdir(parents=True, exist_ok=True)
    done: List[Kill] = []
    rcs: List[int] = []
    events: List[dict] = []
    log_text = ""
    offset = 0  # the attempts of the jobs before
    deadline = time.time() + timeout_s
    t0 = time.time()
    for j, (n, idx, restarts) in enumerate(jobs):
        events_dir = run_dir / ("events" if j == 0 else f"events-{j}")
        log_path = run_dir / ("torchrun.log" if j == 0 else f"torchrun-{j}.log")
        with open(log_path, "w") as logf:
            proc = subprocess.Popen(torchrun_cmd([*args, "--save-dir", str(save_dir), "--out",
                                                  str(run_dir / "out")], n, restarts,
                                                 monitor_s),
                                    env=_env(events_dir, offload == "nvme"), cwd=REPO,
                                    stdout=logf,
                                    stderr=subprocess.STDOUT)
            try:
                for i in idx:
                    k = _one_kill(i - idx.start, kind_of.get(i, "random"), targets[i], proc,
                                  rng, events_dir, save_dir, steps, n, deadline)
                    if k is None:
                        log(f"chaos: kill {i}: the run ended first")
                        break
                    k.index, k.restart, k.nproc = i, k.restart + offset, n
                    k.ends_job = i == resize_at
                    done.append(k)
                    log(f"chaos: kill {i} ({k.kind}): rank {k.rank} (pid {k.pid}) of attempt "
                        f"{k.restart} ({n} ranks) after step {k.step}" +
                        (f", while {Path(k.saving).name} was being written" if k.saving else "")
                        + (f", writing {k.writing}" if k.writing else "")
                        + (f"; the job ends: it restarts on {resize_to} ranks" if k.ends_job
                           else ""))
                rcs.append(proc.wait(timeout=max(1.0, deadline - time.time())))
            finally:
                if proc.poll() is None:
                    proc.kill()
        events += read_events(events_dir, offset)
        log_text += log_path.read_text(errors="replace")
        offset += len(idx)
    chaos_s = time.time() - t0
    events.sort(key=lambda e: e["t"])
    _fill_in(done, events, nproc, log_text)
    rc = rcs[-1]
    cmp = None
    resize = None
    if resize_at is not None and rc == 0 and resize_at < len(done):
        cmp, resize = _after_resize(work, args, done[resize_at], nproc, resize_to, batch,
                                    global_batch, steps, ref_dir / "ck", save_dir, log_text,
                                    timeout_s, log)
    r = summarize(seed, steps, save_every, nproc, max_restarts, seq, batch, rc, done,
                  ref_dir / "ck", save_dir, ref_s, chaos_s, run_dir / "torchrun.log", cmp=cmp)
    r["torchrun_monitor_interval_s"] = monitor_s
    r["global_batch"] = global_batch
    r["offload"] = offload
    r["nvme_files_left"] = _nvme_files(save_dir)
    r["job_exit_codes"] = rcs
    r["resize"] = resize
    return r


def _torchrun_job(args: List[str], out_dir: Path, nproc: int, timeout_s: float) -> None:
    """One uninterrupted `zerokern train` job (a reference) saving under out_dir/ck."""
    ref = subprocess.run(torchrun_cmd([*args, "--save-dir", str(out_dir / "ck"), "--out",
                                       str(out_dir / "out")], nproc, 0),
                         env=_env(None), cwd=REPO, capture_output=True, text=True,
                         timeout=timeout_s)
    if ref.returncode != 0:
        raise RuntimeError(f"the reference run in {out_dir} failed:\n" + ref.stdout[-3000:]
                           + ref.stderr[-3000:])


def _after_resize(work: Path, args: List[str], kill: Kill, nproc: int, new: int, batch: int,
                  global_batch: int, steps: int, ref_ck: Path, run_ck: Path, log_text: str,
                  timeout_s: float, log) -> tuple:
    """[Note: a restart at another world size]: the checkpoints up to the one the new world
    size resumed from against the reference (bitwise), the later ones against an
    uninterrupted run at the new size from that checkpoint (bitwise), the final params
    against the reference (max abs difference: another order of the sums)."""
    import shutil

    import zerokern.checkpoint as ck

    at = kill.resumed_from
    name = f"step{at:08d}"
    new_dir = work / f"reference-{new}"
    (new_dir / "ck").mkdir(parents=True, exist_ok=True)
    shutil.copytree(run_ck / name, new_dir / "ck" / name)
    log(f"chaos: uninterrupted run on {new} ranks from {name}")
    t0 = time.time()
    _torchrun_job(args, new_dir, new, timeout_s)
    new_s = time.time() - t0
    before = compare_checkpoints(ref_ck, run_ck, upto=at)
    after = compare_checkpoints(new_dir / "ck", run_ck)
    final = f"step{steps:08d}"
    a = ck.consolidate(str(ref_ck / final))
    b = ck.consolidate(str(run_ck / final))
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    curves = [json.loads((d / "out" / "metrics.json").read_text())["loss_curve"]
              for d in (ref_ck.parent, run_ck.parent, new_dir)]
    accum = global_batch // (batch * new)
    kept = (f"at step {at} on {new} ranks (saved on {nproc}): {accum} micro-batch(es) of "
            f"{batch} per rank, global batch {global_batch} kept") in log_text
    return {**before, **after}, {
        "from_ranks": nproc, "to_ranks": new, "kill": kill.index, "resumed_from": at,
        "global_batch": global_batch, "micro_batches_before": global_batch // (batch * nproc),
        "micro_batches_after": accum, "global_batch_kept_logged": kept,
        "before_bytes_differ": sum(c["bytes_differ"] for c in before.values()),
        "before_checkpoints": len(before),
        "after_bytes_differ": sum(c["bytes_differ"] for c in after.values()),
        "after_checkpoints": len(after),
        "after_bitwise_equal": bool(after) and final in after and
        all(c["bytes_differ"] == 0 for c in after.values()),
        "final_max_abs_diff_vs_reference": diff, "new_reference_s": round(new_s, 1),
        "loss_curve_max_diff_vs_reference": max(abs(x - y) for x, y in zip(*curves[:2])),
        "loss_curve_equals_new_size_run": curves[1] == curves[2]}


def _one_kill(i: int, kind: str, target: int, proc, rng: random.Random, events_dir: Path,
              save_dir: Path, steps: int, nproc: int, deadline: float) -> Optional[Kill]:
    """Wait for the attempt after the last kill's, with every rank up, to reach step
    `target`; then kill a random rank: after a random fraction of its step time (at most
    DELAY_S), the moment a new temporary directory appears in the save dir (mid-save), or in
    an NVMe state write (mid-write: [Note: a mid-write kill])."""
    victim = rng.randrange(nproc)
    frac = rng.uniform(0, 1)  # of one step's time (DELAY_S)
    seen_tmp = {p.name for p in save_dir.glob("*.tmp-*")} if save_dir.exists() else set()
    while time.time() < deadline and proc.poll() is None:
        events = read_events(events_dir) if events_dir.exists() else []
        att = _attempt(events)
        if att is None or len(att["pids"]) < nproc or att["step"] is None or \
                not all(_alive(p) for p in att["pids"].values()) or \
                att["restart"] < i:  # the attempt the previous kill ended is not over yet
            time.sleep(0.02)
            continue
        if att["step"] >= steps - 2:
            return None  # too late in the run: it would end before the kill
        if att["step"] < target:
            time.sleep(0.005)
            continue
        saving = None
        if kind == "mid-write":
            k = _mid_write(i, att, victim, int(frac * MID_WRITE_NTH), events_dir, deadline)
            if k is not None:
                _watch_exits(k, att["pids"], deadline)
            return k
        if kind == "mid-save":  # a save lives ~10-50 ms: poll the directory alone
            saving = _new_tmp(save_dir, seen_tmp, list(att["pids"].values()), deadline)
            if saving is None:
                continue  # the attempt ended (or the deadline): look again
        else:
            time.sleep(frac * min(DELAY_S, _step_s(events, att["pids"][victim])))
        pid = att["pids"][victim]
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        k = Kill(i, kind, att["restart"], victim, pid, t, att["step"], saving)
        _watch_exits(k, att["pids"], deadline)
        return k
    return None


def _mid_write(i: int, att: dict, victim: int, nth: int, events_dir: Path,
               deadline: float) -> Optional[Kill]:
    """[Note: a mid-write kill]: ask rank `victim` of attempt `att` to die at write `nth` of
    its next step, wait for it to die, and read where (its "mid-write" event). None if it
    exited without one (the run ended first)."""
    pid = att["pids"][victim]
    req = events_dir / MID_WRITE_REQUEST
    tmp = req.with_suffix(".tmp")
    tmp.write_text(json.dumps({"attempt": att["restart"], "rank": victim,
                               "after_step": att["step"], "nth": nth}))
    os.replace(tmp, req)  # whole: a rank never reads half a request
    try:
        while time.time() < deadline and _alive(pid):
            time.sleep(0.002)
    finally:
        req.unlink(missing_ok=True)
    ev = [e for e in read_events(events_dir) if e["pid"] == pid and e["event"] == "mid-write"]
    if not ev:
        return None
    e = ev[-1]
    return Kill(i, "mid-write", att["restart"], victim, pid, e["t"], att["step"],
                writing=_writing(e["file"], e["offset"], e["nth"], e["step"]))


def _writing(file: str, offset: int, nth: int, step: int) -> str:
    """A mid-write kill's place: the state file without its zerokern-<pid>-<uuid>- prefix
    (rank<R>-buf<B>-<state>.bin), the offset, the write of the step and the step."""
    return f"{file.split('-', 3)[-1]} at offset {offset} (write {nth} of step {step})"


def _nvme_files(save_dir: Path) -> List[str]:
    """The NVMe state files left under the save dir (the ranks remove theirs at exit, and a
    restarted rank those of its dead predecessor: train/config.py)."""
    root = save_dir / OFFLOAD_DIR
    return sorted(str(p.relative_to(root)) for p in root.glob("*/*")) if root.exists() else []


def _step_s(events: List[dict], pid: int, last: int = 5) -> float:
    """The mean time between the last `last` step events of process `pid` (DELAY_S if fewer
    than two)."""
    ts = [e["t"] for e in events if e["event"] == "step" and e["pid"] == pid][-last - 1:]
    return (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else DELAY_S


def _new_tmp(save_dir: Path, seen: set, pids: List[int], deadline: float) -> Optional[str]:
    """The first checkpoint temporary directory not in `seen` to appear, polled every POLL_S
    while the attempt's processes live; None if they do not."""
    n = 0
    while time.time() < deadline:
        try:
            names = os.listdir(save_dir)
        except FileNotFoundError:
            names = []
        for name in names:
            if ".tmp-" in name and name not in seen:
                return str(save_dir / name)
        n += 1
        if n % 100 == 0 and not all(_alive(p) for p in pids):
            return None
        time.sleep(POLL_S)
    return None


def _watch_exits(k: Kill, pids: Dict[int, int], deadline: float) -> None:
    """Each survivor's exit time after the kill (a process that raised PeerLost and exits,
    or that torchrun stops: `_fill_in` reads its log for the SIGTERMs)."""
    left = {r: p for r, p in pids.items() if r != k.rank}
    while left and time.time() < deadline:
        for r, p in list(left.items()):
            if not _alive(p):
                k.exit_s[r] = round(time.time() - k.t, 4)
                del left[r]
        time.sleep(0.005)


def _fill_in(kills: List[Kill], events: List[dict], nproc: int, log_text: str = "") -> None:
    """Per kill: the step the next attempt resumed from, the steps recomputed, each
    survivor's detection time, and the survivors torchrun stopped (SIGTERM) rather than
    they exiting on their own."""
    import re

    termed = {int(m) for m in re.findall(r"Sending process (\d+) closing signal SIGTERM",
                                          log_text)}
    starts = {}
    for e in events:
        if e["event"] == "start":
            starts.setdefault(e["restart"], {})[e["rank"]] = e["pid"]
    steps_of: Dict[int, List[int]] = {}
    for e in events:
        if e["event"] == "step":
            steps_of.setdefault(e["pid"], []).append(e["step"])
    for k in kills:
        pids = starts.get(k.restart, {})
        last = max((s for p in pids.values() for s in steps_of.get(p, [])), default=k.step)
        nxt = starts.get(k.restart + 1, {})
        first = min((s for p in nxt.values() for s in steps_of.get(p, [])), default=None)
        k.step = last
        if first is not None:
            k.resumed_from = first - 1
            k.recomputed = last - k.resumed_from
        for r, p in pids.items():
            if r == k.rank:
                continue
            if p in termed:
                k.sigtermed.append(r)
            lost = [e for e in events if e["event"] == "lost" and e["pid"] == p]
            k.detect_s[r] = round(lost[0]["t"] - k.t, 4) if lost else None


def _bytes_differ(a: bytes, b: bytes) -> int:
    import numpy as np

    n = min(len(a), len(b))
    diff = int((np.frombuffer(a, np.uint8, n) != np.frombuffer(b, np.uint8, n)).sum())
    return diff + abs(len(a) - len(b))


def compare_checkpoints(ref_ck: Path, run_ck: Path, upto: Optional[int] = None) -> dict:
    """Every step directory both runs committed (up to step `upto`): its consolidated params
    (fp32 masters) and its data files byte for byte (rank*.bin: each rank's shard of the
    masters and of every optimizer state; extra.bin: buffers); the bytes that differ (0:
    bitwise equal)."""
    import zerokern.checkpoint as ck

    names = sorted(p.name for p in ref_ck.iterdir() if p.name.startswith("step") and
                   ".tmp-" not in p.name and ".old-" not in p.name and
                   (upto is None or int(p.name[4:12]) <= upto))
    out = {}
    for name in names:
        if not (run_ck / name).is_dir():
            continue
        a = ck.consolidate(str(ref_ck / name))
        b = ck.consolidate(str(run_ck / name))
        lost = sum(t.numel() * t.element_size() for k, t in a.items() if k not in b)
        lost += sum(_bytes_differ(t.contiguous().numpy().tobytes(),
                                  b[k].contiguous().numpy().tobytes())
                    for k, t in a.items() if k in b)
        files = sorted(f.name for f in (ref_ck / name).glob("*.bin"))
        total = 0
        for f in files:
            x = (ref_ck / name / f).read_bytes()
            y = (run_ck / name / f).read_bytes() if (run_ck / name / f).exists() else b""
            total += len(x)
            lost += _bytes_differ(x, y)
        out[name] = {"params": len(a), "files": files, "file_bytes": total,
                     "bytes_differ": lost}
    return out


def summarize(seed, steps, save_every, nproc, max_restarts, seq, batch, rc, kills, ref_ck,
              run_ck, ref_s, chaos_s, log_path, cmp: Optional[dict] = None) -> dict:
    if cmp is None:
        cmp = compare_checkpoints(ref_ck, run_ck) if rc == 0 else {}
    final = f"step{steps:08d}"
    detect = [s for k in kills for s in k.detect_s.values() if s is not None]
    exits = [s for k in kills for s in k.exit_s.values() if s is not None]
    leftovers = sorted(p.name for p in run_ck.glob("*.tmp-*")) if run_ck.exists() else []
    return {
        "seed": seed, "steps": steps, "save_every": save_every, "nproc": nproc,
        "max_restarts": max_restarts, "seq": seq, "batch": batch,
        "torchrun_monitor_interval_s": MONITOR_S,
        "exit_code": rc, "kills": [asdict(k) for k in kills],
        "kills_survived": len(kills) if rc == 0 else 0,
        "max_recomputed": max((k.recomputed or 0 for k in kills), default=0),
        "detect_s_max": max(detect, default=None),
        "detect_s_median": sorted(detect)[len(detect) // 2] if detect else None,
        "undetected": sum(1 for k in kills for s in k.detect_s.values() if s is None),
        "exit_s_max": max(exits, default=None),
        "sigtermed": sum(len(k.sigtermed) for k in kills),
        "checkpoints_compared": cmp,
        "final_bitwise_equal": bool(cmp.get(final)) and cmp[final]["bytes_differ"] == 0,
        "bytes_lost": sum(c["bytes_differ"] for c in cmp.values()) if cmp else None,
        "uncommitted_tmp_dirs_left": leftovers,
        "reference_s": round(ref_s, 1), "chaos_s": round(chaos_s, 1),
        "log": str(log_path),
    }


def _resize_lines(r: dict) -> List[str]:
    z = r.get("resize")
    if not r.get("global_batch"):
        return []
    if not z:
        return [f"- global batch {r['global_batch']} (`--global-batch`); no restart at another "
                "world size happened (the run failed first, or no kill landed)"]
    return [
        f"- restart at another world size: kill {z['kill']} ended the {z['from_ranks']}-rank "
        f"job; a {z['to_ranks']}-rank job resumed from step {z['resumed_from']} (resharded "
        "on load)",
        f"- global batch {z['global_batch']} kept by the accumulation: "
        f"{z['micro_batches_before']} micro-batches per rank on {z['from_ranks']} ranks, "
        f"{z['micro_batches_after']} on {z['to_ranks']} (the new job's log says so: "
        f"{z['global_batch_kept_logged']})",
        f"- checkpoints up to step {z['resumed_from']} against the {z['from_ranks']}-rank "
        f"reference: {z['before_checkpoints']} compared, bytes differing "
        f"{z['before_bytes_differ']}",
        f"- later checkpoints against an uninterrupted {z['to_ranks']}-rank run from that "
        f"checkpoint: {z['after_checkpoints']} compared, bytes differing "
        f"{z['after_bytes_differ']} (bitwise: {z['after_bitwise_equal']}; that run took "
        f"{z['new_reference_s']} s)",
        f"- final params against the uninterrupted {z['from_ranks']}-rank run: max abs "
        f"difference {z['final_max_abs_diff_vs_reference']:.3g} (not bitwise: the gradient "
        "sums run in another order at another world size)",
        f"- loss curve (every step): equal to the uninterrupted {z['to_ranks']}-rank "
        f"run's: {z.get('loss_curve_equals_new_size_run')}; max difference from the "
        f"{z['from_ranks']}-rank run's {z.get('loss_curve_max_diff_vs_reference', 0):.3g}"]


def _load(load: dict) -> str:
    """The 1-minute load averages recorded with a run (benchmarks/chaos.py)."""
    return ", ".join(f"{k} {v[0]:g}" for k, v in load.items() if isinstance(v, list))


def markdown(r: dict, env: dict) -> str:
    from .common import markdown_env

    rows = ["| kill | kind | attempt (ranks) | rank (pid) | after step | resumed from | "
            "recomputed | survivor: PeerLost after (s) | survivor: exited after (s) |",
            "|---:|---|---:|---|---:|---:|---:|---|---|"]
    for k in r["kills"]:
        det = ", ".join(f"rank {s}: {v:.3f}" if v is not None else f"rank {s}: none"
                        for s, v in k["detect_s"].items())
        ex = ", ".join(f"rank {s}: {v:.3f}" + (" (SIGTERM)" if int(s) in k["sigtermed"] else "")
                       if v is not None else f"rank {s}: ?" for s, v in k["exit_s"].items())
        kind = k["kind"] + (" (ends the job)" if k.get("ends_job") else "")
        if k.get("writing"):
            kind += f": {k['writing']}"
        rows.append(f"| {k['index']} | {kind} | {k['restart']} ({k.get('nproc', r['nproc'])}) "
                    f"| {k['rank']} ({k['pid']}) "
                    f"| {k['step']} | {k['resumed_from']} | {k['recomputed']} | {det} | {ex} |")
    cmp = r["checkpoints_compared"]
    return "\n".join([
        f"# Chaos run: {len(r['kills'])} SIGKILLs, seed {r['seed']}" +
        (f", offload {r['offload']}" if r.get("offload") else "") +
        (f", {r['nproc']} -> {r['resize']['to_ranks']} ranks" if r.get("resize") else ""),
        "",
        f"`zerokern train` (GPT tiny, seq {r['seq']}, batch {r['batch']} per rank, "
        f"{r['steps']} steps, `--save-every {r['save_every']}`, async saves"
        + (f", `--offload {r['offload']}`" if r.get("offload") else "") + ") on "
        f"{r['nproc']} gloo ranks under `torchrun --standalone --max-restarts "
        f"{r['max_restarts']} --monitor-interval {r['torchrun_monitor_interval_s']:g}`; "
        "zerokern/bench/chaos.py [Note: the chaos run].",
        "",
        f"- exit code: {r['exit_code']}; kills survived: {r['kills_survived']}",
        f"- final params and optimizer state equal to the uninterrupted run's bit for bit: "
        f"{r['final_bitwise_equal']} ({len(cmp)} checkpoints compared, bytes lost: "
        f"{r['bytes_lost']})",
        f"- steps recomputed per kill: at most {r['max_recomputed']} (save interval "
        f"{r['save_every']})",
        f"- detection (kill -> PeerLost on the survivor): median {r['detect_s_median']} s, "
        f"max {r['detect_s_max']} s; survivors that did not report: {r['undetected']}",
        f"- survivor exit after the kill: max {r['exit_s_max']} s; stopped by torchrun's "
        f"SIGTERM instead of exiting on their own: {r['sigtermed']}",
        f"- uncommitted temporary dirs left in the save dir: {len(r['uncommitted_tmp_dirs_left'])}",
        *([f"- NVMe state files left by the killed ranks after the run: "
           f"{len(r['nvme_files_left'])}"] if r.get("offload") == "nvme" else []),
        f"- wall time: reference {r['reference_s']} s, chaos run {r['chaos_s']} s" +
        (f" (load average {_load(r['load_avg'])})" if r.get("load_avg") else ""),
        *_resize_lines(r),
        "",
        *rows,
        "",
        "## Environment",
        "",
        markdown_env(env),
        "",
    ])
