"""Same-host ranks exchange through shared memory: the CPU ring's transport when it can be.

[Note: a shared-memory ring]
On one host, gloo's TCP loopback moves 1-2 GB/s per direction: the 20m GPT's stage-2 step
(2 ranks, fp32) spent 31-38 ms of its 44 ms on the all-gather of the updated params (40 MB each
way), and one 20 MB exchange took 10.4 ms alone; a copy of those bytes runs at 10-45 GB/s on
the same cores. Through these segments the step takes 23 ms, and the iteration, paired against
the same stage over TCP, 0.843x (stage 0), 0.859x (stage 2), 0.879x (stage 3)
(benchmarks/results/step-20m-n2-fp32-shm-paired.md). So ranks whose segments under /dev/shm
can all see each other exchange through them: each rank owns one segment (a header and two
slots of SLOT_BYTES), writes what its peers need into its own slot, and reads theirs.

Rounds. Every collective is cut into rounds of at most one slot; every rank runs the same
rounds in the same order (their number depends only on the sizes), counted by `_round`.
Round s uses slot s % 2 and, per rank, two 32-bit counters in its own header:
- `written` = s + 1 once the rank's slot holds round s's data;
- `consumed` = s + 1 once it has read every peer's slot for round s.
Before writing slot s % 2 a rank waits for every peer's consumed >= s - 1 (they have read
round s - 2 from that slot), then writes, publishes written, waits for each peer's written >=
s + 1, reads, publishes consumed. Each counter has one writer, and x86-64 keeps stores in order
(the data is visible before the counter that announces it): shared memory is used on x86-64
Linux only. A wait spins briefly, then sleeps on the counter with futex (woken by the writer),
waking every 50 ms to check that the ring was not stopped (comm/ring.py [Note: a failed ring
stops]), that every peer process still exists (peers in this pid namespace: a container may
share /dev/shm but not its pids), and the group's timeout: a peer that died or never comes is
an error, never a hang (at the timeout a CollectiveTimeout that says how long it waited and what
to raise: a peer merely slow on a busy machine looks the same from here). Each round also says
what it carries (kind and summed dtype, bytes, offset), checked by its readers: ranks that
issued different collectives raise instead of mixing the data (gloo's TCP path aborts on a size
mismatch; this one must not be quieter), and after any collective raised the exchange refuses
every later one (its rounds are out of step).

The sums. Reduce-scatter: rank r writes its input's chunks for the others into slot regions
(one per destination); the owner adds them to its own chunk in rank order (its own first), so
every chunk is summed by one rank and all-reduce (reduce-scatter, then all-gather) leaves the
same bits on every rank. Over 2 ranks that is ours + theirs, the same bits as the TCP ring's
theirs + ours (IEEE addition commutes).

Set-up is collective and lazy: the first collective that can use the segments (CPU, contiguous,
divisible into equal chunks: the same on every rank) creates them; if any rank cannot open every
peer's (another host, no /dev/shm, a segment that would leave less than half of /dev/shm free,
ZEROKERN_SHM=0), the group keeps the TCP ring for good. Each segment is unlinked once every
rank has mapped it, so nothing is left in /dev/shm after a crash. Memory: 2 slots of SLOT_BYTES
(4 MiB) per rank and ring group.
"""

from __future__ import annotations

import ctypes
import datetime
import mmap
import os
import platform
import secrets
import sys
import threading
import time
from typing import Callable, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from . import liveness
from .abort import PeerLost, timeout_error
from .pieces import Pieces

SLOT_BYTES = int(os.environ.get("ZEROKERN_SHM_SLOT_BYTES", 4 << 20))
_ALIGN = 64
_HDR = 4096
_WRITTEN, _CONSUMED = 0, 16  # uint32 indices into the header (64 bytes apart)
_DESC = 32  # uint32 index: per slot, what its round carries (kind, bytes, offset)
_AG, _RS = 1, 2
# a round's kind also names the dtype it sums (a table: Python's str hash differs per process)
_DTYPE_CODE = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}
_INFO = 512  # bytes each rank sends at set-up: ok, pid, cookie, path
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_MASK = 0xFFFFFFFF
_POLL_S = 0.05


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = None


def _syscall():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL in the call
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


def supported() -> bool:
    """Shared memory can be tried here: Linux x86-64 with /dev/shm, not disabled."""
    return (os.environ.get("ZEROKERN_SHM", "1") != "0" and sys.platform.startswith("linux")
            and platform.machine() == "x86_64" and os.path.isdir("/dev/shm")
            and os.access("/dev/shm", os.W_OK))


