"""offload_params="nvme": the host waits for a param shard's disk read only at the fetch that
copies it to the device ([Note: param offload choices] 1 in stage3/param_offload.py).

World size 1 in this process, stage 3, bf16, offload="nvme" + offload_params="nvme" (the test
model: a root unit with three buffers - two groups and the frozen one - and two blocks of two).
Each test records what happens around ParamHomes' reads, in order:
* the main thread never reads a param file itself: every read runs on the I/O thread (on the
  old code a shard not read ahead, the first units of every pass, was read with a blocking
  pread on the main thread: failed);
* a read is issued before its fetch except for a unit's first buffer among a pass's first two
  units (the old code read all of the root's three buffers at their fetch: failed), and from a
  pass's third unit on every fetch finds its read issued one unit ahead;
* the only main-thread waits for a read are inside the fetch (`load`); a pass that drops
  read-aheads (a forward that raised) waits for none of them (the old new_pass waited for
  each: failed);
* with pinned read buffers (a GPU; emulated here: `pin` set after construction, events stood in
  for), the copy out of a read buffer is non_blocking, and the next read into that buffer
  waits for the copy's event on the I/O thread, never on the main thread (the old code copied
  blocking, which on a GPU synchronizes the gather stream once per buffer per unit, and had no
  events: failed).
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zerokern.state import aligned_io

from ..support import models as M
from ..support.harness import one_thread  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def _opt(model, path):
    return M.zero_opt(model, 3, "bf16", offload="nvme", offload_path=str(path),
                      offload_params="nvme")


def _main() -> bool:
    return threading.current_thread() is threading.main_thread()


class _Log:
    """Param-file reads (which thread), fetches (issued ahead or not), main-thread waits for a
    Future (in which function) and pass markers, in order."""

    def __init__(self, monkeypatch, homes) -> None:
        self.events = []
        self.homes = homes
        real_read = aligned_io.read_chunk

        def read_chunk(fd, buf, off, path, direct):
            if path.endswith("-params.bin"):
                self.events.append(("read", _main()))
            return real_read(fd, buf, off, path, direct)

        monkeypatch.setattr(aligned_io, "read_chunk", read_chunk)
        real_load = homes.load

        def load(f, dev):
            self.events.append(("fetch", f.unit_index, id(f) in homes.ahead))
            return real_load(f, dev)

        monkeypatch.setattr(homes, "load", load)
        reads = weakref.WeakSet()  # the futures of param reads (not of the state files')
        real_submit = homes.io.submit

        def submit(*a, **kw):
            fut = real_submit(*a, **kw)
            reads.add(fut)
            return fut

        monkeypatch.setattr(homes.io, "submit", submit)
        real_result = concurrent.futures.Future.result

        def result(fut, timeout=None):
            if _main() and fut in reads:
                import sys

                self.events.append(("wait", sys._getframe(1).f_code.co_name))
            return real_result(fut, timeout)

        monkeypatch.setattr(concurrent.futures.Future, "result", result)

    def mark(self, what: str) -> None:
        self.events.append(("pass", what))

    def passes(self):
        """[(pass name, [(unit, issued ahead), ...])] of the fetches."""
        out = []
        for e in self.events:
            if e[0] == "pass":
                out.append((e[1], []))
            elif e[0] == "fetch" and out:
                out[-1][1].append(e[1:])
        return out


def _train(model, opt, log, steps=2):
    for s in range(steps):
        log.mark("forward")
        loss = M.loss_fn(model, M.rank_tokens(s, 0, 1))
        log.mark("backward")
        opt.backward(loss)
        log.mark("step")
        opt.step()
        opt.zero_grad()


def test_the_host_never_reads_a_param_file(tmp_path, monkeypatch):
    model = M.make_model()
    opt = _opt(model, tmp_path)
    log = _Log(monkeypatch, opt.param_homes)
    _train(model, opt, log)
    opt.close()
    reads = [e for e in log.events if e[0] == "read"]
    assert len(reads) >= 2 * 7, reads  # control: every buffer read in every forward
    assert not [e for e in reads if e[1]], "a param file was read on the main thread"


def test_reads_are_issued_ahead_and_waited_only_at_the_fetch(tmp_path, monkeypatch):
    model = M.make_model()
    opt = _opt(model, tmp_path)
    log = _Log(monkeypatch, opt.param_homes)
    _train(model, opt, log)
    passes = [(name, fetches) for name, fetches in log.passes() if fetches]
    assert [name for name, _ in passes] == ["forward", "backward"] * 2, passes
    for name, fetches in passes:
        units = list(dict.fromkeys(u for u, _ in fetches))
        seen = set()
        for u, ahead in fetches:
            first = u not in seen
            seen.add(u)
            if not ahead:  # read at its fetch: only a unit's first buffer, early in a pass
                assert first and units.index(u) < 2, (name, fetches)
            if units.index(u) >= 2:
                assert ahead, (name, fetches)
        assert any(ahead for _, ahead in fetches), (name, fetches)  # control: some read ahead
    waits = [e[1] for e in log.events if e[0] == "wait"]
    assert waits and set(waits) == {"load"}, waits

    # A forward that raises after the root's gather leaves read-aheads in flight; the next
    # pass drops them without waiting for them, and the forward after it is right.
    def boom(*a):
        raise RuntimeError("boom")

    h = model.emb.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        M.loss_fn(model, M.rank_tokens(2, 0, 1))
    h.remove()
    assert opt.param_homes.ahead, "the failed forward left no read-ahead in flight"
    del log.events[:]
    with torch.no_grad():
        M.loss_fn(model, M.rank_tokens(2, 0, 1))
    waits = [e[1] for e in log.events if e[0] == "wait"]
    assert waits and set(waits) == {"load"}, waits
    opt.close()


class _FakeEvent:
    """Stands in for the CUDA event of an H2D copy: records where it is waited for."""

    def __init__(self, log) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("main" if _main() else threading.current_thread().name)


class _CopyFlags(TorchDispatchMode):
    """non_blocking of every copy_ whose source is one of the read buffers."""

    def __init__(self, bufs) -> None:
        super().__init__()
        self.ptrs = {b.untyped_storage().data_ptr() for b in bufs}
        self.flags = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            src = args[1]
            if src.untyped_storage().data_ptr() in self.ptrs:
                self.flags.append(bool(args[2] if len(args) > 2
                                       else kwargs.get("non_blocking", False)))
        return func(*args, **kwargs)


def test_pinned_copies_are_non_blocking_and_buffers_wait_off_the_main_thread(tmp_path,
                                                                             monkeypatch):
    model = M.make_model()
    opt = _opt(model, tmp_path)
    homes = opt.param_homes
    monkeypatch.setattr(homes, "pin", True)  # as on a GPU (the buffers stay pageable here)
    waited = []
    monkeypatch.setattr(homes, "_copy_event", lambda: _FakeEvent(waited), raising=False)
    mode = _CopyFlags([homes.bounce, *homes.ahead_bufs])
    with mode:
        M.train_zero(model, opt, 0, 1, 2)
    opt.close()
    assert len(mode.flags) >= 2 * 7, mode.flags  # control: the fetches were seen
    assert all(mode.flags), f"blocking copies out of pinned read buffers: {mode.flags}"
    assert waited, "no read waited for the last copy out of its buffer"
    assert "main" not in waited, waited
