"""ZeRO-Infinity's optimizer half (`offload="nvme"`): the master and the rule's states on disk.

Per rank and flat buffer (group) there is one file under `offload_path` per state tensor
(the master, then the buffer's rule's states: nvme_state.names), each two halves of
`align_up(numel * itemsize)` bytes (nvme_state [Note: any StateSpec in a file, aligned]: fp32
per element, uint8 codes, fp32 per-block absmax). One step
streams every buffer through a bounded pool of aligned host buffer sets, in chunks of
`chunk_numel` elements over the buffer's whole state range (not per bucket piece, so every
O_DIRECT offset is aligned; a chunk that straddles two bucket pieces is updated piece by piece
and written once both are done):

    read chunk c+1..c+depth-1 (current half)  ->  [pool]  ->  cpu kernel on chunk c
        (grad D2H, master and states updated by the rule, 16-bit params H2D)  ->  write chunk c
        (the other half)  ->  the set is free for the next read

Reads and writes run in a thread pool (os.preadv / os.pwritev release the GIL) while the main
thread runs the same fused cpu kernel as offload="cpu". `finish()` (after the last piece)
waits for the writes and commits.

[Note: a phased rule over NVMe]
A phased rule (Muon: rules/muon.py [Note: the Muon group step]) does not update a piece in one
call: it reads and writes some of its states per piece in one pass (Muon: the momentum, then
after the cross-rank Newton-Schulz the master), through `map_piece_(gi, k, names, fn)`, which
every placement offers (in memory: one call on the piece's views). Here each pass streams only
the files it names (the rule's `nvme_passes`, in order: the step's read plan is known at
begin()), chunk by chunk, reading the current half and writing the other one, so the journal
holds as for a per-piece rule: every file of every buffer has its other half written whole by
the step's passes (Muon: momentum in pass 1, master in pass 2) before the flip. The
orthogonalizer's whole-matrix update is an fp32 scratch of the buffer's state size in host
memory for the step (as with offload="cpu"); the state never is. Measured
(benchmarks/results/nvme-rules-step.md, 1 process, stage 2, bf16, the shared 2-core VM at load
~13): a Muon step is dominated by bf16 Newton-Schulz on the CPU (1.6-23 s), and device / "cpu"
/ "nvme" medians differ by less than the run-to-run spread (23.2M GPT: 22.7 / 24.2 / 16.6 s).

[Note: a read pass writes nothing]
A pass the rule declares read-only (`nvme_read_passes`: Adafactor's pass 1, which copies the
master into its exchange) reads its chunks from the current half and hands each set back
without writing it: the other half of those files is written whole by a later pass (the rule
declaration is checked, zerokern.rules `_unwritten_read_passes`). Adafactor's master then
moves 3 times per step instead of 4 (read, read, write: 12 bytes per element, not 16).

[Note: one write in flight per range]
Two writes to the same bytes from the I/O threads land in whichever order the threads run. A
rule whose passes write the same file twice (Adafactor wrote pass 1's master behind unchanged
before it had a read pass; a rule may still declare two writing passes over one file) writes
each chunk of the other half twice, and the second must land last. A write is therefore
submitted only once no earlier write of the step to an overlapping range of a shared file is in
flight (`_order_write`: it waits for that one). Without it, a first-pass write held up under
load landed after the second pass's and the step's update was lost from the master while the
params on the device had it (CI: Adafactor, stage 3, N=1, params 0.109 off relative, states
bitwise; tests/rules/test_adafactor.py test_late_first_pass_writes_land_first_n2 runs
Adafactor with both passes writing, holds pass 1's writes back 0.2 s and fails without it).
The wait costs nothing in the usual order: pass 1's write of a chunk was submitted a whole
exchange (the gather, the owners' update, the scatter) before pass 2's.

[Note: all or nothing]
A step never writes the half it reads. The current half is `self.cur`, one index for every
file of this rank; the step reads half `cur` and writes half `1 - cur`, and only once every
write of every buffer has completed do all ranks agree (one all-reduce of a failure flag) and
flip `cur`. On any failure (ENOSPC, EIO, a short read of a truncated file) on any rank, no rank
flips: the master and states are still the untouched current half, the step counters are
restored from the copy taken in `begin()`, the params already written to the device are re-cast
from the current master (and re-gathered at stages 1-2, collectively, so no rank hangs), the loss
scale is not updated (step() raises before it), and each rank raises: the failing one an OSError
naming the path, the others a RuntimeError. The flip lives in memory, not in an fsync'ed header:
the files never outlive the process (removed at close, GC and exit), so there is no crash to
recover from; durable state is zerokern.checkpoint's job. The state files are preallocated (both
halves) at construction, so a disk that is full fails there, not in a step, on file systems that
allocate.

[Note: direct I/O, chunk and depth, measured] is in aligned_io.py: O_DIRECT (buffered I/O,
fadvise(DONTNEED), where it is refused), CHUNK_NUMEL and QUEUE_DEPTH, with the numbers.

[Note: where the state is visible] is in nvme_state.py: the master and states are mmap views
of the current half, re-pointed at each flip.
"""