def _pid_ns() -> int:
    """This process's pid namespace (its inode), 0 where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _reached(value: int, target: int) -> bool:
    """value >= target on a 32-bit counter that wraps."""
    return ((value - target) & _MASK) < 0x80000000


def _timeout_s(group) -> float:
    try:
        return (group or dist.group.WORLD)._get_backend(
            torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - an older torch: its default
        t = dist.default_pg_timeout
        return t.total_seconds() if isinstance(t, datetime.timedelta) else 1800.0


class _Segment:
    """One rank's mapped segment: its header counters and its two slots."""

    def __init__(self, fd: int, size: int) -> None:
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.hdr = np.frombuffer(self.map, dtype=np.uint32, count=_HDR // 4)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.data = torch.frombuffer(self.map, dtype=torch.uint8)

    def slot(self, s: int) -> torch.Tensor:
        lo = _HDR + (s % 2) * SLOT_BYTES
        return self.data[lo:lo + SLOT_BYTES]


class ShmExchange:
    """All-gather, reduce-scatter and all-reduce of CPU tensors through shared memory, for one
    process group (RingRunner's transport, [Note: a shared-memory ring])."""

    def __init__(self, segs: List[_Segment], pids: List[int], rank: int, timeout_s: float,
                 stopped: Callable[[], Optional[str]],
                 global_ranks: Optional[List[int]] = None) -> None:
        self.segs, self.pids, self.rank, self.n = segs, pids, rank, len(segs)
        self.global_ranks = global_ranks or list(range(self.n))  # named in errors
        self.timeout_s, self._stopped = timeout_s, stopped
        self._round = 0
        self._lock = threading.Lock()  # one collective at a time (callers on two threads)
        self._failed: Optional[str] = None  # a collective raised: the rounds are out of step
        self._syscall = _syscall()

    # -- set-up ----------------------------------------------------------------------------------
    @classmethod
    def connect(cls, group, rank: int, n: int,
                stopped: Callable[[], Optional[str]]) -> Optional[ShmExchange]:
        """Collective over `group`: an exchange if every rank maps every peer's segment."""
        size = _HDR + 2 * SLOT_BYTES
        path, fd, own = None, -1, None
        cookie = secrets.token_bytes(16)
        ok = supported()
        if ok:
            try:
                st = os.statvfs("/dev/shm")
                # At most half of /dev/shm: DataLoader workers and others live there too (a
                # container's default is 64 MB): past that, TCP, slower but not an error.
                if st.f_bavail * st.f_frsize - size < st.f_blocks * st.f_frsize / 2:
                    raise OSError("/dev/shm would be more than half full")
                path = f"/dev/shm/zerokern-ring-{os.getpid()}-{secrets.token_hex(8)}"
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)  # the pages exist: no SIGBUS later
                own = _Segment(fd, size)
                own.map[_HDR - 32:_HDR - 16] = cookie
            except (OSError, ValueError):  # (the file, if made, is unlinked below)
                ok = False
        try:
            # numpy arrays under the tensors: read back without a tensor host read (the step path
            # is checked for those, tests/optimizer/test_no_host_sync.py)
            info = np.zeros(_INFO, dtype=np.uint8)
            if ok:
                raw = bytes([1]) + os.getpid().to_bytes(4, "little") + _pid_ns().to_bytes(
                    8, "little") + cookie + path.encode()
                info[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            infos = [np.zeros(_INFO, dtype=np.uint8) for _ in range(n)]
            dist.all_gather([torch.from_numpy(x) for x in infos], torch.from_numpy(info),
                            group=group)
            segs: List[Optional[_Segment]] = [None] * n
            pids = [0] * n
            for q, t in enumerate(infos):
                raw = t.tobytes()
                if not ok or raw[0] != 1:
                    ok = False
                    break
                # a peer's pid says whether it lives only within the same pid namespace (a
                # container may share /dev/shm but not its pids): elsewhere only the timeout
                pids[q] = int.from_bytes(raw[1:5], "little") if int.from_bytes(
                    raw[5:13], "little") == _pid_ns() else 0
                if q == rank:
                    segs[q] = own
                    continue
                try:
                    qfd = os.open(raw[29:].rstrip(b"\0").decode(), os.O_RDWR)
                    try:
                        if os.fstat(qfd).st_size != size:
                            raise OSError("a segment of another size")
                        seg = _Segment(qfd, size)
                    finally:
                        os.close(qfd)
                    if seg.map[_HDR - 32:_HDR - 16] != raw[13:29]:
                        raise OSError("not the peer's segment")  # another host's file
                    segs[q] = seg
                except (OSError, UnicodeDecodeError, ValueError):
                    ok = False
                    break
            flag = np.array([1 if ok else 0], dtype=np.int32)
            dist.all_reduce(torch.from_numpy(flag), op=dist.ReduceOp.MIN, group=group)
        finally:  # also when a collective here raised: nothing is left in /dev/shm
            if fd >= 0:
                os.close(fd)
            if path is not None:
                os.unlink(path)  # every rank has mapped it (or none will use it)
        if flag[0] != 1:
            return None
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        return cls(segs, pids, rank, _timeout_s(group), stopped, ranks)

    @property
    def own_bytes(self) -> int:
        """The bytes of this rank's segment (the peers' it maps are theirs)."""
        return len(self.segs[self.rank].map)

    # -- the counters ------------------------------------------------------------------------------
    def _publish(self, idx: int, value: int) -> None:
        seg = self.segs[self.rank]
        seg.hdr[idx] = value & _MASK
        self._syscall(_SYS_FUTEX, ctypes.c_void_p(seg.base + 4 * idx), _FUTEX_WAKE,
                      0x7FFFFFFF, None, None, 0)

    def _wait(self, q: int, idx: int, target: int) -> None:
        hdr = self.segs[q].hdr
        for _ in range(64):  # the peer is usually close behind: a short spin first
            if _reached(int(hdr[idx]), target):
                return
        addr = ctypes.c_void_p(self.segs[q].base + 4 * idx)
        ts = _Timespec(0, int(_POLL_S * 1e9))
        t0 = time.monotonic()
        while True:
            v = int(hdr[idx])
            if _reached(v, target):
                return
            expected = ctypes.c_int(v - (1 << 32) if v >= 1 << 31 else v)
            self._syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, expected, ctypes.byref(ts), None, 0)
            if _reached(int(hdr[idx]), target):
                return
            why = self._stopped()
            if why is not None:
                raise RuntimeError("zerokern: an earlier collective on this process group "
                                   f"failed ({why}); this one was stopped")
            try:
                if self.pids[q]:
                    os.kill(self.pids[q], 0)
            except ProcessLookupError:  # [Note: a rank that dies] in liveness.py
                raise liveness.exited(self.global_ranks[q], self.pids[q],
                                      "a shared-memory collective") from None
            except PermissionError:
                pass
            lost = liveness.verdict()  # (a field read) a rank lost elsewhere, or a zombie
            if lost is not None:
                raise PeerLost(lost, self.global_ranks[self.rank],
                               "a shared-memory collective")
            if time.monotonic() - t0 > self.timeout_s:
                # [Note: timeouts under load] a slow peer and a mismatched one look alike here
                raise timeout_error(
                    f"rank {q} in a shared-memory collective (rank {q} did not reach the same "
                    "collective)", time.monotonic() - t0)

    def _write(self, s: int, desc) -> None:
        """Round s's data is in our slot: say what it is, then that it is there."""
        hdr = self.segs[self.rank].hdr
        for i, x in enumerate(desc):
            hdr[_DESC + 4 * (s % 2) + i] = x & _MASK
        self._publish(_WRITTEN, s + 1)

    def _read(self, q: int, s: int, desc) -> None:
        """Wait for rank q's round s, and check it is the round we run: ranks that issued
        different collectives raise here rather than mix unrelated data (the TCP ring's gloo
        aborts on a size mismatch; this one must not be quieter)."""
        self._wait(q, _WRITTEN, s + 1)
        hdr = self.segs[q].hdr
        theirs = tuple(int(hdr[_DESC + 4 * (s % 2) + i]) for i in range(len(desc)))
        if theirs != tuple(x & _MASK for x in desc):
            names = {_AG: "all_gather", _RS: "reduce_scatter"}
            raise RuntimeError(
                "zerokern: the ranks issued different collectives on this process group: "
                f"rank {q} ran {names.get(theirs[0] & 15, theirs[0])} of {theirs[1]} bytes (at "
                f"byte {theirs[2]}) where rank {self.rank} ran "
                f"{names.get(desc[0] & 15, desc[0])} of {desc[1]} bytes (at byte {desc[2]})")

    def _peers(self):
        return [(self.rank + i) % self.n for i in range(1, self.n)]

    def _begin(self) -> int:
        s = self._round
        self._round += 1
        for q in self._peers():  # they have read round s - 2 from the slot we reuse
            self._wait(q, _CONSUMED, s - 1)
        return s

    # -- collectives -----------------------------------------------------------------------------
    def _run(self, fn, *args) -> None:
        """One collective at a time; after one raised, every later one raises at once (its
        rounds would no longer line up with the peers')."""
        with self._lock:
            if self._failed is not None:
                raise RuntimeError("zerokern: an earlier shared-memory collective on this "
                                   f"process group failed ({self._failed}); this one was not run")
            try:
                fn(*args)
            except BaseException as e:
                self._failed = f"{type(e).__name__}: {e}"[:300]
                raise

    def all_gather(self, out: torch.Tensor) -> None:
        """out's n equal chunks: ours is chunk rank; the others are filled from the peers."""
        self._run(self._all_gather, out)

    def reduce_scatter(self, out: torch.Tensor, work: torch.Tensor,
                       into_out: bool = False) -> None:
        """out = sum over ranks of chunk `rank` of work: summed straight into out where
        `into_out` (out shares no memory with work, has chunk rank's dtype and shape and is
        contiguous: the ring's own test), else into that chunk, then copied unless out is
        it."""
        self._run(self._reduce_scatter, out, work, into_out)

    def _all_gather(self, out: torch.Tensor) -> None:
        b = out.view(-1).view(torch.uint8)
        S = b.numel() // self.n
        r = self.rank
        for a in range(0, S, SLOT_BYTES):
            L = min(SLOT_BYTES, S - a)
            s = self._begin()
            self.segs[r].slot(s)[:L].copy_(b[r * S + a:r * S + a + L])
            desc = (_AG, b.numel(), a)
            self._write(s, desc)
            for q in self._peers():
                self._read(q, s, desc)
                b[q * S + a:q * S + a + L].copy_(self.segs[q].slot(s)[:L])
            self._publish(_CONSUMED, s + 1)

    def _reduce_scatter(self, out: torch.Tensor, work, into_out: bool) -> None:
        n, r = self.n, self.rank
        if isinstance(work, Pieces):  # [Note: grads read where they lie] (pieces.py)
            if not into_out:
                raise ValueError("a reduce-scatter of Pieces lands in an output of its own")
            w, dtype, S = work, work.dtype, work.numel() // n

            def send(dst, q, a):  # dst := chunk q's elements [a, a + L)
                work.copy_to(dst, q * S + a)

            def add_ours(theirs, acc, a):  # acc := ours [a, a + L) + theirs
                work.add_to(theirs, acc, r * S + a)
            dst = out.view(-1)
        else:
            w = work.view(-1)
            dtype, S = w.dtype, w.numel() // n
            chunks = [w[q * S:(q + 1) * S] for q in range(n)]

            def send(dst, q, a):
                dst.copy_(chunks[q][a:a + dst.numel()])

            def add_ours(theirs, acc, a):
                torch.add(chunks[r][a:a + acc.numel()], theirs, out=acc)
            dst = out.view(-1) if into_out else chunks[r]
        esz = w.element_size()
        region = (SLOT_BYTES // n) // _ALIGN * _ALIGN // esz  # elements per destination
        if region < 1:
            raise ValueError(f"ZEROKERN_SHM_SLOT_BYTES={SLOT_BYTES} is too small for "
                             f"{n} ranks")
        for a in range(0, S, region):
            L = min(region, S - a)
            s = self._begin()
            slot = self.segs[r].slot(s)
            for d in self._peers():
                send(slot[d * region * esz:(d * region + L) * esz].view(dtype), d, a)
            desc = (_RS + 16 * _DTYPE_CODE.get(dtype, 16 + esz), w.numel() * esz,
                    a * esz)
            self._write(s, desc)
            acc, first = dst[a:a + L], True
            for q in range(n):  # ours first, then the peers in rank order
                if q == r:
                    continue
                self._read(q, s, desc)
                theirs = self.segs[q].slot(s)[r * region * esz:(r * region + L) * esz] \
                    .view(dtype)
                if first:
                    add_ours(theirs, acc, a)
                    first = False
                else:
                    acc.add_(theirs)
            self._publish(_CONSUMED, s + 1)
        if dst.data_ptr() != out.data_ptr() or dst.dtype != out.dtype:
            out.copy_(dst.view(out.shape))

    def all_reduce(self, t: torch.Tensor) -> None:
        """SUM in place: reduce-scatter into our chunk, then all-gather (the same bits on every
        rank)."""
        flat = t.view(-1)
        S = flat.numel() // self.n
        self.reduce_scatter(flat[self.rank * S:(self.rank + 1) * S], flat)
        self.all_gather(flat)


def usable(t, n: int) -> bool:
    """The segments can carry a collective on t (a tensor or Pieces): the same answer on every
    rank (it depends only on what every rank passes alike; a staging buffer is contiguous, as
    Pieces reads, so a rank passing either decides alike)."""
    return t.device.type == "cpu" and (isinstance(t, Pieces) or t.is_contiguous()) \
        and t.numel() % n == 0 and t.numel() > 0
