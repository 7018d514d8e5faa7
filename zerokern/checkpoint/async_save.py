"""`save(..., async_save=True)`: stage a copy now, write it in a background thread.

[Note: asynchronous saves]
Timeline of one async save on every rank:
1. main thread, in `save()`: wait for the previous async save (a save starts only after the
   previous one committed or failed, whose error is raised here, once); `writer.prepare` (the
   collective start: checks, nonce, tmp dir; on the training's own group, as a synchronous
   save); snapshot what can change before the next optimizer step: the step counters,
   hyperparameters, loss scaler, client_state, and rank 0's buffers and frozen params (a
   forward may update buffers) into the staging buffer. Then `save()` returns an `AsyncSave`.
2. writer thread: copy this rank's share of the optimizer state (fp32 master, the rule's
   states, per-matrix states) into the staging buffer, then release the optimizer's next
   step; then `writer.write_and_commit` on the staged copy: write + fsync the files, the
   ranks' agreement that every rank wrote its file, rank 0's metadata and atomic commit, the
   final agreement. The previous checkpoint stays in place until the commit (writer.py
   [Note: atomic replace]), so a crash or an error before it leaves the previous one as the
   latest; a failed save removes its tmp dir.
3. the next `save()`/`load()`, `AsyncSave.wait()`/`close()` or `zerokern.checkpoint.wait()`
   joins the thread and raises its error (the same on every rank: the agreement decided it).

Staging overlaps the next forward and backward: only `opt.step()` writes the optimizer state,
so the copy of step 2 runs while the next micro-batches compute, and a step pre-hook
(`register_step_pre_hook`) holds the next `opt.step()` until the copy has ended: the stall is
the part of the copy the forward and backward did not hide (0 when they take longer), not
the copy itself (GPT 100m, 1.34 GB: 0.38 s at this VM's 3.5 GB/s one-thread memcpy, 8-16% of
a synchronous save if made in save(); the stall measured 0.1-0.7%:
benchmarks/results/checkpoint-async-cpu.md). The optimizer state must not be
changed by other means (load_state_dict, in-place edits of fp32 params, which are the master)
before that step. On an accelerator the copy runs on a side stream that first waits for an
event recorded at save() (the state as the last step left it).

Which thread issues collectives: the agreement of step 2 runs in the writer thread, on a
process group of its own (`_checkpoint_group`: a gloo group over the same ranks, created once,
collectively, by the first async save), never on the training's group. A process group is not
safe to use from two threads at once: a rank's training thread in an all-reduce and its writer
thread in an all-gather on one group could pair with a peer's calls in the other order and
deadlock or mix up bytes. On separate groups the two threads' collectives are independent
(torch.distributed.checkpoint.async_save does the same with a gloo group). Keeping every
collective on the main thread instead (the agreement deferred to the next `wait()`/`save()`)
would also be safe but would commit a checkpoint only at the next call: `latest` would lag a
whole save interval behind the files already on disk.

Staging buffer: one uint8 host buffer per process, grown to the largest share staged and
reused by every later save (one save in flight at a time, so one buffer suffices: bounded by
one copy of this rank's share plus rank 0's extras, 64-byte aligned pieces); page-locked
through the device handle (zerokern.state.pinned, cudaHostRegister) when the state lives on
an accelerator, so the device-to-host copies are DMA. `release_staging()` frees it.

CPU share: on a host where training itself keeps every core busy (CPU training, 2 cores
here) the writer thread competes with it. It copies at the training's priority (the next
step may wait for the copy: niced too, the step waited 5-16% of a synchronous save), then
writes at nice +10 (ZEROKERN_CHECKPOINT_WRITER_NICE), so that the training thread gets the
cores first (not niced, a step with a write in flight took 2.1x as long at 1 rank). With the
model on a GPU the host cores are mostly idle and the write costs the step nothing.

At exit: an `atexit` hook waits for a pending save (up to ZEROKERN_CHECKPOINT_EXIT_WAIT_S,
default 600 s) and reports a failure on stderr; past that it abandons the write (the thread is
a daemon): the uncommitted tmp dir is left for the next save to delete, the previous
checkpoint stays the latest. Never a half-committed checkpoint: the commit is one rename. A
process that ends with os._exit (zerokern.tools.spawn's ranks) runs no atexit hooks: call `wait()`
before the process group is destroyed.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import datetime
import enum
import errno
import os
import shutil
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..platform.device import handle as device_handle
from ..state import pinned
from . import writer
from .collective import Collective
from .format import CheckpointError
from .views import StatePiece, StepCounter, whole_frozen_params

EXIT_WAIT_ENV = "ZEROKERN_CHECKPOINT_EXIT_WAIT_S"
EXIT_WAIT_S = 600.0
PG_TIMEOUT_ENV = "ZEROKERN_PG_TIMEOUT_S"  # the checkpoint group's timeout (as tools/spawn.py)
PG_TIMEOUT_S = 1800.0  # torch's default for gloo
NICE_ENV = "ZEROKERN_CHECKPOINT_WRITER_NICE"
WRITER_NICE = 10  # added to the writer thread's nice value: training keeps the cores it needs
ALIGN = 64  # bytes: every staged tensor starts aligned (any dtype's view is valid)


class SaveState(enum.Enum):
    """The lifecycle of an `AsyncSave` (one at a time per process)."""

    WRITING = "writing"      # the writer thread runs
    COMMITTED = "committed"  # the checkpoint is on disk, atomically replaced
    FAILED = "failed"        # the save failed; its error not yet raised to the caller
    REPORTED = "reported"    # failed, and the error was raised (once)


class AsyncSave:
    """The handle of one asynchronous save (module Note). Collective: every rank calls
    `wait()` at the same point of its program, as it called `save()`.

    Built by `save(..., async_save=True)`, not by hand.

    Args:
        path: the checkpoint directory being written.
        job: the save after its collective start, on the snapshot (writer.SaveJob).
        stage: the writer thread's first task: job -> the job on staged copies.

    Attributes:
        path: the checkpoint directory being written.
        state: a SaveState.
        stall_s: seconds the optimizer's next step waited for the staging copy.
    """

    def __init__(self, path: str, job: writer.SaveJob, stage) -> None:
        self.path = path
        self.state = SaveState.WRITING
        self.stall_s = 0.0
        self._job: Optional[writer.SaveJob] = job
        self._stage = stage  # writer thread: job -> the job on staged copies
        self._staged = threading.Event()
        self._hook = None  # the optimizer's step pre-hook (removed on the main thread)
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="zerokern-checkpoint-writer",
                                        daemon=True)

    def __repr__(self) -> str:
        return f"AsyncSave({self.path!r}, {self.state.value})"

    def _run(self) -> None:
        job = self._job
        try:
            try:
                job = self._stage(job)
            except Exception as e:  # noqa: BLE001 - joins the agreement as a failed write
                job = dataclasses.replace(job, error=e)
            finally:
                self._staged.set()  # the next opt.step() may run
            _lower_priority()  # the copy, which a step may wait for, ran at full priority
            writer.write_and_commit(job)
            self.state = SaveState.COMMITTED
        except BaseException as e:  # noqa: BLE001 - the caller gets it at wait()
            self._error = e
            self.state = SaveState.FAILED
        finally:
            self._job = job = None  # the staged views (the buffer stays for the next save)

    def _before_step(self, *_args) -> None:
        """The optimizer's step pre-hook: the state may change only once it is staged."""
        if not self._staged.is_set():
            t0 = time.perf_counter()
            self._staged.wait()
            self.stall_s += time.perf_counter() - t0

    def done(self) -> bool:
        """The write has ended (committed or failed); never blocks."""
        return not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> Optional[str]:
        """Block until the save has committed; returns its path (None if it failed and the
        error was raised before).

        Args:
            timeout: seconds to wait at most; None: until the write ends.

        Raises:
            TimeoutError: still writing after `timeout` seconds (the save goes on).
            CheckpointError, OSError: the save failed (e.g. ENOSPC); raised once, by the first
                of wait(), close(), the next save() or load(). The previous checkpoint is
                intact and the training state was never touched.
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"zerokern.checkpoint: the async save to {self.path} is still "
                               f"writing after {timeout} s")
        global _pending
        with _lock:
            if _pending is self:
                _pending = None
            hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()
        if self.state is SaveState.FAILED:
            self.state = SaveState.REPORTED
            raise _explained(self._error, self.path)
        return self.path if self.state is SaveState.COMMITTED else None

    def close(self) -> None:
        """`wait()` (raising a failure not raised yet); then the handle holds nothing."""
        self.wait()


_lock = threading.Lock()
_pending: Optional[AsyncSave] = None
_staging: Dict[str, Any] = {"buf": None, "pinned": False}
_groups: Dict[Any, Any] = {}  # ranks -> gloo group; "world": the default group they belong to
_atexit_registered = False


def pending() -> Optional[AsyncSave]:
    """The async save in flight (or failed, its error not raised yet) in this process."""
    return _pending


def wait() -> Optional[str]:
    """Wait for this process's pending async save, if any (collective, as `AsyncSave.wait`);
    returns its path, or None when there was none."""
    h = _pending
    return None if h is None else h.wait()


def staging_buffer() -> Optional[torch.Tensor]:
    """The staging buffer (uint8, host), or None before the first async save."""
    return _staging["buf"]


def release_staging() -> None:
    """Free the staging buffer (after `wait()`); the next async save allocates it again."""
    wait()
    _staging.update(buf=None, pinned=False)


def _buffer(nbytes: int, pin: bool) -> torch.Tensor:
    buf = _staging["buf"]
    if buf is None or buf.numel() < nbytes or _staging["pinned"] != pin:
        _staging["buf"] = None  # the old one goes first: the bound is one copy
        buf = pinned.host_empty(nbytes, torch.uint8, pin)
        _staging.update(buf=buf, pinned=pin)
    return buf


def _checkpoint_group(view) -> Collective:
    """The writer thread's Collective: a gloo group over the ranks of `view.world_group`
    (module Note), created once per set of ranks. Collective the first time: every rank of
    the job calls it (every rank calls save)."""
    if view.world_world_size == 1 or view.world_group is None:
        return Collective(None, view.world_rank, 1)
    ranks = tuple(dist.get_process_group_ranks(view.world_group))
    world = dist.distributed_c10d._get_default_group()
    if _groups.get("world") is not world:  # a new default group: the old groups are gone
        _groups.clear()
        _groups["world"] = world
    if ranks not in _groups:
        everyone = tuple(range(dist.get_world_size()))
        sets = [ranks]
        if ranks != everyone:  # another subgroup per tp rank: every rank creates them all
            seen: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(seen, ranks)
            sets = sorted(set(seen))
        secs = float(os.environ.get(PG_TIMEOUT_ENV, "") or PG_TIMEOUT_S)
        for rs in sets:
            g = dist.new_group(list(rs), backend="gloo",
                               timeout=datetime.timedelta(seconds=secs))
            _groups[tuple(rs)] = g
    return Collective(_groups[ranks], view.world_rank, view.world_world_size)


def _lower_priority() -> None:
    """The writer thread yields the CPU to training (module Note: on a CPU-bound host)."""
    nice = int(os.environ.get(NICE_ENV, "") or WRITER_NICE)
    if nice and hasattr(os, "setpriority") and sys.platform.startswith("linux"):
        try:  # Linux: a thread's own nice value (its native id is a task id)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                           min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
        except OSError:
            pass


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Carver:
    """Consecutive 64-byte-aligned pieces of the staging buffer, each the shape of its source."""

    def __init__(self, buf: torch.Tensor, at: int = 0) -> None:
        self.buf, self.at = buf, at

    def like(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        dst = self.buf[self.at:self.at + n].view(t.dtype).view(t.shape)
        self.at += _aligned(n)
        return dst


def _big(job: writer.SaveJob):
    """(owned pieces, per-matrix states) this rank writes: what only opt.step() changes."""
    view = job.view
    if not view.writes:  # an HSDP replica other than 0 writes nothing
        return [], []
    return view.owned, list(getattr(view, "matrix", ()))


def _snapshot(job: writer.SaveJob) -> Tuple[writer.SaveJob, _Carver, Any]:
    """Main thread, at save(): the staging buffer sized for everything; rank 0's extras
    copied into it; the small state snapshotted. Returns the job on those, the carver where
    the writer thread goes on, and the event the writer's device copies wait for."""
    view = job.view
    owned, matrix = _big(job)
    extras = job.extras if job.lead else []
    big = [t for p in owned for t in p.tensors().values()] + [t for _, _, t in matrix]
    small = [t for _, _, t in extras]
    devices = {t.device for t in big + small if t.device.type != "cpu"}
    buf = _buffer(sum(_aligned(t.numel() * t.element_size()) for t in big + small),
                  pin=bool(devices))
    carve = _Carver(buf)

    def copy_(t: torch.Tensor) -> torch.Tensor:
        return carve.like(t).copy_(t.detach())  # (blocking: buffers are small)

    # extra.bin records whether each extra is a Parameter: a staged frozen param stays one
    staged_extras = [(name, aliases, nn.Parameter(copy_(t), requires_grad=False)
                      if isinstance(t, nn.Parameter) else copy_(t))
                     for name, aliases, t in extras]
    scaler = {k: (v.item() if isinstance(v, torch.Tensor) else v)
              for k, v in view.scaler.state_dict().items()}
    small_view = dataclasses.replace(
        view, held=[], values=[], param_tensors=[], after_load=[],
        steps=[StepCounter(c.value.detach().to("cpu", copy=True), c.params)
               for c in view.steps],
        param_groups=[{k: (v.detach().clone() if isinstance(v, torch.Tensor)
                           else copy.deepcopy(v)) for k, v in g.items() if k != "params"}
                      for g in view.param_groups],
        scaler=_ScalerSnapshot(scaler), layout=copy.deepcopy(view.layout),
        params=list(view.params))
    events = {d: device_handle(d).recorded_event() for d in devices}
    return dataclasses.replace(job, view=small_view, extras=staged_extras), carve, events