from __future__ import annotations

import collections
import errno
import os
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import List, Optional

import torch

from zerokern.rules import Rule, check_rule, rule_for
from zerokern.rules.registry import adamw_rule
from zerokern.state import aligned_io as aio
from zerokern.state.nvme_pool import (  # noqa: F401 (CHUNK_NUMEL, QUEUE_DEPTH: re-exported)
    CHUNK_NUMEL,
    QUEUE_DEPTH,
    NvmeBytes,
    _Set,
    pool_chunk,
    request_span,
    rules_granule,
    step_plan,
)
from zerokern.state.nvme_state import DiskState, cleanup, names
from zerokern.state.offload import CopyPipeline

MAX_DEPTH = 16


class StepPhase(Enum):
    """Where NvmeOffloader is in a step (an I/O failure is recorded apart, in `error`)."""

    IDLE = "idle"          # between steps: no I/O in flight, `plan` None
    STARTED = "started"    # begin() ran: reads ahead; found_inf not read yet
    UPDATING = "updating"  # found_inf read, no overflow: pieces are updated and written
    SKIPPED = "skipped"    # found_inf read, overflow: no I/O, nothing changes, no flip


class NvmeOffloader(NvmeBytes, CopyPipeline):
    """offload="nvme": the state in files (DiskState per buffer, nvme_state.py); the update
    streams every piece of every buffer from and to disk (placement.py)."""

    offload = "nvme"
    movable = False

    def __init__(self, grad_dtype: torch.dtype, offload_path: str, roles,
                 chunk_numel: Optional[int] = None, queue_depth: Optional[int] = None,
                 rule: Optional[Rule] = None, rules: Optional[List[Rule]] = None) -> None:
        self.rule = check_rule(adamw_rule() if rule is None else rule)
        # one rule per param group (zerokern.rules [Note: a rule per param group]), or None
        self.rules = None if rules is None else [check_rule(r) for r in rules]
        self.distinct = list(dict.fromkeys(self.rules or [self.rule]))
        self.names = tuple(dict.fromkeys(n for r in self.distinct for n in names(r)))
        max_files = max(len(names(r)) for r in self.distinct)
        # the optimizer's ParallelPlan (comm/plan.py): its dp groups, and the commit's
        # agreement over every rank holding state files ([Note: one parallel plan])
        self.roles = roles
        self.comm = roles.comm
        self.root = offload_path
        self.grad_dtype = grad_dtype
        self.direct = aio.direct_supported(self.root)
        self.fault_hook = None  # tests: fault(path, offset) in the writer, may raise OSError
        self.tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.files: List[DiskState] = []
        # Threads start on demand, one per request in flight: at most one per file per set.
        self.io = ThreadPoolExecutor(max_workers=max_files * MAX_DEPTH,
                                     thread_name_prefix="zk-nvme")
        self._finalizer = weakref.finalize(self, cleanup, self.files, self.io, os.getpid())
        self.cur = 0
        self.plan = None
        # offload_params="nvme" (stage3/param_offload.py): its param files are checked with
        # the state files, written in the step, and flipped by the same commit.
        self.extra_files: list = []
        self.commit_hooks: list = []
        self.phase = StepPhase.IDLE
        self._pool_args = (chunk_numel, queue_depth)
        self.io_wait_s = 0.0  # host seconds waiting on the disk (bench diagnostics)
        self.bytes_moved = 0

    # -- files (nvme_state.py) -----------------------------------------------------------------
    def allocate(self, buf) -> DiskState:
        """The buffer's state files, the master streamed from its params (Note: lazy state)."""
        # file names: the world rank (HSDP replicas hold the same shard rank)
        f = DiskState(buf, len(self.files), self.comm.world.rank, self.root, self.tag,
                      rule_for(self, buf))
        self.files.append(f)
        try:
            f.create(buf, self.direct)
        except OSError as e:
            self._finalizer()
            raise ValueError(f"offload_path {self.root!r}: cannot create the state files "
                             f"({e.strerror}: {e.filename})") from e
        f.point(self.cur)
        return f

    def attach(self, buffers) -> None:
        self.groups = buffers
        self.dtype = buffers[0].dtype
        self._init_copies(buffers[0].device)  # stream, host scalars (offload.py)
        self.pin = self.streamed
        self.configure(*self._pool_args)

    def close(self) -> None:
        """Remove the state files now (the optimizer cannot step afterwards)."""
        for f in self.files:
            f.release()
        self._finalizer()

    def paths(self) -> List[str]:
        return [p for f in self.files for p in f.paths]

    # -- the pool ------------------------------------------------------------------------------
    def configure(self, chunk_numel: Optional[int] = None, queue_depth: Optional[int] = None
                  ) -> None:
        """Set the chunk (a multiple of the rules' granule, 1024 elements for fp32 states:
        4096-byte O_DIRECT requests, nvme_state [Note: any StateSpec in a file, aligned]) and
        the number of buffer sets; between steps."""
        chunk = CHUNK_NUMEL if chunk_numel is None else chunk_numel
        depth = QUEUE_DEPTH if queue_depth is None else queue_depth
        gran = rules_granule(self.distinct)
        if not (isinstance(chunk, int) and chunk >= gran and chunk % gran == 0):
            raise ValueError(f"offload='nvme' chunk_numel must be a positive multiple of {gran} "
                             f"(the {'/'.join(r.name for r in self.distinct)} states' aligned "
                             f"I/O granule), got {chunk!r}")
        if not (isinstance(depth, int) and 2 <= depth <= MAX_DEPTH):
            raise ValueError(f"offload='nvme' queue_depth must be an int in [2, {MAX_DEPTH}], "
                             f"got {depth!r}")
        self.chunk = pool_chunk([f.n for f in self.files], chunk, gran)
        self.depth = depth
        self.pool = [_Set(self.chunk, self.grad_dtype, self.dtype, self.pin, self.distinct)
                     for _ in range(depth)]

    # -- one step ------------------------------------------------------------------------------
    def begin(self, grad_scale: torch.Tensor, found_inf: torch.Tensor,
              used: Optional[torch.Tensor] = None):
        """Ship this step's scalars (and the params' used flags: frozen_slots.py [Note: a
        param no rank used, on the host]) to the host; start reading ahead."""
        if not self._finalizer.alive:
            raise RuntimeError("zerokern offload='nvme': this optimizer was closed (its state "
                               "files are removed); build a new one or load a checkpoint")
        if self.phase is not StepPhase.IDLE:  # a step that raised before finish(): let its
            self._drain()                     # I/O land
        ev = self.scalars_ev = self._ship_scalars(grad_scale, found_inf, used)
        self.error: Optional[BaseException] = None
        self.phase = StepPhase.STARTED
        self.dirty = []       # (gi, k) whose device params this step wrote
        self.steps0 = [f.steps.clone() for f in self.files]
        self.plan = step_plan([(f.n, f.passes(), f.writes()) for f in self.files], self.chunk)
        self.next_read = 0
        self.free = list(self.pool)
        self.loaded = collections.deque()
        self.writing = collections.deque()
        for f in self.files + self.extra_files:  # a truncated file fails here, before
            halves = getattr(f, "halves", None)  # anything changed
            if not isinstance(halves, list):  # the param files: one size
                halves = [f.half] * len(f.paths)
            for fd, p, h in zip(f.fds, f.paths, halves):
                size = os.fstat(fd).st_size
                if size < 2 * h and self.error is None:
                    self.error = OSError(errno.EIO, f"zerokern offload='nvme': state file {p} "
                                                    f"is {size} bytes, expected {2 * h} "
                                                    "(truncated?)", p)
        if self.error is None:
            self._refill()
        return ev

    def _submit(self, s: _Set, write: bool) -> None:
        gi, lo, hi, files, _ = s.job
        f = self.files[gi]
        half = (1 - self.cur) if write else self.cur
        fn = aio.write_chunk if write else aio.read_chunk
        extra = (self.direct, self.fault_hook) if write else (self.direct,)
        s.futs = []
        for i in files:  # nvme_state [Note: any StateSpec in a file, aligned]
            _, dt, b = f.specs[i]
            off, n = request_span(f.halves[i], half, lo, hi, dt, b)
            s.futs.append(self.io.submit(fn, f.fds[i], s.mv[i][:n], off, f.paths[i], *extra))
            self.bytes_moved += n

    def _settle(self, s: _Set) -> None:
        """Wait for s's I/O; the first failure is recorded (the step then rolls back)."""
        t0 = time.perf_counter()
        for fu in s.futs:
            try:
                fu.result()
            except OSError as e:
                if self.error is None:
                    self.error = e
        s.futs = []
        self.io_wait_s += time.perf_counter() - t0

    def _order_write(self, job) -> None:
        """Wait for every write in flight to an overlapping range of a file `job` writes
        (Note: one write in flight per range)."""
        gi, lo, hi, files, _ = job
        for w in self.writing:
            wg, wlo, whi, wfiles, _ = w.job
            if w.futs and wg == gi and wlo < hi and lo < whi and set(wfiles) & set(files):
                self._settle(w)

    def _refill(self, need: bool = False) -> None:
        """Read ahead into every free set; with need, wait for a write to free one first."""
        while self.writing and (not self.writing[0].futs or self.writing[0].futs[0].done()
                                or (need and not self.free)):
            s = self.writing.popleft()
            self._settle(s)
            self.free.append(s)
        while self.free and self.next_read < len(self.plan) and self.error is None:
            s = self.free.pop()
            self._wait(s.h2d)  # (GPU) its last param copy has left the buffer
            s.h2d = None
            s.job = self.plan[self.next_read]
            s.carve(self.files[s.job[0]].rule)
            self.next_read += 1
            self._submit(s, write=False)
            self.loaded.append(s)

    def _drain(self) -> None:
        for s in list(self.loaded) + list(self.writing):
            self._settle(s)
        self.loaded.clear()
        self.writing.clear()
        self.free = list(self.pool)

    def update_piece(self, gi: int, k: int, grad: torch.Tensor, hyper: dict,
                     backend: str) -> None:
        """Update bucket k's piece of group gi chunk by chunk; write its params back. Any
        failure is recorded, not raised, so that every rank still issues the step's
        collectives; finish() rolls back and raises (Note: all or nothing)."""
        rule = self.files[gi].rule
        step = self.groups[gi].steps[k]
        new_step = [step]
        f_lo = self.groups[gi].state_range(k)[0]  # flat index of the piece's first element

        def work(s: _Set, x: int, y: int, gx: int) -> None:
            self._wait(self._copy(s.grad[x:y], grad[gx:gx + y - x]))
            st = s.cut(x, y)
            new_step[0] = self._chunk_update(gi, f_lo + gx, st[0], st[1:], s.grad[x:y],
                                             None if s.param is None else s.param[x:y],
                                             step, hyper, backend, rule)

        if self._stream(gi, k, tuple(range(len(self.files[gi].names))), work, params=True):
            step.copy_(new_step[0])

    def map_piece_(self, gi: int, k: int, names_: tuple, fn, params: bool = False) -> None:
        """A phased rule's pass over bucket k's piece of buffer gi (Note: a phased rule over
        NVMe): `fn(a, b, views)` on state elements [a, b) with the named states' views (read
        from the current half, written to the other one), chunk by chunk; with params, the
        16-bit params are cast from the new master ("master" first in `names_`) and copied to
        the device. Failures are recorded as in update_piece."""
        f = self.files[gi]
        files = tuple(f.names.index(n) for n in names_)
        g = self.groups[gi]
        s0 = g.state_slice(k).start

        f_lo = g.state_range(k)[0]

        def work(s: _Set, x: int, y: int, gx: int) -> None:
            views = s.cut(x, y)
            mine = [views[i] for i in files]
            if self.unused is None:
                fn(s0 + gx, s0 + gx + y - x, mine)
            else:  # params no rank used: as they were (frozen_slots.HostUnused.map_)
                self._plan_unused()
                self.unused.map_(gi, f_lo + gx, mine,
                                 lambda: fn(s0 + gx, s0 + gx + y - x, mine))
            if params and s.param is not None:
                s.param[x:y].copy_(views[0])  # round to nearest even: `.to(dtype)` bitwise

        self._stream(gi, k, files, work, params)

    def _stream(self, gi: int, k: int, files: tuple, work, params: bool) -> bool:
        """Run `work(set, x, y, gx)` over bucket k's piece of buffer gi, chunk by chunk (x, y
        the chunk's range in the set, gx its offset in the piece), the chunks' files `files`
        written behind; with params the set's param (or master, at fp32) range goes to the
        device after each work. True if it ran (not skipped, no failure)."""
        try:
            return self._stream_piece(gi, k, files, work, params)
        except Exception as e:  # noqa: BLE001 - re-raised by finish() on this rank
            if self.error is None:
                self.error = e
            self._drain()
            return False

    def _stream_piece(self, gi: int, k: int, files: tuple, work, params: bool) -> bool:
        if self.phase is StepPhase.STARTED:  # the first piece reads found_inf
            self._wait(self.scalars_ev)
            self.phase = StepPhase.UPDATING
            if self.scalars_np[1] != 0:  # overflow: nothing changes (DESIGN §3), no I/O
                self.phase = StepPhase.SKIPPED
                self._drain()
        if self.phase is StepPhase.SKIPPED or self.error is not None:
            return False  # after a failure the rest of the step does nothing; finish() rolls back
        g = self.groups[gi]
        sl = g.state_slice(k)
        plo, phi = sl.start, sl.stop
        dev_out = g.param_out_piece(k) if params else None
        if params:
            self.dirty.append((gi, k))
        while plo < phi:
            if not self.loaded:
                self._refill(need=True)  # (a failed write it waits for stops the reads)
            if self.error is not None:
                self._drain()
                return False
            s = self.loaded[0]
            self._settle(s)
            if self.error is not None:
                self._drain()
                return False
            cg, lo, hi, fs, write = s.job
            assert cg == gi and fs == files and lo <= plo < hi, (s.job, gi, files, plo)
            a, b = plo, min(phi, hi)
            self._wait(s.h2d)  # the set's param buffer is free again
            work(s, a - lo, b - lo, a - sl.start)
            if params:
                src = s.state[0] if s.param is None else s.param
                s.h2d = self._copy(dev_out[a - sl.start:b - sl.start], src[a - lo:b - lo])
            plo = b
            if b == hi:  # the chunk is complete: write it behind, read further ahead
                self.loaded.popleft()
                if write:
                    self._order_write(s.job)
                    self._submit(s, write=True)
                    self.writing.append(s)
                else:  # [Note: a read pass writes nothing]
                    self.free.append(s)
                self._refill()
        self.end()  # bucket k's params are on the device before its all-gather
        return True

    def finish(self) -> None:
        """Commit the step, or roll it back everywhere (Note: all or nothing)."""
        if self.phase is StepPhase.IDLE:
            return
        skipped = self.phase is StepPhase.SKIPPED
        if not skipped:
            self._drain()
        failed = torch.tensor([0.0 if self.error is None else 1.0],
                              device=self.groups[0].device)
        # agreement: every rank commits or rolls back, over dp and over the model-parallel
        # ranks (the tp / pipeline slices' files are one checkpointed step too)
        self.roles.agree_(failed, label="nvme commit")
        # One host read per step (a device sync with NCCL): the step already waited for the
        # host's update of every chunk, so it costs the all-reduce's latency only.
        self.plan = None
        self.phase = StepPhase.IDLE
        if failed.item() == 0:
            if not skipped:
                self.cur = 1 - self.cur
                for f in self.files:
                    f.point(self.cur, remap=True)
                for hook in self.commit_hooks:
                    hook()
            return
        self._rollback()
        err = self.error
        if err is not None and not isinstance(err, OSError):
            raise RuntimeError(f"zerokern offload='nvme': the step failed ({err!r}); it was "
                               "rolled back") from err
        if err is not None:
            raise OSError(err.errno, f"{err.strerror or err}; the step was rolled back "
                                     "(master and states, step counters, params and loss scale are "
                                     "as before it)", err.filename) from err
        raise RuntimeError("zerokern offload='nvme': another rank's state I/O failed in this "
                           "step; the step was rolled back on every rank")

    def _rollback(self) -> None:
        # (issue 24, item 8) A failed step returns from update_piece without end(): its last
        # H2D param copies may still be queued on the copy stream, and would land on top of the
        # re-cast below. The compute stream waits for them first (stream order, no host wait).
        self.end()
        for f, s0 in zip(self.files, self.steps0):
            f.steps.copy_(s0)
        for gi, k in self.dirty:  # re-cast the params from the untouched current half
            g = self.groups[gi]
            if getattr(g, "params_journaled", False):
                continue  # its params file's current half was never written
            g.codec.cast_(g.param_out_piece(k), g.master[g.state_slice(k)])
        # Every rank re-publishes every bucket (collective; stages 1-2 all-gather, the others
        # publish nothing), as a step does.
        for g in self.groups:
            for k in range(g.layout.n_buckets):
                h = g.publish_piece(self.comm.shard, k)
                if h is not None:
                    h.wait()
