"""An error that only some ranks see reaches every rank within a poll interval, not a timeout.

[Note: an error only some ranks see]
Some errors are found on one rank only: a `p.grad` cleared between backward and step() on one
rank, a param file found truncated by one rank's read during a forward (stage 3,
offload_params="nvme"). That rank raises before its next collective; the others are left
waiting in that collective until the process-group timeout (60 s in the tests, 30 min by
default), then fail with an opaque gloo error (issue 21, item 9). So the failing rank posts
the error in the process group's store (`signal`) before raising, and every wait of ours polls
the store while the collective has not landed (`wait`): a rank whose peer failed raises
`RankAborted`, naming the peer and its error, within POLL_S of the post (measured: 0.1-0.3 s
on 2 busy cores at N = 2, 3, against the 60 s timeout).

Which failure applies to whom. Errors raised on every rank at the same point (bad input, the
same p.grad cleared everywhere) are posted too and must not stop a rank that went on with the
others; so each post records how many collectives its rank had issued (`issued`, counted in
the same order on every rank: [Note: collective order] in grad_sync.py), and a rank waiting on
collective m raises for a peer's post at n <= m only if it did not post at n itself. A rank
that posted and raised issues nothing after (its caller's training loop ends); the waiters'
collectives never complete, so after a RankAborted the process group is out of step and
cannot be used: every rank should exit (a launcher restarts from the last checkpoint).

A rank killed without a post (SIGKILL, a lost node) is found by liveness.py ([Note: a rank
that dies]): `check` reads its verdict first and raises PeerLost, a RankAborted naming it.

Cost: nothing while collectives land within POLL_S; after that one store round trip per
POLL_S while waiting (about 0.1 ms on a local TCPStore). The store is the default group's
(torch.distributed's private `_get_default_store`); without it (or at world size 1) there is
nothing to post and waits are plain waits.

[Note: aborts cross groups] With a mesh a rank is in several groups (shard, replicate, world,
hpZ's node group) and its peers in one group may be waiting in another: rank 2 of a 2x2 mesh
learns of rank 0's failure in their replicate group, while rank 3 waits for rank 2 in their
shard group. So a rank that raises RankAborted posts it on every other channel of this
process before raising: the failure crosses every group one hop at a time, and every rank of
the mesh raises, none waits for the timeout. Such a post counts for every collective (index
-1), not from this rank's issued count: what it queued on a ring behind the collective that
never completes will never run either (measured: at the issued count, rank 0 of a 2x2 mesh
waited for its replicate all-reduce with rank 2, queued behind rank 2's stuck reduce-scatter,
until the timeout). The process group is out of step after any RankAborted anyway.

Ring waits only: gloo's default path (comm/ring.py) runs every collective on a thread of ours,
whose futures can be polled; with ZEROKERN_GLOO_RING=0 a gloo Work's is_completed() was seen
never to turn True for its reduce-scatter, so those waits are torch's, unwatched. On NCCL a
wait makes the stream wait and the host goes on, so a peer's post is not seen there (NCCL's
watchdog still aborts at its timeout): that needs a watchdog thread that aborts the
communicator, not written here (no GPU to test it on).
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from . import liveness
from .errors import CollectiveMismatch, PeerLost, RankAborted  # noqa: F401 (names here too)

POLL_S = 0.05  # s between store checks while a collective has not landed
STALL_S = 2.0  # s a wait lasts before the ranks' positions are compared, and between compares
PG_TIMEOUT_ENV = "ZEROKERN_PG_TIMEOUT_S"  # spawn.py and `zerokern train`: the group's timeout
PG_TIMEOUT_KNOB = (
    "raise the process group's timeout: init_process_group(..., timeout=datetime.timedelta("
    "seconds=...)) in your script (zerokern.init_distributed(timeout=...)), or "
    f"{PG_TIMEOUT_ENV}=<seconds> for `zerokern train` and zerokern.tools.spawn.spawn_ranks")


class CollectiveTimeout(RuntimeError):
    """A collective of ours waited the process group's timeout for a peer and gave up
    ([Note: timeouts under load] in docs/troubleshooting.md): the message names the wait, the
    seconds waited and the setting to raise (PG_TIMEOUT_KNOB)."""


def is_timeout(error: BaseException) -> bool:
    """gloo's (or the store's) own timeout error: 'Timed out waiting 60000ms for recv ...'."""
    if isinstance(error, CollectiveTimeout) or str(error).startswith("zerokern:"):
        return False  # ours, already explained (e.g. "an earlier collective ... failed (...)")
    text = str(error).lower()
    return isinstance(error, (RuntimeError, TimeoutError)) and (
        "timed out" in text or "timeout" in text)


def timeout_error(what: str, waited_s: float, error: Optional[BaseException] = None
                  ) -> CollectiveTimeout:
    """The error for a wait that reached the process group's timeout: what it waited for, how
    long, the two causes (a slow peer on a busy machine, or ranks that issued different
    collectives), and the setting to raise."""
    cause = f" ({type(error).__name__}: {str(error)[:300]})" if error is not None else ""
    return CollectiveTimeout(
        f"zerokern: timed out after {waited_s:.0f} s (the process group's timeout) waiting for "
        f"{what}{cause}. Either a peer rank is slower than that (a busy machine, a long step "
        "or checkpoint on one rank) or the ranks issued different collectives. If the ranks "
        f"are only slow, {PG_TIMEOUT_KNOB}")
_ALL: list = []  # every AbortChannel of this process ([Note: aborts cross groups])
_ON_ABORT: list = []  # called with the reason when this rank raises RankAborted (ring.py)


def on_abort(method: Callable[[str], None]) -> None:
    """Call the bound method(reason) when this process raises RankAborted ([Note: a failed
    ring stops]); held weakly, so its object (a ring and its thread) can still be freed."""
    _ON_ABORT[:] = [m for m in _ON_ABORT if m() is not None]
    _ON_ABORT.append(weakref.WeakMethod(method))


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private API: without it, no posting
        return None


def forget_channels() -> None:
    """Drop every channel and stop the liveness watcher: the process groups they served were
    destroyed (comm/quorum.py); the first channel of the next groups starts a new watcher on
    the new store, without the old verdict or posts."""
    _ALL.clear()
    liveness.stop()


class AbortChannel:
    """Per process group: post this rank's failure, and see the peers' while waiting."""

    def __init__(self, group, rank: int) -> None:
        # the global rank: posts name it, and a failure crosses groups ([Note: aborts cross
        # groups]), where group ranks would name different processes
        self.rank = dist.get_rank() if dist.is_initialized() else rank
        self.issued = 0          # collectives issued on this group (and its split) so far
        self._mine = set()       # `issued` at each of this rank's posts
        self.store = _default_store()
        if dist.is_initialized():  # [Note: a rank that dies] in liveness.py: once per process
            liveness.start(self.store, self.rank, dist.get_world_size())
        self.key = f"zerokern/abort/{group_name(group)}"
        self.rings: list = []  # the rings counting on this channel (the group's, its split's)
        self._posted: set = set()  # store keys of this rank's positions now posted
        _ALL.append(self)

    def withdraw_positions(self) -> None:
        """The stalled wait ended: delete this rank's posted positions, so that no later
        process group on the same store reads them ([Note: ranks stuck in different
        collectives])."""
        keys, self._posted = self._posted, set()
        for k in keys:
            try:
                self.store.delete_key(k)
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to read it
                pass

    def watch_ring(self, ring) -> None:
        """Compare `ring`'s running job with the peers' when a wait stalls ([Note: ranks stuck
        in different collectives]); anything with `position`, `name` and `peers`."""
        if all(r is not ring for r in self.rings):
            self.rings.append(ring)

    def unwatch_ring(self, ring) -> None:
        self.rings = [r for r in self.rings if r is not ring]

    def compare_positions(self) -> None:
        """[Note: ranks stuck in different collectives]
        A branch that runs collectives on some ranks only (`if rank == 0:` around
        opt.gathered_params(), a checkpoint save, a clip) leaves each rank waiting in a
        different collective, each for its peers, until the process group's timeout (60 s in
        the tests, 30 min by default): a hang. Every collective's number on this channel
        counts in program order, the same on every rank ([Note: collective order]), and each
        ring says which job it runs (ring.position: number and description). So a wait that
        lasts STALL_S posts this rank's position in the store and reads its peers'; a peer
        stuck at the same number in another collective is proof that the ranks went apart,
        and every rank raises CollectiveMismatch naming both, within about STALL_S (probe:
        rank 0 alone in gathered_params() at stage 3, N = 2: a CollectiveTimeout after 60 s
        before). Positions at different numbers prove nothing (a peer may just be slow), so
        they are left to the timeout. zk.checkpoint's object all-gathers (torch's, on a helper
        thread) take a number and a position too (Waiting below): a save on rank 0 alone at
        stage 2 raised after 60 s, now 2.1 s. Cost: nothing while collectives land within
        STALL_S; then one store write and a read per peer every STALL_S."""
        for ring in self.rings:
            at = ring.position
            if at is None:
                continue
            index, what = at
            base = f"{self.key}/at/{ring.name}"
            try:
                self.store.set(f"{base}/{self.rank}", f"{index}|{what}")
                self._posted.add(f"{base}/{self.rank}")
                theirs = {}
                for r in ring.peers:
                    k = f"{base}/{r}"
                    if self.store.check([k]):
                        theirs[r] = self.store.get(k).decode()
            except Exception:  # noqa: BLE001 - the store is gone: liveness.py judges that
                return
            for r, rec in theirs.items():
                n, _, other = rec.partition("|")
                if int(n) == index and other != what:
                    err = CollectiveMismatch(
                        f"zerokern: the ranks issued different collectives on this process "
                        f"group: rank {self.rank} waits in a {what}, rank {r} in a {other}, "
                        f"both at collective #{index} of the group, for more than "
                        f"{STALL_S:.0f} s. Code that runs collectives on some ranks only must "
                        "run on every rank: `with opt.gathered_params():` (saving a stage-3 "
                        "model), zk.checkpoint.save, opt.clip_grad_norm_, a backward or a "
                        "step under `if rank == 0:`. Every rank raises this; the process "
                        "group is now out of step and cannot be used again: exit and restart "
                        "from the last checkpoint")
                    err.origin, err.root = self.rank, str(err)
                    self.signal(err, at=-1)  # the peers raise it too, even if they exit first
                    self._abort(err, f"rank {r} waits in another collective")

    def next_index(self) -> int:
        i = self.issued
        self.issued += 1
        return i

    def signal(self, error: BaseException, at: Optional[int] = None) -> None:
        """Post this rank's error (then the caller raises it): peers waiting in collective
        `at` (default: the next one this rank would issue) or later raise."""
        if self.store is None:
            return
        n = self.issued if at is None else at
        self._mine.add(n)
        try:  # "origin|message": a RankAborted passes on the failure it was told of
            origin = getattr(error, "origin", self.rank)
            root = getattr(error, "root", None) or f"{type(error).__name__}: {error}"
            msg = f"{origin}|{root}"[:4000]
            self.store.set(f"{self.key}/{self.rank}/{n}", msg)
            self.store.append(self.key, f"{self.rank}:{n};")
        except Exception:  # noqa: BLE001 - the store is gone: the caller's error stands
            pass

    def check(self, index: int) -> None:
        """Raise RankAborted if a peer posted a failure this rank did not share, before
        issuing collective `index` (the one this rank waits for); PeerLost if a rank was lost
        (liveness.py: a field read, no store operation)."""
        lost = liveness.verdict()
        if lost is not None:
            self._abort(PeerLost(lost, self.rank), f"rank {lost.rank} was lost")
        if self.store is None or liveness.store_stalled():
            return  # (a store not answering: the liveness thread judges it, not this wait)
        try:
            if not self.store.check([self.key]):
                return
            recs = self.store.get(self.key).decode().split(";")
        except Exception as e:  # noqa: BLE001 - the store's host is gone
            live = liveness.current()
            if live is None:
                raise
            live._store_lost(f"{type(e).__name__}: {str(e)[:200]}")
            self._abort(PeerLost(live.verdict, self.rank), "the store was lost")
        for rec in recs:
            if not rec:
                continue
            r, n = (int(x) for x in rec.split(":"))
            if r != self.rank and n <= index and n not in self._mine:
                origin, _, msg = self.store.get(f"{self.key}/{r}/{n}").decode().partition("|")
                err = RankAborted(
                    f"zerokern: rank {origin} failed and stopped before a collective this rank "
                    f"(rank {self.rank}) is waiting in: {msg}\nEvery rank raises this; the "
                    "process group is now out of step and cannot be used again: exit and "
                    "restart from the last checkpoint")
                err.origin, err.root = int(origin), msg
                self._abort(err, f"rank {origin} failed")

    def _abort(self, err: RankAborted, why: str) -> None:
        """Pass err on to every other group of this process, stop the rings, raise it. A
        PeerLost is not posted: every rank reads the verdict itself (liveness.py), and the
        store may be what was lost (a post would wait for its timeout)."""
        for ch in _ALL:  # [Note: aborts cross groups]
            if ch is not self and not isinstance(err, PeerLost):
                ch.signal(err, at=-1)
        for ref in _ON_ABORT:  # [Note: a failed ring stops] in ring.py
            fn = ref()
            if fn is not None:
                fn(why)
        raise err

    def wait(self, done: Callable[[Optional[float]], bool], index: int) -> None:
        """Block until done(timeout) says the collective landed, checking the peers' posts
        every POLL_S. done(t) waits up to t seconds (None: for good) and returns whether the
        collective landed."""
        if self.store is None:
            done(None)
            return
        compare_at = time.monotonic() + STALL_S
        while not done(POLL_S):
            self.check(index)
            compare_at = _compare_when_stalled((self,), compare_at)
        _withdraw((self,))


class Waiting:
    """A blocking collective of torch's (not a ring job) that the ranks' positions include
    ([Note: ranks stuck in different collectives]): it takes the group's next number, and
    while it waits `poll()` compares every STALL_S, as AbortChannel.wait does for a ring's
    job. `what` must read alike on every rank. Use as a context manager."""

    def __init__(self, channel: AbortChannel, group, what: str) -> None:
        self.channel = channel
        self.position = (channel.next_index(), what)
        self.name = group_name(group)
        me = dist.get_rank()
        self.peers = [r for r in dist.get_process_group_ranks(group) if r != me]
        self._compare_at = time.monotonic() + STALL_S

    def __enter__(self) -> Waiting:
        self.channel.watch_ring(self)
        return self

    def __exit__(self, *exc) -> None:
        self.channel.unwatch_ring(self)
        _withdraw((self.channel,))

    def poll(self) -> None:
        self._compare_at = _compare_when_stalled((self.channel,), self._compare_at)


class Watch:
    """AbortChannel.wait over several (channel, index) pairs: a handle whose collectives run
    on more than one group (comm/groups.py's HSDP reduce-scatter then replicate all-reduce)."""

    def __init__(self, *pairs) -> None:
        self.pairs = [(c, i) for c, i in pairs if c is not None]

    def wait(self, done: Callable[[Optional[float]], bool], index: int = 0) -> None:
        if all(c.store is None for c, _ in self.pairs):
            done(None)
            return
        compare_at = time.monotonic() + STALL_S
        channels = [c for c, _ in self.pairs]
        while not done(POLL_S):
            for c, i in self.pairs:
                c.check(i)
            compare_at = _compare_when_stalled(channels, compare_at)
        _withdraw(channels)


def group_name(group) -> str:
    """A process group's name in the store's keys, alike on every rank."""
    return getattr(group, "group_name", None) or "world"


def _compare_when_stalled(channels, compare_at: float) -> float:
    """A stalled wait's position compare, due at `compare_at` ([Note: ranks stuck in
    different collectives]); returns when the next is due."""
    if time.monotonic() < compare_at:
        return compare_at
    for c in channels:
        if c.store is not None and c.rings:
            c.compare_positions()
    return time.monotonic() + STALL_S


def _withdraw(channels) -> None:
    """The wait ended: withdraw the positions it posted."""
    for c in channels:
        if c._posted:
            c.withdraw_positions()


def polled(fut_wait: Callable[[float], None], is_done: Callable[[], bool]):
    """done(timeout) for AbortChannel.wait from a blocking wait with a timeout that raises
    concurrent.futures' TimeoutError, and a completion test."""

    def done(timeout: Optional[float]) -> bool:
        if timeout is None:
            fut_wait(None)
            return True
        try:
            fut_wait(timeout)
        except FutureTimeout:
            return is_done()
        return True

    return done


def explain(error: BaseException, what: str, candidates: Sequence[int] = ()
            ) -> Optional[BaseException]:
    """The error to raise for `error`, met in `what`: PeerLost naming the lost rank when the
    error is a closed connection (a peer's post of its own error first: abort.py), else None
    (the caller's error stands). Names the rank at once when its pid is gone on this host;
    else waits for the thread's verdict at most CONFIRM_S, then says which peers it talked
    to and that no rank was identified."""
    live = liveness.current()
    if live is None or isinstance(error, RankAborted) or not liveness.is_connection_error(error):
        return None

    try:  # a peer that raised posted its error before its connections closed
        for ch in list(_ALL):
            ch.check(1 << 62)
    except RankAborted as e:  # (or PeerLost: the verdict is already in)
        return e
    deadline = time.monotonic() + liveness.CONFIRM_S
    while True:
        lost = live.verdict or live.check_pids()
        if lost is not None:
            return PeerLost(lost, live.rank, what)
        if time.monotonic() > deadline:
            break
        time.sleep(liveness.BEAT_S / 5)
    peers = ", ".join(str(c) for c in candidates) or "?"
    why = (f"a connection to a peer (rank(s) {peers}) closed during {what} "
           f"({str(error)[:200]}); no rank was identified within {liveness.CONFIRM_S:g} s (a "
           "peer process exited or died on another host, or its host was lost; its own log "
           "says which)")
    return PeerLost(liveness.Lost(candidates[0] if len(candidates) == 1 else None, "?", 0, why),
                    live.rank, what)
