"""Ring reduce-scatter and all-gather over point-to-point sends, for gloo.

[Note: gloo collectives]
gloo's all-reduce is a tuned ring, but its reduce-scatter and all-gather are not: at 92 MB fp32
over 2 ranks on 2 cores we measured all_reduce 77 ms, reduce_scatter_tensor 142 ms,
all_gather_into_tensor 107 ms, while one exchange of halves with isend/irecv takes 35-38 ms.
A ring all-reduce *is* a reduce-scatter plus an all-gather, so ZeRO's two halves should each cost
half of it. These rings do: N-1 steps, each sending one 1/N chunk to rank r+1 while receiving
one from rank r-1, i.e. (N-1)/N of the buffer per rank, the DESIGN §5 volume exactly.

They run on one worker thread per process group, in submission order, so every rank issues the
same sends in the same order (the launch order is already identical across ranks), and the ring
overlaps with the caller's backward pass: the waits and the adds release the GIL.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from . import liveness, shm
from .abort import (
    PeerLost,
    RankAborted,
    explain,
    group_name,
    is_timeout,
    on_abort,
    polled,
    timeout_error,
)
from .pieces import Pieces


class RingRunner:
    """Runs ring collectives for one process group on a single background thread."""

    def __init__(self, group, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self._next = dist.get_global_rank(group, (rank + 1) % world_size) if group else \
            (rank + 1) % world_size
        self._prev = dist.get_global_rank(group, (rank - 1) % world_size) if group else \
            (rank - 1) % world_size
        # the peers' global ranks, named when a connection to one of them closes (liveness.py)
        me = dist.get_global_rank(group, rank) if group else rank
        self.peers = [r for r in (dist.get_process_group_ranks(group) if group else
                                   range(world_size)) if r != me]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerokern-ring")
        self._last: Future = None  # the latest submitted job (the queue runs in order)
        # [Note: a failed ring stops] the first failure of a job, or a RankAborted
        self._broken: Optional[str] = None
        on_abort(self.stop)
        # [Note: a shared-memory ring] (shm.py): None until the first collective that can use
        # it (set up then, on every rank alike), False where the ranks cannot share memory
        self._shm = None
        # the job running now (its number on the group's abort channel, fn, args), for
        # [Note: ranks stuck in different collectives] (abort.py); None between jobs
        self._job: Optional[Tuple[int, Any, tuple]] = None
        self.name = group_name(group)

    def stop(self, why: str) -> None:
        """No job submitted or queued from now on communicates: each raises at once.

        [Note: a failed ring stops] After a collective failed on this group (a peer died, a
        RankAborted), the jobs queued behind it must not run: their sends would meet peers
        that stopped at another collective, and gloo aborts the whole process on a message of
        the wrong size (seen as SIGABRT, 'Received data size doesn't match expected size',
        on a 2x2 mesh after one rank died). Each raises instead, at its handle."""
        if self._broken is None:
            self._broken = why

    def _run(self, fn, *args):
        if self._broken is not None:
            raise RuntimeError("zerokern: an earlier collective on this process group failed "
                               f"({self._broken}); this one was not run")
        try:
            return fn(*args)
        except BaseException as e:
            self.stop(f"{type(e).__name__}: {e}"[:500])
            what = getattr(fn, "__name__", "a collective").lstrip("_")
            # a peer's connection closed: the rank that was lost, by name (liveness.py
            # [Note: a rank that dies]), or the post of a peer that raised first (abort.py)
            lost = explain(e, f"a {what} on a ring of {self.world_size} ranks",
                                    self.peers)
            if lost is not None:
                raise lost from e
            if is_timeout(e) and not isinstance(e, RankAborted):
                v = liveness.verdict()
                if v is not None:  # a node lost without closing its connections
                    raise PeerLost(v, dist.get_rank(), f"a {what}") from e
                # gloo's 'Timed out waiting ...ms': say what to raise
                raise timeout_error(
                    f"the peers of rank {self.rank} (of {self.world_size}) in a {what} on "
                    "this process group's ring", shm._timeout_s(self.group), e) from e
            raise

    def close(self) -> None:
        """The group was destroyed (collectives.forget_groups): let the thread go."""
        self.stop("its process group was destroyed")
        self._pool.shutdown(wait=False)

    def submit(self, fn, *args, index: Optional[int] = None) -> Future:
        """Queue fn(*args); `index`: its number on the group's abort channel (self.position
        while it runs)."""
        self._last = self._pool.submit(self._run_at, index, fn, *args)
        return self._last

    def _run_at(self, index, fn, *args):
        self._job = None if index is None else (index, fn, args)
        try:
            return self._run(fn, *args)
        finally:
            self._job = None

    @property
    def position(self) -> Optional[Tuple[int, str]]:
        """(number, description) of the job running now, or None. The description is what
        every rank sees alike: the function and its tensors' sizes, never their types (a rank
        may pass a staging buffer where another passes Pieces). Formatted only when asked (a
        stalled wait), not per job."""
        job = self._job
        if job is None:
            return None
        index, fn, args = job
        name = getattr(fn, "__name__", "collective").lstrip("_")
        sizes = [str(a.numel()) for a in args if callable(getattr(a, "numel", None))]
        return index, f"{name} of {' and '.join(sizes) or 'no'} elements"

    def drain(self) -> None:
        """Wait until every job submitted so far has run (errors surface at their handle)."""
        if self._last is not None and not self._last.done():
            try:
                self._last.result()
            except Exception:  # noqa: BLE001 - reported by the handle that owns the job
                pass

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        if send.device.type != "cpu" or recv.device.type != "cpu":
            # gloo's send/recv would read a device address as a host pointer ([Note: the ring
            # is for CPU tensors] in collectives.py): refuse rather than crash.
            raise ValueError("zerokern's gloo ring takes CPU tensors only, got "
                             f"{send.device} and {recv.device}")
        ops = [dist.P2POp(dist.isend, send, self._next, self.group),
               dist.P2POp(dist.irecv, recv, self._prev, self.group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def _shm_for(self, t: torch.Tensor):
        """The shared-memory exchange for a collective on t, or None (TCP, send/recv)."""
        if self._shm is False or not shm.usable(t, self.world_size):
            return None
        self.connect_shm()  # collective: every rank takes part, also one that cannot
        return self._shm or None

    def connect_shm(self) -> None:
        """Collective, on the ring thread (submit it): set the shared-memory exchange up now
        rather than at the first collective that can use it (grads/sharded_grads.py: so the
        first backward reads its grads in place too)."""
        if self._shm is None:
            self._shm = shm.ShmExchange.connect(self.group, self.rank, self.world_size,
                                                lambda: self._broken) or False

    @property
    def uses_shm(self) -> bool:
        """Whether this group's collectives go through shared memory (set up at the first)."""
        return bool(self._shm)

    @property
    def shm_bytes(self) -> int:
        """This rank's shared-memory segment for the group (0 before the first collective or
        on TCP): a transport buffer, not a model state (memory_report's comm_buffers)."""
        return self._shm.own_bytes if self._shm else 0

    def all_reduce(self, t: torch.Tensor, op) -> None:
        """In place over the group: SUM of floats through shared memory where it can be,
        else gloo's all-reduce."""
        ex = self._shm_for(t) if (op == dist.ReduceOp.SUM and t.is_floating_point()) else None
        if ex is not None:
            ex.all_reduce(t)
        else:
            dist.all_reduce(t, op, self.group)

    def reduce_scatter(self, out: torch.Tensor, work: torch.Tensor) -> None:
        """out = sum over ranks of chunk `rank` of work; `work` is used as scratch.

        [Note: the ring's last step lands in out]
        When `out` is apart from `work` (stages 2-3: a grad shard), the last step receives rank
        r-1's partial of chunk r straight into out and adds our partial to it: no `recv`
        scratch for that step (none at all over 2 ranks) and no copy of chunk r into out
        afterwards. IEEE addition commutes, so recv + ours has the bits of ours + recv (the
        2-rank test checks them bit for bit). On the 20m GPT, stage 2, fp32, 2 ranks, that is
        4 fresh 13 MB scratch tensors and 46 MB of copying (read and write) less per step on
        the ring thread; benchmarks/step_paired_ab.py (both sides in one pair of ranks, the old
        function restored on one, median B/A over 16-20 alternated pairs): stage 2 0.981,
        0.979, 0.968; stage 3 0.951, 0.985, 0.882; the params bit-equal. An earlier variant,
        torch.add(chunk, recv, out=out), kept the scratch and measured within noise (stage 2,
        3 alternated pairs: 1.07-1.16x DDP with it, 1.04-1.08x without)."""
        n, r = self.world_size, self.rank
        if isinstance(work, Pieces):  # [Note: grads read where they lie] (pieces.py)
            ex = self._shm_for(work)  # (the same answer as for a staging buffer)
            if ex is not None and out.dtype == work.dtype and out.is_contiguous() and \
                    out.numel() * n == work.numel():
                ex.reduce_scatter(out, work, True)
                return
            work = work.materialize()  # the TCP ring works in a buffer
        chunks = work.chunk(n)
        into_out = _apart(out, work) and out.dtype == work.dtype and \
            out.shape == chunks[r].shape and out.is_contiguous()
        ex = self._shm_for(work)
        if ex is not None:  # the same choice: summed into out, or into chunk r, then copied
            ex.reduce_scatter(out, work, into_out)
            return
        recv = torch.empty_like(chunks[0]) if (n > 2 or not into_out) else None
        for s in range(n - 1):
            # Send our partial of chunk r-s-1; receive rank r-1's partial of chunk r-s-2 (on
            # the last step, s = n-2, that is chunk r).
            dst = chunks[(r - s - 2) % n]
            if into_out and s == n - 2:
                self._exchange(chunks[(r - s - 1) % n], out)
                out.add_(dst)
                return
            self._exchange(chunks[(r - s - 1) % n], recv)
            dst.add_(recv)
        if out.data_ptr() != chunks[r].data_ptr():  # else reduced in place (stage 1)
            out.copy_(chunks[r])

    def all_gather(self, out: torch.Tensor) -> None:
        """Chunk `rank` of out is ours; fill the others from the ring, in place."""
        ex = self._shm_for(out)
        if ex is not None:
            ex.all_gather(out)
            return
        n, r = self.world_size, self.rank
        chunks = out.chunk(n)
        for s in range(n - 1):
            self._exchange(chunks[(r - s) % n], chunks[(r - s - 1) % n])


def _apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b share no memory."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return True
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 + a.numel() * a.element_size() <= b0 or b0 + b.numel() * b.element_size() <= a0


class FutureWork:
    """A torch.distributed-like handle over a Future; its wait watches for the peers'
    failures (abort.py [Note: an error only some ranks see])."""

    def __init__(self, fut: Future, abort=None, index: int = 0) -> None:
        self._fut, self._abort, self._index = fut, abort, index

    @property
    def index(self) -> int:
        """The collective's number on its group's failure channel (abort.py)."""
        return self._index

    def wait(self) -> bool:
        if self._abort is not None and not self._fut.done():
            self._abort.wait(polled(self._fut.result, self._fut.done), self._index)
        self._fut.result()
        return True

    def is_completed(self) -> bool:
        return self._fut.done()
