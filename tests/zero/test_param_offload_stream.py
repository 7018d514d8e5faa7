"""Issue 24, item 5: with offload_params on a GPU, the shard's host -> device copy and its
all-gather are issued on a copy stream, and the compute stream waits for them by an event.

No GPU here: `ParamHomes.copy_stream` is patched to return a recording stand-in (its context is
a no-op, so the run itself is the ordinary CPU run), and the fetch (`ParamHomes.load`) and the
all-gather record whether they ran inside the copy stream's context. For every gather of an
offloaded buffer the recorded order must be: copy stream waits for compute -> enter the copy
stream -> H2D copy -> all-gather -> leave -> event recorded; and before the gathered unit is
used (finish_gather) or dropped (free), the compute stream waits for that event, then the
device shard is marked as used by the compute stream (it is freed from there). On the old code
the copy ran on the compute stream: no copy stream was ever asked for (this test failed).
Training results are unchanged by the instrumentation (compared with a plain run). The GPU
side: tests/zero/test_gpu.py::test_param_offload_copy_stream_on_cuda (-m gpu).
"""

from __future__ import annotations

from zerokern.stage3 import param_homes
from zerokern.stage3.param_offload import OffloadedShardedFlat

from . import models as M


class _FakeCopyStream:
    def __init__(self, log):
        self.log, self.inside, self.n = log, False, 0

    def wait_compute(self):
        self.log.append(("wait_compute",))

    def context(self):
        fake = self

        class _Ctx:
            def __enter__(self):
                fake.inside = True
                fake.log.append(("enter",))

            def __exit__(self, *exc):
                fake.inside = False
                fake.log.append(("exit",))
        return _Ctx()

    def record(self):
        self.n += 1
        self.log.append(("record", self.n))
        return self.n

    def compute_waits(self, ev):
        self.log.append(("compute_waits", ev))

    def used_by_compute(self, t):
        self.log.append(("used_by_compute",))


def _run(monkeypatch, instrument: bool):
    log = []
    if instrument:
        fake = _FakeCopyStream(log)
        monkeypatch.setattr(param_homes.ParamHomes, "copy_stream", lambda self, dev: fake)
        real_load = param_homes.ParamHomes.load

        def load(self, f, dev):
            log.append(("h2d", fake.inside))
            return real_load(self, f, dev)
        monkeypatch.setattr(param_homes.ParamHomes, "load", load)
        real_start = OffloadedShardedFlat.start_gather

        def start_gather(self, comm, label=None):
            real_gather = comm.all_gather_

            def all_gather_(*a, **k):
                log.append(("gather", fake.inside))
                return real_gather(*a, **k)
            comm.all_gather_ = all_gather_
            try:
                return real_start(self, comm, label)
            finally:
                del comm.all_gather_
        monkeypatch.setattr(OffloadedShardedFlat, "start_gather", start_gather)
        for name in ("finish_gather", "free"):
            real = getattr(OffloadedShardedFlat, name)

            def wrapped(self, _real=real, _name=name):
                log.append((_name, getattr(self, "_landed", None) is not None))
                return _real(self)
            monkeypatch.setattr(OffloadedShardedFlat, name, wrapped)
    model = M.make_model()
    opt = M.zero_opt(model, 3, "bf16", offload="cpu", offload_params="cpu", backend="cpu")
    for s in range(2):
        opt.backward(M.loss_fn(model, M.rank_tokens(s, 0, 1)))
        opt.step()
        opt.zero_grad()
    return log, M.full_snapshot(model, opt)


def test_fetch_and_gather_on_the_copy_stream_compute_waits(monkeypatch):
    log, snap = _run(monkeypatch, True)
    gathers = [i for i, e in enumerate(log) if e[0] == "gather"]
    assert len(gathers) > 4
    for i in gathers:
        # wait_compute, enter, h2d (inside), gather (inside), exit, record
        assert log[i - 3:i + 3] == [("wait_compute",), ("enter",), ("h2d", True),
                                    ("gather", True), ("exit",), ("record", log[i + 2][1])], \
            log[i - 3:i + 3]
    # every recorded event is waited for by the compute stream before the unit is used or
    # dropped, and only after it was recorded
    recorded = {e[1]: i for i, e in enumerate(log) if e[0] == "record"}
    waited = {e[1]: i for i, e in enumerate(log) if e[0] == "compute_waits"}
    assert set(waited) == set(recorded)
    for ev, i in waited.items():
        assert i > recorded[ev]
        assert log[i - 1][0] in ("finish_gather", "free") and log[i - 1][1] is True
    # the instrumented run trains exactly as a plain one
    monkeypatch.undo()
    _, plain = _run(monkeypatch, False)
    assert M.bitwise_equal(snap, plain)