def _stage_big(job: writer.SaveJob, carve: _Carver, events) -> writer.SaveJob:
    """Writer thread: this rank's share of the optimizer state copied into the staging
    buffer (on a side stream per device, after the event recorded at save())."""
    owned, matrix = _big(job)
    streams = {}
    for dev, ev in events.items():
        h = device_handle(dev)
        with h.device_context(dev):
            streams[dev] = h.stream(dev)
            streams[dev].wait_event(ev)

    def copy_(t: torch.Tensor) -> torch.Tensor:
        dst = carve.like(t)
        if t.device.type == "cpu":
            return dst.copy_(t.detach())
        h = device_handle(t.device)
        with h.device_context(t.device), h.use_stream(streams[t.device]):
            dst.copy_(t.detach(), non_blocking=True)  # pinned: DMA, ordered on the stream
        return dst

    staged_owned = [StatePiece(p.param, p.lo, p.hi, copy_(p.master),
                               {k: copy_(v) for k, v in p.states.items()}) for p in owned]
    staged_matrix = [(j, name, copy_(t)) for j, name, t in matrix]
    for stream in streams.values():
        stream.synchronize()
    changes: Dict[str, Any] = {"owned": staged_owned}
    if hasattr(job.view, "matrix"):
        changes["matrix"] = staged_matrix
    return dataclasses.replace(job, view=dataclasses.replace(job.view, **changes))


