"""Issue 24, items 3 and 5: stage 3's gathers (and param offload's H2D fetch) are issued on the
gather stream, which waits for the compute stream only when a pass starts, never after a
reduce-scatter ([Note: stage-3 gather stream] in zerokern/stage3/gather_stream.py).

No GPU here: `gather_stream.for_device` and `ParamHomes.gather_stream` are patched to return a
recording stand-in (its context is a no-op, so the run is the ordinary CPU run). Recorded and
checked over two training steps (forward, backward, step), stage 3, bf16:
* every all-gather: enter the gather stream -> (offload_params: the H2D fetch) -> the gather
  call -> leave -> event recorded; every event is waited for by the compute stream at the
  unit's finish_gather or free, after it was recorded, and the buffer is then marked as used
  by the compute stream before it is freed;
* no reduce-scatter is issued inside the gather stream's context;
* `new_epoch` (the gather stream waiting for the compute stream) never comes between a
  reduce-scatter and the end of that backward: no gather can wait for a reduce-scatter.
On the old code the gathers and the fetch ran on the compute stream (no stream was ever asked
for: these tests failed). The instrumented runs train exactly as plain ones (bitwise). The GPU
side: tests/gpu/test_gpu_nccl.py (2-3 NCCL ranks, stage 3) and
tests/gpu/test_gpu_paths.py::test_param_offload_copy_stream_matches_torch_adamw.
"""

from __future__ import annotations

import pytest

from zerokern.stage3 import gather_stream, param_homes
from zerokern.stage3.runtime import Stage3Runtime
from zerokern.stage3.sharded_flat import ShardedFlat

from ..support import models as M


class _FakeStream:
    def __init__(self, log):
        self.log, self.inside, self.n = log, False, 0

    def new_epoch(self):
        self.log.append(("new_epoch",))

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


def _run(monkeypatch, instrument: bool, offload_params):
    log = []
    if instrument:
        fake = _FakeStream(log)
        monkeypatch.setattr(gather_stream, "for_device", lambda dev: fake)
        monkeypatch.setattr(param_homes.ParamHomes, "gather_stream", lambda self, dev: fake)
        real_load = param_homes.ParamHomes.load

        def load(self, f, dev):
            log.append(("h2d", fake.inside))
            return real_load(self, f, dev)
        monkeypatch.setattr(param_homes.ParamHomes, "load", load)
        real_source = ShardedFlat._gather_source

        def source(self):
            log.append(("source", fake.inside))
            return real_source(self)
        if offload_params is None:
            monkeypatch.setattr(ShardedFlat, "_gather_source", source)
        for name in ("finish_gather", "free"):
            real = getattr(ShardedFlat, name)

            def wrapped(self, _real=real, _name=name):
                log.append((_name, getattr(self, "_landed", None) is not None))
                return _real(self)
            monkeypatch.setattr(ShardedFlat, name, wrapped)
        real_reduce = Stage3Runtime._reduce_async

        def reduce_async(self, *a):
            log.append(("rs", fake.inside))
            return real_reduce(self, *a)
        monkeypatch.setattr(Stage3Runtime, "_reduce_async", reduce_async)
        real_end = Stage3Runtime.end_backward

        def end_backward(self):
            real_end(self)
            log.append(("end_backward",))
        monkeypatch.setattr(Stage3Runtime, "end_backward", end_backward)
    model = M.make_model()
    kw = {} if offload_params is None else dict(offload="cpu", offload_params=offload_params)
    opt = M.zero_opt(model, 3, "bf16", backend="cpu", **kw)
    for s in range(2):
        opt.backward(M.loss_fn(model, M.rank_tokens(s, 0, 1)))
        opt.step()
        opt.zero_grad()
    return log, M.full_snapshot(model, opt)


@pytest.mark.parametrize("offload_params", [None, "cpu"], ids=["resident", "offload-cpu"])
def test_gathers_on_the_gather_stream_never_after_a_reduce_scatter(monkeypatch, offload_params):
    log, snap = _run(monkeypatch, True, offload_params)
    fetch = "source" if offload_params is None else "h2d"
    enters = [i for i, e in enumerate(log) if e == ("enter",)]
    assert len(enters) > 4
    for i in enters:
        assert log[i + 1] == (fetch, True), log[i:i + 4]
        assert log[i + 2:i + 4] == [("exit",), ("record", log[i + 3][1])], log[i:i + 4]
    recorded = {e[1]: i for i, e in enumerate(log) if e[0] == "record"}
    waited = {e[1]: i for i, e in enumerate(log) if e[0] == "compute_waits"}
    assert set(waited) == set(recorded)
    for ev, i in waited.items():
        assert i > recorded[ev]
        assert log[i - 1][0] in ("finish_gather", "free") and log[i - 1][1] is True
    rs = [i for i, e in enumerate(log) if e[0] == "rs"]
    assert rs and all(log[i] == ("rs", False) for i in rs)
    ends = [i for i, e in enumerate(log) if e == ("end_backward",)]
    epochs = [i for i, e in enumerate(log) if e == ("new_epoch",)]
    assert epochs
    for i in rs:
        end = min(j for j in ends if j > i)
        assert not [j for j in epochs if i < j < end], "the gather stream waited for compute " \
            "after a reduce-scatter"
    assert log.count(("used_by_compute",)) > 0
    # the instrumented run trains exactly as a plain one
    monkeypatch.undo()
    _, plain = _run(monkeypatch, False, offload_params)
    assert M.bitwise_equal(snap, plain)
