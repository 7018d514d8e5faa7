"""Issue 24, item 1: on a gloo group the send/recv ring takes CPU tensors only.

gloo's TCP transport reads a CUDA tensor's address as a host pointer, so CUDA tensors must go to
torch's own gloo collectives (which stage them through the host). Without a GPU, a tensor on the
`meta` device stands for the CUDA one: anything not on the CPU must skip the ring. The Comm here
has a recording ring and recording torch collectives, so the test sees which path each op took;
CPU tensors through the same Comm are the positive control (they must take the ring). On the old
code (ring for any tensor on a gloo group) the meta tensors reached the ring: this test failed.
The GPU-side check is tests/gpu/test_gpu.py::test_gloo_over_cuda_tensors (2 ranks, real CUDA
tensors, against torch AdamW).
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from zerokern.comm import collectives as C
from zerokern.comm.ring import RingRunner


class _RecordingRing:
    def __init__(self, calls):
        self.calls = calls

    def submit(self, fn, *args, index=None):
        self.calls.append(("ring", getattr(fn, "__name__", str(fn))))
        f = Future()
        f.set_result(None)
        return f

    def drain(self):
        self.calls.append(("drain", None))

    def reduce_scatter(self, out, work):  # submitted, never run by this mock
        raise AssertionError

    all_gather = all_reduce = reduce_scatter


class _CountingChannel:
    """Stands in for abort.AbortChannel: the collective counter torch's path advances."""

    def __init__(self) -> None:
        self.n = 0

    def next_index(self) -> int:
        self.n += 1
        return self.n


def _comm(monkeypatch, calls) -> C.GroupComm:
    comm = C.GroupComm.__new__(C.GroupComm)
    comm.group, comm.world_size, comm.rank, comm.backend = object(), 2, 0, "gloo"
    comm.dim = "shard"
    comm.stats, comm.tag, comm.log = C.CommStats(), "main", None
    comm.ring = _RecordingRing(calls)
    comm.abort = _CountingChannel()  # abort.py's failure channel: counts collectives only

    def torch_op(name):
        def op(*args, **kw):
            calls.append(("torch", name))
        return op

    monkeypatch.setattr(C, "_reduce_scatter", torch_op("reduce_scatter"))
    monkeypatch.setattr(C, "_all_gather", torch_op("all_gather"))
    monkeypatch.setattr(C.dist, "all_reduce", torch_op("all_reduce"))
    return comm


def _run_all(comm, device):
    full = torch.empty(256, device=device)
    comm.reduce_scatter_(torch.empty(128, device=device), full)
    comm.all_gather_(full, torch.empty(128, device=device))
    comm.all_reduce_(torch.empty(2, device=device))


def test_non_cpu_tensors_skip_the_ring(monkeypatch):
    calls = []
    comm = _comm(monkeypatch, calls)
    _run_all(comm, "meta")  # stands for CUDA tensors
    assert [c for c in calls if c[0] == "ring"] == []
    assert [c for c in calls if c[0] == "torch"] == [
        ("torch", "reduce_scatter"), ("torch", "all_gather"), ("torch", "all_reduce")]
    # each direct op first waits for the ring's queue (one order per rank)
    assert [c[0] for c in calls] == ["drain", "torch"] * 3
    # positive control: CPU tensors through the same Comm take the ring
    calls.clear()
    _run_all(comm, "cpu")
    assert [c[0] for c in calls] == ["ring"] * 3
    assert comm.stats.as_dict()["calls"]["reduce_scatter"] == 2  # counted on both paths


def test_ring_refuses_device_tensors():
    ring = RingRunner.__new__(RingRunner)
    with pytest.raises(ValueError, match="CPU tensors only"):
        ring._exchange(torch.empty(4, device="meta"), torch.empty(4, device="meta"))