def _explained(e: BaseException, path: str) -> BaseException:
    """The error of a background write, with a note saying what failed and what did not: it
    reaches the caller at a later call (wait, save, load), far from the write (an OSError of a
    file write names neither the file nor the checkpoint). The type and errno stay. Only a
    write's failure (an OSError, also another rank's; a CheckpointError): a lost peer
    (RankAborted, PeerLost) says itself that the job must restart."""
    if isinstance(e, (OSError, CheckpointError)):
        what = ""
        if isinstance(e, OSError) and e.errno is not None:
            what = f" ({errno.errorcode.get(e.errno, e.errno)}: {os.strerror(e.errno)})"
        e.add_note(f"zerokern.checkpoint: the asynchronous save to {path} failed in its "
                   f"background write{what}. Nothing of it was committed: the checkpoints "
                   "committed before are untouched and the training state was only read. "
                   "Training can go on; the next save writes the checkpoint again.")
    return e


class _ScalerSnapshot:
    """The loss scaler's state at save() (the writer reads `state_dict()` only)."""

    def __init__(self, state: Dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> Dict[str, Any]:
        return dict(self._state)


def start(path, model: nn.Module, opt, exclude_frozen: bool,
          client_state: Optional[Dict[str, Any]], on_commit=None) -> AsyncSave:
    """Steps 1-2 of the module Note (the caller, saving.save, has waited for the previous
    save). Collective."""
    global _pending, _atexit_registered
    with whole_frozen_params(opt):  # stage 3 (collective): staged while gathered
        job = writer.prepare(path, model, opt, exclude_frozen, client_state)
        err: Optional[BaseException] = None
        try:
            coll = _checkpoint_group(job.view)
            small, carve, events = _snapshot(job)
            small = dataclasses.replace(small, coll=coll, on_commit=on_commit)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it (no writer
            err = e  # thread may wait in the agreement for a rank that never starts one)
        try:
            job.coll.agree(err)
        except BaseException:
            if job.lead:
                shutil.rmtree(job.tmp, ignore_errors=True)
            raise
    h = AsyncSave(job.top, small, lambda j: _stage_big(j, carve, events))
    h._hook = opt.register_step_pre_hook(h._before_step)
    with _lock:
        _pending = h
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
    h._thread.start()
    return h


def _at_exit() -> None:
    h = _pending
    if h is None:
        return
    secs = float(os.environ.get(EXIT_WAIT_ENV, "") or EXIT_WAIT_S)
    if not h.done():
        print(f"zerokern.checkpoint: waiting up to {secs:g} s for the async save to {h.path}",
              file=sys.stderr, flush=True)
    try:
        h.wait(timeout=secs)
    except TimeoutError:
        print(f"zerokern.checkpoint: abandoned the async save to {h.path} (not committed; the "
              "previous checkpoint stays the latest)", file=sys.stderr, flush=True)
    except BaseException as e:  # noqa: BLE001 - at exit: report, never raise
        print(f"zerokern.checkpoint: the async save to {h.path} failed: "
              f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
