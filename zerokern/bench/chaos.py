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
   rank, up to DELAY_S after the attempt reached the kill's step, or (one kill of the
   schedule) the moment a checkpoint's temporary directory appears in the save dir after that
   step: mid-save, nothing committed yet. random.Random(seed)
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
DELAY_S = 0.3  # a random kill lands up to this long after its step (a step: ~0.1-0.2 s)
POLL_S = 0.001  # the supervisor's poll of the save dir (a tiny model's save lasts ~10-50 ms)


@dataclass
class Kill:
    index: int
    kind: str            # "random" | "mid-save"
    restart: int         # torchrun's restart count of the attempt killed
    rank: int
    pid: int
    t: float             # time.time() of the kill
    step: int            # the last step any rank of the attempt logged before the kill
    saving: Optional[str] = None  # mid-save: the temporary directory seen
    resumed_from: Optional[int] = None
    recomputed: Optional[int] = None
    detect_s: Dict[int, Optional[float]] = field(default_factory=dict)  # survivor rank -> s
    exit_s: Dict[int, Optional[float]] = field(default_factory=dict)  # survivor rank -> s
    sigtermed: List[int] = field(default_factory=list)  # survivors torchrun had to stop


def train_args(steps: int, save_every: int, seq: int, batch: int, seed: int) -> List[str]:
    return ["--model-size", "tiny", "--device", "cpu", "--steps", str(steps), "--seq", str(seq),
            "--batch", str(batch), "--seed", str(seed), "--save-every", str(save_every),
            "--resume", "auto"]


def torchrun_cmd(args: List[str], nproc: int, max_restarts: int,
                 monitor_s: float = MONITOR_S) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "--monitor-interval", f"{monitor_s:g}", "-m", "zerokern", "train", *args]


