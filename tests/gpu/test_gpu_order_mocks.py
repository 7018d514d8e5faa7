"""Issue 24, item 8: two stream-order defects, checked on the CPU with recording stand-ins.

* `_HostFlag` (compact_master.py) copies a device flag to pinned memory and records an event
  to know when it landed. The event must be recorded on the *flag's* device (its current
  stream runs the copy); the old code recorded it on the current device, so with params on
  cuda:1 and cuda:0 current the event could complete before the copy (this test failed: it saw
  the record on device 0). Here torch.cuda.device / Event are stand-ins that note the device
  current at record time, and the flag is a stand-in for a tensor on cuda:1.
* `NvmeOffloader._rollback` re-casts the params of a failed step on the compute stream; H2D
  param copies of that step may still be queued on the copy stream (a failure returns from
  update_piece without end()). The compute stream must wait for the copy stream (end()) before
  the first re-cast copy (old code: no wait; this test failed).
GPU-side: tests/gpu/test_gpu.py::test_compact_master_on_second_device and the NVMe fault tests
under -m gpu.
"""

from __future__ import annotations

import types

import torch

from zerokern.state import compact_master as CM
from zerokern.state.offload_nvme import NvmeOffloader


def test_host_flag_event_is_recorded_on_the_flags_device(monkeypatch):
    cur = [0]
    seen = []

    class _Dev:
        def __init__(self, d):
            self.d = d.index if isinstance(d, torch.device) else d

        def __enter__(self):
            self.prev, cur[0] = cur[0], self.d

        def __exit__(self, *exc):
            cur[0] = self.prev

    class _Event:
        def record(self, stream=None):
            seen.append(("record", cur[0]))

        def query(self):
            return True

    real_empty = torch.empty

    def empty(*a, pin_memory=False, **k):
        return real_empty(*a, **k)

    monkeypatch.setattr(torch.cuda, "device", _Dev)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch, "empty", empty)
    flag = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1),
                                 reshape=lambda *s: torch.tensor([True]))
    hf = CM._HostFlag(flag)
    assert seen == [("record", 1)]
    assert hf.read() is True


def test_nvme_rollback_waits_for_the_copy_stream_first(monkeypatch):
    log = []
    off = NvmeOffloader.__new__(NvmeOffloader)
    off.files, off.steps0 = [], []
    off.dirty = [(0, 0), (0, 1)]

    class _Piece:
        def __init__(self, k):
            self.k = k

        def copy_(self, src):
            log.append(("recast", self.k))

    group = types.SimpleNamespace(
        params_journaled=False, master=torch.zeros(16),
        layout=types.SimpleNamespace(n_buckets=2),
        state_slice=lambda k: slice(8 * k, 8 * k + 8),
        param_out_piece=lambda k: _Piece(k),
        # the buffer's param codec (kernels/param_codec.py) does the re-cast
        codec=types.SimpleNamespace(cast_=lambda out, master: out.copy_(master)),
        publish_piece=lambda comm, k: log.append(("publish", k)))
    off.groups = [group]
    off.comm = types.SimpleNamespace(shard=None)  # the shard group: publish_piece takes it
    off.end = lambda: log.append(("end",))
    off._rollback()
    assert log[0] == ("end",)
    assert [e for e in log if e[0] == "recast"] == [("recast", 0), ("recast", 1)]
