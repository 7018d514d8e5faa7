"""A rank whose process dies without a word (SIGKILL, the OOM killer, a lost node) is named on
every other rank within seconds.

[Note: a rank that dies]
A rank that raises posts its error before it stops (abort.py [Note: an error only some ranks
see]); a killed one posts nothing, and its peers were left with gloo's "Connection closed by
peer [127.0.0.1]:62611" (no rank named), or, where no connection of theirs closes (a node lost
without a FIN, a peer that waits on another survivor), a wait until the process group's
timeout. So every process of a job keeps its liveness in the process group's store, and a
peer is judged lost by one of three tests, the first that fires:

1. its pid is gone. Each rank publishes once who it is: host name, pid, the process's start
   time (/proc/<pid>/stat), and the boot id and pid namespace that make "the same host" certain
   (a container may share a host name or /dev/shm but not its pids). A daemon thread checks the
   peers on its own host every BEAT_S: a pid that no longer exists, a zombie, or a pid reused by
   a process that started at another time is a dead rank for certain, with no timing involved.
   The same check runs at once, on the caller's thread, when a collective fails with a
   connection error (`explain`), so the error that reaches the caller names the rank, its host
   and its pid (a connection that closes is what a killed process leaves behind).
2. its heartbeat stops. The thread bumps this rank's counter in the store every BEAT_S (0.5 s)
   and watches its successor's (rank + 1 mod N): a counter seen unchanged for PEER_DEAD_S
   (ZEROKERN_PEER_DEAD_S, default 30 s) marks the rank lost: a node gone without closing its
   connections (power, network), or a process stopped (SIGSTOP, a debugger). Watching one peer
   each suffices: whichever ranks are lost (not all), some live rank's successor is lost; the
   first rank that knows posts the verdict under one key, which every thread reads each beat.
   Cost: 3 store operations per rank per beat (at 1024 ranks, 6000/s on the store's host).
   30 s is 100x how late a beat came at worst on the loaded test machine (2 cores, load ~7,
   3 ranks training at stage 3 for 60 s: the longest gap between two beats was 0.79 s, 0.29 s
   past BEAT_S). A rank judged lost by mistake fails the job; that is why this test waits long,
   and the certain ones (the pid, a closed connection) decide first wherever they can. A rank
   never seen beating (it died before its first optimizer was built) is not judged by it.
3. the store is gone. The thread uses a connection of its own (`store.clone()`: a blocking
   get of the caller's, such as a barrier, cannot delay a beat). If a store operation fails, or
   one has not returned for PEER_DEAD_S, the store's host is lost: where a rank hosts it
   (init_process_group's env:// rendezvous without torchrun's agent store: rank 0), that rank
   is named (with certainty, by its pid, when it was on this host); else the launcher that
   hosts it (torchrun's agent, zerokern.tools.spawn's parent) is.

The verdict is a field this process reads where it already waits for a collective and polls
for a peer's failure (AbortChannel.check: the ring's waits, host agreement, the NVMe commit,
the shared-memory ring's wake-ups, and checkpoint's object collectives through `watched`): no
store operation and no host-device sync on the fast path. Every rank then raises PeerLost (a
RankAborted), naming the lost rank: the process group is out of step, so every rank exits and
the launcher restarts from the last checkpoint (the NVMe step commits or rolls back as a whole,
the checkpoint writer commits atomically: neither has committed anything when this is raised).

NCCL: the liveness tests are backend-independent (the store, /proc), but an NCCL wait makes
the device stream wait and the host goes on, so nothing of ours polls while NCCL waits: a lost
rank ends an NCCL collective at NCCL's watchdog timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING tears
the process down). Acting on the verdict there needs the thread to abort the communicator
(`ProcessGroupNCCL.abort()`), not written here (no GPU to test it on).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from .errors import PeerLost

BEAT_S = 0.5  # s between two beats of the thread (heartbeat, pid checks, the verdict key)
JOIN_WAIT_S = 10.0  # the longest a new watcher waits for the peers' identities
EXIT_JOIN_S = 5.0  # the longest exit waits for the thread's store operation ([Note: the watcher
#                    at exit]); a healthy one takes milliseconds
PEER_DEAD_ENV = "ZEROKERN_PEER_DEAD_S"
PEER_DEAD_DEFAULT_S = 30.0
CONFIRM_S = 2.0  # s a connection error waits for the thread to name the lost rank (4 beats)
_KEY = "zerokern/live"


def peer_dead_s() -> float:
    """Seconds of a silent heartbeat, or of a store operation not returning, after which a
    rank (the store's host) is judged lost ($ZEROKERN_PEER_DEAD_S, default 30)."""
    raw = os.environ.get(PEER_DEAD_ENV, "").strip()
    if not raw:
        return PEER_DEAD_DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{PEER_DEAD_ENV}={raw!r}: expected a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{PEER_DEAD_ENV}={raw!r}: expected a positive number of seconds")
    return value


@dataclass
class Lost:
    """The verdict: which rank (None: the store's launcher) was lost, where, and why."""
    rank: Optional[int]
    host: str
    pid: int
    how: str

    def who(self) -> str:
        if self.rank is None:
            return "the job's store"
        where = f"host {self.host}, pid {self.pid}" if self.pid else f"host {self.host}"
        return f"rank {self.rank} ({where})"


def peer_lost_error(lost: Lost, me: int, what: str = "a collective") -> BaseException:
    """PeerLost (errors.py) for the verdict."""
    return PeerLost(lost, me, what)


# ---- who a process is, and whether it still lives -----------------------------------------------
def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _stat(pid: int):
    """(state letter, start time in clock ticks) of pid, or None if it does not exist."""
    raw = _read(f"/proc/{pid}/stat")
    if not raw:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ("?", "")
    rest = raw[raw.rfind(")") + 2:].split()
    return rest[0], rest[19]  # fields 3 (state) and 22 (starttime)


def exited(rank: int, pid: int, what: str) -> BaseException:
    """PeerLost for a peer on this host whose pid a wait found gone (shm.py). Not posted for
    the others: the thread's own check of the published pid does that (a caller's pid list
    is its own)."""
    live = _STATE[0]
    lost = Lost(rank, socket.gethostname(), pid,
                f"its process exited during a collective (pid {pid} no longer exists on this "
                "host)")
    return peer_lost_error(lost, live.rank if live is not None else -1, what)


def _pid_ns() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _innermost(store):
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def _hosts_listener(port: int) -> bool:
    """This process listens on TCP `port` (Linux /proc): it hosts the store."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in _read(table).splitlines()[1:]:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    if not inodes:
        return False
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
    except OSError:
        pass
    return False


def _me(store) -> dict:
    inner = _innermost(store)
    port = getattr(inner, "port", 0) or 0
    st = _stat(os.getpid()) or ("", "")
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": st[1],
            "boot": _read("/proc/sys/kernel/random/boot_id"), "pidns": _pid_ns(),
            "store": bool(port) and _hosts_listener(port),
            "store_at": f"{getattr(inner, 'host', '?')}:{port}"}


def _gone(info: dict) -> Optional[str]:
    """Why the process `info` describes is certainly dead (None: alive, or not knowable)."""
    st = _stat(info["pid"])
    if st is None:
        return f"its process is gone (pid {info['pid']} no longer exists on {info['host']})"
    state, start = st
    if state in ("Z", "X"):
        return f"its process exited (pid {info['pid']} on {info['host']} is a zombie)"
    if start and info.get("start") and start != info["start"]:
        return (f"its process is gone (pid {info['pid']} on {info['host']} is now another "
                "process)")
    return None


# ---- the watcher ---------------------------------------------------------------------------------
class Liveness:
    """This process's heartbeat and its watch on the peers ([Note: a rank that dies])."""

    def __init__(self, store, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.dead_s = peer_dead_s()
        self.main_store = store
        self.store = store.clone()  # a connection of its own (item 3 of the Note)
        self.me = _me(store)
        self.peers: dict = {}  # rank -> its published info
        self.verdict: Optional[Lost] = None
        self._busy_since: Optional[float] = None  # a store operation of the thread in flight
        self._succ = (rank + 1) % world_size
        self._succ_beat: Optional[bytes] = None
        self._succ_seen = 0.0  # when the successor's counter last moved
        self.max_gap_s = 0.0  # the longest time between two beats (the measured noise)
        self._stop = threading.Event()
        self.store.set(f"{_KEY}/beat/{rank}", "0")
        self.store.append(f"{_KEY}/who", json.dumps({"rank": rank, **self.me}) + "\n")
        # Know every peer's identity before the first collective (a rank, or the store's
        # host, lost early is then named, not "the launcher"): the ranks start their watchers
        # together (the first process group's abort channel), so this waits milliseconds;
        # bounded by JOIN_WAIT_S for a rank that never builds one (the ticks read it later).
        t0 = time.monotonic()
        while True:
            self._read_peers()
            if len(self.peers) >= world_size or time.monotonic() - t0 > JOIN_WAIT_S:
                break
            time.sleep(0.02)
        self._thread = threading.Thread(target=self._run, name="zerokern-liveness",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.stop_and_join)  # [Note: the watcher at exit]

    # the verdict, read by the waits: no I/O
    def lost(self) -> Optional[Lost]:
        if self.verdict is None and self._busy_since is not None and \
                time.monotonic() - self._busy_since > self.dead_s:
            self._store_lost(f"a store operation has not returned for {self.dead_s:g} s "
                             f"({PEER_DEAD_ENV})")
        return self.verdict

    def store_stalled(self) -> bool:
        """The thread's store operation has been in flight for over 2 beats: the caller's
        store reads may block too (skip them this poll)."""
        b = self._busy_since
        return b is not None and time.monotonic() - b > 2 * BEAT_S

    def stop(self) -> None:
        self._stop.set()

    # [Note: the watcher at exit]
    # The thread is a daemon (it must never keep a process alive), and Python does not join
    # daemon threads: at interpreter finalization one inside a store operation (the c10d store
    # releases the GIL around its network call) takes the GIL back in a C++ destructor, gets
    # pthread_exit from the finalizing interpreter, and the unwind through that noexcept
    # destructor aborts the process: "terminate called without an active exception", SIGABRT,
    # after the script's work is done. A store operation is ~1 ms of every BEAT_S, longer on a
    # loaded machine: examples/deepspeed_config.py (zero2_fp16) aborted so at exit in two CI
    # runs of the slow suite on 2026-11-29 (rank 1), after all 10 steps had printed. So an
    # atexit handler stops the thread and joins it (it ends after its current store operation);
    # a store that no longer answers is given EXIT_JOIN_S, then the exit goes on as before.
    def stop_and_join(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(EXIT_JOIN_S)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(BEAT_S):
            now = time.monotonic()
            self.max_gap_s = max(self.max_gap_s, now - last)
            last = now
            self._busy_since = now
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 - the store (its host) is gone
                self._busy_since = None
                self._store_lost(f"{type(e).__name__}: {str(e)[:200]}")
                return  # no more beats: each would fail (and torch logs every failure)
            self._busy_since = None

    def _tick(self) -> None:
        s = self.store
        s.add(f"{_KEY}/beat/{self.rank}", 1)
        if len(self.peers) < self.world_size:
            self._read_peers()
        self.check_pids()
        self._watch_successor()
        if self.verdict is None and s.check([f"{_KEY}/lost"]):
            d = json.loads(s.get(f"{_KEY}/lost").decode())
            self.verdict = Lost(d["rank"], d["host"], d["pid"], d["how"])

    def _read_peers(self) -> None:
        for line in self.store.get(f"{_KEY}/who").decode().splitlines():
            d = json.loads(line)
            self.peers.setdefault(d["rank"], d)

    def _local(self, info: dict) -> bool:
        return bool(info["boot"]) and info["boot"] == self.me["boot"] and \
            info["pidns"] == self.me["pidns"]

    def check_pids(self) -> Optional[Lost]:
        """The peers on this host whose process is certainly gone (test 1): declare the
        first. Also called on the caller's thread (`explain`)."""
        for r, info in sorted(self.peers.items()):
            if r != self.rank and self._local(info):
                why = _gone(info)
                if why is not None:
                    self.declare(Lost(r, info["host"], info["pid"], why))
                    break
        return self.verdict

    def _watch_successor(self) -> None:
        if self._succ == self.rank:
            return
        key = f"{_KEY}/beat/{self._succ}"
        now = time.monotonic()
        if not self.store.check([key]):
            return  # not started yet: never judged by its heartbeat
        beat = self.store.get(key)
        if beat != self._succ_beat:
            self._succ_beat, self._succ_seen = beat, now
        elif now - self._succ_seen > self.dead_s and self.verdict is None:
            info = self.peers.get(self._succ, {"host": "?", "pid": 0})
            self.declare(Lost(self._succ, info["host"], info["pid"],
                              f"its heartbeat stopped {now - self._succ_seen:.0f} s ago "
                              f"({PEER_DEAD_ENV}={self.dead_s:g}; seen by rank {self.rank}): "
                              "its host is down or unreachable, or the process is stopped"))

    def declare(self, lost: Lost) -> None:
        """Record the verdict here and post it for every rank (first one wins locally)."""
        if self.verdict is not None:
            return
        self.verdict = lost
        try:
            self.store.set(f"{_KEY}/lost", json.dumps(lost.__dict__))
        except Exception:  # noqa: BLE001 - the store is gone too: each rank finds out
            pass

    def _store_lost(self, why: str) -> None:
        if self.verdict is not None:
            return
        host_rank = next((r for r, i in self.peers.items() if i.get("store")), None)
        if host_rank is not None and host_rank != self.rank:
            info = self.peers[host_rank]
            gone = _gone(info) if self._local(info) else None
            self.verdict = Lost(host_rank, info["host"], info["pid"],
                                f"{gone or 'its host is unreachable'}; the c10d store it "
                                f"hosted at {info['store_at']} is unreachable ({why})")
        else:
            self.verdict = Lost(None, "?", 0,
                                f"the c10d store at {self.me['store_at']}, hosted by the "
                                "launcher (torchrun's agent, zerokern.tools.spawn's parent), is "
                                f"unreachable ({why}): the launcher or its host is gone")


_STATE: List[Optional[Liveness]] = [None]


def start(store, rank: int, world_size: int) -> Optional[Liveness]:
    """Start this process's watcher for the default group's store (once per store; a no-op at
    world size 1 or without a store)."""
    cur = _STATE[0]
    if store is None or world_size < 2:
        return cur
    if cur is not None and cur.main_store is store:
        return cur
    if cur is not None:
        cur.stop()
    try:
        _STATE[0] = Liveness(store, rank, world_size)
    except Exception:  # noqa: BLE001 - a store without clone(): no liveness, waits as before
        _STATE[0] = None
    return _STATE[0]


def stop() -> None:
    """Stop this process's watcher (its store's groups were destroyed: abort.forget_channels)."""
    cur, _STATE[0] = _STATE[0], None
    if cur is not None:
        cur.stop()
    pools = list(_WATCHED.values())  # their threads may still wait in an old collective
    _WATCHED.clear()
    for pool in pools:
        pool.shutdown(wait=False)


def current() -> Optional[Liveness]:
    return _STATE[0]


def verdict() -> Optional[Lost]:
    """The lost rank, once known (no I/O: read by the waits every poll)."""
    live = _STATE[0]
    return live.lost() if live is not None else None


def store_stalled() -> bool:
    live = _STATE[0]
    return live is not None and live.store_stalled()


_CONN_WORDS = ("connection closed", "connection reset", "broken pipe", "read error",
               "write error", "connection refused", "socket closed", "econnreset", "epipe",
               "connection was closed", "dist network error")


def is_connection_error(error: BaseException) -> bool:
    """gloo's (or the store's) error for a peer's connection that closed."""
    text = f"{type(error).__name__} {error}".lower()
    return isinstance(error, (RuntimeError, OSError, ConnectionError)) and any(
        w in text for w in _CONN_WORDS)


# [Note: one watcher thread per group] The helper thread that runs a watched collective is
# the group's own: a collective of one group waits there, never behind another group's. One
# thread for all groups deadlocked `zerokern train`'s save (the 2026-11-29 CI run): the async
# writer's commit agreement (on the checkpoint's own group, from the writer thread) and the
# main thread's gather of the train state (on the training group) queued on one thread in
# different orders on two ranks, each waiting for a peer's collective queued behind its own.
_WATCHED: Dict[Any, ThreadPoolExecutor] = {}


def watched(fn: Callable[[], object], what: str, group=None, poll_s: float = 0.05,
            on_poll: Optional[Callable[[], None]] = None):
    """Run fn (a blocking collective of torch's on `group`) on a helper thread and wait for
    it here, checking the verdict every poll_s: a lost peer raises PeerLost within a poll of
    the verdict even where the collective itself would wait for the process group's timeout
    (a node lost without closing its connections). Without a watcher, or on a group that is
    not gloo's (an NCCL collective takes the calling thread's current device): fn() here."""
    import torch.distributed as dist

    live = _STATE[0]
    if live is None or dist.get_backend(group) != "gloo":
        return fn()
    key = group if group is not None else dist.group.WORLD  # (one key for the default group)
    pool = _WATCHED.get(key)
    if pool is None:
        pool = _WATCHED[key] = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="zerokern-watched")
    fut = pool.submit(fn)
    while True:
        try:
            return fut.result(poll_s)
        except FutureTimeout:
            lost = live.lost()
            if lost is not None and not fut.done():
                raise peer_lost_error(lost, live.rank, what) from None
            if on_poll is not None:  # (abort.py's Waiting.poll: it may raise)
                on_poll()