def _env(events: Optional[Path]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    if events is not None:
        env["ZEROKERN_TRAIN_EVENTS"] = str(events)
    return env


def read_events(events: Path) -> List[dict]:
    out = []
    for f in sorted(events.glob("pid*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by the SIGKILL
                    pass
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
              monitor_s: float = MONITOR_S, log=print) -> dict:
    """Steps 1-3 of [Note: the chaos run]; returns the report (see `summarize`)."""
    rng = random.Random(seed)
    args = train_args(steps, save_every, seq, batch, seed=0)
    ref_dir, run_dir = work / "reference", work / "chaos"
    log(f"chaos: seed {seed}; reference run ({steps} steps, {nproc} ranks)")
    t0 = time.time()
    ref = subprocess.run(torchrun_cmd([*args, "--save-dir", str(ref_dir / "ck"), "--out",
                                       str(ref_dir / "out")], nproc, 0),
                         env=_env(None), cwd=REPO, capture_output=True, text=True,
                         timeout=timeout_s)
    if ref.returncode != 0:
        raise RuntimeError("the reference run failed:\n" + ref.stdout[-3000:] + ref.stderr[-3000:])
    ref_s = time.time() - t0
    mid_save_at = rng.randrange(kills) if kills else -1
    # the kills' steps, spread over the run (two never at the same step)
    targets = sorted(rng.sample(range(save_every // 2, steps - save_every), kills))
    events_dir = run_dir / "events"
    save_dir = run_dir / "ck"
    log_path = run_dir / "torchrun.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(torchrun_cmd([*args, "--save-dir", str(save_dir), "--out",
                                              str(run_dir / "out")], nproc, max_restarts,
                                             monitor_s),
                                env=_env(events_dir), cwd=REPO, stdout=logf,
                                stderr=subprocess.STDOUT)
        done: List[Kill] = []
        try:
            for i in range(kills):
                k = _one_kill(i, "mid-save" if i == mid_save_at else "random", targets[i],
                              proc, rng, events_dir, save_dir, steps, nproc, t0 + timeout_s)
                if k is None:
                    log(f"chaos: kill {i}: the run ended first")
                    break
                done.append(k)
                log(f"chaos: kill {i} ({k.kind}): rank {k.rank} (pid {k.pid}) of attempt "
                    f"{k.restart} after step {k.step}" +
                    (f", while {Path(k.saving).name} was being written" if k.saving else ""))
            rc = proc.wait(timeout=max(1.0, t0 + timeout_s - time.time()))
        finally:
            if proc.poll() is None:
                proc.kill()
    chaos_s = time.time() - t0
    events = read_events(events_dir)
    _fill_in(done, events, nproc, log_path.read_text(errors="replace"))
    r = summarize(seed, steps, save_every, nproc, max_restarts, seq, batch, rc, done,
                  ref_dir / "ck", save_dir, ref_s, chaos_s, log_path)
    r["torchrun_monitor_interval_s"] = monitor_s
    return r


def _one_kill(i: int, kind: str, target: int, proc, rng: random.Random, events_dir: Path,
              save_dir: Path, steps: int, nproc: int, deadline: float) -> Optional[Kill]:
    """Wait for the attempt after the last kill's, with every rank up, to reach step
    `target`; then kill a random rank: after a random delay of up to DELAY_S (random), or the
    moment a new temporary directory appears in the save dir (mid-save)."""
    victim = rng.randrange(nproc)
    delay = rng.uniform(0, DELAY_S)
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
        if kind == "mid-save":  # a save lives ~10-50 ms: poll the directory alone
            saving = _new_tmp(save_dir, seen_tmp, list(att["pids"].values()), deadline)
            if saving is None:
                continue  # the attempt ended (or the deadline): look again
        else:
            time.sleep(delay)
        pid = att["pids"][victim]
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        k = Kill(i, kind, att["restart"], victim, pid, t, att["step"], saving)
        _watch_exits(k, att["pids"], deadline)
        return k
    return None


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


def compare_checkpoints(ref_ck: Path, run_ck: Path) -> dict:
    """Every step directory both runs committed: its consolidated params (fp32 masters) and
    its data files byte for byte (rank*.bin: each rank's shard of the masters and of every
    optimizer state; extra.bin: buffers); the bytes that differ (0: bitwise equal)."""
    import zerokern.checkpoint as ck

    names = sorted(p.name for p in ref_ck.iterdir() if p.name.startswith("step") and
                   ".tmp-" not in p.name and ".old-" not in p.name)
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
              run_ck, ref_s, chaos_s, log_path) -> dict:
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


def markdown(r: dict, env: dict) -> str:
    from .common import markdown_env

    rows = ["| kill | kind | attempt | rank (pid) | after step | resumed from | recomputed | "
            "survivor: PeerLost after (s) | survivor: exited after (s) |",
            "|---:|---|---:|---|---:|---:|---:|---|---|"]
    for k in r["kills"]:
        det = ", ".join(f"rank {s}: {v:.3f}" if v is not None else f"rank {s}: none"
                        for s, v in k["detect_s"].items())
        ex = ", ".join(f"rank {s}: {v:.3f}" + (" (SIGTERM)" if int(s) in k["sigtermed"] else "")
                       if v is not None else f"rank {s}: ?" for s, v in k["exit_s"].items())
        rows.append(f"| {k['index']} | {k['kind']} | {k['restart']} | {k['rank']} ({k['pid']}) "
                    f"| {k['step']} | {k['resumed_from']} | {k['recomputed']} | {det} | {ex} |")
    cmp = r["checkpoints_compared"]
    return "\n".join([
        f"# Chaos run: {len(r['kills'])} SIGKILLs, seed {r['seed']}",
        "",
        f"`zerokern train` (GPT tiny, seq {r['seq']}, batch {r['batch']} per rank, "
        f"{r['steps']} steps, `--save-every {r['save_every']}`, async saves) on "
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
        f"- wall time: reference {r['reference_s']} s, chaos run {r['chaos_s']} s",
        "",
        *rows,
        "",
        "## Environment",
        "",
        markdown_env(env),
        "",
    ])
